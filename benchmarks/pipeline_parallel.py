"""Pipeline-parallel step time and peak memory: fivefold against torch.distributed.pipelining.

Run: `.venv/bin/python benchmarks/pipeline_parallel.py [--steps N] [--rounds R] [--quick] [--nproc 4]`
(extra `--section.key=value` arguments override the config, e.g. `--model.n_layers=16`).

What is compared, schedule by schedule, on the same ranks (2 by default: pp = 2, dp = 1, gloo,
CPU, fp32), the same model, initial weights and micro-batches:
1. `gpipe`:            fivefold "gpipe"            vs torch `ScheduleGPipe`;
2. `1f1b`:             fivefold "1f1b"             vs torch `Schedule1F1B`;
3. `interleaved_1f1b`: fivefold "interleaved_1f1b" vs torch `ScheduleInterleaved1F1B`, both with
                       2 stages per rank (stage s on rank s % pp);
4. `zb_h1`:            fivefold "zb_h1"            vs torch `ScheduleInterleavedZeroBubble` with one
                       stage per rank, which is ZB-H1: the same per-rank order of F, I, W (fivefold
                       has no interleaved zero-bubble schedule with more stages per rank);
5. `zb_v`:             fivefold "zb_v"             vs torch `ScheduleZBVZeroBubble` (V placement:
                       rank r holds stages r and 2pp-1-r, on both sides);
6. `dualpipe_v`:       fivefold "dualpipe_v"       vs torch `ScheduleDualPipeV` (V placement; torch
                       runs each overlapped F + B pair one after the other, as fivefold lists it).
Each pair's per-rank action order is the same (tests/test_schedules.py compares them with torch's
`pipeline_order`), so the two sides do the same work in the same order.
The model is fivefold's Transformer (`build_model`, seeded) from configs/tiny.toml with dim 128,
ffn 384, 8 layers, seq 128; a step is global batch 16 in m = 8 micro-batches of 2. fivefold runs it
the way train/step.py does: `parallelize()` (apply_pipeline_parallel + PipelineExecutor),
`pipeline.run()`, `optimizer_step()` (the global-norm clip over the pp group, AdamW). The torch side
builds, on each rank, one nn.Module per stage around the very same modules (embedding on the first
stage, its blocks, final norm + head on the last; RoPE tables computed in forward as fivefold's
StageChunk does), a `PipelineStage` with static example shapes (so no metadata travels at run time),
and the schedule with `loss_fn` = fivefold's `cross_entropy_sum` / global token count and
`scale_grads=False` (the loss is already divided by the step's token count, as fivefold's). It calls
`schedule.step(x, target=y, losses=..., return_outputs=False)` (x on the rank of the first stage,
target and losses on the rank of the last; fivefold keeps no logits either), clips with torch's
`get_total_norm` (the squared norm all-reduced over the pp group) and `clip_grads_with_norm_`, and
steps its own AdamW. Both optimizers come from `build_optimizer` (AdamW, foreach=False).
zero3_pipeline.py reuses both sides at dp = 2 (each dp rank stepping its rows of the global batch;
TorchSide on the pp group of a (pp, dp) mesh, its stage modules wrapped by FSDP2 in `shard`).

Loss check: the sum over micro-batches of the first step's loss (divided by the global token
count) must agree within 1e-5 absolute (`loss_check`); it is the same forward on the same weights
and data, so only summation order could differ (measured: 1.8e-7, the same on every schedule).

How time is measured: a step is the whole pipeline (all forwards and backwards with their
send/recv) + gradient clipping + the AdamW step, i.e. the optimizer is inside the timed region on
both sides; perf_counter on every rank, and a step's time is the slowest rank's. The launcher is
`fivefold.testing.run_workers` (forked gloo workers, one thread each, OMP_NUM_THREADS=1), as in
data_parallel.py: each round of a comparison gets a fresh set of workers holding both sides (each
with its own model copy, stages and optimizer), and the sides alternate step by step (A B, B A,
...), with a loss all-reduce (untimed) between steps that lines the ranks up; which side is built
and stepped first flips from round to round. Each side first runs `--warmup` untimed steps
(torch's one-off stage initialisation and P2P warm-up, allocator warm-up). The reported step
time is the median over all timed steps of all rounds (5 rounds by default); the spread is each
round's ratio of its two medians (`ratio_step_time_per_round`) and their min and max
(`ratio_step_time_min_max`), with each side's per-round medians.

How memory is measured: as data_parallel.py does, with the same helpers (common.py): one extra
untimed run per side and schedule (3 steps, fresh workers, that side alone) with glibc told to
return freed memory at once; the peak RSS (VmHWM, reset right before the model is built) minus file-backed and shared
RSS and minus the anonymous RSS at the reset. `*_peak_mb` is the maximum over ranks,
`*_peak_mb_per_rank` lists each rank's. It includes the full model built on every rank before
its stages are cut out (~7 MB here, the same on both sides).

`--profile` adds, per schedule, one fivefold-only run with the executor's clock on: from the
timeline (start, end, action), measured after each action's inputs arrived, it reports per rank
the time computing actions, the time waiting for inputs (recv) and the rest of the step (final
send waits, clipping, optimizer).

Reading the numbers: absolute times on a shared 2-core machine are noise; the ratios
fivefold / torch between alternated runs are what to read (below 1: fivefold faster or smaller),
and even they move by a few percent between invocations. With `--nproc 4` (pp = 4) the 2 cores
are oversubscribed: the numbers are reported with no target. Output: progress and checks on
stderr; on stdout one JSON object per schedule, and last a summary object whose measured ratios
have "ratio" in their keys (targets from the issue, at 2 processes, printed beside them, not
asserted: step time and peak memory each <= 1.0 of torch's, on every schedule).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    comparison_record,
    finish_summary,
    log,
    make_parser,
    measure_peak,
    median,
    memory_fields,
    memory_over_ranks,
    memory_runs,
    parse,
    prewarm,
    report,
    slowest_rank,
    timed_rounds,
)
from fivefold.attention import rope_cos_sin  # noqa: E402
from fivefold.config import Config, load_config, replace  # noqa: E402
from fivefold.mesh import Mesh  # noqa: E402
from fivefold.model import Transformer, cross_entropy_sum  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.parallel.pipeline import stage_layers  # noqa: E402
from fivefold.parallel.schedules import build_schedule  # noqa: E402
from fivefold.parallel.stage_split import stage_split  # noqa: E402
from fivefold.testing import run_workers  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.optim import build_optimizer  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402
from fivefold.validate import derive, tokenizer_vocab  # noqa: E402

torch.set_num_threads(1)

# fivefold schedule name -> (torch schedule class, stages per rank). Each pair runs the same
# per-rank action order (tests/test_schedules.py checks it against torch's pipeline_order):
# ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1, fivefold's "zb_h1" (fivefold has
# no interleaved zero-bubble schedule with v > 1); DualPipeV's overlapped F + B pairs run one after
# the other in torch too (no overlap on one CPU thread), as fivefold lists them.
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "zb_h1": (ScheduleInterleavedZeroBubble, 1),
    "zb_v": (ScheduleZBVZeroBubble, 2),
    "dualpipe_v": (ScheduleDualPipeV, 2),
}
# fivefold / torch at 2 processes, from the issue: no slower and no larger than torch on any schedule
TARGETS = {f"{name}_ratio_{what}": 1.0 for name in SCHEDULES for what in ("step_time", "peak_memory")}
TARGET_NPROC = 2


def schedule_cfg(cfg: Config, name: str) -> Config:
    return replace(cfg, parallel={"pp_schedule": name, "virtual_stages": SCHEDULES[name][1]})


def global_batches(cfg: Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n global batches (inputs, targets), (global_batch, T) each; the same in every run and rank."""
    t = cfg.train
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(t.seed * 100_003 + step)
        tokens = torch.randint(0, 256, (t.global_batch, t.seq_len + 1), generator=g)  # (B_global, T+1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


# ---- the torch side ---------------------------------------------------------------------------------
class TorchStage(nn.Module):
    """One pipeline stage for torch.distributed.pipelining, around modules of a fivefold Transformer."""

    def __init__(self, model: Transformer, layers: list[str], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[name] for name in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.head_dim, self.rope_theta = model.head_dim, model.cfg.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, dim)
        cos, sin = rope_cos_sin(torch.arange(h.shape[1], device=h.device), self.head_dim, self.rope_theta)
        for block in self.layers:
            h = block(h, cos, sin)
        if self.output is not None:
            h = self.output(self.norm(h))  # (B, T, V)
        return h


class FivefoldSide:
    """fivefold's pipeline on this rank, stepped as train/loop.py steps it."""

    kind = "fivefold"

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        derived = derive(cfg, mesh.world_size)
        self.par = parallelize(build_model(cfg, derived.vocab_size), mesh, cfg, derived)
        self.scaler = LossScaler(cfg.train)  # fp32: a scale of 1 that never skips
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []
        self.comm: list[dict[str, dict[str, float]]] = []
        self.timelines: list[list[tuple[float, float, str]]] = []
        self.step_spans: list[tuple[float, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        t, par, mesh = self.cfg.train, self.par, self.mesh
        mesh.stats.reset()
        rows = x.shape[0] // mesh.size("batch")  # this dp rank's rows of the global batch, as rank_slice takes them
        mine = slice(mesh.rank("batch") * rows, (mesh.rank("batch") + 1) * rows)
        micro = list(zip(x[mine].split(t.micro_batch), y[mine].split(t.micro_batch), strict=True))  # in order
        stats = par.pipeline.run(micro, x.numel(), clock=clock)
        par.optimizer_step(t.lr, self.scaler, t.grad_clip, stop_on_nonfinite=True)
        self.comm.append(mesh.stats.snapshot())  # this step's traffic per axis, as train_step's metrics "comm"
        if clock:
            self.timelines.append(stats.timeline)
        return stats.loss  # this rank's sum of micro-batch losses (0 off the last stage)


class TorchSide:
    """torch.distributed.pipelining with the same stages, loss, clipping and AdamW. `pp_group`: the
    stages' group (default: every rank, dp = 1); with dp > 1 ranks are pp-major as fivefold's mesh, a
    subclass's `shard` adds data parallel, which averages over dp (so the loss / this dp rank's tokens)."""

    kind = "torch"

    def __init__(self, cfg: Config, world: int, name: str, pp_group: dist.ProcessGroup | None = None):
        t, m = cfg.train, cfg.model
        self.cfg = cfg
        self.group = dist.group.WORLD if pp_group is None else pp_group
        pp = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)  # this rank's place in the pipeline
        self.dp, self.dp_rank = world // pp, dist.get_rank() % (world // pp)
        cls, v = SCHEDULES[name]
        n_stages, n_micro = pp * v, t.global_batch // (self.dp * t.micro_batch)
        vocab = derive(cfg, world).vocab_size
        model = build_model(cfg, vocab)
        layers = stage_layers(stage_split(cfg, vocab))  # fivefold's blocks per stage
        # fivefold's placement, which is torch's: stage s on rank s % pp ("loop"), or r and 2pp-1-r ("v")
        to_rank = build_schedule(name, pp, n_micro, v).stage_to_rank
        mine = [s for s in range(n_stages) if to_rank(s) == self.rank]
        self.modules = [TorchStage(model, layers[s], s == 0, s == n_stages - 1) for s in mine]
        del model  # what no stage of this rank uses is freed with it
        for module in self.modules:
            self.shard(module)
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        mb, T = t.micro_batch, t.seq_len
        stages = []
        for s, module in zip(mine, self.modules, strict=True):
            # Static example shapes: non-first inputs and every output need requires_grad (docs/torch-cpu-notes.md).
            inp = (torch.zeros(mb, T, dtype=torch.long) if s == 0
                   else torch.zeros(mb, T, m.dim, requires_grad=True))
            out = torch.zeros(mb, T, vocab if s == n_stages - 1 else m.dim, requires_grad=True)
            stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"), input_args=(inp,),
                                        output_args=(out,), group=self.group))
        rank_tokens = t.global_batch * T // self.dp  # the tokens of this dp rank's rows, of every micro-batch

        real = tokenizer_vocab(cfg)  # fivefold masks the padding ids out of the loss; so does this side

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return cross_entropy_sum(logits[..., :real], target) / rank_tokens

        self.schedule = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], n_micro,
                            loss_fn=loss_fn, scale_grads=False)
        holder = nn.ModuleList(self.modules)
        self.params = [p for p in holder.parameters() if p.requires_grad]
        self.opt = build_optimizer(holder, t)  # after `shard`: FSDP2 steps the DTensor shards
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []

    def shard(self, module: nn.Module) -> None:
        """Data parallel for one stage module: none here (dp = 1)."""

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        rows = x.shape[0] // self.dp  # this dp rank's rows of the global batch, as fivefold takes them
        x, y = (z[self.dp_rank * rows : (self.dp_rank + 1) * rows] for z in (x, y))
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # FSDP2: the shards' norm, reduced over dp
            norm = norm.full_tensor()
        sq = norm.double() ** 2  # this rank's part of the global norm
        dist.all_reduce(sq, group=self.group)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.train.grad_clip, sq.sqrt().float())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(float(loss.detach()) for loss in losses) / self.dp  # summed over ranks: the mean over dp


def _make_side(kind: str, cfg: Config, world: int, name: str, mesh: Mesh):
    return FivefoldSide(cfg, mesh) if kind == "fivefold" else TorchSide(cfg, world, name)


def timed_step(side, x: torch.Tensor, y: torch.Tensor, clock=None) -> None:
    cpu, began = time.process_time(), time.perf_counter()
    loss = side.step(x, y, clock)
    ended = time.perf_counter()
    side.times.append(ended - began)
    side.cpu_times.append(time.process_time() - cpu)  # every thread of the process: gloo's, the send waiter
    if clock:
        side.step_spans.append((began, ended))
    total = torch.tensor(loss, dtype=torch.float64)  # outside the timed region; lines the ranks up
    dist.all_reduce(total)
    side.losses.append(float(total))


# ---- workers -------------------------------------------------------------------------------------------
def _timed_worker(rank: int, world: int, name: str, kinds: tuple[str, str], cfg: Config, warmup: int,
                  steps: int) -> list[dict]:
    """Both sides in these processes, alternating step by step (A B, B A, ...) after their warm-up."""
    cfg = schedule_cfg(cfg, name)
    mesh = Mesh.from_config(cfg, derive(cfg, world))
    sides = [_make_side(kind, cfg, world, name, mesh) for kind in kinds]
    return alternate(sides, global_batches(cfg, warmup + steps), warmup, timed_step)


def _memory_worker(rank: int, world: int, name: str, kind: str, cfg: Config, steps: int) -> dict:
    """One side alone, glibc returning freed memory: its peak RSS above the pre-model baseline."""
    cfg = schedule_cfg(cfg, name)
    mesh = Mesh.from_config(cfg, derive(cfg, world))  # process groups exist before the baseline

    def run() -> FivefoldSide | TorchSide:
        side = _make_side(kind, cfg, world, name, mesh)
        for x, y in global_batches(cfg, steps):
            timed_step(side, x, y)
        return side

    return measure_peak(run)


def _profile_worker(rank: int, world: int, name: str, cfg: Config, warmup: int, steps: int) -> dict:
    """fivefold alone with the executor's clock: compute, input waits and the rest, per step."""
    cfg = schedule_cfg(cfg, name)
    side = FivefoldSide(cfg, Mesh.from_config(cfg, derive(cfg, world)))
    for i, (x, y) in enumerate(global_batches(cfg, warmup + steps)):
        timed_step(side, x, y, clock=time.perf_counter if i >= warmup else None)
    parts = {"compute": [], "wait_inputs": [], "other": [], "step": []}
    for (began, ended), timeline in zip(side.step_spans, side.timelines, strict=True):
        compute = sum(e - s for s, e, _ in timeline)
        # Before each action: the gap since the previous one ended (or since the step began) is
        # the wait for its input (a recv); after the last action: final send waits, clip, AdamW.
        waits = sum(s - prev for (s, _, _), prev in zip(timeline, [began] + [e for _, e, _ in timeline[:-1]],
                                                        strict=True))
        parts["compute"].append(compute)
        parts["wait_inputs"].append(waits)
        parts["other"].append(ended - timeline[-1][1])
        parts["step"].append(ended - began)
    return {k: round(median(v), 4) for k, v in parts.items()}


# ---- driver ----------------------------------------------------------------------------------------------
def run_timed(name: str, kinds: tuple[str, str], cfg: Config, world: int, warmup: int, steps: int) -> dict:
    results = run_workers(_timed_worker, world, name, kinds, cfg, warmup, steps, timeout=300.0)  # [rank][side]
    return slowest_rank(results, kinds)


def run_memory(name: str, kind: str, cfg: Config, world: int, steps: int) -> dict:
    return memory_over_ranks(run_workers(_memory_worker, world, name, kind, cfg, steps, timeout=300.0))


def summarize(name: str, runs: dict[str, list[dict]], mem: dict[str, dict], steps: int, rounds: int) -> dict:
    head = {"name": name, "fivefold": f"fivefold '{name}'", "torch": SCHEDULES[name][0].__name__,
            "stages_per_rank": SCHEDULES[name][1]}
    memory = memory_fields(mem["fivefold"], mem["torch"], fields=("peak_mb", "ratio", "per_rank", "peak_rss_mb"))
    return comparison_record(head, runs["fivefold"], runs["torch"], memory, steps, rounds)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), SCHEDULES, steps=6, rounds=5, unit="schedule")
    parser.add_argument("--nproc", type=int, default=2, help="ranks = pipeline stages (pp); targets apply at 2")
    parser.add_argument("--profile", action="store_true",
                        help="also time fivefold's executor actions (compute vs input waits) per schedule")
    args, overrides = parse(parser, argv)
    world = args.nproc
    cfg = load_config(args.config, [
        "--model.dim=128", "--model.ffn_dim=384", "--model.n_layers=8", "--train.seq_len=128",
        "--train.micro_batch=2", "--train.global_batch=16", "--train.dtype=fp32", "--train.device=cpu",
        f"--parallel.pp={world}", "--parallel.dp=1", *overrides])
    m, t = cfg.model, cfg.train
    n_micro = t.global_batch // t.micro_batch
    n_params = sum(p.numel() for p in build_model(cfg, derive(cfg, world).vocab_size).parameters())
    prewarm()
    log(f"model dim {m.dim}, ffn {m.ffn_dim}, {m.n_layers} layers, {n_params / 1e6:.2f}M params; pp {world}, "
        f"global batch {t.global_batch} = {n_micro} micro-batches x {t.micro_batch} x seq {t.seq_len}, fp32; "
        f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps per run, then a memory run "
        f"each; optimizer (AdamW) inside the timed step on both sides")

    began = time.perf_counter()
    runs = timed_rounds(args.only, args.rounds,
                        lambda name, kinds: run_timed(name, kinds, cfg, world, args.warmup, args.steps), began, 17)
    # 3 steps: the optimizer state exists from the first step on
    mem = memory_runs(args.only, lambda name, kind: run_memory(name, kind, cfg, world, 3), began, 17)
    profiles = {}
    if args.profile:
        for name in args.only:
            profiles[name] = run_workers(_profile_worker, world, name, cfg, args.warmup, args.steps, timeout=300.0)
            log(f"profile {name:17s} fivefold per rank (median s/step): "
                + "; ".join(f"rank {r}: " + ", ".join(f"{k} {v:.4f}" for k, v in p.items())
                            for r, p in enumerate(profiles[name]))
                + f"  [{time.perf_counter() - began:.0f} s]")

    summary: dict = {"summary": True, "nproc": world}
    for name in args.only:
        out = summarize(name, runs[name], mem[name], args.steps, args.rounds)
        if name in profiles:
            out["fivefold_profile_per_rank"] = profiles[name]
        report(name, out, summary, {f"{name}_ratio_step_time": "ratio_step_time",
                                    f"{name}_ratio_step_time_min_max": "ratio_step_time_min_max",
                                    f"{name}_ratio_step_time_paired_median": "ratio_step_time_paired_median",
                                    f"{name}_ratio_cpu_time": "ratio_cpu_time",
                                    f"{name}_ratio_peak_memory": "ratio_peak_memory"})
    if world == TARGET_NPROC:
        finish_summary(summary, TARGETS, began)
    else:
        finish_summary(summary, None, began, note=f"targets apply at {TARGET_NPROC} processes; "
                                                  f"{world} oversubscribe the 2 cores")


if __name__ == "__main__":
    main()
