"""`fivefold plan` and `fivefold calibrate`.

    fivefold plan --model llama3-70b --gpus 64 --gpu h100 --seq 8192 --global-batch-tokens 4M
    fivefold plan --model llama3-8b --gpus 8 --gpu a100-80gb --layout dp=8,zero=1 --seq 4096 --global-batch 64 --explain
    fivefold plan --params 7.5e9 --gpus 8 --gpu a100-80gb --bytes 2,2,8        # does a 7.5B model fit?
    fivefold plan --params 70e9 --gpus 64 --mp 8 --largest-layer 1.05e9 --layout offload=optimizer
    fivefold plan --model llama3-8b --gpus 8 --consider offload,fp8 --out /tmp/plan.toml   # and what others run
    fivefold calibrate --out local.toml && fivefold plan ... --hardware local.toml

With --layout one layout is estimated (a rich table, --explain for the arithmetic, --json for one
object); without it every layout is searched and the fastest that fits is written as a TOML that
`fivefold train` loads unchanged. Options of other trainers (offload, fp8: planner/options.py) are
priced only when asked for, in --layout or by `--consider`, and marked not runnable: a search shows
them beside the rest and writes the fastest runnable layout, never one of them. Model fields can be
overridden like training configs: --model.n_layers 96 --model.dim 12288.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fivefold.config import ConfigError, read_config, to_toml
from fivefold.planner.hardware import GB, get_hardware, load_profile, profile_toml
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.options import DEFAULT


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
    p.add_argument("--global-batch-tokens", default=None, help="tokens per step: 4M = 4 x 2^20, 512K, ...")
    p.add_argument("--bytes", default="2,2,12", help="bytes per parameter: weight,gradient,optimizer (2,2,12)")
    p.add_argument("--act-bytes", type=int, default=2, help="bytes per activation element (2 = bf16)")
    p.add_argument("--explain", action="store_true", help="print the arithmetic behind each number")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--expert-imbalance", type=float, default=1.0,
                   help="tokens on the busiest expert rank over the mean (1 = balanced): its activations and "
                        "all-to-alls")
    p.add_argument("--consider", default="", metavar="offload,fp8",
                   help="search: also price layouts under options fivefold's trainer lacks (shown, marked not "
                        "runnable, never written as the TOML)")
    p.add_argument("--top", type=int, default=10, help="search: layouts shown")
    p.add_argument("--out", default="plan.toml", help="search: where the best layout's config is written")


def add_calibrate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write a hardware profile",
                       description="Time ops, matmuls, the optimizer, Python's fixed costs, a copy and every "
                                   "collective; write a profile for --hardware.")
    p.add_argument("--out", default="local.toml", help="profile to write")
    p.add_argument("--nproc", type=int, default=2, help="local gloo ranks for the collective timings")
    p.add_argument("--quick", action="store_true", help="small sizes, short samples (a few seconds; rough)")
    p.add_argument("--layers", nargs="+", default=[], metavar="CONFIG",
                   help="also time the model's own blocks, embedding and head + loss whole, at the shapes these "
                        "training configs run on --nproc ranks (--section.key=value overrides apply to each); the "
                        "planner uses those times instead of pricing the parts op by op")


def parse_tokens(text: str) -> int:
    """"4M" -> 4 x 2^20 (binary, as in "4M tokens" = 1024 x 4096), "512K", or a plain number."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 2**30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def _hardware(args: argparse.Namespace):
    hw = load_profile(args.hardware) if args.hardware else get_hardware(args.gpu)
    if args.gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    return hw


def _config(args: argparse.Namespace, rest: list[str]):
    from fivefold.planner.layout import split_layout

    path, preset = None, []
    if args.model and Path(args.model).suffix == ".toml":
        path = args.model
    elif args.model:
        preset = [f"--model.preset={args.model}"]
    extra = []
    if args.seq:
        extra.append(f"--train.seq_len={args.seq}")
    if args.micro_batch:
        extra.append(f"--train.micro_batch={args.micro_batch}")
    seq = args.seq
    if args.global_batch_tokens:
        if not seq:
            seq = read_config(path, preset + rest)[0].train.seq_len
        extra.append(f"--train.global_batch={max(1, parse_tokens(args.global_batch_tokens) // seq)}")
    elif args.global_batch:
        extra.append(f"--train.global_batch={args.global_batch}")
    layout, options = split_layout(args.layout) if args.layout else ([], DEFAULT)
    cfg, errors = read_config(path, preset + extra + rest + layout)
    if errors:
        raise ConfigError(errors)
    return cfg, options


def _largest_layer(args: argparse.Namespace, rest: list[str]) -> float:
    """--largest-layer, or with --model the largest unit ZeRO-3 gathers whole (a block, the embedding
    or the head, unsplit: layout.rank_shares' units), or none."""
    if args.largest_layer is not None or not args.model:
        return args.largest_layer or 0.0
    from fivefold.planner.counts import model_counts

    m = _config(args, rest)[0].model
    if not m.vocab_size:  # a model whose vocabulary comes from its data: no embedding to size
        return 0.0
    counts = model_counts(m)
    return float(max(max(blk.total for blk in counts.blocks), counts.embedding, counts.head))


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
    for a, tr in est.comm.items():
        t.add_row(f"{a} bytes/step", f"{tr.bytes / GB:.3f} GB ({'inter' if tr.inter_node else 'intra'}-node)")
    t.add_row("bubble", f"{est.bubble_ratio:.1%} of compute / {est.bubble_fraction:.1%} of time")
    t.add_row("exposed dp", f"{est.exposed_dp_s * 1e3:.1f} ms")
    t.add_row("step time", f"{est.step_time_s:.3f} s")
    t.add_row("tokens/s/GPU", f"{est.tokens_per_s_per_gpu:,.0f}")
    t.add_row("MFU", f"{est.mfu:.1%}")
    if est.host_memory_bytes:
        t.add_row("host memory/node", f"{est.host_memory_bytes / GB:.1f} GB (offload={est.options.offload})")
    t.add_row("fits", "yes" if est.fits else "NO")
    t.add_row("runnable", "no: " + "; ".join(est.not_runnable) if est.not_runnable else "yes")
    c.print(t)


def _print_explain(est) -> None:
    c = Console()
    for what, arithmetic, source in est.explain:
        c.print(f"[bold]{what}[/bold]: {arithmetic}\n    [dim]source: {source}[/dim]", highlight=False)


def _search(args, cfg, hw, b: BytesPerParam, options) -> int:
    from fivefold.planner.search import layout_name, options_name, parse_consider, search

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
            cells += [f"{e.host_memory_bytes / GB:.0f}", "no: " + options_name(e.options) if e.not_runnable else "yes"]
        t.add_row(layout_name(lc), *cells)
    c.print(t)
    for reason, n in res.rejected.most_common():
        c.print(f"rejected {n:>6}: {reason}", highlight=False)
    if not res.ranked:
        c.print("no runnable layout fits: more GPUs, a larger --gpu, or a smaller model"
                + (f" ({len(res.not_runnable)} fit under options fivefold's trainer lacks)" if res.not_runnable
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
    from fivefold.config import load_config
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


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Entry point for both commands (cli.main dispatches here)."""
    if args.command == "calibrate":
        from fivefold.planner.calibration.measure import calibrate

        hw = calibrate(args.nproc, args.quick, name=Path(args.out).stem, parts=_layer_parts(args, rest))
        Path(args.out).write_text(profile_toml(hw))
        timed = hw.pricer.profile.layer_times
        print(f"wrote {args.out}: peak {hw.peak_flops / 1e9:.1f} GFLOP/s, copy {hw.hbm_bw / 1e9:.1f} GB/s, "
              f"collectives alpha {hw.intra_latency * 1e6:.0f} us, beta {hw.intra_bw / 1e9:.2f} GB/s"
              + (f", {len(timed)} model parts timed" if timed else ""))
        return 0
    from fivefold.planner.estimate import estimate
    from fivefold.validate import validate

    try:
        hw, b = _hardware(args), BytesPerParam.parse(args.bytes)
        if args.params is not None:
            return _fits_table(args, hw, b, rest)
        if args.expert_imbalance < 1:
            raise ValueError(f"--expert-imbalance {args.expert_imbalance:g}: the busiest expert rank's tokens over "
                             "the mean are at least 1 (1 = balanced)")
        cfg, options = _config(args, rest)
        options = dataclasses.replace(options, expert_imbalance=args.expert_imbalance)
        if not args.layout:
            return _search(args, cfg, hw, b, options)
        errors = validate(cfg, args.gpus)
        if errors:
            raise ConfigError(errors)
        est = estimate(cfg, args.gpus, hw, b, args.act_bytes, options=options)
    except ConfigError:
        raise
    except ValueError as e:  # a flag's value: one line naming it (ConfigError lists a config's problems)
        print(f"fivefold plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(est.to_json()))
        return 0
    _print_estimate(cfg, est, hw, args.gpus)
    if args.explain:
        _print_explain(est)
    return 0

