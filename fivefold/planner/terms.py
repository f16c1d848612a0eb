"""The terms of an estimate after compute and traffic, each its seconds (or bytes) and explain rows.

- critical_path: the tp, cp and ep collectives that overlap.py leaves exposed, added to every forward
  and backward, and each one's wait for its slowest rank;
- pipeline: the same simulate() that checks the executor's schedules, on the chunk's costs;
- dp_exposure: the gradient reduction hidden under the backward bucket by bucket (Li et al. 2020,
  "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"), what is left exposed,
  and ZeRO-3's gathers as overlap.zero3_hidden prices them;
- step_sync: the scalar all-reduces every step runs (gradient norm, logged loss);
- rank_memory: the fullest pipeline rank's model state, activations and buffers, and the host
  memory offload takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.simulate import Costs, SimResult, peak_inflight, simulate
from fivefold.planner.comm import AxisTraffic, link
from fivefold.planner.layout import RankShare
from fivefold.planner.lora_step import trainable_share, with_adapter_activations
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.pricing import ChunkWork, Memo, Priced, Row
from fivefold.planner.machine.roofline import attention_forward_seconds
from fivefold.planner.memory import (
    BytesPerParam,
    activation_bytes,
    buffer_bytes,
    expert_imbalance,
    head_tokens,
    loss_bytes,
    loss_chunk_tokens,
    rank_state_bytes,
    with_fp8_weights,
)
from fivefold.planner.offload import SOURCE as OFFLOAD_SOURCE
from fivefold.planner.offload import pinned_host_bytes
from fivefold.planner.options import DEFAULT, PlanOptions
from fivefold.planner.overlap import Hidden, dp_hidden, gather_hidden


@dataclass(frozen=True)
class CriticalPath:
    """tp, cp and ep time added to each forward and each backward of a chunk."""

    units: int  # forwards and backwards of a step (2 per micro-batch and chunk), the collectives spread over
    per_unit_s: float  # seconds added to each, waits for the slowest rank included
    p2p_s: float  # one pipeline send between stages (simulate's comm)
    explain: list[Row] = field(default_factory=list)


def critical_path(work: ChunkWork, d: Derived, hw: Hardware, traffic: dict[str, AxisTraffic], act_bytes: int,
                  busy_s: float, memo: Memo, tp: Hidden, ep: Hidden) -> CriticalPath:
    """What tp and ep leave exposed (`tp`, `ep`: overlap.tp_hidden, ep_hidden) and cp sit on the
    critical path of every F and B of every chunk (spread evenly); ring attention's K/V hops overlap
    the block's attention compute, so only what exceeds it is added.
    Each of those collectives also waits for its slowest rank after busy_s / collectives of compute
    (the pricer's noise_wait; the pipeline's sends are not charged)."""
    cfg = work.cfg
    m, p, t = cfg.model, cfg.parallel, cfg.train
    units = max(1, 2 * d.grad_accum * work.chunks)
    attention_time = attention_forward_seconds(work, hw, memo)
    cp_time = traffic["cp"].time_s
    cp_exposed = max(0.0, cp_time / units - attention_time) if p.cp_method == "ring" else cp_time / units
    on_path = (tp.exposed_s + ep.exposed_s) / units + cp_exposed
    pp_bw, pp_alpha = link(hw, traffic["pp"].inter_node, "send")
    activation = t.micro_batch * d.local_seq_len * m.dim * act_bytes / (p.tp if p.sp else 1)  # one stage's output
    p2p = pp_alpha + activation / pp_bw if p.pp > 1 else 0.0
    degrees = {a: n for a, n in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep if m.moe.n_experts else 1)) if n > 1}
    syncs = sum(traffic[a].calls for a in degrees)
    noise = (sum(traffic[a].calls * hw.pricer.noise_wait(n, busy_s / syncs, memo) for a, n in degrees.items())
             if syncs else 0.0)
    rows = []
    if noise:
        rows.append(("tp/cp/ep noise", f"{syncs} collectives, each after {busy_s / syncs * 1e3:.2f} ms of compute: "
                     f"{noise * 1e3:.2f} ms waiting for the slowest rank", hw.sources.get("noise_curve", "profile")))
    return CriticalPath(units, on_path + noise / units, p2p, rows)


def simulate_scaled(schedule: str, pp: int, m: int, v: int, f: float, b: float, comm: float, memo: Memo,
                    fb: float | None = None) -> SimResult:
    """simulate() with f = 1, scaled: every duration scales with f, so the makespan does too and the
    bubble figures and peak in flight do not. The unit run is kept in `memo` by its shape and cost
    ratios (rounded to 1e-4), so a search simulates each shape once. fb: DualPipe's overlapped F&B
    (simulate.Costs.fb), None to run each pair as F then B."""
    if f <= 0:
        return simulate(build_schedule(schedule, pp, m, v), Costs(f=f, b=b, comm=comm, fb=fb))
    b_over_f, comm_over_f = round(b / f, 4), round(comm / f, 4)
    fb_over_f = None if fb is None else round(fb / f, 4)
    unit = memo.get(("simulate", schedule, pp, m, v, b_over_f, comm_over_f, fb_over_f),
                    lambda: simulate(build_schedule(schedule, pp, m, v),
                                     Costs(f=1.0, b=b_over_f, comm=comm_over_f, fb=fb_over_f)))
    return dataclasses.replace(unit, makespan=unit.makespan * f, busy=[x * f for x in unit.busy],
                               idle=[x * f for x in unit.idle], timeline=[])


def dualpipe_bubble(p: int, f: float, b: float, fb: float | None = None) -> float:
    """DeepSeek's DualPipe bubble, (PP/2 - 1)(F&B + B - 3W) (DeepSeek-V3 technical report, 2024,
    Table 2; the DualPipe repository gives DualPipeV the same), mapped onto fivefold's dualpipe_v:
    PP is the number of stages, 2p on p ranks (rank r holds stages r and 2p-1-r, one chunk each),
    F, B and W are one chunk's forward, full backward and weight-gradient times (W = B/2, as
    simulate's Costs splits a backward by default), and F&B = F + B unless given."""
    return (p - 1) * ((f + b if fb is None else fb) + b - 3 * (b / 2))


@dataclass(frozen=True)
class Pipeline:
    sim: SimResult  # makespan, bubble figures and peak activations in flight per rank
    ideal_s: float  # the same work with no bubble
    explain: list[Row] = field(default_factory=list)


def pipeline(cfg: Config, d: Derived, chunks: int, f_cost: float, b_cost: float, p2p_s: float,
             memo: Memo, paired: bool = False) -> Pipeline:
    """The step's compute as the schedule runs it: `simulate(build_schedule(...), Costs(f, b, comm))`,
    with `paired` (parallel.ep_overlap under dualpipe_v) each F&B pair started together as the
    executor runs it (pipeline/overlap.py), F&B = F + B: what the pair hides is ep_overlap's.
    For dualpipe_v, explain also checks the simulator against DeepSeek's bubble formula."""
    p, M = cfg.parallel, d.grad_accum
    fb = f_cost + b_cost if paired and p.pp_schedule == "dualpipe_v" else None
    sim = simulate_scaled(p.pp_schedule, p.pp, M, p.virtual_stages, f_cost, b_cost, p2p_s, memo, fb=fb)
    rows = [("pipeline", f"{p.pp_schedule} p={p.pp} m={M} v={p.virtual_stages}"
             + (" (F&B pairs started together)" if fb else "") + f": makespan {sim.makespan * 1e3:.2f} ms, "
             f"bubble {sim.bubble_ratio:.1%} of compute, {sim.bubble_fraction:.1%} of time",
             "pipeline/simulate.py on pipeline/schedules.py (1F1B: (p-1)/m and (p-1)/(m+p-1), Narayanan 2021)")]
    if p.pp_schedule == "dualpipe_v":
        paired = simulate_scaled(p.pp_schedule, p.pp, M, 2, f_cost, b_cost, 0.0, memo, fb=f_cost + b_cost)
        rows.append(("dualpipe_v bubble", f"DeepSeek's (PP/2-1)(F&B+B-3W), PP = {2 * p.pp} stages on {p.pp} ranks, "
                     f"F&B = F + B, W = B/2: {dualpipe_bubble(p.pp, f_cost, b_cost) * 1e3:.2f} ms; simulate with "
                     f"each F&B pair started together (parallel.ep_overlap): {max(paired.idle) * 1e3:.2f} ms; as "
                     f"fivefold runs a pair without it (F, then B, the F starting before the B's gradient "
                     f"arrives), without messages: "
                     f"{max(simulate_scaled(p.pp_schedule, p.pp, M, 2, f_cost, b_cost, 0.0, memo).idle) * 1e3:.2f} ms",
                     "DeepSeek-V3 technical report (2024), Table 2; github.com/deepseek-ai/DualPipe README"))
    return Pipeline(sim, M * chunks * (f_cost + b_cost), rows)


def bucket_reduce_s(bucket_bytes: float, n: int, bw: float, alpha: float) -> float:
    """One gradient bucket's ring all-reduce over n ranks: 2(n-1) steps of alpha, 2(n-1)/n of it on the wire."""
    return (2 * (n - 1) * alpha + 2 * (n - 1) / n * bucket_bytes / bw) if n > 1 else 0.0


@dataclass(frozen=True)
class BucketOverlap:
    """A gradient reduction started bucket by bucket during the backward that fills the buckets
    (Li et al. 2020, "PyTorch Distributed", sec. 3.2.3). Seconds."""

    reduce_s: float  # reducing all the gradients of one backward
    bucket_s: float  # reducing one bucket
    window_s: float  # the backward it overlaps (0 without parallel.overlap_comm)

    @property
    def exposed_s(self) -> float:
        """What the backward does not hide: all that exceeds it, and never less than the last
        bucket, which fills only when the backward ends."""
        return max(self.reduce_s - self.window_s, min(self.bucket_s, self.reduce_s))


@dataclass(frozen=True)
class DpExposure:
    exposed_s: float
    overlap: BucketOverlap | None  # DDP, ZeRO-1/2 over more than one rank (per micro-batch for ZeRO-2)
    switch: Hidden  # parallel.overlap_comm's row (overlap.dp_hidden)
    gather: Hidden  # ZeRO-1/2's weight all-gather after the step (overlap.gather_hidden)
    explain: list[Row] = field(default_factory=list)


def dp_exposure(work: ChunkWork, d: Derived, hw: Hardware, dp: AxisTraffic, grad_b: float, param_b: float,
                f_cost: float, b_cost: float, busy_s: float, memo: Memo, zero3: Hidden,
                gather_overlap: bool = False) -> DpExposure:
    """The gradient reduction overlaps the backward of the last micro-batch bucket by bucket, so only
    what exceeds that backward is exposed, and never less than the last bucket; ZeRO's weight
    all-gather after the optimizer step is exposed, or with `gather_overlap` (Megatron-LM's
    --overlap-param-gather) overlaps the next step's first forward bucket by bucket, the first
    bucket exposed (BucketOverlap mirrored); ZeRO-3's gathers and reduce-scatters expose what
    `zero3` (overlap.zero3_hidden) says; the all-reduces over a ZeRO shard's replicas
    (comm.replica_traffic: dp.merged, once a step) overlap the last micro-batch's backward bucket by
    bucket, the last bucket's exposed. Its collectives wait for the slowest replica too: once a step
    (DDP, ZeRO-1), once per micro-batch (ZeRO-2), at every gather and reduce-scatter (ZeRO-3)."""
    p, share, chunks, M = work.cfg.parallel, work.share, work.chunks, d.grad_accum
    bw, alpha = link(hw, dp.inter_node, "all_reduce" if p.zero == 0 else "reduce_scatter", dp.ranks_per_node)
    bucket = min(p.bucket_mb * 1e6, share.params * grad_b)
    n_dp = d.dp * p.cp if p.zero == 0 else d.dp_shard
    t_bucket = bucket_reduce_s(bucket, n_dp, bw, alpha)
    backward_window = chunks * b_cost if p.overlap_comm else 0.0
    gather = share.params * param_b * (n_dp - 1) / n_dp / bw + (n_dp - 1) * alpha if n_dp > 1 else 0.0
    gathered = (BucketOverlap(reduce_s=gather, bucket_s=gather * bucket / (share.params * grad_b),
                              window_s=chunks * f_cost if gather_overlap else 0.0).exposed_s
                if p.zero in (1, 2) and gather else 0.0)
    overlap = None
    per_step = M if p.zero == 2 else 1  # reductions a step: ZeRO-2 reduces every micro-batch
    replicas, replicas_exposed = dp.merged_s, 0.0
    if replicas:  # the shard's all-reduces behind the backward, a bucket's share of the bytes each
        replica_overlap = BucketOverlap(reduce_s=replicas, bucket_s=replicas * bucket / (share.params * grad_b),
                                        window_s=backward_window)
        replicas_exposed = replica_overlap.exposed_s
    if n_dp <= 1:
        exposed = replicas_exposed
    elif p.zero == 3:
        exposed = zero3.exposed_s + replicas_exposed
    else:
        reduce_t = (dp.time_s - replicas - (gather if p.zero else 0.0)) / per_step
        overlap = BucketOverlap(reduce_s=reduce_t, bucket_s=t_bucket, window_s=backward_window)
        exposed = overlap.exposed_s * per_step + gathered + replicas_exposed
    switch = dp_hidden(work.cfg, n_dp, overlap.reduce_s * per_step if overlap else 0.0,
                       overlap.exposed_s * per_step if overlap else 0.0)
    gather_switch = gather_hidden(work.cfg, n_dp, gather_overlap, gather if p.zero in (1, 2) else 0.0, gathered)
    dp_syncs = 0 if n_dp <= 1 else dp.calls if p.zero == 3 else per_step
    dp_noise = dp_syncs * hw.pricer.noise_wait(n_dp, busy_s / dp_syncs, memo) if dp_syncs else 0.0
    exposed += dp_noise
    window = ("the zero3 prefetch row prices it" if p.zero == 3
              else f"backward window {backward_window * 1e3:.2f} ms")
    also = (f" (of it {replicas * 1e3:.2f} ms all-reducing the shards' replicas, {replicas_exposed * 1e3:.2f} ms "
            f"of that exposed)" if replicas else "")
    row = ("exposed dp", f"{dp.time_s * 1e3:.2f} ms of traffic{also}, {window}, "
           f"{dp_syncs} x waiting for the slowest replica {dp_noise * 1e3:.2f} ms: {exposed * 1e3:.2f} ms exposed",
           "bucket overlap (Li et al. 2020, \"PyTorch Distributed\"); noise: calibration/noise.py")
    return DpExposure(exposed, overlap, switch, gather_switch, [row])


def step_sync(cfg: Config, d: Derived, hw: Hardware) -> Priced:
    """Scalar all-reduces every step runs (train/step.py): the gradient norm's partial sums over the
    groups gradients are split over (ZeRO shards, pp, tp, ep: Parallelized.optimizer_step) and
    the logged loss over pp and the gradient group; latency only, nothing to overlap with."""
    m, p = cfg.model, cfg.parallel
    alpha_in = link(hw, False, "all_reduce")[1]
    split_over = [d.dp_shard if p.zero else 1, p.pp, p.tp, p.ep if m.moe.n_experts else 1, p.pp, d.dp * p.cp]
    sync_t = sum(2 * (n - 1) * alpha_in for n in split_over if n > 1)
    rows = []
    if sync_t:
        rows.append(("step sync", f"{sum(1 for n in split_over if n > 1)} scalar all-reduces (gradient norm, logged "
                     f"loss) x 2(n-1) x {alpha_in * 1e6:.0f} us = {sync_t * 1e3:.2f} ms", "train/step.py; alpha-beta"))
    return Priced(sync_t, rows)


@dataclass(frozen=True)
class RankMemory:
    memory: dict[str, float]  # bytes on the fullest rank: params, grads, optimizer, activations, buffers, total
    fits: bool  # on the device, and in the host's memory where offload puts state there (when the host is known)
    explain: list[Row] = field(default_factory=list)
    host_bytes: float = 0.0  # host memory per node that offloaded state takes (its ranks x the fullest rank's)
    per_rank: list[dict[str, float]] = field(default_factory=list)  # every pipeline rank's, like `memory`
    activations: dict[str, float] = field(default_factory=dict)  # the fullest rank's (memory.activation_bytes)
    host_pinned_bytes: float = 0.0  # of host_bytes, those page-locked (offload.pinned_host_bytes), per node


def inflight_blocks(cfg: Config, d: Derived, sizes: list[int], memo: Memo) -> list[int]:
    """Per pipeline rank, the most blocks whose activations it holds at once: simulate's rule (a
    forward's unit is held until its backward completes, after B or W) with each unit weighed by
    its chunk's blocks (`sizes`, per global stage), so uneven chunks count as they are."""
    p = cfg.parallel
    schedule = memo.get(("schedule", p.pp_schedule, p.pp, d.grad_accum, p.virtual_stages),
                        lambda: build_schedule(p.pp_schedule, p.pp, d.grad_accum, p.virtual_stages))
    return [peak_inflight(seq, sizes) for seq in schedule.actions]


def rank_memory(cfg: Config, d: Derived, shares: list[RankShare], held: list[int], b: BytesPerParam,
                act_bytes: int, implementation: bool, hw: Hardware, options: PlanOptions = DEFAULT) -> RankMemory:
    """The fullest pipeline rank: its model state (ZeRO's accounting, or fivefold's own with
    `implementation`; offload and FP8 weights from `options`), activations at the schedule's peak
    in flight (on the busiest expert rank under options.expert_imbalance), and communication buffers.
    Pipeline ranks differ in what they keep: 1F1B keeps p - r micro-batches in flight on rank r
    (Narayanan et al. 2021), so the first stage is usually the fullest, unless the last one's logits
    or a larger stage outweigh it."""
    p, n_shard, grad_ranks = cfg.parallel, d.dp_shard, d.dp * cfg.parallel.cp
    memory: dict[str, float] = {}
    per_rank, host, pinned = [], 0.0, 0.0
    for r, s in enumerate(shares):
        state = rank_state_bytes(cfg, d, s, b, implementation, options)
        acts = activation_bytes(cfg, s, held[r], d.local_seq_len, d.vocab_size, act_bytes, options)
        acts = with_adapter_activations(cfg, s, acts, held[r], cfg.train.micro_batch * d.local_seq_len, act_bytes)
        bufs = buffer_bytes(cfg, trainable_share(cfg, s), b, d.local_seq_len, act_bytes, grad_ranks, d.grad_accum)
        mem = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": acts["total"], "buffers": bufs["total"]}
        mem["total"] = sum(mem.values())
        per_rank.append(mem)
        host = max(host, state["host"])
        pinned = max(pinned, pinned_host_bytes(cfg, d, s, b, options, implementation))
        if not memory or mem["total"] > memory["total"]:
            memory, worst_acts, worst_r = mem, acts, r
    ranks_per_node = min(d.world_size, hw.gpus_per_node)
    host_node = host * ranks_per_node
    fits_host = not host_node or not hw.host_memory_bytes or host_node <= hw.host_memory_bytes
    fits = memory["total"] <= hw.memory_bytes and fits_host
    shown = with_fp8_weights(b, options)
    rows = [("model state", f"{memory['params'] / GB:.2f} + {memory['grads'] / GB:.2f} + "
             f"{memory['optimizer'] / GB:.2f} GB (bytes {shown.param:g},{b.grad:g},{b.optimizer:g}; zero={p.zero} "
             f"over {n_shard})", "ZeRO (Rajbhandari et al. 2020, sec. 3.1: 16 bytes/param with mixed-precision Adam)"),
            ("activations", f"{worst_acts['per_block_microbatch'] / GB:.3f} GB/block/micro-batch x "
             f"{held[worst_r]} blocks in flight + logits "
             f"{worst_acts['logits'] / GB:.3f} GB"
             + (f" + MTP depths {worst_acts['mtp'] / GB:.3f} GB" if worst_acts["mtp"] else ""),
             "activations.py (Korthikanti 2022 method); terms.inflight_blocks")]
    rows += loss_rows(cfg, d, act_bytes)
    if p.pp > 1:
        rows.append(("fullest rank", f"pipeline rank {worst_r} of {p.pp}: {held[worst_r]} blocks in flight "
                     f"(per rank {list(held)})"
                     + (", the logits" if shares[worst_r].last else "") + "; totals per rank "
                     + ", ".join(f"{m['total'] / GB:.1f}" for m in per_rank) + " GB",
                     f"terms.inflight_blocks(build_schedule('{p.pp_schedule}', ...)); layout.rank_shares"))
    rows += _option_rows(cfg, options, worst_acts, host, host_node, ranks_per_node, hw, pinned)
    rows.append(("memory", f"{memory['total'] / GB:.2f} GB of {hw.memory_bytes / GB:.0f} GB: "
                 f"{'fits' if memory['total'] <= hw.memory_bytes else 'does NOT fit'}",
                 hw.sources.get("memory_bytes", "profile")))
    return RankMemory(memory, fits, rows, host_node, per_rank, worst_acts, pinned * ranks_per_node)


def loss_rows(cfg: Config, d: Derived, act_bytes: int) -> list[Row]:
    """The explanation's rows of the last stage's loss (train.loss_chunk) and MTP depths (model.mtp_layers):
    what the logits term is and why."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    tokens = head_tokens(cfg, d.local_seq_len)
    c, v = loss_chunk_tokens(cfg, d.local_seq_len), d.vocab_size // tp
    chunks = -(-tokens // c)
    said = f"loss_chunk {t.loss_chunk}" if t.loss_chunk else "loss_chunk 0 (the whole micro-batch)"
    depths = (f" (the micro-batch's {tokens // (1 + m.mtp_layers)} for the model and as many for each of "
              f"{m.mtp_layers} MTP depth(s))" if m.mtp_layers else "")
    rows: list[Row] = [("loss (logits)", f"{said}: {chunks} chunk(s) of {c} tokens x {v} vocabulary columns; "
                        f"{loss_bytes(cfg, d.local_seq_len, d.vocab_size, act_bytes) / GB:.3f} GB at its peak "
                        f"(8 bytes per logit: fp32 logits + log-sum-exp's temporary, one chunk at a time) of "
                        f"{tokens} tokens per micro-batch on the last stage{depths}; backward makes each chunk's "
                        f"logits again: one more head matmul, 2 x {tokens} x {m.dim} x {v} FLOPs"
                        + ("; tp: one all-gather of (2, c) fp32 per chunk" if tp > 1 else ""),
                        "model/head.py (Wijmans et al. 2024, Cut Cross-Entropy: recompute in backward); "
                        "memory.loss_bytes")]
    if m.mtp_layers:
        rows.append(("MTP depths", f"{m.mtp_layers} on the last stage, each a block (layer {m.n_layers} on), eh_proj "
                     f"(2 x {m.dim} -> {m.dim}), 3 norms and the shared head once more"
                     + (", and a copy of the embedding there (pp > 1)" if cfg.parallel.pp > 1 else ""),
                     "DeepSeek-V3 sec. 2.2; model/transformer.py MTPLayer; memory.mtp_bytes"))
    return rows


def _option_rows(cfg: Config, options: PlanOptions, acts: dict[str, float], host: float, host_node: float,
                 ranks_per_node: int, hw: Hardware, pinned: float = 0.0) -> list[Row]:
    """Explain rows of the memory options of other trainers (memory.py's docstring)."""
    rows = []
    imbalance = expert_imbalance(cfg, options)
    if imbalance != 1.0:
        measured = (f" (measured: a run's logged routing regrouped at ep = {cfg.parallel.ep})"
                    if options.measured_imbalance else "")
        rows.append(("busiest expert rank", f"{imbalance:g} x the mean's tokens{measured}: its routed copies add "
                     f"{acts['routed_extra'] / GB:.3f} GB per block and micro-batch, its all-to-alls carry "
                     f"{imbalance:g} x the balanced bytes", "memory.activation_bytes; comm.activation_traffic"
                     + ("; planner/routing.py" if measured else "")))
    if options.fp8 != "none":
        rows.append(("fp8", f"{options.fp8}: the linear layers' inputs kept for backward in 1 byte"
                     + ("; the blocks' weights in 1 byte at rest and on ZeRO's weight gathers, the fp32 master in "
                        "the optimizer state" if options.fp8 == "weights" else ""),
                     "Transformer Engine's FP8 linear layers; DeepSeek-V3 sec. 3.3.3; torchtitan docs/float8.md"))
    if options.offload != "none":
        verdict = "fits" if host_node <= hw.host_memory_bytes else "does NOT fit"
        capacity = f" of {hw.host_memory_bytes / GB:.0f} GB: {verdict}" if hw.host_memory_bytes else " (unknown host)"
        rows.append(("host memory", f"{ranks_per_node} ranks x {host / GB:.2f} GB (optimizer state + fp32 gradient"
                     + (" + parameter" if options.offload == "params" else "") + f" shards) = {host_node / GB:.1f} "
                     f"GB per node{capacity}; of it pinned {ranks_per_node} x {pinned / GB:.2f} GB (what crosses the "
                     "host link, page-locked: never swapped)",
                     f"{OFFLOAD_SOURCE}; host: {hw.sources.get('host_memory_bytes', '-')}"))
    return rows
