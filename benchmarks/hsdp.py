"""HSDP with gradient accumulation: fivefold against FSDP2 on a 2-D (replicate, shard) mesh.

Run: `.venv/bin/python benchmarks/hsdp.py [--steps N] [--quick]` (extra `--section.key=value`
arguments override the config, e.g. `--train.micro_batch=2`).

World 4 = dp_replicate 2 x dp_shard 2 (gloo, CPU, fp32, one thread per rank), ranks
replicate-major on both sides (fivefold's mesh order; torch's `init_device_mesh("cpu", (2, 2))`).
The model is fivefold's Transformer from configs/tiny.toml with dim 128, ffn 384, 4 layers, seq 64;
a step is a global batch of 16, each rank taking its 4 rows in M = 4 micro-batches of 1. On a real
cluster the shard groups sit inside a node and the replica groups span nodes: the replicas' bytes
are the ones that cross the slow link.
- `fivefold`: `parallel.zero = 3`, `dp_replicate = 2` (resharding, the default without pipelines)
  through `parallelize()`, stepped as train/loop.py steps it: reduce-scatters on every
  micro-batch, the replicas' all-reduce once, at the last (parallel/data/zero.py).
- `fsdp2`: `fully_shard` (each block, then the root; reshard_after_forward=True) on the 2-D mesh,
  a plain loop of M forward-backwards, then clip and AdamW: FSDP2's default, which all-reduces over
  the replicas after every micro-batch's reduce-scatter.
- `fsdp2_accum`: the same with `set_requires_all_reduce(False)` before all but the last
  micro-batch, FSDP2's own way to accumulate under HSDP.
FSDP2 averages over its 4 data-parallel ranks, so its loss is divided by this rank's token count;
fivefold sums a loss divided by the global count: the same gradient. The first step's losses must
agree (common.LOSS_TOL).

Counted: every all_reduce, flat reduce-scatter and all-gather (their names in the running torch:
common.counting_collectives) that either side calls on torch.distributed during its last step, by
the group it runs on (a shard group, a replica group, or another: the loss and the gradient norm),
as wire bytes per rank with comms.wire_bytes' ring formula. Printed per side: those bytes and calls
per group kind, the ratios fivefold / each FSDP2 side, and the step time fivefold / fsdp2 (median over
the timed steps, sides alternating step by step: common.alternate; the machine's 2 cores run 4 ranks,
so read the ratio, not the times).
Progress and the indented summary go to stderr, the summary as one JSON line to stdout.
"""

from __future__ import annotations

import json
import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from benchmarks.common import LOSS_TOL, alternate, counting_collectives, log, median, ratio  # noqa: E402
from benchmarks.pipeline_sides import FivefoldSide, global_batches, timed_step  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import ConfigError, load_config  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import tokenizer_vocab, unpadded_vocab  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.validate import validate  # noqa: E402

torch.set_num_threads(1)

WORLD, REPLICAS = 4, 2
SIDES = ("fivefold", "fsdp2", "fsdp2_accum")
CONFIG = ("--model.dim=128", "--model.ffn_dim=384", "--model.n_layers=4", "--train.seq_len=64",
          "--train.global_batch=16", "--train.micro_batch=1", "--parallel.zero=3",
          f"--parallel.dp_replicate={REPLICAS}")


def group_kind(group: dist.ProcessGroup | None) -> str:
    """"shard" (ranks 2k, 2k+1), "replica" (ranks k, k+2) or "other" (the world: loss, norm)."""
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    if len(ranks) == WORLD // REPLICAS and ranks[1] - ranks[0] == 1:
        return "shard"
    if len(ranks) == REPLICAS and ranks[1] - ranks[0] == WORLD // REPLICAS:
        return "replica"
    return "other"


class Counted:
    """A side whose last step's collectives are counted."""

    def __init__(self, side):
        self.side, self.comm = side, {}
        self.times, self.cpu_times, self.losses = side.times, side.cpu_times, side.losses

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        self.comm = {}

        def record(op: str, group: dist.ProcessGroup | None, nbytes: float) -> None:
            kind = self.comm.setdefault(group_kind(group), {"wire_bytes": 0.0, "calls": 0})
            kind["wire_bytes"] += nbytes
            kind["calls"] += 1

        with counting_collectives(record):  # all_reduce, reduce_scatter, all_gather: this torch's names
            return self.side.step(x, y, clock)


class Fsdp2Hsdp:
    """FSDP2 on the (replicate, shard) mesh: M forward-backwards, clip, AdamW."""

    def __init__(self, cfg: Config, accumulate: bool):
        self.cfg, self.accumulate = cfg, accumulate
        mesh = init_device_mesh("cpu", (REPLICAS, WORLD // REPLICAS), mesh_dim_names=("replicate", "shard"))
        self.model = build_model(cfg, derive(cfg, WORLD, unpadded_vocab(cfg)).vocab_size)
        for block in self.model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = build_optimizer(self.model, cfg.optim)
        self.real = tokenizer_vocab(cfg)  # fivefold leaves the padding ids out of the softmax; so does this side
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        t = self.cfg.train
        rows = x.shape[0] // WORLD  # this rank's rows of the global batch, as fivefold takes them
        x, y = (z[dist.get_rank() * rows : (dist.get_rank() + 1) * rows] for z in (x, y))
        micro = list(zip(x.split(t.micro_batch), y.split(t.micro_batch), strict=True))
        total = 0.0
        for i, (xm, ym) in enumerate(micro):
            if self.accumulate:
                self.model.set_requires_all_reduce(i == len(micro) - 1)
            loss = cross_entropy_sum(self.model(xm)[..., : self.real], ym) / x.numel()  # FSDP2 averages over ranks
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total / WORLD  # summed over ranks by timed_step: the mean over every token


def _worker(rank: int, world: int, cfg: Config, warmup: int, steps: int) -> dict:
    mesh = Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg)))
    sides = [Counted(FivefoldSide(cfg, mesh)), Counted(Fsdp2Hsdp(cfg, False)), Counted(Fsdp2Hsdp(cfg, True))]
    results = alternate(sides, global_batches(cfg, warmup + steps), warmup, timed_step)
    return {name: {**res, "comm": side.comm} for name, res, side in zip(SIDES, results, sides, strict=True)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 timed steps: checks that it runs")
    args, overrides = parser.parse_known_args(argv)
    try:  # a bad override is one line naming it, before any worker starts
        cfg = load_config(ROOT / "configs" / "tiny.toml", [*CONFIG, *overrides])
        errors = validate(cfg, WORLD)
        if errors:
            raise ConfigError(errors)
    except ConfigError as e:
        log(f"benchmarks/hsdp.py: {e}")
        return 2
    steps = 2 if args.quick else args.steps
    ranks = run_workers(_worker, WORLD, cfg, args.warmup, steps, timeout=1800)
    micro_batches = derive(cfg, WORLD, unpadded_vocab(cfg)).grad_accum
    summary: dict = {"world": WORLD, "replicas": REPLICAS, "micro_batches": micro_batches, "steps": steps}
    first = {name: ranks[0][name]["losses"][0] for name in SIDES}
    summary["loss_check"] = {"first_step": first, "ok": all(abs(v - first["fivefold"]) < LOSS_TOL
                                                             for v in first.values())}
    for name in SIDES:  # the collectives of one step, the most over ranks (all ranks send the same)
        kinds = sorted({k for r in ranks for k in r[name]["comm"]})
        summary[name] = {k: {"wire_mb": round(max(r[name]["comm"].get(k, {}).get("wire_bytes", 0.0)
                                                  for r in ranks) / 1e6, 3),
                             "calls": max(r[name]["comm"].get(k, {}).get("calls", 0) for r in ranks)} for k in kinds}
        times = [max(ts) for ts in zip(*(r[name]["times"] for r in ranks), strict=True)]  # the slowest rank's
        summary[name]["step_s"] = round(median(times), 4)
    ours = summary["fivefold"]
    summary["ratios"] = {
        f"replica bytes fivefold / {peer}": ratio(ours["replica"]["wire_mb"], summary[peer]["replica"]["wire_mb"])
        for peer in SIDES[1:]} | {
        f"shard bytes fivefold / {peer}": ratio(ours["shard"]["wire_mb"], summary[peer]["shard"]["wire_mb"])
        for peer in SIDES[1:]} | {
        "step time fivefold / fsdp2": ratio(ours["step_s"], summary["fsdp2"]["step_s"])}
    log(json.dumps(summary, indent=1))
    print(json.dumps(summary))  # stdout: the one JSON line, as the other benchmarks
    return 0 if summary["loss_check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
