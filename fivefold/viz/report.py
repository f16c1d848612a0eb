"""`fivefold report RUN_DIR`: one self-contained HTML file about a training run.

It reads what the run wrote (metrics.jsonl, config.toml, summary.json; keys in train/metrics.py)
and draws: loss and validation loss with the layout timeline under it (which layout ran from which
step to which, with its step time: an elastic job's re-plans show there), tokens/s, model-state
memory measured on rank 0 beside the planner's prediction (`predicted`), communication bytes per
parallel axis, and, when the metrics log holds them, the step-time breakdown and the pipeline
schedule as executed, and the logging steps' TFLOP/s, MFU, step time and peak memory beside the
planner's. A section whose
data the log lacks says so instead of drawing. Figures are SVG in data: URLs: the file opens
from disk with no server and fetches nothing.

Two keys are read when present (written by the training loop once it measures them):
- `step_breakdown`: {part: seconds} of the step, e.g. compute, bubble, dp exposed, optimizer;
- `pipeline_timeline`: one list per pipeline rank of [start_s, end_s, action] actions, action
  as `str(Action)` ("F3s1": forward of micro-batch 3 on stage 1).
"""

from __future__ import annotations

import dataclasses
import html
import json
import statistics
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fivefold.config.load import RUN_CONFIG, read_config
from fivefold.train.metrics import read_events, read_metrics
from fivefold.viz import report_plots as plots
from fivefold.viz.layout_timeline import layout_segments

BREAKDOWN_KEY = "step_breakdown"
TIMELINE_KEY = "pipeline_timeline"
UTILIZATION_KEY = "utilization"
STATE_PARTS = ("params", "grads", "optimizer", "total")
AXES = ("dp", "tp", "pp", "cp", "ep")
CSS = Path(__file__).parent / "explain" / "static" / "explain.css"


def _num(value: float, text: str, ident: str = "") -> str:
    """A number for the page: readable text, the exact value in data-value (the tests read it)."""
    attr = f' id="{ident}"' if ident else ""
    return f'<span class="value"{attr} data-value="{value!r}">{html.escape(text)}</span>'


def _absent(what: str) -> str:
    return f'<p class="absent">Not in this run\'s metrics log: {html.escape(what)}.</p>'


def _figure(url: str, alt: str) -> str:
    return f'<img class="figure" src="{url}" alt="{html.escape(alt)}">'


def overview(records: list[dict[str, Any]], config: dict[str, Any]) -> str:
    model, par = config.get("model", {}), config.get("parallel", {})
    last = records[-1]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    rates = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]  # step 1 warms up
    items = [("steps logged", _num(len(records), f"{len(records):,}", "steps")),
             ("last loss", _num(last["loss"], f"{last['loss']:.4f}", "last-loss")),
             ("last validation loss", _num(vals[-1], f"{vals[-1]:.4f}", "last-val") if vals else "-"),
             ("median tokens/s (after step 1)", _num(statistics.median(rates), f"{statistics.median(rates):,.0f}",
                                                      "median-tps")),
             ("tokens trained", _num(sum(r["tokens"] for r in records), f"{sum(r['tokens'] for r in records):,}",
                                     "tokens"))]
    layout = ", ".join(f"{k}={par[k]}" for k in ("dp", "tp", "pp", "cp", "ep", "zero") if k in par)
    if par.get("pp", 1) > 1:
        layout += f", schedule {par.get('pp_schedule')} (v={par.get('virtual_stages')})"
    shape = ", ".join(f"{k}={model[k]}" for k in ("dim", "n_layers", "n_heads") if k in model)
    if model.get("moe", {}).get("n_experts"):
        shape += f", n_experts={model['moe']['n_experts']}"
    cells = "".join(f'<div class="number"><span class="label">{html.escape(k)}</span>{v}</div>' for k, v in items)
    return (f'<div class="numbers">{cells}</div><p>Model: {html.escape(str(model.get("preset") or "custom"))} '
            f"({html.escape(shape)}). Layout: {html.escape(layout)} (dp=0: all remaining ranks).</p>")


def loss_section(records: list[dict[str, Any]], events: list[dict[str, Any]]) -> str:
    """The loss curve with the layout timeline under it, and the timeline as a table."""
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    mtp = [(r["step"], r["mtp_loss"]) for r in records if "mtp_loss" in r]  # model.mtp_layers > 0
    segments = layout_segments(records, events)
    figure = _figure(plots.loss_figure([r["step"] for r in records], [r["loss"] for r in records], val, segments,
                                       mtp), "training and validation loss over steps, and the layout of each step")
    if not segments:
        return figure + _absent("layout events (which layout ran at which step)")

    def seconds(value: float | None, ident: str) -> str:
        return _num(value, f"{value:.4g} s", ident) if value is not None else "-"

    rows = "".join(f"<tr><td>{s.first}-{s.last}</td><td>{html.escape(s.layout)}</td><td>{s.world_size}</td>"
                   f"<td>{seconds(s.step_time_s, f'layout-{k}-step-time')}</td>"
                   f"<td>{seconds(s.predicted_s, f'layout-{k}-predicted')}</td></tr>" for k, s in enumerate(segments))
    return (figure + '<table class="grid"><tr><th>steps</th><th>layout</th><th>ranks</th><th>step time (median)'
            f"</th><th>predicted</th></tr>{rows}</table>")


def throughput_section(records: list[dict[str, Any]]) -> str:
    return _figure(plots.throughput_figure([r["step"] for r in records], [r["tokens_per_s"] for r in records]),
                   "tokens per second over steps")


def memory_section(records: list[dict[str, Any]]) -> str:
    measured = [r for r in records if "model_state_bytes" in r]
    if not measured:
        return _absent("model_state_bytes (model-state memory measured on rank 0)")
    # The step whose sample was largest: optimizer state appears only after the first step.
    peak = max(measured, key=lambda r: r["model_state_bytes"]["total"])["model_state_bytes"]
    predicted = next((r["predicted"] for r in reversed(records) if r.get("predicted")), None)
    pred_state = predicted["model_state_bytes"] if predicted else {}
    rows = []
    for part in STATE_PARTS:
        p = pred_state.get(part)
        ratio = f"{peak[part] / p:.3f}" if p else "-"
        pred_cell = _num(p, plots.format_bytes(p), f"pred-{part}") if p is not None else "-"
        rows.append(f"<tr><th>{part}</th><td>{_num(peak[part], plots.format_bytes(peak[part]), f'mem-{part}')}"
                    f"</td><td>{pred_cell}</td><td>{ratio}</td></tr>")
    extra = ""
    if predicted:
        extra = (f"<p>Predicted but not measured by the log: activations "
                 f"{plots.format_bytes(predicted['activation_bytes'])}, communication buffers "
                 f"{plots.format_bytes(predicted['buffer_bytes'])}.</p>")
    note = "" if predicted else _absent("predicted (the planner's prediction for this layout)")
    figure = _figure(plots.memory_figure(STATE_PARTS, [peak[p] for p in STATE_PARTS],
                                         [pred_state.get(p) for p in STATE_PARTS]), "memory measured vs predicted")
    return (f"<p>Rank 0 only: the metrics log samples rank 0's model state after each micro-batch's backward; "
            f"the largest sample of the run is shown.</p>{figure}<table class=\"grid\"><tr><th></th><th>measured"
            f"</th><th>predicted</th><th>measured / predicted</th></tr>{''.join(rows)}</table>{extra}{note}")


def _median_of(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def utilization_section(records: list[dict[str, Any]]) -> str:
    """Achieved TFLOP/s, MFU and HFU of the logging steps, and their step time and peak memory
    beside the planner's (`utilization`, `memory`, `predicted`: train/metrics.py)."""
    logged = [r for r in records if UTILIZATION_KEY in r]
    if not logged:
        return _absent(f"{UTILIZATION_KEY} and memory (what the device achieved on logging steps)")
    predicted = next((r["predicted"] for r in reversed(records) if r.get("predicted")), None) or {}
    steady = [r for r in logged if r["step"] > 1] or logged  # step 1 warms up (as overview's tokens/s)
    util = [r[UTILIZATION_KEY] for r in steady]
    rows = []

    def row(label: str, value: float | None, text: str, ident: str, pred: float | None = None,
            pred_text: str = "") -> None:
        cell = _num(value, text, ident) if value is not None else "-"
        pred_cell = _num(pred, pred_text, f"{ident}-pred") if pred is not None else "-"
        ratio = f"{value / pred:.3f}" if value is not None and pred else "-"
        rows.append(f"<tr><th>{html.escape(label)}</th><td>{cell}</td><td>{pred_cell}</td><td>{ratio}</td></tr>")

    tflops = _median_of([u["achieved_tflops"] for u in util])
    row("achieved TFLOP/s per rank (model FLOPs)", tflops, f"{tflops:.4g}", "util-tflops")
    for key in ("mfu", "hfu"):
        value = _median_of([u.get(key) for u in util])
        row(key.upper(), value, f"{value:.2%}" if value is not None else "", f"util-{key}")
    step = _median_of([r["step_time_s"] for r in steady])
    pred_step = predicted.get("step_time_s")
    row("step time (s)", step, f"{step:.4g} s", "util-step-time", pred_step,
        f"{pred_step:.4g} s" if pred_step is not None else "")
    mem = [r.get("memory", {}) for r in logged]
    name, key = (("peak allocated (CUDA allocator, per window)", "peak_allocated_bytes")
                 if any("peak_allocated_bytes" in m for m in mem)
                 else ("peak RSS (the whole process, over its lifetime)", "peak_rss_bytes"))
    points = [(r["step"], r["memory"][key]) for r in logged if key in r.get("memory", {})]
    peak = max((p for _, p in points), default=None)
    pred_peak = predicted.get("peak_bytes")
    row(name, peak, plots.format_bytes(peak) if peak is not None else "", "util-peak-memory", pred_peak,
        plots.format_bytes(pred_peak) if pred_peak is not None else "")
    retries = (f" Allocation retries (CUDA): {sum(m.get('alloc_retries', 0) for m in mem)}."
               if key == "peak_allocated_bytes" else " On a CPU the peak RSS counts the whole process (Python, torch, "
               "data), so it exceeds the planner's tensors.")
    sources = sorted({u["peak_from"] for u in util if u.get("peak_from")})
    peak_note = (f"MFU and HFU divide by one device's peak ({', '.join(sources)}, train/utilization.py)"
                 if sources else
                 "MFU and HFU left out: no peak (set train.peak_tflops, or run.hardware's calibrated profile)")
    figure = _figure(plots.utilization_figure([r["step"] for r in records], [r["step_time_s"] for r in records],
                                              pred_step, points, pred_peak, name),
                     "step time and peak memory, measured and predicted")
    return (f"{figure}<table class=\"grid\"><tr><th></th><th>measured (median; memory: max)</th>"
            f"<th>predicted</th><th>measured / predicted</th></tr>{''.join(rows)}</table>"
            f"<p>Medians over the logging steps after step 1. {html.escape(peak_note)}. FLOPs as the planner "
            "counts them: causal attention in full, windows and documents as the pairs the mask keeps, recompute "
            f"in HFU only.{html.escape(retries)}</p>")


def breakdown_section(records: list[dict[str, Any]]) -> str:
    logged = [r[BREAKDOWN_KEY] for r in records if r.get(BREAKDOWN_KEY)]
    if not logged:
        return _absent(f"{BREAKDOWN_KEY} (seconds per part of the step)")
    parts = {k: statistics.fmean(b.get(k, 0.0) for b in logged) for k in logged[-1]}
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_num(v, f'{v * 1e3:.2f} ms', f'part-{k}')}</td></tr>"
                   for k, v in parts.items())
    return (_figure(plots.breakdown_figure(parts), "step time breakdown")
            + f'<table class="grid">{rows}</table>')


def schedule_section(records: list[dict[str, Any]]) -> str:
    last = next((r for r in reversed(records) if r.get(TIMELINE_KEY)), None)
    if last is None:
        return _absent(f"{TIMELINE_KEY} (the pipeline actions as executed)")
    return (f"<p>Step {last['step']}, the last step that logged it.</p>"
            + _figure(plots.timeline_figure(last[TIMELINE_KEY]), "executed pipeline schedule"))


def comm_section(records: list[dict[str, Any]]) -> str:
    axes = [a for a in AXES if any(a in r.get("comm", {}) for r in records)]
    if not axes:
        return _absent("comm (bytes per parallel axis)")
    wire = {a: [r.get("comm", {}).get(a, {}).get("wire_bytes", 0.0) for r in records] for a in axes}
    predicted = next((r["predicted"] for r in reversed(records) if r.get("predicted")), None)
    rows = []
    for a in axes:
        calls = statistics.fmean(r.get("comm", {}).get(a, {}).get("calls", 0) for r in records)
        mean = statistics.fmean(wire[a])
        pred = predicted["comm_wire_bytes"].get(a) if predicted else None
        pred_cell = _num(pred, plots.format_bytes(pred), f"pred-comm-{a}") if pred is not None else "-"
        rows.append(f"<tr><th>{a}</th><td>{calls:.1f}</td><td>{_num(mean, plots.format_bytes(mean), f'comm-{a}')}"
                    f"</td><td>{pred_cell}</td></tr>")
    return (_figure(plots.comm_figure([r["step"] for r in records], wire), "communication per axis")
            + '<table class="grid"><tr><th>axis</th><th>collectives / step</th><th>wire bytes / step (mean)'
            + f"</th><th>predicted</th></tr>{''.join(rows)}</table><p>Wire bytes: what rank 0 put on the wire, "
            "counted by <code>parallel/comm/collectives.py</code> (a ring all-reduce of S bytes over N ranks sends "
            "2(N-1)/N S)."
            "</p>")


SECTIONS = (("Throughput", throughput_section),
            ("Memory per rank: measured and predicted", memory_section),
            ("Device utilization and peak memory: measured and predicted", utilization_section),
            ("Step-time breakdown", breakdown_section), ("Pipeline schedule as executed", schedule_section),
            ("Communication per axis", comm_section))


def build_report(run_dir: Path, progress: bool = True) -> str:
    """The report's HTML for the run in `run_dir`."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} not found: is {run_dir} a run directory (fivefold train writes one)?")
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics} holds no step yet")
    config_path = run_dir / RUN_CONFIG
    # read_config: a run directory of an earlier fivefold holds keys that have moved since (config/moved.py)
    config = dataclasses.asdict(read_config(config_path)[0]) if config_path.is_file() else {}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    bar = Progress(TextColumn("[bold]report"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                   console=Console(stderr=True), disable=not progress)
    body = [f"<h2>Overview</h2>{overview(records, config)}",
            f"<section><h2>Loss and layouts</h2>{loss_section(records, read_events(metrics))}</section>"]
    with bar:
        task = bar.add_task("report", total=len(SECTIONS))
        for title, section in SECTIONS:
            body.append(f"<section><h2>{html.escape(title)}</h2>{section(records)}</section>")
            bar.advance(task)
    files = "".join(f"<li>{html.escape(k)}: <code>{html.escape(str(v))}</code></li>" for k, v in summary.items())
    name = config.get("run", {}).get("name") or run_dir.name
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<link rel="icon" href="data:,">
<title>{html.escape(name)} - fivefold run report</title>
<style>{CSS.read_text()}
img.figure {{ display: block; max-width: 100%; margin: 8px 0; }}
.absent {{ color: var(--muted); font-style: italic; }}</style>
</head>
<body>
<h1>Run report: {html.escape(name)}</h1>
<p>From <code>{html.escape(str(run_dir))}</code>.</p>
{''.join(body)}
<div class="notes"><p>Outputs of the run:</p><ul>{files or '<li>no summary.json (run unfinished?)</li>'}</ul></div>
</body>
</html>
"""


def write_report(run_dir: Path, out: Path | None = None, progress: bool = True) -> Path:
    out = out or run_dir / "report.html"
    text = build_report(run_dir, progress)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
