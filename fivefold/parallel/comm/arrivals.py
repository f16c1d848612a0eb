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

On gloo a timed-out collective raises in the calling thread, and comm/errors.py asks `missing()`.
On NCCL it does not: the host only launches collectives, and NCCL's watchdog, finding one past the
process group's timeout, aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING's default) before any
Python error exists. So on CUDA the thread also *watches* (`collective_deadlines`): when this rank
has launched no collective for `watch_s` it is blocked on one, and the thread reads its peers'
reports and prints the ranks behind this rank's last call on each group, while the process lives.
The watch follows the timeout in force: the mesh's `timeout` block (the first step's longer
parallel.first_step_timeout_s, parallel/mesh.py) sets `watch_s` from it, and back after the block.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist
from torch.distributed import constants

# One report per rank every 2 s: cheap for the store (16,384 ranks make ~8,000 small writes a second,
# well within what one TCPStore serves) and a short wait when a timeout needs fresh reports.
PUBLISH_PERIOD_S = 2.0
# No new report for 3 periods: the rank is stopped or hung, not merely late (a loaded host can
# delay a thread by a period, rarely by three).
STALE_AFTER_S = 3 * PUBLISH_PERIOD_S
PREFIX = "fivefold.arrivals/"
# The longest a look takes once due: a period until the thread wakes, then the wait for fresh reports.
LOOK_S = PUBLISH_PERIOD_S + STALE_AFTER_S


@dataclass(frozen=True)
class Deadlines:
    """A run's deadlines for a collective, in seconds from its launch."""

    process_group_s: float  # the process group's timeout; on NCCL its watchdog then aborts the process
    watch_s: float | None  # launching nothing this long, a rank looks for peers that never arrived (None: no watch)
    look_s: float = LOOK_S  # the longest that look takes


def collective_deadlines(timeout_s: float | None, device_type: str) -> Deadlines:
    """The deadlines of a run on `device_type` whose groups wait timeout_s (`parallel.collective_timeout_s`,
    or in the first step `parallel.first_step_timeout_s`; None: torch's default for the backend), as
    train/loop.py's process group and the mesh's groups and Arrivals use them.

    The watch runs on CUDA (NCCL) only: there a rank runs ahead of its stuck collective, launching
    work until something waits on the GPU (the step's loss read, a full allocator) and is then silent.
    It looks after half the timeout without a launch, so the look ends before the timeout of a
    collective launched up to timeout/2 - look_s before the last launch: more than a step's run-ahead.
    A timeout under 4 looks leaves no room: no watch (a timeout that short is for tests).
    """
    default = constants.default_pg_nccl_timeout if device_type == "cuda" else constants.default_pg_timeout
    default = default or timedelta(minutes=10)  # a build without NCCL has no NCCL default: its documented 10 min
    process_group_s = timeout_s if timeout_s is not None else default.total_seconds()
    watch = device_type == "cuda" and process_group_s >= 4 * LOOK_S
    return Deadlines(process_group_s, process_group_s / 2 if watch else None)


class Arrivals:
    """This rank's collective counts per group, published by a daemon thread until `close()`."""

    def __init__(self, store: dist.Store, rank: int, watch_s: float | None = None):
        """`watch_s`: look for the peers that never arrived when this rank has issued nothing for
        this long (`collective_deadlines`; None: only when a timed-out collective asks)."""
        mesh = store.add(f"{PREFIX}built/{rank}", 1)  # one round trip, when the mesh is built
        self._store = dist.PrefixStore(f"{PREFIX}{mesh}", store)  # (it adds the "/" before each key)
        self.rank = rank
        self._counts: dict[str, int] = {}  # group name -> calls issued (only comm/collectives.py's thread adds keys)
        self._beat = 0
        self.watch_s = watch_s
        self.on_found: Callable[[dict[int, str]], None] | None = None  # also told what the watch found
        self._last_issue = time.monotonic()  # when this rank last issued a collective
        self._looked_at = self._last_issue  # the silence last looked into (one look per silence)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fivefold-arrivals", daemon=True)
        self._thread.start()

    def issue(self, group_name: str) -> int:
        """Count one collective on the group; its number there (1 for the first)."""
        n = self._counts.get(group_name, 0) + 1
        self._counts[group_name] = n
        self._last_issue = time.monotonic()
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
                if self.watch_s is not None:
                    self._watch(self.watch_s)
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

    def _watch(self, watch_s: float) -> None:
        """Once per silence of watch_s (no collective issued): print the peers behind, if any."""
        last = self._last_issue
        if time.monotonic() - last < watch_s or self._looked_at == last:
            return
        self._looked_at = last
        found = self.behind(self._groups_called())
        if found:
            print(stalled_report(self.rank, time.monotonic() - last, found), file=sys.stderr, flush=True)
            if self.on_found is not None:
                self.on_found({r: why for late in found.values() for r, why in late.items()})

    def _groups_called(self) -> dict[str, list[int]]:
        """The groups this rank has called: name -> its members (global ranks)."""
        by_name = {name: pg for pg, name in dist.distributed_c10d._world.pg_names.items()}
        return {name: dist.get_process_group_ranks(by_name[name]) for name in list(self._counts) if name in by_name}

    def behind(self, groups: dict[str, list[int]]) -> dict[tuple[int, ...], dict[int, str]]:
        """For each of `groups` (name -> members, global ranks), the peers that have not reached this
        rank's last call there: members -> {global rank: why}. One wait of at most STALE_AFTER_S for
        fresh reports serves every group."""
        counts = dict(self._counts)  # a copy: the training thread may add a group meanwhile
        peers = sorted({r for ranks in groups.values() for r in ranks if r != self.rank})
        before, fresh = self._fresh(peers)
        found = {}
        for name, ranks in groups.items():
            late = self._verdicts([r for r in ranks if r != self.rank], name, counts.get(name, 0), before, fresh)
            if late:
                found[tuple(ranks)] = late
        return found

    def missing(self, group_name: str, ranks: list[int], call: int) -> dict[int, str]:
        """Global rank -> why it has not arrived at call number `call` on the group (its members
        `ranks`, global), for the peers that have not: stopped or hung, or behind. Waits at most
        STALE_AFTER_S for fresh reports."""
        peers = [r for r in ranks if r != self.rank]
        return self._verdicts(peers, group_name, call, *self._fresh(peers))

    def _fresh(self, peers: list[int]) -> tuple[dict[int, dict], dict[int, dict]]:
        """The peers' reports now, and those published since (waiting at most STALE_AFTER_S)."""
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
        return before, fresh

    def _verdicts(self, peers: list[int], group_name: str, call: int, before: dict[int, dict],
                  fresh: dict[int, dict]) -> dict[int, str]:
        """Why each of `peers` has not arrived at call `call` on the group, for those that have not."""
        out = {}
        for r in peers:
            if r not in fresh:
                out[r] = (f"sent no report for {STALE_AFTER_S:g} s: stopped (SIGSTOP, a debugger), hung or gone"
                          if r in before else "never reported: it died or hung before its first report")
            elif (made := fresh[r]["calls"].get(group_name, 0)) < call:
                out[r] = (f"made {made} of these calls, this is call {call}: it took another code path (a "
                          f"rank-dependent branch, an exception caught on one rank) or is stuck before the call")
        return out


def stalled_report(rank: int, silent_s: float, found: dict[tuple[int, ...], dict[int, str]]) -> str:
    """The watch's line: which ranks of which groups never arrived where this rank waits."""
    groups = "; ".join(f"of the group of ranks {list(ranks)}: " + ", ".join(f"rank {r} {why}" for r, why in
                                                                            sorted(missing.items()))
                       for ranks, missing in found.items())
    return (f"rank {rank}: no collective launched for {silent_s:.0f} s, waiting for peers that never arrived "
            f"(the groups' timeout ends the job: parallel.collective_timeout_s, in the first step "
            f"parallel.first_step_timeout_s): {groups}")
