"""The planner's step-time self-check: predicted against measured, dp = 2, tp = 2 and pp = 2.

Run: `.venv/bin/python benchmarks/planner_selfcheck.py [--models tiny debug] [--rounds R] [--quick]`
or `... --hardware local.toml` to predict from a profile already written by `fivefold calibrate`
(extra `--section.key=value` arguments override every run's config).

Each layout of each model (configs/tiny.toml, configs/debug.toml) trains on 2 forked gloo ranks
with the real loop (`fivefold.train.loop.train`, fp32, 1 thread per rank); a step's time is rank 0's
`step_time_s` from the metrics log, the median over the timed steps (after `--warmup`) of every
round. The prediction is `selfcheck.predict_for_config`, the figure `fivefold train
--run.hardware PROFILE` logs as `predicted.step_time_s`, from a profile of this machine:

- without --hardware, each round first takes one measurement session of `fivefold calibrate
  --layers` on the runs' configs (planner.calibration.measure.measure: op costs, matmuls, the
  optimizer, Python's fixed costs, the models' blocks, embedding and head timed whole,
  collectives), then trains every layout; the profile is the median over the sessions
  (measure.profile), so the calibration samples the same stretch of time as the runs it predicts.
  On this shared 2-core machine a neighbour's test run can double every time for tens of seconds;
  one calibration taken a minute before the runs measures another machine. Nothing in the profile
  comes from the runs: it is written (--out) before any prediction is made;
- with --hardware, that profile as it is.
The layouts take turns from round to round (A B C, C B A, ...), so a load change hits them alike.

Output: progress on stderr; one JSON line per model and layout (measured median, predicted,
ratio = predicted / measured, per-round medians, the prediction's time split, and `ratio_op_priced`:
the same profile without its layer times, every part priced op by op) on stdout, then a
summary line with every ratio and the issue's target (each within [0.75, 1.25]), printed beside
the ratios, not asserted: timings on a shared machine are a report, not a test.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import log, make_parser, median, parse  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402

LAYOUTS = {"dp2": (), "tp2": ("--parallel.tp=2",), "pp2": ("--parallel.pp=2",)}
MODELS = ("tiny", "debug")
TARGET = (0.75, 1.25)
NPROC = 2


def _worker(rank: int, world: int, cfg) -> list[float]:
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only this script's JSON lines
        result = train(cfg, progress=False)
    steps = read_metrics(result.run_dir / cfg.run.metrics_file) if rank == 0 else []  # events left out
    return [r["step_time_s"] for r in steps]


def _config(model: str, layout: str, args, overrides: list[str], out: Path, hardware: str | None):
    return load_config(ROOT / "configs" / f"{model}.toml", [
        *LAYOUTS[layout], f"--train.steps={args.warmup + args.steps}", "--optim.warmup_steps=1",
        "--train.dtype=fp32", "--train.device=cpu", "--train.eval_every=0", "--data.val_fraction=0",
        "--data.max_bytes=400000", "--checkpoint.every=0", "--train.log_every=1000", f"--run.out_dir={out}",
        f"--run.name={model}-{layout}-{time.monotonic_ns()}", *([f"--run.hardware={hardware}"] if hardware else []),
        *overrides])


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), LAYOUTS, steps=20, rounds=3, unit="layout")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["tiny"])
    parser.add_argument("--hardware", default=None, help="a profile from `fivefold calibrate` (else: measured here)")
    parser.add_argument("--out", default=None, help="where to write the profile measured here")
    args, overrides = parse(parser, argv)
    import dataclasses

    from fivefold.planner.calibration.layers import config_parts
    from fivefold.planner.calibration.measure import measure, profile, threads_per_rank
    from fivefold.planner.estimate import estimate
    from fivefold.planner.hardware import load_profile, profile_toml
    from fivefold.planner.selfcheck import activation_element_bytes, predict_for_config

    began, summary = time.perf_counter(), {"summary": True, "nproc": NPROC, "models": args.models}
    runs = [(m, lay) for m in args.models for lay in args.only]
    times: dict[tuple[str, str], list[list[float]]] = {run: [] for run in runs}
    sessions = []
    with tempfile.TemporaryDirectory() as tmp:
        parts = {part.key: part for m, lay in runs
                 for part in config_parts(_config(m, lay, args, overrides, Path(tmp), None), NPROC)}
        for rnd in range(args.rounds):
            if not args.hardware:
                log(f"round {rnd + 1}/{args.rounds}: calibration session  [{time.perf_counter() - began:.0f} s]")
                sessions.append(measure(NPROC, args.quick, parts=tuple(parts.values())))
            for model, layout in runs if rnd % 2 == 0 else runs[::-1]:
                cfg = _config(model, layout, args, overrides, Path(tmp), args.hardware)
                steps = run_workers(_worker, NPROC, cfg, timeout=1800)[0][args.warmup:]
                times[(model, layout)].append(steps)
                log(f"round {rnd + 1}/{args.rounds} {model} {layout}: median {median(steps):.4f} s/step  "
                    f"[{time.perf_counter() - began:.0f} s]")
        path = args.hardware or args.out or str(Path(tmp) / "local.toml")
        if not args.hardware:
            Path(path).write_text(profile_toml(profile(sessions, NPROC, threads_per_rank(NPROC))))
        hw = load_profile(path)
        # the pricer a search uses: a measured one without its layer times, every part priced op by op
        op_priced = dataclasses.replace(hw, pricer=hw.pricer.for_search())
        for model, layout in runs:
            cfg = _config(model, layout, args, overrides, Path(tmp), path)
            predicted = predict_for_config(cfg, NPROC, hw)["step_time_s"]
            predicted_ops = predict_for_config(cfg, NPROC, op_priced)["step_time_s"]
            split = estimate(cfg, NPROC, hw, act_bytes=activation_element_bytes(cfg), implementation=True).time_split
            measured = median([t for steps in times[(model, layout)] for t in steps])
            name = f"{model}_{layout}"
            record = {"model": model, "layout": layout, "measured_step_s": round(measured, 4),
                      "predicted_step_s": round(predicted, 4), "ratio": round(predicted / measured, 3),
                      "ratio_op_priced": round(predicted_ops / measured, 3),
                      "round_medians_s": [round(median(s), 4) for s in times[(model, layout)]],
                      "predicted_split_s": {k: round(v, 4) for k, v in split.items()},
                      "steps": args.steps, "rounds": args.rounds,
                      "profile": args.hardware or f"{len(sessions)} session(s) measured here"}
            summary[f"{name}_ratio"] = record["ratio"]
            summary[f"{name}_ratio_op_priced"] = record["ratio_op_priced"]
            print(json.dumps(record), flush=True)
    ratios = {k: v for k, v in summary.items() if k.endswith("_ratio")}
    summary["target"] = f"each ratio within [{TARGET[0]}, {TARGET[1]}]"
    summary["within_target"] = {k: TARGET[0] <= v <= TARGET[1] for k, v in ratios.items()}
    summary["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
