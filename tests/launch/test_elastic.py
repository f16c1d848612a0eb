"""Elastic jobs (--nnodes MIN:MAX): lose a node, re-plan for the ranks left, continue on the same
sample stream with the same losses; grow back when the node returns; and the bad inputs.

The launched cases run two real launcher "nodes" of 2 processes each on loopback (every launcher
start costs seconds: it and its forkserver import torch). They share one reference: the
uninterrupted 4-rank run, forked in this process. Rendezvous settings keep them short: a round
with at least MIN nodes starts 2 s after MIN arrived (--rdzv-last-call), and a node silent for 3
heartbeats of 1 s is lost (--rdzv-keep-alive).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, reference_records, tiny_config, train_only
from test_launch import assert_each_sample_once, children, free_port, worker_pids

from fivefold.checkpoint.run_dir import latest_checkpoint
from fivefold.cli import main
from fivefold.launch.agent import add_arguments, spec_from_args
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_events, read_metrics

STEPS = 24
# 24 steps over 5 epochs (35 samples, batches of 8: each epoch's 5th batch holds 3), checkpoints
# every 3 steps. AdamW's eps 1e-6, as in the equivalence tests (helpers.EQUIVALENCE says why): with
# 1e-8 a 1e-12 difference of summation order between layouts can move a weight by 1e-2.
RUN = ("--data.max_bytes=1100", "--data.val_fraction=0.0", f"--train.steps={STEPS}", "--checkpoint.every=3",
       "--optim.eps=1e-6")
RDZV = ("--rdzv-last-call", "2", "--rdzv-keep-alive", "1")
CONFIG = str(ROOT / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run on 4 ranks (dp4): its step records."""
    return reference_records(tmp_path_factory.mktemp("reference"), 4, *RUN)


def start(out: Path, rank: int, port: int, *args: str, log: str) -> subprocess.Popen:
    """One node's `fivefold train` launcher of 2 workers in an elastic job of 1 to 2 nodes."""
    cmd = [sys.executable, "-m", "fivefold", "train", CONFIG, f"--run.out_dir={out}", *RUN, "--no-progress",
           "--nproc", "2", "--nnodes", "1:2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
           *RDZV, *args]
    with (out / log).open("w") as f:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f)


def wait_for(condition, jobs: list[subprocess.Popen], out: Path, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for job in jobs:
            assert job.poll() is None, "\n".join(p.read_text()[-2000:] for p in sorted(out.glob("*.log")))
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def sigterm_pending(pid: int) -> bool:
    """Whether SIGTERM waits to be delivered to stopped process `pid` (Linux: /proc/PID/status)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return bool(pending >> (signal.SIGTERM - 1) & 1)


def running_on(metrics: Path, world: int, steps: int) -> bool:
    """The job logged `steps` steps and its latest layout has `world` ranks."""
    if not metrics.is_file():
        return False
    layouts = [e for e in read_events(metrics) if e["event"] == "layout"]
    return bool(layouts) and layouts[-1]["world_size"] == world and len(read_metrics(metrics)) >= steps


def kill_node(launcher: subprocess.Popen) -> None:
    """SIGKILL a node: its launcher, the launcher's forkserver and the workers."""
    victims = [launcher.pid, *children(launcher.pid), *worker_pids(launcher.pid)]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait()


def assert_same_run(records: list[dict], reference: list[dict]) -> None:
    """Every step once, the reference's samples in each, and its losses within the equivalence tests'
    fp32 tolerance (helpers.assert_reproduces: rtol 1e-5; measured here: 7e-8 after dp4 -> dp2)."""
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert [(r["epoch"], r["samples"]) for r in records] == [(r["epoch"], r["samples"]) for r in reference]
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]),
                               torch.tensor([r["loss"] for r in reference]), rtol=1e-5, atol=0)
    assert_each_sample_once(records)


def shrink(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, int, Path]:
    """Start the two nodes (node 1 first: it waits for node 0's rendezvous), let them train on 4 ranks,
    then SIGKILL node 1. Returns node 0's launcher, the port and the metrics file."""
    port, metrics = free_port(), tmp_path / "tiny" / "metrics.jsonl"
    node1 = start(tmp_path, 1, port, *args, log="node1.log")
    node0 = start(tmp_path, 0, port, *args, log="node0.log")
    try:
        wait_for(lambda: running_on(metrics, 4, 4), [node0, node1], tmp_path)
    except BaseException:
        node0.kill()
        raise
    finally:
        kill_node(node1)
    assert len(read_metrics(metrics)) < STEPS  # killed mid-run
    return node0, port, metrics


def replans(metrics: Path) -> list[dict]:
    return [e for e in read_events(metrics) if e["event"] == "replan"]


def test_keep_tp_shrinks_tp2_dp2_to_tp2(tmp_path, uninterrupted):
    node0, _, metrics = shrink(tmp_path, "--parallel.tp=2", "--keep", "tp")
    try:
        assert node0.wait(timeout=300) == 0, (tmp_path / "node0.log").read_text()[-3000:]
    finally:
        node0.kill()
    (event,) = replans(metrics)
    assert (event["from"], event["to"], event["kept"]) == ("dp2 tp2 z0 mb2 -", "dp1 tp2 z0 mb2 -", ["tp"])
    assert event["grad_accum"] == [2, 4]  # 8 / (dp 1 x micro-batch 2)
    assert_same_run(read_metrics(metrics), uninterrupted)  # tp2 x dp2, then tp2: dp4's losses


def test_a_lost_node_leaves_the_job_on_the_other_and_grows_it_again_when_it_comes_back(tmp_path, uninterrupted):
    """Node 1 is killed: node 0 goes on alone from the last checkpoint; node 1 comes back: the job grows
    to 4 ranks again; the run is the uninterrupted one's, every step logged once."""
    node0, port, metrics = shrink(tmp_path)
    node1 = None
    try:
        wait_for(lambda: running_on(metrics, 2, 8), [node0], tmp_path)
        # Starting a launcher here takes longer than the rest of the run: hold node 0's workers
        # (SIGSTOP) until node 1's launcher has reached the rendezvous, so it joins mid-run.
        held = worker_pids(node0.pid)
        for pid in held:
            os.kill(pid, signal.SIGSTOP)
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store.delete_key("fivefold.arrived.1")  # set again by the new launcher of node-rank 1 (launch/agent.py)
        node1 = start(tmp_path, 1, port, log="node1-again.log")
        wait_for(lambda: store.check(["fivefold.arrived.1"]), [node0, node1], tmp_path)
        # Node 0's agent SIGTERMs its workers once it sees node 1 waiting; they take it when resumed.
        # Resumed before that, they could finish the run (0.4 s here) before the agent's next poll.
        wait_for(lambda: all(sigterm_pending(pid) for pid in held), [node0, node1], tmp_path)
        for pid in held:
            os.kill(pid, signal.SIGCONT)
        for job, log in ((node0, "node0.log"), (node1, "node1-again.log")):
            assert job.wait(timeout=300) == 0, (tmp_path / log).read_text()[-3000:]
    finally:
        for job in (node0, node1):
            if job is not None:
                job.kill()
    events = read_events(metrics)
    shrunk, grown = replans(metrics)
    (stop,) = [e for e in events if e["event"] == "stop"]
    # dp = world / (tp pp cp) = 2; global batch 8 = dp x micro-batch 2 x accumulation 2 (was 1 on dp4)
    assert (shrunk["world_size"], shrunk["from_world_size"], shrunk["from"], shrunk["to"]) == (
        2, 4, "dp4 z0 mb2 -", "dp2 z0 mb2 -")
    assert shrunk["grad_accum"] == [1, 2] and shrunk["micro_batch"] == [2, 2]
    assert shrunk["predicted_step_time_s"] == {"from": None, "to": None}  # no run.hardware, no --gpu
    # From the last complete checkpoint (every 3 steps); the steps after it ran again, logged once.
    assert shrunk["step"] % 3 == 0 and shrunk["step"] < STEPS
    assert "re-planned for 2 ranks (was 4): dp4 z0 mb2 - -> dp2 z0 mb2 -" in (tmp_path / "node0.log").read_text()
    # The join made node 0's agent SIGTERM its workers: they agreed on a step, saved there and stopped;
    # the grown world resumed from that checkpoint, so no step ran twice after the shrink.
    assert (grown["from_world_size"], grown["world_size"], grown["to"]) == (2, 4, "dp4 z0 mb2 -")
    assert grown["step"] == stop["step"] and grown["grad_accum"] == [2, 1]
    # One restart after a failure (the lost node); the agent does not count the join as one.
    assert [e["restarts"] for e in events if e["event"] == "restart"] == [1]
    assert_same_run(read_metrics(metrics), uninterrupted)


def test_a_world_below_min_ends_the_job_with_a_checkpoint_to_resume(tmp_path, uninterrupted):
    """--nnodes 2 (2:2) and a restart allowed: node 1 is lost, the rendezvous waits --rdzv-timeout for
    2 nodes, then node 0 ends naming the checkpoint; resuming from it (2 ranks) gives the same run."""
    port, metrics = free_port(), tmp_path / "tiny" / "metrics.jsonl"

    def node(rank: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "fivefold", "train", CONFIG, f"--run.out_dir={tmp_path}", *RUN, "--no-progress",
               "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--max-restarts", "1", "--rdzv-timeout", "10", "--rdzv-keep-alive", "1"]
        with (tmp_path / f"node{rank}.log").open("w") as f:
            return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000"},
                                    stdout=f, stderr=f)

    node1, node0 = node(1), node(0)
    try:
        wait_for(lambda: running_on(metrics, 2, 4), [node0, node1], tmp_path)
        kill_node(node1)
        assert node0.wait(timeout=120) == 2
    finally:
        node0.kill()
        node1.kill()
    text = (tmp_path / "node0.log").read_text()
    latest = latest_checkpoint(tmp_path / "tiny")
    assert "a round needs all 2 nodes (--nnodes 2) and fewer came back within 10 s (--rdzv-timeout)" in text
    assert f"the last complete checkpoint is {latest}: the same command with --resume continues from it" in text
    assert json.loads((latest / "state.json").read_text())["step"] < STEPS
    run_workers(train_only, 2, tiny_config(tmp_path, *RUN, "--checkpoint.resume=true"))  # 2 ranks here, on one node
    assert_same_run(read_metrics(metrics), uninterrupted)


def _command(tmp_path: Path, *args: str) -> list[str]:
    return ["train", CONFIG, f"--run.out_dir={tmp_path}", "--no-progress", "--nproc", "2", "--node-rank", "0",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *args]


@pytest.mark.parametrize("args, message", [
    (("--nnodes", "1:2", "--parallel.tp=2", "--parallel.pp=2", "--keep", "tp,pp"),
     "--nnodes 1:2, 1 node(s) of --nproc 2: re-plan for 2 ranks keeping tp=2, pp=2 (--keep tp,pp): "
     "tp x pp x cp = 4 does not divide 2 ranks"),
    (("--nnodes", "1:2", "--parallel.tp=4"),  # the default keeps every axis
     "re-plan for 2 ranks keeping tp=4, pp=1, cp=1, ep=1 (the default: only dp changes): tp x pp x cp = 4 "
     "does not divide 2 ranks"),
    (("--nnodes", "2:3", "--nproc", "1", "--train.global_batch=3", "--train.micro_batch=1"),
     "2 node(s) of --nproc 1: re-plan for 2 ranks keeping tp=1, pp=1, cp=1, ep=1 (the default: only dp changes): "
     "dp = 2 does not divide"),
    (("--nnodes", "1:2", "--keep", "dp"), "--keep 'dp': name axes among tp, pp, cp, ep"),
    (("--nnodes", "2", "--keep", "tp"), "--keep: only an elastic job changes its layout"),
    (("--nnodes", "3:2",), "--nnodes = '3:2': need 1 <= MIN <= MAX"),
    (("--nnodes", "1:2", "--replan"), "--replan needs hardware to plan for: set run.hardware"),
    (("--nnodes", "1:2", "--replan", "--gpu", "h1000"), "--gpu: unknown GPU 'h1000'"),
    (("--nnodes", "1:2", "--rdzv-timeout", "30"),
     "--rdzv-last-call 30 + 3 x --rdzv-keep-alive 5 = 45 s does not fit in --rdzv-timeout 30"),
])
def test_bad_elastic_input_fails_before_any_process_naming_the_flag(tmp_path, capsys, args, message):
    assert main(_command(tmp_path, *args)) == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized() and not (tmp_path / "tiny").exists()  # no process, nothing written


def _launch_errors(*argv: str) -> list[str]:
    """spec_from_args()'s problems with a command line of launcher flags (nothing starts)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-restarts", type=int, default=None)  # (the train command's)
    add_arguments(parser)
    return spec_from_args(parser.parse_args(argv), 2, under_torchrun=False)[1]


def test_an_elastic_last_call_must_fit_well_inside_the_rendezvous_timeout():
    """After losing a node, a round waits 3 keep-alives to take it for lost, then its last call; that wait
    may take at most two thirds of --rdzv-timeout. With the default last call, --rdzv-timeout 30 made node 0
    give up although it alone was enough for --nnodes 1:2; with --rdzv-last-call 5 the same job shrank and
    finished."""
    elastic = ("--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500")
    assert _launch_errors(*elastic) == []  # the defaults: 30 + 3 x 5 = 45 s of 300
    assert _launch_errors(*elastic, *RDZV) == []  # this file's jobs, and benchmarks/elastic.py's (the same)
    assert _launch_errors(*elastic, "--rdzv-keep-alive", "5", "--rdzv-last-call", "30") == []  # benchmarks/README.md
    assert _launch_errors(*elastic, "--rdzv-timeout", "30") == [
        "--rdzv-last-call 30 + 3 x --rdzv-keep-alive 5 = 45 s does not fit in --rdzv-timeout 30: a round that lost "
        "a node waits that long before it forms (the missed heartbeats, then the last call) and must form within "
        "the timeout, with half as long again to spare; use --rdzv-last-call <= 5 or --rdzv-timeout >= 68"]
    assert _launch_errors(*elastic, "--rdzv-timeout", "30", "--rdzv-last-call", "5") == []  # the job that finished
    (error,) = _launch_errors(*elastic, "--rdzv-timeout", "45", "--rdzv-keep-alive", "2.5")
    assert error.startswith("--rdzv-last-call 30 + 3 x --rdzv-keep-alive 2.5 = 37.5 s does not fit in "
                            "--rdzv-timeout 45")
    assert error.endswith("use --rdzv-last-call <= 22.5 or --rdzv-timeout >= 57")
    for fix in (("--rdzv-last-call", "22.5"), ("--rdzv-timeout", "57")):  # each fix it names is accepted
        assert _launch_errors(*elastic, "--rdzv-timeout", "45", "--rdzv-keep-alive", "2.5", *fix) == []
    # A fixed number of nodes has no last call: test_a_world_below_min_ends_the_job's 10 s timeout stands.
    assert _launch_errors("--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:29500",
                          "--rdzv-timeout", "10", "--rdzv-keep-alive", "1") == []
    assert _launch_errors(*elastic, "--rdzv-last-call", "inf") == [
        "--rdzv-last-call = inf: must be a finite number of seconds above 0"]
