"""What each overlap switch of the layout (options.py) hides, and what it leaves on the critical path.

Each switch defaults to what fivefold's runtime does by default; `--explain` shows its value,
whether fivefold runs it in this layout, the traffic it governs and how much of it stays exposed
(Hidden.row):

- tp_overlap = parallel.tp_overlap (off: parallel/tensor.py's collectives block the compute that
  needs them; on, with sp: parallel/comm/collective_matmul.py). On: each tensor-parallel region's
  collective is decomposed with the region's matmuls into tp pieces, each piece's communication
  running under the next piece's matmul (Wang et al. 2022, "Overlap Communication with Dependent
  Computation via Decomposition in Large Deep Learning Models"; Megatron-LM / Transformer Engine's
  userbuffers comm-GEMM overlap), so one piece always stays exposed: per region and pass,
  max(comm / tp, comm - (tp-1)/tp x matmul) (decomposed_exposure). The embedding's forward
  all-reduce (a lookup: no matmul), the loss's three scalar all-reduces and sp's once-a-step MoE
  gradient sum have nothing to hide under and stay exposed.
- zero3_prefetch (fivefold: on, parallel/data/fsdp.py issues the next unit's all-gather as the current
  unit starts). Exposure is modelled unit by unit (prefetch_pass): per micro-batch and pass, the
  first unit's gather is exposed and each later one exposes what it exceeds the previous unit's
  compute; the backward's reduce-scatters share that one communication stream. Kept gathered
  (Derived.reshard_after_forward false, the default with pp > 1) the units are gathered in the
  first micro-batch's forward only and reduce-scattered in the last one's backward. Off: every
  gather waits on its own, and a reduce-scatter queued before it on the same stream with it: all exposed.
- ep_overlap = parallel.ep_overlap (off: parallel/expert.py's all-to-alls block; on, with
  dualpipe_v: the pipeline executor runs the pairs). On: DualPipe's pairing of a
  forward with another micro-batch's backward (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
  sec. 3.2.1): each pass's dispatch and combine run under the other pass's compute of the MoE
  blocks, exposed = max(0, a2a - that compute); the step's first forward and last backward have
  no partner and stay exposed.
- dp_overlap = parallel.overlap_comm (a config field, so whatever it says is what fivefold runs):
  gradient buckets reduce during the backward (terms.BucketOverlap; Li et al. 2020).
- param_gather_overlap (fivefold: off, parallel/data/zero.py gathers ZeRO-1/2's updated weights
  after the optimizer step, all exposed). On: Megatron-LM's distributed optimizer with
  --overlap-param-gather, each bucket's gather waited for by the next step's forward when it
  reaches the bucket, so only what exceeds the first micro-batch's forward is exposed, and never
  less than the first bucket (terms.dp_exposure).

What a switch hides is not free: a collective kernel runs on SMs the matmuls then lack (DeepSeek-AI
2024, sec. 3.2.2 and 3.5.1: 20 of the H800's 132 SMs run its all-to-alls and "limit computational
throughput"). `contention` charges the compute that runs beside each hidden second that share
of it (Hardware.comm_sms / sm_count).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.counts import (
    ModelCounts,
    attention_params,
    block_forward_flops,
    block_rank_params,
    head_forward_flops,
)
from fivefold.planner.activations import FP8_BYTES
from fivefold.planner.comm import AxisTraffic, time_of
from fivefold.planner.compute import block_keys
from fivefold.planner.lora import block_adapter_elements
from fivefold.planner.machine.datasheet import Hardware
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, Priced, Row

SWITCHES = ("tp_overlap", "zero3_prefetch", "ep_overlap", "dp_overlap", "param_gather_overlap")
# what fivefold's runtime does, in words, for each switch's row
RUNTIME = {"tp_overlap": "runs parallel.tp_overlap as set", "zero3_prefetch": "prefetches the next unit",
           "ep_overlap": "runs parallel.ep_overlap as set", "dp_overlap": "runs parallel.overlap_comm as set",
           "param_gather_overlap": "gathers ZeRO-1/2's weights after the step"}
SOURCES = {
    "tp_overlap": "Wang et al. 2022 (decomposition); Megatron-LM / Transformer Engine userbuffers comm-GEMM overlap",
    "zero3_prefetch": "parallel/data/fsdp.py (one unit ahead); Zhao et al. 2023, \"PyTorch FSDP\" (prefetch)",
    "ep_overlap": "DeepSeek-V3 Technical Report (DeepSeek-AI 2024), sec. 3.2.1: DualPipe's overlapped chunk pairs",
    "dp_overlap": "bucket overlap (Li et al. 2020, \"PyTorch Distributed\", sec. 3.2.3); parallel/data/buckets.py",
    "param_gather_overlap": "Megatron-LM distributed optimizer, --overlap-param-gather; parallel/data/zero.py",
}


@dataclass(frozen=True)
class Hidden:
    """One overlap switch in one estimate: the traffic it governs and what stays exposed (seconds per step)."""

    switch: str  # one of SWITCHES
    on: bool
    runtime: bool  # fivefold's runtime runs this value in this layout
    traffic_s: float
    exposed_s: float
    note: str = ""  # what the traffic is, or why there is none

    @property
    def hidden_s(self) -> float:
        return self.traffic_s - self.exposed_s

    @property
    def row(self) -> Row:
        name = self.switch.replace("_", " ")
        runtime = (f"fivefold: {RUNTIME[self.switch]}" if self.runtime
                   else f"not fivefold's: it {RUNTIME[self.switch]}"
                   if self.switch in ("zero3_prefetch", "param_gather_overlap")
                   else "not runnable in this layout: see runnable")
        head = f"{'on' if self.on else 'off'} ({runtime}): "
        if not self.traffic_s:
            return (name, head + (self.note or "no traffic"), SOURCES[self.switch])
        what = f"{self.traffic_s * 1e3:.2f} ms of {self.note}"
        if self.exposed_s >= self.traffic_s * (1 - 1e-12):
            told = f"{what}, all exposed"
        else:
            told = f"{what}, {self.hidden_s * 1e3:.2f} ms hidden, {self.exposed_s * 1e3:.2f} ms exposed"
        return (name, head + told, SOURCES[self.switch])


def decomposed_exposure(comm_s: float, matmul_s: float, pieces: int) -> float:
    """A collective and the matmul it feeds (or is fed by) cut into `pieces`: each piece's
    communication runs under the next piece's matmul, the last (or first) one alone (Wang et al.
    2022, sec. 3; the pipelined comm-GEMM overlap of Transformer Engine): of a timeline
    mm_1, (mm_2 || c_1), ..., (mm_n || c_(n-1)), c_n what is not matmul is
    max(comm / n, comm - (n-1)/n x matmul)."""
    if comm_s <= 0:
        return 0.0
    n = max(pieces, 1)
    return max(comm_s / n, comm_s - (n - 1) / n * matmul_s)


def _one(hw: Hardware, inter_node: bool, op: str, nbytes: float, n: int, ranks_per_node: int = 1) -> float:
    """Seconds of one collective, priced as comm.py prices an axis (alpha per step + bytes / bandwidth)."""
    t = AxisTraffic(inter_node=inter_node, ranks_per_node=ranks_per_node)
    t.add(op, nbytes, n)
    return time_of(t, hw)


def tp_hidden(work: ChunkWork, d: Derived, counts: ModelCounts, chunk: ChunkPrice, tp: AxisTraffic, hw: Hardware,
              act_bytes: int, on: bool, runs: bool = True) -> Hidden:
    """The tp traffic of a step and what stays exposed (module docstring). Per micro-batch, each
    attention region (every block) and MLP region (dense blocks) has one collective of the
    (b, s/cp, d) activation in forward and one in backward (+1 there with full recompute), and the
    head one in backward (comm.activation_traffic); a region's matmul time is the rank's forward
    (backward) seconds times the region's share of the forward FLOPs."""
    cfg, p = work.cfg, work.cfg.parallel
    runtime, note = runs or not on, "tp traffic"
    if p.tp <= 1 or not tp.time_s:
        return Hidden("tp_overlap", on, runtime, 0.0, 0.0, "no tp traffic (tp = 1)")
    if not on or work.forward_flops <= 0:
        return Hidden("tp_overlap", on, runtime, tp.time_s, tp.time_s, note)
    m, t, M, n = cfg.model, cfg.train, d.grad_accum, p.tp
    tokens = t.micro_batch * d.local_seq_len
    # one region's collective
    c1 = _one(hw, tp.inter_node, "all_reduce", tokens * m.dim * act_bytes, n, tp.ranks_per_node)
    per_flop_f = work.chunks * chunk.forward_s / work.forward_flops  # the rank's seconds per forward FLOP
    per_flop_b = work.chunks * chunk.backward_s / work.forward_flops
    backward_calls = 2 if t.recompute == "full" else 1  # the recomputed forward's collective runs in backward
    attention_flops = 2 * attention_params(m)[0] // n * tokens  # its tp-split projections (not the core)
    mlp_flops = 2 * 3 * m.dim * m.ffn_dim // n * tokens
    blocks = len(work.share.blocks)
    regions = [(blocks, attention_flops), (blocks - work.moe_blocks, mlp_flops)]
    exposed = calls = 0.0
    for count, flops in regions:
        exposed += count * (decomposed_exposure(c1, flops * per_flop_f, n)
                            + decomposed_exposure(backward_calls * c1, flops * per_flop_b, n))
        calls += count * (1 + backward_calls)
    if work.share.last:  # the vocabulary-parallel head: its input gradient's collective, in backward
        exposed += decomposed_exposure(c1, head_forward_flops(counts, n) * tokens * per_flop_b, n)
        calls += 1
    rest = max(0.0, tp.time_s - M * calls * c1)  # embedding, loss, sp's MoE gradient sum: nothing to hide under
    return Hidden("tp_overlap", on, runtime, tp.time_s, min(tp.time_s, rest + M * exposed),
                  note + " (each region's collective and matmuls cut into tp pieces, one exposed)")


def _moe_share(work: ChunkWork, counts: ModelCounts) -> float:
    """The MoE blocks' share of the rank's forward FLOPs."""
    m, t, p = work.cfg.model, work.cfg.train, work.cfg.parallel
    tokens = t.micro_batch * work.local_seq
    keys = block_keys(work.cfg, work.options)
    moe = sum(block_forward_flops(m, counts.block(b), t.seq_len, p.tp, p.sp, keys[b])
              for b in work.share.blocks if counts.block(b).experts)
    return min(1.0, moe * tokens / work.forward_flops) if work.forward_flops else 0.0


def ep_hidden(work: ChunkWork, d: Derived, counts: ModelCounts, chunk: ChunkPrice, ep: AxisTraffic,
              on: bool, runs: bool = True) -> Hidden:
    """The expert all-to-alls of a step and what stays exposed (module docstring). Per micro-batch
    and chunk, a forward's dispatch and combine (1 of the fwd_passes + 1 passes comm.py counts)
    run under another micro-batch's backward of the MoE blocks, the backward's (recompute's
    included) under another's forward; of the M x chunks passes of each kind one has no partner."""
    runtime, note = runs or not on, "expert all-to-alls"
    if not ep.time_s:
        return Hidden("ep_overlap", on, runtime, 0.0, 0.0, "no expert all-to-alls (ep = 1 or no MoE block here)")
    if not on:
        return Hidden("ep_overlap", on, runtime, ep.time_s, ep.time_s, note)
    passes = d.grad_accum * work.chunks  # (micro-batch, chunk) pairs of the step
    fwd_passes = 2 if work.cfg.train.recompute == "full" else 1
    a2a = ep.time_s / passes
    a2a_f = a2a / (fwd_passes + 1)
    a2a_b = a2a - a2a_f
    share = _moe_share(work, counts)
    f, b = chunk.forward_s * share, chunk.backward_s * share  # the partner's compute of the MoE blocks
    exposed = a2a + (passes - 1) * (max(0.0, a2a_f - b) + max(0.0, a2a_b - f))
    return Hidden("ep_overlap", on, runtime, ep.time_s, min(ep.time_s, exposed),
                  note + " (each pass's under another micro-batch's opposite pass, DualPipe pairs)")


def prefetch_pass(gathers: list[float], computes: list[float], reduces: list[float] | None = None) -> float:
    """Exposed seconds of one pass over units run in this order, as parallel/data/fsdp.py runs them: a
    unit's gather is issued when the previous unit starts computing (the first one's when the pass
    starts) and waited for before the unit computes; a unit's reduce-scatter (backward) is issued
    when it has computed; one communication stream runs them first in, first out; with reduces the
    pass ends when the last one is done (the step waits for its gradients). With gathers only this
    is g_1 + sum_i max(0, g_i - c_(i-1)): the link is idle whenever a gather is waited for."""
    clock = link = gathers[0] if gathers else 0.0
    ready = gathers[0] if gathers else 0.0
    for i, compute in enumerate(computes):
        clock = max(clock, ready)
        if i + 1 < len(gathers):  # prefetch the next unit
            link = max(link, clock) + gathers[i + 1]
            ready = link
        clock += compute
        if reduces:
            link = max(link, clock) + reduces[i]
    end = max(clock, link) if reduces else clock
    return end - sum(computes)


@dataclass(frozen=True)
class Zero3Unit:
    """One ZeRO-3 unit of the busiest rank (the embedding, a block, the head: layout.rank_shares)."""

    flops: float  # forward FLOPs per token on this rank: its share of a pass
    gather_s: float  # all-gather of its weights
    reduce_s: float  # reduce-scatter of its gradients
    kept_for_backward: bool = False  # resharding gathers it for the forward only (RankShare.kept_unit)


def zero3_units(cfg: Config, d: Derived, counts: ModelCounts, work: ChunkWork, hw: Hardware, dp: AxisTraffic,
                grad_b: float, param_b: float) -> list[Zero3Unit]:
    """The rank's units in forward order, each gathered and reduce-scattered on its own (one bucket
    per unit and group: dense weights over dp_shard, routed experts (ep > 1) over expert_dp, as
    comm.step_traffic sends them, a block's weights in FP8 under fp8 = "weights", its routed experts
    too with fp8_experts), on the link `dp` (the step's dp traffic) says. Under LoRA a unit gathers its
    frozen base with its adapters and reduce-scatters the adapters' gradients alone, and a frozen
    embedding's unit is gathered for the forward only (planner/lora.py dp_gathers)."""
    m, p, t, share, options = cfg.model, cfg.parallel, cfg.train, work.share, work.options
    n_dense, n_expert = d.dp_shard, d.dp * p.cp // p.ep
    block_b = FP8_BYTES if options.fp8 == "weights" else param_b
    expert_b = block_b if options.fp8_experts else param_b
    lora = cfg.lora.rank > 0  # whole units gathered, the adapters alone reduced (planner/lora.py)
    timed: dict[tuple[int, int, bool, int], tuple[float, float]] = {}  # blocks repeat: price each size once

    def unit(flops: float, params: int, experts: int, kept: bool = False, block: bool = True,
             adapters: int = 0) -> Zero3Unit:
        experts = experts if p.ep > 1 else 0
        key = (params, experts, block, adapters)
        if key not in timed:
            dense = params - experts
            gathered = (dense * (block_b if block else param_b) + adapters * param_b, experts * expert_b)
            reduced = (adapters * grad_b, 0.0) if lora else (dense * grad_b, experts * grad_b)
            timed[key] = tuple(_one(hw, dp.inter_node, op, dense_bytes, n_dense, dp.ranks_per_node)
                               + _one(hw, dp.inter_node, op, expert_bytes, n_expert, dp.ranks_per_node)
                               for op, (dense_bytes, expert_bytes) in (("all_gather", gathered),
                                                                       ("reduce_scatter", reduced)))
        return Zero3Unit(flops, *timed[key], kept_for_backward=kept)

    kept = share.kept_unit > 0
    tied_here = counts.head == 0 and share.first  # the tied embedding shares the head's unit
    # a frozen embedding (LoRA) has no backward unless its unit holds the tied head: gathered for the forward only
    frozen = lora and not (counts.head == 0 and share.last)
    out = [unit(0.0, counts.embedding // p.tp, 0, kept and tied_here or frozen, block=False)] if share.first else []
    keys = block_keys(cfg, work.options)
    mtp_flops = mtp_params = mtp_experts = mtp_adapters = 0  # the MTP depths join the head's unit (fsdp.py)
    for blk in share.blocks:
        bp = counts.block(blk)
        params, flops = block_rank_params(bp, p.tp, p.ep), block_forward_flops(m, bp, t.seq_len, p.tp, p.sp, keys[blk])
        if blk >= m.n_layers:
            mtp_flops, mtp_params, mtp_experts = (mtp_flops + flops, mtp_params + params + counts.mtp_extra,
                                                  mtp_experts + bp.experts // p.ep)
            mtp_adapters += block_adapter_elements(cfg, blk)
            continue
        out.append(unit(flops, params, bp.experts // p.ep, adapters=block_adapter_elements(cfg, blk)))
    if share.last:
        tied_copy = counts.embedding if counts.head == 0 and not share.first else 0
        if counts.mtp and counts.head and not share.first:  # the MTP depths' copy of the embedding: its own unit
            out.append(unit(0.0, counts.embedding // p.tp, 0, lora, block=False))
        head = head_forward_flops(counts, p.tp) * (1 + len(counts.mtp))
        out.append(unit(head + mtp_flops, (counts.head + tied_copy) // p.tp + counts.final_norm + mtp_params,
                        mtp_experts, kept, block=False, adapters=mtp_adapters))
    return out


def zero3_hidden(cfg: Config, d: Derived, units: list[Zero3Unit], forward_s: float, backward_s: float,
                 on: bool) -> Hidden:
    """ZeRO-3's gathers and reduce-scatters of a step and what stays exposed (module docstring).
    forward_s, backward_s: the rank's seconds of one micro-batch's forward and backward (all its
    chunks), split over the units by their forward FLOPs."""
    p, M, reshard = cfg.parallel, d.grad_accum, d.reshard_after_forward
    runtime = on
    gathers = [u.gather_s for u in units]
    regathers = [0.0 if u.kept_for_backward else u.gather_s for u in units]  # resharding's, for the backward
    reduces = [u.reduce_s for u in units]
    per_pass = sum(gathers) + (sum(regathers) if reshard else 0.0) + sum(reduces)
    traffic = per_pass * (M if reshard else 1)
    note = (f"ZeRO-3 gathers and reduce-scatters ({len(units)} units, "
            + (f"gathered for every forward and backward of {M} micro-batches)" if reshard
               else "gathered once a step: kept gathered)"))
    if p.zero != 3 or not traffic:
        return Hidden("zero3_prefetch", on, runtime, 0.0, 0.0, f"no ZeRO-3 traffic (zero = {p.zero}, "
                      f"dp_shard = {d.dp_shard})")
    if not on:
        return Hidden("zero3_prefetch", on, runtime, traffic, traffic, note)
    flops = sum(u.flops for u in units) or 1.0
    forward = [forward_s * u.flops / flops for u in units]
    backward = [backward_s * u.flops / flops for u in reversed(units)]
    overlap_rs = p.overlap_comm  # without it the buckets reduce after the backward (parallel/data/buckets.py)
    after = 0.0 if overlap_rs else sum(reduces)
    rs = list(reversed(reduces)) if overlap_rs else None
    if reshard:
        exposed = M * (prefetch_pass(gathers, forward) + prefetch_pass(regathers[::-1], backward, rs) + after)
    else:  # gathered in the first micro-batch's forward, reduced in the last one's backward
        exposed = prefetch_pass(gathers, forward) + prefetch_pass([0.0] * len(units), backward, rs) + after
    return Hidden("zero3_prefetch", on, runtime, traffic, min(traffic, exposed), note)


def dp_hidden(cfg: Config, n_dp: int, reduce_s: float, exposed_s: float) -> Hidden:
    """parallel.overlap_comm's row: the gradient reduction (DDP's all-reduce, ZeRO-1/2's
    reduce-scatters) and what the backward leaves exposed; ZeRO-3's reduce-scatters are priced with
    its gathers (zero3_hidden), on the same stream."""
    p, on = cfg.parallel, cfg.parallel.overlap_comm
    if n_dp <= 1:
        return Hidden("dp_overlap", on, True, 0.0, 0.0, "no gradient reduction (one data-parallel rank)")
    if p.zero == 3:
        return Hidden("dp_overlap", on, True, 0.0, 0.0, "ZeRO-3's reduce-scatters "
                      + ("run unit by unit during the backward" if on else "start after the backward")
                      + ", priced in the zero3 prefetch row")
    return Hidden("dp_overlap", on, True, reduce_s, exposed_s,
                  "gradient reduction" + (" (ZeRO's weight all-gather after the step is exposed besides)"
                                          if p.zero else ""))


def gather_hidden(cfg: Config, n_dp: int, on: bool, gather_s: float, exposed_s: float) -> Hidden:
    """param_gather_overlap's row: ZeRO-1/2's weight all-gather after the step and what stays exposed
    (module docstring); fivefold runs it off."""
    if n_dp <= 1 or cfg.parallel.zero not in (1, 2):
        return Hidden("param_gather_overlap", on, True, 0.0, 0.0,
                      "no weight all-gather after the step (DDP, ZeRO-3 or one data-parallel rank)")
    return Hidden("param_gather_overlap", on, not on, gather_s, exposed_s, "ZeRO's weight all-gather after the step")


def contention(overlaps: dict[str, Hidden], hw: Hardware) -> Priced:
    """The compute slowed by the collectives it hides (module docstring): while a hidden collective
    runs, its comm_sms of the GPU's sm_count SMs are not computing, so the step is longer by that
    share of every hidden second (the compute beside it being at least as long, as hiding needs)."""
    hidden = {h.switch: h.hidden_s for h in overlaps.values() if h.hidden_s > 0}
    if not hw.comm_sms or not hw.sm_count or not hidden:
        return Priced(0.0)
    share = hw.comm_sms / hw.sm_count
    seconds = share * sum(hidden.values())
    parts = " + ".join(f"{t * 1e3:.2f} ({k.replace('_', ' ')})" for k, t in hidden.items())
    return Priced(seconds, [("contention", f"{hw.comm_sms} of {hw.sm_count} SMs run the hidden collectives: "
                             f"{share:.3f} x ({parts} ms hidden) = {seconds * 1e3:.2f} ms",
                             hw.sources.get("comm_sms", "DeepSeek-V3 report, sec. 3.2.2 and 3.5.1"))])
