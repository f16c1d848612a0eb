"""The dry run: what every rank of a layout would hold, built at the real scale with no device
and no peer. `fivefold train CONFIG --dry-run --world N (--gpu NAME | --device-memory 80GB)`.

How. One process plays one rank of each position in turn: torch's fake process group
(torch.testing._internal.distributed.fake_pg) makes a world of N ranks in which this process is
rank r, and the model is built exactly as training builds it (train/loop.py: parallel_model, on
the meta device, through parallelize()) with `mesh.device` the meta device, so every tensor has
its shape and dtype and no memory. A fake collective returns this rank's own data, so no build
decision may depend on what one returns: the build makes none (only groups), and `build()` checks
that no collective went through comm/collectives.py while it ran.

What is counted, per part, from the storages that parallelize() and AdamW leave (a meta tensor's
storage reports its size; ZeRO-3's freed placeholders report 0), each storage once and classified
as parallel/state_memory.model_state_bytes classifies what training reports as `model_state_bytes`
(the same function):
- params: the model's parameters on this rank (ZeRO-3: none; its shards are the optimizer's, but for
  the frozen ones' under LoRA, the base's only copy: frozen_shards);
- optimizer: AdamW's moments, made as its first step makes them (parallel/optimizer.py
  init_optimizer_state), and ZeRO's fp32 master shards;
- grads: a gradient exists only after a backward, so the dry run gives the real tensors meta
  gradients of exactly the shapes data parallel holds where training samples model_state_bytes,
  after each micro-batch's backward, at its largest (`hold_gradients`): DDP a full gradient per
  parameter (ddp.py: kept until the step); ZeRO-1 the full gradients while micro-batches
  accumulate (grad_accum > 1; zero.py reduces them into the shards on the last one), else the fp32
  shard gradients; ZeRO-2 and ZeRO-3 the fp32 shard gradients only (zero.py, fsdp.py: each full
  gradient is dropped once its bucket is reduce-scattered).
Model state is fp32 whatever train.dtype: fivefold keeps fp32 weights, gradients and optimizer
state and computes under bf16 / fp16 autocast (train/precision.py), so a GPU run holds these bytes.
Activations and communication buffers are not model state and are not built: the planner's
prediction for them (in the compute dtype a GPU run uses: bf16 unless train.dtype = "fp32") is
shown beside, labelled as predicted. (The mesh's device type stays "cpu" for the fake group; the
one thing it sets in the build is the dtype activations travel in between stages, none held.)

Positions. What a rank holds depends on its pipeline rank only: tp slices are equal in size
(validate() requires heads, key/value heads, ffn_dim and the padded vocabulary divisible by tp),
experts split equally over ep (n_experts divisible by ep), ZeRO pads every shard to c = ceil(rows
/ N) rows on every dp_shard rank, the last included (zero.py), and dp_replicate and cp ranks hold
what their peers hold. So one rank per pipeline rank is built and stands for the rest;
`every=True` (`--all-positions`) builds every (pp, tp, ep, dp_shard) position apart instead.
The pipeline's message plan (parallel/pipeline/messages.py) is the schedule's, the same for every position:
it is proven once, before the builds (a built pipeline proves its own at its first step only).

Prediction and fit. Beside each position: planner/selfcheck.memory_per_pipeline_rank, the
estimate's implementation=True memory of that pipeline rank. A position fits when built model
state + predicted activations + predicted buffers <= the capacity (`--gpu`'s memory from the
datasheet catalog, or `--device-memory`, GB = 1e9 as the planner counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.parallel.data import DataParallel
from fivefold.parallel.data.offload import HostOffload, ParamOffload
from fivefold.parallel.mesh import AXES, Mesh
from fivefold.parallel.optimizer import init_optimizer_state
from fivefold.parallel.pipeline.messages import check_plans
from fivefold.parallel.pipeline.schedules import build_schedule
from fivefold.parallel.pipeline.stage_split import split_note, stage_split
from fivefold.parallel.state_memory import frozen_shards, model_state_bytes
from fivefold.planner.selfcheck import memory_per_pipeline_rank
from fivefold.progress import progress_bar
from fivefold.train.loop import parallel_model

STATE = ("params", "grads", "optimizer")
PROGRESS_FROM = 8  # positions from which a progress bar shows


@dataclass(frozen=True)
class Position:
    """Ranks that hold alike: their coordinates (None: every rank of that axis), the global rank
    built for them, and how many ranks they are."""

    pp: int
    tp: int | None
    ep: int | None
    dp_shard: int | None
    rank: int
    ranks: int

    @property
    def name(self) -> str:
        coords = (("pp", self.pp), ("tp", self.tp), ("ep", self.ep), ("dp_shard", self.dp_shard))
        return " ".join(f"{axis} {v}" for axis, v in coords if v is not None)


def coordinates(rank: int, degrees: dict[str, int], ep: int) -> dict[str, int]:
    """A global rank's place on every mesh axis (parallel/mesh.py: pp outermost, tp fastest) and its ep rank
    (mesh.expert_partitions: its rank in the grad view dp_replicate x dp_shard x cp, modulo ep)."""
    out, rest = {}, rank
    for axis in reversed(AXES):
        out[axis], rest = rest % degrees[axis], rest // degrees[axis]
    grad = (out["dp_replicate"] * degrees["dp_shard"] + out["dp_shard"]) * degrees["cp"] + out["cp"]
    return {**out, "ep": grad % ep}


def positions(cfg: Config, derived: Derived, every: bool = False) -> list[Position]:
    """The distinct positions of a layout, in global rank order, each with its first rank (the
    module docstring says why only the pipeline rank matters unless `every`)."""
    p = cfg.parallel
    degrees = {"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": derived.dp_shard, "cp": p.cp, "tp": p.tp}
    apart = {"tp": every and p.tp > 1, "ep": every and p.ep > 1,
             "dp_shard": every and p.zero > 0 and derived.dp_shard > 1}
    found: dict[tuple, list[int]] = {}  # key -> [first rank, ranks]
    for rank in range(derived.world_size):
        c = coordinates(rank, degrees, p.ep)
        key = (c["pp"], *(c[axis] if apart[axis] else None for axis in ("tp", "ep", "dp_shard")))
        found.setdefault(key, [rank, 0])[1] += 1
    return [Position(*key, rank=first, ranks=n) for key, (first, n) in found.items()]


def hold_gradients(dp: DataParallel, zero: int, grad_accum: int,
                   offload: HostOffload | ParamOffload | None = None) -> None:
    """Give the tensors the gradients data parallel holds after a micro-batch's backward, at the
    largest such sample (module docstring), as meta tensors of their exact shapes. With `offload` the
    optimizer steps host copies; the gradients are the device's fp32 shards' all the same (offload =
    "params": the device keeps no shard, and its gradients are the host's)."""
    full = zero == 0 or (zero == 1 and grad_accum > 1)
    shards = offload.device_masters if offload is not None else dp.optimizer_params()
    tensors = dp.params if full else shards  # else the fp32 master shards' gradients
    for t in tensors:
        t.grad = torch.empty_like(t)


def build(cfg: Config, derived: Derived, rank: int) -> dict[str, int]:
    """Global rank `rank`'s model state as training would hold it (module docstring), built in a
    fake world of derived.world_size ranks on the meta device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=derived.world_size)
    try:
        mesh = Mesh.from_config(cfg, derived, "cpu", device=torch.device("meta"))
        par, _ = parallel_model(cfg, derived, mesh)
        if mesh.stats.snapshot():
            raise RuntimeError(f"the build of rank {rank} made collectives ({mesh.stats.snapshot()}); a fake "
                               "process group returns this rank's own data, so the dry run cannot trust it")
        init_optimizer_state(par.optimizer)
        hold_gradients(par.dp, cfg.parallel.zero, derived.grad_accum, par.offload)
        held = [*par.model.parameters(), *frozen_shards(par.dp, par.model.parameters())]  # frozen ones too
        return model_state_bytes(held, par.optimizer, par.offload)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class PositionReport:
    position: Position
    built: dict[str, int]  # params, grads, optimizer, total: counted from the storages
    predicted: dict[str, float]  # params, grads, optimizer, activations, buffers, total: the planner's
    capacity: float  # bytes of one device

    @property
    def built_state(self) -> int:
        return self.built["total"]

    @property
    def predicted_state(self) -> float:
        return sum(self.predicted[k] for k in STATE)

    @property
    def need(self) -> float:
        """Built model state + predicted activations + predicted buffers: what is compared with the capacity."""
        return self.built_state + self.predicted["activations"] + self.predicted["buffers"]

    @property
    def fits(self) -> bool:
        return self.need <= self.capacity

    def difference(self, part: str) -> float:
        """(built - predicted) / predicted of one part of model state, or "total"; 0 when both are 0."""
        built = self.built[part]
        predicted = self.predicted_state if part == "total" else self.predicted[part]
        return (built - predicted) / predicted if predicted else (0.0 if built == 0 else float("inf"))

    def overflow(self) -> str | None:
        """Why the position does not fit: the part that takes the sum past the capacity, and by how much."""
        if self.fits:
            return None
        parts = [("parameters", self.built["params"], "built"), ("gradients", self.built["grads"], "built"),
                 ("optimizer state", self.built["optimizer"], "built"),
                 ("activations", self.predicted["activations"], "predicted"),
                 ("buffers", self.predicted["buffers"], "predicted")]
        running = [sum(nbytes for _, nbytes, _ in parts[:i + 1]) for i in range(len(parts))]
        at = next((i for i, total in enumerate(running) if total > self.capacity), len(parts) - 1)
        what, source = parts[at][0], parts[at][2]
        terms = [f"{name} {size(nbytes)}" for name, nbytes, _ in parts[:at + 1]]
        p = self.position
        who = f"rank {p.rank}" + (f" and {p.ranks - 1} more like it" if p.ranks > 1 else "")
        return (f"{p.name} ({who}) does not fit: it needs {size(self.need)} of {size(self.capacity)}, "
                f"{size(self.need - self.capacity)} over; it overflows at the {what} ({source}): "
                f"{' + '.join(terms)} = {size(running[at])} > {size(self.capacity)}")


def dry_run(cfg: Config, derived: Derived, capacity: float, every: bool = False,
            progress: bool = True) -> list[PositionReport]:
    """Build every position of `cfg` on derived.world_size ranks (cfg must pass validate()) and set
    each beside the planner's prediction and the capacity."""
    if dist.is_initialized():
        raise RuntimeError("the dry run makes its own fake process group: call it outside any other")
    predicted = memory_per_pipeline_rank(cfg, derived.world_size, "cuda")
    p = cfg.parallel  # the pipeline's messages, proven once: every position runs the same schedule
    check_plans(build_schedule(p.pp_schedule, p.pp, derived.grad_accum, p.virtual_stages))
    todo = positions(cfg, derived, every)
    reports = []
    with progress_bar("dry run: building positions", len(todo),
                                            progress and len(todo) >= PROGRESS_FROM) as advance:
        for pos in todo:
            reports.append(PositionReport(pos, build(cfg, derived, pos.rank), predicted[pos.pp], capacity))
            advance()
    return reports


SIZES = (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3), ("B", 1.0))


def unit_for(nbytes: float) -> tuple[str, float]:
    """The largest unit (1e3 steps, as the planner counts) in which `nbytes` is at least 1."""
    return next(((name, size) for name, size in SIZES if nbytes >= size), SIZES[-1])


def size(nbytes: float) -> str:
    name, unit = unit_for(nbytes)
    return f"{nbytes / unit:.2f} {name}"


def format_report(cfg: Config, derived: Derived, reports: list[PositionReport], capacity_name: str,
                  seconds: float) -> str:
    """The header, one row per position (built beside predicted), and the verdict."""
    p = cfg.parallel
    degrees = [f"{axis} {n}" for axis, n in (("pp", p.pp), ("dp", derived.dp), ("cp", p.cp), ("tp", p.tp),
                                             ("ep", p.ep)) if n > 1]
    model = cfg.model.preset or f"a {cfg.model.n_layers}-layer model"
    capacity = reports[0].capacity
    lines = [
        f"dry run: {model} on {derived.world_size:,} ranks ({' x '.join(degrees) or 'one rank'}; zero {p.zero}; "
        f"{derived.grad_accum} micro-batches per step), {len(reports)} positions",
        "built: the storages parallelize() and AdamW leave, fp32 under any train.dtype; pred: the planner",
        f"capacity {capacity_name}: {size(capacity)} per device; fits: built state + acts* + bufs* (*: predicted)",
        *filter(None, [split_note(cfg, stage_split(cfg, derived.vocab_size))]),  # the runtime's split, as built
        "",
    ]
    unit, div = unit_for(max(r.need for r in reports))
    width = max([len(r.position.name) for r in reports] + [8])
    pair = 6 + 1 + 6
    head = (f"{'position':<{width}} {'rank':>6} {'ranks':>6}  " + "  ".join(
        f"{f'{part} {unit}':>{pair}}" for part in ("params", "grads", "optimizer", "state"))
        + f" {'diff':>7}  {'acts*':>7} {'bufs*':>6}  {'total':>7}  fits")
    sub = f"{'':<{width}} {'':>6} {'':>6}  " + "  ".join([f"{'built':>6} {'pred':>6}"] * 4)
    lines += [head, sub]
    for r in reports:
        pairs = [(r.built[k], r.predicted[k]) for k in STATE] + [(r.built_state, r.predicted_state)]
        cells = "  ".join(f"{b / div:>6.2f} {q / div:>6.2f}" for b, q in pairs)
        lines.append(f"{r.position.name:<{width}} {r.position.rank:>6} {r.position.ranks:>6}  {cells} "
                     f"{r.difference('total'):>+7.2%}  {r.predicted['activations'] / div:>7.2f} "
                     f"{r.predicted['buffers'] / div:>6.2f}  {r.need / div:>7.2f}  {'yes' if r.fits else 'NO'}")
    lines.append("")
    bad = [r.overflow() for r in reports if not r.fits]
    if bad:
        lines += [f"{len(bad)} of {len(reports)} positions do not fit:", *(f"  - {b}" for b in bad)]
    else:
        lines.append(f"every position fits (the fullest needs {size(max(r.need for r in reports))})")
    lines.append(f"({len(reports)} positions built in {seconds:.1f} s, in one process on the meta device)")
    return "\n".join(lines)
