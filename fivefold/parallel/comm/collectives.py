"""Every collective the parallel code calls, each on an explicit group, each counted per axis.

A collective takes an `AxisGroup` (a process group plus the axis its traffic is charged to), so a
run can report how many calls and bytes each parallel dimension cost, and the planner predicts the
same numbers with the same `wire_bytes()` formula. A group of size 1 returns at once and counts
nothing: code never branches on "is this dimension on".

Bytes are counted two ways, per rank:
- `bytes`: the payload (the tensor handed to the collective);
- `wire_bytes`: what one rank sends under the bandwidth-optimal ring algorithm, the accounting used
  in docs/ring-all-reduce.md and by NCCL's bus bandwidth: all-reduce 2(N-1)/N x S (a reduce-scatter then
  an all-gather, Patarasuk & Yuan 2009), all-gather and reduce-scatter (N-1)/N x S of the full
  tensor, all-to-all (N-1)/N x S, broadcast and point-to-point S.

A collective whose peers do not answer within the group's timeout (`parallel.collective_timeout_s`),
or whose peer's connection drops, raises `CollectiveError` naming this rank, the axis, the operation
and its bytes, instead of the backend's anonymous message; async handles do the same in `wait()`.
A timed-out collective also names the ranks of its group that never arrived, and why (stopped or
hung, or behind by a number of calls), from the counts every rank publishes (comm/errors.py,
arrivals.py).

Point-to-point messages (pipeline activations and gradients, ring-attention K/V blocks, the steps
of our own ring all-reduce) go through here too: `send`, `recv` and `exchange` address peers by
their rank in the group, count what they send as "send" on the group's axis, and name a failure
like a collective does; `batch` posts several sends and receives at once (the pipeline's).

The time the calling thread is blocked in a collective or a message (a synchronous call, an async
launch, a `wait()`) is reported to the group's `timer` (timing.py) as that axis's exposed
communication.

Every call here is excluded from torch.compile's tracing (`torch.compiler.disable`): inside a
compiled block (`train.compile`) a collective is one graph break and runs as it does eagerly,
counted, timed and named. Traced, its Python bookkeeping (these counters, the timer's spans, the
arrivals' counts) and the backend's call each broke the graph again, or were replayed wrongly
(tests/parallel/test_compile.py counts the breaks).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from fivefold.parallel.comm.arrivals import Arrivals
from fivefold.parallel.comm.compat import flat_collective

# CollectiveError: what the calls here raise, so callers catch it as comms.CollectiveError.
from fivefold.parallel.comm.errors import CollectiveError as CollectiveError
from fivefold.parallel.comm.errors import group_name, named_error, named_errors
from fivefold.parallel.comm.lanes import Lanes
from fivefold.parallel.comm.timing import Flight, StepTimer
from fivefold.parallel.comm.wire import wire_bytes


@dataclass
class AxisCounter:
    calls: int = 0
    bytes: int = 0
    wire_bytes: float = 0.0


@dataclass
class CommStats:
    """Calls and bytes per axis label ("dp", "tp", "pp", "cp", "ep"; "log" for metrics)."""

    axes: dict[str, AxisCounter] = field(default_factory=lambda: defaultdict(AxisCounter))
    # Two lanes (lanes.py) count at once: a += between threads could lose one of two increments.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, label: str, op: str, nbytes: int, n: int, wire: float | None = None) -> None:
        """One call of `op` over n ranks on nbytes; `wire` overrides the ring formula when known."""
        with self.lock:
            c = self.axes[label]
            c.calls += 1
            c.bytes += nbytes
            c.wire_bytes += wire_bytes(op, nbytes, n) if wire is None else wire

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: {"calls": v.calls, "bytes": v.bytes, "wire_bytes": v.wire_bytes}
                for k, v in sorted(self.axes.items())}

    def reset(self) -> None:
        self.axes.clear()


@dataclass
class AxisGroup:
    """A process group, this rank's place in it, and the axis label its traffic is charged to."""

    name: str  # the view's name: "tp", "dp", "grad", ...
    label: str  # the axis charged: gradient reduction over dp x cp counts as "dp"
    pg: dist.ProcessGroup | None
    size: int
    rank: int
    stats: CommStats
    timeout_s: float | None = None  # what the process group waits for its peers (None: torch's default)
    timer: StepTimer = field(default_factory=StepTimer)  # the mesh's step timer: where blocked time goes
    arrivals: Arrivals | None = None  # the mesh's collective counts (None: a timeout names no missing rank)
    side: "AxisGroup | None" = field(default=None, repr=False)  # its twin on the side lane (lanes.py), if any
    lanes: Lanes | None = field(default=None, repr=False)

    def current(self) -> "AxisGroup":
        """This group as the calling thread's lane uses it: its side-lane twin on the side lane's thread."""
        return self.side if self.side is not None and self.lanes.on_side() else self

    def launch(self) -> contextlib.AbstractContextManager:
        """Around the backend call that launches a collective on this group: inside an overlapped
        pair, the calling lane's turn (lanes.py: one launch order on every rank); elsewhere nothing."""
        return self.lanes.launch() if self.lanes is not None else contextlib.nullcontext()

    def global_rank(self, group_rank: int) -> int:
        """The world rank of this group's rank `group_rank` (point-to-point calls address world ranks)."""
        return dist.get_global_rank(self.pg, group_rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _count(group: AxisGroup) -> int | None:
    """Count one collective on the group; its number there, or None where nothing counts."""
    return None if group.arrivals is None else group.arrivals.issue(group_name(group))


class Pending:
    """The handle of an async collective or message: wait() blocks until it is done, naming it if it
    fails. The time wait() blocks is this axis's exposed communication (timing.py); a wait on another
    thread (the pipeline's send thread) counts nothing."""

    def __init__(self, works: list[dist.Work], describe: Callable[[RuntimeError], RuntimeError], group: AxisGroup,
                 label: str, op: str, flight: Flight | None = None):
        self._works, self._describe, self._group, self._label, self._op = works, describe, group, label, op
        self._flight = flight  # traced, and the work has no future: its span ends when waited on

    def is_completed(self) -> bool:
        """Done (or failed: wait() then names it), without blocking. gloo reports False until waited on."""
        return all(work.is_completed() for work in self._works)

    @torch.compiler.disable
    def wait(self, part: str | None = None) -> None:
        """Block until done; the time waited counts to `part` when given ("bubble": a pipeline stage
        with nothing else to do), else to the axis's exposed time."""
        timer, name = self._group.timer, f"{self._op} wait"
        try:
            with timer.span(part, self._label, name) if part else timer.blocked(self._label, name):
                for work in self._works:
                    work.wait()
        except RuntimeError as e:
            raise self._describe(e) from e
        if self._flight is not None:
            self._flight.done()
            self._flight = None


def _issue(op: str, group: AxisGroup, nbytes: int, label: str, async_op: bool,
           call: Callable[[], dist.Work | list[dist.Work] | None], name: str | None = None,
           number: int | None = None) -> Pending | None:
    """Run one collective or batch of messages; a failure names it (async: when the handle is waited on).
    `number`: a collective's number on its group (`_count`; messages have none)."""
    name = name or op
    describe = lambda e: named_error(e, name, group, nbytes, label, number)  # noqa: E731
    flight = group.timer.flight(label, name) if async_op else None
    try:
        with group.timer.blocked(label, name), group.launch():  # a synchronous call blocks throughout; an async
            work = call()  # one while it launches (and, in a pair, while it waits for its lane's turn)
    except RuntimeError as e:
        raise describe(e) from e
    if not async_op:
        return None
    works = work if isinstance(work, list) else [work]
    if flight is not None and len(works) == 1:
        try:  # gloo's collectives complete their future from the backend's thread: the true end
            works[0].get_future().add_done_callback(flight.done)
            flight = None
        except RuntimeError:  # "getFuture not implemented" (gloo point-to-point): ends at wait()
            pass
    return Pending(works, describe, group, label, name, flight)


@torch.compiler.disable
def all_reduce(tensor: torch.Tensor, group: AxisGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
               async_op: bool = False, label: str | None = None) -> Pending | None:
    """In-place all-reduce over `group`; returns the work handle when async_op.

    `label` charges the traffic elsewhere than the group's axis (metrics use "log", so the
    per-axis counts stay those of training itself).
    """
    group = group.current()
    if group.size == 1:
        return None
    group.stats.record(label or group.label, "all_reduce", _nbytes(tensor), group.size)
    return _issue("all_reduce", group, _nbytes(tensor), label or group.label, async_op,
                  lambda: dist.all_reduce(tensor, op=op, group=group.pg, async_op=async_op), number=_count(group))



@torch.compiler.disable
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
                   async_op: bool = False) -> Pending | None:
    """Sum `input` (N x output.numel(), rank-major) over the group; rank r keeps chunk r in `output`.

    Counted by the full input size, as the ring moves (N-1)/N of it. On CPU tensors (gloo) it is
    always synchronous: gloo's async form blocks for most of its time anyway (docs/torch-cpu-notes.md)
    and keeps a copy of the whole input alive until it is waited on, a bucket's size more at the peak
    of a ZeRO backward (measured: benchmarks/startup_memory.py); the sync form frees it at once.
    """
    group = group.current()
    if group.size == 1:
        output.copy_(input)
        return None
    async_op = async_op and input.device.type != "cpu"
    group.stats.record(group.label, "reduce_scatter", _nbytes(input), group.size)
    return _issue("reduce_scatter", group, _nbytes(input), group.label, async_op,
                  lambda: flat_collective("reduce_scatter")(output, input, op=dist.ReduceOp.SUM, group=group.pg,
                                                              async_op=async_op), number=_count(group))


@torch.compiler.disable
def all_gather(output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
               async_op: bool = False) -> Pending | None:
    """Concatenate every rank's `input` into the flat `output` (N x input.numel()), in rank order."""
    group = group.current()
    if group.size == 1:
        output.copy_(input)
        return None
    group.stats.record(group.label, "all_gather", _nbytes(output), group.size)
    return _issue("all_gather", group, _nbytes(output), group.label, async_op,
                  lambda: flat_collective("all_gather")(output, input, group=group.pg, async_op=async_op),
                  number=_count(group))


@torch.compiler.disable
def all_to_all(output: torch.Tensor, input: torch.Tensor, group: AxisGroup,
               output_splits: list[int] | None = None, input_splits: list[int] | None = None,
               async_op: bool = False) -> Pending | None:
    """Rank r sends rows input_splits[j] (dim 0) to rank j and receives output_splits[j] from it.

    Equal splits when none are given. Counted by the rows this rank sends to the others (its own
    rows never leave it): the wire bytes are then exactly the payload that crosses the network.
    """
    group = group.current()
    if group.size == 1:
        output.copy_(input)
        return None
    sent = None  # equal splits: the ring formula (N-1)/N x S is exact
    if input_splits is not None:
        row = _nbytes(input[0]) if input.shape[0] else 0
        sent = row * (sum(input_splits) - input_splits[group.rank])
    group.stats.record(group.label, "all_to_all", _nbytes(input), group.size, wire=sent)
    return _issue("all_to_all", group, _nbytes(input), group.label, async_op,
                  lambda: dist.all_to_all_single(output, input, output_splits, input_splits, group=group.pg,
                                                 async_op=async_op), number=_count(group))


# ---- point-to-point: pipeline messages, ring hops ----
# Peers are group ranks. Only sends are counted (a message's bytes once, by the rank that sends them).


@torch.compiler.disable
def send(tensor: torch.Tensor, to: int, group: AxisGroup, name: str = "send", tag: int = 0) -> Pending:
    """Start sending `tensor` to group rank `to`; wait() on the handle (or on another thread) to finish."""
    group = group.current()
    nbytes = _nbytes(tensor)
    group.stats.record(group.label, "send", nbytes, group.size)
    return _issue("send", group, nbytes, group.label, True,
                  lambda: dist.isend(tensor, group.global_rank(to), group=group.pg, tag=tag), name)


@torch.compiler.disable
def recv(tensor: torch.Tensor, frm: int, group: AxisGroup, name: str = "recv", tag: int = 0,
         part: str | None = None) -> None:
    """Receive into `tensor` from group rank `frm`, blocking. The time waited is the axis's exposed
    time, or `part`'s ("bubble": a pipeline stage that has nothing else to do)."""
    group = group.current()
    span = group.timer.span(part, group.label, name) if part else group.timer.blocked(group.label, name)
    with span, named_errors(name, group, _nbytes(tensor)):
        with group.launch():
            work = dist.irecv(tensor, group.global_rank(frm), group=group.pg, tag=tag)
        work.wait()


@torch.compiler.disable
def exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, to: int, frm: int, group: AxisGroup,
             name: str = "exchange", tag: int = 0) -> Pending:
    """Post a send to `to` and a receive from `frm` as one batch; wait() on the handle for both.

    One batch, because in a ring every rank sends and receives at once: if each did a blocking send
    first, all would wait for a receiver that is itself stuck sending.
    """
    group = group.current()
    nbytes = _nbytes(send_buf)
    group.stats.record(group.label, "send", nbytes, group.size)
    ops = [dist.P2POp(dist.isend, send_buf, group.global_rank(to), group=group.pg, tag=tag),
           dist.P2POp(dist.irecv, recv_buf, group.global_rank(frm), group=group.pg, tag=tag)]
    return _issue("send", group, nbytes, group.label, True, lambda: dist.batch_isend_irecv(ops), name)


@dataclass(frozen=True)
class P2P:
    """One send or receive of a `batch`: the tensor, the peer's group rank, the tag (gloo matches by
    it, NCCL ignores it) and a name for errors and traces."""

    tensor: torch.Tensor
    peer: int
    tag: int = 0
    name: str = "message"


@torch.compiler.disable
def batch(sends: list[P2P], recvs: list[P2P], group: AxisGroup) -> tuple[list[Pending], list[Pending]]:
    """Post `sends` and `recvs` as one batch; one handle per send and per receive, in order.

    NCCL runs a batch as one group whose operations progress together (two ranks that each send to
    the other cannot both block in the send) and matches the messages between two ranks by the
    order they are posted. Where the backend returns one work for the whole batch (NCCL), every
    handle waits for all of it; gloo returns one per operation.
    """
    group = group.current()
    if not sends and not recvs:
        return [], []
    ops = [dist.P2POp(op, m.tensor, group.global_rank(m.peer), group=group.pg, tag=m.tag)
           for op, ms in ((dist.isend, sends), (dist.irecv, recvs)) for m in ms]
    for m in sends:
        group.stats.record(group.label, "send", _nbytes(m.tensor), group.size)
    first = (sends or recvs)[0]
    try:
        with group.timer.blocked(group.label, first.name), group.launch():  # the transfers run in the background
            works = dist.batch_isend_irecv(ops)
    except RuntimeError as e:
        raise named_error(e, first.name, group, sum(_nbytes(m.tensor) for m in sends), group.label) from e
    handles = [Pending(list(works) if len(works) != len(ops) else [works[k]],
                       lambda e, m=m: named_error(e, m.name, group, _nbytes(m.tensor), group.label), group, group.label,
                       m.name, group.timer.flight(group.label, m.name)) for k, m in enumerate([*sends, *recvs])]
    return handles[:len(sends)], handles[len(sends):]


# ---- coordination: barriers and object gathers ----
# The run's own coordination (every rank at one point of the run, a few Python values gathered)
# goes through here too, so a rank that never arrives is named like at any collective. It is charged
# to "log", never to the group's axis: the per-axis counts stay those of training.
# An object collective counts its calls and no bytes: it carries pickled Python values whose size
# differs by rank (torch pads every rank's to the largest, known only after a first exchange of sizes);
# what it moves is coordination, never a step's tensors.

COORDINATION = "log"


def world_group(stats: CommStats | None = None, timeout_s: float | None = None, timer: StepTimer | None = None,
                arrivals: Arrivals | None = None) -> AxisGroup:
    """Every rank of the job (torch's default group), charged to "log": the mesh's "world" view, or,
    where no mesh exists (a test's peer, a tool), an uncounted one whose failures are still named."""
    return AxisGroup("world", COORDINATION, None, dist.get_world_size(), dist.get_rank(), stats or CommStats(),
                     timeout_s, timer or StepTimer(), arrivals)


@torch.compiler.disable
def barrier(group: AxisGroup, name: str = "barrier") -> None:
    """Block until every rank of `group` has called this (a barrier of the same `name` is the same
    point of the run on every rank)."""
    group = group.current()
    if group.size == 1:
        return
    group.stats.record(COORDINATION, "barrier", 0, group.size, wire=0.0)
    _issue("barrier", group, 0, COORDINATION, False, lambda: dist.barrier(group=group.pg), name, number=_count(group))


@torch.compiler.disable
def all_gather_object(obj: object, group: AxisGroup, name: str = "all_gather_object") -> list:
    """Every rank's picklable `obj`, in group rank order. Tensors travel as CPU copies: pickled on a
    GPU, a tensor names its device index, and a receiver would unpickle it onto the sender's GPU."""
    group = group.current()
    if group.size == 1:
        return [obj]
    group.stats.record(COORDINATION, "all_gather_object", 0, group.size, wire=0.0)
    gathered: list = [None] * group.size
    payload = _pickled_on_cpu(obj)
    _issue("all_gather_object", group, 0, COORDINATION, False,
           lambda: dist.all_gather_object(gathered, payload, group=group.pg), name, number=_count(group))
    return [pickle.loads(b) for b in gathered]  # the job's own ranks' bytes, as torch's gather unpickles them


class _CpuPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
            return obj.cpu().__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # (the C pickler keeps no .proto)
        return NotImplemented


def _pickled_on_cpu(obj: object) -> bytes:
    """`obj` pickled with every tensor in it on the CPU (a tensor on the CPU or meta device as it is)."""
    out = io.BytesIO()
    _CpuPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()
