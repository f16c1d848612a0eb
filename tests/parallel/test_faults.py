"""Faults inside a run: a collective whose peer never comes (skipped or stopped), a checkpoint write that
runs out of space."""

import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
import traceback

import pytest
import torch
from helpers import ROOT, config_mesh, tiny_config

from fivefold.checkpoint.run_state import latest_checkpoint
from fivefold.data.batches import DataCacheError, epoch_order
from fivefold.launch.worker_report import AGENT_LOGGER, culprit_summary, error_line, missing_ranks, one_line_failures
from fivefold.parallel.comm import arrivals, collectives
from fivefold.parallel.forked_ranks import WorkerError, run_workers
from fivefold.train.loop import train


def _skip_a_collective(rank, world, cfg):
    mesh, _ = config_mesh(cfg, world)
    expert = mesh.subgroups([[0, 1]], "ep")
    collectives.all_reduce(torch.ones(1), mesh.group("dp"))  # one call together: rank 1 is one behind below
    if rank == 1:  # took another code path: never makes the calls below (the harness kills it at the end)
        threading.Event().wait()
    messages = []
    # Async, as DDP's gradient buckets: the error comes from wait().
    try:
        collectives.all_to_all(torch.empty(6, 4), torch.ones(6, 4), expert, async_op=True).wait()
    except collectives.CollectiveError as e:
        messages.append(str(e))
    try:
        collectives.all_reduce(torch.ones(1000), mesh.group("dp"))
    except collectives.CollectiveError as e:
        messages.append(str(e))
    # Point-to-point calls (pipeline sends and receives, ring hops) name theirs too.
    try:
        collectives.recv(torch.empty(4), 1, mesh.group("dp"), "recv activation mb 0 from stage 1")
    except collectives.CollectiveError as e:
        messages.append(str(e))
    # Raise rather than return: the harness then kills rank 1.
    raise AssertionError("\n".join(messages))


def test_a_skipped_collective_times_out_naming_rank_axis_operation_and_the_rank_behind(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.collective_timeout_s=0.5")
    with pytest.raises(WorkerError) as failed:
        run_workers(_skip_a_collective, 2, cfg)
    async_message, sync_message, p2p_message = str(failed.value).split("AssertionError: ")[1].splitlines()[:3]
    # The collectives waited the configured 0.5 s, not torch's default: the backend's own words say so
    # (its clock, not this test's: a loaded machine makes the test slower, never the timeout longer).
    # The receive after them finds the pair the timeout closed.
    for message in (async_message, sync_message):
        assert "Timed out waiting 500ms" in message.split("Backend: ")[1], message
    assert async_message.startswith("rank 0: all_to_all of 96 bytes on axis 'ep' (rank 0 of 2 there) got no "
                                    "answer within 0.5 s (parallel.collective_timeout_s). Never arrived: rank 1 "
                                    "made 0 of these calls, this is call 1: it took another code path")
    # The dp group had one call that both ranks made: rank 1 is one behind.
    assert sync_message.startswith("rank 0: all_reduce of 4,000 bytes on axis 'dp' (rank 0 of 2 there) got no "
                                   "answer within 0.5 s (parallel.collective_timeout_s). Never arrived: rank 1 "
                                   "made 1 of these calls, this is call 2")
    assert "stopped" not in sync_message  # its thread kept reporting: late, not stopped
    assert p2p_message.startswith("rank 0: recv activation mb 0 from stage 1 of 16 bytes on axis 'dp' (rank 0 of 2 "
                                  "there) got no answer within 0.5 s")
    assert "most likely died" in p2p_message and "another code path" in p2p_message  # messages count no calls


def _skip_a_barrier(rank, world, cfg):
    mesh, _ = config_mesh(cfg, world)
    collectives.barrier(mesh.group("dp"), "barrier after making the run directory")  # together: rank 1 one behind
    if rank == 1:  # never reaches the next barrier (the harness kills it once rank 0 has failed)
        threading.Event().wait()
    try:
        collectives.barrier(mesh.group("dp"), "barrier before writing checkpoint step 3")
    except collectives.CollectiveError as e:
        raise AssertionError(f"{sorted(e.missing)} {mesh.stats.snapshot()}\n{e}") from None


def test_a_barrier_one_rank_never_reaches_times_out_naming_that_rank(tmp_path):
    """A barrier is a collective of the layer like any other: counted (as coordination, "log") and,
    when a rank never comes, named by the rank that waited, with the barrier's own name."""
    cfg = tiny_config(tmp_path, "--parallel.collective_timeout_s=0.5")
    with pytest.raises(WorkerError) as failed:
        run_workers(_skip_a_barrier, 2, cfg)
    first, message = str(failed.value).split("AssertionError: ")[1].splitlines()[:2]
    assert first == "[1] {'log': {'calls': 2, 'bytes': 0, 'wire_bytes': 0.0}}"
    assert message.startswith("rank 0: barrier before writing checkpoint step 3 on axis 'dp', for metrics or "
                              "coordination (rank 0 of 2 there) got no answer within 0.5 s "
                              "(parallel.collective_timeout_s). Never arrived: rank 1 made 1 of these calls, this is "
                              "call 2: it took another code path"), message
    assert "Timed out waiting 500ms" in message.split("Backend: ")[1], message


def _stop_one_rank(rank, world, cfg):
    mesh, _ = config_mesh(cfg, world)
    collectives.all_reduce(torch.ones(1), mesh.group("dp"))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stopped, publishing thread too (the harness kills it later)
    began = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(8), mesh.group("dp"))
    except collectives.CollectiveError as e:
        raise AssertionError(f"{time.monotonic() - began:.1f} s {sorted(e.missing)}\n{e}") from None


def test_a_stopped_rank_is_named_by_the_rank_that_waits_for_it(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.collective_timeout_s=0.5")
    with pytest.raises(WorkerError) as failed:
        run_workers(_stop_one_rank, 2, cfg)
    first, message = str(failed.value).split("AssertionError: ")[1].splitlines()[:2]
    seconds, missing = first.split(" s ")
    assert missing == "[1]"
    # Named only once its report went STALE_AFTER_S without a beat, after the 0.5 s timeout (the
    # backend's words): lower bounds, which a loaded machine can only exceed. That the wait ends at
    # all is the harness's deadline's to catch.
    assert float(seconds) >= 0.5 + arrivals.STALE_AFTER_S - 0.05  # (printed to 0.1 s)
    assert "Timed out waiting 500ms" in message.split("Backend: ")[1], message
    assert message.startswith("rank 0: all_reduce of 32 bytes on axis 'dp' (rank 0 of 2 there) got no answer within "
                              f"0.5 s (parallel.collective_timeout_s). Never arrived: rank 1 sent no report for "
                              f"{arrivals.STALE_AFTER_S:g} s: stopped (SIGSTOP, a debugger), hung or gone."), message


def _train(rank, world, cfg, file_size_limit=None):
    if file_size_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() then fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, resource.RLIM_INFINITY))
    train(cfg, progress=False)


def _digest(folder) -> dict:
    return {p.relative_to(folder): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def test_a_checkpoint_that_runs_out_of_space_keeps_the_previous_one(tmp_path):
    """A real write error from the kernel, without root: RLIMIT_FSIZE makes write() fail with EFBIG
    past 1 MiB, in the forked worker only (a checkpoint of the tiny model is about 5 MB). /dev/full
    would give ENOSPC, but only to a file opened at a path known in advance, and every checkpoint
    is written into a folder made afresh."""
    args = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--checkpoint.every=1")
    run_workers(_train, 1, tiny_config(tmp_path, *args, "--train.steps=2"))
    previous = tmp_path / "tiny" / "checkpoints" / "step_00000002"
    written = _digest(previous)
    with pytest.raises(WorkerError) as failed:
        run_workers(_train, 1, tiny_config(tmp_path, *args, "--train.steps=3", "--checkpoint.resume=true"), 1 << 20)
    tmp = previous.parent / ".tmp_step_00000003"
    message = str(failed.value)
    assert f"checkpoint step 3: no space left to write '{tmp}' (File too large)" in message
    assert "--run.out_dir" in message and f"the previous checkpoint '{previous}' is intact" in message
    # The partial folder is gone; the previous checkpoint is still the latest, byte for byte.
    assert not tmp.exists() and latest_checkpoint(tmp_path / "tiny") == previous
    assert _digest(previous) == written


def test_the_launcher_names_a_stopped_rank_first_from_its_peers_reports(tmp_path):
    """A SIGSTOPped rank ends in the launcher's SIGKILL with no error of its own; the rank whose
    collective timed out recorded it as missing, so the summary names it first (launch/worker_report.py)."""
    why = f"sent no report for {arrivals.STALE_AFTER_S:g} s: stopped (SIGSTOP, a debugger), hung or gone"
    reports = {0: {"pid": 100, "state": "failed", "missing": {"1": why},
                   "error": "rank 0: all_reduce of 32 bytes on axis 'dp' (rank 0 of 2 there) got no answer within 5 s"},
               1: {"pid": 101, "state": "running"}}
    for rank, report in reports.items():
        (tmp_path / f"attempt0-rank{rank}.json").write_text(json.dumps(report))
    assert culprit_summary(tmp_path).splitlines() == [
        "the job failed; first cause:",
        f"rank 1 (pid 101) never arrived at a collective rank 0 waited for: {why}",
        f"rank 0 (pid 100) failed as a consequence: {reports[0]['error']}"]
    # A CollectiveError's missing ranks reach the report through the exception chain.
    try:
        try:
            raise collectives.CollectiveError("timed out", {1: why})
        except collectives.CollectiveError as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert missing_ranks(e) == {"1": why}


def test_on_nccl_the_launcher_names_the_rank_the_watch_found_missing(tmp_path, monkeypatch):
    """NCCL's watchdog ends every waiting rank at the timeout, with no error: the watch's finding,
    kept in the waiting rank's file while it ran, names the culprit first; the waiter follows."""
    from fivefold.launch.worker_report import WORKER_DIR, note_missing

    why = "made 2 of these calls, this is call 3: it took another code path"
    monkeypatch.setenv(WORKER_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    note_missing({1: why})  # rank 0's watch, before NCCL's watchdog aborts it
    (tmp_path / "attempt0-rank1.json").write_text(json.dumps({"pid": 101, "state": "running"}))
    pid = os.getpid()
    assert culprit_summary(tmp_path).splitlines() == [
        "the job failed; first cause:",
        f"rank 1 (pid 101) never arrived at a collective rank 0 waited for: {why}",
        f"rank 0 (pid {pid}) was ended waiting for them (parallel.collective_timeout_s)"]


def test_the_summary_ends_with_the_first_causes_traceback_and_torchs_lines_are_one_each(tmp_path):
    """A rank that raised comes first with its error and, after the note, its traceback; the rank
    that failed as a consequence gets neither. torch's agent logs each failed worker as an
    exception (60 lines through its spawn wrapper): one line each while the launcher runs."""
    try:
        [][1]
    except IndexError as e:
        bug = e
    lost = collectives.CollectiveError("rank 0: all_reduce of 32 bytes on axis 'dp' lost the connection to a peer", {})
    assert error_line(bug) == "IndexError: list index out of range"  # Python's words, with the type
    assert error_line(lost) == str(lost)  # fivefold's own kinds name the fix already
    reports = {0: {"pid": 100, "state": "failed", "error": error_line(lost), "traceback": "Traceback (0)\nlost"},
               1: {"pid": 101, "state": "failed", "error": error_line(bug),
                   "traceback": "".join(traceback.format_exception(bug))}}
    for rank, report in reports.items():
        (tmp_path / f"attempt0-rank{rank}.json").write_text(json.dumps(report))
    lines = culprit_summary(tmp_path, note="(the note)").splitlines()
    assert lines[:5] == ["the job failed; first cause:", "rank 1 (pid 101) failed: IndexError: list index out of range",
                         f"rank 0 (pid 100) failed as a consequence: {lost}", "(the note)", "rank 1's traceback:"]
    assert lines[5] == "  Traceback (most recent call last):" and lines[-1] == "  IndexError: list index out of range"
    assert not any("Traceback (0)" in line for line in lines)

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(logging.Formatter().format(record))
    agent = logging.getLogger(AGENT_LOGGER)
    agent.addHandler(handler)
    try:
        with one_line_failures():
            try:
                raise RuntimeError("\n\n-- Process 0 terminated with the following error:\nTraceback ...\n"
                                   "IndexError: list index out of range")
            except RuntimeError:
                agent.exception("failed (exitcode: %s) local_rank: %s", 1, 0)
        try:
            raise RuntimeError("after")
        except RuntimeError:
            agent.exception("outside")  # the filter is gone with the launch
    finally:
        agent.removeHandler(handler)
    assert seen[0] == "failed (exitcode: 1) local_rank: 0: IndexError: list index out of range"
    assert seen[1].startswith("outside\nTraceback")


@contextlib.contextmanager
def small_disk(folder, size: str):
    """A real full disk: a tmpfs of `size` mounted at `folder` (root only); skipped where mount is refused."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}); the injected "
                    f"ENOSPC tests cover the same paths")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def fill(disk, leave: int) -> None:
    """Take all of the disk's space but `leave` bytes (0: until a write fails)."""
    with (disk / "filler").open("wb", buffering=0) as f, contextlib.suppress(OSError):  # ENOSPC: full
        f.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
        while not leave:
            f.write(b"\0" * 4096)


@pytest.mark.parametrize("fault", ["blocking", "async", "metrics"])
def test_a_full_disk_names_the_file_keeps_the_previous_checkpoint_and_no_half_line(tmp_path, fault):
    """A real tmpfs: one checkpoint (about 5 MB for the tiny model) is written, then the disk is
    filled but for 256 KiB, room for a few metrics lines and not for the next checkpoint (blocking
    or asynchronous: while it is written, training logs on), or for nothing (the metrics log: its
    last page has room for a line or two, then a line is cut by the full disk)."""
    with small_disk(tmp_path / "disk", "16m") as disk:
        args = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=8",
                f"--checkpoint.every={100 if fault == 'metrics' else 2}",
                f"--checkpoint.async_save={'true' if fault == 'async' else 'false'}")
        run_workers(_train, 1, tiny_config(disk, *args, "--train.stop_after=2"))
        run_dir = disk / "tiny"
        previous = run_dir / "checkpoints" / "step_00000002"
        written = _digest(previous)
        fill(disk, 0 if fault == "metrics" else 256 << 10)
        with pytest.raises(WorkerError) as failed:
            run_workers(_train, 1, tiny_config(disk, *args, "--checkpoint.resume=true"))
        message = str(failed.value)
        tmp = previous.parent / ".tmp_step_00000004"
        if fault == "blocking":
            assert f"checkpoint step 4: no space left to write '{tmp}' (No space left on device" in message
            assert f"the previous checkpoint '{previous}' is intact" in message
        elif fault == "metrics":
            assert f"{run_dir / 'metrics.jsonl'}: no space left writing the step record" in message
        else:  # the checkpoint's thread, the metrics log or the next epoch's order finds the disk full first
            assert (f"checkpoint step 4: no space left to write '{tmp}'" in message
                    or f"{run_dir / 'metrics.jsonl'}: no space left writing the step record" in message
                    or f"{disk / '.prepared' / 'orders'}/" in message and "no space left writing epoch 1's" in message
                    ), message
        # The previous checkpoint is still the latest, byte for byte; no partial folder; whole lines only.
        assert latest_checkpoint(run_dir) == previous and _digest(previous) == written
        assert not list(previous.parent.glob(".tmp_*"))
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())


def _where_messages(rank, world):
    from fivefold.parallel.comm.collectives import AxisGroup, CommStats
    from fivefold.parallel.comm.errors import named_error

    stats, timeout = CommStats(), RuntimeError("Timed out waiting 500ms for recv operation to complete")
    grad = AxisGroup("grad", "dp", None, 2, 0, stats, timeout_s=0.5)
    world_log = AxisGroup("world", "log", None, 2, 0, stats, timeout_s=0.5)
    return [str(named_error(timeout, "all_reduce", grad, 8, "dp")),
            str(named_error(timeout, "all_reduce", grad, 8, "log")),
            str(named_error(timeout, "all_gather", world_log, 8, "log"))]


def test_a_message_names_the_users_axis_first():
    """dp, the user's word, before the internal view's name (grad = dp x cp)."""
    (ours, metrics, log), = run_workers(_where_messages, 1)
    assert ours.startswith("rank 0: all_reduce of 8 bytes on axis 'dp' (its 'grad' group) (rank 0 of 2 there) got no")
    assert metrics.startswith("rank 0: all_reduce of 8 bytes on axis 'dp' (its 'grad' group), for metrics or "
                              "coordination (rank 0 of 2 there)")
    assert log.startswith("rank 0: all_gather of 8 bytes on the 'world' group (metrics and coordination) (rank 0 of 2")


def _order_into(rank, world, folder):
    try:
        epoch_order(1_000_000, 0, 0, folder)
    except DataCacheError as e:
        return str(e)


def test_an_epoch_order_on_a_full_disk_names_its_file(tmp_path):
    """The order is memory-mapped: its blocks are taken before the map is written, so a disk with
    room for the file's header and not its 4 MB is an error naming the file, not a SIGBUS at the
    first write of a page (built in a forked worker: a SIGBUS would kill it, not pytest)."""
    with small_disk(tmp_path / "disk", "1m") as disk:
        fill(disk, 64 << 10)
        (message,) = run_workers(_order_into, 1, disk / "orders")
    assert message.startswith(f"{disk / 'orders'}/.order-n1000000-seed0-epoch0.npy.")
    assert "no space left writing epoch 0's sample order (4,000,000 bytes)" in message


def test_the_arrivals_thread_publishes_counts_and_stops_on_close():
    """A daemon thread; its first report at once, then one a period; none after close()."""
    store = torch.distributed.HashStore()

    def report(mesh: int, rank: int) -> dict | None:
        key = f"fivefold.arrivals/{mesh}/{rank}"
        return json.loads(store.get(key)) if store.check([key]) else None

    first, second = arrivals.Arrivals(store, 3), arrivals.Arrivals(store, 3)  # two meshes of one rank
    try:
        assert first._thread.daemon and first._thread.is_alive()
        assert [first.issue("7"), first.issue("7"), first.issue("0")] == [1, 2, 1]
        # The next report holds the counts: due within a period; polled for up to ten, as a loaded
        # machine can delay the thread by a period or more (arrivals.py), and a thread that never
        # reports still fails here.
        deadline = time.monotonic() + 10 * arrivals.PUBLISH_PERIOD_S
        while (report(1, 3) or {}).get("calls") != {"7": 2, "0": 1}:
            assert time.monotonic() < deadline, f"no report within ten periods: {report(1, 3)}"
            time.sleep(0.05)
        assert report(2, 3)["calls"] == {}  # the second mesh's own key
    finally:
        first.close()
        second.close()
    # close() ends the thread: joined here for up to ten periods (close's own join gives up after
    # 1 s, for a store stuck on a dead server; a loaded machine can take that long to wake it).
    for thread in (first._thread, second._thread):
        thread.join(timeout=10 * arrivals.PUBLISH_PERIOD_S)
        assert not thread.is_alive()


def test_on_nccl_the_watch_looks_before_the_process_groups_timeout_ends_the_process(tmp_path):
    """On NCCL a timed-out collective never raises in Python: the watchdog aborts the process at the
    process group's timeout. The arrivals watch must have looked and printed by then, with room for
    the host running ahead of its stuck collective. The settings are those a CUDA run derives from
    its config (train/loop.py's process group and the mesh's Arrivals both call collective_deadlines)."""
    from fivefold.config.load import load_config

    configs = [tiny_config(tmp_path), load_config(ROOT / "configs" / "debug.toml"),
               tiny_config(tmp_path, "--parallel.collective_timeout_s=60")]
    for cfg in configs:
        d = arrivals.collective_deadlines(cfg.parallel.collective_timeout_s, "cuda")
        assert d.process_group_s == cfg.parallel.collective_timeout_s
        assert d.watch_s is not None and d.watch_s + d.look_s < d.process_group_s, d
        assert d.process_group_s - (d.watch_s + d.look_s) >= d.look_s  # room for a step's run-ahead
    assert arrivals.collective_deadlines(None, "cuda").process_group_s == 600  # NCCL's default: 10 min
    # gloo raises at the timeout, where comm/errors.py asks who is missing: no watch
    assert arrivals.collective_deadlines(300, "cpu").watch_s is None
    # too short for a look to end before it: no watch rather than one that looks too late
    assert arrivals.collective_deadlines(4 * arrivals.LOOK_S - 1, "cuda").watch_s is None


def test_the_watch_names_the_peers_behind_once_per_silence(monkeypatch, capsys):
    """A rank silent for watch_s (blocked on a collective) reads its peers' reports and prints the
    ranks that have not reached its last call on a group, once per silence."""
    store = torch.distributed.HashStore()
    waiting, late = arrivals.Arrivals(store, 0), arrivals.Arrivals(store, 1)  # watched by hand below
    for a in (waiting, late):  # one writer per report, as in a run: the test's publishes only (a thread
        a._stop.set()  # late on a loaded machine could set an older report over a newer one)
        a._thread.join()
    # Fresh reports while a look waits for them.
    sleep = time.sleep
    monkeypatch.setattr(arrivals.time, "sleep", lambda s: (waiting._publish(), late._publish(), sleep(s)))
    try:
        for _ in range(3):
            waiting.issue("7")
        for _ in range(2):
            late.issue("7")
        groups = {"7": [0, 1]}
        behind = waiting.behind(groups)
        assert list(behind) == [(0, 1)] and behind[(0, 1)][1].startswith("made 2 of these calls, this is call 3")
        assert late.behind(groups) == {}  # rank 0 is ahead of it, not behind
        monkeypatch.setattr(waiting, "_groups_called", lambda: groups)  # no process group here
        told = []
        waiting.on_found = told.append  # train/loop.py: the worker's report file (launch/worker_report.py)
        waiting._watch(0.0)  # silent for 0 s or more
        assert list(told[0]) == [1] and told[0][1].startswith("made 2 of these calls")
        line = capsys.readouterr().err
        assert line.startswith("rank 0: no collective launched for ")
        assert "of the group of ranks [0, 1]: rank 1 made 2 of these calls" in line
        waiting._watch(0.0)  # the same silence: looked at already
        assert capsys.readouterr().err == ""
    finally:
        waiting.close()
        late.close()
