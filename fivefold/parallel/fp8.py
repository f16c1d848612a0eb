"""FP8 training (`train.fp8`): the blocks' linear layers compute their three matmuls in FP8.

Each matmul of y = x W^T (forward), dx = dy W and dW = dy^T x (backward) multiplies two FP8
operands with dynamic scales and accumulates in higher precision (`torch._scaled_mm`), as in
Micikevicius et al. 2022, "FP8 Formats for Deep Learning": an operand t is stored as
q = fp8(t * s) with s = FP8_MAX / amax(t), so its largest element lands at the format's largest
value, and the product is multiplied back by 1 / (s_a s_b). Quantization is straight-through: the
gradient treats it as the identity. The fp32 master weights, the optimizer, the embedding, the
output head, the MoE router and the routed experts are untouched, so checkpoints are what they are
without FP8 and reshard as ever.

Recipes (the facts of torchao's float8 training, which names them the same):
- "tensorwise": one scale per tensor; activations and weights in e4m3 (3 mantissa bits, max 448),
  the output gradient in e5m2 (2 bits, max 57344: gradients span a wider range).
- "rowwise": one scale per row of each operand along the contraction dimension (per token of x
  and per output feature of W in forward, ...), every operand in e4m3 and every scale rounded
  down to a power of two, so scaling itself adds no rounding.

What is reduced where. FP8 is deterministic given the scales, so a layout reproduces one process
(running the same micro-batches) exactly when every amax is taken over the same elements as
there: each amax is MAX-all-reduced over exactly the mesh axes that split the dimensions it is
taken over, and over nothing else.

    tensor   dims                  split by
    x        tokens x in           tokens: cp (and tp under sp, outside tp regions); in: tp (row-parallel)
    W        out x in              out: tp (column-parallel); in: tp (row-parallel)
    dy       tokens x out          tokens: as x; out: tp (column-parallel)

A tensorwise amax covers all of a tensor's dimensions, so it is reduced over every axis splitting
either; a rowwise amax covers only the contraction dimension, so it is reduced over the axis that
splits that one (x's rows in forward: tp for a row-parallel layer; x's columns in dW: cp).
Data parallel is never reduced over: each rank's micro-batches are a single process's micro-batches
(the loader slices a global batch contiguously), and a dp all-reduce per matmul would cost what it
saves. ZeRO-3 gathers whole weights before they are used, so it changes nothing here; with
`parallel.fp8_gather` it gathers them already in FP8 (data/fp8_gather.py): each weight's amax is
then the MAX over its ZeRO shards and its tp splits, the same number, so the same FP8 values, in a
quarter of fp32's bytes on the wire. The layer's matmuls read them (`Float8Weight`) instead of
quantizing a weight that was never gathered in full precision.

Why our own autograd Function rather than torchao's Float8Linear: torchao reduces an amax over
ranks only for DTensors; fivefold's tensor, sequence and context parallel split plain tensors, so a
column-parallel slice would be scaled by its own amax and no layout would reproduce one process.
The Function is also one node to the zero-bubble split (pipeline/split_backward.py): its backward
computes dx and dW together, so I and W each run it whole (correct; the W half of it is repeated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fivefold.config.schema import Config
from fivefold.model.lora import LoRALinear
from fivefold.model.moe import MoE
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.mesh import Mesh

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass
class Float8Weight:
    """A weight ZeRO-3 gathered in FP8 (parallel.fp8_gather, data/fp8_gather.py): its e4m3 values and
    inverse scale, refilled at each gather and dropped when the unit is freed."""

    q: torch.Tensor | None = None  # (N, K) e4m3
    inv_scale: torch.Tensor | None = None  # () fp32

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q is None:
            raise RuntimeError("an FP8 weight gathered by parallel.fp8_gather was used after its unit was freed: "
                               "set parallel.fp8_gather = false")
        return self.q, self.inv_scale


@dataclass(frozen=True)
class Float8Scaling:
    """How one linear layer scales its operands, and the groups (of size > 1) splitting each dim."""

    recipe: str  # "tensorwise" | "rowwise"
    tokens: tuple[AxisGroup, ...] = ()  # split the rows of x and dy
    inputs: tuple[AxisGroup, ...] = ()  # split the input features (W's columns, x's columns)
    outputs: tuple[AxisGroup, ...] = ()  # split the output features (W's rows, dy's columns)

    @property
    def grad_dtype(self) -> torch.dtype:
        return E5M2 if self.recipe == "tensorwise" else E4M3


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, groups: tuple[AxisGroup, ...],
             power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """t in FP8 and its inverse scale (t ~ q x inv): one scale for the tensor (dim None) or one per
    slice along the other dim (dim = the contraction dim, kept as size 1), the amax MAX-reduced
    over `groups`, the ranks holding the rest of what it is taken over."""
    amax = (t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)).float()  # () | (M, 1) | (1, K)
    for group in groups:
        collectives.all_reduce(amax, group, op=dist.ReduceOp.MAX)
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp(min=1e-12)
    if power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """(a @ b) x scale_a x scale_b in out_dtype, FP8 operands a (M, K) and b (K, N), fp32 accumulation.

    On CUDA: torch._scaled_mm, the FP8 tensor-core GEMM. Elsewhere the same arithmetic on fp32
    units: FP8 values are exact in fp32 and so are their products (4 x 4 significant bits), so this
    differs from the FP8 GEMM only in the order of the fp32 sums, and a CPU run does not depend on
    which FP8 kernel its torch build has. (torch 2.13's CPU _scaled_mm takes 2 to 3 times an fp32
    matmul's time at 256 x 64 x 192 and 256 x 128 x 384, measured; an earlier reading of 2,400
    times did not reproduce.)"""
    if a.device.type == "cuda":
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    with torch.autocast(a.device.type, enabled=False):  # autocast would make the sums bf16's
        return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


def _column_major(q: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column by column: _scaled_mm's second operand (cuBLASLt's layout)."""
    return q.t().contiguous().t()


class _Float8Matmul(torch.autograd.Function):
    """y = x W^T with all three matmuls in FP8; x (M, K), W (N, K), y (M, N) in `out_dtype`."""

    @staticmethod
    def forward(ctx, x, weight, scaling: Float8Scaling, out_dtype: torch.dtype, gathered: Float8Weight | None):
        rowwise = scaling.recipe == "rowwise"
        dim = 1 if rowwise else None  # the contraction dim K, or the whole tensor
        x_groups = scaling.inputs if rowwise else scaling.tokens + scaling.inputs
        w_groups = scaling.inputs if rowwise else scaling.inputs + scaling.outputs
        qx, sx = quantize(x, E4M3, dim, x_groups, rowwise)  # (M, K), () | (M, 1)
        # (N, K), () | (N, 1): gathered in FP8 (tensorwise only), or quantized here
        qw, sw = gathered.get() if gathered is not None else quantize(weight, E4M3, dim, w_groups, rowwise)
        y = scaled_mm(qx, qw.t(), sx, sw.view(1, -1) if rowwise else sw, out_dtype)  # (M, N)
        # tensorwise keeps x in FP8 (a quarter of fp32's bytes): dW's x has the same one scale;
        # rowwise needs x again, scaled along the other dim. W is quantized again in backward
        # rather than kept: under ZeRO-3 a kept copy would hold every gathered weight until backward.
        ctx.save_for_backward(*((x, weight) if rowwise else (qx, sx, weight)))
        ctx.scaling, ctx.x_dtype, ctx.gathered = scaling, x.dtype, gathered
        return y

    @staticmethod
    def backward(ctx, dy):
        s = ctx.scaling
        dy = dy.contiguous()  # (M, N)
        if s.recipe == "rowwise":
            x, weight = ctx.saved_tensors
            qg, sg = quantize(dy, E4M3, 1, s.outputs, True)  # dx contracts over N: (M, 1)
            qw, sw = quantize(weight, E4M3, 0, s.outputs, True)  # (1, K)
            dx = scaled_mm(qg, _column_major(qw), sg, sw, dy.dtype)  # (M, K)
            dw = None
            if ctx.needs_input_grad[1]:  # none for a frozen weight (LoRA's base)
                qgt, sgt = quantize(dy, E4M3, 0, s.tokens, True)  # dW contracts over M: (1, N)
                qxt, sxt = quantize(x, E4M3, 0, s.tokens, True)  # (1, K)
                dw = scaled_mm(qgt.t().contiguous(), _column_major(qxt), sgt.view(-1, 1), sxt, dy.dtype)  # (N, K)
        else:
            qx, sx, weight = ctx.saved_tensors
            qg, sg = quantize(dy, E5M2, None, s.tokens + s.outputs)  # (M, N), ()
            # (N, K), the forward's scale; gathered again before this backward (fsdp.py's pre-backward)
            qw, sw = ctx.gathered.get() if ctx.gathered is not None else quantize(weight, E4M3, None,
                                                                                  s.inputs + s.outputs)
            dx = scaled_mm(qg, _column_major(qw), sg, sw, dy.dtype)  # (M, K)
            dw = (scaled_mm(qg.t().contiguous(), _column_major(qx), sg, sx, dy.dtype)  # (N, K)
                  if ctx.needs_input_grad[1] else None)
        return dx.to(ctx.x_dtype), None if dw is None else dw.to(weight.dtype), None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           scaling: Float8Scaling | None, gathered: Float8Weight | None = None) -> torch.Tensor:
    """F.linear, in FP8 when `scaling` says how (with the weight ZeRO-3 gathered in FP8 when
    `gathered`); the output in the compute dtype (autocast's, or x's)."""
    if scaling is None:
        return F.linear(x, weight, bias)
    kind = x.device.type
    out_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
    y = _Float8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling, out_dtype, gathered)  # (M, N)
    y = y.view(*x.shape[:-1], weight.shape[0])  # (..., N)
    return y if bias is None else y + bias.to(y.dtype)


class Float8Linear(nn.Linear):
    """An nn.Linear (the same parameters, the same state-dict keys) computing in FP8; a LoRA layer's
    adapter (model/lora.py) comes along and computes in the compute dtype beside it."""

    scaling: Float8Scaling | None = None
    fp8_weight: Float8Weight | None = None  # set by ZeRO-3 with parallel.fp8_gather

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.scaling, self.fp8_weight)
        lora = self._modules.get("lora")
        return y if lora is None else y + lora(x)


def _float8(layer: nn.Linear, scaling: Float8Scaling) -> Float8Linear:
    swapped = Float8Linear(layer.in_features, layer.out_features, bias=False, device="meta")
    swapped.weight, swapped.bias = layer.weight, layer.bias  # the same Parameter objects
    if isinstance(layer, LoRALinear):
        swapped.lora = layer.lora
    swapped.scaling = scaling
    return swapped


def apply_fp8(model: Transformer, mesh: Mesh, cfg: Config) -> int:
    """Make every linear layer of the blocks but the router compute in FP8 (no-op without train.fp8),
    after tensor parallel has split them; returns how many layers (tests count them)."""
    recipe = cfg.train.fp8
    if recipe == "none":
        return 0
    tp, cp = mesh.group("tp"), mesh.group("cp")
    sized = lambda *groups: tuple(g for g in groups if g.size > 1)  # noqa: E731
    # A plain linear layer of a block at tp > 1 is one tp does not split (latent attention's
    # down-projections, shared experts): under sp it sees this rank's T/tp tokens.
    plain_tokens = sized(cp, tp) if cfg.parallel.sp else sized(cp)
    count = 0
    for block in model.blocks():
        for parent in list(block.modules()):
            if isinstance(parent, MoE):
                continue  # the router stays in the compute dtype; its shared experts are reached below
            for name, child in parent.named_children():
                split = getattr(child, "tp_splits", None)  # tensor.py's Column- and RowParallelLinear
                if split == "outputs":
                    child.scaling = Float8Scaling(recipe, tokens=sized(cp), outputs=sized(tp))
                elif split == "inputs":
                    child.scaling = Float8Scaling(recipe, tokens=sized(cp), inputs=sized(tp))
                elif type(child) in (nn.Linear, LoRALinear):  # a LoRA layer's frozen base too
                    setattr(parent, name, _float8(child, Float8Scaling(recipe, tokens=plain_tokens)))
                else:
                    continue
                count += 1
    return count
