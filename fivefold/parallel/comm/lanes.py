"""Two lanes of work on one rank: DualPipe's overlapped F&B pair (parallel.ep_overlap).

DeepSeek-V3 (DeepSeek-AI 2024, sec. 3.2.1) hides the expert all-to-alls of one micro-batch's
chunk under the computation of another's: a forward chunk and a backward chunk of two
micro-batches run as one pair, each one's dispatch and combine in flight while the other
computes. fivefold runs the pair on two threads of the rank (pipeline/overlap.py): the backward
on the step's thread (the main lane), the forward on one worker thread (the side lane). Every
torch op and every wait on a collective releases the GIL, so while one lane waits for its
all-to-all the other computes (on CUDA each chunk has its own stream, so the kernels overlap too).

Two threads must not issue collectives on one process group: the ranks of a group must call its
collectives in one order, and two threads interleave theirs differently on each rank. So the
side lane has a twin of every process group of the mesh (`Mesh.add_side_lane`), and every call in
comm/collectives.py asks its group for the one of the calling thread's lane (`AxisGroup.current`).
Each lane's calls on its groups are in program order, the same on every rank of the group, as
without overlap. The twins cost one communicator more per group (NCCL buffers), only with ep_overlap.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class Lanes:
    """Which lane the calling thread is on, and the side lane's worker thread."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._local = threading.local()  # .side: True on the worker thread
        self._device = device
        self._worker: ThreadPoolExecutor | None = None  # started by the first pair

    def on_side(self) -> bool:
        """Is the calling thread the side lane's?"""
        return getattr(self._local, "side", False)

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

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
