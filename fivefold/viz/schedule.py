"""Draw a simulated pipeline schedule: one row per rank, one box per action.

Used by ``fivefold viz schedule`` (see :func:`add_schedule_parser`). The
picture is drawn from the same :class:`~fivefold.parallel.pipeline.schedules.Schedule`
the executor runs, timed by :func:`~fivefold.parallel.pipeline.simulate.simulate`, so
gaps in the picture are the bubble the run will have under those costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fivefold.parallel.pipeline.schedules import SCHEDULES, Schedule, build_schedule
from fivefold.parallel.pipeline.simulate import Costs, SimResult, simulate

# Colour per action kind; I and W are shades that read as "parts of B".
KIND_COLOURS = {"F": "#4C72B0", "B": "#55A868", "I": "#DD8452", "W": "#8C6BB1", "F&B": "#2A9D8F"}
KIND_LABELS = {"F": "forward", "B": "backward", "I": "backward (input grad)",
               "W": "backward (weight grad)", "F&B": "a forward and a backward overlapped (parallel.ep_overlap)"}


def _lighten(colour: str, amount: float) -> tuple[float, float, float]:
    from matplotlib.colors import to_rgb
    r, g, b = to_rgb(colour)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def _chunk_index(schedule: Schedule, stage: int) -> int:
    """Which of a rank's chunks a stage is (0 for the first one it holds)."""
    if schedule.layout == "v":
        return 0 if stage < schedule.pp else 1
    return stage // schedule.pp


def draw_schedule(result: SimResult, schedule: Schedule,
                  path: str | Path) -> tuple[Path, Path]:
    """Save the timeline as ``<path>.png`` and ``<path>.svg``; return both paths.

    A trailing ``.png``/``.svg`` on ``path`` is dropped, anything else is kept
    (so ``out/run.v2`` becomes ``out/run.v2.png``).
    """
    # Figure + explicit canvas instead of pyplot: no global backend switch, so
    # this is safe on headless machines and inside other matplotlib users.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    base = Path(path)
    if base.suffix.lower() in (".png", ".svg"):
        base = base.with_suffix("")
    base.parent.mkdir(parents=True, exist_ok=True)

    p, span = schedule.pp, max(result.makespan, 1e-9)
    # Width grows with the longest action list so boxes stay legible, within limits.
    n_actions = max((len(seq) for seq in schedule.actions), default=1)
    width = min(max(8.0, 2.0 + 0.2 * n_actions), 36.0)
    fig = Figure(figsize=(width, 0.6 * p + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=1.0 / width, right=1 - 0.3 / width)
    points_per_unit = (width - 1.3) * 72 / span  # axes width in points per time unit

    v = schedule.virtual_stages
    for rank, events in enumerate(result.timeline):
        for start, end, act in events:
            shade = 0.45 * _chunk_index(schedule, act.stage) / max(v - 1, 1) if v > 1 else 0.0
            ax.broken_barh([(start, end - start)], (rank - 0.4, 0.8),
                           facecolors=_lighten(KIND_COLOURS[act.kind], shade),
                           edgecolors="white", linewidth=0.5)
            # Micro-batch number only where it fits: unreadable text is worse than none.
            label = str(act.microbatch)
            size = min(9.0, (end - start) * points_per_unit * 0.85 / (0.6 * len(label)))
            if size >= 4:
                ax.text((start + end) / 2, rank, label, ha="center", va="center",
                        fontsize=size, color="white")

    ax.set_ylim(p - 0.5, -0.5)  # rank 0 on top, as in the papers' figures
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_xlim(0, span)
    ax.set_xlabel("time (cost units)")
    ax.set_title(
        f"{schedule.name}  p={p}  m={schedule.microbatches}  v={v}   "
        f"bubble ratio {result.bubble_ratio:.2%} (idle/compute)   "
        f"bubble fraction {result.bubble_fraction:.2%} (idle/total)   "
        f"makespan {result.makespan:g}", fontsize=10)
    kinds = [k for k in "FBIW" if any(a.kind == k for seq in schedule.actions for a in seq)]
    ax.legend(handles=[Patch(color=KIND_COLOURS[k], label=f"{k}: {KIND_LABELS[k]}") for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.2 / p), ncol=len(kinds),
              fontsize=8, frameon=False,
              title="lighter shade = a later chunk on the same rank" if v > 1 else None,
              title_fontsize=8)

    png, svg = Path(f"{base}.png"), Path(f"{base}.svg")
    fig.savefig(png, dpi=110, bbox_inches="tight")
    # Keep SVG text as text (not outlines): searchable, selectable, smaller.
    from matplotlib import rc_context
    with rc_context({"svg.fonttype": "none"}):
        fig.savefig(svg, bbox_inches="tight")
    return png, svg


def per_chunk_costs(costs: Costs, v: int) -> Costs:
    """Costs of one chunk when `costs` are for a rank's whole share of layers cut into v chunks.

    Keeps makespans comparable between 1f1b and interleaved / V schedules: the same work per rank.
    """
    if v == 1:
        return costs
    return Costs(f=costs.f / v, b=costs.b / v, i=None if costs.i is None else costs.i / v,
                 w=None if costs.w is None else costs.w / v, comm=costs.comm)


def _parse_costs(text: str | None) -> Costs:
    """``"f,b"`` or ``"f,b,w"``: b is the whole backward, w its weight-grad part."""
    if not text:
        return Costs()
    try:
        parts = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--costs expects numbers like '1,2' or '1,2,1', got {text!r}") from None
    if len(parts) == 2:
        return Costs(f=parts[0], b=parts[1])
    if len(parts) == 3:
        f, b, w = parts
        if not 0 <= w <= b:
            raise ValueError(f"--costs f,b,w needs 0 <= w <= b (w is part of b), got {text!r}")
        return Costs(f=f, b=b, w=w)
    raise ValueError(f"--costs expects 'f,b' or 'f,b,w', got {text!r}")


def add_schedule_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``schedule`` to the ``fivefold viz`` sub-commands."""
    parser = subparsers.add_parser(
        "schedule", help="simulate a pipeline schedule and draw its timeline",
        description="Build a pipeline schedule, time it with the simulator and write "
                    "a PNG and an SVG of the timeline.")
    parser.add_argument("--schedule", required=True, choices=list(SCHEDULES))
    parser.add_argument("--pp", type=int, required=True, help="pipeline ranks p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches m")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="chunks per rank v (interleaved_1f1b: >= 2; zb_v, dualpipe_v: always 2)")
    parser.add_argument("--costs", default=None, metavar="f,b[,w]",
                        help="time of forward and backward for one rank's whole share of "
                             "layers, optionally the weight-grad part w of b (default 1,2; "
                             "with v chunks per rank each chunk takes 1/v of it)")
    parser.add_argument("--out", default=None,
                        help="output path without suffix (default schedule_<name>_p<p>_m<m>)")
    parser.set_defaults(run=run_schedule_viz)
    return parser


def run_schedule_viz(args: argparse.Namespace) -> int:
    """Build, simulate, draw, print a summary; return a process exit code."""
    try:
        schedule = build_schedule(args.schedule, args.pp, args.microbatches, args.virtual_stages)
        costs = _parse_costs(args.costs)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    v = schedule.virtual_stages
    result = simulate(schedule, per_chunk_costs(costs, v))
    out = args.out or f"schedule_{schedule.name}_p{schedule.pp}_m{schedule.microbatches}"
    png, svg = draw_schedule(result, schedule, out)
    print(f"{schedule.name} p={schedule.pp} m={schedule.microbatches} v={v}: "
          f"bubble ratio {result.bubble_ratio:.2%} (idle/compute), "
          f"bubble fraction {result.bubble_fraction:.2%} (idle/total), "
          f"makespan {result.makespan:g}, peak in-flight per rank {result.peak_inflight}")
    print(f"wrote {png} and {svg}")
    return 0
