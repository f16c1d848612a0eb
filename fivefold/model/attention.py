"""The attention variants of model/transformer.py, free of any parallelism: grouped-query and multi-head latent.

- `Attention`: grouped-query attention (GQA; multi-head when K = H) with optional QK-norm, per head
  (Qwen3, Gemma 3) or over the whole projection (OLMo 2), and optional biases (Qwen2, gpt-oss).
- `LatentAttention`: multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, sec. 2.1;
  as used by DeepSeek-V3, arXiv 2412.19437, sec. 2.1.1). Queries and keys/values are each
  compressed into a low-rank latent, normalised and projected back up per head; RoPE acts only on
  a decoupled part: qk_rope_head_dim per query head, and one key of that width shared by all heads.

Both hold their attention core in `self.core`, a callable (q, k, v, mask, scale) -> out that context
parallel swaps for ring attention or Ulysses. scale is the softmax scale (model.attention.scale;
None: 1/sqrt(q/k head width)), handed to every kernel as an argument (SDPA, FlexAttention and
aten's flash / memory-efficient ops all take one), so q is never pre-scaled: no extra pass over q,
and the kernels' own fp32 scaling stays the only rounding. `attend` is the local core, which picks
the kernel for the mask (model/masks.py): SDPA for causality alone, FlexAttention or the blockwise
path for documents, sliding windows and sinks. Each layer holds its window and its sinks (a learned logit
per head, gpt-oss) and adds them to the micro-batch's document ids. Heads are read from shapes, so
a tensor-parallel rank holding H/tp heads needs no change. RMSNorm lives here because attention
uses it (q/k norms, latent norms); the blocks in model/transformer.py import it. RoPE (with its
scalings and per-layer base) is model/rope.py's.

Shapes: B batch, T sequence, H query heads, K key/value heads, D head_dim; for MLA, Dn/Dr the
query/key widths without/with RoPE, Dv the value width, Cq/Ckv the query/key-value latent widths.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.model.blockwise import blockwise_attention
from fivefold.model.config import ModelConfig, NormConfig
from fivefold.model.flex import flex_attention_core
from fivefold.model.masks import AttentionMask, DocumentIds
from fivefold.model.rope import apply_rope


class RMSNorm(nn.Module):
    """x / rms(x) times the weight, or times (offset + weight) when `offset` is set (Gemma stores its
    norm weights as offsets from 1).

    `sum_over`: where the sum of squares spans more than this tensor holds. Tensor parallel sets it
    on a norm over a whole projection (model.norm.qk_span = "all", OLMo 2) whose heads it splits:
    each rank sums its slice's squares, the callable adds the others' (an all-reduce), and the mean
    divides by the whole `width`."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0, weight_fp32: bool = False):
        super().__init__()
        self.eps, self.offset, self.width = eps, offset, dim
        self.weight_fp32 = weight_fp32 or bool(offset)
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - offset))  # a scale of 1 to start
        self.sum_over: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32: under bf16 the mean of squares loses too many digits.
        xf = x.float()
        if self.sum_over is None:
            mean_square = xf.pow(2).mean(-1, keepdim=True)  # (..., 1)
        else:
            mean_square = self.sum_over(xf.pow(2).sum(-1, keepdim=True)) / self.width  # (..., 1)
        xf = xf * torch.rsqrt(mean_square + self.eps)
        if self.weight_fp32:  # scaled in fp32, then cast (transformers' Gemma3RMSNorm and Olmo2RMSNorm order)
            scale = self.weight.float() + self.offset if self.offset else self.weight.float()  # (dim,)
            return (xf * scale).type_as(x)
        return xf.type_as(x) * self.weight  # cast, then scaled (transformers' LlamaRMSNorm order)


def rms_norm(norm: NormConfig, dim: int) -> RMSNorm:
    """A norm over `dim` features as [model.norm] makes them: its epsilon, weight offset and cast order."""
    return RMSNorm(dim, norm.eps, norm.offset, norm.weight_fp32)


def gqa_in_kernel(device_type: str, dtype: torch.dtype) -> bool:
    """Does causal SDPA take grouped K/V heads itself (`enable_gqa`, torch >= 2.5) rather than a copy
    repeated to the query heads? On CPU always (math and flash kernels both take it; the results
    equal the copy's). On CUDA only for the flash kernel's case, fp16/bf16: in torch 2.11 flash is
    the one fused kernel with GQA (pytorch/pytorch#139586), so fp32 with enable_gqa would fall back
    to the math kernel, O(T^2) memory, where the copy keeps the memory-efficient or cuDNN kernel."""
    return device_type != "cuda" or dtype in (torch.float16, torch.bfloat16)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Plain causal attention through SDPA (`is_causal=True`: flash where it can): q (B, T, H, D),
    k (B, T, K, D), v (B, T, K, Dv) -> (B, T, H, Dv). Scaled by `scale`, None for 1/sqrt(D), the
    query/key width (MLA: Dn + Dr; its values may be narrower, Dv)."""
    grouped = k.shape[2] != q.shape[2]  # grouped-query: each K/V head serves H/K query heads (h uses h // G)
    if grouped and not gqa_in_kernel(q.device.type, q.dtype):
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # (B, T, H, D)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)  # (B, T, H, Dv)
        grouped = False
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D), (B, K, T, D), (B, K, T, Dv)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped, scale=scale)
    return out.transpose(1, 2)  # (B, T, H, Dv)


def backend_for(masked: bool, device_type: str, backend: str = "auto") -> str:
    """Which kernel attends: "sdpa" for causality alone, else "flex" on CUDA and "blockwise"
    elsewhere (FlexAttention has no CPU backward), unless model.attention.backend names one."""
    if backend != "auto":
        return backend
    if not masked:
        return "sdpa"
    return "flex" if device_type == "cuda" else "blockwise"


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None,
           scale: float | None = None, backend: str = "auto") -> torch.Tensor:
    """Local attention core under `mask` (None: causal alone): q (B, T, H, D), k and v (B, T, K, D)
    -> (B, T, H, D), through the kernel `backend_for` picks (the blockwise path where the mask records
    the largest logits, optim.qk_clip), softmax scale `scale` (None: 1/sqrt(D)). validate() refuses
    "sdpa" with a mask, and "sdpa" or "flex" with qk_clip."""
    masked = mask is not None and not mask.plain
    recording = mask is not None and mask.logit_max is not None  # optim.qk_clip: the tiles give the largest logit
    chosen = "blockwise" if recording and backend == "auto" else backend_for(masked, q.device.type, backend)
    if chosen == "sdpa":
        if masked:
            raise ValueError("model.attention.backend = 'sdpa' does causal attention only; documents, sliding "
                             "windows and sinks need 'auto', 'flex' or 'blockwise'")
        return causal_attention(q, k, v, scale)
    if chosen == "flex":
        return flex_attention_core(q, k, v, mask or AttentionMask(), scale=scale)
    return blockwise_attention(q, k, v, mask, scale=scale)


class _LayerMask:
    """What one attention layer adds to the micro-batch's documents: its window and its sinks; and
    the softmax scale its core is called with (None: 1/sqrt(q/k head width))."""

    window: int
    sinks: nn.Parameter | None
    scale: float | None
    logit_max: torch.Tensor | None = None  # optim.qk_clip: this layer's heads' largest logits (parallel/qk_clip.py)

    def _mask(self, doc: DocumentIds | torch.Tensor | None) -> AttentionMask | None:
        mask = AttentionMask.of(doc, self.window, self.sinks, self.logit_max)
        return None if mask.plain else mask


class Attention(_LayerMask, nn.Module):
    """Grouped-query attention with RoPE at explicit positions (and QK-norm when cfg.norm.qk)."""

    def __init__(self, cfg: ModelConfig, head_dim: int, layer: int = 0):
        super().__init__()
        self.head_dim = head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * head_dim, bias=cfg.attention.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=cfg.attention.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * head_dim, bias=cfg.attention.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * head_dim, cfg.dim, bias=cfg.attention.out_bias)
        # QK-norm over each head (Qwen3, Gemma 3) or over the whole projection before the head split (OLMo 2)
        self.qk_norm_all = cfg.norm.qk_span == "all"
        q_width, k_width = (cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim) if self.qk_norm_all else (head_dim,) * 2
        self.q_norm = rms_norm(cfg.norm, q_width) if cfg.norm.qk else None
        self.k_norm = rms_norm(cfg.norm, k_width) if cfg.norm.qk else None
        self.window = cfg.attention.layer_window(layer)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attention.sinks else None  # (H,) logits
        self.scale = cfg.attention.scale or None
        # (q, k, v, mask, scale) -> out, mask None for causality alone; context parallel swaps in its own.
        self.core: Callable[..., torch.Tensor] = functools.partial(attend, backend=cfg.attention.backend)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentIds | torch.Tensor | None = None) -> torch.Tensor:
        """x (B, T, dim); doc: the micro-batch's (B, T) document ids of whole rows, or None."""
        B, T, _ = x.shape
        q, k = self.wq(x), self.wk(x)  # (B, T, H D), (B, T, K D)
        if self.q_norm is not None and self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, -1, self.head_dim)  # (B, T, H, D)
        k = k.view(B, T, -1, self.head_dim)  # (B, T, K, D)
        v = self.wv(x).view(B, T, -1, self.head_dim)  # (B, T, K, D)
        if self.q_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core(q, k, v, self._mask(doc), self.scale)  # (B, T, H, D)
        return self.wo(out.reshape(B, T, -1))  # (B, T, dim)


def _unchanged(*latents: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return latents


class LatentAttention(_LayerMask, nn.Module):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1, eqs. 9-19), without a KV cache.

      c_q = RMSNorm(x W_qa)                          (Cq)    skipped when q_lora_rank = 0
      [q_n, q_r] = c_q W_qb  per head                (H, Dn + Dr);  q_r <- RoPE(q_r)
      [c_kv, k_r] = x W_kva                          (Ckv + Dr);    k_r <- RoPE(k_r), one for all heads
      [k_n, v] = RMSNorm(c_kv) W_kvb  per head       (H, Dn + Dv)
      k = [k_n, k_r],  out = softmax(q k^T / sqrt(Dn + Dr)) v,  then W_o  (or model.attention.scale)
    (v is padded with zeros to Dn + Dr for the core and its output cut back to Dv: see forward.)

    The down-projections (wq_a, wkv_a) and their norms act on every token whole; everything after
    them is per head. `enter_heads` marks that boundary: it takes the tensors the per-head part
    reads, each (B, T, width): the query latent (x when q_lora_rank = 0), the normalised key/value
    latent and the shared key before RoPE, and returns them unchanged here. Tensor parallel
    installs its region entry there (parallel/tensor.py), so the replicated down-projections get
    whole gradients.
    RoPE follows model/rope.py's rules (DeepSeek-V3: YaRN, its long-context extension, report sec.
    4.3; its softmax scale comes in as model.attention.scale, rope.py's yarn_softmax_scale).
    """

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        H, latent = cfg.n_heads, cfg.latent
        self.kv_rank, self.nope, self.rope, self.v_dim = (latent.kv_lora_rank, latent.qk_nope_head_dim,
                                                          latent.qk_rope_head_dim, latent.v_head_dim)
        qk = self.nope + self.rope
        if latent.q_lora_rank:
            self.wq_a: nn.Linear | None = nn.Linear(cfg.dim, latent.q_lora_rank, bias=False)
            self.q_a_norm: RMSNorm | None = rms_norm(cfg.norm, latent.q_lora_rank)
            self.wq_b = nn.Linear(latent.q_lora_rank, H * qk, bias=False)
        else:  # queries straight from x (DeepSeek-V2-Lite)
            self.wq_a, self.q_a_norm = None, None
            self.wq = nn.Linear(cfg.dim, H * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = rms_norm(cfg.norm, self.kv_rank)
        self.wkv_b = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(H * self.v_dim, cfg.dim, bias=cfg.attention.out_bias)
        self.window = cfg.attention.layer_window(layer)
        self.sinks = nn.Parameter(torch.zeros(H)) if cfg.attention.sinks else None  # (H,) logits
        self.scale = cfg.attention.scale or None  # DeepSeek-V3 under YaRN: model/rope.py yarn_softmax_scale
        self.core: Callable[..., torch.Tensor] = functools.partial(attend, backend=cfg.attention.backend)
        self.enter_heads: Callable[..., tuple[torch.Tensor, ...]] = _unchanged

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc: DocumentIds | torch.Tensor | None = None) -> torch.Tensor:
        q_in = x if self.wq_a is None else self.q_a_norm(self.wq_a(x))  # (B, T, Cq) or (B, T, dim)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)  # (B, T, Ckv), (B, T, Dr)
        # With sequence parallel x holds T/tp tokens and enter_heads gathers all T (the positions
        # cos/sin are for), so the shared key is roped after it.
        q_in, c_kv, k_rope = self.enter_heads(q_in, self.kv_a_norm(c_kv), k_rope)
        B, T, _ = c_kv.shape  # T: every token of the sequence (x held T/tp of them with sp)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin)  # (B, T, 1, Dr): cos/sin are (.., T, Dr)
        wq = self.wq if self.wq_a is None else self.wq_b
        q = wq(q_in).view(B, T, -1, self.nope + self.rope)  # (B, T, H, Dn + Dr)
        q = torch.cat([q[..., :self.nope], apply_rope(q[..., self.nope:], cos, sin)], dim=-1)
        kv = self.wkv_b(c_kv).view(B, T, -1, self.nope + self.v_dim)  # (B, T, H, Dn + Dv)
        k = torch.cat([kv[..., :self.nope], k_rope.expand(-1, -1, kv.shape[2], -1)], dim=-1)  # (B, T, H, Dn + Dr)
        # Values padded with zeros to the query/key width: fused kernels (flash attention on CPU and
        # GPU) and context parallel's cores take equal widths; without it SDPA falls back to its
        # math path, which keeps the (T, T) probabilities. The zero columns come out zero and are cut.
        v = F.pad(kv[..., self.nope:], (0, self.nope + self.rope - self.v_dim))  # (B, T, H, Dn + Dr)
        out = self.core(q, k, v, self._mask(doc), self.scale)  # (B, T, H, Dn + Dr)
        return self.wo(out[..., :self.v_dim].reshape(B, T, -1))  # (B, T, dim)


def attention(cfg: ModelConfig, head_dim: int, layer: int = 0) -> nn.Module:
    """The attention block `layer` of `cfg` uses: latent when cfg.latent.kv_lora_rank > 0, else grouped-query."""
    return LatentAttention(cfg, layer) if cfg.latent.kv_lora_rank else Attention(cfg, head_dim, layer)
