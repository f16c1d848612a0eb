"""How `fivefold calibrate` times a primitive: in samples about as long as a training step.

On a machine shared with other processes the scheduler takes a core away every few milliseconds.
A timing of a few milliseconds usually falls between two such preemptions, so the median of short
timings measures an idle machine, while a training step (tens to hundreds of milliseconds) always
pays its share of them: calibrated that way, predictions on this machine with a neighbour's tests
running came out well below the steps they predicted. So each sample repeats the primitive until
it has run for at least SAMPLE_S, and a figure is the median over samples of the time per call:
each sample pays for preemptions as a step does, and the median still resists a burst of load that
spoils one sample.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

SAMPLE_S = 0.05  # seconds: about the shortest training step of the test model on this machine


def calls_per_sample(fn: Callable[[], object], min_s: float = SAMPLE_S) -> int:
    """How many calls of fn (warmed up here) make a sample of at least min_s."""
    fn()
    start = time.perf_counter()
    fn()
    return max(1, math.ceil(min_s / max(time.perf_counter() - start, 1e-7)))


def sample_turns(fns: dict[str, Callable[[], object]], samples: int, min_s: float = SAMPLE_S) -> dict[str, float]:
    """Median seconds per call of each function; the functions take turns, one sample each per turn,
    so that a change of load hits them alike (what host.py's differences need)."""
    calls = {k: calls_per_sample(fn, min_s) for k, fn in fns.items()}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(samples):
        for k, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls[k]):
                fn()
            times[k].append((time.perf_counter() - start) / calls[k])
    return {k: statistics.median(v) for k, v in times.items()}


def sample_time(fn: Callable[[], object], samples: int, min_s: float = SAMPLE_S) -> float:
    """Median seconds per call of fn over `samples` samples of at least min_s each."""
    return sample_turns({"fn": fn}, samples, min_s)["fn"]
