"""A SIGTERM ends an elastic job's step with a checkpoint, so a restart loses nothing.

torch's elastic agent restarts the running workers when a node asks to join (num_nodes_waiting() > 0):
it sends them SIGTERM and waits 30 s (its shutdown timeout) before SIGKILL. A worker that died at
the signal would leave the new, larger world to repeat every step since the last checkpoint. So in
an elastic job the first SIGTERM only raises a flag; at the end of each step every rank contributes
its flag to one all-reduce (MAX), so all ranks agree on the step at which to stop, save a
checkpoint there, and return. One all-reduce of 4 bytes per step is the price: the signal reaches
the ranks of different nodes at different moments, and a rank that saved alone would hang the
others' checkpoint collective. A second SIGTERM (a user who means it, or a peer already gone) runs
the handler that was there before (the worker report's, which ends the process at once).

Polling a store key each step would see the join as well, but the agent's SIGTERM comes anyway,
possibly first; the signal is the one notice every stop already sends (Slurm's preemption too).
"""

from __future__ import annotations

import signal
from types import FrameType, TracebackType

import torch

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup


class StopRequest:
    """Within `with StopRequest():` a SIGTERM asks for a stop at the end of the step."""

    def __init__(self) -> None:
        self.signalled = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled and callable(self._previous):  # the second one: stop now, as before
            self._previous(signum, frame)
        self.signalled = True

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]

    def agreed(self, world: AxisGroup) -> bool:
        """Collective over `world`: has any rank been asked to stop?"""
        flag = torch.tensor([int(self.signalled)], dtype=torch.int32)
        collectives.all_reduce(flag, world, op=torch.distributed.ReduceOp.MAX, label="log")
        return bool(flag.item())
