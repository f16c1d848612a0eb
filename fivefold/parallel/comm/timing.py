"""Where a training step's time goes on this rank: one recorder, fed by the code that does the work.

A step is cut into parts by *exclusive* time, as a profiler's "self time": a span's part gets its
wall time minus the spans opened inside it. So the parts of a step never overlap and add up:

- compute: the pipeline executor's F, B, I, W actions (pipeline/executor.py), timed directly around them;
- recompute: the forward that activation checkpointing runs again inside backward (recompute.py);
- exposed_<axis>: the time this thread is blocked in a collective of that axis (comm/collectives.py): the
  whole call of a synchronous one; the launch and the `wait()` of an asynchronous one. While an
  asynchronous collective runs and this thread computes, it is hidden and not counted. The tp, cp
  and ep collectives run inside forward and backward: nested in compute, so subtracted from it;
- bubble: a pipeline stage waiting to receive an activation or gradient (nothing else to do);
- optimizer, data: the loop's own spans (train/step.py);
- unattributed: the step's wall time minus all of the above, reported as its own part.

DualPipe's overlapped pairs (parallel.ep_overlap, comm/lanes.py) run a forward on a second thread,
the side lane, while the step's thread runs a backward. The parts stay the step thread's time, and
where the lanes overlap they say what the rank did: a wait of the step thread while the side lane
computes is compute, not exposed (the rank was busy), and the step thread's wait for the side lane
to finish (`lane_wait`) is the side lane's: compute while it computes, exposed_<axis> while it waits
for a collective of that axis. So exposed_<axis> is the time neither lane computes and a lane waits.

Marks of a clock, read at the end of the step: wall clock (perf_counter) on a CPU, where the work
runs on the thread that issues it; CUDA events on a GPU, where the thread only launches kernels and
the events time the stream (one synchronisation per step, in end_step).

With tracing on (a bounded window of steps), every span is also kept as an event, and
asynchronous collectives as "in flight" spans from launch to completion: the work's future
reports completion on CPU (gloo's collectives complete it from the backend's thread); gloo's
point-to-point works have no future, so theirs end when they are waited on (an upper bound).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

# Every label comm/collectives.py charges traffic to; "log": the metrics' own reductions (loss, expert loads).
AXES = ("dp", "tp", "pp", "cp", "ep", "log")
PARTS = ("data", "compute", "recompute", "bubble", *(f"exposed_{a}" for a in AXES), "optimizer")
UNATTRIBUTED = "unattributed"


class _Null:
    """What a span is when nothing is measured: entering and leaving cost one attribute lookup."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


def _in_backward() -> bool:
    """Is this thread running a backward (autograd's engine has a graph task on it)?"""
    import torch

    return torch._C._current_graph_task_id() != -1


class WallClock:
    """perf_counter on the calling thread: exact on a CPU, where the work runs on the thread that
    issues it."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        """Each mark's time in seconds after the first."""
        return [m - marks[0] for m in marks]

    def host_times(self, first: Any, began: float, marks: list[Any]) -> list[float]:
        """Each mark as a perf_counter time: the marks are."""
        return list(marks)


class CudaClock:
    """CUDA events recorded on the current stream: the GPU's own time, where the thread only
    launches kernels. Read once, at the end of the step (one synchronisation)."""

    def mark(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, marks: list[Any]) -> list[float]:
        import torch

        torch.cuda.synchronize()
        return [marks[0].elapsed_time(m) / 1e3 for m in marks]

    def host_times(self, first: Any, began: float, marks: list[Any]) -> list[float]:
        """Each event as a perf_counter time: `began` (the host's time at the step's `first` event)
        plus the GPU's time from that event to it. Events of a step that ended are complete (its
        end synchronised), so reading them waits for nothing."""
        return [began + first.elapsed_time(m) / 1e3 for m in marks]


class _Span:
    """A measured `with` block: its time minus that of the spans inside it goes to `part`.

    It keeps its own two marks (no index into a list shared by threads): spans open on the step's
    thread and on autograd's, each thread with its own stack of open spans."""

    def __init__(self, timer: StepTimer, part: str, track: str, name: str, stack: list[_Span], parent: _Span | None,
                 lane: str = "main"):
        self.timer, self.part, self.track, self.name = timer, part, track, name
        self.stack, self.parent = stack, parent
        self.lane = lane  # "main", "side" (the side lane's thread) or "wait" (the main lane waiting for the side)

    def __enter__(self) -> None:
        self.start = self.timer.clock.mark()
        self.stack.append(self)

    def __exit__(self, *exc: Any) -> None:
        self.end = self.timer.clock.mark()
        self.stack.pop()
        self.timer._spans.append(self)  # one append: atomic under the GIL whichever thread closes it


class Flight:
    """An asynchronous operation being traced: launched now, `done()` when it completes (host time:
    a completion callback or a wait runs on the host)."""

    def __init__(self, events: list, track: str, name: str):
        self.events, self.track, self.name = events, track, name
        self.start = time.perf_counter()

    def done(self, *_: Any) -> None:
        self.events.append((f"{self.track} in flight", self.name, self.start, time.perf_counter()))


class StepTimer:
    """This rank's step-time recorder. The Mesh owns one and every AxisGroup carries it, so the code
    that does the work (collectives, pipeline actions, recomputation) reports to its own mesh's timer.

    A span records a mark of `clock` when it opens and when it closes; the step's parts are worked
    out from the marks at its end: wall clock on a CPU, CUDA events on a GPU (one synchronisation a
    step). Outside a step (evaluation, checkpoints, tests that run the parallel code alone) every
    span is a no-op.

    Threads: the parts are the step thread's time. On CUDA autograd runs a backward on its own
    device thread while the step's thread waits in `backward()`, so a span opened on another thread
    *while it runs a backward* (a recomputed forward, a tp/sp/ep/cp collective of backward, a
    bucket's reduction) is recorded, nested in the step thread's innermost open span (the action
    waiting for that backward), whose exclusive time it is taken from; its marks are that thread's
    CUDA events (on the stream autograd runs the node on) or its clock. A span on a thread not
    running a backward (the pipeline's send thread, whose waits overlap the step's work) is a no-op.
    """

    def __init__(self, clock: WallClock | CudaClock | None = None) -> None:
        self.clock = clock or WallClock()
        self.active = False
        self.events: list[tuple[str, str, float, float]] | None = None  # (track, name, start, end) when tracing
        self._first: Any = None  # the step's opening mark
        self._spans: list[_Span] = []  # closed this step, on any thread
        self._open: dict[int, list[_Span]] = {}  # thread ident -> its open spans, innermost last
        self._side: set[int] = set()  # the side lane's thread while it runs a pair's half (side_lane)
        self._began = 0.0
        self._owner = 0

    def begin_step(self, trace: bool = False) -> float:
        """Start measuring a step (and keep its events when `trace`); returns its start (perf_counter)."""
        self.events = [] if trace else None
        self._owner = threading.get_ident()
        self._spans, self._open = [], {self._owner: []}
        self.active = True
        self._began = time.perf_counter()
        self._first = self.clock.mark()
        return self._began

    def end_step(self) -> tuple[float, dict[str, float]]:
        """Stop measuring: (the step's seconds, {part: exclusive seconds} with unattributed)."""
        last = self.clock.mark()
        self.active = False
        marks = [self._first, *(m for s in self._spans for m in (s.start, s.end)), last]
        seconds = self.clock.seconds(marks)  # each mark's seconds after the step's start
        at = {id(s): (seconds[1 + 2 * i], seconds[2 + 2 * i]) for i, s in enumerate(self._spans)}
        took = {id(s): at[id(s)][1] - at[id(s)][0] for s in self._spans}
        inner = dict.fromkeys(took, 0.0)  # seconds of the spans opened directly inside each span
        for s in self._spans:
            if s.parent is not None:
                inner[id(s.parent)] += took[id(s)]
        parts = dict.fromkeys(PARTS, 0.0)
        for s in self._spans:
            if s.lane != "side":  # the side lane's time overlaps the step thread's: _overlapped charges it
                parts[s.part] += took[id(s)] - inner[id(s)]  # a label missing from AXES fails here, loudly
            if self.events is not None:
                track = s.track + (" (side lane)" if s.lane == "side" else "")
                self.events.append((track, s.name, self._began + at[id(s)][0], self._began + at[id(s)][1]))
        _overlapped(self._spans, at, parts)
        wall = seconds[-1]
        parts[UNATTRIBUTED] = wall - sum(parts.values())
        return wall, parts

    def host_times(self, marks: list[Any]) -> list[float]:
        """Marks of this timer's clock made during the step that just ended (`end_step`), as
        perf_counter times: on a CPU the marks themselves, on a GPU when the stream reached each
        event (the pipeline's timeline: when its kernels ran, not when they were launched)."""
        return self.clock.host_times(self._first, self._began, marks)

    def span(self, part: str, track: str = "compute", name: str | None = None) -> _Span | _Null:
        """A `with` block whose exclusive time counts to `part`, shown on `track` in a trace."""
        if not self.active:
            return _NULL
        me = threading.get_ident()
        if me in self._side:  # its own stack; its time is charged where it overlaps the step thread's
            stack = self._open.setdefault(me, [])
            return _Span(self, part, track, name or part, stack, stack[-1] if stack else None, "side")
        if me == self._owner:
            stack = self._open[me]
            return _Span(self, part, track, name or part, stack, stack[-1] if stack else None)
        stack = self._open.get(me)
        if not stack and not _in_backward():
            return _NULL
        if stack is None:
            stack = self._open[me] = []
        # Autograd's thread: nested in its own open span, or else in the one the step thread waits in.
        owner = self._open[self._owner]
        return _Span(self, part, track, name or part, stack, stack[-1] if stack else owner[-1] if owner else None)

    @contextlib.contextmanager
    def side_lane(self) -> Iterator[None]:
        """The calling thread runs the side lane's half of a pair (comm/lanes.py) until the block ends:
        its spans are recorded, each on its own stack (module docstring)."""
        me = threading.get_ident()
        self._side.add(me)
        try:
            yield
        finally:
            self._side.discard(me)

    def lane_wait(self, name: str) -> _Span | _Null:
        """The step thread waiting for the side lane's half of a pair to end (charged as the side
        lane spends that time)."""
        span = self.span("compute", "compute", name)
        if isinstance(span, _Span):
            span.lane = "wait"
        return span

    def blocked(self, axis: str, name: str) -> _Span | _Null:
        """A `with` block in which this thread waits for a collective of `axis`: exposed time."""
        return self.span(f"exposed_{axis}", axis, name) if self.active else _NULL

    def flight(self, axis: str, name: str) -> Flight | None:
        """Trace an asynchronous operation of `axis` from now to its `done()`; None when not tracing."""
        if self.events is None or not self.active:
            return None
        return Flight(self.events, axis, name)


def _overlap(a: tuple[float, float], intervals: list[tuple[float, float]]) -> float:
    """Seconds of `a` inside `intervals` (disjoint)."""
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in intervals)


def _overlapped(spans: list[_Span], at: dict[int, tuple[float, float]], parts: dict[str, float]) -> None:
    """Charge the time two lanes overlap as the rank spent it (module docstring): a step-thread wait
    while the side lane computes moves to compute; the step thread's wait for the side lane goes to
    what the side lane did meanwhile. Nothing to do without a side lane's spans."""
    side = [s for s in spans if s.lane == "side"]
    if not side:
        return
    waits = [s for s in side if s.part.startswith("exposed_")]
    computing: list[tuple[float, float]] = []  # the side lane's compute spans less the waits inside them
    for c in (s for s in side if s.part == "compute"):
        start, end = at[id(c)]
        for w in sorted((w for w in waits if at[id(w)][0] >= start and at[id(w)][1] <= end), key=lambda w: at[id(w)]):
            computing.append((start, at[id(w)][0]))
            start = at[id(w)][1]
        computing.append((start, end))
    for s in spans:
        if s.lane == "main" and s.part.startswith("exposed_"):
            hidden = _overlap(at[id(s)], computing)
            parts[s.part] -= hidden
            parts["compute"] += hidden
        elif s.lane == "wait":
            for w in waits:
                seconds = _overlap(at[id(s)], [at[id(w)]])
                parts["compute"] -= seconds
                parts[w.part] += seconds
