"""Which layout ran from which step to which: the run report's layout timeline.

Every start and resume writes a `layout` event at the step it begins from (train/step_log.py); an
elastic job's re-plan adds a `replan` event beside it with the planner's predicted step time
(fivefold/launch/elastic.py). A layout holds from the step after its event to the step before the next
layout event. Events are read in the order written: two at the same step (a round that failed
before its first step, then the next one) leave the later one, and a resume into the same layout
continues the segment. Each segment's step time is the median of its steps' `step_time_s` (the
median: the first step of a new layout warms up).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Segment:
    first: int  # first step trained under this layout (steps are 1-based)
    last: int
    layout: str  # "dp2 tp2", the degrees above 1 (dp always)
    world_size: int
    step_time_s: float | None  # median measured
    predicted_s: float | None  # the planner's, when the log has one


def layout_label(event: dict[str, Any]) -> str:
    """A `layout` event's degrees as "dp2 tp2 pp2" (dp = dp_replicate x dp_shard)."""
    dp = event.get("dp_replicate", 1) * event.get("dp_shard", 1)
    return " ".join([f"dp{dp}"] + [f"{a}{event[a]}" for a in ("tp", "pp", "cp", "ep") if event.get(a, 1) > 1])


def layout_segments(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[Segment]:
    """The run's layouts in step order, from its step records and events (train/metrics.py)."""
    starts: dict[int, dict[str, Any]] = {}
    predicted: dict[int, float | None] = {}
    for e in events:
        if e["event"] == "layout":
            starts[e["step"]] = e  # a later event at the same step wins
        elif e["event"] == "replan":
            predicted[e["step"]] = (e.get("predicted_step_time_s") or {}).get("to")
    if not records or not starts:
        return []
    order = sorted(starts)
    segments: list[Segment] = []
    for k, begin in enumerate(order):
        end = order[k + 1] if k + 1 < len(order) else records[-1]["step"]
        steps = [r for r in records if begin < r["step"] <= end]
        if not steps:
            continue
        label, world = layout_label(starts[begin]), starts[begin]["world_size"]
        times = [r["step_time_s"] for r in steps if "step_time_s" in r]
        planned = predicted.get(begin)
        if planned is None:  # the step records carry the prediction of their own layout (run.hardware)
            planned = next((r["predicted"].get("step_time_s") for r in steps if r.get("predicted")), None)
        if segments and (segments[-1].layout, segments[-1].world_size) == (label, world):
            previous = segments.pop()  # a resume into the same layout: one segment
            steps_before = [r["step_time_s"] for r in records
                            if previous.first <= r["step"] <= previous.last and "step_time_s" in r]
            times, begin, planned = steps_before + times, previous.first - 1, previous.predicted_s
        segments.append(Segment(begin + 1, steps[-1]["step"], label, world,
                                statistics.median(times) if times else None, planned))
    return segments
