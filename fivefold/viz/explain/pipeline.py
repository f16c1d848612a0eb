"""Pipeline schedules and their bubble: every (schedule, p, m, v) built and timed by simulate().

The same `build_schedule` the executor runs and the same `simulate` the planner uses, with
forward 1 and backward 2 for a rank's whole share of layers (each of v chunks costs 1/v of it, as
in `fivefold viz schedule`). A combination `build_schedule` refuses shows its error message.
"""

from __future__ import annotations

from typing import Any

from fivefold.parallel.pipeline.schedules import SCHEDULES, build_schedule
from fivefold.parallel.pipeline.simulate import Costs, simulate
from fivefold.viz.explain.page import Control, Page
from fivefold.viz.schedule import per_chunk_costs

PP = (2, 4, 8)
MICROBATCHES = (1, 2, 4, 8, 16)
VIRTUAL = (1, 2, 3, 4)
COSTS = Costs(f=1.0, b=2.0)


def entry(schedule: str, p: int, m: int, v: int) -> dict[str, Any]:
    try:
        s = build_schedule(schedule, p, m, v)
        result = simulate(s, per_chunk_costs(COSTS, s.virtual_stages))
    except ValueError as e:  # a combination the schedule does not support: say why, as fivefold does
        return {"error": str(e)}
    # One row per rank: [start, end, kind, micro-batch, chunk on this rank], times rounded for size.
    chunk = (lambda st: 0 if st < p else 1) if s.layout == "v" else (lambda st: st // p)
    timeline = [[[round(a, 6), round(b, 6), act.kind, act.microbatch, chunk(act.stage)] for a, b, act in row]
                for row in result.timeline]
    return {"makespan": result.makespan, "bubble_ratio": result.bubble_ratio,
            "bubble_fraction": result.bubble_fraction, "peak_inflight": result.peak_inflight,
            "busy": result.busy, "idle": result.idle, "v": s.virtual_stages, "timeline": timeline}


def page() -> Page:
    names = tuple(SCHEDULES)
    return Page(
        slug="pipeline_schedules", title="Pipeline schedules and the bubble",
        summary="choose a schedule, p, m and v and watch the bubble, from the pipeline simulator",
        intro=("<p>The layers are cut into stages over p ranks; a step's batch into m micro-batches. Every "
               "micro-batch goes forward through every stage and back. A schedule is the order in which each "
               "rank does that work; the white gaps are the <b>bubble</b>, time a rank waits for a neighbour. "
               "More micro-batches, or v chunks per rank (interleaved), shrink it; zero-bubble schedules split "
               "the backward into input (I) and weight (W) gradients and fill gaps with W.</p>"),
        controls=[Control("schedule", "schedule", names, default="1f1b"),
                  Control("p", "ranks p", PP, kind="slider", default=4),
                  Control("m", "micro-batches m", MICROBATCHES, kind="slider", default=8),
                  Control("v", "chunks per rank v", VIRTUAL, default=1)],
        entry=entry, script="pipeline.js",
        body=('<div class="numbers">'
              '<div class="number key"><span class="label">bubble ratio (idle / compute)</span>'
              '<span class="value" id="bubble-ratio"></span></div>'
              '<div class="number key"><span class="label">bubble fraction (idle / total)</span>'
              '<span class="value" id="bubble-fraction"></span></div>'
              '<div class="number"><span class="label">makespan (forward of one rank\'s layers = 1)</span>'
              '<span class="value" id="makespan"></span></div>'
              '<div class="number"><span class="label">peak activations in flight (max over ranks)</span>'
              '<span class="value" id="peak"></span></div></div>'
              '<svg id="timeline" width="1040" height="200" role="img" aria-label="schedule timeline"></svg>'
              '<div class="legend">'
              '<span data-kind="F"><span class="swatch" style="background:var(--f)"></span>F forward</span>'
              '<span data-kind="B"><span class="swatch" style="background:var(--b)"></span>B backward</span>'
              '<span data-kind="I"><span class="swatch" style="background:var(--i)"></span>I input gradient</span>'
              '<span data-kind="W"><span class="swatch" style="background:var(--w)"></span>W weight gradient</span>'
              '<span>number: micro-batch; lighter: a later chunk on the rank</span></div>'
              '<table class="grid" id="per-rank"></table>'),
        notes=("<p>Built by <code>build_schedule</code> (<code>fivefold/parallel/pipeline/schedules.py</code>), the "
               "action lists the executor runs, and timed by <code>simulate()</code> "
               "(<code>parallel/pipeline/simulate.py</code>) "
               "with forward 1 and backward 2 (I = W = 1) per rank's share of layers, each chunk 1/v of that. "
               "zb_v and dualpipe_v always hold 2 chunks per rank in a V. Peak in flight counts micro-batch "
               "activations of one chunk.</p>"))
