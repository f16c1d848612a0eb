"""One job per run directory: a lock file with the holder's host and pid and a heartbeat.

`RUN_DIR/.lock` (JSON: host, pid, started, heartbeat) is taken by the job's node-0 launcher (rank 0
under torchrun) before any worker starts, and held across the job's own restarts. A thread
rewrites the heartbeat every HEARTBEAT_S seconds (an atomic rename: a reader never sees half a
file). A second job on the same directory refuses to start, naming the holder and how to clear
the lock. A lock counts as stale, and is taken over with a message, when its heartbeat is older
than STALE_S (pids cannot be checked across hosts), or when it names this host and a pid that is
no longer running.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from fivefold.config.load import ConfigError

HEARTBEAT_S = 10.0
STALE_S = 60.0  # 6 missed heartbeats
LOCK = ".lock"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # running, as another user
        return True
    return True


class RunLock:
    """Held while the job runs: `acquire()` (or refuse), `release()` at its end."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.took_over: str | None = None  # what a stale lock said, when this one replaced it
        self._made = False

    def _write(self, started: float) -> None:
        tmp = self.path.with_name(f"{LOCK}.{self.pid}.tmp")
        tmp.write_text(json.dumps({"host": self.host, "pid": self.pid, "started": started, "heartbeat": time.time()}))
        os.replace(tmp, self.path)

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # unreadable: a crash mid-write cannot leave one (rename), so treat as stale
            return {"host": "?", "pid": -1, "heartbeat": 0.0}

    def acquire(self) -> None:
        """Take the lock, or raise ConfigError naming the job that holds it."""
        self._made = not self.path.parent.exists()  # a job that never started leaves no folder behind
        self.path.parent.mkdir(parents=True, exist_ok=True)
        held = self._holder()
        if held is not None and not (held.get("host") == self.host and held.get("pid") == self.pid):
            age = time.time() - float(held.get("heartbeat", 0.0))
            dead_here = held.get("host") == self.host and not _alive(int(held.get("pid", -1)))
            if age < STALE_S and not dead_here:
                raise ConfigError([
                    f"run directory '{self.path.parent}' is in use by the job of pid {held.get('pid')} on host "
                    f"{held.get('host')} (heartbeat {age:.0f} s ago); wait for it to end, or choose another "
                    f"--run.name; if that job is dead, delete {self.path}"])
            why = "its process is gone" if dead_here else f"no heartbeat for {age:.0f} s"
            self.took_over = (f"took over the stale lock of pid {held.get('pid')} on host {held.get('host')} "
                              f"({why})")
        started = time.time()
        self._write(started)
        self._thread = threading.Thread(target=self._beat, args=(started,), daemon=True, name="fivefold-run-lock")
        self._thread.start()

    def _beat(self, started: float) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write(started)
            except OSError:  # a full disk: the next beat tries again; the job's own writes report it
                pass

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        held = self._holder()
        if held is not None and held.get("host") == self.host and held.get("pid") == self.pid:
            self.path.unlink(missing_ok=True)
        if self._made and not any(self.path.parent.iterdir()):
            self.path.parent.rmdir()
