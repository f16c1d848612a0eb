"""The planner's predictions beside published training runs (the runs: benchmarks/published_runs.py).

Run: `.venv/bin/python benchmarks/planner_vs_published.py [--markdown | --json] [--only NAME ...]`
(a few seconds; no process group, no tensors).

For each published run this builds the fivefold `Config` of its layout (`load_config(None, [...])`,
a preset where one exists, GPT-3 shapes by `--model.*`), checks it with `validate()`, and calls
`planner.estimate.estimate()` on the run's GPU (a catalog entry, with the fields the run's hardware
differs in replaced) under the `PlanOptions` that match the source: its causal-FLOP convention and
its overlap switches, with the bytes per parameter the source keeps (`Run.state_bytes`, the planner's
`--bytes`: an fp32 gradient reduction sends 4 bytes a gradient). PlanOptions fields the planner does
not have yet are left out and listed, so the script runs on any version of the planner. A run whose
recomputation the source does not state gets the least of none / selective / full that the planner
finds fitting in memory (a feasibility choice, never a fit to the published figure).

Each row prints the published figure in the source's unit and convention, the planner's figure in
the same unit (`predicted()`), and error = predicted / published - 1. Where the source states its
own FLOPs per token, the published TFLOP/s or MFU is also turned into tokens/s/GPU by that formula,
which compares time with time whatever the FLOP conventions: the `tok/s` columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.published_common import METRICS, Run  # noqa: E402
from benchmarks.published_runs import RUNS  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts  # noqa: E402
from fivefold.planner.estimate import estimate  # noqa: E402
from fivefold.planner.hardware import get_hardware  # noqa: E402
from fivefold.planner.machine.datasheet import Hardware  # noqa: E402
from fivefold.planner.memory import BytesPerParam  # noqa: E402
from fivefold.planner.options import PlanOptions  # noqa: E402
from fivefold.validate import validate  # noqa: E402

RECOMPUTE_ORDER = ("none", "selective", "full")


def plan_options(wanted: dict[str, object]) -> tuple[PlanOptions, list[str]]:
    """The PlanOptions a run asks for, and the keys this planner has no field for (left out)."""
    known = {f.name for f in dataclasses.fields(PlanOptions)}
    return PlanOptions(**{k: v for k, v in wanted.items() if k in known}), sorted(set(wanted) - known)


def hardware(run: Run) -> Hardware:
    return dataclasses.replace(get_hardware(run.gpu), **run.hardware)


def hfu(est: Any) -> float | None:
    """The estimate's HFU; None where this planner does not fill it yet (0 or no such field)."""
    return getattr(est, "hfu", 0.0) or None


def predicted(metric: str, est: Any, hw: Hardware) -> float | None:
    """The planner's figure in the unit of `metric` (published_common.METRICS); None: it has none."""
    h, tok = hfu(est), est.tokens_per_s_per_gpu
    return {
        "tokens_per_s_per_gpu": tok,
        "gpu_hours_per_trillion": 1e12 / tok / 3600 if tok else None,
        "mfu": est.mfu,
        "tflops_model": est.mfu * hw.peak_flops / 1e12,
        "tflops_hardware": h * hw.peak_flops / 1e12 if h else None,
        "hfu_over_mfu": h / est.mfu if h and est.mfu else None,
        "hfu_korthikanti_over_mfu": (est.conventions["hfu_korthikanti"] / est.mfu
                                     if getattr(est, "conventions", None) and est.mfu else None),
    }[metric]


def published_tokens(run: Run, hw: Hardware) -> float | None:
    """The published figure as tokens/s/GPU: directly, or by the source's own FLOPs per token."""
    if run.metric == "tokens_per_s_per_gpu":
        return run.published
    if run.metric == "gpu_hours_per_trillion":
        return 1e12 / (run.published * 3600)
    if not run.flops_per_token:
        return None
    per_gpu = {"tflops_model": run.published * 1e12, "tflops_hardware": run.published * 1e12,
               "mfu": run.published * hw.peak_flops}.get(run.metric)
    return per_gpu / run.flops_per_token if per_gpu else None


def config(run: Run, recompute: str | None = None) -> Config:
    extra = [f"--train.recompute={recompute}"] if recompute else []
    return load_config(None, [*run.overrides, *extra])


def evaluate(run: Run) -> dict[str, Any]:
    """One row: the config, the estimate and every figure the table prints."""
    hw = hardware(run)
    options, missing = plan_options(run.options)
    tries = RECOMPUTE_ORDER if run.recompute_fit else (None,)
    row: dict[str, Any] = {"run": run.name, "gpu": run.gpu, "metric": run.metric, "published": run.published,
                           "options": {f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
                           "options_missing": missing}
    for recompute in tries:
        cfg = config(run, recompute)
        errors = validate(cfg, run.world)
        if errors:
            return {**row, "refused": f"validate(): {errors[0]}"}
        est = estimate(cfg, run.world, hw, BytesPerParam(*run.state_bytes), options=options)
        if est.fits or recompute == tries[-1]:
            break
    d = derive(cfg, run.world, unpadded_vocab(cfg))
    params = model_counts(cfg.model, d.vocab_size).total / 1e9
    pred, pub_tok = predicted(run.metric, est, hw), published_tokens(run, hw)
    return {**row, "layout": layout_text(cfg, d.dp), "recompute": cfg.train.recompute, "fits": est.fits,
            "memory_gb": est.memory["total"] / 1e9,
            "params_b": params, "params_ratio": params / run.params_b if run.params_b else None,
            "predicted": pred, "error": pred / run.published - 1 if pred is not None else None,
            "tokens_published": pub_tok, "tokens_predicted": est.tokens_per_s_per_gpu,
            "tokens_error": est.tokens_per_s_per_gpu / pub_tok - 1 if pub_tok else None,
            "mfu": est.mfu, "hfu": hfu(est), "step_time_s": est.step_time_s,
            "time_split": {k: round(v, 4) for k, v in est.time_split.items()}}


def layout_text(cfg: Config, dp: int) -> str:
    """The layout in one line: degrees, ZeRO stage, schedule, batch."""
    p, t = cfg.parallel, cfg.train
    degrees = " ".join(f"{k}{v}" for k, v in (("dp", dp), ("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep))
                       if v > 1 or k == "dp")
    pipe = f" {p.pp_schedule} v{p.virtual_stages}" if p.pp > 1 else ""
    return (f"{degrees}{' sp' if p.sp else ''} zero{p.zero}{pipe}, batch {t.global_batch} x {t.seq_len}, "
            f"micro {t.micro_batch}")


def _evaluate_or_report(run: Run) -> dict[str, Any]:
    """evaluate(), or the row with the planner's error: one run the planner cannot price (an option of a
    newer or older planner, a layout it refuses) must not hide the others."""
    try:
        return evaluate(run)
    except Exception as e:  # noqa: BLE001 - reported in the row, the table goes on
        return {"run": run.name, "metric": run.metric, "published": run.published,
                "refused": f"{type(e).__name__}: {e}"}


def _num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    return f"{x:.4g}" if abs(x) < 10 else f"{x:,.{digits}f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _options(row: dict[str, Any]) -> str:
    o = row["options"]
    on = [k for k in ("tp_overlap", "ep_overlap") if o.get(k)] + [f"fp8={o['fp8']}"] * (o.get("fp8", "none") != "none")
    text = f"causal={o.get('causal_flops', '?')}" + "".join(f", {k}" for k in on)
    return text + (f" (not in this planner: {', '.join(row['options_missing'])})" if row["options_missing"] else "")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'run':34} {'unit':22} {'published':>10} {'planner':>10} {'error':>7} {'tok/s pub':>10} "
            f"{'tok/s plan':>10} {'error':>7}  recompute  options")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "refused" in r:
            print(f"{r['run']:34} not priced: {r['refused']}")
            continue
        fit = "" if r["fits"] else " (over memory)"
        print(f"{r['run']:34} {METRICS[r['metric']]:22} {_num(r['published']):>10} {_num(r['predicted']):>10} "
              f"{_pct(r['error']):>7} {_num(r['tokens_published']):>10} {_num(r['tokens_predicted']):>10} "
              f"{_pct(r['tokens_error']):>7}  {r['recompute'] + fit:9}  {_options(r)}")


def print_markdown(rows: list[dict[str, Any]]) -> None:
    """The note's table: every row with its source, conventions, overlap and what was assumed."""
    by_name = {run.name: run for run in RUNS}
    print("| run | source | layout (fivefold) | published | planner | error | tok/s/GPU published / planner (error) | "
          "source's FLOP convention | source's overlap | planner options | recompute | assumed / differs |")
    print("|" + " --- |" * 12)
    for r in rows:
        run = by_name[r["run"]]
        if "refused" in r:
            print(f"| {run.name} | {run.source} | | {_num(run.published)} | refused: {r['refused']} |" + " |" * 7)
            continue
        tok = f"{_num(r['tokens_published'])} / {_num(r['tokens_predicted'])} ({_pct(r['tokens_error'])})"
        notes = "; ".join(x for x in (run.assumed and f"assumed: {run.assumed}", run.differs,
                                      f"params {r['params_b']:.1f}B vs {run.params_b}B" if run.params_b else "") if x)
        print(f"| {run.name} | {run.source} | {r['layout']} | {_num(run.published)} {METRICS[run.metric]} | "
              f"{_num(r['predicted'])} | {_pct(r['error'])} | {tok} | {run.convention} | {run.overlap} | "
              f"{_options(r)} | {r['recompute']}{'' if r['fits'] else ' (over memory)'} | {notes} |")


# The trainer each row's source ran, by the row's name: the lean is reported by trainer as by GPU.
TRAINERS = {"megatron21": "megatron", "korthikanti22": "megatron", "megatron24": "megatron", "mbridge": "megatron",
            "mcore": "megatron", "llama3": "meta", "deepseek-v3": "deepseek_v3", "torchtitan": "torchtitan",
            "torchao": "torchtitan", "mpt": "mosaic"}


def trainer(name: str) -> str:
    return next(t for prefix, t in TRAINERS.items() if name.startswith(prefix + "-"))


def differs(run: Run) -> str:
    """What a row says fivefold's run differs in (its `differs`, first clause), or "not explained": the
    candidates for its miss, not yet each a cause with its size."""
    first = run.differs.split(";")[0].strip()
    return f"differs: {first}" if first and not first.startswith("not explained") else "not explained"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Median |error| in the sources' units and in tokens/s/GPU; the signed tokens/s error (+: the planner
    fast) by GPU and by trainer, whether the errors lean one way on one kind of GPU or one trainer's runs,
    and its spread (quartiles); the runs off by more than 15% and 25% in their own unit, each with what it
    says differs."""
    errs = [abs(r["error"]) for r in rows if r.get("error") is not None]
    signed = [r["tokens_error"] for r in rows if r.get("tokens_error") is not None]
    by_gpu: dict[str, list[float]] = {}
    by_trainer: dict[str, list[float]] = {}
    for r in rows:
        if r.get("tokens_error") is not None:
            by_gpu.setdefault(r["gpu"], []).append(r["tokens_error"])
            by_trainer.setdefault(trainer(r["run"]), []).append(r["tokens_error"])
    runs = {run.name: run for run in RUNS}
    beyond = {f"beyond_{int(bound * 100)}": [(r["run"], r["error"], differs(runs[r["run"]])) for r in rows
                                             if r.get("error") is not None and abs(r["error"]) > bound]
              for bound in (0.15, 0.25)}
    return {"rows": len(rows), "compared": len(errs), "median_abs_error": statistics.median(errs) if errs else None,
            "tokens_compared": len(signed),
            "median_abs_tokens_error": statistics.median(map(abs, signed)) if signed else None,
            "tokens_error_quartiles": statistics.quantiles(signed, n=4) if len(signed) > 1 else None,
            **{f"median_tokens_error_by_{by}": {k: (len(e), statistics.median(e)) for k, e in sorted(groups.items())}
               for by, groups in (("gpu", by_gpu), ("trainer", by_trainer))},
            **beyond}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="the note's table, with sources and settings")
    parser.add_argument("--json", action="store_true", help="one JSON object per run, then a summary")
    parser.add_argument("--only", nargs="+", default=[], help="runs whose name contains one of these")
    args = parser.parse_args(argv)
    runs = [r for r in RUNS if not args.only or any(s in r.name for s in args.only)]
    rows = [_evaluate_or_report(run) for run in runs]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        print(json.dumps({"summary": summary(rows)}))
    elif args.markdown:
        print_markdown(rows)
    else:
        print_table(rows)
        s = summary(rows)
        print(f"\n{s['compared']} of {s['rows']} runs compared in their own unit: median |error| "
              f"{_pct(s['median_abs_error'])}; {s['tokens_compared']} in tokens/s/GPU: median |error| "
              f"{_pct(s['median_abs_tokens_error'])}")
        for by in ("gpu", "trainer"):
            print(f"signed median in tokens/s/GPU by {by} (+: the planner fast): " + ", ".join(
                f"{g} {_pct(m)} ({n} runs)" for g, (n, m) in s[f"median_tokens_error_by_{by}"].items()))
        if s["tokens_error_quartiles"]:
            quartiles = ", ".join(map(_pct, s["tokens_error_quartiles"]))
            print(f"spread of the signed tokens/s/GPU error: quartiles {quartiles}")
        for bound in (15, 25):
            misses = s[f"beyond_{bound}"]
            print(f"beyond {bound}% in their own unit: {len(misses)} runs" + "".join(
                f"\n  {name} {_pct(err)}: {why}" for name, err, why in misses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
