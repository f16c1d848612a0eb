"""FLOP conventions: model FLOPs (MFU) beside hardware FLOPs (HFU), and the measured mode.

- MFU = model FLOPs / (step x GPUs x peak) (PaLM, Chowdhery et al. 2022, App. B): the FLOPs the
  model needs, however the system runs them; recomputation does not count.
- HFU = hardware FLOPs / (step x GPUs x peak): the FLOPs the GPUs run, recomputation included (full:
  one more forward of the blocks; selective: the attention core's forward again, or under
  torchtitan's per-op policy, PlanOptions.selective_ac, every other matmul of each block). Not the
  loss's own recompute (model/head.py: its backward makes each chunk's logits again, one head matmul,
  2 V d per token): like FlashAttention's backward, which makes the attention scores again and
  which no HFU counts, it is the kernel's way to save memory, not the activation recomputation
  HFU names; Narayanan et al.'s F, whose HFU figures the tests reproduce, has the head once
  forward and twice backward. The step time prices it (roofline.chunk_price, ChunkWork's
  loss_recompute_flops). Korthikanti et al. 2022 report both; Narayanan et al. 2021's Megatron-LM
  figures are hardware FLOPs with full recompute, F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
- causal attention in the numerator: counted in full (PaLM, Megatron: the default) or halved for the
  masked half the kernels skip (PlanOptions.causal_flops). Only the report changes: the step time
  always prices the half the kernels run (compute.py).
- masks beyond causality (sliding windows, documents): counted as the pairs they keep
  (model/mask_counts.py), under either causal convention ("full" doubles them as it doubles the
  causal half). Not the causal full sequence, which published MFU formulas count: those predate
  such masks, and at long context they charge what no kernel runs (a window of 128 tokens at
  131,072 or documents of 2k in a row of 128k keep 0.2% and 3% of the causal pairs), so a step
  that runs at half the peak would report an MFU of several hundred percent. Kept pairs are the
  FLOPs the model needs for those tokens, as an MoE's model FLOPs count only the experts a token
  uses, and the step time prices the same pairs. The causal-full-sequence figure is shown beside
  it (convention_row) for comparison with published runs.

- LoRA (lora.rank): model FLOPs are the work LoRA training needs, not 6 N: the frozen base's forward and
  input gradients (4 per active matmul weight and token: its weight gradients are never computed, and
  counting them would report FLOPs no GPU runs) and the adapters' 6 per parameter (lora_step.py).

The measured mode turns a run's step time, tokens/s or achieved TFLOP/s into MFU, HFU and, with a
token budget, days and GPU-hours, with no layout to search: a paper's claim checked by arithmetic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from fivefold.config.schema import Config
from fivefold.model.counts import CausalFlops, flops_per_token, recompute_flops_per_token
from fivefold.planner.lora_step import lora_flops_per_token
from fivefold.planner.machine.ops import PER_OP_RERUN, RankShapes, block_ops
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
    unmasked_attention_per_token: float = 0.0  # the same without windows and documents (the causal full sequence)
    masks: str = ""  # the masks beyond causality, in words ("" for causality alone)

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


def masks_in_words(cfg: Config, document_tokens: float = 0) -> str:
    """The masks beyond causality the step's attention runs ("" for causality alone)."""
    m, seq = cfg.model, cfg.train.seq_len
    words = []
    sliding = sum(1 for layer in range(m.n_layers) if 0 < m.attention.layer_window(layer) < seq)
    if sliding:
        words.append(f"a window of {m.attention.window} tokens in {sliding} of {m.n_layers} layers")
    if cfg.data.document_mask:
        words.append(f"documents of mean {document_tokens:g} tokens (geometric lengths)" if document_tokens
                     else "documents of unstated length, priced as the whole row (--document-tokens N states it)")
    return "; ".join(words)


def per_op_recompute_flops_per_token(cfg: Config) -> float:
    """FLOPs per token torchtitan's per-op selective recompute runs again (roofline.py): the second,
    fourth, ... matmul of each block in forward order, counted on one whole sequence at tp = 1."""
    m, seq = cfg.model, cfg.train.seq_len
    shapes = RankShapes(tokens=seq, sp_tokens=seq, seq_len=seq, kernel_seq=seq)
    kinds = {0: m.moe.first_dense_layers if m.moe.n_experts else m.n_layers}  # a block of each kind: how many
    if m.moe.n_experts and m.moe.first_dense_layers < m.n_layers:
        kinds[m.moe.first_dense_layers] = m.n_layers - m.moe.first_dense_layers
    rerun = sum(n * sum(mm.flops for mm in block_ops(m, layer, shapes).matmuls[PER_OP_RERUN])
                for layer, n in kinds.items() if n)
    return rerun / seq


def step_flops(cfg: Config, vocab_size: int, causal: CausalFlops = "full", document_tokens: float = 0,
               per_op: bool = False) -> StepFlops:
    """The FLOPs of one step of `cfg` (its model, seq_len, global_batch and recompute) with the
    padded vocabulary `vocab_size` (config/derive.py: padded_vocab), its sliding windows and,
    under data.document_mask, documents of mean length `document_tokens` counted as kept; `per_op`:
    selective recompute as torchtitan's per-op policy (PlanOptions.selective_ac)."""
    m, t = cfg.model, cfg.train
    docs = document_tokens if cfg.data.document_mask else 0
    f = flops_per_token(m, t.seq_len, vocab_size, causal, docs)
    extra = (per_op_recompute_flops_per_token(cfg) if per_op and t.recompute == "selective"
             else recompute_flops_per_token(m, t.seq_len, t.recompute, vocab_size, causal, docs))
    saved, adapters = lora_flops_per_token(cfg, vocab_size)  # LoRA: the work it needs (lora_step.py)
    f = {**f, "total": f["total"] - saved + adapters}
    extra += adapters / 3 if t.recompute == "full" else 0.0  # the adapters' forward again
    unwindowed = dataclasses.replace(m, attention=dataclasses.replace(m.attention, window=0))
    unmasked = flops_per_token(unwindowed, t.seq_len, vocab_size, causal)
    return StepFlops(model_per_token=f["total"], hardware_per_token=f["total"] + extra,
                     attention_per_token=f["attention"], tokens_per_step=t.global_batch * t.seq_len, causal=causal,
                     recompute=t.recompute, unmasked_attention_per_token=unmasked["attention"],
                     masks=masks_in_words(cfg, docs))


def kept_attention(f: StepFlops, ratio: float) -> StepFlops:
    """`f` with its attention core scaled by `ratio` (the keys a step's mask really kept over those
    the formula charged: train/utilization.py's documents), in the model FLOPs and, where
    recomputation runs the attention's forward again (counts.recompute_flops_per_token: a third of
    it, under "full" and "selective"), in the hardware FLOPs too."""
    delta = f.attention_per_token * (ratio - 1)
    rerun = delta / 3 if f.recompute in ("full", "selective") else 0.0
    return dataclasses.replace(f, model_per_token=f.model_per_token + delta,
                               hardware_per_token=f.hardware_per_token + delta + rerun,
                               attention_per_token=f.attention_per_token + delta)


def convention_row(f: StepFlops) -> Row:
    """The explain row naming the FLOP convention in use and its source, and for masks beyond
    causality what counting the causal full sequence would give instead."""
    text = (f"causal_flops={f.causal}: per token model {f.model_per_token:.4e} (attention "
            f"{f.attention_per_token:.4e}), hardware {f.hardware_per_token:.4e} (recompute={f.recompute})")
    source = _SOURCES[f.causal] + "; recompute in HFU: Korthikanti et al. 2022"
    if f.masks:
        text += (f"; masks: {f.masks}, attention counted as the pairs they keep, "
                 f"{f.attention_per_token / f.unmasked_attention_per_token:.2%} of the causal full sequence's "
                 f"{f.unmasked_attention_per_token:.4e}")
        source += ("; masks counted as kept, not as the causal full sequence published formulas count: "
                   "planner/flops.py says why, model/mask_counts.py how")
    return ("FLOP convention", text, source)


def utilization_row(f: StepFlops, step_s: float, gpus: int, peak_flops: float) -> Row:
    mfu, hfu = f.utilization(step_s, gpus, peak_flops)
    capacity = f"({step_s:.4g} s x {gpus} x {peak_flops:.3e})"
    text = (f"model {f.model_per_step:.4e} / {capacity} = {mfu:.1%}; hardware "
            f"{f.hardware_per_step:.4e} / {capacity} = {hfu:.1%}")
    if f.masks:
        unmasked = (f.model_per_token - f.attention_per_token + f.unmasked_attention_per_token) * f.tokens_per_step
        text += f"; counting the causal full sequence instead: {unmasked / (step_s * gpus * peak_flops):.1%}"
    return ("MFU / HFU", text,
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
