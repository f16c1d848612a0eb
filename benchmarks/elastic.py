"""The time an elastic job takes from the loss of a node to the first step of its new layout.

Run: `.venv/bin/python benchmarks/elastic.py [--nproc 1] [--rounds 1] [--rdzv-keep-alive 1 --rdzv-last-call 2]`

Two `fivefold train` launcher "nodes" on loopback (`--nnodes 1:2`, --nproc workers each) train the
debug model (configs/debug.toml, on 200 kB of the standard library) with a checkpoint every
--every steps. After --kill-after steps node 1's launcher, forkserver and workers are SIGKILLed;
node 0 goes on alone under the re-planned layout. The phases, from the clock of this process and
the files the job writes (each node's worker reports, launch/agent.py's FIVEFOLD_WORKER_DIR, and
metrics.jsonl):

- detection: from the SIGKILL to node 0's worker failing on its collective (its report says `failed`);
- rendezvous: from that failure to the new worker's start (its report of the next attempt): the
  agent's poll (0.5 s), the node taken for lost (3 missed heartbeats of --rdzv-keep-alive), the
  round's last call (--rdzv-last-call) and the fork;
- re-plan: the replan event's `decide_s` (elastic.decide());
- process group and rest: what the new worker spends before its first step outside re-plan, setup
  and the step (init_process_group, the prediction, the metrics sinks);
- reshard-load: the replan event's `setup_s` (mesh, model, data, the checkpoint loaded into the new layout);
- warm-up: the first step of the new layout, less the median of the steps after it.

Also printed: the steps lost (the kill's step less the checkpoint's: they run again, at most
`checkpoint.every`), and the first step's time itself. A benchmark, not a test: nothing is
asserted. On this shared 2-core machine every phase stretches with the load; the rendezvous
phase is set by the two flags above (torch's defaults, 5 s and 30 s, make it ~45 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fivefold.train.metrics import read_events, read_metrics  # noqa: E402


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _node_pids(launcher: int) -> list[int]:
    """The launcher, its forkserver (and resource tracker), and the forkserver's workers."""
    below = _children(launcher)
    return [launcher, *below, *(w for c in below for w in _children(c))]


def _report(folder: Path, attempt: int) -> tuple[str, float] | None:
    """(state, mtime) of rank 0's report on node 0 for `attempt`, or None before it exists."""
    found = sorted(folder.glob(f"attempt{attempt}-rank*.json"))
    for path in found:
        try:
            return json.loads(path.read_text())["state"], path.stat().st_mtime
        except (OSError, ValueError):  # being replaced
            return None
    return None


def _wait(condition, what: str, timeout: float = 600.0, alive: tuple[tuple[subprocess.Popen, Path], ...] = ()):
    """condition()'s first true value; an error when a node in `alive` (job, its log) ends first."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for job, log in alive:
            if job.poll() is not None:
                raise RuntimeError(f"waiting for {what}: {log.name} ended with {job.returncode}:\n"
                                   + log.read_text()[-2000:])
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def one_round(out: Path, args: argparse.Namespace) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = ["--data.max_bytes=200000", f"--train.steps={args.steps}", f"--checkpoint.every={args.every}",
           "--train.eval_every=0", "--train.log_every=1000"]
    jobs = []
    for rank in (1, 0):  # node 1 first: it waits for node 0's rendezvous
        reports = out / f"reports{rank}"
        reports.mkdir(parents=True)
        cmd = [sys.executable, "-m", "fivefold", "train", str(ROOT / "configs" / "debug.toml"), f"--run.out_dir={out}",
               *run, "--no-progress", "--nproc", str(args.nproc), "--nnodes", "1:2", "--node-rank", str(rank),
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-last-call", str(args.rdzv_last_call),
               "--rdzv-keep-alive", str(args.rdzv_keep_alive)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FIVEFOLD_WORKER_DIR": str(reports), "PYTHONPATH": str(ROOT)}
        with (out / f"node{rank}.log").open("w") as f:
            jobs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f))
    node1, node0 = jobs
    metrics, reports0 = out / "debug" / "metrics.jsonl", out / "reports0"
    try:
        _wait(lambda: metrics.is_file() and len(read_metrics(metrics)) >= args.kill_after, "training on both nodes",
              alive=((node0, out / "node0.log"), (node1, out / "node1.log")))
        layouts = [e for e in read_events(metrics) if e["event"] == "layout"]
        if layouts[-1]["world_size"] != 2 * args.nproc:
            raise RuntimeError("node 1 was not in the first round: raise --rdzv-last-call")
        killed_at_step = len(read_metrics(metrics))
        victims = _node_pids(node1.pid)
        t_kill = time.time()
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):  # gone with its forkserver
                os.kill(pid, signal.SIGKILL)
        node1.wait()
        _, t_fail = _wait(lambda: (r := _report(reports0, 0)) and r[0] == "failed" and r, "the survivor's failure")
        _, t_start = _wait(lambda: _report(reports0, 1), "the new workers")
        event = _wait(lambda: next((e for e in read_events(metrics) if e["event"] == "replan"), None), "the re-plan")
        first = _wait(lambda: next((r for r in read_metrics(metrics) if r["step"] == event["step"] + 1), None)
                      if len(read_metrics(metrics)) > event["step"] else None, "the first step")
        t_first = time.time()
        assert node0.wait(timeout=600) == 0, (out / "node0.log").read_text()[-3000:]
    finally:
        for job in jobs:
            job.kill()
    after = [r["step_time_s"] for r in read_metrics(metrics) if r["step"] > event["step"] + 1]
    steady = statistics.median(after) if after else 0.0
    total = t_first - t_kill
    rest = (t_first - t_start) - event["decide_s"] - event["setup_s"] - first["step_time_s"]
    return {"detection_s": t_fail - t_kill, "rendezvous_s": t_start - t_fail, "replan_s": event["decide_s"],
            "process_group_and_rest_s": rest, "reshard_load_s": event["setup_s"],
            "warm_up_s": first["step_time_s"] - steady, "first_step_s": first["step_time_s"],
            "steady_step_s": steady, "total_s": total, "steps_lost": killed_at_step - event["step"],
            "from": event["from"], "to": event["to"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=1, help="workers per node (the machine has 2 cores)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="checkpoint.every")
    p.add_argument("--kill-after", type=int, default=8, help="steps logged before node 1 is killed")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rdzv-keep-alive", type=float, default=1.0)
    p.add_argument("--rdzv-last-call", type=float, default=2.0)
    args = p.parse_args()
    results = []
    for k in range(args.rounds):
        out = Path(tempfile.mkdtemp(prefix="fivefold-elastic-"))
        try:
            results.append(one_round(out, args))
        finally:
            shutil.rmtree(out, ignore_errors=True)
        print(json.dumps({"round": k, **results[-1]}), flush=True)
    keys = [k for k in results[0] if k.endswith("_s")]
    summary = {k: round(statistics.median(r[k] for r in results), 3) for k in keys}
    print(f"node lost -> first step of {results[0]['to']!r} (was {results[0]['from']!r}), median of {len(results)} "
          f"round(s), keep-alive {args.rdzv_keep_alive} s, last call {args.rdzv_last_call} s:")
    for k in keys:
        print(f"  {k[:-2]:26s} {summary[k]:8.3f} s")
    print(f"  steps lost (run again)     {results[0]['steps_lost']:8d}   (checkpoint.every = {args.every})")


if __name__ == "__main__":
    main()
