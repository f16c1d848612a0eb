"""The learning-rate schedules: linear warmup, then cosine, warmup-stable-decay or constant."""

from __future__ import annotations

import math

from fivefold.config.schema import OptimConfig


def lr_at(step: int, cfg: OptimConfig, steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `steps` (train.steps): linear warmup, then the
    chosen decay.

    cosine: from lr down to min_lr_ratio x lr over the steps after warmup.
    wsd (warmup-stable-decay, Hu et al. 2024 "MiniCPM"): hold lr, then decay linearly to the
    minimum over the last decay_fraction of the steps.
    """
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return peak
    if cfg.lr_schedule == "cosine":
        span = max(1, steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_steps = max(1, round(cfg.decay_fraction * steps))
    decay_start = steps - decay_steps
    if step < decay_start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - decay_start + 1) / decay_steps)
