"""`fivefold plan` and `fivefold calibrate`.

    fivefold plan --model llama3-70b --gpus 64 --gpu h100 --seq 8192 --global-batch-tokens 4M
    fivefold plan --model llama3-8b --gpus 8 --gpu a100-80gb --layout dp=8,zero=1 --seq 4096 --global-batch 64 --explain
    fivefold plan --params 7.5e9 --gpus 8 --gpu a100-80gb --bytes 2,2,8        # does a 7.5B model fit?
    fivefold plan --params 70e9 --gpus 64 --mp 8 --largest-layer 1.05e9 --layout offload=optimizer
    fivefold plan --model llama3-8b --gpus 8 --consider offload,fp8 --out /tmp/plan.toml   # FP8, offload too
    fivefold calibrate --out local.toml && fivefold plan ... --hardware local.toml
    fivefold plan --model deepseek-v3 --gpus 2048 --seq 4096 --tokens-per-s 3.16e6 --token-budget 14.8T  # measured

With --layout one layout is estimated (a rich table, --explain for the arithmetic, --json for one
object); without it every layout is searched and the fastest that fits is written as a TOML that
`fivefold train` loads unchanged. Options of other trainers (offload, fp8: planner/options.py) are
priced only when asked for, in --layout or by `--consider`, and marked not runnable: a search shows
them beside the rest and writes the fastest runnable layout, never one of them. Model fields can be
overridden like training configs: --model.n_layers 96 --model.dim 12288. With --step-time,
--tokens-per-s or --tflops it searches nothing: it restates a measured run as MFU, HFU and, with
--token-budget, days and GPU-hours.

Only values the user gave can refuse a --layout: without a batch in sequences of the user's own
(--global-batch, train.global_batch) it is --global-batch-tokens (default 4M) / seq, rounded to a
multiple of dp x micro-batch; without a micro-batch of the user's own (--micro-batch, micro_batch in
--layout, train.micro_batch) the fastest of 1, 2, 4 that validates and fits is taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fivefold.config.load import ConfigError, to_toml
from fivefold.data.resolve import unpadded_vocab
from fivefold.planner.hardware import GB, get_hardware, load_profile, profile_toml
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.options import DEFAULT
from fivefold.planner.request import DEFAULT_BATCH_TOKENS


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict memory, traffic and step time; search layouts",
                       description="Estimate a layout (--layout) or search them all; --model.KEY VALUE overrides.")
    p.add_argument("--model", default=None, help="a preset name (llama3-70b, ...) or a TOML config file")
    p.add_argument("--params", type=float, default=None, help="a bare parameter count: model-state memory only")
    p.add_argument("--mp", type=int, default=1, help="--params: model-parallel degree tp x pp dividing the model state")
    p.add_argument("--largest-layer", type=float, default=None, metavar="PARAMS",
                   help="--params: parameters of the largest layer ZeRO-3 gathers whole (default: none, or with "
                        "--model its largest unit: a block, the embedding or the head)")
    p.add_argument("--gpu", default="h100", help="catalog entry: a100-40gb, a100-80gb, h100, h200, b200, mi300x")
    p.add_argument("--hardware", default=None, help="a profile TOML (from `fivefold calibrate`), instead of --gpu")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware's")
    p.add_argument("--layout", default=None, help="dp=8,tp=8,pp=1,cp=1,ep=1,zero=1,sp=true,pp_schedule=1f1b,"
                   "virtual_stages=1,recompute=selective,micro_batch=1 (omit to search)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the config's)")
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    p.add_argument("--global-batch-tokens", default=None,
                   help=f"tokens per step: 4M = 4 x 2^20, 512K, ... (with --layout or a measured run, default "
                        f"{DEFAULT_BATCH_TOKENS})")
    p.add_argument("--causal-flops", choices=("full", "half"), default="full",
                   help="causal attention in the MFU/HFU numerator: full (PaLM, Megatron) or half (what the "
                        "kernels run); the step time prices the half either way")
    p.add_argument("--kernels", choices=("eager", "fused"), default=None,
                   help="elementwise kernels as priced: eager (fivefold's model code op by op) or fused (each chain "
                        "one kernel: torch.compile, Megatron-LM / Transformer Engine); default: train.compile's")
    p.add_argument("--document-tokens", type=float, default=None, metavar="N",
                   help="with data.document_mask: the data's mean document length in tokens (geometric lengths "
                        "assumed); attention FLOPs and time count the pairs the mask keeps (default: the whole row)")
    measured = p.add_mutually_exclusive_group()
    measured.add_argument("--step-time", type=float, default=None, metavar="SECONDS",
                          help="a measured step: report its MFU, HFU, tokens/s (no search)")
    measured.add_argument("--tokens-per-s", type=float, default=None, metavar="N", help="measured, the whole job's")
    measured.add_argument("--tflops", type=float, default=None, metavar="X",
                          help="measured: achieved TFLOP/s per GPU in model FLOPs (under --causal-flops)")
    p.add_argument("--token-budget", default=None, help="with a measured run: tokens to train, decimal "
                   "(15T = 15e12, as papers state them): days and GPU-hours")
    p.add_argument("--bytes", default="2,2,12", help="bytes per parameter: weight,gradient,optimizer (2,2,12)")
    p.add_argument("--act-bytes", type=int, default=2, help="bytes per activation element (2 = bf16)")
    p.add_argument("--explain", action="store_true", help="print the arithmetic behind each number")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--expert-imbalance", default="1", metavar="X|RUN_DIR",
                   help="tokens on the busiest expert rank over the mean (1 = balanced): its activations and "
                        "all-to-alls; or a run directory whose metrics.jsonl logged the routing (expert_load)")
    p.add_argument("--consider", default="", metavar="offload,fp8",
                   help="search: also price layouts under options fivefold's trainer lacks (shown, marked not "
                        "runnable, never written as the TOML)")
    p.add_argument("--top", type=int, default=10, help="search: layouts shown")
    p.add_argument("--out", default="plan.toml", help="search: where the best layout's config is written")
    p.set_defaults(run=run, overrides=True)  # --model.KEY VALUE overrides


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Time ops, matmuls, the optimizer, Python's fixed costs, a copy and every "
                                   "collective; write a profile for --hardware.")
    p.add_argument("--out", default="local.toml", help="profile to write")
    p.add_argument("--nproc", type=int, default=2, help="local gloo ranks for the collective timings")
    p.add_argument("--quick", action="store_true", help="small sizes, short samples (a few seconds; rough)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: measure this GPU's roofline constants into its catalog entry (GEMM and FP8 GEMM "
                        "fractions, attention curves, HBM); cpu: the CPU as a training device; auto: cuda if present")
    p.add_argument("--layers", nargs="+", default=[], metavar="CONFIG",
                   help="also time the model's own blocks, embedding and head + loss whole, at the shapes these "
                        "training configs run on --nproc ranks (--section.key=value overrides apply to each); the "
                        "planner uses those times instead of pricing the parts op by op")
    p.set_defaults(run=run, overrides=True)  # --layers' --section.key=value overrides


def _hardware(args: argparse.Namespace):
    hw = load_profile(args.hardware) if args.hardware else get_hardware(args.gpu)
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return hw


def _largest_layer(args: argparse.Namespace, rest: list[str]) -> float:
    """--largest-layer, or with --model the largest unit ZeRO-3 gathers whole (a block, the embedding
    or the head, unsplit: layout.rank_shares' units), or none."""
    if args.largest_layer is not None or not args.model:
        return args.largest_layer or 0.0
    from fivefold.model.counts import model_counts
    from fivefold.planner.request import read_request

    m = read_request(args, rest, batch_default=False).cfg.model
    if not m.vocab_size:  # a model whose vocabulary comes from its data: no embedding to size
        return 0.0
    counts = model_counts(m)
    # the head's unit holds the MTP depths too (parallel/data/fsdp.py)
    head = counts.head + sum(blk.total + counts.mtp_extra for blk in counts.mtp)
    return float(max(max(blk.total for blk in counts.blocks), counts.embedding, head))


def _fits_table(args: argparse.Namespace, hw, b: BytesPerParam, rest: list[str]) -> int:
    """--params: model state per GPU for each ZeRO stage, and the largest model that fits (fits.py)."""
    from fivefold.planner.fits import SHARDED_BY, STAGES, check_params_mode, stage_fit
    from fivefold.planner.layout import split_layout

    n, mp = args.gpus, args.mp
    check_params_mode(n, mp, args.largest_layer)
    overrides, options = split_layout(args.layout) if args.layout else ([], DEFAULT)
    if overrides:
        raise ValueError(f"--layout with --params takes offload= and fp8= only (not {overrides[0].lstrip('-')})")
    largest = _largest_layer(args, rest)
    title = (f"{args.params / 1e9:.2f}B parameters on {n} x {hw.name} ({hw.memory_bytes / GB:.0f} GB), bytes "
             f"{b.param:g},{b.grad:g},{b.optimizer:g}, mp {mp}, largest layer {largest / 1e9:.3f}B"
             + (f", offload {options.offload}" if options.offload != "none" else "")
             + (f", fp8 {options.fp8}" if options.fp8 != "none" else ""))
    table = Table(title=title)
    cols = ["stage", "params GB", "grads GB", "optimizer GB", "largest layer GB", "total GB"]
    cols += ["host GB/node"] if options.offload != "none" else []
    for col in (*cols, "fits", "largest model"):
        table.add_column(col, justify="right")
    out: dict = {"sharded_by": SHARDED_BY}
    for zero in range(4):
        row = stage_fit(args.params, b, zero, n, mp, largest, options, hw.memory_bytes, hw.host_memory_bytes,
                        min(n, hw.gpus_per_node))
        if row is None:
            table.add_row(STAGES[zero], *["-"] * (len(cols) - 1),
                          "n/a", f"offload={options.offload} needs zero={'3' if options.offload == 'params' else '1+'}")
            continue
        s = row.device
        out[row.stage] = {**{k: v / GB for k, v in s.items()}, "host_per_node": row.host_node / GB, "fits": row.fits,
                          "largest_params": row.largest_params}
        cells = [f"{s[k] / GB:.1f}" for k in ("params", "grads", "optimizer", "largest_layer", "total")]
        cells += [f"{row.host_node / GB:.1f}"] if options.offload != "none" else []
        table.add_row(row.stage, *cells, "yes" if row.fits else "no", f"{row.largest_params / 1e9:.2f}B")
    if options.not_runnable():
        out["not_runnable"] = options.not_runnable()
    if args.json:
        print(json.dumps(out))
        return 0
    c = Console()
    if not c.is_terminal:  # rich assumes 80 columns when piped; the table needs more
        c.width = 150
    c.print(table)
    weight = f"{b.param:g} B" + (", the blocks' 1 B in fp8" if options.fp8 == "weights" else "")
    c.print(f"sharded by: weights ({weight}) ZeRO-3; gradients ({b.grad:g} B) ZeRO-2, ZeRO-3; optimizer "
            f"({b.optimizer:g} B: fp32 master and moments) ZeRO-1, 2, 3; --mp {mp} divides all three. ZeRO-3 also "
            "holds its largest layer's weight and gradient whole (DeepSpeed's memory estimator adds the same).",
            highlight=False)
    for why in options.not_runnable():
        c.print(f"not runnable by fivefold: {why}", highlight=False)
    return 0


def _print_estimate(cfg, est, hw, world: int) -> None:
    from fivefold.planner.search import layout_name

    c = Console()
    t = Table(title=f"{layout_name(cfg)} on {world} x {hw.name}")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    for k, v in est.memory.items():
        t.add_row(f"memory {k}", f"{v / GB:.2f} GB")
    chunk = cfg.train.loss_chunk
    t.add_row("loss chunk", f"{chunk} tokens of logits at a time" if chunk else "0: the whole micro-batch's logits")
    if cfg.model.mtp_layers:
        t.add_row("MTP depths", f"{cfg.model.mtp_layers} on the last stage (mtp_weight {cfg.train.mtp_weight:g})")
    for a, tr in est.comm.items():
        t.add_row(f"{a} bytes/step", f"{tr.bytes / GB:.3f} GB ({'inter' if tr.inter_node else 'intra'}-node)")
    t.add_row("bubble", f"{est.bubble_ratio:.1%} of compute / {est.bubble_fraction:.1%} of time")
    t.add_row("exposed dp", f"{est.exposed_dp_s * 1e3:.1f} ms")
    t.add_row("optimizer step", f"{cfg.optim.name}: {est.time_split['optimizer'] * 1e3:.1f} ms"
              + (" (Newton-Schulz and its all_to_alls included)" if cfg.optim.name == "muon" else ""))
    t.add_row("step time", f"{est.step_time_s:.3f} s")
    t.add_row("tokens/s/GPU", f"{est.tokens_per_s_per_gpu:,.0f}")
    if est.host_memory_bytes:
        t.add_row("host memory/node", f"{est.host_memory_bytes / GB:.1f} GB (offload={est.options.offload})")
    t.add_row(f"MFU / HFU ({est.options.causal_flops} causal)", f"{est.mfu:.1%} / {est.hfu:.1%}")
    t.add_row("kernels", est.options.kernels)
    t.add_row("fits", "yes" if est.fits else "NO")
    t.add_row("runnable", "no: " + "; ".join(est.not_runnable) if est.not_runnable else "yes")
    c.print(t)


def _print_explain(rows: list[tuple[str, str, str]]) -> None:
    c = Console()
    for what, arithmetic, source in rows:
        c.print(f"[bold]{what}[/bold]: {arithmetic}\n    [dim]source: {source}[/dim]", highlight=False)


def _search(args, cfg, hw, b: BytesPerParam, options) -> int:
    from fivefold.planner.search import layout_name, parse_consider, search

    res = search(cfg, args.gpus, hw, b, args.act_bytes, keep=args.top, options=options,
                 consider=parse_consider(args.consider))
    c = Console(stderr=args.json)
    if not c.is_terminal:  # rich assumes 80 columns when piped; the table needs more
        c.width = 150
    shown = sorted(res.ranked + res.not_runnable, key=lambda ce: ce[1].step_time_s)
    extra = f" (+ {len(res.not_runnable)} not runnable)" if res.not_runnable else ""
    t = Table(title=f"{len(res.ranked)} best of {res.tried} layouts{extra}, {args.gpus} x {hw.name}")
    cols = ["layout", "step s", "tok/s/GPU", "MFU", "mem GB", "state GB", "act GB", "bubble", "tp+cp+ep s",
            "dp exposed s"] + (["host GB", "runnable"] if res.not_runnable else [])
    for col in cols:
        t.add_column(col, justify="right")
    for lc, e in shown:
        state = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
        cells = [f"{e.step_time_s:.2f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{e.mfu:.1%}",
                 f"{e.memory['total'] / GB:.1f}", f"{state / GB:.1f}", f"{e.memory['activations'] / GB:.1f}",
                 f"{e.bubble_fraction:.1%}", f"{e.time_split['tp_cp_ep']:.2f}", f"{e.exposed_dp_s:.2f}"]
        if res.not_runnable:
            cells += [f"{e.host_memory_bytes / GB:.0f}",
                      "no: " + ", ".join(w.split(" = ")[0].split(":")[0] for w in e.not_runnable) if e.not_runnable
                      else "yes"]
        t.add_row(layout_name(lc), *cells)
    c.print(t)
    for reason, n in res.rejected.most_common():
        c.print(f"rejected {n:>6}: {reason}", highlight=False)
    if not res.ranked:
        c.print("no runnable layout fits: more GPUs, a larger --gpu, or a smaller model"
                + (f" ({len(res.not_runnable)} fit under options fivefold does not run)" if res.not_runnable
                   else ""))
        return 1
    best_cfg, best = res.ranked[0]
    Path(args.out).write_text(to_toml(best_cfg))
    c.print(f"best: {layout_name(best_cfg)} -> {args.out} (fivefold train {args.out} on {args.gpus} processes)"
            + ("; not-runnable layouts are shown, never written" if res.not_runnable else ""))
    if args.json:
        print(json.dumps(best.to_json()))
    return 0


def _layer_parts(args: argparse.Namespace, rest: list[str]) -> tuple:
    """The distinct parts the --layers configs run on --nproc ranks; every config checked first."""
    from fivefold.config.load import load_config
    from fivefold.planner.calibration.layers import config_parts
    from fivefold.validate import validate

    if rest and not args.layers:
        raise ConfigError([f"unrecognized arguments: {' '.join(rest)} (overrides apply to --layers configs)"])
    parts = {}
    for path in args.layers:
        cfg = load_config(path, rest)
        errors = validate(cfg, args.nproc)
        if errors:
            raise ConfigError([f"--layers {path} on --nproc {args.nproc}: {e}" for e in errors])
        parts.update((part.key, part) for part in config_parts(cfg, args.nproc))
    return tuple(parts.values())


def _on_cuda(device: str) -> bool:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(["calibrate --device cuda: no CUDA device here; use --device cpu"])
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def _calibrate_gpu(args: argparse.Namespace, rest: list[str]) -> int:
    """This GPU's roofline constants (calibration/gpu.py) written as a profile for --hardware."""
    from fivefold.planner.calibration.gpu import calibrate_gpu

    if args.layers or rest:
        raise ConfigError(["calibrate --layers times a CPU's parts: use --device cpu"])
    hw = calibrate_gpu(args.quick, name=Path(args.out).stem)
    Path(args.out).write_text(profile_toml(hw))
    print(f"wrote {args.out}: bf16 GEMM {hw.matmul_efficiency:.1%} of peak, attention "
          f"{hw.attention_fwd_curve[-1][1]:.1%} forward / {hw.attention_bwd_curve[-1][1]:.1%} backward at "
          f"{hw.attention_fwd_curve[-1][0]:.0f}, HBM {hw.hbm_efficiency:.1%}")
    print(f"GEMM: {hw.sources['matmul_efficiency']}")
    return 0


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Entry point for both commands (their parsers name it)."""
    if args.command == "calibrate" and _on_cuda(args.device):
        return _calibrate_gpu(args, rest)
    if args.command == "calibrate":
        from fivefold.planner.calibration.measure import calibrate

        hw = calibrate(args.nproc, args.quick, name=Path(args.out).stem, parts=_layer_parts(args, rest))
        Path(args.out).write_text(profile_toml(hw))
        timed = hw.pricer.profile.layer_times
        print(f"wrote {args.out}: peak {hw.peak_flops / 1e9:.1f} GFLOP/s, copy {hw.hbm_bw / 1e9:.1f} GB/s, "
              f"collectives alpha {hw.intra_latency * 1e6:.0f} us, beta {hw.intra_bw / 1e9:.2f} GB/s"
              + (f", {len(timed)} model parts timed" if timed else ""))
        return 0
    try:  # bad flags, --layout items and measured figures: one line naming the flag, not a traceback
        hw, b = _hardware(args), BytesPerParam.parse(args.bytes)
        if args.params is not None:
            return _fits_table(args, hw, b, rest)
        return _plan(args, rest, hw, b)
    except ConfigError:
        raise
    except ValueError as e:  # one flag's value: one line naming it (ConfigError lists a config's problems)
        print(f"fivefold plan: {e}", file=sys.stderr)
        return 2


def _plan(args: argparse.Namespace, rest: list[str], hw, b: BytesPerParam) -> int:
    from fivefold.planner.request import estimate_request, read_request

    is_measured = any(v is not None for v in (args.step_time, args.tokens_per_s, args.tflops))
    if args.token_budget and not is_measured:
        raise ConfigError(["--token-budget needs a measured run: give --step-time, --tokens-per-s or --tflops"])
    req = read_request(args, rest, batch_default=bool(args.layout) or is_measured)
    if is_measured:
        return _measured(args, req.cfg, req.options, hw)
    if not args.layout:
        return _search(args, req.cfg, hw, b, req.options)
    cfg, est = estimate_request(req, args.gpus, hw, b, args.act_bytes)
    if args.json:
        print(json.dumps(est.to_json()))
        return 0
    _print_estimate(cfg, est, hw, args.gpus)
    if args.explain:
        _print_explain(est.explain)
    return 0


def _measured(args: argparse.Namespace, cfg, options, hw) -> int:
    """A measured run restated (flops.measured): no layout, no search."""
    from fivefold.config.derive import padded_vocab
    from fivefold.planner.flops import convention_row, measured, parse_token_budget, step_flops, utilization_row

    budget = parse_token_budget(args.token_budget) if args.token_budget else None
    causal = options.causal_flops
    f = step_flops(cfg, padded_vocab(cfg, unpadded_vocab(cfg)), causal, options.document_tokens)
    result = measured(f, args.gpus, hw.peak_flops, step_time_s=args.step_time, tokens_per_s=args.tokens_per_s,
                   tflops=args.tflops, token_budget=budget)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    explain = [convention_row(f), utilization_row(f, result.step_time_s, args.gpus, hw.peak_flops)]
    t = Table(title="a measured run")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("GPUs", f"{args.gpus} x {hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s peak)")
    t.add_row("tokens/step", f"{f.tokens_per_step:,} (seq {cfg.train.seq_len})")
    t.add_row("convention", f"causal_flops={causal}, recompute={f.recompute}"
              + (f"; masks counted as kept: {f.masks}" if f.masks else ""))
    t.add_row("step time", f"{result.step_time_s:.3f} s")
    t.add_row("tokens/s/GPU", f"{result.tokens_per_s_per_gpu:,.0f}")
    t.add_row("model FLOPs/token", f"{f.model_per_token:.4e}")
    t.add_row("hardware FLOPs/token", f"{f.hardware_per_token:.4e}")
    t.add_row("MFU", f"{result.mfu:.1%}")
    t.add_row("HFU", f"{result.hfu:.1%}")
    if budget is not None:
        t.add_row("token budget", f"{budget:.4g}")
        t.add_row("days", f"{result.days:,.1f}")
        t.add_row("GPU-hours", f"{result.gpu_hours:,.0f}")
    Console().print(t)
    if args.explain:
        _print_explain(explain)
    return 0
