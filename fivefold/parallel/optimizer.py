"""The optimizer over a parallel layout: AdamW (or Muon with AdamW, muon.py) on what data parallel
says it steps, and the global gradient norm over the groups the gradients are split across.

Data parallel decides what the optimizer steps (`optimizer_params()`: the parameters for DDP,
fp32 shards for ZeRO), so the optimizer lives beside the dimensions: `parallelize()` builds it and
`Parallelized.optimizer_step` clips and steps it. The learning-rate schedule is the training
loop's (train/lr_schedule.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch
from torch import nn

from fivefold.config.schema import OptimConfig
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.muon import build_muon

if TYPE_CHECKING:
    from fivefold.parallel.data import DataParallel
    from fivefold.parallel.mesh import Mesh


def fused_on(device: torch.device) -> bool:
    """Whether AdamW runs fused on `device`: on CUDA, one kernel for every tensor, its step counter on
    the device and a non-finite step skipped there (`found_inf`), so the step needs no host read.
    Elsewhere foreach (the CPU's fused kernel rounds differently from the per-tensor one by an ulp;
    foreach's is bitwise the same, measured on torch 2.13)."""
    return device.type == "cuda"


def layout_optimizer(dp: DataParallel, mesh: Mesh, cfg: OptimConfig) -> torch.optim.Optimizer:
    """optim.name's optimizer over what data parallel steps (`dp.optimizer_params()`): AdamW, or Muon on
    the hidden matrices' pieces with AdamW on the rest (muon.py)."""
    if cfg.name == "muon":
        return build_muon(dp, mesh, cfg, build_optimizer)
    return build_optimizer(dp.optimizer_params(), cfg)


def build_optimizer(params: nn.Module | Iterable[torch.Tensor], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over a module's parameters or the given tensors (ZeRO steps fp32 shards); norms and
    biases (1-D tensors, and the experts' stacked biases, marked `no_decay`) get no weight decay, as in
    GPT-3 and Llama. Fused on CUDA, foreach elsewhere (`fused_on`)."""
    tensors = [p for p in params.parameters() if p.requires_grad] if isinstance(params, nn.Module) else list(params)
    decays = [p.ndim >= 2 and not getattr(p, "no_decay", False) for p in tensors]
    groups = [
        {"params": [p for p, d in zip(tensors, decays, strict=True) if d], "weight_decay": cfg.weight_decay},
        {"params": [p for p, d in zip(tensors, decays, strict=True) if not d], "weight_decay": 0.0},
    ]
    # an empty group (LoRA trains no norm) would fail torch's state-dict load, which names each group by
    # its first parameter (DDP's checkpoints load through get/set_optimizer_state_dict)
    groups = [g for g in groups if g["params"]] or groups[:1]
    fused = bool(tensors) and fused_on(tensors[0].device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=fused or None, foreach=not fused)


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state AdamW (and Muon) creates at its first step, made now for the tensors that have none:
    what a checkpoint describes and a resumed optimizer loads into (each continues from it exactly as
    it would have started). Not done before it is needed: at startup it would be 2x the shards."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if group.get("kind") == "muon" and not optimizer.state.get(p):
                optimizer.state[p] = {"momentum_buffer": torch.zeros_like(p)}
            elif not optimizer.state.get(p):
                # where AdamW keeps it: on the device when fused (or capturable), else on the CPU
                on_device = group.get("fused") or group.get("capturable")
                step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                optimizer.state[p] = {"step": step, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step; Muon's group at its own peak's ratio (optim.muon.lr)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float, groups: list[AxisGroup] = (),
                   counted_elsewhere: list[torch.Tensor] = (),
                   split_further: tuple[list[torch.Tensor], list[AxisGroup], list[AxisGroup]] | None = None,
                   device: torch.device | None = None) -> torch.Tensor:
    """Scale gradients so their global L2 norm is at most max_norm (0: no clipping); return the norm,
    a 0-dim float64 tensor on `device` (None: the gradients'): nothing here waits for the device.

    With plain data parallel every rank holds the whole summed gradient, so the local norm is the
    global one. Gradients split over ranks (ZeRO shards, pipeline stages) pass the groups they are
    split over: the partial sums of squares are added over them before the square root, so each
    element counts exactly once; `counted_elsewhere` are copies another rank already counts (a tied
    embedding on the last pipeline stage): they are scaled but not counted. `split_further`:
    (some of `grads`, the groups they alone are split over, the groups only the others are split
    over): experts over ep (and with ZeRO their shards over expert_dp) while the dense gradients'
    ZeRO shards are over dp_shard; `groups` are then the ones both are split over (pp, tp).

    Each tensor's norm is taken in float64 without a float64 copy of it (torch._foreach_norm
    accumulates in the dtype it is given); their squares are summed in float64. A non-finite norm
    leaves the gradients as they are (the step is skipped; the caller names the culprits from them).
    With offload = "params" the gradients are on the host and `device` is the mesh's: the partial
    sums are taken on the host and go to the device for the reductions, the same float64 numbers.
    """
    here = grads[0].device if grads else device
    device = device or here
    further, further_groups, dense_groups = split_further or ([], [], [])
    counted = [g for g in grads if not any(g is other for other in counted_elsewhere)]
    sq = _sum_of_squares([g for g in counted if not any(g is other for other in further)], here).to(device)
    sq_further = _sum_of_squares([g for g in counted if any(g is other for other in further)], here).to(device)
    for group in dense_groups:
        collectives.all_reduce(sq, group)
    for group in further_groups:
        collectives.all_reduce(sq_further, group)
    sq += sq_further
    for group in groups:
        collectives.all_reduce(sq, group)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        # min(1, max_norm / (norm + 1e-6)) in float64, then float32 as a Python scale would be; 1 when not finite
        scale = torch.where(torch.isfinite(norm), (max_norm / (norm + 1e-6)).clamp(max=1.0), 1.0)
        torch._foreach_mul_(grads, scale.to(here, grads[0].dtype))
    return norm


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    """Sum over `grads` of their squared L2 norms, () float64 on `device`."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).square().sum()
