"""The launcher for real: a worker killed from outside, two nodes on one machine, bad input.

Every `fivefold train` here is a real launcher process, and each start costs seconds (the launcher
and the forkserver its workers come from import torch), so the launched cases share one reference run.
"""

import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import ROOT, reference_records

from fivefold.cli import main
from fivefold.train.metrics import read_metrics

# 8 steps over an epoch boundary (35 samples, batches of 8: the 5th batch holds 3).
RUN = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=8")
STEPS = 8
CONFIG = str(ROOT / "configs" / "tiny.toml")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted one-node run on 2 ranks (forked in this process): its metrics records."""
    return reference_records(tmp_path_factory.mktemp("reference"), 2, *RUN)


def start(out: Path, *args: str, log: str = "job.log", env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """`fivefold train` on the tiny config as a process of its own; its output goes to a file."""
    path = out / log
    cmd = [sys.executable, "-m", "fivefold", "train", CONFIG, f"--run.out_dir={out}", *RUN, "--no-progress", *args]
    with path.open("w") as f:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "1000", **(env or {})}  # COLUMNS: no wrapping
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=f)
    return job, path


def same_steps(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["loss"], r["epoch"], r["samples"]) for r in records]


def assert_each_sample_once(records: list[dict]) -> None:
    """Positions consumed in each epoch's order: no repeats, and no gap before the last one."""
    seen = [(r["epoch"], i) for r in records for i in range(*r["samples"])]
    assert len(seen) == len(set(seen)), "a sample was repeated"
    for epoch in {e for e, _ in seen}:
        positions = sorted(i for e, i in seen if e == epoch)
        assert positions == list(range(len(positions))), f"epoch {epoch}: a sample was skipped"


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def worker_pids(launcher: int) -> list[int]:
    """The workers: children of the launcher's forkserver (its other child is the resource tracker)."""
    servers = [c for c in children(launcher) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
    return sorted(w for server in servers for w in children(server))


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets process `pid` listens on (from /proc, no tools needed)."""
    inodes = {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir()
              if os.readlink(fd).startswith("socket:[")}
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                raw = bytes.fromhex(fields[1].split(":")[0])
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                found.append(str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))))
    return found


def test_a_killed_worker_restarts_the_job_which_resumes_exactly(tmp_path, uninterrupted):
    job, log = start(tmp_path, "--nproc", "2", "--max-restarts", "1", "--checkpoint.every=2")
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    try:
        while not (metrics.is_file() and len(read_metrics(metrics)) >= 3):
            assert job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.01)
        done = len(read_metrics(metrics))  # steps logged (event lines are not steps)
        # A local run's rendezvous and workers' store listen on loopback only.
        listens = listening_addresses(job.pid)
        workers = worker_pids(job.pid)
        os.kill(workers[-1], signal.SIGKILL)
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        job.kill()
    assert len(workers) == 2 and done < STEPS  # killed mid-run
    assert len(listens) >= 2 and all(ipaddress.ip_address(a).is_loopback for a in listens), listens
    resumed = re.search(r"resumed from \S+ at step (\d+)", log.read_text())
    assert resumed, log.read_text()[-3000:]
    # From the last complete checkpoint: the one of step `done - 1` or before was complete when step
    # `done` was logged (checkpoints every 2 steps).
    assert (done - 1) // 2 * 2 <= int(resumed.group(1)) < STEPS
    records = read_metrics(metrics)
    assert same_steps(records) == same_steps(uninterrupted)  # losses bit-exact, the same samples each step
    assert_each_sample_once(records)
    assert records[0]["comm"]["dp"]["calls"] == 1  # one gradient all-reduce per step over 2 ranks
    assert (tmp_path / "tiny" / "config.toml").is_file() and f"outputs in {tmp_path / 'tiny'}" in log.read_text()


def test_a_killed_launcher_leaves_no_worker_behind(tmp_path):
    """SIGKILL the launcher mid-run: its workers end within seconds (launch.die_with_parent), not
    after finishing the run on their own; while it ran, a second job on its directory was refused."""
    job, log = start(tmp_path, "--nproc", "2", "--train.steps=100000")
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    try:
        while not (metrics.is_file() and read_metrics(metrics)):
            assert job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.01)
        workers = worker_pids(job.pid)
        # One job per run directory: a second one is refused while the first runs, naming its pid.
        second = subprocess.run([sys.executable, "-m", "fivefold", "train", CONFIG, f"--run.out_dir={tmp_path}", *RUN,
                                 "--resume", "--no-progress"], cwd=ROOT, capture_output=True, text=True)
        assert second.returncode == 2 and f"in use by the job of pid {job.pid}" in second.stderr, second.stderr
        os.kill(job.pid, signal.SIGKILL)
        job.wait(timeout=30)
        # Polled for up to 120 s: dying with the parent takes a signal's delivery, and left alive the
        # workers would train 100,000 steps (hours), so a loaded machine cannot blur the two.
        deadline = time.monotonic() + 120
        while any(Path(f"/proc/{w}").exists() and "Z" not in _state(w) for w in workers):
            assert time.monotonic() < deadline, f"workers {workers} outlived their launcher"
            time.sleep(0.05)
    finally:
        job.kill()
        for w in worker_pids(job.pid) if job.poll() is None else []:
            os.kill(w, signal.SIGKILL)
    assert len(workers) == 2


def test_a_killed_rank_is_named_first(tmp_path):
    """kill -9 of one worker: the launcher's summary names that rank and pid as the cause, and the
    survivor that lost its peer as a consequence (launch/worker_report.py), not the other way round."""
    reports = tmp_path / "reports"
    reports.mkdir()
    job, log = start(tmp_path, "--nproc", "2", "--train.steps=100000", env={"FIVEFOLD_WORKER_DIR": str(reports)})
    metrics = tmp_path / "tiny" / "metrics.jsonl"
    try:
        while not (metrics.is_file() and read_metrics(metrics)):
            assert job.poll() is None, log.read_text()[-3000:]
            time.sleep(0.01)
        ranks = {r: json.loads((reports / f"attempt0-rank{r}.json").read_text())["pid"] for r in (0, 1)}
        os.kill(ranks[1], signal.SIGKILL)
        assert job.wait(timeout=120) == 2
    finally:
        job.kill()
    text = log.read_text()
    # A rank killed or failed as a consequence prints no traceback (launch/worker_report.py).
    assert "Traceback" not in text
    first = text.index(f"rank 1 (pid {ranks[1]}) died without an error")
    # Rank 0 either finds its peer gone first (its all_reduce fails: torch's agent logs that in one
    # line, not its 60-line traceback) or, on a loaded machine, the launcher sees rank 1's death first
    # and stops it (seen under two busy loops): either way after the cause, never as the cause.
    if "failed (exitcode: 1) local_rank: 0" in text:
        after = text.index(f"rank 0 (pid {ranks[0]}) failed as a consequence: rank 0: all_reduce")
    else:
        after = text.index(f"rank 0 (pid {ranks[0]}) was stopped by the launcher")
    assert text.index("the job failed; first cause:") < first < after


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return "Z"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_like_one_node(tmp_path, uninterrupted):
    endpoint = f"127.0.0.1:{free_port()}"
    # Node 1 first: it must wait for node 0's rendezvous to appear.
    nodes = [start(tmp_path, "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                   log=f"node{rank}.log") for rank in (1, 0)]
    try:
        for job, log in nodes:
            assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        for job, _ in nodes:
            job.kill()
    # dp = 2 over two nodes is the same computation as over two local ranks: exactly equal.
    assert same_steps(read_metrics(tmp_path / "tiny" / "metrics.jsonl")) == same_steps(uninterrupted)


def _train_command(tmp_path: Path, *args: str) -> list[str]:
    return ["train", CONFIG, f"--run.out_dir={tmp_path}", "--no-progress", *args]


def test_a_rendezvous_port_in_use_fails_at_once_naming_it(tmp_path, capsys):
    """At once: the message comes from binding the port, before any rendezvous waits (no clock asked)."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        endpoint = f"127.0.0.1:{taken.getsockname()[1]}"
        code = main(_train_command(tmp_path, "--nproc", "1", "--nnodes", "2", "--node-rank", "0",
                                   "--rdzv-endpoint", endpoint, "--rdzv-timeout", "5"))
    assert code == 2 and not dist.is_initialized()
    assert f"rendezvous endpoint {endpoint}: the port is already in use" in capsys.readouterr().err


def test_a_node_that_never_joins_times_out_naming_the_address(tmp_path, capsys):
    endpoint = f"127.0.0.1:{free_port()}"
    # Node 0 waits for node 1, which never comes.
    assert main(_train_command(tmp_path, "--nproc", "1", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                               endpoint, "--rdzv-timeout", "1")) == 2
    err = capsys.readouterr().err
    assert f"rendezvous at {endpoint}: 1 of 2 nodes joined within 1 s" in err and "missing node-rank 1" in err
    # Node 1 waits for node 0's rendezvous, which never comes.
    assert main(_train_command(tmp_path, "--nproc", "1", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint",
                               endpoint, "--rdzv-timeout", "1")) == 2
    assert f"no rendezvous at {endpoint} within 1 s" in capsys.readouterr().err  # the timeout given, said
    assert not (tmp_path / "tiny").exists()  # no worker ever started


def test_a_missing_corpus_or_an_unwritable_run_directory_fails_before_any_process(tmp_path, capsys):
    """An unwritable folder is made with a file where a folder should be: chmod would not stop root."""
    (tmp_path / "a_file").write_text("")
    out_dir = tmp_path / "a_file" / "runs"
    code = main(["train", CONFIG, "--nproc", "2", f"--run.out_dir={out_dir}", "--data.paths=['no/such/corpus']"])
    err = capsys.readouterr().err
    assert code == 2 and not dist.is_initialized()
    assert "data.paths: 'no/such/corpus' does not exist" in err
    assert f"run directory '{out_dir / 'tiny'}' is not writable ('{tmp_path / 'a_file'}' is a file" in err
    assert "set --run.out_dir to a writable folder" in err
