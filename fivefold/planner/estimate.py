"""Estimate one layout: memory per rank, bytes per axis, pipeline bubble, step time, MFU.

`estimate(cfg, world_size, hw)` takes the same `Config` that `fivefold train` runs (a layout is a
config) and returns an `Estimate` whose `explain` lists every number with its arithmetic and the
source of its formula. How the step time is put together:

1. compute: training FLOPs of one micro-batch on one pipeline chunk (counts.flops_per_token:
   6 x active matmul parameters + causal attention), split by tp (experts are not: they are
   replicated over tp), at peak x compute_efficiency; backward = 2 x forward; full recompute adds
   a forward, selective the attention core's forward (Korthikanti et al. 2022). With a profile
   from `fivefold calibrate` (a CPU) the model's own ops are priced one by one instead
   (opcount.py; parts the profile timed whole, calibrate_layers.py, at their measured times), and
   the Python around them from counts of the layout (overheads.py: module calls, autograd
   Functions, gradient hooks, model-state sampling and gradient accumulation per micro-batch; the
   send thread and DDP's bucket packing per step).
2. tp, cp and ep collectives sit on the critical path of each forward and backward (they are
   added to its duration); ring attention's K/V hops overlap the block's attention compute, so
   only what exceeds it is added.
3. the pipeline: `simulate(build_schedule(...), Costs(f, b, comm))`, the very simulator that
   checks the executor's schedules, gives the makespan and both bubble figures.
4. dp: the gradient reduction overlaps the backward of the last micro-batch bucket by bucket
   (Li et al. 2020, "PyTorch Distributed"; course page 003_*), so only what exceeds that backward
   is exposed, and never less than the last bucket; ZeRO's weight all-gather after the optimizer
   step is exposed; ZeRO-3's per-unit gathers overlap the compute of each micro-batch.
   With a measured noise curve (calibrate_sync.py), every collective also waits for its slowest
   rank, E[max of n normals] x sigma(compute since the last one): on tp/cp/ep's path and in dp's
   exposed time (the pipeline's sends are not charged).
5. the optimizer step is memory-bound: it reads and writes about b_p + b_g + 2 b_o bytes per
   parameter of its shard at the HBM bandwidth (a calibrated profile: fivefold's own step, timed).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from fivefold.config import Config
from fivefold.parallel.schedules import build_schedule
from fivefold.parallel.simulate import Costs, SimResult, simulate
from fivefold.planner.comm import AXES, LOSS_ALL_REDUCES, AxisTraffic, activation_traffic, dp_traffic, link, time_of
from fivefold.planner.counts import flops_per_token, head_dim, model_counts
from fivefold.planner.hardware import GB, Hardware
from fivefold.planner.layout import axis_spans_nodes, rank_shares
from fivefold.planner.memory import (BytesPerParam, activation_bytes, buffer_bytes, fivefold_state_bytes,
                                     model_state_bytes)
from fivefold.planner.opcount import noise_wait
from fivefold.planner.overheads import HostCosts, host_costs
from fivefold.validate import derive

@functools.lru_cache(maxsize=4096)
def _simulate_unit(schedule: str, pp: int, m: int, v: int, b_over_f: float, comm_over_f: float) -> SimResult:
    return simulate(build_schedule(schedule, pp, m, v), Costs(f=1.0, b=b_over_f, comm=comm_over_f))


def _simulate(schedule: str, pp: int, m: int, v: int, f: float, b: float, comm: float) -> SimResult:
    """simulate() with f = 1, scaled: every duration scales with f, so the makespan does too and
    the bubble figures and peak in flight do not. Cached, so a search simulates each shape once."""
    if f <= 0:
        return simulate(build_schedule(schedule, pp, m, v), Costs(f=f, b=b, comm=comm))
    unit = _simulate_unit(schedule, pp, m, v, round(b / f, 4), round(comm / f, 4))
    return dataclasses.replace(unit, makespan=unit.makespan * f, busy=[x * f for x in unit.busy],
                               idle=[x * f for x in unit.idle], timeline=[])


def _op_priced(cfg: Config, hw: Hardware, share, vocab: int, local_seq: int,
               chunks: int) -> tuple[float, float, int, dict] | None:
    """(forward s, backward s, parameter tensors, parts) of one micro-batch's chunk on the rank
    holding `share`: each part (block, embedding, head) timed whole if the profile has it
    (hw.layer_times, calibrate_layers.py), else priced op by op (opcount.py); None when the profile
    has no per-op costs (a catalog GPU) or a block cannot be traced (then FLOPs alone price it)."""
    if not hw.op_overhead_s:
        return None
    from fivefold.planner.opcount import OpTally, Part, end_parts, part_tally, tally_time

    m, p, t = cfg.model, cfg.parallel, cfg.train
    parts = [Part("block", m, blk, 0, p.tp, t.micro_batch, local_seq) for blk in share.blocks]
    parts += end_parts(m, vocab, p.tp, t.micro_batch, local_seq, share.first, share.last)
    priced_f, priced_b, all_f, all_b = OpTally(), OpTally(), OpTally(), OpTally()
    timed_f = timed_b = 0.0
    timed = 0
    try:
        for part in parts:
            f, b = part_tally(part)
            all_f, all_b = all_f + f, all_b + b
            measured = hw.layer_time(part.key)
            if measured:
                timed_f, timed_b, timed = timed_f + measured[0], timed_b + measured[1], timed + 1
            else:
                priced_f, priced_b = priced_f + f, priced_b + b
    except ValueError:
        return None
    ft, bt = tally_time(priced_f, hw), tally_time(priced_b, hw)
    forward = ft["total"] + timed_f
    recompute = forward if t.recompute == "full" else 0.0
    both = all_f + all_b
    n_params = all_f.params - (1 if share.first and share.last and m.tie_embeddings else 0)
    out = {k: (ft[k] + bt[k]) / chunks for k in ft} | {
        "timed": (timed_f + timed_b) / chunks, "timed_parts": timed, "parts": len(parts),
        "ops": both.ops // chunks, "views": both.views // chunks, "flops": both.flops / chunks,
        # the Python around the ops of timed parts is in their times already (overheads.py adds the rest)
        "modules": priced_f.modules / chunks, "functions": priced_f.functions / chunks}
    return forward / chunks, (bt["total"] + timed_b + recompute) / chunks, n_params, out


MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers", "total")


def bucket_reduce_s(bucket_bytes: float, n: int, bw: float, alpha: float) -> float:
    """One gradient bucket's ring all-reduce over n ranks: 2(n-1) steps of alpha, 2(n-1)/n of it on the wire."""
    return (2 * (n - 1) * alpha + 2 * (n - 1) / n * bucket_bytes / bw) if n > 1 else 0.0


@dataclass(frozen=True)
class BucketOverlap:
    """A gradient reduction started bucket by bucket during the backward that fills the buckets
    (Li et al. 2020, "PyTorch Distributed"; course page 003_*). Seconds."""

    reduce_s: float  # reducing all the gradients of one backward
    bucket_s: float  # reducing one bucket
    window_s: float  # the backward it overlaps (0 without parallel.overlap_comm)

    @property
    def exposed_s(self) -> float:
        """What the backward does not hide: all that exceeds it, and never less than the last
        bucket, which fills only when the backward ends."""
        return max(self.reduce_s - self.window_s, min(self.bucket_s, self.reduce_s))


@dataclass
class Estimate:
    world_size: int
    memory: dict[str, float]  # bytes on the fullest rank, MEMORY_KEYS
    comm: dict[str, AxisTraffic]  # per axis, on the busiest rank
    bubble_ratio: float  # idle / ideal compute (simulate)
    bubble_fraction: float  # idle / total
    exposed_dp_s: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool
    time_split: dict[str, float]  # seconds: compute, tp/cp/ep exposed, bubble, dp exposed, optimizer, sync, host
    explain: list[tuple[str, str, str]] = field(default_factory=list)  # (what, arithmetic, source)
    dp_overlap: BucketOverlap | None = None  # DDP, ZeRO-1/2 over more than one rank (per micro-batch for ZeRO-2)

    def to_json(self) -> dict[str, Any]:
        """The `--json` object (keys fixed by the planner issue)."""
        return {
            "memory_gb": {k: self.memory[k] / GB for k in MEMORY_KEYS},
            "comm_bytes_per_step": {a: self.comm[a].bytes for a in AXES},
            "bubble": {"ratio": self.bubble_ratio, "fraction": self.bubble_fraction},
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "fits": self.fits,
        }


def estimate(cfg: Config, world_size: int, hw: Hardware, b: BytesPerParam | None = None, act_bytes: int = 2,
             implementation: bool = False) -> Estimate:
    """Predict one layout. `cfg` must pass validate(cfg, world_size).

    b: bytes per parameter (default 2,2,12); act_bytes: bytes per activation element (2 = bf16).
    implementation=True counts model state as fivefold's own code holds it (fp32 weights and
    gradients, memory.fivefold_state_bytes) and gradients travel in parallel.reduce_dtype: the
    self-check against real runs; False is the textbook accounting with `b`.
    """
    b = b or BytesPerParam()
    m, p, t = cfg.model, cfg.parallel, cfg.train
    d = derive(cfg, world_size)
    counts = model_counts(m, d.vocab_size)
    shares = rank_shares(cfg, counts)
    M, local_seq, n_shard = d.grad_accum, d.local_seq_len, d.dp_shard
    grad_ranks = d.dp * p.cp
    ex: list[tuple[str, str, str]] = []
    eff_flops = hw.peak_flops * hw.compute_efficiency
    ex.append(("params", f"{counts.total:,} ({counts.total / 1e9:.2f}B), experts {counts.expert_total:,}",
               "counts.model_counts: model.py layer by layer (checked on the meta device)"))

    # ---- compute per chunk (per micro-batch), on the busiest pipeline rank ---------------------
    tokens = t.micro_batch * local_seq  # tokens of one micro-batch on one rank
    attn_fwd_per_block = 2 * t.seq_len * m.n_heads * head_dim(m) / p.tp  # causal: half of 4 s H hd
    fwd_flops, moe_blocks_on = [], []
    for s in shares:
        flops = 0.0
        for blk in s.blocks:
            bp = counts.blocks[blk]
            # tp cuts attention and dense MLPs; routed/shared experts and the router run whole
            flops += 2 * bp.tp_split / p.tp + 2 * (bp.active_matmul - bp.tp_split) + attn_fwd_per_block
        if s.last:
            flops += 2 * counts.embedding / p.tp  # the head's V x d matmul
        fwd_flops.append(flops * tokens)
        moe_blocks_on.append(sum(1 for blk in s.blocks if counts.blocks[blk].experts))
    worst = max(range(len(shares)), key=lambda r: fwd_flops[r])
    share = shares[worst]
    chunks = p.virtual_stages if p.pp_schedule not in ("zb_v", "dualpipe_v") else 2
    f_compute = fwd_flops[worst] / chunks / eff_flops
    recompute = {"none": 0.0, "full": f_compute,
                 "selective": attn_fwd_per_block * tokens * len(share.blocks) / chunks / eff_flops}[t.recompute]
    b_compute = 2 * f_compute + recompute
    ex.append(("forward per chunk", f"{fwd_flops[worst] / chunks:.3e} FLOP / ({hw.peak_flops:.3e} x "
               f"{hw.compute_efficiency}) = {f_compute * 1e3:.3f} ms; backward 2x + recompute {recompute * 1e3:.3f} ms",
               "6N + causal attention (Kaplan 2020; PaLM App. B halved for the mask); recompute: Korthikanti 2022"))
    op_priced = _op_priced(cfg, hw, share, d.vocab_size, local_seq, chunks)
    if op_priced is not None:  # a profile that measured per-op costs (a CPU): price the model's own ops
        f_compute, b_compute, n_tensors, parts = op_priced
        ex.append(("forward per chunk (ops)", f"{parts['ops']:,} ops + {parts['views']:,} views, "
                   f"{parts['flops']:.3e} FLOP: {f_compute * 1e3:.3f} ms forward, {b_compute * 1e3:.3f} ms backward "
                   f"({parts['timed_parts']} of {parts['parts']} parts timed whole: {parts['timed'] * 1e3:.3f} ms; the "
                   f"rest op by op: overhead {parts['overhead'] * 1e3:.3f}, matmul {parts['matmul'] * 1e3:.3f}, "
                   f"attention {parts['attention'] * 1e3:.3f}, elementwise {parts['elementwise'] * 1e3:.3f} ms)",
                   "opcount.py: model.Block and the ends traced forward + backward (TorchDispatchMode), priced "
                   "with the profile's op_overhead_s, view_overhead_s, matmul_curve, elementwise_curve; timed "
                   "parts: the profile's layer_times (calibrate_layers.py)"))

    # ---- traffic per axis -----------------------------------------------------------------------
    if implementation:
        grad_b = 2.0 if p.reduce_dtype == "bf16" else 4.0
        param_b = 4.0
    else:
        grad_b, param_b = b.grad, b.param
    traffic: dict[str, AxisTraffic] = {"dp": dp_traffic(p.zero, grad_ranks if p.zero == 0 else n_shard,
                                                        share.params * grad_b, share.params * param_b, M)}
    pp_ends = int(share.first) + int(share.last) if p.pp > 1 else 0
    traffic.update(activation_traffic(cfg, len(share.blocks), moe_blocks_on[worst], chunks, share.first, share.last,
                                      local_seq, M, act_bytes, pp_ends))
    for axis, tr in traffic.items():
        tr.inter_node = axis_spans_nodes(cfg, world_size, hw.gpus_per_node, axis)
        tr.time_s = time_of(tr, hw)
        where = "across nodes" if tr.inter_node else "inside a node"
        if tr.bytes:
            steps = " + ".join(f"{k} {op} steps x {link(hw, tr.inter_node, op)[1] * 1e6:.0f} us"
                               for op, k in tr.op_steps.items())
            ex.append((f"{axis} traffic", f"{tr.bytes / GB:.3f} GB in {tr.calls} collectives, {where}: {steps} + "
                       f"bytes / {link(hw, tr.inter_node)[0] / GB:.2f} GB/s = {tr.time_s * 1e3:.2f} ms",
                       "comm.py (wire_bytes ring accounting; alpha-beta, Hockney 1994); alpha: "
                       + hw.sources.get("collective_alpha" if hw.collective_alpha
                                        else "inter_latency" if tr.inter_node else "intra_latency", "profile")))

    # tp / ep / cp on the critical path of every F and B of every chunk (spread evenly).
    units = max(1, 2 * M * chunks)  # F and B of each micro-batch and chunk
    attention_time = attn_fwd_per_block * tokens * len(share.blocks) / chunks / eff_flops
    cp_exposed = max(0.0, traffic["cp"].time_s / units - attention_time) if p.cp_method == "ring" else traffic["cp"].time_s / units
    on_path = (traffic["tp"].time_s + traffic["ep"].time_s) / units + cp_exposed
    pp_bw, pp_alpha = link(hw, traffic["pp"].inter_node, "send")
    p2p = pp_alpha + t.micro_batch * local_seq * m.dim * act_bytes / (p.tp if p.sp else 1) / pp_bw if p.pp > 1 else 0.0
    host = HostCosts()
    if op_priced is not None:  # a CPU profile: the Python around the ops, from counts of this layout
        host = host_costs(cfg, hw, modules=parts["modules"], functions=parts["functions"], tensors=n_tensors / chunks,
                          rank_tensors=n_tensors, rank_params=share.params, micro=M, chunks=chunks,
                          tp_calls=traffic["tp"].calls - (M * LOSS_ALL_REDUCES if share.last and p.tp > 1 else 0),
                          grad_bytes=share.params * grad_b, dp_ranks=grad_ranks)
        ex += host.explain
    # Each collective also waits for its slowest rank: noise since the last one (calibrate_sync.py).
    busy = M * chunks * (f_compute + b_compute + host.forward_s + host.backward_s)  # one rank's compute
    degrees = {a: n for a, n in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep if m.n_experts else 1)) if n > 1}
    syncs = sum(traffic[a].calls for a in degrees)
    noise = sum(traffic[a].calls * noise_wait(hw, n, busy / syncs) for a, n in degrees.items()) if syncs else 0.0
    if noise:
        ex.append(("tp/cp/ep noise", f"{syncs} collectives, each after {busy / syncs * 1e3:.2f} ms of compute: "
                   f"{noise * 1e3:.2f} ms waiting for the slowest rank", hw.sources.get("noise_curve", "profile")))
    on_path += noise / units
    f_cost, b_cost = f_compute + on_path + host.forward_s, b_compute + on_path + host.backward_s

    # ---- the pipeline: the same simulator as the executor's schedules ---------------------------
    sim = _simulate(p.pp_schedule, p.pp, M, p.virtual_stages, f_cost, b_cost, p2p)
    ideal = M * chunks * (f_cost + b_cost)
    ex.append(("pipeline", f"{p.pp_schedule} p={p.pp} m={M} v={p.virtual_stages}: makespan {sim.makespan * 1e3:.2f} ms, "
               f"bubble {sim.bubble_ratio:.1%} of compute, {sim.bubble_fraction:.1%} of time",
               "parallel/simulate.py on parallel/schedules.py (1F1B: (p-1)/m and (p-1)/(m+p-1), Narayanan 2021)"))

    # ---- data parallel exposure -----------------------------------------------------------------
    dp = traffic["dp"]
    bw, alpha = link(hw, dp.inter_node, "all_reduce" if p.zero == 0 else "reduce_scatter")
    bucket = min(p.bucket_mb * 1e6, share.params * grad_b)
    n_dp = grad_ranks if p.zero == 0 else n_shard
    t_bucket = bucket_reduce_s(bucket, n_dp, bw, alpha)
    backward_window = chunks * b_cost if p.overlap_comm else 0.0
    gather = share.params * param_b * (n_dp - 1) / n_dp / bw + (n_dp - 1) * alpha if n_dp > 1 else 0.0
    overlap = None
    if n_dp <= 1:
        exposed = 0.0
    elif p.zero == 3:
        per_micro = (dp.time_s) / max(M, 1)
        exposed = M * max(0.0, per_micro - chunks * (f_cost + b_cost)) + share.largest_unit * param_b / bw
    else:
        reduce_t = dp.time_s - (gather if p.zero else 0.0)
        reduce_t /= M if p.zero == 2 else 1
        overlap = BucketOverlap(reduce_s=reduce_t, bucket_s=t_bucket, window_s=backward_window)
        exposed = overlap.exposed_s * (M if p.zero == 2 else 1) + (gather if p.zero else 0.0)
    # its collectives wait for the slowest replica too: once a step (DDP, ZeRO-1), once per
    # micro-batch (ZeRO-2), at every gather and reduce-scatter (ZeRO-3)
    dp_syncs = 0 if n_dp <= 1 else dp.calls if p.zero == 3 else M if p.zero == 2 else 1
    dp_noise = dp_syncs * noise_wait(hw, n_dp, busy / dp_syncs) if dp_syncs else 0.0
    exposed += dp_noise
    ex.append(("exposed dp", f"{dp.time_s * 1e3:.2f} ms of traffic, backward window {backward_window * 1e3:.2f} ms, "
               f"{dp_syncs} x waiting for the slowest replica {dp_noise * 1e3:.2f} ms: {exposed * 1e3:.2f} ms exposed",
               "bucket overlap (Li et al. 2020; course page 003_*); noise: calibrate_sync.py"))

    # ---- optimizer, memory, totals --------------------------------------------------------------
    shard = share.params / (n_shard if p.zero else 1)
    optimizer_t = shard * (b.param + b.grad + 2 * b.optimizer) / hw.hbm_bw
    if hw.optimizer_s_per_tensor or hw.optimizer_s_per_element:  # measured: fivefold's own optimizer step
        tensors = op_priced[2] if op_priced is not None else 0
        optimizer_t = tensors * hw.optimizer_s_per_tensor + shard * hw.optimizer_s_per_element
        ex.append(("optimizer", f"{tensors} tensors x {hw.optimizer_s_per_tensor * 1e6:.1f} us + {shard:,.0f} "
                   f"elements x {hw.optimizer_s_per_element * 1e9:.2f} ns = {optimizer_t * 1e3:.3f} ms",
                   hw.sources.get("optimizer_s_per_tensor", "profile")))
    # scalar all-reduces every step runs (train/loop.py): the gradient norm's partial sums over the
    # groups gradients are split over (ZeRO shards, pp, tp, ep: parallelize.gradient_split_groups)
    # and the logged loss over pp and the gradient group: latency only, nothing to overlap with
    alpha_in = link(hw, False, "all_reduce")[1]
    split_over = [n_shard if p.zero else 1, p.pp, p.tp, p.ep if m.n_experts else 1, p.pp, grad_ranks]
    sync_t = sum(2 * (n - 1) * alpha_in for n in split_over if n > 1)
    if sync_t:
        ex.append(("step sync", f"{sum(1 for n in split_over if n > 1)} scalar all-reduces (gradient norm, logged "
                   f"loss) x 2(n-1) x {alpha_in * 1e6:.0f} us = {sync_t * 1e3:.2f} ms", "train/loop.py; alpha-beta"))
    step = sim.makespan + exposed + optimizer_t + sync_t + host.step_s
    tokens_step = d.tokens_per_step
    model_flops = flops_per_token(m, t.seq_len, d.vocab_size)["total"] * tokens_step
    mfu = model_flops / (step * world_size * hw.peak_flops)

    memory, act_b = {}, act_bytes
    for r, s in enumerate(shares):
        state = (fivefold_state_bytes(cfg, s.params, n_shard, M) if implementation
                 else model_state_bytes(s.params, b, p.zero, n_shard))
        acts = activation_bytes(cfg, s, sim.peak_inflight[r], local_seq, d.vocab_size, act_b)
        bufs = buffer_bytes(cfg, s, b, local_seq, act_b, grad_ranks)
        mem = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": acts["total"], "buffers": bufs["total"]}
        mem["total"] = sum(mem.values())
        if not memory or mem["total"] > memory["total"]:
            memory, worst_acts, worst_r = mem, acts, r
    ex.append(("model state", f"{memory['params'] / GB:.2f} + {memory['grads'] / GB:.2f} + {memory['optimizer'] / GB:.2f} GB "
               f"(bytes {b.param:g},{b.grad:g},{b.optimizer:g}; zero={p.zero} over {n_shard})",
               "ZeRO (Rajbhandari 2020 sec. 3); lecture 000_*: 16 bytes/param"))
    ex.append(("activations", f"{worst_acts['per_block_microbatch'] / GB:.3f} GB/block/micro-batch x "
               f"{shares[worst_r].chunk_blocks} blocks x {sim.peak_inflight[worst_r]} in flight + logits "
               f"{worst_acts['logits'] / GB:.3f} GB", "activations.py (Korthikanti 2022 method); simulate().peak_inflight"))
    fits = memory["total"] <= hw.memory_bytes
    ex.append(("memory", f"{memory['total'] / GB:.2f} GB of {hw.memory_bytes / GB:.0f} GB: {'fits' if fits else 'does NOT fit'}",
               hw.sources.get("memory_bytes", "profile")))
    ex.append(("step time", f"{sim.makespan * 1e3:.2f} (pipeline) + {exposed * 1e3:.2f} (dp) + {optimizer_t * 1e3:.2f} "
               f"(optimizer) + {sync_t * 1e3:.2f} (sync) + {host.step_s * 1e3:.2f} (per-step Python) = "
               f"{step * 1e3:.2f} ms; MFU {model_flops:.3e} / ({step:.3f} s x {world_size} x "
               f"{hw.peak_flops:.3e}) = {mfu:.1%}", "MFU as in PaLM (Chowdhery et al. 2022, App. B)"))
    compute = M * chunks * (f_compute + b_compute)
    split = {"compute": compute, "tp_cp_ep": M * chunks * 2 * on_path, "bubble": sim.makespan - ideal,
             "dp_exposed": exposed, "optimizer": optimizer_t, "step_sync": sync_t,
             "host": M * chunks * (host.forward_s + host.backward_s) + host.step_s}
    return Estimate(world_size=world_size, memory=memory, comm=traffic, bubble_ratio=sim.bubble_ratio,
                    bubble_fraction=sim.bubble_fraction, exposed_dp_s=exposed, step_time_s=step,
                    tokens_per_s_per_gpu=tokens_step / step / world_size, mfu=mfu, fits=fits, time_split=split,
                    explain=ex, dp_overlap=overlap)
