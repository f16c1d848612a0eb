"""DualPipe's overlapped pairs: dualpipe_v with `parallel.ep_overlap = true` against without.

Run: `.venv/bin/python benchmarks/ep_overlap.py [--steps N] [--rounds R] [--quick]`
(extra `--section.key=value` arguments override the config, e.g. `--model.dim=128`).

What is compared, on 4 forked gloo ranks (CPU, fp32, 1 thread each: pp = 2 x ep = 2, ZeRO-1, the
DeepSeek-V3 recipe in miniature), for the `tiny-moe` preset: `fivefold train` under dualpipe_v with
ep_overlap (each steady-phase F and the B after it run at once, the F on the side lane's thread:
pipeline/overlap.py) against the same schedule run one action after the other. PyTorch's own
peer, `ScheduleDualPipeV`, runs each pair one after the other too and has no expert parallelism
(benchmarks/pipeline_parallel.py sets it beside fivefold's dualpipe_v without ep), so the yardstick
is fivefold's unpaired schedule: the same ops, messages and all-to-alls, bit for bit the same run.

How: each round runs both sides one after the other in fresh workers (which goes first flips from
round to round), `--warmup` + `--steps` steps each; a side's figure is the median over the timed
steps of all rounds of rank 0's `step_time_s` and its step breakdown's `exposed_ep` (the time no
lane computed while one waited for an expert all-to-all: comm/timing.py). On 2 shared cores the
4 ranks' 8 threads take turns, so a lane that waits gives its core to another rank as often as to
its own other lane; a GPU runs the two lanes' kernels on two streams and their all-to-alls on the
links. Read the exposed ep ratio first; the step ratio says what this machine makes of it.

Output: progress on stderr; on stdout one JSON object, then a summary whose measured ratios have
"ratio" in their keys. Absolute times on a shared 2-core machine are noise; read the ratios.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import finish_summary, log, make_parser, median, parse, ratio  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.train.metrics import read_metrics  # noqa: E402

torch.set_num_threads(1)

SIDES = {"paired": "true", "in_order": "false"}  # side -> parallel.ep_overlap
LAYOUT = ("--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1", "--parallel.pp_schedule=dualpipe_v",
          "--parallel.virtual_stages=2", "--train.micro_batch=1")


def _train(rank: int, world: int, cfg: Config) -> None:
    from fivefold.train.loop import train

    with contextlib.redirect_stdout(sys.stderr):  # the run's own summary: stdout holds only the JSON lines
        train(cfg, progress=False)


def run_side(out: Path, overlap: str, steps: int, overrides: list[str], config: str) -> list[dict]:
    """One run of a side on 4 ranks: rank 0's step records (every step logged: each has its breakdown,
    gathered outside the timed step)."""
    cfg = load_config(ROOT / config, [f"--run.out_dir={out}", "--model.preset=tiny-moe", *LAYOUT,
                                      f"--parallel.ep_overlap={overlap}", f"--train.steps={steps}",
                                      "--checkpoint.every=0", "--train.log_every=1", "--data.val_fraction=0.0",
                                      *overrides])
    run_workers(_train, 4, cfg)
    return read_metrics(next(out.glob("*/metrics.jsonl")))


def compare(args, overrides: list[str]) -> dict:
    steps = {side: [] for side in SIDES}
    exposed = {side: [] for side in SIDES}
    losses = {}
    for rnd in range(args.rounds):
        for side in list(SIDES) if rnd % 2 == 0 else list(SIDES)[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                records = run_side(Path(tmp), SIDES[side], args.warmup + args.steps, overrides, args.config)
            steps[side] += [r["step_time_s"] for r in records[args.warmup:]]
            exposed[side] += [r["step_breakdown"]["exposed_ep"] for r in records[args.warmup:]]
            losses[side] = [r["loss"] for r in records]
            log(f"round {rnd + 1}/{args.rounds} {side}: median step {median(steps[side]) * 1e3:.1f} ms, "
                f"exposed ep {median(exposed[side]) * 1e3:.1f} ms")
    return {
        "layout": "pp2 ep2 zero1 dualpipe_v, tiny-moe", "steps": args.steps, "rounds": args.rounds,
        "paired_step_s": round(median(steps["paired"]), 5), "in_order_step_s": round(median(steps["in_order"]), 5),
        "paired_exposed_ep_s": round(median(exposed["paired"]), 5),
        "in_order_exposed_ep_s": round(median(exposed["in_order"]), 5),
        "ratio_step_time": ratio(median(steps["paired"]), median(steps["in_order"])),
        "ratio_exposed_ep": ratio(median(exposed["paired"]), median(exposed["in_order"])),
        "loss_equal": losses["paired"] == losses["in_order"],  # the same ops on the same values: bit for bit
    }


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, "configs/tiny.toml", ("tiny-moe",), steps=8, rounds=2, unit="preset")
    args, overrides = parse(parser, argv)
    began = time.perf_counter()
    record = compare(args, overrides)
    print(json.dumps(record), flush=True)
    finish_summary({"ratio_step_time": record["ratio_step_time"], "ratio_exposed_ep": record["ratio_exposed_ep"]},
                   None, began, note="no target: the pairs hide all-to-alls that a GPU's links carry")


if __name__ == "__main__":
    main()
