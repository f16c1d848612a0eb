"""A checkpoint's files checked before a resume applies any of them: each damaged one named.

What is checked, from headers and sizes only (no tensor is read):
- `state.json`: a JSON object with the step and the data position;
- `rng/rank<R>.pt`: a uint8 tensor (torch.load with weights_only=True: nothing in it can run);
- each `.distcp` data file: at least as long as the byte ranges its `.metadata` says it holds (a
  file cut short by a full disk or a copy that stopped).
The launcher runs this on the checkpoint a `--resume` will read (train/preflight.py), so a damaged
file fails in one line before any worker starts, never as a traceback from inside a rank.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path


def _fix(folder: Path) -> str:
    return f"the checkpoint is damaged: delete {folder} to resume from the one before it"


def checkpoint_errors(folder: Path) -> list[str]:
    """One line per damaged file of the checkpoint `folder`."""
    errors = []
    state = folder / "state.json"
    try:
        loaded = json.loads(state.read_text(encoding="utf-8"))
        if not isinstance(loaded, dict) or not {"step", "loader"} <= loaded.keys():
            raise ValueError("no 'step' and 'loader' entries")
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        errors.append(f"{state}: not the state fivefold wrote ({str(e).splitlines()[0][:120]}); {_fix(folder)}")
    errors += _rng_errors(folder)
    errors += data_file_errors(folder)
    return errors


def _rng_errors(folder: Path) -> list[str]:
    import pickle

    import torch

    errors = []
    for path in sorted((folder / "rng").glob("rank*.pt")):
        try:
            with warnings.catch_warnings():  # torch's notes on an unexpected pickle protocol: the error says it
                warnings.simplefilter("ignore")
                value = torch.load(path, weights_only=True)
            if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8):
                raise ValueError(f"holds {type(value).__name__}, not a uint8 RNG state")
        except pickle.UnpicklingError:  # torch's text advises weights_only=False: the one thing not to do
            errors.append(f"{path}: not an RNG state fivefold wrote (it pickles Python objects other than a "
                          f"tensor; refused unread, nothing in it ran); {_fix(folder)}")
        except (OSError, RuntimeError, ValueError, EOFError) as e:
            errors.append(f"{path}: not an RNG state fivefold wrote ({str(e).splitlines()[0][:120]}); "
                          f"{_fix(folder)}")
    return errors


def data_file_errors(folder: Path, fix: str | None = None) -> list[str]:
    """One line per data file of the checkpoint `folder` that is missing or shorter than its index
    says (or for its unreadable `.metadata`), each ending in `fix` (default: how to resume without it)."""
    from fivefold.checkpoint.safe_load import SafeFileSystemReader

    fix = fix or _fix(folder)
    try:
        metadata = SafeFileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # a damaged .metadata: DCP and our safe reader raise several kinds
        line = str(e).splitlines()[0] if str(e) else type(e).__name__
        said = line if str(folder) in line else f"{folder / '.metadata'}: unreadable ({line[:200]})"
        return [f"{said}; {fix}"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    errors = []
    for name, size in sorted(needed.items()):
        path = folder / name
        have = path.stat().st_size if path.is_file() else -1
        if have < size:
            what = "missing" if have < 0 else f"{have:,} bytes where its index needs {size:,} (truncated)"
            errors.append(f"{path}: {what}; {fix}")
    return errors


def first_failure(e: BaseException) -> str:
    """A DCP CheckpointException's first rank's error, one line (its own message holds every rank's
    traceback); its `failures` map rank -> (exception, traceback)."""
    import pickle

    for rank, (reason, _) in sorted(getattr(e, "failures", {}).items()):
        if isinstance(reason, pickle.UnpicklingError):  # torch's text advises weights_only=False: never
            return f"rank {rank}: not data torch.save wrote (refused unread, nothing in it ran)"
        return f"rank {rank}: {type(reason).__name__}: {str(reason).splitlines()[0][:200]}"
    return str(e).splitlines()[0][:200]
