"""The per-step cost of the logged utilization and memory (train/utilization.py), on a CPU.

Run: `.venv/bin/python benchmarks/telemetry_overhead.py [--rounds 3] [--steps 30]`

The worst case for the telemetry: configs/tiny.toml with train.log_every = 1 (every step a logging
step) and data.document_mask on (each logging step counts its rows' kept pairs). Two measurements:
- direct: each telemetry call timed over many repetitions in this process (the memory read, the
  document pairs of one step's rows, the utilization record), their sum over the median step
  (train_step to the end of log_step) of the run with telemetry: the overhead as a ratio;
- A/B: the same run with the telemetry and without it (step.logging_step answering False, which
  skips the memory read and the document pairs, and StepLog._utilization doing nothing), the two
  sides alternated `--rounds` times, each side's median step (train_step to the end of log_step,
  steps after the first); the ratio with / without. On a shared machine its noise is larger than
  the effect: the direct ratio is the figure to read.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
RUN = ("--train.log_every=1", "--data.document_mask=true", "--data.max_bytes=40000", "--train.peak_tflops=1")


def timed_run(out: Path, steps: int, telemetry: bool) -> list[float]:
    """One single-rank run; each step's seconds from train_step's start to log_step's end."""
    from fivefold.config.load import load_config
    from fivefold.parallel.forked_ranks import run_workers

    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"--run.out_dir={out}", f"--train.steps={steps}", *RUN])

    def worker(rank: int, world: int) -> list[float]:
        import fivefold.train.loop as loop
        import fivefold.train.step as step
        from fivefold.train.step_log import StepLog

        starts, ends = [], []
        train_step, log_step = loop.train_step, StepLog.log_step

        def start(*a, **k):
            starts.append(time.perf_counter())
            return train_step(*a, **k)

        def end(*a, **k):
            out = log_step(*a, **k)
            ends.append(time.perf_counter())
            return out

        patches = [mock.patch.object(loop, "train_step", start), mock.patch.object(StepLog, "log_step", end)]
        if not telemetry:
            patches += [mock.patch.object(step, "logging_step", lambda cfg, done: False),
                        mock.patch.object(StepLog, "_utilization", lambda self, m, record: None)]
        for p in patches:
            p.start()
        loop.train(cfg, progress=False)
        return [e - s for s, e in zip(starts, ends, strict=True)]

    return run_workers(worker, 1)[0]


def per_call(fn, repeats: int = 200) -> float:
    """Median seconds of one call of fn over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def direct_seconds(folder: Path) -> dict[str, float]:
    """Each telemetry call's seconds, on the benchmark's config and one step's rows."""
    from fivefold.config.load import load_config
    from fivefold.train.utilization import Peak, document_keys, formula_keys, memory_peaks, run_flops, utilization

    cfg = load_config(ROOT / "configs" / "tiny.toml", [f"--run.out_dir={folder}", *RUN])
    rows = [torch.randint(0, 257, (cfg.train.micro_batch, cfg.train.seq_len))  # (B, T)
            for _ in range(cfg.train.global_batch // cfg.train.micro_batch)]
    flops, keys = run_flops(cfg, 320), formula_keys(cfg)
    return {"memory_peaks": per_call(lambda: memory_peaks(torch.device("cpu"))),
            "document_keys": per_call(lambda: document_keys(cfg, rows, 256)),
            "utilization": per_call(lambda: utilization(flops, 0.1, 1, Peak(1e12, "setting"), 20.0, keys))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    sides: dict[str, list[float]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = ("with", "without") if r % 2 == 0 else ("without", "with")
            for side in order:
                times = timed_run(Path(tmp) / f"{side}{r}", args.steps, side == "with")
                sides[side] += times[1:]  # the first step warms up
                print(f"round {r} {side}: median step {statistics.median(times[1:]) * 1e3:.2f} ms", file=sys.stderr)
        calls = direct_seconds(Path(tmp) / "direct")
    step_with, step_without = statistics.median(sides["with"]), statistics.median(sides["without"])
    telemetry = sum(calls.values())
    print(json.dumps({"step_with_s": step_with, "step_without_s": step_without,
                      "ab_ratio": round(step_with / step_without, 4), "telemetry_s_per_step": telemetry,
                      "calls_s": calls, "direct_overhead_ratio": round(telemetry / step_with, 5)}))


if __name__ == "__main__":
    main()
