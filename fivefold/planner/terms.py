"""The terms of an estimate after compute and traffic, each its seconds (or bytes) and explain rows.

- critical_path: the tp, cp and ep collectives that overlap.py leaves exposed, added to every forward
  and backward, and each one's wait for its slowest rank;
- pipeline: the same simulate() that checks the executor's schedules, on the chunk's costs;
- dp_exposure: the gradient reduction hidden under the backward bucket by bucket (Li et al. 2020,
  "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"), what is left exposed,
  and ZeRO-3's gathers as overlap.zero3_hidden prices them;
- step_sync: the scalar all-reduces every step runs (gradient norm, logged loss);
- rank_memory: the fullest pipeline rank's model state, activations and buffers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.config import Config
from fivefold.parallel.schedules import build_schedule
from fivefold.parallel.simulate import Costs, SimResult, simulate
from fivefold.planner.comm import AxisTraffic, link
from fivefold.planner.datasheet import GB, Hardware
from fivefold.planner.layout import RankShare
from fivefold.planner.memory import BytesPerParam, activation_bytes, buffer_bytes, rank_state_bytes
from fivefold.planner.overlap import Hidden, dp_hidden
from fivefold.planner.pricing import ChunkWork, Memo, Priced, Row
from fivefold.validate import Derived


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
    attention_time = work.attention_forward_flops / work.chunks / (hw.peak_flops * hw.compute_efficiency)
    cp_time = traffic["cp"].time_s
    cp_exposed = max(0.0, cp_time / units - attention_time) if p.cp_method == "ring" else cp_time / units
    on_path = (tp.exposed_s + ep.exposed_s) / units + cp_exposed
    pp_bw, pp_alpha = link(hw, traffic["pp"].inter_node, "send")
    activation = t.micro_batch * d.local_seq_len * m.dim * act_bytes / (p.tp if p.sp else 1)  # one stage's output
    p2p = pp_alpha + activation / pp_bw if p.pp > 1 else 0.0
    degrees = {a: n for a, n in (("tp", p.tp), ("cp", p.cp), ("ep", p.ep if m.n_experts else 1)) if n > 1}
    syncs = sum(traffic[a].calls for a in degrees)
    noise = (sum(traffic[a].calls * hw.pricer.noise_wait(n, busy_s / syncs, memo) for a, n in degrees.items())
             if syncs else 0.0)
    rows = []
    if noise:
        rows.append(("tp/cp/ep noise", f"{syncs} collectives, each after {busy_s / syncs * 1e3:.2f} ms of compute: "
                     f"{noise * 1e3:.2f} ms waiting for the slowest rank", hw.sources.get("noise_curve", "profile")))
    return CriticalPath(units, on_path + noise / units, p2p, rows)


def simulate_scaled(schedule: str, pp: int, m: int, v: int, f: float, b: float, comm: float, memo: Memo) -> SimResult:
    """simulate() with f = 1, scaled: every duration scales with f, so the makespan does too and the
    bubble figures and peak in flight do not. The unit run is kept in `memo` by its shape and cost
    ratios (rounded to 1e-4), so a search simulates each shape once."""
    if f <= 0:
        return simulate(build_schedule(schedule, pp, m, v), Costs(f=f, b=b, comm=comm))
    b_over_f, comm_over_f = round(b / f, 4), round(comm / f, 4)
    unit = memo.get(("simulate", schedule, pp, m, v, b_over_f, comm_over_f),
                    lambda: simulate(build_schedule(schedule, pp, m, v), Costs(f=1.0, b=b_over_f, comm=comm_over_f)))
    return dataclasses.replace(unit, makespan=unit.makespan * f, busy=[x * f for x in unit.busy],
                               idle=[x * f for x in unit.idle], timeline=[])


@dataclass(frozen=True)
class Pipeline:
    sim: SimResult  # makespan, bubble figures and peak activations in flight per rank
    ideal_s: float  # the same work with no bubble
    explain: list[Row] = field(default_factory=list)


def pipeline(cfg: Config, d: Derived, chunks: int, f_cost: float, b_cost: float, p2p_s: float,
             memo: Memo) -> Pipeline:
    """The step's compute as the schedule runs it: `simulate(build_schedule(...), Costs(f, b, comm))`."""
    p, M = cfg.parallel, d.grad_accum
    sim = simulate_scaled(p.pp_schedule, p.pp, M, p.virtual_stages, f_cost, b_cost, p2p_s, memo)
    row = ("pipeline", f"{p.pp_schedule} p={p.pp} m={M} v={p.virtual_stages}: makespan {sim.makespan * 1e3:.2f} ms, "
           f"bubble {sim.bubble_ratio:.1%} of compute, {sim.bubble_fraction:.1%} of time",
           "parallel/simulate.py on parallel/schedules.py (1F1B: (p-1)/m and (p-1)/(m+p-1), Narayanan 2021)")
    return Pipeline(sim, M * chunks * (f_cost + b_cost), [row])


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
    explain: list[Row] = field(default_factory=list)


def dp_exposure(work: ChunkWork, d: Derived, hw: Hardware, dp: AxisTraffic, grad_b: float, param_b: float,
                b_cost: float, busy_s: float, memo: Memo, zero3: Hidden) -> DpExposure:
    """The gradient reduction overlaps the backward of the last micro-batch bucket by bucket, so only
    what exceeds that backward is exposed, and never less than the last bucket; ZeRO's weight
    all-gather after the optimizer step is exposed; ZeRO-3's gathers and reduce-scatters expose what
    `zero3` (overlap.zero3_hidden) says. Its collectives wait for the slowest replica too:
    once a step (DDP, ZeRO-1), once per micro-batch (ZeRO-2), at every gather and reduce-scatter (ZeRO-3)."""
    p, share, chunks, M = work.cfg.parallel, work.share, work.chunks, d.grad_accum
    bw, alpha = link(hw, dp.inter_node, "all_reduce" if p.zero == 0 else "reduce_scatter")
    bucket = min(p.bucket_mb * 1e6, share.params * grad_b)
    n_dp = d.dp * p.cp if p.zero == 0 else d.dp_shard
    t_bucket = bucket_reduce_s(bucket, n_dp, bw, alpha)
    backward_window = chunks * b_cost if p.overlap_comm else 0.0
    gather = share.params * param_b * (n_dp - 1) / n_dp / bw + (n_dp - 1) * alpha if n_dp > 1 else 0.0
    overlap = None
    if n_dp <= 1:
        exposed = 0.0
    elif p.zero == 3:
        exposed = zero3.exposed_s
    else:
        reduce_t = dp.time_s - (gather if p.zero else 0.0)
        reduce_t /= M if p.zero == 2 else 1
        overlap = BucketOverlap(reduce_s=reduce_t, bucket_s=t_bucket, window_s=backward_window)
        exposed = overlap.exposed_s * (M if p.zero == 2 else 1) + (gather if p.zero else 0.0)
    per_step = M if p.zero == 2 else 1  # ZeRO-2 reduces every micro-batch
    switch = dp_hidden(work.cfg, n_dp, overlap.reduce_s * per_step if overlap else 0.0,
                       overlap.exposed_s * per_step if overlap else 0.0)
    dp_syncs = 0 if n_dp <= 1 else dp.calls if p.zero == 3 else M if p.zero == 2 else 1
    dp_noise = dp_syncs * hw.pricer.noise_wait(n_dp, busy_s / dp_syncs, memo) if dp_syncs else 0.0
    exposed += dp_noise
    row = ("exposed dp", f"{dp.time_s * 1e3:.2f} ms of traffic, backward window {backward_window * 1e3:.2f} ms, "
           f"{dp_syncs} x waiting for the slowest replica {dp_noise * 1e3:.2f} ms: {exposed * 1e3:.2f} ms exposed",
           "bucket overlap (Li et al. 2020, \"PyTorch Distributed\"); noise: calibration/noise.py")
    return DpExposure(exposed, overlap, switch, [row])


def step_sync(cfg: Config, d: Derived, hw: Hardware) -> Priced:
    """Scalar all-reduces every step runs (train/step.py): the gradient norm's partial sums over the
    groups gradients are split over (ZeRO shards, pp, tp, ep: Parallelized.optimizer_step) and
    the logged loss over pp and the gradient group; latency only, nothing to overlap with."""
    m, p = cfg.model, cfg.parallel
    alpha_in = link(hw, False, "all_reduce")[1]
    split_over = [d.dp_shard if p.zero else 1, p.pp, p.tp, p.ep if m.n_experts else 1, p.pp, d.dp * p.cp]
    sync_t = sum(2 * (n - 1) * alpha_in for n in split_over if n > 1)
    rows = []
    if sync_t:
        rows.append(("step sync", f"{sum(1 for n in split_over if n > 1)} scalar all-reduces (gradient norm, logged "
                     f"loss) x 2(n-1) x {alpha_in * 1e6:.0f} us = {sync_t * 1e3:.2f} ms", "train/step.py; alpha-beta"))
    return Priced(sync_t, rows)


@dataclass(frozen=True)
class RankMemory:
    memory: dict[str, float]  # bytes on the fullest rank: params, grads, optimizer, activations, buffers, total
    fits: bool
    explain: list[Row] = field(default_factory=list)


def rank_memory(cfg: Config, d: Derived, shares: list[RankShare], peak_inflight: list[int], b: BytesPerParam,
                act_bytes: int, implementation: bool, hw: Hardware) -> RankMemory:
    """The fullest pipeline rank: its model state (ZeRO's accounting, or fivefold's own with
    `implementation`), activations at the schedule's peak in flight, and communication buffers."""
    p, n_shard, grad_ranks = cfg.parallel, d.dp_shard, d.dp * cfg.parallel.cp
    memory: dict[str, float] = {}
    for r, s in enumerate(shares):
        state = rank_state_bytes(cfg, d, s, b, implementation)
        acts = activation_bytes(cfg, s, peak_inflight[r], d.local_seq_len, d.vocab_size, act_bytes)
        bufs = buffer_bytes(cfg, s, b, d.local_seq_len, act_bytes, grad_ranks)
        mem = {"params": state["params"], "grads": state["grads"], "optimizer": state["optimizer"],
               "activations": acts["total"], "buffers": bufs["total"]}
        mem["total"] = sum(mem.values())
        if not memory or mem["total"] > memory["total"]:
            memory, worst_acts, worst_r = mem, acts, r
    fits = memory["total"] <= hw.memory_bytes
    rows = [("model state", f"{memory['params'] / GB:.2f} + {memory['grads'] / GB:.2f} + "
             f"{memory['optimizer'] / GB:.2f} GB (bytes {b.param:g},{b.grad:g},{b.optimizer:g}; zero={p.zero} "
             f"over {n_shard})", "ZeRO (Rajbhandari et al. 2020, sec. 3.1: 16 bytes/param with mixed-precision Adam)"),
            ("activations", f"{worst_acts['per_block_microbatch'] / GB:.3f} GB/block/micro-batch x "
             f"{shares[worst_r].chunk_blocks} blocks x {peak_inflight[worst_r]} in flight + logits "
             f"{worst_acts['logits'] / GB:.3f} GB",
             "activations.py (Korthikanti 2022 method); simulate().peak_inflight"),
            ("memory", f"{memory['total'] / GB:.2f} GB of {hw.memory_bytes / GB:.0f} GB: "
             f"{'fits' if fits else 'does NOT fit'}", hw.sources.get("memory_bytes", "profile"))]
    return RankMemory(memory, fits, rows)
