"""Tensor parallel (Megatron-LM, Shoeybi et al. 2019) with sequence parallel (Korthikanti et al. 2022).

What is sharded over `tp`: the weight matrices. Attention is split by heads (query heads and
key/value heads alike, so grouped-query attention keeps its grouping on every rank; latent
attention's per-head up-projections wq_b/wkv_b and wo, its down-projections wq_a/wkv_a and their
norms replicated, the region entered after them, at `LatentAttention.enter_heads`) and SwiGLU by
its hidden units: the first matrix of each pair is column-parallel (output features split), the
second row-parallel (input features split), so the activation between them never needs
communication. The embedding and the output head are split along the vocabulary (the same rows of
one matrix when they are tied), and the loss is computed from vocabulary-sharded logits without
ever forming the full (B, T, V) tensor.

Collectives per transformer block, forward (backward has the conjugates):
- without sp: one all-reduce after attention's row-parallel wo and one after the MLP's down;
- with sp (`parallel.sp`): activations outside the matmuls (norms, residual adds) are split along
  the sequence; an all-gather enters each tensor-parallel region and a reduce-scatter leaves it,
  moving the same bytes as the all-reduce they replace (an all-reduce is a reduce-scatter plus an
  all-gather) while norms and residuals hold T/tp tokens. Norm weights then see different tokens
  on each rank, so their gradients are all-reduced over tp.
- with sp and `parallel.tp_overlap`, each region's all-gather is cut into tp pieces that travel
  around the ring while its column-parallel layers multiply the piece already here, and the
  row-parallel layer's reduce-scatter likewise (comm/collective_matmul.py): the same bytes, hidden
  under the matmuls. A region's column layers then run in one step at its entry
  (`_OverlappedEntry`); latent attention's entry, whose gathered latents also feed RoPE's shared
  key, stays blocking.
- a q/k norm over the whole projection (OLMo 2) sums its sums of squares over tp: one small
  all-reduce (a number per token) for q and one for k, forward and backward.

Biases: a column-parallel layer's (q, k, v: Qwen2) are split with its output features; a
row-parallel layer's (attention's output: gpt-oss) is whole on every rank and added once, after
the sum (with sp each rank adds it to its own T/tp tokens, so its gradient is summed as norms' are).

Every layer is built from the full layer and keeps its slice, so every layout starts from the
same weights. Each sharded weight records the dim it is split along (`tp_dim`), so checkpoints
can describe it as a DTensor Shard(tp_dim) on the tp axis (state_dict.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.attention import LatentAttention, RMSNorm
from fivefold.model.ffn import FeedForward
from fivefold.model.head import OutputHead, VocabSplit
from fivefold.model.lora import LoRA
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm import collectives, regions
from fivefold.parallel.comm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.fp8 import Float8Scaling, Float8Weight, linear
from fivefold.parallel.materialize import materialize_parameter
from fivefold.parallel.mesh import Mesh


def _shard(weight: torch.Tensor, dim: int, group: AxisGroup) -> nn.Parameter:
    # frozen stays frozen (LoRA's base)
    part = nn.Parameter(weight.detach().chunk(group.size, dim=dim)[group.rank].clone(), weight.requires_grad)
    part.tp_dim = dim  # read by checkpoints: Shard(dim) on the tp axis
    return part


def enter_tensor_parallel_region(x: torch.Tensor, group: AxisGroup, sequence_parallel: bool) -> torch.Tensor:
    """Where a region of column-parallel layers begins: with sp, gather the sequence shards
    (B, T/tp, d) -> (B, T, d); without, x is already whole and only its gradient needs a sum."""
    if sequence_parallel:
        return regions.gather_from_sequence_parallel_region(x, group)
    return regions.copy_to_tensor_parallel_region(x, group)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split: each rank computes its slice of y.

    Its input is already in the tensor-parallel region: the region begins once for all of a block's
    column-parallel layers (q, k and v share one input), on entry to attention or the MLP, so one
    collective serves them all. With sp and parallel.tp_overlap the region's entry computes this
    layer's output itself, its gather overlapped with the matmul (`_OverlappedEntry`), and leaves it
    in `computed`, which forward returns (with a LoRA adapter, also x A^T, which its B then takes up).
    """

    tp_splits = "outputs"  # the matmul dim tp splits: FP8's amax reductions read it (fp8.py)
    scaling: Float8Scaling | None = None  # set by apply_fp8 (train.fp8)
    fp8_weight: Float8Weight | None = None  # set by ZeRO-3 with parallel.fp8_gather
    computed: torch.Tensor | None = None  # (B, T, out/tp): set by the region's overlapped entry
    computed_lora: torch.Tensor | None = None  # (B, T, r): x A^T, set with it when the layer has an adapter

    def __init__(self, linear: nn.Linear, group: AxisGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = _shard(linear.weight, 0, group)  # (out/tp, in)
        # a bias (Qwen2's q/k/v) split with its output features
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, group)  # (out/tp,)
        self.lora = _split_adapter(linear, "outputs", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.computed is not None:  # the region's overlapped entry ran this layer's matmul already
            y, u, self.computed, self.computed_lora = self.computed, self.computed_lora, None, None
            return y if self.lora is None else y + self.lora.up(u)
        y = linear(x, self.weight, self.bias, self.scaling, self.fp8_weight)  # (B, T, out/tp)
        return y if self.lora is None else y + self.lora(x)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (input features) split: partial products are summed over tp,
    then the bias (gpt-oss's attention output), whole on every rank, is added once to the sum."""

    tp_splits = "inputs"
    scaling: Float8Scaling | None = None
    fp8_weight: Float8Weight | None = None

    def __init__(self, linear: nn.Linear, group: AxisGroup, sequence_parallel: bool, overlap: bool = False):
        super().__init__()
        self.group, self.sp, self.overlap = group, sequence_parallel, overlap
        self.weight = _shard(linear.weight, 1, group)  # (out, in/tp)
        self.bias = linear.bias  # (out,) or None: replicated
        self.lora = _split_adapter(linear, "inputs", group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.overlap:  # the reduce-scatter's pieces travel while the next one's partial sum is computed
            # an adapter's share x_r A_r^T B^T is computed whole first (a rank-r product, small) and joins
            # each piece's partial sum before it travels
            extra = None if self.lora is None else self.lora(x)  # (B, T, out)
            y = matmul_reduce_scatter(x, self.weight, self.group, extra)  # (B, T/tp, out)
            return y if self.bias is None else y + self.bias
        partial = linear(x, self.weight, None, self.scaling, self.fp8_weight)  # (B, T, out): this rank's share
        if self.lora is not None:  # x_r A_r^T B^T: the adapter's share, summed by the same reduction
            partial = partial + self.lora(x)
        if self.sp:
            y = regions.reduce_scatter_to_sequence_parallel_region(partial, self.group)  # (B, T/tp, out)
        else:
            y = regions.reduce_from_tensor_parallel_region(partial, self.group)  # (B, T, out)
        return y if self.bias is None else y + self.bias


def _split_adapter(layer: nn.Linear, splits: str, group: AxisGroup) -> LoRA | None:
    """A LoRA adapter (model/lora.py) split the way its layer is. Column-parallel (outputs split): B's
    rows with the outputs, A whole; row-parallel (inputs split): A's columns with the inputs, B whole,
    its product a partial sum the layer's own reduction completes. The whole factor's gradient is then
    a partial sum on each rank (its product meets only this rank's slice of the other), marked
    tp_partial: summed over tp after backward (ExpertParallel.sum_partial_gradients). With sp nothing
    changes: a column layer's adapter sees the region's gathered input, a row layer's its local one."""
    adapter = getattr(layer, "lora", None)
    if adapter is None:
        return None
    if splits == "outputs":
        adapter.b = _shard(adapter.b, 0, group)  # (out/tp, r)
        whole = adapter.a  # (r, in)
    else:
        adapter.a = _shard(adapter.a, 1, group)  # (r, in/tp)
        whole = adapter.b  # (out, r)
    whole.tp_partial = group.size > 1
    return adapter


class VocabParallelEmbedding(nn.Module):
    """Rows [r V/tp, (r+1) V/tp) of the table on rank r; other tokens look up zeros, then a sum."""

    def __init__(self, embedding: nn.Embedding, group: AxisGroup, sequence_parallel: bool):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = _shard(embedding.weight, 0, group)  # (V/tp, dim)
        self.start = group.rank * self.weight.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local = tokens - self.start  # (B, T)
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (B, T, dim)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sp:
            return regions.reduce_scatter_to_sequence_parallel_region(h, self.group)  # (B, T/tp, dim)
        return regions.reduce_from_tensor_parallel_region(h, self.group)


class VocabParallelHead(OutputHead):
    """The output head with its rows (the vocabulary) split: rank r holds ids [r V/tp, (r+1) V/tp).

    Its logits stay vocabulary-sharded (B, T, V/tp); its loss (model/head.py) reduces each rank's
    columns to a log-sum-exp and a target logit per token, one all-gather of those two numbers
    combines them, and backward is local: softmax minus one-hot on this rank's columns. No rank forms
    the full (B, T, V) logits. Ids from `vocab_limit` on are padding (the vocabulary was padded to
    divide by tp): they take no probability."""

    def __init__(self, head: OutputHead, group: AxisGroup, sequence_parallel: bool, vocab_limit: int):
        nn.Module.__init__(self)
        self.group, self.sp = group, sequence_parallel
        self.weight = _shard(head.weight, 0, group)  # (V/tp, dim)
        start = group.rank * self.weight.shape[0]
        self.split = VocabSplit(start, vocab_limit, partial(_gather_over, group=group))

    def enter(self, h: torch.Tensor) -> torch.Tensor:
        """The region's entry: with sp the sequence gathered (B, T/tp, dim) -> (B, T, dim); without,
        the gradient summed over tp."""
        return enter_tensor_parallel_region(h, self.group, self.sp)


def _gather_over(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(2, c) per-token values on each rank -> (tp, 2, c), in rank order."""
    out = x.new_empty((group.size * x.shape[0], *x.shape[1:]))  # (tp 2, c): concatenated along dim 0
    collectives.all_gather(out, x.contiguous(), group)
    return out.view(group.size, *x.shape)


# Module name -> how it is split. Attention by heads, SwiGLU by hidden units, vocabulary for
# embedding and head; everything else (norms, router) is replicated.
TP_PLAN: dict[str, type[nn.Module]] = {
    "attn.wq": ColumnParallelLinear, "attn.wk": ColumnParallelLinear, "attn.wv": ColumnParallelLinear,
    "attn.wq_b": ColumnParallelLinear, "attn.wkv_b": ColumnParallelLinear,  # latent attention's up-projections
    "attn.wo": RowParallelLinear,
    "ffn.gate": ColumnParallelLinear, "ffn.up": ColumnParallelLinear, "ffn.down": RowParallelLinear,
}


@dataclass(frozen=True)
class TensorParallel:
    """What the rest of the step needs from tensor parallel: the loss over vocabulary-sharded logits,
    and how many tokens of a sequence an activation between pipeline stages holds."""

    group: AxisGroup
    sequence_parallel: bool

    @property
    def seq_divisor(self) -> int:
        """Activations outside tp regions hold T / seq_divisor tokens (T / tp with sp)."""
        return self.group.size if self.sequence_parallel else 1


def apply_tensor_parallel(model: Transformer, mesh: Mesh, cfg: Config, derived: Derived) -> TensorParallel:
    """Swap the model's layers for their tensor-parallel versions in place (no-op at tp = 1)."""
    group, sequence_parallel = mesh.group("tp"), cfg.parallel.sp
    overlap = sequence_parallel and cfg.parallel.tp_overlap  # validate refuses tp_overlap without sp
    state = TensorParallel(group, sequence_parallel)
    if model.output is not None:  # padding ids (the vocabulary padded to data.vocab_multiple) take no probability
        model.output.split = VocabSplit(limit=derived.vocab_limit)
    if group.size == 1:
        return state
    for block in model.blocks():
        # An MoE block's experts are not split by tp (expert parallel shards them instead): without
        # sp each tp rank routes the same tokens through whole experts; with sp, its own T/tp tokens
        # (expert.py then sums the MoE's gradients and balance counts over tp).
        regions = [block.attn] + ([block.ffn] if isinstance(block.ffn, FeedForward) else [])
        for name, cls in TP_PLAN.items():
            parent_name, child = name.split(".")
            parent = getattr(block, parent_name)
            if parent in regions and isinstance(getattr(parent, child, None), nn.Linear):  # MLA has no wk, wv
                row = {"overlap": overlap} if cls is RowParallelLinear else {}  # (a column's: its region's entry)
                setattr(parent, child, cls(getattr(parent, child), group, sequence_parallel, **row))
        if block.attn.sinks is not None:  # one logit per query head: split as the heads are
            block.attn.sinks = _shard(block.attn.sinks, 0, group)
        if getattr(block.attn, "qk_norm_all", False) and block.attn.q_norm is not None:
            _split_projection_norm(block.attn.q_norm, group)
            _split_projection_norm(block.attn.k_norm, group)
        for region in regions:  # one entry per region, before its column-parallel layers
            if isinstance(region, LatentAttention):  # after the replicated down-projections instead
                region.enter_heads = partial(_enter_heads, group=group, sequence_parallel=sequence_parallel)
                continue
            if overlap:
                region.register_forward_pre_hook(_OverlappedEntry(region, group))
                continue
            region.register_forward_pre_hook(
                lambda mod, args: (enter_tensor_parallel_region(args[0], group, sequence_parallel), *args[1:]))
    if model.tok_embeddings is not None:
        model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sequence_parallel)
    if model.output is not None:  # logits stay vocabulary-sharded, for the loss's per-chunk reductions
        model.output = VocabParallelHead(model.output, group, sequence_parallel, derived.vocab_limit)
        if model.cfg.tie_embeddings and model.tok_embeddings is not None:
            # Both are split along the vocabulary into the same rows: rank r's embedding rows are its
            # head's output features, so the tie holds slice by slice and needs no communication.
            # (On separate pipeline stages each keeps its slice; tied_embedding_group sums their
            # gradients between the ranks at the same tp place.)
            model.output.weight = model.tok_embeddings.weight
    for name, param in list(model.named_parameters()):
        # Replicated weights that saw different data on each tp rank need the others' gradients:
        # QK-norm weights (each rank normalises its own heads) and, with sp, every norm (each rank
        # normalises its own T/tp tokens; so do latent attention's down-projections, which run before
        # the region's entry). Without sp the block norms' inputs are identical. The hook lives on
        # the tensor, so a meta one gets its (small) storage first.
        # So does attention's output bias with sp (added after the reduce-scatter, to T/tp tokens).
        # Weights split with the heads (an OLMo 2 q/k norm over the whole projection) are not replicated.
        if getattr(param, "tp_dim", None) is not None or not param.requires_grad:  # frozen (LoRA): no gradient
            continue
        # (And the MTP depths' eh_proj, which projects each rank's own tokens before its block.)
        # (and their LoRA adapters, on the same tokens)
        seq_local = "norm" in name or name.endswith(("attn.wo.bias", *(f"{layer}.{leaf}" for layer in (
            "attn.wq_a", "attn.wkv_a", "eh_proj") for leaf in ("weight", "lora.a", "lora.b"))))
        if name.endswith(("q_norm.weight", "k_norm.weight")) or (sequence_parallel and seq_local):
            materialize_parameter(model, name, mesh.device).register_hook(lambda g: _summed_over(g, group))
    return state


class _OverlappedEntry:
    """A region's entry with tp_overlap (a forward pre-hook on attention or the MLP): the gather of
    the region's input overlapped with all of its column-parallel layers' matmuls at once (q, k and
    v, or gate and up, share the gathered input), each output left in its layer's `computed` for the
    region's forward to take when it calls the layer. The region then receives a stand-in for the
    gathered input of its shape, (B, T, d), that holds no tokens: NaN, so a read of it shows in the loss."""

    def __init__(self, region: nn.Module, group: AxisGroup):
        self.columns = [m for m in region.children() if isinstance(m, ColumnParallelLinear)]  # called in forward
        self.group = group

    def __call__(self, region: nn.Module, args: tuple) -> tuple:
        x = args[0]  # (B, T/tp, d)
        # A LoRA adapter's A multiplies the same gathered input, after its layer's weight, as each layer's
        # forward calls them (the order dx sums their branches in: collective_matmul.py)
        weights = [w for c in self.columns for w in (c.weight, *([c.lora.a] if c.lora is not None else []))]
        biases = [b for c in self.columns for b in (c.bias, *([None] if c.lora is not None else []))]
        outs = iter(all_gather_matmul(x, weights, biases, self.group))
        for layer in self.columns:
            if layer.computed is not None:
                raise RuntimeError(f"{type(region).__name__} did not call every column-parallel layer of its "
                                   "region in its last forward, as parallel.tp_overlap needs: set tp_overlap = false")
            layer.computed = next(outs)  # (B, T, out/tp)
            layer.computed_lora = next(outs) if layer.lora is not None else None  # (B, T, r)
        B, t, d = x.shape
        stand_in = x.new_full((1, 1, 1), float("nan")).expand(B, t * self.group.size, d)  # (B, T, d), no storage
        return (stand_in, *args[1:])


def _enter_heads(*latents: torch.Tensor, group: AxisGroup, sequence_parallel: bool) -> tuple[torch.Tensor, ...]:
    """LatentAttention.enter_heads under tp: the tensors its per-head layers read, (B, T, w_i) each
    (T/tp with sp), enter the region in one collective. Forward: identity, or an all-gather of the
    sequence; backward: the sum over tp of each rank's heads' gradients (all-reduce, or
    reduce-scatter with sp), so the replicated down-projections and their norms get the whole
    gradient. Entering here rather than at x moves the latents (DeepSeek-V3: 1536 + 512 + 64 per
    token) instead of x (7168)."""
    widths = [t.shape[-1] for t in latents]
    joined = enter_tensor_parallel_region(torch.cat(latents, dim=-1), group, sequence_parallel)  # (B, T, sum w)
    return tuple(joined.split(widths, dim=-1))


def _split_projection_norm(norm: RMSNorm, group: AxisGroup) -> None:
    """A q/k norm over the whole projection (model.norm.qk_span = "all", OLMo 2) under tp: this rank holds
    H/tp heads of it, so its weight is split with them, and its mean of squares is the sum of every
    rank's sum of squares (one all-reduce of a number per token, its gradient summed back) over the
    whole width."""
    norm.weight = _shard(norm.weight, 0, group)  # (H D / tp,) or (K D / tp,)
    norm.sum_over = partial(regions.sum_over_tensor_parallel_ranks, group=group)


def _summed_over(grad: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    grad = grad.clone()
    collectives.all_reduce(grad, group)
    return grad
