"""FLOP conventions: model FLOPs (MFU) beside hardware FLOPs (HFU), and the measured mode.

- MFU = model FLOPs / (step x GPUs x peak) (PaLM, Chowdhery et al. 2022, App. B): the FLOPs the
  model needs, however the system runs them; recomputation does not count.
- HFU = hardware FLOPs / (step x GPUs x peak): the FLOPs the GPUs run, recomputation included (full:
  one more forward of the blocks; selective: the attention core's forward again). Korthikanti et
  al. 2022 report both; Narayanan et al. 2021's Megatron-LM figures are hardware FLOPs with full
  recompute, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
- causal attention in the numerator: counted in full (PaLM, Megatron: the default) or halved for the
  masked half the kernels skip (PlanOptions.causal_flops). Only the report changes: the step time
  always prices the half the kernels run (compute.py).

The measured mode turns a run's step time, tokens/s or achieved TFLOP/s into MFU, HFU and, with a
token budget, days and GPU-hours, with no layout to search: a paper's claim checked by arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fivefold.config import Config
from fivefold.model.counts import CausalFlops, flops_per_token, recompute_flops_per_token
from fivefold.planner.machine.pricing import Row

_SOURCES = {"full": "causal attention counted in full, as PaLM (Chowdhery et al. 2022, App. B) and Megatron-LM "
                    "(Narayanan et al. 2021) count it",
            "half": "causal attention halved: the masked half the fused kernels skip (what the step time prices); "
                    "PaLM and Megatron-LM count it in full"}


@dataclass(frozen=True)
class StepFlops:
    """Model and hardware FLOPs of one training step, under one causal convention."""

    model_per_token: float  # 6 x active matmul parameters + the attention core (counts.flops_per_token)
    hardware_per_token: float  # model + what recomputation runs again (counts.recompute_flops_per_token)
    attention_per_token: float  # the attention core's share of model_per_token, under `causal`
    tokens_per_step: int  # global batch x sequence length
    causal: CausalFlops
    recompute: str

    @property
    def model_per_step(self) -> float:
        return self.model_per_token * self.tokens_per_step

    @property
    def hardware_per_step(self) -> float:
        return self.hardware_per_token * self.tokens_per_step

    def utilization(self, step_s: float, gpus: int, peak_flops: float) -> tuple[float, float]:
        """(MFU, HFU) of a step of `step_s` seconds on `gpus` GPUs of `peak_flops` each."""
        capacity = step_s * gpus * peak_flops
        return self.model_per_step / capacity, self.hardware_per_step / capacity

    def to_json(self) -> dict[str, float]:
        return {"model_per_token": self.model_per_token, "hardware_per_token": self.hardware_per_token,
                "model_per_step": self.model_per_step, "hardware_per_step": self.hardware_per_step}


def step_flops(cfg: Config, vocab_size: int, causal: CausalFlops = "full") -> StepFlops:
    """The FLOPs of one step of `cfg` (its model, seq_len, global_batch and recompute) with the
    padded vocabulary `vocab_size` (parallel/derive.py: padded_vocab)."""
    m, t = cfg.model, cfg.train
    f = flops_per_token(m, t.seq_len, vocab_size, causal)
    extra = recompute_flops_per_token(m, t.seq_len, t.recompute, vocab_size, causal)
    return StepFlops(model_per_token=f["total"], hardware_per_token=f["total"] + extra,
                     attention_per_token=f["attention"], tokens_per_step=t.global_batch * t.seq_len, causal=causal,
                     recompute=t.recompute)


def convention_row(f: StepFlops) -> Row:
    """The explain row naming the FLOP convention in use and its source."""
    return ("FLOP convention", f"causal_flops={f.causal}: per token model {f.model_per_token:.4e} (attention "
            f"{f.attention_per_token:.4e}), hardware {f.hardware_per_token:.4e} (recompute={f.recompute})",
            _SOURCES[f.causal] + "; recompute in HFU: Korthikanti et al. 2022")


def utilization_row(f: StepFlops, step_s: float, gpus: int, peak_flops: float) -> Row:
    mfu, hfu = f.utilization(step_s, gpus, peak_flops)
    capacity = f"({step_s:.4g} s x {gpus} x {peak_flops:.3e})"
    return ("MFU / HFU", f"model {f.model_per_step:.4e} / {capacity} = {mfu:.1%}; hardware "
            f"{f.hardware_per_step:.4e} / {capacity} = {hfu:.1%}",
            "MFU: PaLM (Chowdhery et al. 2022, App. B); HFU: recomputation counted (Korthikanti et al. 2022)")


_DECIMAL = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def parse_token_budget(text: str) -> float:
    """"15T" -> 15e12: decimal prefixes, as papers state token budgets (Llama 3's 15.6T, DeepSeek-V3's
    14.8T); "1.5e12" and plain numbers too. (--global-batch-tokens is binary: 4M = 4 x 2^20.)"""
    raw = text.strip().upper()
    scale = _DECIMAL.get(raw[-1:], 1.0)
    try:
        value = float(raw[:-1] if raw[-1:] in _DECIMAL else raw) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"--token-budget '{text}': give a positive token count such as 15T, 300B or 1.5e12")
    return value


@dataclass(frozen=True)
class Measured:
    """A run's throughput restated: MFU, HFU, tokens/s/GPU, and the cost of a token budget."""

    flops: StepFlops
    gpus: int
    peak_flops: float
    tokens_per_s: float  # the whole job's
    token_budget: float | None = None

    @property
    def step_time_s(self) -> float:
        return self.flops.tokens_per_step / self.tokens_per_s

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    @property
    def mfu(self) -> float:
        return self.flops.utilization(self.step_time_s, self.gpus, self.peak_flops)[0]

    @property
    def hfu(self) -> float:
        return self.flops.utilization(self.step_time_s, self.gpus, self.peak_flops)[1]

    @property
    def days(self) -> float | None:
        return None if self.token_budget is None else self.token_budget / self.tokens_per_s / 86400

    @property
    def gpu_hours(self) -> float | None:
        return None if self.token_budget is None else self.token_budget / self.tokens_per_s * self.gpus / 3600

    def to_json(self) -> dict[str, Any]:
        return {"mfu": self.mfu, "hfu": self.hfu, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
                "tokens_per_s": self.tokens_per_s, "step_time_s": self.step_time_s, "flops": self.flops.to_json(),
                "causal_flops": self.flops.causal, "token_budget": self.token_budget, "days": self.days,
                "gpu_hours": self.gpu_hours}


def measured(f: StepFlops, gpus: int, peak_flops: float, *, step_time_s: float | None = None,
             tokens_per_s: float | None = None, tflops: float | None = None,
             token_budget: float | None = None) -> Measured:
    """From exactly one of: a step's seconds, the whole job's tokens/s, or the achieved TFLOP/s per
    GPU in model FLOPs under f.causal (the MFU numerator's FLOPs, as papers quote them)."""
    given = {"--step-time": step_time_s, "--tokens-per-s": tokens_per_s, "--tflops": tflops}
    named = [k for k, v in given.items() if v is not None]
    if len(named) != 1:
        raise ValueError(f"a measured run takes one of --step-time, --tokens-per-s, --tflops (got {named or 'none'})")
    if given[named[0]] <= 0 or not math.isfinite(given[named[0]]):
        raise ValueError(f"{named[0]} = {given[named[0]]}: must be a positive number")
    if step_time_s is not None:
        tokens_per_s = f.tokens_per_step / step_time_s
    elif tflops is not None:
        tokens_per_s = tflops * 1e12 * gpus / f.model_per_token
    return Measured(f, gpus, peak_flops, tokens_per_s, token_budget)
