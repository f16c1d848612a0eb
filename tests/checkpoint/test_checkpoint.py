"""Checkpoints: a resumed run reproduces the uninterrupted one exactly; incomplete ones are ignored."""

import json
import shutil

import pytest
from helpers import tiny_config

from fivefold.checkpoint.run_dir import check_run_dir
from fivefold.checkpoint.run_state import complete_checkpoints, latest_checkpoint
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.loop import train
from fivefold.train.metrics import read_metrics

# 6 steps over an epoch boundary (35 samples, batches of 8), checkpoints at steps 3 and 6.
ARGS = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=6", "--checkpoint.every=3")


def _train(rank, world, cfg):
    r = train(cfg, progress=False)
    return r.start_step, r.losses, r.samples


@pytest.mark.parametrize("dp,write", [(1, "blocking"), (2, "async")])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, dp, write):
    cfg = tiny_config(tmp_path, *ARGS, f"--checkpoint.async_save={str(write == 'async').lower()}")
    start, losses, samples = run_workers(_train, dp, cfg)[0]
    run_dir = tmp_path / "tiny"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000003", "step_00000006"]
    # "Crash" after step 3: the step-6 checkpoint never happened.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    # A fresh run refuses to overwrite it (cli.py checks this before any process starts).
    assert "already holds checkpoints; pass --resume" in check_run_dir(cfg)[0]
    resumed = tiny_config(tmp_path, *ARGS, "--checkpoint.resume=true",
                          f"--checkpoint.async_save={str(write == 'async').lower()}")
    start2, losses2, samples2 = run_workers(_train, dp, resumed)[0]
    assert start2 == 3
    # Bit-exact on CPU: same weights, optimizer moments, step count, data position and lr.
    assert losses2 == losses[3:]
    assert samples2 == samples[3:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # lines past the checkpoint were replaced
    assert [r["loss"] for r in records] == losses
    state = json.loads((run_dir / "checkpoints" / "step_00000006" / "state.json").read_text())
    assert state["step"] == 6 and state["loader"] == {"epoch": 1, "cursor": 8}


def test_incomplete_checkpoints_are_never_picked_up(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "step_00000004").mkdir(parents=True)
    (root / "step_00000004" / "state.json").write_text("{}")
    (root / ".tmp_step_00000009").mkdir()  # an interrupted write
    (root / ".tmp_step_00000009" / "state.json").write_text("{}")
    (root / "step_00000008").mkdir()  # renamed by hand, no state.json: not complete
    assert latest_checkpoint(tmp_path) == root / "step_00000004"
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_keep_prunes_old_checkpoints(tmp_path):
    cfg = tiny_config(tmp_path, "--train.steps=4", "--checkpoint.every=1", "--checkpoint.keep=2")
    run_workers(_train, 1, cfg)
    assert [p.name for p in complete_checkpoints(tmp_path / "tiny")] == ["step_00000003", "step_00000004"]


def _save_async_then_change_the_weights(rank, world, cfg, root):
    import torch
    from helpers import parallelized
    from torch.distributed.tensor import DTensor

    from fivefold.checkpoint.run_state import CheckpointWriter, load_checkpoint
    from fivefold.parallel.comm import collectives

    par = parallelized(cfg, world)
    local = lambda: [v.to_local() if isinstance(v, DTensor) else v for v in par.model_state_dict().values()]  # noqa: E731
    before = [v.clone() for v in local()]
    writer = CheckpointWriter(root, keep=2, async_save=True)
    writer.save(1, par, {"loader": {}})
    with torch.no_grad():  # training goes on while the checkpoint is written (ZeRO-3: in its shards)
        for v in local():
            v.add_(1.0)
    writer.wait()  # collective: on every rank, the checkpoint is published when it returns
    found = latest_checkpoint(root)
    # What every rank found, before loading (collective: a rank that found nothing would leave the
    # others waiting in it).
    if None in collectives.all_gather_object(found, collectives.world_group()):
        return found, False
    load_checkpoint(found, par)
    return found.name, all(torch.equal(a, b) for a, b in zip(before, local(), strict=True))


def test_async_save_writes_the_state_of_its_step_not_later_changes(tmp_path):
    """The asynchronous write stages a copy: weights changed right after save() are not in it. Every
    rank finds the checkpoint once wait() returns, not only rank 0, which publishes it."""
    cfg = tiny_config(tmp_path, "--parallel.zero=3")  # ZeRO-3: the shards themselves are staged
    assert run_workers(_save_async_then_change_the_weights, 2, cfg, tmp_path / "run") == [("step_00000001", True)] * 2
