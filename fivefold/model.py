"""A Llama-style decoder (dense and mixture-of-experts) in one file, free of any parallelism.

Pre-norm blocks: h = x + Attention(RMSNorm(x)); out = h + FFN(RMSNorm(h)), where FFN is SwiGLU or
a top-k routed mixture of SwiGLU experts. Attention is grouped-query with RoPE applied at explicit
token positions, so context parallel can hand each rank its true positions.

What the parallel code relies on (and why this file imports nothing from torch.distributed):
- blocks live in an nn.ModuleDict keyed "0".."L-1": a pipeline stage deletes the ones it does not
  own and the remaining names (and checkpoint keys) stay the same;
- embedding, final norm and head may be None: forward passes through whatever is absent;
- head counts are read from shapes (view(B, T, -1, head_dim)), so a tensor-parallel rank holding
  H/tp heads needs no change here;
- the attention core and the MoE dispatch are attributes holding callables; context parallel swaps
  in ring attention, expert parallel swaps in an all-to-all dispatch.

Shapes: B batch, T sequence, H query heads, K key/value heads, D head_dim, E experts, V vocabulary.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under bf16 the mean of squares loses too many digits.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles: (..., T) -> (..., T, D)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # (..., T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, D): the "rotate half" layout Hugging Face uses
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x (B, T, H, D) by the angles in cos/sin (T, D) or (B, T, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Local attention core: q (B, T, H, D), k/v (B, T, K, D) -> (B, T, H, D)."""
    if k.shape[2] != q.shape[2]:  # grouped-query: each K/V head serves H/K query heads
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)  # (B, T, H, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=False)
        self.q_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.core: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v)  # (B, T, H, D)
        return self.wo(out.reshape(B, T, -1))  # (B, T, dim)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (Shazeer 2020)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GroupedExperts(nn.Module):
    """E SwiGLU experts stored as stacked weights, so expert parallel shards them along dim 0."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.up = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (N, dim) sorted by expert, counts[e] rows for local expert e -> (N, dim)."""
        outs = []
        for e, chunk in enumerate(torch.split(x, counts)):
            outs.append((F.silu(chunk @ self.gate[e]) * (chunk @ self.up[e])) @ self.down[e])
        return torch.cat(outs) if outs else x[:0]


def local_dispatch(x: torch.Tensor, weights: torch.Tensor, experts_idx: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
    """Send each token's copies to its experts and sum the weighted results, all in this process.

    x (N, dim), weights and experts_idx (N, k) -> (N, dim). Expert parallel replaces this with an
    all-to-all that sends the same sorted rows to the ranks owning the experts.
    """
    n_experts = experts.gate.shape[0]
    flat_idx = experts_idx.reshape(-1)  # (N k,)
    order = torch.argsort(flat_idx, stable=True)  # token copies grouped by expert
    counts = torch.bincount(flat_idx, minlength=n_experts).tolist()
    token_of_copy = order // experts_idx.shape[1]  # (N k,) source token of each sorted copy
    y = experts(x[token_of_copy], counts)  # (N k, dim)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token_of_copy, y)  # (N, dim)


class MoE(nn.Module):
    """Top-k routed experts plus optional always-on shared experts (Shazeer 2017; DeepSeekMoE 2024)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.moe_ffn_dim or cfg.ffn_dim
        self.top_k, self.score, self.norm_topk = cfg.top_k, cfg.router_score, cfg.norm_topk
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = GroupedExperts(cfg.n_experts, cfg.dim, hidden)
        self.shared = FeedForward(cfg.dim, hidden * cfg.n_shared_experts) if cfg.n_shared_experts else None
        self.dispatch: Callable[..., torch.Tensor] = local_dispatch

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, dim) -> top-k weights (N, k) and expert indices (N, k)."""
        logits = self.router(x).float()  # (N, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        weights, idx = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, dim = x.shape
        flat = x.reshape(-1, dim)  # (B T, dim)
        weights, idx = self.route(flat)
        out = self.dispatch(flat, weights, idx, self.experts)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(B, T, dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, head_dim: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg, head_dim)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        moe = cfg.n_experts > 0 and layer >= cfg.first_dense_layers
        self.ffn = MoE(cfg) if moe else FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)  # (B, T, dim)
        return h + self.ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, V); a pipeline stage without embedding takes hidden states."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError("ModelConfig.vocab_size must be resolved (> 0) before building the model")
        self.cfg = cfg
        self.head_dim = cfg.head_dim or cfg.dim // cfg.n_heads
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, self.head_dim) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) for matrices; residual output projections scaled by 1/sqrt(2 L) (GPT-2)."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)  # norm weights
            else:
                residual_out = name.endswith(("wo.weight", "down.weight", ".experts.down"))
                p.normal_(0.0, out_std if residual_out else std, generator=generator)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, dim)
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)  # (T,)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.cfg.rope_theta)  # (T, D)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (B, T, V)
        return h


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of token losses; targets of -100 (padding) count nothing.

    The caller divides by the step's global token count, so every token weighs the same however
    the batch is split into micro-batches, ranks and padded sequences.
    """
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
