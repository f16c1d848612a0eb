"""One-GPU check in two stages, each under 5 minutes with its cold compiles: `correct` (each feature at
world 1 against its fp32 or one-path reference) and `speed` (a Llama 3.2 1B shape: fivefold eager and
compiled beside a plain PyTorch loop, FP8 against bf16, its head and loss chunked against eager
cross-entropy, the planner's roofline, calibrate).

Run on the GPU machine from the source tree, with the torch it has (2.11 or newer; nothing to install):

    python3 benchmarks/gpu_check.py --stage correct --out $OUT
    python3 benchmarks/gpu_check.py --stage speed --out $OUT
    python3 benchmarks/gpu_check.py --device cpu --tiny --out DIR    # both stages, the suite's smoke test

What --out receives (docs/gpu.md says how to read it): one JSONL file per part (gpucheck/records.py:
a record per check, {"check", "value", "bound", "pass", "status", "detail"}, written and printed as it
is measured), `summary.md` (the verdict table over every part's file, rewritten after each part, so a
stage stopped midway still leaves one), `stderr.log` (progress and tracebacks), and the speed stage's
`profile.toml` (calibrate's). At most 8 files per stage: what the GPU machine copies back.

The parts (gpucheck/correct.py and gpucheck/speed.py say what each check compares and its bound)
run one after the other in a worker process, each under its own budget (`--budget PART=SECONDS`)
inside the stage's deadline (`--deadline-s`): a check that would end past either is recorded as
skipped; a part that runs past its budget, or a worker that dies (a CUDA fault), is stopped, recorded
as a failed check, and a fresh worker runs the parts after it. Exit status 0 whatever the verdicts;
1 only when `--device cuda` finds no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpucheck.records import LOG, STAGES, PartLog, log, read_part, write_summary  # noqa: E402

# Seconds per part on an H100 or H200, cold compiles included; each stage's sum stays under its deadline,
# but for the correct stage's last part, optimizer (15 s past it): the deadline skips what would not fit.
# Guessed, not yet measured on a GPU: `--budget` moves them.
BUDGETS_S = {"precision": 40, "moe": 15, "sharding": 45, "attention": 100, "compile": 80, "optimizer": 20,
             "training": 150, "fp8": 40, "loss_chunk": 15, "roofline": 35, "calibrate": 45}
DEADLINE_S = 285.0  # a stage, under the 5 minutes that leave a 15-minute session room to rerun one
CPU_BUDGET_S, CPU_DEADLINE_S = 300.0, 900.0  # --device cpu: a shared CPU is slow, and the GPU's figures mean nothing
GRACE_S = 5.0  # past a part's budget before its worker is stopped: its own deadline check skips first
POLL_S = 0.2


def environment(device: str) -> dict:
    """Python, torch, the device, and which of fivefold's runtime dependencies this Python lacks."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[=<>;\[ ]", d)[0] for d in deps]  # each is imported under its distribution's name
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    env = {"environment": True, "python": sys.version.split()[0], "torch": torch.__version__,
           "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": device,
           "missing_dependencies": missing}
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
        env["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    return env


# ---- the worker: a stage's remaining parts, in order, in one process -----------------------------------------
def run_worker(args) -> int:
    from benchmarks.gpucheck import correct, speed

    if args.device == "cpu":
        torch.set_num_threads(1)  # on a small shared CPU, OpenMP's threads waiting on a busy core slow a step 100x
    contexts = {}  # a stage's, made when its first part runs
    try:
        for name in args.worker.split(","):
            module = correct if name in STAGES["correct"] else speed
            if module not in contexts:
                contexts[module] = (correct.Context(args.device, args.tiny) if module is correct else speed.Context(
                    args.device, args.tiny, args.out, args.peak_tflops, args.warmup, args.steps))
            part = PartLog(args.out, name, min(args.deadline_at, time.time() + args.budgets[name]))
            try:
                module.PARTS[name](part, contexts[module])
                part.end("ok")
            except Exception as e:  # noqa: BLE001 - the part's failure is a record; the next part runs
                log(traceback.format_exc())
                part.write({"check": f"{name}: the part", "value": None, "bound": None, "pass": False,
                            "status": "fail", "detail": f"error: {e!r}"[:600]})
                part.end("error")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ---- the supervisor: workers under the budgets, the summary after each part -----------------------------------
def worker_command(args, parts: list[str]) -> list[str]:
    """This script as a worker running `parts` (of one stage) in order, until `args.deadline_at`."""
    return [sys.executable, str(Path(__file__).resolve()), "--device", args.device, "--out", str(args.out),
            *(["--tiny"] if args.tiny else []), "--warmup", str(args.warmup), "--steps", str(args.steps),
            "--peak-tflops", str(args.peak_tflops), *(f"--budget={k}={v}" for k, v in args.budgets.items()),
            "--worker", ",".join(parts), "--deadline-at", repr(args.deadline_at)]


def run_stage(stage: str, parts: list[str], args, command=worker_command) -> None:
    """Run `parts` in workers (`command(args, parts)`), a fresh one after each that dies or is stopped."""
    deadline = args.deadline_at = time.time() + args.deadline_s
    for name in parts:  # this run's records only
        (args.out / f"{name}.jsonl").unlink(missing_ok=True)
    remaining = list(parts)
    with (args.out / LOG).open("a") as err:
        while remaining:
            if time.time() >= deadline:
                for name in remaining:
                    _stopped(args.out, name, "skipped", f"not run: the stage's {args.deadline_s:g} s had passed")
                break
            log(f"gpu_check: stage {stage}, parts {', '.join(remaining)}")
            # its own session: a stop reaches the compile workers and calibrate it started too
            proc = subprocess.Popen(command(args, remaining), cwd=ROOT, stderr=err, start_new_session=True)
            why = _watch(proc, remaining, args)
            remaining = [n for n in remaining if read_part(args.out / f"{n}.jsonl")[1] is None]
            if remaining:  # the first part without its end line is the one that was running
                why = why or f"its worker exited with status {proc.returncode}"
                _stopped(args.out, remaining.pop(0), "stopped", why)
            write_summary(args.out, args.env)


def _watch(proc: subprocess.Popen, parts: list[str], args) -> str | None:
    """Wait for the worker, rewriting the summary as each part ends; stop it when the running part
    passes its budget (with args.grace_s) or the stage its deadline. Returns why it was stopped, or None."""
    index, began = 0, time.monotonic()
    while proc.poll() is None:
        while index < len(parts) and read_part(args.out / f"{parts[index]}.jsonl")[1] is not None:
            index, began = index + 1, time.monotonic()
            write_summary(args.out, args.env)
        over = index < len(parts) and time.monotonic() - began > args.budgets[parts[index]] + args.grace_s
        if over or time.time() > args.deadline_at + args.grace_s:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return (f"stopped at its budget of {args.budgets[parts[index]]:g} s" if over
                    else f"stopped at the stage's deadline of {args.deadline_s:g} s")
        time.sleep(POLL_S)
    return None


def _stopped(out: Path, name: str, status: str, why: str) -> None:
    part = PartLog(out, name, 0.0)
    if part.path.exists() and not part.path.read_text().endswith("\n"):  # a line the kill cut short
        with part.path.open("a") as f:
            f.write("\n")
    part.write({"check": f"{name}: the part", "value": None, "bound": None, "pass": False,
                "status": "skip" if status == "skipped" else "fail", "detail": why})
    part.end(status)


def parse_budgets(pairs: list[str], device: str) -> dict[str, float]:
    budgets = {k: (CPU_BUDGET_S if device == "cpu" else float(v)) for k, v in BUDGETS_S.items()}
    for pair in pairs:
        part, _, seconds = pair.partition("=")
        if part not in BUDGETS_S or not seconds:
            raise SystemExit(f"gpu_check: --budget {pair!r}: give PART=SECONDS with PART one of {', '.join(BUDGETS_S)}")
        budgets[part] = float(seconds)
    return budgets


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stage", choices=["correct", "speed", "all"], default="all",
                    help="on a GPU run correct and speed as two calls (each under 5 minutes)")
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check", help="the folder it keeps everything in")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.toml and small shapes: the suite's smoke test")
    ap.add_argument("--parts", default=None, help=f"comma-separated, of {', '.join(BUDGETS_S)} (default: the stage's)")
    ap.add_argument("--warmup", type=int, default=0, help="speed: untimed steps first (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, default=0, help="speed: timed steps (default 10; --tiny 2)")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense TFLOP/s, for a GPU not in the catalog")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                    help=f"a part's budget (defaults {', '.join(f'{k}={v}' for k, v in BUDGETS_S.items())}; "
                         f"cpu: {CPU_BUDGET_S:g} each)")
    ap.add_argument("--deadline-s", type=float, default=0.0,
                    help=f"each stage's deadline (default {DEADLINE_S:g}; cpu {CPU_DEADLINE_S:g})")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a worker process: these parts
    ap.add_argument("--deadline-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.budgets = parse_budgets(args.budget, args.device)
    args.deadline_s = args.deadline_s or (CPU_DEADLINE_S if args.device == "cpu" else DEADLINE_S)
    args.out, args.grace_s = args.out.resolve(), GRACE_S
    if args.worker:
        return run_worker(args)

    env = args.env = environment(args.device)
    print(json.dumps(env), flush=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("gpu_check: --device cuda but torch.cuda.is_available() is False (here: --device cpu --tiny)")
        return 1
    chosen = set(args.parts.split(",")) if args.parts else set(BUDGETS_S)
    if chosen - set(BUDGETS_S):
        raise SystemExit(f"gpu_check: --parts {args.parts}: of {', '.join(BUDGETS_S)}")
    args.out.mkdir(parents=True, exist_ok=True)
    with (args.out / LOG).open("a") as err:
        err.write(json.dumps(env) + "\n")
    # all: one worker for both stages under their two deadlines (a process's start less on a CPU)
    stages = ["correct", "speed"] if args.stage == "all" else [args.stage]
    args.deadline_s *= len(stages)
    if parts := [p for stage in stages for p in STAGES[stage] if p in chosen]:
        run_stage(args.stage, parts, args)
    print(json.dumps({"summary": str(write_summary(args.out, args.env))}), flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
