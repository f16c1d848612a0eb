"""Search layouts: enumerate, keep what validate() accepts and what fits, rank by step time.

Choosing a layout automatically is a research problem of its own (Alpa, Zheng et al. 2022, and
Galvatron, Miao et al. 2022, search with profiled costs and dynamic programming); this is the
plain version: every combination of degrees (tp inside a node, pp dividing the layers, cp for long
sequences, ep for MoE), ZeRO stage, sequence parallel, pipeline schedule, micro-batch size and
recompute, each checked by the same `validate()` that guards `fivefold train`, each estimated by
`estimate()`, the ones over memory dropped, the rest sorted by predicted step time. Every
rejection is counted under its reason, so "nothing fits" says why. All the estimates of a search
share one Memo, so each pipeline shape is simulated, and each model part traced, once.

ZeRO-2 and ZeRO-3 with pipelines and ZeRO with experts are among the candidates (fivefold's
trainer runs them), and so are the overlap switches: every sequence-parallel layout runs
parallel.tp_overlap (the decomposition never exposes more than the blocking collective,
overlap.decomposed_exposure, so the layout without it is never faster and is not priced) unless
its schedule splits the backward (zb_v, dualpipe_v: validate refuses the pair), and
MoE pipelines with expert parallelism are tried under dualpipe_v with parallel.ep_overlap.
FP8 and offload change the numerics or trade speed for memory, so they are priced only when
asked for (`consider`, the CLI's `--consider offload,fp8`): each valid layout is then estimated
again under every such variant its ZeRO stage allows (offload=optimizer from ZeRO-1,
offload=params with ZeRO-3; fp8 compute, and weights with ZeRO-3), and ranked among the others
with its switches set (options.switched_config), so the TOML written runs them. What fivefold
cannot run (options.not_runnable: zero3_prefetch = false, or a switch its layout refuses) is kept
apart: shown, never the best, never written.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from dataclasses import dataclass, field

from fivefold.config.load import replace
from fivefold.config.schema import Config
from fivefold.planner.estimate import Estimate, estimate
from fivefold.planner.machine.datasheet import Hardware
from fivefold.planner.machine.pricing import Memo
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.options import DEFAULT, PlanOptions, switched_config
from fivefold.validate import validate

CONSIDER = ("offload", "fp8")  # what `consider` may name: the switches the search tries only when asked
SPLIT_BACKWARD = ("zb_v", "dualpipe_v")  # the schedules tried whose backward splits into I and W: no tp_overlap


@dataclass
class SearchResult:
    ranked: list[tuple[Config, Estimate]]  # fitting layouts fivefold's trainer runs, fastest first
    rejected: Counter = field(default_factory=Counter)  # reason -> count
    tried: int = 0
    not_runnable: list[tuple[Config, Estimate]] = field(default_factory=list)  # fitting, but not what fivefold runs


def parse_consider(text: str) -> tuple[str, ...]:
    """"offload,fp8" -> ("offload", "fp8"); ValueError naming --consider for anything else."""
    names = tuple(x.strip().lower() for x in text.split(",") if x.strip())
    unknown = [x for x in names if x not in CONSIDER]
    if unknown:
        raise ValueError(f"--consider {text}: expected a comma list of {', '.join(CONSIDER)}")
    return names


def option_variants(cfg: Config, options: PlanOptions, consider: tuple[str, ...],
                    has_fp8: bool = True) -> list[PlanOptions]:
    """The variants of `options` that `consider` asks for, cfg's ZeRO stage allows (offload.check_offload;
    FP8 gathers with ZeRO-3) and the GPU can run (FP8 only with FP8 tensor cores), `options` itself
    left out. Offload with FP8 weights is not tried, to keep the variants few (the runtime runs both
    together, offload = "params" included: parallel/data/offload.py)."""
    zero = cfg.parallel.zero
    offloads = ["none"] + ([*(["optimizer"] if zero else []), *(["params"] if zero == 3 else [])]
                           if "offload" in consider else [])
    fp8s = ["none"] + ([*["compute"], *(["weights"] if zero == 3 else [])] if "fp8" in consider and has_fp8 else [])
    return [dataclasses.replace(options, offload=o, fp8=f) for o, f in itertools.product(offloads, fp8s)
            if (o, f) != ("none", "none") and not (o != "none" and f == "weights")]


def _divisors(n: int, limit: int) -> list[int]:
    return [k for k in range(1, min(n, limit) + 1) if n % k == 0]


def _reason(error: str) -> str:
    """A short bucket for a validate() message (its first words name the field)."""
    return "invalid: " + error.split(":")[0].split(" = ")[0].split(" is ")[0][:60]


def candidates(base: Config, world: int, gpus_per_node: int) -> list[Config]:
    """Every layout worth trying for `base` on `world` ranks (before validation)."""
    m, t = base.model, base.train
    moe = m.moe.n_experts > 0
    out = []
    tps = [k for k in _divisors(world, gpus_per_node) if k & (k - 1) == 0]  # 1, 2, 4, 8: inside a node
    pps = [k for k in _divisors(world, 64) if m.n_layers % k == 0]
    cps = [k for k in (1, 2, 4, 8) if t.seq_len // k >= 4096 or k == 1]  # only long sequences are cut
    for tp, pp, cp in itertools.product(tps, pps, cps):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        eps = [k for k in _divisors(dp * cp, 256) if m.moe.n_experts % k == 0] if moe else [1]
        zeros = (0,) if dp == 1 else (0, 1, 2, 3)  # ZeRO over one rank is DDP
        sps = (False, True) if tp > 1 else (False,)
        for ep, zero, sp, mb, rc in itertools.product(eps, zeros, sps, (1, 2, 4), ("none", "selective", "full")):
            micro = t.global_batch // max(1, dp * mb)
            # ZB-V's lists grow as p x m and it is slow to build: tried for up to 64 micro-batches
            schedules = ([("1f1b", 1), ("interleaved_1f1b", 2)] + ([("zb_v", 2)] if micro <= 64 else [])
                         if pp > 1 else [("1f1b", 1)])
            # DualPipe-V pays off with expert all-to-alls to hide: tried with its overlap, as DeepSeek-V3 ran it
            schedules += [("dualpipe_v", 2)] if pp > 1 and ep > 1 and micro <= 64 else []
            for sched, v in schedules:
                out.append(replace(base, parallel={"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "zero": zero,
                                                   "sp": sp, "pp_schedule": sched, "virtual_stages": v,
                                                   "tp_overlap": sp and sched not in SPLIT_BACKWARD,
                                                   "ep_overlap": sched == "dualpipe_v"},
                                   train={"micro_batch": mb, "recompute": rc}))
    return out


def search(base: Config, world: int, hw: Hardware, b: BytesPerParam | None = None, act_bytes: int = 2,
           keep: int = 10, options: PlanOptions = DEFAULT, consider: tuple[str, ...] = ()) -> SearchResult:
    """Rank every valid, fitting layout of `base` on `world` GPUs of kind `hw`, each estimated under
    `options` (its speed switches set in the layout; options fivefold cannot run put every candidate
    among `not_runnable`) and, with `consider`, under its variants too (module docstring)."""
    result, memo = SearchResult(ranked=[]), Memo()
    checked: dict[Config, list[str]] = {}
    # One pricing for every candidate (a measured profile's drops its layer times: they cover only
    # the shapes they were taken at; MeasuredPricer.for_search says why)
    hw = dataclasses.replace(hw, pricer=hw.pricer.for_search())
    for cfg in candidates(base, world, hw.gpus_per_node):
        result.tried += 1
        # validate() builds the pipeline schedule, the slow part of a search; train.recompute
        # takes no part in its arithmetic (only its type is checked, and every candidate's is
        # valid; a test keeps this true), so candidates differing only in recompute share a result.
        key = replace(cfg, train={"recompute": "none"})
        if key not in checked:
            checked[key] = validate(cfg, world)
        errors = checked[key]
        if errors:
            result.rejected[_reason(errors[0])] += 1
            continue
        for variant in [options, *option_variants(cfg, options, consider, has_fp8=hw.fp8_peak_flops > 0)]:
            # fivefold's overlapped tp matmuls are not FP8 ones (validate/speed.py): FP8 runs the blocking path
            vcfg = replace(cfg, parallel={"tp_overlap": False}) if variant.fp8 != "none" else cfg
            est = estimate(vcfg, world, hw, b, act_bytes, memo=memo, options=variant)
            if not est.fits:
                result.rejected["does not fit in memory" + ("" if variant is options else
                                                            " (under --consider's options)")] += 1
            else:
                (result.not_runnable if est.not_runnable else result.ranked).append(
                    (switched_config(vcfg, variant), est))
    for ranked in (result.ranked, result.not_runnable):
        ranked.sort(key=lambda ce: ce[1].step_time_s)
        del ranked[keep:]
    return result


def layout_name(cfg: Config) -> str:
    """"dp2 tp8sp pp4 z1 1f1b mb1 sel": the degrees above 1 (dp always), then the choices."""
    p, t = cfg.parallel, cfg.train
    parts = [f"dp{p.dp}"] + [f"{a}{getattr(p, a)}" for a in ("tp", "pp", "cp", "ep") if getattr(p, a) > 1]
    if p.sp:
        parts[parts.index(f"tp{p.tp}")] += "sp"
    parts.append(f"z{p.zero}")
    if p.pp > 1:
        parts.append({"interleaved_1f1b": "i1f1b"}.get(p.pp_schedule, p.pp_schedule)
                     + (f"v{p.virtual_stages}" if p.pp_schedule == "interleaved_1f1b" else ""))
    parts += [s for on, s in ((p.tp_overlap, "tpo"), (p.ep_overlap, "epo"), (p.offload != "none", f"off-{p.offload}"),
                              (t.fp8 != "none", "fp8" + ("-gather" if p.fp8_gather else ""))) if on]
    return " ".join(parts + [f"mb{t.micro_batch}", {"none": "-", "selective": "sel", "full": "full"}[t.recompute]])

