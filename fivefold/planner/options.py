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
- overlap switches, each defaulting to what fivefold's runtime does (parallel/tensor.py's
  collectives block the compute that needs them; parallel/data/fsdp.py issues the next unit's gather
  before the current unit computes; parallel/expert.py's all-to-alls wait; DDP's buckets reduce
  during backward unless `parallel.overlap_comm = false`, the one switch the config carries);
- options fivefold's trainer does not have (optimizer and parameter offload to the host, FP8
  compute and FP8 weights), which the planner prices so that a user can compare, and marks not
  runnable: such a layout is shown, never chosen by the search nor written as its TOML.

`--layout` accepts these keys beside the config's (split_layout below); `--causal-flops`,
`--document-tokens` and `--expert-imbalance` are flags of their own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fivefold.model.counts import CausalFlops

if TYPE_CHECKING:
    from fivefold.config import ParallelConfig

Offload = Literal["none", "optimizer", "params"]  # "params" offloads the optimizer state too (ZeRO-Infinity)
Fp8 = Literal["none", "compute", "weights"]  # "weights" computes in FP8 too


@dataclass(frozen=True)
class PlanOptions:
    """The planner's assumptions that are not part of the training config (module docstring)."""

    causal_flops: CausalFlops = "full"  # attention in the MFU / HFU numerator: PaLM's and Megatron's full count
    tp_overlap: bool = False  # tp collectives hidden under the matmuls of their region (Megatron's userbuffers)
    zero3_prefetch: bool = True  # ZeRO-3 gathers the next unit while this one computes
    ep_overlap: bool = False  # expert all-to-alls hidden under another micro-batch's compute (DualPipe)
    offload: Offload = "none"  # ZeRO-Offload (Ren et al. 2021) / ZeRO-Infinity (Rajbhandari et al. 2021)
    fp8: Fp8 = "none"  # FP8 matmuls (Micikevicius et al. 2022), and FP8 weights on the wire and at rest
    expert_imbalance: float = 1.0  # tokens on the busiest expert rank over the mean (1 = perfectly balanced)
    # mean document length in tokens under data.document_mask; 0 = not stated, priced as causal
    # attention over the whole row (what the mask keeps at most)
    document_tokens: float = 0.0

    def not_runnable(self, parallel: ParallelConfig | None = None) -> list[str]:
        """Why `fivefold train` cannot run a layout under these options (empty: it can). Given the
        layout's `parallel` section, a switch its layout never uses (tp_overlap at tp = 1,
        zero3_prefetch without ZeRO-3, ep_overlap at ep = 1) changes no second and is not a reason."""
        tp, zero, ep = (parallel.tp, parallel.zero, parallel.ep) if parallel is not None else (2, 3, 2)
        out = []
        if self.tp_overlap and tp > 1:
            out.append("tp_overlap: fivefold's tp collectives block their region's compute")
        if not self.zero3_prefetch and zero == 3:
            out.append("zero3_prefetch=false: fivefold's ZeRO-3 always prefetches the next unit")
        if self.ep_overlap and ep > 1:
            out.append("ep_overlap: fivefold's expert all-to-alls are not overlapped with another micro-batch")
        if self.offload != "none":
            out.append(f"offload={self.offload}: fivefold keeps all state on the device")
        if self.fp8 != "none":
            out.append(f"fp8={self.fp8}: fivefold computes in bf16 or fp32")
        return out


DEFAULT = PlanOptions()

_CHOICES = {"causal_flops": ("half", "full"), "offload": ("none", "optimizer", "params"),
            "fp8": ("none", "compute", "weights")}
_BOOLS = ("tp_overlap", "zero3_prefetch", "ep_overlap")
OPTION_KEYS = (*_BOOLS, "offload", "fp8")  # the ones --layout accepts beside the config's keys


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
