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

import contextlib
import errno
import json
import pickle
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from fivefold.checkpoint.files import first_failure
from fivefold.checkpoint.run_dir import PREFIX, checkpoint_dir, complete_checkpoints, latest_checkpoint
from fivefold.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.parallelize import Parallelized


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous complete one is untouched."""


def _attempt(write: Callable[[], object]) -> BaseException | None:
    """Run a write; return its error (DCP's CheckpointException is a BaseException) instead of raising.
    A RuntimeError is torch.save's zip writer failing (on a full disk: "unexpected pos", no errno)."""
    try:
        write()
    except (OSError, RuntimeError, CheckpointException) as e:
        return e
    return None


LOW_SPACE = 64 << 20  # bytes free below which a write error without an errno is taken for a full disk
# How long a failing run waits for an asynchronous write in flight to end before removing its folder:
# a write that fails on a full disk ends at once, but one whose peer died waits for the group's timeout.
ABANDON_WAIT_S = 10.0


def _os_error(error: BaseException | None, folder: Path | None = None) -> OSError | None:
    """The OSError behind a write error: itself, or the first one DCP gathered from the ranks. torch's
    zip writer (torch.save) reports a full disk without an errno ("[enforce fail at inline_container.cc]
    unexpected pos"): such an error, on a disk with almost no space left, counts as ENOSPC."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        found = next((e for e, _ in error.failures.values() if isinstance(e, OSError)), None)
        if found is not None:
            return found
    if error is not None and folder is not None:
        with contextlib.suppress(OSError):
            where = next(p for p in (folder, *folder.parents) if p.exists())
            free = shutil.disk_usage(where).free
            if free < LOW_SPACE:
                return OSError(errno.ENOSPC, f"No space left on device ({free:,} bytes free)", str(where))
    return None


class CheckpointWriter:
    """Writes checkpoints: blocking, or (`checkpoint.async_save`) overlapped with training.

    Asynchronous: DCP copies this rank's state into fresh CPU memory (the "staging" copy, so the
    next optimizer step cannot change what is being written), then a thread writes it while
    training goes on. That thread runs DCP's collectives (planning, gathering every rank's write
    results) on a process group of its own: on the training group they could interleave with the
    training collectives in a different order on different ranks. When rank 0's write completes,
    DCP has written the metadata after every rank's data, so rank 0 alone makes it visible
    (state.json, rename), on the writer's thread. At most one write is in flight: the next save,
    and the end of training, `wait()` for it first, so memory holds at most one staged copy; that
    wait is collective and ends on every rank only once rank 0 has published, so any rank that has
    waited finds the checkpoint (a rank's own write finishing says nothing of rank 0's rename).

    `world`: every rank of the job, where the barriers and agreements of a save run (the mesh's
    "world" view; None: torch's default group, uncounted).
    """

    def __init__(self, run_dir: Path, keep: int, async_save: bool = False, world: AxisGroup | None = None):
        self.run_dir, self.keep = run_dir, keep
        self.world = world or collectives.world_group()
        if dist.get_rank() == 0:  # partial folders of a job that died mid-write: never visible, now gone
            for partial in checkpoint_dir(run_dir).glob(f".tmp_{PREFIX}*"):
                shutil.rmtree(partial, ignore_errors=True)
        # Collective: every rank builds the writer at the same point of the run.
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.pending: Future | None = None
        self.writing: tuple[int, Path] | None = None  # step and folder of the pending write
        self.published = threading.Event()
        self.error: BaseException | None = None  # publishing failed on the writer's thread

    def save(self, step: int, par: Parallelized, state: dict[str, Any]) -> Path:
        """Collective over the world: every rank calls it with the same step."""
        self.wait()
        rank = dist.get_rank()
        root = checkpoint_dir(self.run_dir)
        final, tmp = root / f"{PREFIX}{step:08d}", root / f".tmp_{PREFIX}{step:08d}"
        error = None
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of an interrupted write of this step
            error = _attempt(lambda: (tmp / "rng").mkdir(parents=True))
        collectives.barrier(self.world, f"barrier before writing checkpoint step {step}")  # the folder exists
        error = error or _attempt(lambda: torch.save(torch.get_rng_state(), tmp / "rng" / f"rank{rank}.pt"))
        tensors = {"model": par.model_state_dict(), "optim": par.optim_state_dict()}
        publish = lambda: self._publish(tmp, final, {"step": step, **state})  # noqa: E731
        if self.group is None:
            # Collective: called on every rank, even one whose own file failed, or the others would hang.
            error = error or _attempt(lambda: dcp.save(tensors, checkpoint_id=str(tmp)))
        # Every rank stops if any rank failed; blocking, it is also where every rank's files are on
        # disk before rank 0 makes the folder visible as complete.
        self._agree(step, tmp, error)
        if self.group is None:
            self._agree(step, tmp, _attempt(publish) if rank == 0 else None)  # every rank returns once it is visible
            return final
        self.published.clear()
        self.pending = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self.group)
        self.writing = (step, tmp)
        if rank == 0:
            self.pending.add_done_callback(lambda f: self._after_write(f, publish))
        return final

    def _failed(self, step: int, tmp: Path, error: BaseException | None) -> CheckpointWriteError:
        """Rank 0 removes the partial folder (it was never visible as a checkpoint); the error says why."""
        cause = _os_error(error, tmp)  # (before the folder goes: the space free when the write failed)
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        reason = cause and (f"{cause.strerror}: {cause.filename}" if cause.filename else cause.strerror)
        previous = latest_checkpoint(self.run_dir)
        kept = (f"the previous checkpoint '{previous}' is intact and --resume continues from it" if previous
                else "there is no earlier checkpoint")
        if cause is None:
            return CheckpointWriteError(f"checkpoint step {step}: writing '{tmp}' failed ({error or 'on another rank'}"
                                        f"); {kept}")
        if cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            return CheckpointWriteError(
                f"checkpoint step {step}: no space left to write '{tmp}' ({reason}); free "
                f"space on that disk (or raise its quota, or the file-size limit `ulimit -f`) or set --run.out_dir to "
                f"a disk with room; {kept}")
        return CheckpointWriteError(f"checkpoint step {step}: cannot write '{tmp}' ({reason}); make the run "
                                    f"directory writable or set --run.out_dir; {kept}")

    def _after_write(self, written: Future, publish: Callable[[], None]) -> None:
        """Rank 0, on the writer's thread: publish a complete write; keep any error for wait()."""
        try:
            if written.exception() is None:
                publish()
        except BaseException as e:  # noqa: BLE001 - handed to the training thread by wait()
            self.error = e
        finally:
            self.published.set()

    def _agree(self, step: int, tmp: Path, error: BaseException | None) -> None:
        """Collective over the world: raise on every rank if any rank's `error` is set."""
        failed = torch.tensor([error is not None], dtype=torch.int32)
        collectives.all_reduce(failed, self.world, op=dist.ReduceOp.MAX)
        if failed.item():
            raise self._failed(step, tmp, error)

    def wait(self) -> None:
        """Collective over the world: block until the write in flight (if any) is on disk and published
        by rank 0, on every rank (an error publishing it is raised on every rank)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        error = _attempt(pending.result)  # the write's error comes here, in the training thread
        if error is not None:  # DCP gathered it: every rank sees it
            raise self._failed(*self.writing, error)
        if dist.get_rank() == 0:
            self.published.wait()  # callbacks run after result() is released: wait for the rename
            error, self.error = self.error, None
        self._agree(*self.writing, error)

    def abandon(self) -> CheckpointWriteError | None:
        """The run is failing: let the write in flight (if any) end, waiting at most ABANDON_WAIT_S,
        and remove its partial folder; a write that completed meanwhile is published and kept.
        Returns the write's own error, if it failed (a full disk fails the metrics log too)."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        try:
            pending.result(timeout=ABANDON_WAIT_S)
        except TimeoutError:  # still writing (a peer gone): its folder goes, its thread ends with the process
            pass
        except BaseException as e:  # noqa: BLE001 - reported beside the error in flight, not instead of it
            return self._failed(*self.writing, e)  # (rank 0 removes the folder)
        else:
            if dist.get_rank() != 0 or (self.published.wait(ABANDON_WAIT_S) and self.error is None):
                return None
        if dist.get_rank() == 0:
            shutil.rmtree(self.writing[1], ignore_errors=True)
        return None

    def _publish(self, tmp: Path, final: Path, state: dict[str, Any]) -> None:
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in complete_checkpoints(self.run_dir)[:-self.keep]:
            shutil.rmtree(old)
        self.published.set()


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
                                      f"checkpoint is incomplete or corrupt: delete it to resume from an earlier "
                                      "one") from None
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
        raise CheckpointMismatchError(f"{path} does not fit this model (was it written with another model "
                                      f"config?):\n  {shown}")


def load_checkpoint(path: Path, par: Parallelized) -> dict[str, Any]:
    """Restore model, optimizer and this rank's RNG from `path`; return the JSON state."""
    state = json.loads((path / "state.json").read_text())
    target = {"model": par.model_state_dict(), "optim": par.optim_state_dict()}
    check_compatible(target, path)
    # In place, each rank reading the pieces it owns; nothing in the files can run code (safe_load.py).
    try:
        dcp.load(target, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(path))
    except CheckpointException as e:  # a data file truncated or damaged after its metadata was written
        raise CheckpointMismatchError(
            f"{path}: reading its tensors failed ({first_failure(e)}); a data file is truncated or corrupt. "
            f"The run stops here, before any step: delete {path} to resume from the checkpoint before it") from None
    par.load_model_state_dict(target["model"])
    par.load_optim_state_dict(target["optim"])
    rng = path / "rng" / f"rank{dist.get_rank()}.pt"
    if rng.is_file():  # absent when resuming with more ranks than wrote the checkpoint
        torch.set_rng_state(torch.load(rng, weights_only=True))
    return state
