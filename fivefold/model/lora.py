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

QLoRA (Dettmers et al. 2023; lora.base_dtype = "nf4"): once its values are loaded, each adapted
layer's frozen weight is replaced by its 4-bit NormalFloat form (torchao's NF4Tensor: 64-element
blocks, each block's absmax scale double-quantised to int8 in groups of 256 around their mean),
held as the buffers of `<layer>.nf4` (NF4Base), which checkpoints save as they are: a resumed run
computes with the very same base (re-quantising the dequantised weight is not the identity: the
scales' mean moves). Each use dequantises it into the compute dtype; the backward dequantises again
rather than keep the dense weight alive between the passes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.config import NF4_BLOCK, NF4_GROUP, NF4_SCALER_BLOCK, PEFT_NAMES, LoRAConfig

LORA_A, LORA_B = ".lora.a", ".lora.b"  # the adapters' parameter names end so (seeded_init.py reads them)
NF4 = ".nf4."  # an NF4 base's buffers: <layer>.nf4.codes, .scales, .scale_factor, .scale_mean


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
        return self.up(F.linear(x, self.a))  # (..., in) -> (..., r) -> (..., out)

    def up(self, u: torch.Tensor) -> torch.Tensor:
        """The second half, from x A^T (..., r), which tp_overlap's region entry computes with the base's
        matmuls (parallel/tensor.py): scaling u B^T, (..., out)."""
        return F.linear(u, self.b) * self.scaling


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
        nf4 = self._modules.get("nf4")
        if nf4 is None:
            return super().forward(x) + self.lora(x)
        y = NF4Linear.apply(x.to(compute_dtype(x)), nf4)  # (..., out), in the compute dtype
        return (y if self.bias is None else y + self.bias) + self.lora(x)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of x computes in: autocast's where it is on, else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class NF4Base(nn.Module):
    """A frozen (out, in) weight in NF4: its codes two to a byte, (out, in / 2) uint8; one int8 scale per
    64-element block, each group of 256 with its factor, around one mean (the weight's dtype); no
    parameter (nothing to train, reduce or step)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        q = to_nf4(weight.detach().contiguous(), NF4_BLOCK, NF4_SCALER_BLOCK)
        self.shape = tuple(weight.shape)
        self.register_buffer("codes", q.quantized_data.view(weight.shape[0], -1))  # (out, in / 2) uint8
        self.register_buffer("scales", q.quantized_scalers)  # (numel / 64,) int8
        self.register_buffer("scale_factor", q.quantization_factor)  # (numel / 16384,)
        self.register_buffer("scale_mean", q.scaler_mean)  # ()
        self.register_buffer("levels", q.nf4, persistent=False)  # the 16 NF4 values (torchao's table)

    def tensor(self):
        """The torchao NF4Tensor these buffers are."""
        return nf4_tensor(self.codes, self.scales, self.scale_factor, self.scale_mean, self.levels)

    @torch.no_grad()
    def dequantise(self) -> torch.Tensor:
        return self.tensor().get_original_weight()  # (out, in), the original weight's dtype


def nf4_tensor(codes: torch.Tensor, scales: torch.Tensor, factor: torch.Tensor, mean: torch.Tensor,
               levels: torch.Tensor | None = None):
    """torchao's NF4Tensor from its parts (as NF4Base holds them, or a checkpoint saved them)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs, to_nf4

    if levels is None:  # the table to_nf4 quantises with, in the weight's dtype
        levels = to_nf4(torch.zeros(NF4_GROUP, dtype=mean.dtype, device=mean.device)).nf4
    shape = (codes.shape[0], codes.shape[1] * 2)
    meta = SubclassTensorArgs(torch.Size(shape), (shape[1], 1), 0, mean.dtype, codes.device, False)
    return NF4Tensor(meta, NF4_BLOCK, scales.numel(), NF4_SCALER_BLOCK, scales, factor, mean,
                     codes.flatten(), levels)


class NF4Linear(torch.autograd.Function):
    """x W^T with W dequantised at each use, in x's dtype, not saved for the backward (made again)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, base: NF4Base) -> torch.Tensor:
        ctx.base = base
        with torch.autocast(x.device.type, enabled=False):  # x is already in the compute dtype
            return F.linear(x, base.dequantise().to(x.dtype))  # (..., in) -> (..., out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ ctx.base.dequantise().to(grad.dtype), None  # (..., out) -> (..., in)


def quantise_base(model: nn.Module) -> list[str]:
    """Replace each adapted layer's frozen weight by its NF4 form (lora.base_dtype = "nf4"), from the
    values it holds now; the layers' names. The dense weight is released layer by layer."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear) and "nf4" not in m._modules:
            nf4 = NF4Base(m.weight)
            m.weight = None  # the parameter goes (data parallel's buckets hold only what trains)
            m.nf4 = nf4
            names.append(name)
    return names


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
