"""The pipeline executor's messages on one rank: posting the plan, freeing what has been sent.

`messages.py` plans, from the schedule alone, which batch of sends and receives a rank posts
before each of its actions (one order per pair of ranks, as NCCL needs, proven not to deadlock).
`Mailbox` posts exactly those batches for one run of `PipelineExecutor` (pipeline/executor.py): it keeps
what an action produced until its batch and what arrived until the action that uses it, and hands
over in memory between two stages of one rank (V layout). `Sends` watches the sends in flight and
frees the storage of a stage output once it has left (polled on CUDA, by a helper thread on gloo).
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.pipeline.messages import Batch, Message, incoming, outgoing
from fivefold.parallel.pipeline.schedules import Action, Schedule


class Sends:
    """Outstanding sends. When one completes, the stage output it carried (if any) is freed.

    How completion is seen depends on the backend (`sends_for`):
    - polled (CUDA, NCCL): the executor asks every send in flight `is_completed()` before each
      action (`poll`), a query of the work's CUDA event that never blocks, and frees those done.
      A helper thread blocking in NCCL's wait() would instead make the compute stream wait for the
      whole batch at whatever point the thread reached it.
    - a helper thread (CPU, gloo) that waits on each send in turn (the wait releases the GIL):
      gloo's Work.is_completed() reports False until someone waits (measured, torch 2.13), so
      polling would free nothing before the end of the step.
    `finish()` waits for the rest in both: on NCCL that wait only orders the current stream after
    the sends, so a buffer freed then is reused by later kernels only once its send has left.
    """

    def __init__(self, poll: bool = False) -> None:
        self.polled = poll
        self.freed_bytes = 0  # storage released (read after finish())
        self.in_flight: list[tuple[collectives.Pending, torch.Tensor | None]] = []  # polled: in posting order
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None  # started by the first send: pp = 1 sends nothing

    def add(self, pending: collectives.Pending, free: torch.Tensor | None) -> None:
        if self.polled:
            self.in_flight.append((pending, free))
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._drain, daemon=True)
            self.thread.start()
        self.queue.put((pending, free))

    def poll(self) -> None:
        """Free what the completed sends carried (polled mode; the helper thread does it otherwise).
        A completed send is still waited for: that returns at once, or names its failure."""
        if not self.polled:
            return
        still = []
        for pending, t in self.in_flight:
            if pending.is_completed():
                pending.wait()
                self._free(t)
            else:
                still.append((pending, t))
        self.in_flight = still

    def _free(self, t: torch.Tensor | None) -> None:
        if t is not None:
            self.freed_bytes += t.untyped_storage().nbytes()
            t.untyped_storage().resize_(0)  # shape and autograd node stay; the values are gone

    def _drain(self) -> None:
        while (item := self.queue.get()) is not None:
            pending, t = item
            try:
                pending.wait()  # names a failure (comms); counts no exposed time on this thread
            except BaseException as e:  # noqa: BLE001 - re-raised by finish() on the executor's thread
                self.error = self.error or e
                continue
            self._free(t)

    def finish(self) -> None:
        """Wait until every send has completed."""
        if self.polled:
            for pending, t in self.in_flight:
                pending.wait()
                self._free(t)
            self.in_flight = []
            return
        if self.thread is None:
            return
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


def sends_for(device: torch.device) -> Sends:
    """One run's `Sends` on `device`: polled on CUDA (NCCL), drained by a helper thread elsewhere (gloo)."""
    return Sends(poll=device.type == "cuda")


class Mailbox:
    """One run's messages on this rank, posted as `plan` (this rank's `message_plans()`) says.

    shape: micro-batch -> the shape of what travels for it; dtype: what travels in (the receive
    buffers'); tag: a message's gloo tag.
    """

    def __init__(self, schedule: Schedule, plan: list[Batch], group: AxisGroup, shape: Callable[[int], tuple[int, ...]],
                 dtype: torch.dtype, device: torch.device, tag: Callable[[Message], int], sends: Sends):
        self.schedule, self.plan, self.group, self.shape = schedule, plan, group, shape
        self.dtype, self.device, self.tag, self.sends = dtype, device, tag, sends
        self.outbox: dict[Message, tuple[torch.Tensor, bool]] = {}  # produced, not yet posted: (tensor, free it)
        self.inbox: dict[Message, tuple[torch.Tensor, collectives.Pending]] = {}  # posted receives: (buffer, handle)
        self.local: dict[tuple[str, int, int], torch.Tensor] = {}  # (kind, mb, producing stage) -> tensor

    def post(self, index: int) -> None:
        """Post batch `index` of the plan: before action `index`, or after the last one (first
        freeing what the sends completed since the last post carried, when polled)."""
        self.sends.poll()
        batch = self.plan[index]
        sends = [collectives.P2P(self.outbox[m][0], m.dst, self.tag(m), f"send {m.kind} mb {m.microbatch} to stage "
                           f"{m.stage + (1 if m.kind == 'activation' else -1)}") for m in batch.sends]
        bufs = [torch.empty(self.shape(m.microbatch), dtype=self.dtype, device=self.device) for m in batch.recvs]
        recvs = [collectives.P2P(buf, m.src, self.tag(m), f"recv {m.kind} mb {m.microbatch} from stage {m.stage}")
                 for m, buf in zip(batch.recvs, bufs, strict=True)]
        sent, received = collectives.batch(sends, recvs, self.group)
        for m, pending in zip(batch.sends, sent, strict=True):
            t, free = self.outbox.pop(m)
            self.sends.add(pending, t if free else None)
        self.inbox.update((m, (buf, pending)) for m, buf, pending in zip(batch.recvs, bufs, received, strict=True))

    def take(self, action: Action) -> torch.Tensor:
        """The input `action` needs from a neighbouring stage: an activation (F) or a gradient (B, I)."""
        if (msg := incoming(self.schedule, action)) is None:
            forward = action.kind == "F"
            return self.local.pop(("activation" if forward else "gradient", action.microbatch,
                                   action.stage - 1 if forward else action.stage + 1))
        buf, pending = self.inbox.pop(msg)
        # The stage has nothing to do until this arrives: the pipeline bubble. The wait also holds
        # the transfer itself, small on CPU with these activations; on a slow link it is pp time.
        pending.wait(part="bubble")
        return buf

    def travels(self, action: Action) -> bool:
        """Does what `action` produces go to another rank (and so in the compute dtype)?"""
        return outgoing(self.schedule, action) is not None

    def put(self, action: Action, t: torch.Tensor, free: bool = False) -> None:
        """What `action` produced for the neighbouring stage (in `dtype` if it `travels`); with `free`,
        its storage is released once sent (a handover in memory frees nothing)."""
        if (msg := outgoing(self.schedule, action)) is None:
            self.local["activation" if action.kind == "F" else "gradient", action.microbatch, action.stage] = t
        else:
            self.outbox[msg] = (t.contiguous(), free)
