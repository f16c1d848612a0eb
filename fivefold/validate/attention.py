"""Config checks of what attention sees (model/masks.py): sliding windows, their per-layer pattern,
and a kernel that can do them, sinks and packed documents. Part of `validate()` (validate/__init__.py)."""

from __future__ import annotations

from fivefold.config.schema import Config

PATTERN = ("sliding", "full")


def _window_errors(cfg: Config) -> list[str]:
    m, seq_len = cfg.model, cfg.train.seq_len
    errors = []
    if m.attention.window < 0 or (m.attention.window == 0 and m.attention.window_pattern):
        what = ("sliding layers in model.attention.window_pattern need" if m.attention.window_pattern
                else "a sliding window needs")
        errors.append(f"model.attention.window = {m.attention.window}: {what} a window of at least 1 token "
                      f"(Mistral: 4096, Gemma 3: 1024, gpt-oss: 128); or leave window = 0 and "
                      f"window_pattern = [] for full attention")
    elif m.attention.window >= seq_len:
        errors.append(f"model.attention.window = {m.attention.window} is not shorter than train.seq_len = {seq_len}: "
                      f"no query would lose a key; set window = 0 or below {seq_len}")
    unknown = sorted({p for p in m.attention.window_pattern if p not in PATTERN})
    if unknown:
        errors.append(f"model.attention.window_pattern holds {unknown}: each entry is 'sliding' or 'full' "
                      f"(Gemma 3: five 'sliding' then one 'full')")
    elif m.attention.window_pattern and m.n_layers % len(m.attention.window_pattern):
        errors.append(f"model.attention.window_pattern has {len(m.attention.window_pattern)} entries, which do not "
                      f"divide model.n_layers = {m.n_layers}: the pattern repeats over the layers; give one whose "
                      f"length divides {m.n_layers}")
    return errors


def _backend_errors(cfg: Config) -> list[str]:
    m, masked = cfg.model, cfg.data.document_mask
    errors = []
    if m.attention.backend == "sdpa":
        needs = [name for name, on in (("data.document_mask", masked), ("model.attention.window", m.attention.window),
                                       ("model.attention.sinks", m.attention.sinks)) if on]
        if needs:
            errors.append(f"model.attention.backend = 'sdpa' does causal attention only, not {', '.join(needs)}; "
                          f"use 'auto' (FlexAttention on CUDA, the exact blockwise path elsewhere)")
    if m.attention.backend == "flex":
        import torch  # here: the planner validates configs and imports no torch

        device = cfg.train.device
        if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
            errors.append("model.attention.backend = 'flex' trains on CUDA only (torch has no FlexAttention "
                          "backward on CPU); use 'auto' or 'blockwise' on this machine")
    return errors


def attention_errors(cfg: Config) -> list[str]:
    """Windows, their pattern, and a backend that can do them and documents. (Documents need an
    end-of-document id: the data checks refuse a tokenizer or token files without one.)"""
    return _window_errors(cfg) + _backend_errors(cfg)
