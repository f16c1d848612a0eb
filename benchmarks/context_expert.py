"""Context parallel (ring vs Ulysses) and expert parallel (ep = 2 vs ep = 1): step time and bytes.

Run: `.venv/bin/python benchmarks/context_expert.py [--steps N] [--rounds R] [--quick] [--nproc 4]`
(extra `--section.key=value` arguments override both model configs).

There is no PyTorch peer to run beside these on a CPU: torch's context_parallel has no CPU
attention strategy (docs/torch-cpu-notes.md) and torch has no expert-parallel MoE. So each comparison
is between two fivefold layouts of the same model, data and weights, trained with the real loop
(`fivefold.train.loop.train`) on forked gloo ranks:
1. `cp`: cp = nproc, `cp_method = "ring"` (zig-zag) vs `"ulysses"`, dim 128, 8 heads, 4 layers,
   seq 512, one sequence per micro-batch. Reported: step time, and the "cp" traffic per step
   (calls, wire bytes per rank), counted through comm/collectives.py.
2. `ep`: a tiny MoE (dim 128, 4 layers, 8 experts, top-2, expert width 256) on dp = nproc ranks,
   ep = nproc vs ep = 1. Reported: tokens/s and the "ep" all-to-all bytes per step.
The layouts alternate over rounds (A B, B A, ...), so a load change on the shared machine hits
both alike; a step's time is rank 0's `step_time_s` from the metrics log, the median over the
timed steps of every round. First-step losses must agree within 1e-5 (same model, same data).

Output: progress on stderr; one JSON line per comparison on stdout, then a summary line whose
ratio keys contain "ratio" (ulysses / ring step time; ep / no-ep tokens/s). No targets: the
issue asks for the figures. With --nproc 4 the 2 cores are oversubscribed: reported, no target.
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

from benchmarks.common import finish_summary, log, make_parser, median, parse, ratio  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402

COMPARISONS = {  # name: (shared overrides, {side: overrides})
    "cp": (("--model.dim=128", "--model.n_heads=8", "--model.n_kv_heads=8", "--model.ffn_dim=384",
            "--model.n_layers=4", "--train.seq_len=512", "--train.micro_batch=1", "--train.global_batch=2"),
           {"ring": ("--parallel.cp_method=ring",), "ulysses": ("--parallel.cp_method=ulysses",)}),
    "ep": (("--model.preset=tiny-moe", "--model.dim=128", "--model.n_layers=4", "--model.moe.n_experts=8",
            "--model.moe.ffn_dim=256", "--train.seq_len=128", "--train.micro_batch=4",
            "--train.global_batch=16"),
           {"ep1": ("--parallel.ep=1",), "ep": ()}),
}


def _worker(rank: int, world: int, cfg) -> list[dict]:
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only this script's JSON lines
        result = train(cfg, progress=False)
    return read_metrics(result.run_dir / cfg.run.metrics_file) if rank == 0 else []


def _run(name: str, side: str, nproc: int, args, overrides: list[str], out: Path) -> list[dict]:
    shared, sides = COMPARISONS[name]
    degree = (f"--parallel.cp={nproc}", "--parallel.dp=1") if name == "cp" else (f"--parallel.ep={nproc}",)
    cfg = load_config(ROOT / "configs" / "tiny.toml", [
        *shared, *degree, *sides[side], f"--train.steps={args.warmup + args.steps}", "--optim.lr=1e-3",
        "--train.dtype=fp32", "--train.device=cpu", "--data.val_fraction=0", "--checkpoint.every=0",
        f"--run.out_dir={out}", f"--run.name={name}-{side}-{time.monotonic_ns()}", "--train.log_every=1000",
        *overrides])
    return run_workers(_worker, nproc, cfg, timeout=900)[0]


def _axis(step: dict, axis: str, key: str) -> float:
    return step["comm"].get(axis, {}).get(key, 0)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), COMPARISONS, steps=6, rounds=2,
                         unit="comparison")
    parser.add_argument("--nproc", type=int, default=2, help="ranks: cp (or dp and ep) degree")
    args, overrides = parse(parser, argv)
    began, summary = time.perf_counter(), {"summary": True, "nproc": args.nproc}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            sides = list(COMPARISONS[name][1])
            steps: dict[str, list[dict]] = {s: [] for s in sides}
            first: dict[str, float] = {}
            for rnd in range(args.rounds):
                for side in sides if rnd % 2 == 0 else sides[::-1]:
                    log(f"{name}: round {rnd + 1}/{args.rounds}, {side}")
                    metrics = _run(name, side, args.nproc, args, overrides, Path(tmp))
                    first.setdefault(side, metrics[0]["loss"])
                    steps[side] += metrics[args.warmup:]
            a, b = sides
            t = {s: median([m["step_time_s"] for m in steps[s]]) for s in sides}
            tps = {s: median([m["tokens_per_s"] for m in steps[s]]) for s in sides}
            axis = "cp" if name == "cp" else "ep"
            record = {"name": name, "nproc": args.nproc, "sides": sides,
                      "step_time_s": {s: round(t[s], 4) for s in sides},
                      "tokens_per_s": {s: round(tps[s], 1) for s in sides},
                      f"{axis}_calls_per_step": {s: _axis(steps[s][0], axis, "calls") for s in sides},
                      f"{axis}_wire_bytes_per_step_per_rank": {s: _axis(steps[s][0], axis, "wire_bytes")
                                                               for s in sides},
                      "loss_first_step": [first[a], first[b]],
                      "loss_check": "ok" if abs(first[a] - first[b]) <= 1e-5 else "MISMATCH"}
            if name == "cp":
                record["ratio_step_time_ulysses_over_ring"] = summary["cp_ratio_ulysses_over_ring"] = ratio(t[b], t[a])
            else:
                record["ratio_tokens_per_s_ep_over_ep1"] = summary["ep_ratio_tokens_per_s"] = ratio(tps[b], tps[a])
            summary[f"{name}_loss_check"] = record["loss_check"]
            log(f"{name}: {json.dumps(record['step_time_s'])}, loss check {record['loss_check']}")
            print(json.dumps(record), flush=True)
    finish_summary(summary, None, began, note="no target: the issue asks for the figures")


if __name__ == "__main__":
    main()
