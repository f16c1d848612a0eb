"""What an estimate assumes beyond the training config: the FLOP convention it reports in, which
communication it overlaps, and the memory-saving options of other trainers.

A layout is a `Config` (layout.py), and the config says everything `fivefold train` runs. Some
choices a planner must still make are not in it:

- conventions that change no second of the step, only how it is reported: whether the causal
  mask halves the attention FLOPs of the MFU numerator (PaLM, Chowdhery et al. 2022, App. B, and
  Megatron-LM, Narayanan et al. 2021, count it in full; the kernels skip the masked half either way,
  so the step time always prices the half they run);
- what the data holds: the mean document length under `data.document_mask`, which sets how many
  pairs the document mask keeps (model/mask_counts.py assumes geometric lengths of that mean);
- the kernels the trainer runs (`kernels`): "eager" prices fivefold's model code kernel by kernel
  (planner/machine/ops.py), "fused" its elementwise chains fused (each fused kernel reads its
  inputs once and writes its output once: what `train.compile` gives, and what Megatron-LM and
  Transformer Engine fuse by hand: norms, bias + activation, rotary, softmax); "auto" is what
  `train.compile` says;
- overlap switches, each defaulting to what fivefold's runtime does by default (parallel/tensor.py's
  collectives block the compute that needs them unless `parallel.tp_overlap`; parallel/data/fsdp.py
  issues the next unit's gather before the current unit computes; parallel/expert.py's all-to-alls
  wait unless `parallel.ep_overlap`; DDP's buckets reduce during backward unless
  `parallel.overlap_comm = false`);
- the runtime's speed options, each also a config switch: `tp_overlap` (parallel.tp_overlap),
  `ep_overlap` (parallel.ep_overlap), `offload` (parallel.offload) and `fp8` ("compute":
  train.fp8; "weights": ZeRO-3's gathers in FP8 too, parallel.fp8_gather). An estimate takes each
  from its config or from these options, whichever turns it on (`with_config`), and prices the
  config `switched_config` writes; the layout is runnable when `validate` accepts that config's
  switches (validate/speed.py: tp_overlap needs sp, ep_overlap dualpipe_v, offload ZeRO, fp8
  weights ZeRO-3). `zero3_prefetch = false` and `param_gather_overlap = true` (Megatron-LM's
  --overlap-param-gather: ZeRO-1/2's weight all-gather under the next step's forward) are the
  switches fivefold does not run.

`attention_kernel` names the attention kernel: "sdpa" (fivefold's: the kernel torch's SDPA runs on
the GPU, cuDNN's on Hopper and Blackwell), "fa2" (FlashAttention-2, what SDPA ran there before torch
2.11 and what torchtitan pinned) or "materialized", a trainer before FlashAttention (the score matrix
written out, ops.materialized_attention): published runs of 2021 ran so, fivefold never does.
`activations = "megatron"` keeps for backward what Megatron-LM keeps (activations.py), with the
backward's extra all-gather that sequence parallelism then runs (comm.py): published runs'
memory, not fivefold's. `ep_dispatch = "node_limited"` prices DeepSeek-V3's node-limited
dispatch (expert_comm.py), which fivefold does not run either, and `selective_ac = "per_op"`
torchtitan's per-op selective recompute (roofline.py).

`--layout` accepts these keys beside the config's (split_layout below); `--causal-flops`,
`--document-tokens`, `--kernels` and `--expert-imbalance` are flags of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from fivefold.config.load import replace
from fivefold.config.schema import Config
from fivefold.model.counts import CausalFlops
from fivefold.planner.activations import ActivationLayout, layout_applies
from fivefold.validate.speed import speed_errors

Offload = Literal["none", "optimizer", "params"]  # "params" offloads the optimizer state too (ZeRO-Infinity)
Fp8 = Literal["none", "compute", "weights"]  # "weights" computes in FP8 too
Kernels = Literal["auto", "eager", "fused"]  # "auto": fused when train.compile is on
AttentionKernel = Literal["sdpa", "fa2", "materialized"]  # "materialized": the whole score matrix (machine/ops.py)
EpDispatch = Literal["all_to_all", "node_limited"]  # fivefold's all-to-all, DeepSeek-V3's (expert_comm.py)
SelectiveAc = Literal["attention_core", "per_op"]  # what train.recompute = "selective" reruns (roofline.py)


@dataclass(frozen=True)
class PlanOptions:
    """The planner's assumptions that are not part of the training config (module docstring)."""

    causal_flops: CausalFlops = "full"  # attention in the MFU / HFU numerator: PaLM's and Megatron's full count
    tp_overlap: bool = False  # tp collectives hidden under the matmuls of their region (Megatron's userbuffers)
    zero3_prefetch: bool = True  # ZeRO-3 gathers the next unit while this one computes
    ep_overlap: bool = False  # expert all-to-alls hidden under another micro-batch's compute (DualPipe)
    # ZeRO-1/2's weight all-gather under the next step's forward (Megatron-LM's --overlap-param-gather)
    param_gather_overlap: bool = False
    offload: Offload = "none"  # ZeRO-Offload (Ren et al. 2021) / ZeRO-Infinity (Rajbhandari et al. 2021)
    fp8: Fp8 = "none"  # FP8 matmuls (Micikevicius et al. 2022), and FP8 weights on the wire and at rest
    # the routed experts' matmuls in FP8 too (DeepSeek-V3's, Transformer Engine's grouped GEMMs); fivefold's
    # FP8 converts the blocks' dense linears only, the head, router and routed experts stay bf16 (parallel/fp8.py)
    fp8_experts: bool = False
    kernels: Kernels = "auto"  # elementwise kernels as run eagerly or fused (module docstring)
    attention_kernel: AttentionKernel = "sdpa"  # "fa2", "materialized": another trainer's kernel (module docstring)
    activations: ActivationLayout = "fivefold"  # "megatron": what Megatron-LM keeps for backward (activations.py)
    ep_dispatch: EpDispatch = "all_to_all"  # "node_limited": DeepSeek-V3's dispatch over nodes (expert_comm.py)
    # what selective recompute reruns: the attention core (Korthikanti et al. 2022, fivefold's) or torchtitan's
    # per-op policy ("per_op": every other matmul of a block and all its elementwise kernels; roofline.py)
    selective_ac: SelectiveAc = "attention_core"
    expert_imbalance: float = 1.0  # tokens on the busiest expert rank over the mean (1 = perfectly balanced)
    # a run's measured routing as (ep, the busiest expert rank's share at that ep) (routing.py): when
    # given, the layout's ep reads its imbalance here instead of expert_imbalance
    measured_imbalance: tuple[tuple[int, float], ...] = ()
    # mean document length in tokens under data.document_mask; 0 = not stated, priced as causal
    # attention over the whole row (what the mask keeps at most)
    document_tokens: float = 0.0

    def with_config(self, cfg: Config) -> PlanOptions:
        """These options with the speed switches `cfg` turns on (a switch on in either is on), and
        the kernels resolved: "auto" becomes what train.compile says, a stated choice stays."""
        p, t = cfg.parallel, cfg.train
        fp8 = "weights" if p.fp8_gather else "compute" if t.fp8 != "none" else "none"
        kernels = self.kernels if self.kernels != "auto" else "fused" if t.compile else "eager"
        return dataclasses.replace(
            self, tp_overlap=self.tp_overlap or p.tp_overlap, ep_overlap=self.ep_overlap or p.ep_overlap,
            offload=p.offload if p.offload != "none" else self.offload,
            fp8=max(fp8, self.fp8, key=("none", "compute", "weights").index), kernels=kernels)

    def not_runnable(self, cfg: Config | None = None) -> list[str]:
        """Why `fivefold train` cannot run `cfg` under these options (empty: it can): what validate
        refuses of `switched_config(cfg, self)`'s speed switches, and zero3_prefetch = false under
        ZeRO-3. A switch its layout never uses (tp_overlap at tp = 1, zero3_prefetch without ZeRO-3,
        ep_overlap at ep = 1) changes no second and is not a reason. Without a layout, only the
        options no layout can run."""
        out = [] if self.zero3_prefetch or (cfg is not None and cfg.parallel.zero != 3) else [
            "zero3_prefetch=false: fivefold's ZeRO-3 always prefetches the next unit"]
        if self.attention_kernel != "sdpa":
            out.append(f"attention_kernel={self.attention_kernel}: fivefold's attention is the kernel torch's SDPA "
                       "picks (model/attention.py)")
        if self.activations != "fivefold" and (cfg is None or layout_applies(cfg.model, self.activations)):
            out.append(f"activations={self.activations}: fivefold keeps other tensors for backward "
                       "(planner/activations.py)")
        if self.ep_dispatch != "all_to_all" and (cfg is None or (cfg.parallel.ep > 1 and cfg.model.moe.n_experts)):
            out.append(f"ep_dispatch={self.ep_dispatch}: fivefold's experts exchange tokens in one all-to-all")
        if self.selective_ac != "attention_core" and (cfg is None or cfg.train.recompute == "selective"):
            out.append(f"selective_ac={self.selective_ac}: fivefold's selective recompute reruns the attention core")
        if self.fp8_experts and (cfg is None or cfg.model.moe.n_experts):
            out.append("fp8_experts=true: fivefold's FP8 leaves the routed experts in bf16 (parallel/fp8.py)")
        if self.param_gather_overlap and (cfg is None or cfg.parallel.zero in (1, 2)):
            out.append("param_gather_overlap=true: fivefold's ZeRO-1/2 gather the weights after the step "
                       "(parallel/data/zero.py)")
        return out + (speed_errors(switched_config(cfg, self)) if cfg is not None else [])


def switched_config(cfg: Config, options: PlanOptions) -> Config:
    """`cfg` with the speed switches `options` turns on and its layout uses: what `fivefold train`
    runs for an estimate under `options` (the search writes it). FP8 compute is torchao's
    tensorwise recipe unless `cfg` names another; fused kernels are train.compile's, eager ones
    its absence."""
    p, t = cfg.parallel, cfg.train
    fp8 = t.fp8 if t.fp8 != "none" or options.fp8 == "none" else "tensorwise"
    compile_ = t.compile if options.kernels == "auto" else options.kernels == "fused"
    return replace(cfg, parallel={"tp_overlap": p.tp_overlap or (options.tp_overlap and p.tp > 1),
                                  "ep_overlap": p.ep_overlap or (options.ep_overlap and p.ep > 1),
                                  "offload": p.offload if p.offload != "none" else options.offload,
                                  "fp8_gather": p.fp8_gather or options.fp8 == "weights"},
                   train={"fp8": fp8, "compile": compile_})


DEFAULT = PlanOptions()

_CHOICES = {"causal_flops": ("half", "full"), "offload": ("none", "optimizer", "params"),
            "fp8": ("none", "compute", "weights"), "kernels": ("auto", "eager", "fused"),
            "attention_kernel": ("sdpa", "fa2", "materialized"), "activations": ("fivefold", "megatron", "deepseek"),
            "ep_dispatch": ("all_to_all", "node_limited"), "selective_ac": ("attention_core", "per_op")}
_BOOLS = ("tp_overlap", "zero3_prefetch", "ep_overlap", "param_gather_overlap", "fp8_experts")
# the ones --layout accepts beside the config's keys (another trainer's kernels, memory and dispatch among them)
OPTION_KEYS = (*_BOOLS, "offload", "fp8", "kernels", "attention_kernel", "activations", "ep_dispatch",
               "selective_ac")


def parse_option(options: PlanOptions, key: str, value: str) -> PlanOptions:
    """`options` with `key` set from its text; ValueError naming the key and what it accepts."""
    value = value.strip().lower()
    if key in _BOOLS:
        if value not in ("true", "false", "on", "off", "1", "0"):
            raise ValueError(f"--layout {key}={value}: expected true or false")
        return dataclasses.replace(options, **{key: value in ("true", "on", "1")})
    if key in _CHOICES:
        if value not in _CHOICES[key]:
            raise ValueError(f"--layout {key}={value}: expected one of {', '.join(_CHOICES[key])}")
        return dataclasses.replace(options, **{key: value})
    raise ValueError(f"unknown planner option '{key}'; valid: {', '.join(OPTION_KEYS)}")
