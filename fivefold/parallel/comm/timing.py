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

Marks of a clock, read at the end of the step: wall clock (perf_counter) on a CPU, where the work
runs on the thread that issues it; CUDA events on a GPU, where the thread only launches kernels and
the events time the stream (one synchronisation per step, in end_step).

With tracing on (a bounded window of steps), every span is also kept as an event, and
asynchronous collectives as "in flight" spans from launch to completion: the work's future
reports completion on CPU (gloo's collectives complete it from the backend's thread); gloo's
point-to-point works have no future, so theirs end when they are waited on (an upper bound).
"""

from __future__ import annotations

import threading
import time
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


class WallClock:
    """perf_counter on the calling thread: exact on a CPU, where the work runs on the thread that
    issues it."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, marks: list[Any]) -> list[float]:
        """Each mark's time in seconds after the first."""
        return [m - marks[0] for m in marks]


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


class _Span:
    """A measured `with` block: its time minus that of the spans inside it goes to `part`."""

    def __init__(self, timer: StepTimer, part: str, track: str, name: str):
        self.timer, self.part, self.track, self.name = timer, part, track, name

    def __enter__(self) -> None:
        timer = self.timer
        self.parent = timer._open[-1] if timer._open else None
        self.start = len(timer._marks)
        timer._marks.append(timer.clock.mark())
        timer._open.append(self)

    def __exit__(self, *exc: Any) -> None:
        timer = self.timer
        self.end = len(timer._marks)
        timer._marks.append(timer.clock.mark())
        timer._open.pop()
        timer._spans.append(self)


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
    span is a no-op, and so is a span opened on another thread: the parts are the step thread's time.
    """

    def __init__(self, clock: WallClock | CudaClock | None = None) -> None:
        self.clock = clock or WallClock()
        self.active = False
        self.events: list[tuple[str, str, float, float]] | None = None  # (track, name, start, end) when tracing
        self._marks: list[Any] = []
        self._spans: list[_Span] = []
        self._open: list[_Span] = []
        self._began = 0.0
        self._owner = 0

    def begin_step(self, trace: bool = False) -> float:
        """Start measuring a step (and keep its events when `trace`); returns its start (perf_counter)."""
        self.events = [] if trace else None
        self._spans, self._open = [], []
        self._owner = threading.get_ident()
        self.active = True
        self._began = time.perf_counter()
        self._marks = [self.clock.mark()]
        return self._began

    def end_step(self) -> tuple[float, dict[str, float]]:
        """Stop measuring: (the step's seconds, {part: exclusive seconds} with unattributed)."""
        self._marks.append(self.clock.mark())
        self.active = False
        at = self.clock.seconds(self._marks)  # each mark's seconds after the step's start
        took = {id(s): at[s.end] - at[s.start] for s in self._spans}
        inner = dict.fromkeys(took, 0.0)  # seconds of the spans opened directly inside each span
        for s in self._spans:
            if s.parent is not None:
                inner[id(s.parent)] += took[id(s)]
        parts = dict.fromkeys(PARTS, 0.0)
        for s in self._spans:
            parts[s.part] += took[id(s)] - inner[id(s)]  # a label missing from AXES fails here, loudly
            if self.events is not None:
                self.events.append((s.track, s.name, self._began + at[s.start], self._began + at[s.end]))
        wall = at[-1]
        parts[UNATTRIBUTED] = wall - sum(parts.values())
        return wall, parts

    def span(self, part: str, track: str = "compute", name: str | None = None) -> _Span | _Null:
        """A `with` block whose exclusive time counts to `part`, shown on `track` in a trace."""
        if not self.active or threading.get_ident() != self._owner:
            return _NULL
        return _Span(self, part, track, name or part)

    def blocked(self, axis: str, name: str) -> _Span | _Null:
        """A `with` block in which this thread waits for a collective of `axis`: exposed time."""
        return self.span(f"exposed_{axis}", axis, name) if self.active else _NULL

    def flight(self, axis: str, name: str) -> Flight | None:
        """Trace an asynchronous operation of `axis` from now to its `done()`; None when not tracing."""
        if self.events is None or not self.active:
            return None
        return Flight(self.events, axis, name)
