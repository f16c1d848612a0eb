"""Traces of training steps in the Chrome trace event format (Perfetto, chrome://tracing open them).

`fivefold train --trace` makes each rank write `RUN_DIR/trace/rank<R>.json` for a few steps
(`run.trace_steps`): one process per rank (pid = global rank), one thread per track:

- step: one span per traced step;
- compute: the pipeline actions ("F3s1": forward of micro-batch 3 on stage 1, B, I, W), with the
  recomputed forwards inside backward, data loading and the optimizer step; a span is the whole
  action, and the communication tracks show where inside it the thread was blocked;
- dp, tp, pp, cp, ep, log: the time the training thread is blocked on that axis (a synchronous
  collective, an async launch or wait, a pipeline receive: the bubble);
- "<axis> in flight": asynchronous operations from launch to completion, one lane per operation
  in flight at once. Completion comes from the work's future (gloo completes it from its own
  thread); gloo's point-to-point works have none, so theirs end when waited on (an upper bound).

Timestamps are microseconds of the wall clock (perf_counter shifted to time.time() once per
rank), so the ranks of one host line up exactly and those of several hosts as well as their
clocks agree. `fivefold viz trace RUN_DIR` merges the ranks into one file (`RUN_DIR/trace.json`).
The format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

TRACKS = ("step", "compute", "dp", "tp", "pp", "cp", "ep", "log")
FLIGHT = " in flight"
META = {"process_name": "name", "process_sort_index": "sort_index", "thread_name": "name",
        "thread_sort_index": "sort_index"}  # metadata event -> the key its args must hold


def _tid(track: str, lane: int = 0) -> int:
    """Fixed tracks at multiples of 100; an axis's in-flight lanes right after it (its tid + 1 + lane)."""
    axis = track.removesuffix(FLIGHT)
    base = 100 * TRACKS.index(axis) if axis in TRACKS else 100 * len(TRACKS)
    return base + (1 + lane if track.endswith(FLIGHT) else 0)


class RankTrace:
    """This rank's events over a window of steps [first, last] (1-based), then one JSON file."""

    def __init__(self, rank: int, first: int, last: int):
        self.rank, self.first, self.last = rank, first, last
        self.offset = time.time() - time.perf_counter()  # perf_counter -> seconds since the epoch
        self.spans: list[tuple[str, str, float, float]] = []

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    def add(self, step: int, began: float, wall: float, events: list[tuple[str, str, float, float]]) -> None:
        """One traced step: its span and the (track, name, start, end) events the timer kept."""
        self.spans.append(("step", f"step {step}", began, began + wall))
        self.spans += events

    def chrome(self) -> dict[str, Any]:
        """The Chrome trace object: metadata events naming the process and its threads, then spans."""
        lanes: dict[str, list[float]] = {}  # in-flight track -> the end of each lane's last span
        out, used = [], {}
        for track, name, start, end in sorted(self.spans, key=lambda s: s[2]):
            lane = 0
            if track.endswith(FLIGHT):  # overlapping operations of one axis go to separate lanes
                ends = lanes.setdefault(track, [])
                lane = next((i for i, e in enumerate(ends) if e <= start), len(ends))
                ends[lane:lane + 1] = [end]
            tid = _tid(track, lane)
            used[tid] = track if lane == 0 else f"{track} {lane + 1}"
            out.append({"name": name, "cat": track.removesuffix(FLIGHT), "ph": "X", "pid": self.rank, "tid": tid,
                        "ts": round((start + self.offset) * 1e6, 3), "dur": round((end - start) * 1e6, 3)})

        def metadata(name: str, tid: int, value: Any) -> dict[str, Any]:
            return {"name": name, "ph": "M", "pid": self.rank, "tid": tid, "args": {META[name]: value}}

        meta = [metadata("process_name", 0, f"rank {self.rank}"), metadata("process_sort_index", 0, self.rank)]
        for tid, track in sorted(used.items()):
            meta += [metadata("thread_name", tid, track), metadata("thread_sort_index", tid, tid)]
        return {"traceEvents": meta + out, "displayTimeUnit": "ms",
                "otherData": {"rank": self.rank, "steps": [self.first, self.last]}}

    def write(self, run_dir: Path) -> Path:
        path = run_dir / "trace" / f"rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.chrome(), separators=(",", ":")))
        return path


def check_trace(trace: Any) -> list[str]:
    """What in `trace` breaks the Chrome trace format as fivefold writes it (empty: valid)."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["not an object with a traceEvents list"]
    errors = []
    for i, ev in enumerate(trace["traceEvents"]):
        if not isinstance(ev, dict):
            errors.append(f"event {i}: not an object")
            continue
        ph = ev.get("ph")
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in ev]
        if ph == "X":
            missing += [k for k in ("ts", "dur") if k not in ev]
        if missing:
            errors.append(f"event {i}: missing {', '.join(missing)}")
        elif not isinstance(ev["pid"], int) or not isinstance(ev["tid"], int):
            errors.append(f"event {i}: pid and tid must be integers")
        elif ph == "X" and not (isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float))
                                and ev["dur"] >= 0):
            errors.append(f"event {i}: ts and dur must be numbers, dur >= 0")
        elif ph == "M" and not (ev["name"] in META and META[ev["name"]] in ev.get("args", {})):
            errors.append(f"event {i}: metadata {ev['name']!r} needs args.{META.get(ev['name'], 'name')}")
        elif ph not in ("X", "M"):
            errors.append(f"event {i}: phase {ph!r} (fivefold writes X and M)")
    return errors


def merge_traces(run_dir: Path, out: Path | None = None) -> Path:
    """Every rank's trace of the run in one file (each rank stays its own process)."""
    paths = sorted((run_dir / "trace").glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    if not paths:
        raise FileNotFoundError(f"no {run_dir}/trace/rank*.json: train with --trace (fivefold train ... --trace)")
    events = []
    for path in paths:
        trace = json.loads(path.read_text())
        errors = check_trace(trace)
        if errors:
            raise ValueError(f"{path} is not a valid trace: {errors[0]} ({len(errors)} problems)")
        events += trace["traceEvents"]
    out = out or run_dir / "trace.json"
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}, separators=(",", ":")))
    return out


def add_trace_parser(viz: argparse._SubParsersAction) -> None:
    p = viz.add_parser("trace", help="merge a run's per-rank traces into one file",
                       description="Merge RUN_DIR/trace/rank*.json (written by fivefold train --trace) into one "
                                   "Chrome trace file for Perfetto (ui.perfetto.dev) or chrome://tracing.")
    p.add_argument("run_dir", help="the run directory (runs/<name>/)")
    p.add_argument("--out", default=None, help="the file to write (default: RUN_DIR/trace.json)")
    p.set_defaults(run=run_trace_viz)


def run_trace_viz(args: argparse.Namespace) -> int:
    try:
        out = merge_traces(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as e:
        print(f"fivefold viz trace: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e3:,.0f} kB); open it in https://ui.perfetto.dev or chrome://tracing")
    return 0
