"""What the device did in a logged step: achieved TFLOP/s, MFU and HFU, and the allocator's peaks.

FLOPs follow the planner's convention (planner/flops.py, model/counts.py), so a measured MFU and a
predicted one divide the same numerator:
- model FLOPs: 6 x the active matmul parameters per token (an MoE counts its top_k routed experts,
  GQA its narrower K/V projections) plus the attention core;
- causal attention counted in full, as PaLM (Chowdhery et al. 2022, App. B) and Megatron-LM count
  it ("full": the T x T square; the planner's default `causal_flops`);
- sliding windows counted as the pairs they keep (exact, by formula); documents (data.document_mask)
  as the pairs the mask keeps in rank 0's own rows of the step (`document_keys`), the only rows
  this rank sees: the other data-parallel ranks' rows are assumed alike;
- hardware FLOPs (HFU): the model's plus what train.recompute runs again (Korthikanti et al. 2022).

Achieved TFLOP/s is per rank: the step's model FLOPs over the whole job / rank 0's step time /
ranks. MFU divides it by one device's peak, taken from (first that applies) train.peak_tflops,
the calibrated profile of run.hardware, or the planner's catalog entry of the CUDA device torch
reports; with none, MFU and HFU are left out (None) and `peak_from` says so (None).

Memory is read at the logging step's one existing read from the device (step.train_step): on CUDA
the caching allocator's peak allocated and reserved bytes and its retries (cudaMalloc failures
that freed the cache and tried again) since the last logging step, then reset; on a CPU the
process's peak resident set, which the kernel keeps for the process's lifetime (no reset).
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch

from fivefold.config.schema import Config
from fivefold.model.counts import attention_keys
from fivefold.model.masks import document_ids
from fivefold.planner.flops import StepFlops, kept_attention, step_flops

CAUSAL = "full"  # the MFU numerator's causal convention (planner/flops.py)


@dataclass(frozen=True)
class Peak:
    """One device's peak FLOP/s and where it came from."""

    flops: float | None  # None: unknown, MFU left out
    source: str | None  # "catalog:<entry>", "profile", "setting", or None


def peak_of(cfg: Config, device: torch.device) -> Peak:
    """The peak one device's MFU divides by: the explicit setting, the run's calibrated profile, the
    catalog entry of the CUDA device torch reports, in that order; Peak(None, None) without any."""
    if cfg.train.peak_tflops > 0:
        return Peak(cfg.train.peak_tflops * 1e12, "setting")
    if cfg.run.hardware:
        from fivefold.planner.hardware import load_profile

        return Peak(load_profile(cfg.run.hardware).peak_flops, "profile")
    return catalog_peak(device)


def catalog_peak(device: torch.device) -> Peak:
    """The planner's catalog entry of the CUDA device torch reports (dense bf16); Peak(None, None) on
    a CPU, or for a GPU the catalog lacks (a PCIe H100, an L4)."""
    if device.type != "cuda":
        return Peak(None, None)
    from fivefold.planner.calibration.gpu import catalog_key
    from fivefold.planner.machine.datasheet import get_hardware

    try:
        key = catalog_key(torch.cuda.get_device_name(device))
    except ValueError:
        return Peak(None, None)
    return Peak(get_hardware(key).peak_flops, f"catalog:{key}")


def run_flops(cfg: Config, vocab_size: int) -> StepFlops:
    """One step's FLOPs by formula: windows counted as kept, documents not (document_keys adds them)."""
    return step_flops(cfg, vocab_size, CAUSAL, document_tokens=0)


def formula_keys(cfg: Config) -> float:
    """Keys per query summed over blocks as run_flops charges them (windows, no documents)."""
    return sum(attention_keys(cfg.model, cfg.train.seq_len))


def document_keys(cfg: Config, rows: list[torch.Tensor], eod: int) -> float:
    """Keys per query summed over blocks that the document mask keeps in these host rows of token
    ids (each (B, T)): per block, its window's kept pairs of every document (model/mask_counts.py's
    n w - w (w - 1) / 2, w the window or the document's length) over the rows' tokens."""
    tokens = torch.cat(rows)  # (R, T)
    R, T = tokens.shape
    doc = document_ids(tokens, eod)  # (R, T)
    flat = doc + torch.arange(R).unsqueeze(1) * T  # (R, T): one id per (row, document)
    lengths = torch.bincount(flat.reshape(-1), minlength=R * T).double()  # (R T,): 0 for unused ids
    m = cfg.model
    pairs = {}
    for w in {m.attention.layer_window(layer) for layer in range(m.n_layers)}:
        kept = torch.where((w > 0) & (lengths > w), torch.full_like(lengths, float(w)), lengths)  # (R T,)
        pairs[w] = float((lengths * kept - kept * (kept - 1) / 2).sum())
    return sum(pairs[m.attention.layer_window(layer)] for layer in range(m.n_layers)) / (R * T)


def utilization(flops: StepFlops, step_s: float, ranks: int, peak: Peak, keys: float | None = None,
                formula: float = 0.0) -> dict[str, Any]:
    """The step record's "utilization": achieved model and hardware TFLOP/s per rank, MFU and HFU
    against `peak` (None without one). `keys`: the document mask's kept keys per query (summed over
    blocks) for this step, replacing the formula's `formula`."""
    if keys is not None and formula > 0:
        flops = kept_attention(flops, keys / formula)
    model = flops.model_per_step / step_s / ranks  # FLOP/s per rank
    hardware = flops.hardware_per_step / step_s / ranks
    return {"achieved_tflops": model / 1e12, "hardware_tflops": hardware / 1e12,
            "mfu": model / peak.flops if peak.flops else None, "hfu": hardware / peak.flops if peak.flops else None,
            "peak_tflops": peak.flops / 1e12 if peak.flops else None, "peak_from": peak.source}


def memory_peaks(device: torch.device) -> dict[str, int]:
    """The step record's "memory", read on the host (the allocator's counters, no device sync). On
    CUDA the peaks are reset, so the next logging step reports its own window; "alloc_retries" is
    the process's count so far (StepLog turns it into the window's: resetting the accumulated
    counters would also zero num_ooms, which others read)."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        out = {"peak_allocated_bytes": int(stats.get("allocated_bytes.all.peak", 0)),
               "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
               "alloc_retries": int(stats.get("num_alloc_retries", 0))}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    # ru_maxrss: KiB on Linux, bytes on macOS (getrusage(2) of each)
    scale = 1 if sys.platform == "darwin" else 1024
    return {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale}
