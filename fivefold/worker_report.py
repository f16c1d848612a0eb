"""How each launched worker ended, so the launcher names the culprit, not the first rank to notice.

When one rank dies, its peers fail a moment later ("lost the connection to a peer"), and torch's
agent reports whichever failure it saw first: often a survivor, while a SIGKILLed rank leaves no
error at all. So each worker keeps a small file in a folder the launcher made
(`FIVEFOLD_WORKER_DIR`), one per attempt and rank: `running` with its pid when it starts, then
`failed` with its error's first line, `stopped` when a SIGTERM (the launcher stopping the others,
or its own death) ends it, or `done`. A worker whose file still says `running` when the job
fails died by something it could not catch: SIGKILL (by hand, the OOM killer) or a crash. That
rank comes first in the launcher's summary; ranks that failed because a peer vanished follow as
consequences. A rank whose collective timed out also records the peers it found missing (stopped or
hung, or behind: parallel/arrivals.py): a stopped or hung rank ends in the launcher's SIGTERM or
SIGKILL with no error of its own, and is named first from its peers' reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

WORKER_DIR = "FIVEFOLD_WORKER_DIR"
CONSEQUENCES = ("lost the connection to a peer", "got no answer within")  # comms.py's words for a vanished peer


def _path(folder: Path, attempt: int, rank: int) -> Path:
    return folder / f"attempt{attempt}-rank{rank}.json"


def _write(path: Path, **fields) -> None:
    """Best effort: a report that cannot be written (the folder gone, a full disk) never fails the worker."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
        os.replace(tmp, path)


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Around a launched worker's work: its file says how it ended (nothing without the folder)."""
    folder = os.environ.get(WORKER_DIR)
    if not folder:
        yield
        return
    path = _path(Path(folder), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ["RANK"]))
    _write(path, state="running")

    def stopped(signum, frame):  # noqa: ARG001
        _write(path, state="stopped")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    except BaseException as e:
        _write(path, state="failed", error=(str(e).splitlines() or [type(e).__name__])[0][:300],
               missing=missing_ranks(e))
        raise
    _write(path, state="done")


def missing_ranks(error: BaseException) -> dict[str, str]:
    """The peers a timed-out collective in the error's chain found missing (global rank -> why)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(getattr(error, "missing", None), dict):  # comms.CollectiveError (not imported: no torch here)
            return {str(r): why for r, why in error.missing.items()}
        error = error.__cause__ or error.__context__
    return {}


def culprit_summary(folder: Path) -> str | None:
    """The launcher's lines on the last failed attempt, the culprits first; None without any file."""
    attempts = [int(p.name.split("-")[0].removeprefix("attempt")) for p in folder.glob("attempt*-rank*.json")]
    if not attempts:
        return None
    attempt, found = max(attempts), []
    for path in sorted(folder.glob(f"attempt{attempt}-rank*.json"), key=lambda p: int(p.stem.split("rank")[1])):
        with contextlib.suppress(OSError, ValueError):
            found.append((int(path.stem.split("rank")[1]), json.loads(path.read_text())))
    # Ranks that peers' timed-out collectives found missing: rank -> (the first rank that waited, why).
    named = {}
    for rank, r in found:
        for peer, why in r.get("missing", {}).items():
            named.setdefault(int(peer), (rank, why))
    first, after = [], []
    for rank, r in found:
        if rank in named and r["state"] in ("running", "stopped"):  # ended by the launcher, not by an error
            waiter, why = named[rank]
            first.append(f"rank {rank} (pid {r['pid']}) never arrived at a collective rank {waiter} waited for: {why}")
        elif r["state"] == "running":
            first.append(f"rank {rank} (pid {r['pid']}) died without an error: killed by a signal it cannot "
                         f"catch (SIGKILL: by hand, or the kernel's OOM killer) or crashed")
        elif r["state"] == "failed" and not any(c in r["error"] for c in CONSEQUENCES):
            first.append(f"rank {rank} (pid {r['pid']}) failed: {r['error']}")
        elif r["state"] == "failed":
            after.append(f"rank {rank} (pid {r['pid']}) failed as a consequence: {r['error']}")
        elif r["state"] == "stopped":
            after.append(f"rank {rank} (pid {r['pid']}) was stopped by the launcher")
    return "\n".join(["the job failed; first cause:" if first else "the job failed:", *first, *after])
