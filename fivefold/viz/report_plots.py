"""The run report's figures: matplotlib drawn to SVG, returned as a data: URL for an <img>.

An <img> with a data: URL keeps each figure self-contained (no file beside the page, no fetch)
and keeps the SVGs' internal ids apart, which inline <svg> elements in one page would share.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Sequence

from fivefold.viz.layout_timeline import Segment
from fivefold.viz.schedule import KIND_COLOURS, KIND_LABELS


def byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) that writes `largest` bytes with a few digits before the point."""
    return next(((d, n) for d, n in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")) if largest >= d), (1.0, "bytes"))


def format_bytes(n: float) -> str:
    scale, unit = byte_unit(abs(n))
    return f"{n / scale:.2f} {unit}" if scale > 1 else f"{n:.0f} bytes"
ACTION = re.compile(r"([FBIW])(\d+)s(\d+)$")  # str(parallel.schedules.Action): "F3s1"


def _figure(width: float, height: float):
    # Figure + explicit canvas instead of pyplot: no global backend switch (as viz/schedule.py).
    from matplotlib.backends.backend_svg import FigureCanvasSVG
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height))
    FigureCanvasSVG(fig)
    return fig


def svg_data_url(fig) -> str:
    from matplotlib import rc_context

    buf = io.BytesIO()
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": "fivefold"}):
        fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    return "data:image/svg+xml;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def loss_figure(steps: Sequence[int], loss: Sequence[float], val: Sequence[tuple[int, float]],
                segments: Sequence[Segment] = (), mtp: Sequence[tuple[int, float]] = ()) -> str:
    """The loss over steps (and the MTP depths' mean loss, `mtp`); with `segments`, the layout
    timeline under it on the same step axis."""
    fig = _figure(9, 3.4 + 0.8 * bool(segments))
    grid = fig.add_gridspec(2, 1, height_ratios=(4.2, 1), hspace=0.08) if segments else None
    ax = fig.add_subplot(grid[0] if grid is not None else 111)
    ax.plot(steps, loss, color=KIND_COLOURS["F"], linewidth=1.2, label="training loss (global batch)")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", color=KIND_COLOURS["I"], markersize=5,
                label="validation loss")
    if mtp:
        ax.plot([s for s, _ in mtp], [v for _, v in mtp], color=KIND_COLOURS["W"], linewidth=1.0,
                label="multi-token prediction loss (mean over depths)")
    ax.set_ylabel("mean token loss")
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    if not segments:
        ax.set_xlabel("step")
        return svg_data_url(fig)
    band = fig.add_subplot(grid[1], sharex=ax)
    ax.tick_params(labelbottom=False)
    colours = ("#dbe6f4", "#f4e3d3")
    for k, seg in enumerate(segments):
        band.broken_barh([(seg.first - 0.5, seg.last - seg.first + 1)], (0, 1), facecolors=colours[k % 2],
                         edgecolors="white")
        timing = f", {_seconds(seg.step_time_s)}/step" if seg.step_time_s is not None else ""
        band.text((seg.first + seg.last) / 2, 0.5, f"{seg.layout} ({seg.world_size} ranks){timing}", ha="center",
                  va="center", fontsize=8)
        if k:
            ax.axvline(seg.first - 0.5, color="#888888", linestyle="--", linewidth=0.8)
    band.set_yticks([])
    band.set_ylim(0, 1)
    band.set_xlabel("step (the band: the layout each step ran under, and its median step time)")
    return svg_data_url(fig)


def throughput_figure(steps: Sequence[int], tokens_per_s: Sequence[float]) -> str:
    fig = _figure(9, 3.0)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(steps, tokens_per_s, color=KIND_COLOURS["B"], linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens / s (whole job)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return svg_data_url(fig)


def memory_figure(parts: Sequence[str], measured: Sequence[float], predicted: Sequence[float | None]) -> str:
    fig = _figure(7, 3.0)
    ax = fig.add_subplot(1, 1, 1)
    x = range(len(parts))
    scale, unit = byte_unit(max([*measured, *(p or 0 for p in predicted)]))
    ax.bar([i - 0.2 for i in x], [m / scale for m in measured], width=0.4, color=KIND_COLOURS["F"], label="measured")
    ax.bar([i + 0.2 for i in x], [(p or 0) / scale for p in predicted], width=0.4, color=KIND_COLOURS["W"],
           label="predicted (planner)")
    ax.set_xticks(list(x), parts)
    ax.set_ylabel(f"{unit} on rank 0")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(frameon=False)
    return svg_data_url(fig)


def utilization_figure(steps: Sequence[int], step_times: Sequence[float], predicted_s: float | None,
                       peaks: Sequence[tuple[int, float]], predicted_peak: float | None, peak_label: str) -> str:
    """Step time over steps and peak memory (step, bytes) over logging steps, each with the planner's
    figure as a dashed line (when it has one)."""
    fig = _figure(9, 3.0)
    ax, mem = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    ax.plot(steps, step_times, color=KIND_COLOURS["F"], linewidth=1.2, label="measured (rank 0)")
    if predicted_s is not None:
        ax.axhline(predicted_s, color=KIND_COLOURS["W"], linestyle="--", label="predicted (planner)")
    ax.set_xlabel("step")
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    scale, unit = byte_unit(max([*(p for _, p in peaks), predicted_peak or 0, 1]))
    mem.plot([s for s, _ in peaks], [p / scale for _, p in peaks], "o-", color=KIND_COLOURS["F"], markersize=4,
             label=peak_label)
    if predicted_peak is not None:
        mem.axhline(predicted_peak / scale, color=KIND_COLOURS["W"], linestyle="--", label="predicted peak (planner)")
    mem.set_xlabel("logging step")
    mem.set_ylabel(f"{unit} on rank 0")
    mem.set_ylim(bottom=0)
    for a in (ax, mem):
        a.grid(alpha=0.3)
        a.legend(frameon=False, fontsize=7)
    return svg_data_url(fig)


def breakdown_figure(parts: dict[str, float]) -> str:
    fig = _figure(9, 1.9)
    ax = fig.add_subplot(1, 1, 1)
    left = 0.0
    colours = ["#4C72B0", "#55A868", "#DD8452", "#8C6BB1", "#C44E52", "#937860", "#8c8c8c"]
    for k, (name, seconds) in enumerate(parts.items()):
        ax.barh([0], [seconds * 1e3], left=left, color=colours[k % len(colours)], label=name)
        left += seconds * 1e3
    ax.set_yticks([])
    ax.set_xlabel("ms per step (mean over the steps that logged it)")
    ax.legend(frameon=False, ncol=min(len(parts), 6), loc="upper center", bbox_to_anchor=(0.5, -0.45))
    return svg_data_url(fig)


def comm_figure(steps: Sequence[int], wire: dict[str, Sequence[float]]) -> str:
    fig = _figure(9, 3.0)
    ax = fig.add_subplot(1, 1, 1)
    scale, unit = byte_unit(max((max(v, default=0) for v in wire.values()), default=0))
    for axis, values in wire.items():
        ax.plot(steps, [v / scale for v in values], linewidth=1.2, label=axis)
    ax.set_xlabel("step")
    ax.set_ylabel(f"{unit} sent by rank 0 per step")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False, title="axis")
    return svg_data_url(fig)


def timeline_figure(ranks: Sequence[Sequence[Sequence]]) -> str:
    """The executed pipeline: per rank [start_s, end_s, "F3s1"] as the run measured them."""
    from matplotlib.patches import Patch

    p = len(ranks)
    fig = _figure(10, 0.55 * p + 1.4)
    ax = fig.add_subplot(1, 1, 1)
    t0 = min((ev[0] for row in ranks for ev in row), default=0.0)
    kinds = set()
    for rank, row in enumerate(ranks):
        for start, end, action in row:
            match = ACTION.match(action)
            kind = "F&B" if "&" in action else match.group(1) if match else "F"  # "F3s0&B1s3": DualPipe's pair
            kinds.add(kind)
            ax.broken_barh([((start - t0) * 1e3, (end - start) * 1e3)], (rank - 0.4, 0.8),
                           facecolors=KIND_COLOURS[kind], edgecolors="white", linewidth=0.5)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    ax.set_xlabel("ms from the step's first action")
    handles = [Patch(color=KIND_COLOURS[k], label=f"{k}: {KIND_LABELS[k]}") for k in KIND_COLOURS if k in kinds]
    ax.legend(handles=handles,
              frameon=False, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    return svg_data_url(fig)
