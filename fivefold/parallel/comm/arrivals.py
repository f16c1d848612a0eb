"""Which ranks of a group never arrived at a collective that timed out.

A timed-out collective tells the waiting rank only that some peer is missing. To name which, each
rank counts the collectives it issues on each process group (comm/collectives.py calls `issue()`: a local
integer, no communication), and a daemon thread publishes the counts to the job's store (the c10d
store the default process group was made with) every PUBLISH_PERIOD_S seconds: one key per rank,
`fivefold.arrivals/<mesh>/<rank>`, holding a beat (how many times it has published) and its count
per group; <mesh> numbers the meshes a rank has built (every rank builds the same ones in the same
order), so two meshes of one process never mix their counts. Every rank of a group makes the
same calls on it in the same order, so when call k on a group times out, the waiting rank reads
its peers' reports (`missing()`):
- a peer whose beat does not move for STALE_AFTER_S, timed on the waiting rank's own clock (hosts'
  clocks need not agree), is stopped (SIGSTOP, a debugger), hung or gone: its thread stops with it;
- a peer whose fresh report counts fewer than k calls on that group has not reached the call: it
  took another code path or is stuck before it.
Only a report published after the wait ended counts as fresh: one made earlier could predate the
peer's arrival, and name a rank that did come.
"""

from __future__ import annotations

import json
import threading
import time

import torch.distributed as dist

# One report per rank every 2 s: cheap for the store (16,384 ranks make ~8,000 small writes a second,
# well within what one TCPStore serves) and a short wait when a timeout needs fresh reports.
PUBLISH_PERIOD_S = 2.0
# No new report for 3 periods: the rank is stopped or hung, not merely late (a loaded host can
# delay a thread by a period, rarely by three).
STALE_AFTER_S = 3 * PUBLISH_PERIOD_S
PREFIX = "fivefold.arrivals/"


class Arrivals:
    """This rank's collective counts per group, published by a daemon thread until `close()`."""

    def __init__(self, store: dist.Store, rank: int):
        mesh = store.add(f"{PREFIX}built/{rank}", 1)  # one round trip, when the mesh is built
        self._store = dist.PrefixStore(f"{PREFIX}{mesh}", store)  # (it adds the "/" before each key)
        self.rank = rank
        self._counts: dict[str, int] = {}  # group name -> calls issued (only comm/collectives.py's thread adds keys)
        self._beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-arrivals", daemon=True)
        self._thread.start()

    def issue(self, group_name: str) -> int:
        """Count one collective on the group; its number there (1 for the first)."""
        n = self._counts.get(group_name, 0) + 1
        self._counts[group_name] = n
        return n

    def _publish(self) -> None:
        self._beat += 1
        self._store.set(str(self.rank), json.dumps({"beat": self._beat, "calls": dict(self._counts)}))

    def _run(self) -> None:
        # Event.wait sleeps outside the GIL, and the store's calls release it: the training thread
        # loses a few microseconds a period.
        try:
            self._publish()
            while not self._stop.wait(PUBLISH_PERIOD_S):
                self._publish()
        except Exception:  # noqa: BLE001 - the store is gone (the job is ending): nothing left to tell
            return

    def close(self) -> None:
        """Stop publishing (idempotent). The thread is a daemon: a store call stuck on a dead server
        does not hold the process's exit beyond the bounded join."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _read(self, ranks: list[int]) -> dict[int, dict]:
        """The reports of those of `ranks` that have published."""
        keys = [str(r) for r in ranks]
        if not self._store.check(keys):  # some never published: read the others one by one
            present = [r for r in ranks if self._store.check([str(r)])]
            keys = [str(r) for r in present]
            ranks = present
        return {r: json.loads(v) for r, v in zip(ranks, self._store.multi_get(keys) if keys else [], strict=True)}

    def missing(self, group_name: str, ranks: list[int], call: int) -> dict[int, str]:
        """Global rank -> why it has not arrived at call number `call` on the group (its members
        `ranks`, global), for the peers that have not: stopped or hung, or behind. Waits at most
        STALE_AFTER_S for fresh reports."""
        peers = [r for r in ranks if r != self.rank]
        before = self._read(peers)
        fresh: dict[int, dict] = {}
        began = time.monotonic()
        while True:
            waiting = [r for r in peers if r not in fresh]
            now = self._read(waiting)
            fresh.update({r: v for r, v in now.items() if r not in before or v["beat"] != before[r]["beat"]})
            if len(fresh) == len(peers) or time.monotonic() - began >= STALE_AFTER_S:
                break
            time.sleep(PUBLISH_PERIOD_S / 8)
        out = {}
        for r in peers:
            if r not in fresh:
                out[r] = (f"sent no report for {STALE_AFTER_S:g} s: stopped (SIGSTOP, a debugger), hung or gone"
                          if r in before else "never reported: it died or hung before its first report")
            elif (made := fresh[r]["calls"].get(group_name, 0)) < call:
                out[r] = (f"made {made} of these calls, this is call {call}: it took another code path (a "
                          f"rank-dependent branch, an exception caught on one rank) or is stuck before the call")
        return out
