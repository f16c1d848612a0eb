"""Estimate one layout: memory per rank, bytes per axis, pipeline bubble, step time, MFU.

`estimate(cfg, world_size, hw)` takes the same `Config` that `fivefold train` runs (a layout is a
config) and returns an `Estimate` whose `explain` lists every number with its arithmetic and the
source of its formula. The step time is the textbook model, term by term:

1. compute (compute.py, priced by the hardware's pricer): one micro-batch on one pipeline chunk,
   for a catalog GPU op by op (roofline.py: matmuls tile and wave quantised at a measured GEMM
   fraction of peak, input and weight gradients at their own shapes, the attention core at
   FlashAttention-2's measured fraction, elementwise kernels at HBM speed), for other hardware its
   training FLOPs at peak x compute_efficiency with backward = 2 x forward; full recompute adds a
   forward, selective the attention core's forward (Korthikanti et al. 2022). A profile measured
   by `fivefold calibrate` brings its own pricer (calibration/pricer.py: the model's ops counted
   and priced one by one, and the Python around them).
2. traffic (comm.py): bytes per axis by ring accounting, timed alpha-beta: steps x alpha + wire
   bytes / (bandwidth x efficiency), on the node's links or the NIC.
3. the critical path (terms.py): what overlap.py leaves exposed of the tp and ep collectives (all
   of it by default: fivefold's block; parallel.tp_overlap, ep_overlap hide them under matmuls or
   another micro-batch) and the cp ones are added to every forward and backward; ring attention's
   K/V hops overlap the block's attention, so only what exceeds it is added; with a pricer that
   knows the machine's noise, each collective also waits for its slowest rank.
4. the pipeline: `simulate(build_schedule(...), Costs(f, b, comm))`, the very simulator that
   checks the executor's schedules, gives the makespan and both bubble figures.
5. dp: the gradient reduction overlaps the backward of the last micro-batch bucket by bucket
   (Li et al. 2020, "PyTorch Distributed"), so only what exceeds that backward is exposed, and
   never less than the last bucket; ZeRO's weight all-gather after the optimizer step is exposed
   (with options.param_gather_overlap, what exceeds the next step's first forward);
   ZeRO-3's gathers are prefetched one unit ahead (options.zero3_prefetch), so each pass exposes
   its first unit's gather and what each later one exceeds the previous unit's compute (overlap.py).
6. the optimizer step is memory-bound: it reads and writes about b_p + b_g + 2 b_o bytes per
   parameter of its shard at the HBM bandwidth (a measured pricer: fivefold's own step, timed);
   with offload (parallel.offload) the host steps it instead, and the host
   link's copies that the compute does not hide are added (offload.py). Under Muon (optim.name) its
   owners' all_to_alls and Newton-Schulz iterations are added, exposed (muon_step.py).
7. the scalar all-reduces of every step (gradient norm, logged loss), latency only.
With LoRA (lora.rank, lora_step.py) the compute drops the frozen base's weight gradients and adds the
adapters', and dp, the optimizer and its state hold the adapters only.

What the overlaps of 3-5 hide still takes SMs from the compute beside it (overlap.contention).
step = makespan + exposed dp + contention + optimizer + step sync + per-step host time; MFU = model FLOPs /
(step x GPUs x peak) as in PaLM (Chowdhery et al. 2022, App. B), HFU the same with recomputation
counted, causal attention in full or halved as options.causal_flops says, sliding windows and
documents counted as the pairs they keep (flops.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fivefold.config.derive import Derived, derive
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import ModelCounts, model_counts
from fivefold.parallel.pipeline.stage_split import is_automatic_and_uneven, split_note
from fivefold.planner.comm import AXES, AxisTraffic, heaviest_senders, loss_gathers, own_part, step_traffic
from fivefold.planner.compute import busiest_chunk
from fivefold.planner.conventions import conventions
from fivefold.planner.flops import convention_row, step_flops, utilization_row
from fivefold.planner.layout import RankShare, rank_shares, stage_sizes
from fivefold.planner.lora_step import lora_chunk, lora_row, trainable_share
from fivefold.planner.machine.datasheet import GB, Hardware
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, HostPrice, HostWork, Memo, Priced, Row
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.muon_step import muon_step
from fivefold.planner.offload import check_offload, offload_step
from fivefold.planner.options import DEFAULT, PlanOptions
from fivefold.planner.overlap import Hidden, contention, ep_hidden, tp_hidden, zero3_hidden, zero3_units
from fivefold.planner.terms import (
    BucketOverlap,
    CriticalPath,
    DpExposure,
    Pipeline,
    RankMemory,
    bucket_reduce_s,
    critical_path,
    dp_exposure,
    inflight_blocks,
    pipeline,
    rank_memory,
    step_sync,
)

__all__ = ["MEMORY_KEYS", "BucketOverlap", "Estimate", "bucket_reduce_s", "estimate"]

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "buffers", "total")


@dataclass
class Estimate:
    world_size: int
    memory: dict[str, float]  # bytes on the fullest rank, MEMORY_KEYS
    comm: dict[str, AxisTraffic]  # per axis, of the pipeline rank that sends the most (comm.heaviest_senders)
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
    options: PlanOptions = DEFAULT  # the conventions and switches it was made under (options.py)
    hfu: float = 0.0  # hardware FLOPs (recomputation counted) / (step x GPUs x peak)
    flops: dict[str, float] = field(default_factory=dict)  # model and hardware FLOPs, per token and per step
    host_memory_bytes: float = 0.0  # host memory per node that offloaded state takes
    host_pinned_bytes: float = 0.0  # of it, page-locked (planner/offload.py: pinned_host_bytes)
    overlaps: dict[str, Hidden] = field(default_factory=dict)  # overlap.SWITCHES -> traffic and what stays exposed
    not_runnable: list[str] = field(default_factory=list)  # why `fivefold train` cannot run it as assumed
    comm_by_pp_rank: list[dict[str, AxisTraffic]] = field(default_factory=list)  # every pipeline rank's traffic
    memory_by_pp_rank: list[dict[str, float]] = field(default_factory=list)  # every pipeline rank's, MEMORY_KEYS
    conventions: dict[str, float] = field(default_factory=dict)  # conventions.CONVENTION_KEYS: the papers' figures


    def to_json(self) -> dict[str, Any]:
        """The `--json` object (keys fixed by the planner issue)."""
        return {
            "memory_gb": {k: self.memory[k] / GB for k in MEMORY_KEYS},
            "comm_bytes_per_step": {a: self.comm[a].bytes for a in AXES},
            "bubble": {"ratio": self.bubble_ratio, "fraction": self.bubble_fraction},
            "step_time_s": self.step_time_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "flops": self.flops,
            "fits": self.fits,
            "kernels": self.options.kernels,
            "conventions": dict(self.conventions),
            "host_memory_gb": self.host_memory_bytes / GB,
            "runnable": not self.not_runnable,
            "not_runnable": self.not_runnable,
        }


def wire_element_bytes(cfg: Config, b: BytesPerParam, implementation: bool) -> tuple[float, float]:
    """(gradient, weight) bytes per element on the wire: the textbook's b_g and b_p, or what fivefold's
    own code sends (gradients in parallel.reduce_dtype, weights in parallel.param_dtype)."""
    if implementation:
        p = cfg.parallel
        return (2.0 if p.reduce_dtype == "bf16" else 4.0), (2.0 if p.param_dtype == "bf16" else 4.0)
    return b.grad, b.param


def estimate(cfg: Config, world_size: int, hw: Hardware, b: BytesPerParam | None = None, act_bytes: int = 2,
             implementation: bool = False, memo: Memo | None = None, options: PlanOptions = DEFAULT) -> Estimate:
    """Predict one layout. `cfg` must pass validate(cfg, world_size).

    b: bytes per parameter (default 2,2,12); act_bytes: bytes per activation element (2 = bf16).
    implementation=True counts model state as fivefold's own code holds it (fp32 weights and
    gradients, memory.fivefold_state_bytes) and gradients travel in parallel.reduce_dtype: the
    self-check against real runs; False is the textbook accounting with `b`. memo: results shared
    with other estimates of the same caller (search() passes one); by default this estimate's own.
    options: the FLOP convention and the switches beyond `cfg`'s (options.py); a speed switch on in
    either `cfg` or `options` is priced on, and the estimate is runnable when fivefold runs
    options.switched_config(cfg, options).

    In three parts: where things live (`_where`), each term of the step priced (`_price`, the
    module docstring's 1-7), and the estimate assembled with its explain rows (`_assemble`).
    """
    b, memo, options = b or BytesPerParam(), memo or Memo(), options.with_config(cfg)
    check_offload(cfg, options)
    if options.expert_imbalance < 1:
        raise ValueError(f"--expert-imbalance {options.expert_imbalance:g}: the busiest expert rank's tokens over "
                         "the mean are at least 1 (1 = balanced)")
    where = _where(cfg, world_size, b, act_bytes, implementation, options)
    terms = _price(cfg, hw, where, b, act_bytes, implementation, memo, options)
    return _assemble(cfg, world_size, hw, where, terms, options)


@dataclass
class _Where:
    """Where things live in the layout: its numbers, the model's counts, each rank's share, the
    busiest rank's chunk, and the bytes per element of what travels."""

    d: Derived
    counts: ModelCounts
    sizes: list[int]  # blocks per pipeline stage
    shares: list[RankShare]
    work: ChunkWork
    grad_b: float
    param_b: float


def _where(cfg: Config, world_size: int, b: BytesPerParam, act_bytes: int, implementation: bool,
           options: PlanOptions) -> _Where:
    d = derive(cfg, world_size, unpadded_vocab(cfg))
    counts = model_counts(cfg.model, d.vocab_size)
    sizes = stage_sizes(cfg, counts)
    shares = rank_shares(cfg, counts, sizes)
    grad_b, param_b = wire_element_bytes(cfg, b, implementation)
    return _Where(d, counts, sizes, shares, busiest_chunk(cfg, d, counts, shares, options, act_bytes, param_b),
                  grad_b, param_b)


@dataclass
class _Terms:
    """Every term of the step, priced (the module docstring's 1-7), and what they are made of."""

    chunk: ChunkPrice  # 1. compute of one micro-batch on one chunk
    traffic_rows: list[Row]  # 2. traffic: the busiest rank's rows, timed
    sent: dict[str, AxisTraffic]  # and what the heaviest sender of each axis sends
    sent_rows: list[Row]
    by_rank: list[dict[str, AxisTraffic]]
    host: HostPrice  # Python around the kernels
    path: CriticalPath  # 3. the exposed tp/cp/ep collectives on every forward and backward
    pipe: Pipeline  # 4. makespan and bubble
    dp: DpExposure  # 5. the exposed gradient reduction
    overlaps: dict[str, Hidden]
    contention: Priced  # the compute slowed by the collectives it hides (overlap.contention)
    opt: Priced  # 6. the optimizer step (or offload's)
    sync: Priced  # 7. the scalar all-reduces
    mem: RankMemory


def _price(cfg: Config, hw: Hardware, where: _Where, b: BytesPerParam, act_bytes: int, implementation: bool,
           memo: Memo, options: PlanOptions) -> _Terms:
    pricer, p, d, work = hw.pricer, cfg.parallel, where.d, where.work
    grad_b, param_b = where.grad_b, where.param_b
    share, M = work.share, d.grad_accum
    units = M * work.chunks  # (micro-batch, chunk) pairs of a step
    chunk = lora_chunk(work, pricer.chunk(work, hw, memo), hw, memo)  # lora.rank: frozen base, adapters
    trains = trainable_share(cfg, share)  # what data parallel and the optimizer hold (LoRA: the adapters)
    traffic, traffic_rows = step_traffic(work, d, hw, grad_b, param_b, act_bytes)  # the busiest rank's: timed
    muon = muon_step(cfg, d, where.shares, share, hw)  # optim.name = "muon": its all_to_alls and NS5
    sent, sent_rows, by_rank = heaviest_senders(work, where.shares, where.counts, traffic, d, hw, grad_b, param_b,
                                                act_bytes, muon.by_rank)
    # tp collectives that are autograd Functions of their own (the loss's all-gathers sit inside one)
    loss_calls = sum(n for _, n in loss_gathers(cfg, d.local_seq_len)) if share.last else 0
    tp_calls = traffic["tp"].calls - M * loss_calls
    host = pricer.host(HostWork(cfg, share.params, M, work.chunks, tp_calls, trains.params * grad_b, d.dp * p.cp),
                       chunk, hw)
    busy = units * (chunk.forward_s + chunk.backward_s + host.forward_s + host.backward_s)  # one rank's compute
    blocked = options.not_runnable(cfg)  # a switch validate refuses here prices what fivefold does not run
    runs = {sw: not any(r.startswith(f"parallel.{sw} ") for r in blocked) for sw in ("tp_overlap", "ep_overlap")}
    tp = tp_hidden(work, d, where.counts, chunk, traffic["tp"], hw, act_bytes, options.tp_overlap, runs["tp_overlap"])
    ep = ep_hidden(work, d, where.counts, chunk, traffic["ep"], options.ep_overlap, runs["ep_overlap"])
    path = critical_path(work, d, hw, traffic, act_bytes, busy, memo, tp, ep)
    f_cost = chunk.forward_s + path.per_unit_s + host.forward_s
    b_cost = chunk.backward_s + path.per_unit_s + host.backward_s
    pipe = pipeline(cfg, d, work.chunks, f_cost, b_cost, path.p2p_s, memo, paired=options.ep_overlap)
    units3 = (zero3_units(cfg, d, where.counts, work, hw, traffic["dp"], grad_b, param_b)
              if p.zero == 3 else [])
    zero3 = zero3_hidden(cfg, d, units3, work.chunks * f_cost, work.chunks * b_cost, options.zero3_prefetch)
    dp = dp_exposure(work, d, hw, traffic["dp"], grad_b, param_b, f_cost, b_cost, busy, memo, zero3,
                     options.param_gather_overlap)
    opt = (pricer.optimizer(trains.params / (d.dp_shard if p.zero else 1), b, chunk, hw) if options.offload == "none"
           else offload_step(cfg, d, trains, b, hw, options, grad_b, param_b, work.chunks * f_cost,
                             work.chunks * b_cost))
    opt = Priced(opt.seconds + muon.priced.seconds, opt.explain + muon.priced.explain  # Muon's, exposed
                 + lora_row(cfg, share, grad_b, d.dp_shard))
    held = inflight_blocks(cfg, d, where.sizes, memo)
    mem = rank_memory(cfg, d, where.shares, held, b, act_bytes, implementation, hw, options)
    overlaps = {h.switch: h for h in (tp, zero3, ep, dp.switch, dp.gather)}
    return _Terms(chunk, traffic_rows, sent, sent_rows, by_rank, host, path, pipe, dp, overlaps,
                  contention(overlaps, hw), opt, step_sync(cfg, d, hw), mem)


def _assemble(cfg: Config, world_size: int, hw: Hardware, where: _Where, terms: _Terms,
              options: PlanOptions) -> Estimate:
    """The step time as the sum of its terms, its split by part, MFU and HFU, and the explain rows."""
    d, t = where.d, terms
    units = d.grad_accum * where.work.chunks
    step_terms = {"pipeline": t.pipe.sim.makespan, "dp": t.dp.exposed_s, "contention": t.contention.seconds,
                  "optimizer" if options.offload == "none" else "offload": t.opt.seconds, "sync": t.sync.seconds,
                  "per-step Python": t.host.step_s}
    step = sum(step_terms.values())
    split = {"compute": units * (t.chunk.forward_s + t.chunk.backward_s), "tp_cp_ep": units * 2 * t.path.per_unit_s,
             "bubble": t.pipe.sim.makespan - t.pipe.ideal_s, "dp_exposed": t.dp.exposed_s,
             "contention": t.contention.seconds, "optimizer": t.opt.seconds,
             "step_sync": t.sync.seconds, "host": units * (t.host.forward_s + t.host.backward_s) + t.host.step_s}
    flops = step_flops(cfg, d.vocab_size, options.causal_flops, options.document_tokens,
                       options.selective_ac == "per_op")
    mfu, hfu = flops.utilization(step, world_size, hw.peak_flops)
    papers = {a: own_part(tr) for a, tr in t.sent.items()}  # without the optimizer's (Muon's) all_to_alls
    figures, figures_row = conventions(cfg, d, papers, flops, step, hw.peak_flops, t.mem.activations,
                                       where.work.act_bytes)
    stages = [("pipeline stages", split_note(cfg, tuple(where.sizes)).partition(": ")[2],
               "parallel/pipeline/stage_split.py (the runtime's split)")] if is_automatic_and_uneven(cfg) else []
    explain = [_params_row(where.counts), *stages, *t.chunk.explain, *t.traffic_rows, *t.sent_rows, *t.host.explain,
               *t.path.explain, *t.pipe.explain, *t.dp.explain, *(h.row for h in t.overlaps.values()),
               *t.contention.explain,
               *t.opt.explain, *t.sync.explain, *t.mem.explain, _step_row(step_terms, step), convention_row(flops),
               utilization_row(flops, step, world_size, hw.peak_flops), figures_row]
    return Estimate(world_size=world_size, memory=t.mem.memory, comm=t.sent, bubble_ratio=t.pipe.sim.bubble_ratio,
                    bubble_fraction=t.pipe.sim.bubble_fraction, exposed_dp_s=t.dp.exposed_s, step_time_s=step,
                    tokens_per_s_per_gpu=d.tokens_per_step / step / world_size, mfu=mfu, fits=t.mem.fits,
                    time_split=split, explain=explain, dp_overlap=t.dp.overlap, options=options, hfu=hfu,
                    flops=flops.to_json(), host_memory_bytes=t.mem.host_bytes,
                    host_pinned_bytes=t.mem.host_pinned_bytes, overlaps=t.overlaps,
                    not_runnable=options.not_runnable(cfg), comm_by_pp_rank=t.by_rank,
                    memory_by_pp_rank=t.mem.per_rank, conventions=figures)


def _params_row(counts: ModelCounts) -> Row:
    return ("params", f"{counts.total:,} ({counts.total / 1e9:.2f}B), experts {counts.expert_total:,}",
            "counts.model_counts: model/transformer.py layer by layer (checked on the meta device)")


def _step_row(terms: dict[str, float], step: float) -> Row:
    added = " + ".join(f"{seconds * 1e3:.2f} ({what})" for what, seconds in terms.items())
    return ("step time", f"{added} = {step * 1e3:.2f} ms", "the terms of the module docstring, in order")
