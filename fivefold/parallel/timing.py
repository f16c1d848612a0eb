"""Where a training step's time goes on this rank: one recorder, fed by the code that does the work.

A step is cut into parts by *exclusive* time, as a profiler's "self time": a span's part gets its
wall time minus the spans opened inside it. So the parts of a step never overlap and add up:

- compute: the pipeline executor's F, B, I, W actions (pipeline.py), timed directly around them;
- recompute: the forward that activation checkpointing runs again inside backward (recompute.py);
- exposed_<axis>: the time this thread is blocked in a collective of that axis (comms.py): the
  whole call of a synchronous one; the launch and the `wait()` of an asynchronous one. While an
  asynchronous collective runs and this thread computes, it is hidden and not counted. The tp, cp
  and ep collectives run inside forward and backward: nested in compute, so subtracted from it;
- bubble: a pipeline stage waiting to receive an activation or gradient (nothing else to do);
- optimizer, data: the loop's own spans (train/step.py);
- unattributed: the step's wall time minus all of the above, reported as its own part.

Wall clock (perf_counter) on the calling thread: exact on CPU, where work runs on the thread that
issues it. On a GPU these spans would time kernel launches, not kernels; the breakdown is CPU-only.

With tracing on (a bounded window of steps), every span is also kept as an event, and
asynchronous collectives as "in flight" spans from launch to completion: the work's future
reports completion on CPU (gloo's collectives complete it from the backend's thread); gloo's
point-to-point works have no future, so theirs end when they are waited on (an upper bound).
"""

from __future__ import annotations

import threading
import time
from typing import Any

# Every label comms.py charges traffic to; "log": the metrics' own reductions (loss, expert loads).
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


class _Span:
    """A measured `with` block: its time minus that of the spans inside it goes to `part`."""

    def __init__(self, timer: StepTimer, part: str, track: str, name: str):
        self.timer, self.part, self.track, self.name = timer, part, track, name

    def __enter__(self) -> None:
        self.timer._inner.append(0.0)  # seconds spent in spans opened inside this one
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        end = time.perf_counter()
        timer, took = self.timer, end - self.start
        timer.parts[self.part] += took - timer._inner.pop()  # a label missing from AXES fails here, loudly
        if timer._inner:
            timer._inner[-1] += took
        if timer.events is not None:
            timer.events.append((self.track, self.name, self.start, end))


class Flight:
    """An asynchronous operation being traced: launched now, `done()` when it completes."""

    def __init__(self, events: list, track: str, name: str):
        self.events, self.track, self.name = events, track, name
        self.start = time.perf_counter()

    def done(self, *_: Any) -> None:
        self.events.append((f"{self.track} in flight", self.name, self.start, time.perf_counter()))


class StepTimer:
    """This rank's step-time recorder. The Mesh owns one and every AxisGroup carries it, so the code
    that does the work (collectives, pipeline actions, recomputation) reports to its own mesh's timer.

    Outside a step (evaluation, checkpoints, tests that run the parallel code alone) every span
    is a no-op, and so is a span opened on another thread: the parts are the step thread's time.
    """

    def __init__(self) -> None:
        self.active = False
        self.parts: dict[str, float] = {}
        self.events: list[tuple[str, str, float, float]] | None = None  # (track, name, start, end) when tracing
        self._inner: list[float] = []
        self._began = 0.0
        self._owner = 0

    def begin_step(self, trace: bool = False) -> float:
        """Start measuring a step (and keep its events when `trace`); returns its start time."""
        self.parts = dict.fromkeys(PARTS, 0.0)
        self.events = [] if trace else None
        self._inner = []
        self._owner = threading.get_ident()
        self.active = True
        self._began = time.perf_counter()
        return self._began

    def end_step(self) -> tuple[float, dict[str, float]]:
        """Stop measuring: (the step's wall seconds, {part: exclusive seconds} with unattributed)."""
        wall = time.perf_counter() - self._began
        self.active = False
        parts = dict(self.parts)
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
