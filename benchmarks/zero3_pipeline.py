"""ZeRO-3 with pipelines: fivefold against FSDP2 `fully_shard` composed with torch.distributed.pipelining.

Run: `.venv/bin/python benchmarks/zero3_pipeline.py [--steps N] [--rounds R] [--quick] [--only 1f1b ...]`
(extra `--section.key=value` arguments override the config, e.g. `--model.n_layers=16`).

World 4 = pp 2 x dp 2 (gloo, CPU, fp32, one thread per rank: the 2 cores are oversubscribed, so
read the ratios, not the times). Ranks are pp-major on both sides (rank = pp_rank * dp + dp_rank,
fivefold's mesh order and a torch `init_device_mesh("cpu", (pp, dp))`). The model, initial weights,
global batches, schedules and the torch stage modules are pipeline_parallel.py's (imported from
it): fivefold's Transformer from configs/tiny.toml with dim 128, ffn 384, 8 layers, seq 128; a
step is global batch 32, each dp rank taking its 16 rows in m = 8 micro-batches of 2.
- fivefold: `parallel.zero = 3`, `pp = 2`, `dp = 2` through `parallelize()`, with
  `reshard_after_forward = "auto"`, which keeps a chunk's units gathered from their first forward
  of the step to the chunk's last backward, where the gradients are reduce-scattered once
  (fsdp.py's docstring); `pipeline.run()`, then `optimizer_step()` (clip, AdamW on the shards).
- torch, composed as torchtitan composes them: each stage module (pipeline_parallel.TorchStage)
  gets `fully_shard(..., reshard_after_forward=False)` on the dp axis of a 2-D (pp, dp) device mesh
  per unit: the embedding (first stage), each block, final norm + head together (last stage), then
  the stage module as the root; the `PipelineStage` runs on the pp axis's group. The schedule's
  `backward_maybe_with_nosync` keeps the gradient sync off during every backward and its
  `perform_reduce_grad` (after a stage's last backward) reduce-scatters once. FSDP2 averages over
  dp, so the torch loss is divided by this dp rank's token count (fivefold sums over dp a loss
  divided by the global count: the same gradient). Clipping: the DTensor norm reduced over dp
  (`full_tensor`), squared, all-reduced over pp; AdamW from `build_optimizer` on the shards.

Schedules: `1f1b` (Schedule1F1B), `interleaved_1f1b` (ScheduleInterleaved1F1B, 2 stages per rank),
and the zero-bubble ones pipeline_parallel.py pairs: `zb_h1`, `zb_v`, `dualpipe_v` (see `--only`).

Printed per schedule (common.py's record, as the other benchmarks): step time fivefold / torch as
the median over all timed steps of `--rounds` alternating rounds (sides alternate step by step
inside a round; the side stepped first flips per round), the per-round ratios and their min/max,
the step-by-step median and IQR, CPU seconds (all ranks) per step, peak memory (one memory run
per side, glibc returning freed memory: common.measure_peak) and the first step's loss on both
sides (must agree within 1e-5). Beside them the dp wire bytes of one step per rank: fivefold's
counted ones (mesh.stats, the "dp" axis, as train_step's metrics `comm`), torch's (its flat
all-gathers and reduce-scatters under the names its torch has, common.counting_collectives, counted
while its step runs, with the same ring formula comms.wire_bytes uses), and the formula 2 (N-1)/N x P
for one gather and one reduce-scatter of this rank's P parameter bytes per step.
"""

from __future__ import annotations

import contextlib
import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Iterator  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    comparison_record,
    counting_collectives,
    finish_summary,
    log,
    make_parser,
    measure_peak,
    memory_fields,
    memory_over_ranks,
    memory_runs,
    parse,
    prewarm,
    report,
    slowest_rank,
    timed_rounds,
)
from benchmarks.pipeline_sides import (  # noqa: E402
    SCHEDULES,
    FivefoldSide,
    TorchSide,
    TorchStage,
    global_batches,
    schedule_cfg,
    timed_step,
)
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import unpadded_vocab  # noqa: E402
from fivefold.parallel.comm.collectives import wire_bytes  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402

torch.set_num_threads(1)

PP, DP = 2, 2
NAMES = ["1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v"]
MB = 1e6


@contextlib.contextmanager
def counting_fsdp_collectives(counts: dict[str, float]) -> Iterator[None]:
    """Count the wire bytes of FSDP2's all-gathers and reduce-scatters per op, and their calls,
    while the block runs (common.counting_collectives)."""
    def record(op: str, group, nbytes: float) -> None:
        counts[op] = counts.get(op, 0.0) + nbytes
        counts["calls"] = counts.get("calls", 0) + 1

    with counting_collectives(record, ("all_gather", "reduce_scatter")):
        yield


class FivefoldZero3(FivefoldSide):
    """fivefold ZeRO-3 (parallel.zero = 3) with the pipeline, stepped as pipeline_parallel.py steps it."""

    def param_bytes(self) -> int:
        """This rank's P: the full (gathered) bytes of its stages' parameters."""
        return sum(p.numel() * p.element_size() for p in self.par.model.parameters())

    def dp_wire(self) -> dict[str, float]:
        last = self.comm[-1].get("dp", {})
        return {"wire_bytes": last.get("wire_bytes", 0.0), "calls": last.get("calls", 0)}


class TorchFsdp2(TorchSide):
    """FSDP2 `fully_shard` on the dp axis around each stage module, the stages on the pp axis."""

    def __init__(self, cfg: Config, world: int, name: str, mesh: DeviceMesh):
        self.dp_mesh = mesh["dp"]
        self.comm: list[dict[str, float]] = []
        super().__init__(cfg, world, name, pp_group=mesh.get_group("pp"))

    def shard(self, module: TorchStage) -> None:
        # torchtitan's units: the embedding, each block, final norm + head, and the stage as the root.
        # Kept unsharded through the step: the pipeline's next micro-batch needs them soon again.
        kw = {"mesh": self.dp_mesh, "reshard_after_forward": False}
        if module.tok_embeddings is not None:
            fully_shard(module.tok_embeddings, **kw)
        for block in module.layers:
            fully_shard(block, **kw)
        if module.output is not None:
            fully_shard([module.norm, module.output], **kw)
        fully_shard(module, **kw)

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        counts: dict[str, float] = {}
        with counting_fsdp_collectives(counts):
            loss = super().step(x, y, clock)
        self.comm.append(counts)
        return loss

    def param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)  # a DTensor's numel is the full one

    def dp_wire(self) -> dict[str, float]:
        last = self.comm[-1]
        return {"wire_bytes": last.get("all_gather", 0.0) + last.get("reduce_scatter", 0.0),
                "calls": last.get("calls", 0)}


def _meshes(cfg: Config, world: int) -> tuple[Mesh, DeviceMesh]:
    return (Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg))),
            init_device_mesh("cpu", (PP, world // PP), mesh_dim_names=("pp", "dp")))


def _make_side(kind: str, cfg: Config, world: int, name: str, meshes: tuple[Mesh, DeviceMesh]):
    return FivefoldZero3(cfg, meshes[0]) if kind == "fivefold" else TorchFsdp2(cfg, world, name, meshes[1])


def _traffic(side) -> dict:
    """This rank's dp traffic in the last step, and the formula 2 (N-1)/N x P."""
    p = side.param_bytes()
    return {**side.dp_wire(), "formula": 2 * wire_bytes("all_gather", p, DP), "param_bytes": p}


# ---- workers -------------------------------------------------------------------------------------------
def _timed_worker(rank: int, world: int, name: str, kinds: tuple[str, str], cfg: Config, warmup: int,
                  steps: int) -> list[dict]:
    cfg = schedule_cfg(cfg, name)
    meshes = _meshes(cfg, world)
    sides = [_make_side(kind, cfg, world, name, meshes) for kind in kinds]
    results = alternate(sides, global_batches(cfg, warmup + steps), warmup, timed_step)
    for res, side in zip(results, sides, strict=True):
        res["traffic"] = _traffic(side)
    return results


def _memory_worker(rank: int, world: int, name: str, kind: str, cfg: Config, steps: int) -> dict:
    cfg = schedule_cfg(cfg, name)
    meshes = _meshes(cfg, world)  # process groups exist before the baseline

    def run():
        side = _make_side(kind, cfg, world, name, meshes)
        for x, y in global_batches(cfg, steps):
            timed_step(side, x, y)
        return side

    return measure_peak(run)


# ---- driver ----------------------------------------------------------------------------------------------
def run_timed(name: str, kinds: tuple[str, str], cfg: Config, world: int, warmup: int, steps: int) -> dict:
    results = run_workers(_timed_worker, world, name, kinds, cfg, warmup, steps, timeout=600.0)  # [rank][side]
    out = slowest_rank(results, kinds)
    for i, kind in enumerate(kinds):
        out[kind]["traffic"] = [r[i]["traffic"] for r in results]  # per rank
    return out


def run_memory(name: str, kind: str, cfg: Config, world: int, steps: int) -> dict:
    return memory_over_ranks(run_workers(_memory_worker, world, name, kind, cfg, steps, timeout=600.0))


def summarize(name: str, runs: dict[str, list[dict]], mem: dict[str, dict], steps: int, rounds: int) -> dict:
    head = {"name": name, "fivefold": f"fivefold zero 3 '{name}'",
            "torch": f"fully_shard + {SCHEDULES[name][0].__name__}", "stages_per_rank": SCHEDULES[name][1]}
    memory = memory_fields(mem["fivefold"], mem["torch"], fields=("peak_mb", "ratio", "per_rank", "peak_rss_mb"))
    record = comparison_record(head, runs["fivefold"], runs["torch"], memory, steps, rounds)
    ours, theirs = runs["fivefold"][-1]["traffic"], runs["torch"][-1]["traffic"]  # the last round's last step
    record.update({
        "dp_wire_mb_per_rank": {"fivefold": [round(t["wire_bytes"] / MB, 4) for t in ours],
                                "torch": [round(t["wire_bytes"] / MB, 4) for t in theirs],
                                "formula_2(N-1)/N_P": [round(t["formula"] / MB, 4) for t in ours]},
        "dp_calls_per_rank": {"fivefold": [t["calls"] for t in ours], "torch": [t["calls"] for t in theirs]},
        "ratio_dp_wire_over_formula": max(t["wire_bytes"] / t["formula"] for t in ours),
        "param_mb_per_rank": [round(t["param_bytes"] / MB, 4) for t in ours],
    })
    return record


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), NAMES, steps=6, rounds=5, unit="schedule")
    args, overrides = parse(parser, argv)
    world = PP * DP
    cfg = load_config(args.config, [
        "--model.dim=128", "--model.ffn_dim=384", "--model.n_layers=8", "--train.seq_len=128",
        "--train.micro_batch=2", "--train.global_batch=32", "--train.dtype=fp32", "--train.device=cpu",
        f"--parallel.pp={PP}", f"--parallel.dp={DP}", "--parallel.zero=3", *overrides])
    m, t = cfg.model, cfg.train
    n_micro = t.global_batch // (DP * t.micro_batch)
    n_params = sum(p.numel() for p in build_model(cfg, derive(cfg, world, unpadded_vocab(cfg)).vocab_size).parameters())
    prewarm()
    log(f"model dim {m.dim}, ffn {m.ffn_dim}, {m.n_layers} layers, {n_params / 1e6:.2f}M params; pp {PP} x dp {DP}, "
        f"zero 3; global batch {t.global_batch}: {n_micro} micro-batches x {t.micro_batch} x seq {t.seq_len} per dp "
        f"rank, fp32; {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps per run, then a "
        f"memory run each; {world} ranks on the machine's cores")

    began = time.perf_counter()
    runs = timed_rounds(args.only, args.rounds,
                        lambda name, kinds: run_timed(name, kinds, cfg, world, args.warmup, args.steps), began, 17)
    mem = memory_runs(args.only, lambda name, kind: run_memory(name, kind, cfg, world, 3), began, 17)

    summary: dict = {"summary": True, "layout": f"pp{PP}-dp{DP}-zero3"}
    for name in args.only:
        out = summarize(name, runs[name], mem[name], args.steps, args.rounds)
        wire = out["dp_wire_mb_per_rank"]
        log(f"{name}: dp wire MB per rank per step: fivefold {wire['fivefold']}, torch {wire['torch']}, "
            f"2 (N-1)/N P {wire['formula_2(N-1)/N_P']}")
        report(name, out, summary, {f"{name}_ratio_step_time": "ratio_step_time",
                                    f"{name}_ratio_step_time_min_max": "ratio_step_time_min_max",
                                    f"{name}_ratio_cpu_time": "ratio_cpu_time",
                                    f"{name}_ratio_peak_memory": "ratio_peak_memory",
                                    f"{name}_ratio_dp_wire_over_formula": "ratio_dp_wire_over_formula"})
    finish_summary(summary, None, began, note=f"no target; {world} ranks oversubscribe a 2-core machine")


if __name__ == "__main__":
    main()
