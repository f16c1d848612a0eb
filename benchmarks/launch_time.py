"""Launch to exit: `fivefold train --nproc N` beside `torchrun --nproc-per-node N -m fivefold train`.

Run: `.venv/bin/python benchmarks/launch_time.py [--rounds 5] [--nproc 2]`

The same short job both ways, in a fresh temporary folder each time: configs/debug.toml, 2 steps
(warm-up 1), 20 kB of the standard library, no progress bar; every run writes its metrics and its
final checkpoint. What differs is only how the workers start:
- `fivefold`: fivefold's launcher (launch/agent.py) over torch's elastic agent, its workers forked by one
  server process that imported torch and fivefold once; `fivefold train` starts that server as
  soon as the config is checked, so its imports overlap the launcher's own start (data, torch's
  agent, the rendezvous);
- `torchrun`: torch's own launcher, `--standalone`, each worker a fresh interpreter that imports
  torch and fivefold itself (in parallel, one per core here).
The two alternate within each round (which goes first alternates too), so a slow moment of this
shared machine falls on both. Each side's time is the wall time from the command's start to its
exit (`time.perf_counter` around `subprocess.run`); the summary gives the medians and their ratio
fivefold / torchrun (below 1: fivefold starts faster). The data cache lives in the run's fresh
folder, so every run tokenizes its 20 kB again (rank 0 does, under torchrun): the same work both ways.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["--train.steps=2", "--optim.warmup_steps=1", "--data.max_bytes=20000", "--no-progress"]
SIDES = ("fivefold", "torchrun")


def command(side: str, nproc: int) -> list[str]:
    config = str(ROOT / "configs" / "debug.toml")
    if side == "fivefold":
        return [sys.executable, "-m", "fivefold", "train", config, "--nproc", str(nproc), *RUN]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "fivefold", "train", config, *RUN]


def timed(side: str, nproc: int) -> float:
    """Seconds from the start of `side`'s command to its exit, in a fresh folder."""
    folder = Path(tempfile.mkdtemp(prefix=f"ff-launch-{side}-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        began = time.perf_counter()
        done = subprocess.run([*command(side, nproc), f"--run.out_dir={folder}"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - began
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else reversed(SIDES):
            times[side].append(timed(side, args.nproc))
        print(f"round {r + 1}: " + ", ".join(f"{s} {times[s][-1]:.2f} s" for s in SIDES), file=sys.stderr, flush=True)
    medians = {side: statistics.median(xs) for side, xs in times.items()}
    print(json.dumps({"nproc": args.nproc, "rounds": args.rounds,
                      **{f"{side}_s": [round(x, 3) for x in xs] for side, xs in times.items()},
                      **{f"{side}_median_s": round(m, 3) for side, m in medians.items()},
                      "ratio_fivefold_over_torchrun": round(medians["fivefold"] / medians["torchrun"], 4)}))


if __name__ == "__main__":
    main()
