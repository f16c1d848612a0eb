"""A tampered checkpoint cannot run code: metadata and non-tensor items are read as data only."""

import io
import os
import pickle

import pytest
import torch
from helpers import EQUIVALENCE, tiny_config

from fivefold.checkpoint.safe_load import SafeLoadPlanner, UnsafeCheckpointError
from fivefold.data.resolve import unpadded_vocab
from fivefold.parallel.forked_ranks import run_workers


class _Payload:
    """Unpickling this creates a file: the proof that code ran."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _train_checked(rank, world, cfg):
    from fivefold.config.derive import derive
    from fivefold.train.loop import train

    return train(cfg, derive(cfg, world, unpadded_vocab(cfg)), progress=False).losses


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def test_tampered_metadata_is_refused_and_runs_nothing(tmp_path):
    args = (*EQUIVALENCE, "--train.steps=2", "--checkpoint.every=1")
    run_workers(_train, 1, tiny_config(tmp_path, *args))
    from fivefold.checkpoint.run_state import latest_checkpoint

    metadata = latest_checkpoint(tmp_path / "tiny") / ".metadata"
    marker = tmp_path / "payload-ran"
    metadata.write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(Exception, match=r"refusing to load posix\.system|refusing to load os\.system"):
        run_workers(_train, 1, tiny_config(tmp_path, *args, "--train.steps=3", "--checkpoint.resume=true"))
    assert not marker.exists()


def test_non_tensor_items_load_as_data_only(tmp_path):
    marker = tmp_path / "payload-ran"
    planner = SafeLoadPlanner(tmp_path)
    item = type("ReadItem", (), {"dest_index": type("Index", (), {"fqn": "optim.param_groups.0.lr"})()})()
    bad = io.BytesIO()
    torch.save({"lr": _Payload(str(marker))}, bad)
    bad.seek(0)
    with pytest.raises(UnsafeCheckpointError, match="optim.param_groups.0.lr"):
        planner.load_bytes(item, bad)
    assert not marker.exists()


def test_another_model_shape_or_a_corrupt_checkpoint_is_named(tmp_path):
    """Resuming with another model shape names each tensor and both shapes; a truncated metadata
    file names the path; both before anything is loaded into the model. A truncated data file
    names the checkpoint and the fix, before any step runs."""
    args = (*EQUIVALENCE, "--train.steps=1")
    run_workers(_train, 1, tiny_config(tmp_path, *args))
    with pytest.raises(Exception,
                       match=r"model.tok_embeddings.weight: checkpoint \(320, 64\), this model \(320, 128\)"):
        run_workers(_train, 1, tiny_config(tmp_path, *args, "--train.steps=2", "--checkpoint.resume=true",
                                           "--model.dim=128"))
    from fivefold.checkpoint.run_state import latest_checkpoint

    data = latest_checkpoint(tmp_path / "tiny") / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    resume = tiny_config(tmp_path, *args, "--train.steps=2", "--checkpoint.resume=true")
    # Named by the preflight, from the file sizes its index gives (checkpoint/files.py) ...
    with pytest.raises(Exception, match=r"__0_0.distcp: [\d,]+ bytes where its index needs [\d,]+ \(truncated\)"):
        run_workers(_train, 1, resume)
    # ... and inside the ranks when a job skips it (a caller that checked the config itself).
    with pytest.raises(Exception, match=r"step_00000001: reading its tensors failed \(rank 0: .*truncated or corrupt"):
        run_workers(_train_checked, 1, resume)
    metadata = latest_checkpoint(tmp_path / "tiny") / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(Exception, match=r"step_00000001/\.metadata: unreadable \(pickle data was truncated\)"):
        run_workers(_train, 1, tiny_config(tmp_path, *args, "--train.steps=2", "--checkpoint.resume=true"))
