"""Checkpoints: a resumed run reproduces the uninterrupted one exactly; incomplete ones are ignored."""

import json
import shutil

import pytest

from fivefold.testing import run_workers
from fivefold.train.checkpoint import complete_checkpoints, latest_checkpoint
from fivefold.train.loop import check_run_dir, train
from fivefold.train.metrics import read_metrics
from helpers import tiny_config

# 6 steps over an epoch boundary (35 samples, batches of 8), checkpoints at steps 3 and 6.
ARGS = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=6", "--checkpoint.every=3")


def _train(rank, world, cfg):
    r = train(cfg, progress=False)
    return r.start_step, r.losses, r.samples


@pytest.mark.parametrize("dp", [1, 2])
def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, dp):
    cfg = tiny_config(tmp_path, *ARGS)
    start, losses, samples = run_workers(_train, dp, cfg)[0]
    run_dir = tmp_path / "tiny"
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step_00000003", "step_00000006"]
    # "Crash" after step 3: the step-6 checkpoint never happened.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    # A fresh run refuses to overwrite it (cli.py checks this before any process starts).
    assert "already holds checkpoints; pass --resume" in check_run_dir(cfg)[0]
    resumed = tiny_config(tmp_path, *ARGS, "--checkpoint.resume=true")
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
