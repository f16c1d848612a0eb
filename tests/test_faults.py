"""Faults inside a run: a collective whose peer never comes, a checkpoint write that runs out of space."""

import hashlib
import resource
import signal
import time

import pytest
import torch
from helpers import tiny_config

from fivefold.mesh import Mesh
from fivefold.parallel import comms
from fivefold.testing import WorkerError, run_workers
from fivefold.train.checkpoint import latest_checkpoint
from fivefold.train.loop import train
from fivefold.validate import derive


def _skip_a_collective(rank, world, cfg):
    mesh = Mesh.from_config(cfg, derive(cfg, world))
    expert = mesh.subgroups([[0, 1]], "ep")
    if rank == 1:  # took another code path: never makes the calls below
        time.sleep(60)
    messages = []
    began = time.monotonic()
    # Async, as DDP's gradient buckets: the error comes from wait().
    try:
        comms.all_to_all(torch.empty(6, 4), torch.ones(6, 4), expert, async_op=True).wait()
    except comms.CollectiveError as e:
        messages.append(str(e))
    try:
        comms.all_reduce(torch.ones(1000), mesh.group("dp"))
    except comms.CollectiveError as e:
        messages.append(str(e))
    # Point-to-point calls (pipeline sends and receives, ring hops) name theirs too.
    try:
        comms.recv(torch.empty(4), 1, mesh.group("dp"), "recv activation mb 0 from stage 1")
    except comms.CollectiveError as e:
        messages.append(str(e))
    # Raise rather than return: the harness's closing barrier would meet rank 1's late calls.
    raise AssertionError(f"{time.monotonic() - began:.1f} s\n" + "\n".join(messages))


def test_a_skipped_collective_times_out_naming_rank_axis_and_operation(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.collective_timeout_s=0.5")
    with pytest.raises(WorkerError) as failed:
        run_workers(_skip_a_collective, 2, cfg)
    seconds, async_message, sync_message, p2p_message = str(failed.value).split("AssertionError: ")[1].splitlines()[:4]
    assert float(seconds.split()[0]) < 4  # three waits of 0.5 s each, not the default 300 s
    assert async_message.startswith("rank 0: all_to_all of 96 bytes on axis 'ep' (rank 0 of 2 there) got no "
                                    "answer within 0.5 s (parallel.collective_timeout_s)")
    assert sync_message.startswith("rank 0: all_reduce of 4,000 bytes on axis 'dp' (rank 0 of 2 there) got no "
                                   "answer within 0.5 s")
    assert "most likely died" in sync_message and "another code path" in sync_message
    assert p2p_message.startswith("rank 0: recv activation mb 0 from stage 1 of 16 bytes on axis 'dp' (rank 0 of 2 "
                                  "there) got no answer within 0.5 s")


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
