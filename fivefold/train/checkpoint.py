"""Run-state checkpoints through torch.distributed.checkpoint (DCP), complete or absent.

A checkpoint is a folder `checkpoints/step_XXXXXXXX/` in the run directory holding
- the model and optimizer state, written by DCP (each rank writes what it owns; replicated
  tensors once), keyed by parameter name so that a later layout can reshard them;
- `state.json`: step, data-loader position, tokens seen, world size (plain JSON, no pickle);
- `rng/rank<R>.pt`: each rank's torch RNG state (a uint8 tensor, read with weights_only=True).
Loading never unpickles anything but data (`safe_load.py`).

It is written into `.tmp_step_XXXXXXXX/` and renamed when every rank has finished, so a crash
mid-write leaves a temporary folder that is never picked up, and the previous checkpoint intact.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fivefold.parallel.data import DataParallel
from fivefold.train.safe_load import SafeFileSystemReader, SafeLoadPlanner

PREFIX = "step_"


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints, oldest first (temporary folders of interrupted writes are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def save_checkpoint(run_dir: Path, step: int, dp: DataParallel,
                    state: dict[str, Any], keep: int) -> Path:
    """Collective over the world: every rank calls it with the same step."""
    rank = dist.get_rank()
    root = checkpoint_dir(run_dir)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp_{PREFIX}{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted write of this step
        (tmp / "rng").mkdir(parents=True)
    dist.barrier()
    dcp.save({"model": dp.model_state_dict(), "optim": dp.optim_state_dict()}, checkpoint_id=str(tmp))
    torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{rank}.pt")
    dist.barrier()  # every rank's files are on disk before the folder becomes visible as complete
    if rank == 0:
        (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old)
    dist.barrier()
    return final


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this model: nothing was loaded."""


def check_compatible(target: dict[str, dict[str, Any]], path: Path) -> None:
    """Every tensor the run needs is in the checkpoint with the same whole shape (a DTensor's is
    its global one, so any layout compares alike); else one error listing each difference, raised
    before anything is read into the model."""
    try:
        saved = SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointMismatchError(f"{path}: unreadable checkpoint metadata ({type(e).__name__}: {e}); the "
                                      f"checkpoint is incomplete or corrupt: delete it to resume from an earlier one") from None
    problems = []
    for section, entries in target.items():
        for key, value in entries.items():
            if not torch.is_tensor(value):
                continue
            fqn, found = f"{section}.{key}", saved.get(f"{section}.{key}")
            if not isinstance(found, TensorStorageMetadata):
                problems.append(f"{fqn}: not in the checkpoint")
            elif tuple(found.size) != tuple(value.shape):
                problems.append(f"{fqn}: checkpoint {tuple(found.size)}, this model {tuple(value.shape)}")
    if problems:
        shown = "\n  ".join(problems[:10]) + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise CheckpointMismatchError(f"{path} does not fit this model (was it written with another model config?):\n  {shown}")


def load_checkpoint(path: Path, dp: DataParallel) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path`; return the JSON state."""
    state = json.loads((path / "state.json").read_text())
    target = {"model": dp.model_state_dict(), "optim": dp.optim_state_dict()}
    check_compatible(target, path)
    # In place, each rank reading the pieces it owns; nothing in the files can run code (safe_load.py).
    dcp.load(target, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(path))
    dp.load_model_state_dict(target["model"])
    dp.load_optim_state_dict(target["optim"])
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file():  # absent when resuming with more ranks than wrote the checkpoint
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return state
