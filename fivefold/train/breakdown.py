"""The step-time breakdown of a run: every rank's parts gathered, logged, printed beside the plan.

Each rank measures its own step (`parallel/comm/timing.py`) and adds it to its window of the steps since
the last logging step. On a logging step (`train.log_every`), outside the step's timed window, one
all-gather brings every rank's parts of that step and of the window to every rank: the table
prints the window's mean step, the metrics log that step's parts. Gathering only then keeps a
world-wide collective out of every other step. The metrics log keeps, per part, the mean
over ranks (`step_breakdown`: the parts add up to the ranks' mean step time) and the max over
ranks (`step_breakdown_max`: the slowest rank for that part; these do not add up). A pipeline's
stages differ (the last computes the head and loss, the first waits longest for gradients), so
both are worth reading.
"""

from __future__ import annotations

import torch
from rich.table import Table

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.comm.timing import PARTS, UNATTRIBUTED

COLUMNS = (*PARTS, UNATTRIBUTED, "step")  # one row per rank in the gathered matrix
ALWAYS = ("compute", UNATTRIBUTED)  # logged even when zero; other parts only when some rank has time there

# The printed table's rows: the planner's time_split (planner/estimate.py) where a part matches it.
# (label, measured parts, the prediction's keys (summed; none: no prediction), a note where the two
# count differently). The planner's "host" is the Python around the model's ops: measured inside
# the actions, so it is set beside compute.
ROWS = (
    ("compute", ("compute", "recompute"), ("compute", "host", "contention"),
     "planned: + host (Python overhead) + contention (SMs the hidden collectives take)"),
    ("exposed tp/cp/ep", ("exposed_tp", "exposed_cp", "exposed_ep"), ("tp_cp_ep",), ""),
    ("bubble", ("bubble",), ("bubble",), ""),
    ("exposed dp", ("exposed_dp",), ("dp_exposed",), ""),
    ("exposed pp", ("exposed_pp",), (), ""),
    ("optimizer", ("optimizer",), ("optimizer",), "measured: unscale + clip + step"),
    ("metrics sync", ("exposed_log",), ("step_sync",), "planned: + gradient-norm reductions"),
    ("data", ("data",), (), ""),
    (UNATTRIBUTED, (UNATTRIBUTED,), (), ""),
    ("step", ("step",), ("step_time_s",), ""),
)


def log_entries(matrix: torch.Tensor) -> dict[str, dict[str, float]]:
    """`step_breakdown` (mean over ranks) and `step_breakdown_max` for the metrics log, from one
    step's (world size, len(COLUMNS)) seconds."""
    mean, most = matrix.mean(0), matrix.max(0).values
    keep = [i for i, k in enumerate(COLUMNS[:-1]) if k in ALWAYS or bool((matrix[:, i] != 0).any())]
    return {"step_breakdown": {COLUMNS[i]: round(float(mean[i]), 7) for i in keep},
            "step_breakdown_max": {COLUMNS[i]: round(float(most[i]), 7) for i in keep}}


class BreakdownWindow:
    """This rank's parts summed over the steps since the last gather, plus the latest step's."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.steps = 0
        self.first = 0

    def add(self, step: int, wall: float, parts: dict[str, float]) -> None:
        self.last = torch.tensor([parts[k] for k in COLUMNS[:-1]] + [wall], dtype=torch.float64)
        if self.total is None:
            self.total, self.first = torch.zeros_like(self.last), step
        self.total += self.last
        self.steps += 1

    def gather(self, world: AxisGroup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Collective over the world: every rank's latest step and mean step of the window, each
        (world size, len(COLUMNS)) seconds, rows by rank, and the window's first step. The window
        starts again."""
        mine = torch.stack([self.last, self.total / self.steps]).to(device)  # (2, columns)
        every = mine.new_empty(world.size * mine.numel())
        collectives.all_gather(every, mine.reshape(-1), world)
        every = every.view(world.size, 2, -1).cpu()
        first, self.total, self.steps = self.first, None, 0
        return every[:, 0], every[:, 1], first


def breakdown_table(per_rank: torch.Tensor, first: int, last: int, predicted: dict | None) -> Table:
    """The mean step of steps first..last (per_rank: (world size, len(COLUMNS)) seconds) as a table,
    beside the planner's time_split when it has one."""
    steps = f"step {last}" if first == last else f"steps {first}-{last}"
    split = (predicted or {}).get("time_split")
    planned = {**split, "step_time_s": predicted["step_time_s"]} if split else {}
    table = Table(title=f"step time, {steps} (over ranks)", title_justify="left", box=None, padding=(0, 1),
                  show_edge=False)
    for header in ("part", "mean ms", "max ms", "% step"):
        table.add_column(header, justify="left" if header == "part" else "right")
    if split:
        table.add_column("predicted ms", justify="right")
    table.add_column("detail")
    step_ms = float(per_rank[:, -1].mean()) * 1e3
    for label, parts, keys, note in ROWS:
        cols = [COLUMNS.index(p) for p in parts]
        values = per_rank[:, cols]  # (world, parts)
        total = values.sum(1)
        known = [planned[k] for k in keys if k in planned]
        pred = sum(known) if known else None
        if not bool((total != 0).any()) and not pred:
            continue
        spent = [j for j in range(len(parts)) if bool((values[:, j] != 0).any())]
        detail = ", ".join(f"{parts[j].removeprefix('exposed_')} {float(values[:, j].mean()) * 1e3:.2f}"
                           for j in spent) if len(spent) > 1 else ""
        row = [label, f"{float(total.mean()) * 1e3:.2f}", f"{float(total.max()) * 1e3:.2f}",
               f"{float(total.mean()) * 1e3 / step_ms:.1%}" if step_ms else "-"]
        if split:
            row.append(f"{pred * 1e3:.2f}" if pred is not None else "-")
        counted_as_noted = bool(keys) and len(known) == len(keys)
        table.add_row(*row, "; ".join(d for d in (detail, note if counted_as_noted else "") if d))
    return table


def pipeline_timeline(timeline: list[tuple[float, float, str]], pp: AxisGroup) -> list[list[list]] | None:
    """The executed actions of every stage of this rank's pipeline, `[start_s, end_s, "F3s1"]` per
    action, in seconds from the earliest action of the step (perf_counter is one clock for every
    process of a host; across hosts the stages' clocks are not aligned). None on ranks but pp's 0."""
    rows = collectives.all_gather_object(timeline, pp, "gather of the pipeline timeline")
    if pp.rank != 0:
        return None
    t0 = min((start for row in rows for start, _, _ in row), default=0.0)
    return [[[round(start - t0, 7), round(end - t0, 7), name] for start, end, name in row] for row in rows]
