"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models"): the model's weights
frozen, a low-rank update trained beside chosen linear layers,

    y = x W^T + b + scaling x (dropout(x) A^T) B^T,    A (r, in), B (out, r),

scaling = alpha / r (or alpha / sqrt(r), rsLoRA: Kalajdzievski 2023). As PEFT initialises it
(init_lora_weights = True): A Kaiming-uniform (bound 1 / sqrt(in)), B zero, so training starts from
the frozen model's function exactly (model/seeded_init.py draws A by name, as every parameter).

Which layers: `lora.targets`, in the names PEFT users write (`PEFT_NAMES`: fivefold's module name ->
PEFT's). A target is an `nn.Linear` of the model; routed experts are stacked weights, no linear layers,
and get none. The adapter is the layer's `lora` (parameters `<layer>.lora.a`, `<layer>.lora.b`), the
layer's own weight keeps its name, so checkpoints of the base and Hugging Face conversion read it
as before. Everything but the adapters is frozen (requires_grad False): data parallel reduces and
the optimizer steps only what trains (parallel/data/: the buckets hold trainable parameters).
Tensor parallel splits each adapter the way its layer is split (parallel/tensor.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import PEFT_NAMES, LoRAConfig

LORA_A, LORA_B = ".lora.a", ".lora.b"  # the adapters' parameter names end so (seeded_init.py reads them)


class LoRA(nn.Module):
    """One layer's adapter: (..., in) -> (..., out), scaling x (dropout(x) A^T) B^T."""

    def __init__(self, in_features: int, out_features: int, cfg: LoRAConfig, device: torch.device | None = None):
        super().__init__()
        self.a = nn.Parameter(torch.empty(cfg.rank, in_features, device=device))  # (r, in): PEFT's lora_A
        self.b = nn.Parameter(torch.empty(out_features, cfg.rank, device=device))  # (out, r): PEFT's lora_B
        self.scaling = cfg.alpha / (math.sqrt(cfg.rank) if cfg.rslora else cfg.rank)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout:
            x = F.dropout(x, self.dropout, self.training)
        return F.linear(F.linear(x, self.a), self.b) * self.scaling  # (..., r) -> (..., out)


class LoRALinear(nn.Linear):
    """An nn.Linear whose frozen weight (and bias) is joined by an adapter: y = x W^T + b + lora(x)."""

    lora: LoRA

    @classmethod
    def around(cls, linear: nn.Linear, cfg: LoRAConfig) -> LoRALinear:
        """The layer's own weight and bias (the same parameters, frozen), with a new adapter."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight, out.bias = linear.weight, linear.bias
        out.lora = LoRA(linear.in_features, linear.out_features, cfg, linear.weight.device)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.lora(x)


def lora_targets(model: nn.Module, targets: tuple[str, ...]) -> list[str]:
    """The names of the model's linear layers that `targets` (PEFT names) select, in model order."""
    return [name for name, m in model.named_modules()
            if type(m) is nn.Linear and PEFT_NAMES.get(name.rsplit(".", 1)[-1]) in targets]


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Give every target layer an adapter and freeze everything else; the adapted layers' names.
    Before any dimension splits the model (tp splits each adapter with its layer)."""
    chosen = lora_targets(model, cfg.targets)
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, attr, LoRALinear.around(getattr(owner, attr), cfg))
    return chosen


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (what trains under LoRA)."""
    return name.endswith((LORA_A, LORA_B))
