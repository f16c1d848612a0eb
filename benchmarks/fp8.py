"""FP8 training (`train.fp8`) against bf16, and against torchao's float8 training, on one process.

Run: `.venv/bin/python benchmarks/fp8.py [--steps N] [--rounds R] [--quick]` (extra
`--section.key=value` arguments override the config).

Three sides, the same model (fivefold's Transformer from configs/tiny.toml, seeded), the same
initial weights and batches, bf16 autocast on the CPU:
- `bf16`:    fivefold, train.fp8 = "none";
- `fp8`:     fivefold, train.fp8 = "tensorwise" (parallel/fp8.py: the blocks' linear layers);
- `torchao`: the bf16 side's model with torchao's `convert_to_float8_training` (its tensorwise
             recipe, the same e4m3 / e5m2 formats and dynamic scales) on the same layers, the
             embedding and the head left out as fivefold leaves them.
Each side is stepped as train/loop.py steps it (`pipeline.run`, then `optimizer_step`: clip and
AdamW), in one forked worker (world 1), the sides alternating step by step after their warm-up.

What the ratios mean on a CPU. There are no FP8 units here: fivefold's FP8 multiplies its FP8
operands as fp32 numbers (exact: scaled_mm in parallel/fp8.py), so `fp8 / bf16` is the price of
quantizing (amax, scale, cast) every operand of every matmul plus fp32 matmuls in place of bf16
ones: the overhead a GPU's FP8 tensor cores must win back, not a speed-up. torchao calls
torch._scaled_mm, whose CPU kernel takes 2 to 3 times an fp32 matmul's time, and wraps its
operands in tensor subclasses, so `fp8 / torchao` compares two CPU stand-ins, not FP8 kernels.
Read the loss columns beside them: both FP8 sides quantize with the same recipe and scales, so
their first-step losses agree to fp32 summation order, and both differ from bf16's by FP8's
rounding. On a GPU the question is tokens/s of a 1B shape
(benchmarks/gpu_check.py's place; no GPU was lent when this was written).

Memory: one untimed run per side (3 steps, a fresh worker), peak RSS above the pre-model baseline
(common.measure_peak); torchao is imported before the workers fork, so its import is not counted.
FP8 keeps each linear layer's input for backward in FP8 (half of bf16's bytes).
Output: progress on stderr; one JSON line per comparison, then a summary line.
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
from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    finish_summary,
    log,
    make_parser,
    measure_peak,
    median,
    parse,
    prewarm,
    ratio,
)
from benchmarks.pipeline_sides import global_batches  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config, replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import unpadded_vocab  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402

torch.set_num_threads(1)
SIDES = ("bf16", "fp8", "torchao")


class Side:
    """One way of training the model, stepped as train/loop.py steps it."""

    def __init__(self, kind: str, cfg: Config):
        self.kind = kind
        self.cfg = replace(cfg, train={"fp8": "tensorwise" if kind == "fp8" else "none"})
        derived = derive(self.cfg, 1, unpadded_vocab(self.cfg))
        self.par = parallelize(build_model(self.cfg, derived.vocab_size), Mesh.from_config(self.cfg, derived),
                               self.cfg, derived)
        if kind == "torchao":
            convert_to_float8_training(self.par.model, config=Float8LinearConfig(),
                                       module_filter_fn=lambda mod, fqn: fqn.startswith("layers."))
        self.scaler = LossScaler(self.cfg.train)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        began = time.perf_counter()
        stats = self.par.pipeline.run([(x, y)], x.numel())
        self.par.optimizer_step(self.cfg.optim.lr, self.scaler, self.cfg.optim.grad_clip)
        self.times.append(time.perf_counter() - began)
        self.losses.append(float(stats.loss))


def _timed_worker(rank: int, world: int, kinds: tuple[str, ...], cfg: Config, warmup: int, steps: int) -> list[dict]:
    sides = [Side(kind, cfg) for kind in kinds]
    return alternate(sides, global_batches(cfg, warmup + steps), warmup, lambda side, x, y: side.step(x, y))


def _memory_worker(rank: int, world: int, kind: str, cfg: Config, steps: int) -> dict:
    def run() -> Side:
        side = Side(kind, cfg)
        for x, y in global_batches(cfg, steps):
            side.step(x, y)
        return side

    return measure_peak(run)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), SIDES, steps=4, rounds=2, unit="comparison")
    args, overrides = parse(parser, argv)
    cfg = load_config(args.config, [
        "--model.dim=128", "--model.n_heads=4", "--model.n_kv_heads=4", "--model.ffn_dim=384", "--model.n_layers=2",
        "--train.seq_len=64", "--train.micro_batch=4", "--train.global_batch=4", "--train.dtype=bf16",
        "--train.device=cpu", *overrides])
    prewarm()
    began = time.perf_counter()
    kinds = tuple(args.only)
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]  # who is built and stepped first
        for kind, res in zip(order, run_workers(_timed_worker, 1, order, cfg, args.warmup, args.steps,
                                                timeout=600.0)[0], strict=True):
            runs[kind].append(res)
            log(f"round {rnd + 1}/{args.rounds} {kind:8s} median {median(res['times']):.4f} s/step  "
                f"first loss {res['losses'][0]:.6f}  [{time.perf_counter() - began:.0f} s]")
    mem = {k: run_workers(_memory_worker, 1, k, cfg, 3, timeout=600.0)[0]["peak_mb"] for k in kinds}
    step = {k: median([t for r in runs[k] for t in r["times"]]) for k in kinds}
    first = {k: runs[k][0]["losses"][0] for k in kinds}
    last = {k: runs[k][0]["losses"][-1] for k in kinds}
    summary: dict = {"summary": True, **{f"{k}_step_s": round(step[k], 4) for k in kinds},
                     **{f"{k}_peak_mb": round(mem[k], 1) for k in kinds},
                     **{f"{k}_first_loss": first[k] for k in kinds}, **{f"{k}_last_loss": last[k] for k in kinds}}
    for a, b in (("fp8", "bf16"), ("fp8", "torchao"), ("torchao", "bf16")):
        if a in kinds and b in kinds:
            summary[f"{a}_over_{b}_ratio_step_time"] = ratio(step[a], step[b])
            summary[f"{a}_over_{b}_ratio_peak_memory"] = ratio(mem[a], mem[b])
            summary[f"{a}_vs_{b}_first_loss_abs_diff"] = abs(first[a] - first[b])
    finish_summary(summary, None, began, note="CPU FP8 is emulated: the ratios price quantization, not FP8 units")


if __name__ == "__main__":
    main()
