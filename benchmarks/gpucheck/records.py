"""What a stage keeps in its --out folder: one JSONL file per part (a record per check, written and
printed as it is measured), and summary.md, the verdict table over every part's file.

A check's record: {"check", "value", "bound", "pass", "status", "detail"}; status is "pass", "fail"
or "skip" (a skipped check has pass false and says why in detail). A part's file ends with one
{"part", "status", "wall_s"} line once the part has ended; a file without it is a part that was
stopped (the supervisor in gpu_check.py then writes that line, and a failed check for the part).
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

# The parts of each stage, in the order they run (each its own JSONL file: <part>.jsonl).
STAGES = {"correct": ("precision", "moe", "sharding", "attention", "compile", "optimizer"),
          "speed": ("training", "fp8", "loss_chunk", "roofline", "calibrate")}
SUMMARY = "summary.md"
LOG = "stderr.log"

Outcome = tuple[object, str, bool, object]  # (value, bound, passed, detail)


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def at_most(value: float, limit: float, detail: object = None) -> Outcome:
    return value, f"<= {limit:g}", bool(value <= limit), detail


def at_least(value: float, limit: float, detail: object = None) -> Outcome:
    return value, f">= {limit:g}", bool(value >= limit), detail


def within(value: float, low: float, high: float, detail: object = None) -> Outcome:
    return value, f"{low:g} .. {high:g}", bool(low <= value <= high), detail


def recorded(value: object, detail: object = None) -> Outcome:
    """A measurement with no bound: kept for the record, never a failure."""
    return value, "none (recorded)", True, detail


class PartLog:
    """One part's JSONL file under `out`: each record appended, flushed and printed at once, so a part
    stopped midway keeps what it measured. `deadline`: the stage's end (time.time()); a check whose
    `cost_s` would run past it is recorded as skipped."""

    def __init__(self, out: Path, part: str, deadline: float):
        self.part, self.deadline, self.began = part, deadline, time.monotonic()
        self.path = out / f"{part}.jsonl"

    def write(self, record: dict) -> dict:
        line = json.dumps(record, default=str)
        with self.path.open("a") as f:
            f.write(line + "\n")
        print(line, flush=True)
        return record

    def record(self, check: str, outcome: Outcome, **extra) -> dict:
        value, bound, passed, detail = outcome
        return self.write({"check": check, "value": value, "bound": bound, "pass": passed,
                           "status": "pass" if passed else "fail", "detail": detail, **extra})

    def skip(self, check: str, why: str) -> dict:
        return self.write({"check": check, "value": None, "bound": None, "pass": False, "status": "skip",
                           "detail": f"skipped: {why}"})

    def run(self, check: str, measure: Callable[[], Outcome], cost_s: float = 0.0) -> dict:
        """Measure one check unless it would end past the deadline; an exception is its failed record."""
        if time.time() + cost_s > self.deadline:
            return self.skip(check, f"over the stage's budget (needs about {cost_s:g} s)")
        log(f"[{time.monotonic() - self.began:5.0f} s] {self.part}: {check} ...")
        try:
            return self.record(check, measure())
        except Exception as e:  # noqa: BLE001 - the failed check's record, and the next check runs
            log(traceback.format_exc())
            return self.write({"check": check, "value": None, "bound": None, "pass": False, "status": "fail",
                               "detail": f"error: {e!r}"[:600]})

    def end(self, status: str = "ok") -> None:
        self.write({"part": self.part, "status": status, "wall_s": round(time.monotonic() - self.began, 1)})


def read_part(path: Path) -> tuple[list[dict], dict | None]:
    """A part's check records and its end line (None: it never ended)."""
    checks, end = [], None
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if "check" in rec:
            checks.append(rec)
        elif "part" in rec:
            end = rec
    return checks, end


def _cell(x: object) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:.4g}" if math.isfinite(x) else str(x)
    text = x if isinstance(x, str) else json.dumps(x, default=str)
    return text.replace("|", "\\|").replace("\n", " ")[:300]


def write_summary(out: Path, environment: dict | None = None) -> Path:
    """summary.md: a verdict table over every part's file in `out`, both stages' parts in order,
    under the machine's `environment` line."""
    rows, counts = [], {"pass": 0, "fail": 0, "skip": 0}
    for stage, parts in STAGES.items():
        for part in parts:
            path = out / f"{part}.jsonl"
            if not path.exists():
                continue
            checks, end = read_part(path)
            for c in checks:
                counts[c["status"]] += 1
                rows.append(f"| {stage} | {part} | {_cell(c['check'])} | {_cell(c['value'])} | {_cell(c['bound'])} "
                            f"| {c['status'].upper()} | {_cell(c.get('detail'))} |")
            if end is None:
                rows.append(f"| {stage} | {part} | (the part) | | | RUNNING or STOPPED | no end line yet |")
    text = "\n".join([
        "# gpu_check summary", "", *([f"`{json.dumps(environment)}`", ""] if environment else []),
        f"{counts['pass']} pass, {counts['fail']} fail, {counts['skip']} skipped. Each row: a check, its measured "
        "value, the bound it is held to, the verdict. The parts' JSONL files hold each record in full; "
        f"{LOG} holds the tracebacks.", "",
        "| stage | part | check | value | bound | verdict | detail |",
        "| --- | --- | --- | --- | --- | --- | --- |", *rows, ""])
    path = out / SUMMARY
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # whole or not at all: a kill mid-write leaves the previous table
    return path
