"""Mixed precision: the autocast compute dtype, and dynamic loss scaling for fp16.

Weights, gradients and optimizer state stay fp32 (the parameters are the fp32 master weights);
matrix products run in bf16 or fp16 under autocast. bf16 has fp32's exponent range and needs no
scaling. fp16 does: small gradients underflow to zero, so the loss is multiplied by a scale S
before backward and the gradients divided by S before the step. Dynamic scaling (Micikevicius et
al. 2018, "Mixed Precision Training") halves S and skips the step when a gradient overflows to
inf/NaN, and doubles it after `loss_scale_window` clean steps.
"""

from __future__ import annotations

import contextlib

import torch

from fivefold.config.schema import TrainConfig
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup


def compute_dtype(cfg: TrainConfig, device_type: str) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.dtype]


def autocast(cfg: TrainConfig, device_type: str) -> contextlib.AbstractContextManager:
    dtype = compute_dtype(cfg, device_type)
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)


class LossScaler:
    """Loss scaling for fp16; for any other dtype a scale of 1 that never skips."""

    def __init__(self, cfg: TrainConfig):
        self.enabled = cfg.dtype == "fp16"
        self.dynamic = self.enabled and cfg.loss_scale == 0
        self.scale = (cfg.loss_scale or 2.0 ** cfg.initial_scale_power) if self.enabled else 1.0
        self.window, self.min_scale = cfg.loss_scale_window, cfg.min_loss_scale
        self.clean_steps = 0

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor], groups: list[AxisGroup], device: torch.device | None = None) -> bool:
        """Divide gradients by the scale; True when all are finite on every rank.

        With gradients split over ranks each sees only its part, so the verdict is agreed over the
        groups they are split over: every rank must skip, or none. `device`: where those reductions
        run, when not where the gradients are (offload = "params" keeps them on the host).
        """
        if not self.enabled:
            return True
        bad = torch.zeros((), device=grads[0].device if grads else device)  # beside the gradients: no copies
        for g in grads:
            g.mul_(1.0 / self.scale)
            bad += (~torch.isfinite(g)).any().float()
        bad = bad.to(device) if device is not None else bad
        for group in groups:
            collectives.all_reduce(bad, group)
        return bool(bad == 0)

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        if not finite:
            self.scale, self.clean_steps = max(self.scale / 2, self.min_scale), 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.window:
            self.scale, self.clean_steps = self.scale * 2, 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])
