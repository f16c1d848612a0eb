"""How each launched worker ended, so the launcher names the culprit, not the first rank to notice.

When one rank dies, its peers fail a moment later ("lost the connection to a peer"), and torch's
agent reports whichever failure it saw first: often a survivor, while a SIGKILLed rank leaves no
error at all. So each worker keeps a small file in a folder the launcher made
(`FIVEFOLD_WORKER_DIR`), one per attempt and rank: `running` with its pid when it starts, then
`failed` with its error's first line and traceback, `stopped` when a SIGTERM (the launcher
stopping the others, or its own death) ends it, or `done`. A worker whose file still says
`running` when the job fails died by something it could not catch: SIGKILL (by hand, the OOM
killer) or a crash. That rank comes first in the launcher's summary; ranks that failed because a peer vanished follow as
consequences. A rank whose collective timed out also records the peers it found missing (stopped or
hung, or behind: parallel/comm/arrivals.py): a stopped or hung rank ends in the launcher's SIGTERM or
SIGKILL with no error of its own, and is named first from its peers' reports. The summary ends
with the traceback of each rank that failed first (torch's agent logs every failure's, through its
spawn wrapper's: launch/agent.py shortens those to one line each).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import traceback
from collections.abc import Iterator
from pathlib import Path

WORKER_DIR = "FIVEFOLD_WORKER_DIR"
TRACEBACK_CHARS = 8000  # the end of a failed rank's traceback, kept for the summary (where it failed)
# comm/collectives.py's words for a vanished peer
CONSEQUENCES = ("lost the connection to a peer", "got no answer within")


def _path(folder: Path, attempt: int, rank: int) -> Path:
    return folder / f"attempt{attempt}-rank{rank}.json"


def _write(path: Path, **fields) -> None:
    """Best effort: a report that cannot be written (the folder gone, a full disk) never fails the worker."""
    tmp = path.with_name(f".{path.name}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(json.dumps({"pid": os.getpid(), **fields}))
        os.replace(tmp, path)


def _own_path() -> Path | None:
    """This launched worker's file (None: not launched by fivefold's launcher)."""
    folder = os.environ.get(WORKER_DIR)
    if not folder:
        return None
    return _path(Path(folder), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), int(os.environ["RANK"]))


def note_missing(missing: dict[int, str]) -> None:
    """The peers the arrivals watch found missing (parallel/comm/arrivals.py), kept in this worker's
    file while it still runs: on NCCL the watchdog ends the process at the timeout, before any error
    reaches `reporting`, so this is how the launcher's summary learns who never arrived."""
    if (path := _own_path()) is not None:
        _write(path, state="running", missing={str(r): why for r, why in missing.items()})


@contextlib.contextmanager
def reporting() -> Iterator[None]:
    """Around a launched worker's work: its file says how it ended (nothing without the folder)."""
    path = _own_path()
    if path is None:
        yield
        return
    _write(path, state="running")

    def stopped(signum, frame):  # noqa: ARG001
        _write(path, state="stopped")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)
    try:
        yield
    except BaseException as e:
        _write(path, state="failed", error=error_line(e),
               missing=missing_ranks(e), traceback="".join(traceback.format_exception(e))[-TRACEBACK_CHARS:])
        raise
    _write(path, state="done")


def error_line(e: BaseException) -> str:
    """The error's first line; an exception not of fivefold's own kinds (theirs name the fix) with
    its type, as Python's traceback ends: "IndexError: list index out of range"."""
    line = (str(e).splitlines() or [""])[0][:300]
    if type(e).__module__.startswith("fivefold."):
        return line or type(e).__name__
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def missing_ranks(error: BaseException) -> dict[str, str]:
    """The peers a timed-out collective in the error's chain found missing (global rank -> why)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(getattr(error, "missing", None), dict):  # comms.CollectiveError (not imported: no torch here)
            return {str(r): why for r, why in error.missing.items()}
        error = error.__cause__ or error.__context__
    return {}


def culprit_summary(folder: Path, note: str = "") -> str | None:
    """The launcher's lines on the last failed attempt, the culprits first, then `note`, then the
    tracebacks of the ranks that failed first; None without any file."""
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
    first, after, tracebacks = [], [], []
    for rank, r in found:
        if rank in named and r["state"] in ("running", "stopped"):  # ended by the launcher, not by an error
            waiter, why = named[rank]
            first.append(f"rank {rank} (pid {r['pid']}) never arrived at a collective rank {waiter} waited for: {why}")
        elif r["state"] == "running" and r.get("missing"):  # its watch named them; NCCL's watchdog ended it
            after.append(f"rank {rank} (pid {r['pid']}) was ended waiting for them (parallel.collective_timeout_s)")
        elif r["state"] == "running":
            first.append(f"rank {rank} (pid {r['pid']}) died without an error: killed by a signal it cannot "
                         f"catch (SIGKILL: by hand, or the kernel's OOM killer) or crashed")
        elif r["state"] == "failed" and not any(c in r["error"] for c in CONSEQUENCES):
            first.append(f"rank {rank} (pid {r['pid']}) failed: {r['error']}")
            if r.get("traceback"):
                tracebacks += [f"rank {rank}'s traceback:", *(f"  {line}" for line in r["traceback"].splitlines())]
        elif r["state"] == "failed":
            after.append(f"rank {rank} (pid {r['pid']}) failed as a consequence: {r['error']}")
        elif r["state"] == "stopped":
            after.append(f"rank {rank} (pid {r['pid']}) was stopped by the launcher")
    head = "the job failed; first cause:" if first else "the job failed:"
    return "\n".join([head, *first, *after, *([note] if note else []), *tracebacks])


AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # logs each failed worker with its traceback


class OneLineFailures(logging.Filter):
    """torch's agent logs a failed worker as its exception: the worker's traceback inside torch's
    spawn wrapper's, 60 lines a rank, every rank that failed, in the order the agent saw them.
    Here each is one line ending with the worker's error (the summary prints the first cause's
    traceback); a restart after a failure still shows what failed."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            lines = str(error).strip().splitlines()
            record.msg, record.args = f"{record.getMessage()}: {(lines or [type(error).__name__])[-1][:300]}", ()
            record.exc_info = record.exc_text = None
        return True


@contextlib.contextmanager
def one_line_failures() -> Iterator[None]:
    """While the launcher's agent runs: its failed-worker records one line each."""
    logger, only = logging.getLogger(AGENT_LOGGER), OneLineFailures()
    logger.addFilter(only)
    try:
        yield
    finally:
        logger.removeFilter(only)
