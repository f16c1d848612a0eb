"""Two lanes of work on one rank: DualPipe's overlapped F&B pair (parallel.ep_overlap).

DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.2.1) hides the expert all-to-alls of one micro-batch's
chunk under the computation of another's: a forward chunk and a backward chunk of two
micro-batches run as one pair, each one's dispatch and combine in flight while the other
computes. fivefold runs the pair on two threads of the rank (pipeline/overlap.py): the backward
on the step's thread (the main lane), the forward on one worker thread (the side lane). Every
torch op and every wait on a collective releases the GIL, so while one lane waits for its
all-to-all the other computes (on CUDA each chunk has its own stream, so the kernels overlap too).

NCCL's rules for two threads (its user guide, "Using multiple NCCL communicators concurrently"),
and how the lanes keep them:
- one communicator per thread: two threads must not issue collectives on one process group (its
  ranks must call them in one order, and two threads interleave theirs differently on each rank).
  So the side lane has a twin of every process group of the mesh (`Mesh.add_side_lane`), and every
  call in comm/collectives.py asks its group for the one of the calling thread's lane
  (`AxisGroup.current`). The twins cost one communicator more per group (NCCL buffers), only with
  ep_overlap. NCCL makes a communicator at its group's first collective, itself a collective of
  the group's ranks: the mesh makes every twin and runs one collective on each at setup, in one
  order on every rank, not inside the first pair.
- one launch order: where the kernels of two communicators can wait for each other, every rank
  must launch the collectives of all its communicators in one order, or rank 0's first kernel waits
  for rank 1's first, which waits for rank 0's second. Two free threads launch in whatever order
  they reach their calls. So inside a pair the lanes take turns (`Turns`): one launch each, the
  main lane's first, then only the lane still launching once the other's half is done. Each lane's
  own calls are in program order, the same on every rank of its groups (every group a pair uses,
  ep, tp, cp, lies inside one pipeline stage, whose ranks run the same actions), so the turns
  make one order of the two lanes' launches, the same on every rank. A lane waits for its turn to
  launch, never to wait on a collective; a synchronous call is launched and waited for within its
  turn (on NCCL it returns once enqueued; on gloo it returns done).
  Why the main lane first: the plan posts both halves' inputs before the pair (paired_plans), and a
  B's first collective comes at its start (the received gradient goes straight into its last
  block's combine), an F's only after its first block's attention.

Proven on gloo (CPU: tests/parallel/test_ep_overlap.py records every rank's launches); not yet run
on NCCL.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

MAIN, SIDE = "main", "side"


class Turns:
    """Whose collective launches next, inside one pair: the lanes one launch each in `order`, a lane
    that is done (`finish`) leaving the rotation. One lock (a Condition) for both lanes."""

    def __init__(self, order: tuple[str, ...]) -> None:
        self._cond = threading.Condition()
        self._order = list(order)  # the lanes still launching, in turn order
        self._next = 0  # index in _order of the lane whose launch is next

    @contextlib.contextmanager
    def turn(self, lane: str) -> Iterator[None]:
        """Wait for `lane`'s turn, launch inside the block, then pass the turn on."""
        with self._cond:
            if lane not in self._order:
                raise RuntimeError(f"the {lane} lane launched a collective after its half of the pair was done")
            self._cond.wait_for(lambda: self._order[self._next] == lane)
        try:
            yield
        finally:
            with self._cond:
                self._next = (self._next + 1) % len(self._order)
                self._cond.notify_all()

    def finish(self, lane: str) -> None:
        """`lane` launches nothing more in this pair: the turns go on without it."""
        with self._cond:
            if lane not in self._order:
                return
            at, current = self._order.index(lane), self._order[self._next]
            self._order.remove(lane)
            if not self._order:
                return
            # The lane whose turn it was keeps it; if it was the finished lane's, the next one's.
            self._next = self._order.index(current) if current != lane else at % len(self._order)
            self._cond.notify_all()


class Lanes:
    """Which lane the calling thread is on, the side lane's worker thread, and the turns of a pair."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._local = threading.local()  # .side: True on the worker thread
        self._device = device
        self._worker: ThreadPoolExecutor | None = None  # started by the first pair
        self._turns: Turns | None = None  # set while a pair runs (`taking_turns`)

    def on_side(self) -> bool:
        """Is the calling thread the side lane's? (Any other thread, CUDA autograd's included, runs
        for the main lane: a pair's backward is the main lane's.)"""
        return getattr(self._local, "side", False)

    def lane(self) -> str:
        return SIDE if self.on_side() else MAIN

    def _enter_side(self) -> None:
        self._local.side = True
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # a new thread starts on device 0

    def beside(self, fn: Callable[[], T]) -> Future:
        """Run `fn` on the side lane while the caller goes on; `.result()` waits for it (and re-raises
        what it raised). One worker: the side lane's calls stay in one order."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="fivefold-side-lane", initializer=self._enter_side)
        return self._worker.submit(fn)

    @contextlib.contextmanager
    def taking_turns(self) -> Iterator[None]:
        """Inside the block (one pair) the lanes' collectives launch in turns, the main lane's first
        (module docstring). Each lane calls `finish` when its half is done."""
        self._turns = Turns((MAIN, SIDE))
        try:
            yield
        finally:
            self._turns = None

    def launch(self) -> contextlib.AbstractContextManager:
        """Around the backend call that launches a collective: inside a pair, waits for the calling
        lane's turn and passes it on after; outside one (a single lane), nothing."""
        turns = self._turns
        return turns.turn(self.lane()) if turns is not None else contextlib.nullcontext()

    def finish(self) -> None:
        """The calling lane's half of the pair is done: the other lane launches without waiting for it."""
        if self._turns is not None:
            self._turns.finish(self.lane())

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
