"""Offload's cost and saving: dp2 ZeRO-1 with `parallel.offload = "optimizer"` against without, and
dp2 ZeRO-3 with ZeRO-Infinity's `parallel.offload = "params"` against "optimizer" and without.

Run: `.venv/bin/python benchmarks/offload.py [--steps N] [--rounds R] [--quick]`
(extra `--section.key=value` arguments override the config, e.g. `--model.preset=debug`).

What is compared, on 2 forked gloo ranks (CPU, fp32, 1 thread each), per model preset (`tiny`,
`debug`): `fivefold train` with parallel.zero = 1 and offload = "optimizer" (the AdamW step on host
copies of the shards, parallel/data/offload.py) against the same layout with offload = "none"; then
(layout "zero3") parallel.zero = 3 with offload = "params" (the fp32 parameter shards on the host,
staged up for every gather, the gradient shards down at every reduce-scatter), "optimizer" and "none".
PyTorch's own peer, FSDP2's `CPUOffloadPolicy`, does not run on gloo (docs/torch-cpu-notes.md), so
the yardstick is fivefold's device optimizer: the comparison prices the mechanism (the copies each
way, the wait before the host step), not a host that is slower than a GPU.

How: each round runs both sides one after the other in fresh workers (which side goes first flips
from round to round), `--warmup` + `--steps` steps each; a side's step time is the median over the
timed steps of all rounds of rank 0's `step_time_s` in metrics.jsonl. On a CPU host and device are
the same memory, so the copies cost memory bandwidth only; on a GPU they cross the host link.
Bytes are read from the same records: `offload` (d2h / h2d bytes of the step, the host tensors'
bytes) and `model_state_bytes` (what rank 0 keeps as device state; its "optimizer" share drops
from the fp32 shard + two moments, 12 bytes per shard element, to the fp32 shard, 4, and with
"params" to 0, the gradient shard's 4 going too). On a CPU the "host" and the "device" are the same
memory: the device bytes are what a GPU would hold, the process's memory does not drop.

Output: progress on stderr; on stdout one JSON object per preset and layout, then a summary whose measured
ratios have "ratio" in their keys. Absolute times on a shared 2-core machine are noise; read the ratios.
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

PRESETS = ("tiny", "debug")
# layout -> (parallel.zero, {side: parallel.offload}); the others are measured against "device"
LAYOUTS = {"zero1": (1, {"offload": "optimizer", "device": "none"}),
           "zero3": (3, {"params": "params", "optimizer": "optimizer", "device": "none"})}


def _train(rank: int, world: int, cfg: Config) -> None:
    from fivefold.train.loop import train

    with contextlib.redirect_stdout(sys.stderr):  # the run's own summary: stdout holds only the JSON lines
        train(cfg, progress=False)


def run_side(out: Path, preset: str, zero: int, offload: str, steps: int, overrides: list[str],
             config: str) -> list[dict]:
    """One run of a side on 2 ranks: rank 0's step records."""
    cfg = load_config(ROOT / config, [f"--run.out_dir={out}", f"--model.preset={preset}", "--parallel.dp=2",
                                      f"--parallel.zero={zero}", f"--parallel.offload={offload}",
                                      f"--train.steps={steps}",
                                      "--checkpoint.every=0", "--train.log_every=1000", "--data.val_fraction=0.0",
                                      *overrides])
    run_workers(_train, 2, cfg)
    return read_metrics(next(out.glob("*/metrics.jsonl")))  # RUN_DIR = out_dir / the run's name


def compare(preset: str, layout: str, args, overrides: list[str]) -> dict:
    """Every side of one preset and layout over the rounds: step times and bytes."""
    zero, sides = LAYOUTS[layout]
    times: dict[str, list[float]] = {side: [] for side in sides}
    per_round: dict[str, list[float]] = {side: [] for side in sides}  # each round's median: the spread
    last: dict[str, dict] = {}
    for rnd in range(args.rounds):
        order = list(sides) if rnd % 2 == 0 else list(sides)[::-1]
        for side in order:
            with tempfile.TemporaryDirectory() as tmp:
                records = run_side(Path(tmp), preset, zero, sides[side], args.warmup + args.steps, overrides,
                                   args.config)
            timed = [r["step_time_s"] for r in records[args.warmup:]]
            times[side] += timed
            per_round[side].append(round(median(timed), 5))
            last[side] = records[-1]
            log(f"{preset} {layout} round {rnd + 1}/{args.rounds} {side}: "
                f"median step {median(times[side]) * 1e3:.1f} ms")
    dev = last["device"]
    record: dict = {"preset": preset, "layout": f"dp2 {layout}", "steps": args.steps, "rounds": args.rounds,
                    "round_medians_s": per_round, "device_step_s": round(median(times["device"]), 5)}
    for side in [s for s in sides if s != "device"]:
        off = last[side]
        record.update({
            f"{side}_step_s": round(median(times[side]), 5),
            f"{side}_ratio_step_time": ratio(median(times[side]), median(times["device"])),
            f"{side}_d2h_bytes_per_step": off["offload"]["d2h_bytes"],
            f"{side}_h2d_bytes_per_step": off["offload"]["h2d_bytes"],
            f"{side}_host_bytes": off["offload"]["host_bytes"],
            f"{side}_ratio_device_state_bytes": ratio(off["model_state_bytes"]["total"],
                                                      dev["model_state_bytes"]["total"]),
            f"{side}_loss_equal": off["loss"] == dev["loss"],  # the same AdamW on the same values: bit for bit
        })
    # what rank 0 keeps as device state per side (its largest sample of the last step), by part
    record["device_state_bytes"] = {side: last[side]["model_state_bytes"] for side in sides}
    return record


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, "configs/tiny.toml", PRESETS, steps=10, rounds=3, unit="preset")
    args, overrides = parse(parser, argv)
    began = time.perf_counter()
    summary: dict = {}
    for preset in args.only:
        for layout in LAYOUTS:
            record = compare(preset, layout, args, overrides)
            print(json.dumps(record), flush=True)
            summary.update({f"{preset}_{layout}_{k}": v for k, v in record.items() if "ratio" in k})
    finish_summary(summary, None, began, note="no target: offload trades step time for device memory")


if __name__ == "__main__":
    main()
