"""Masked attention through FlexAttention (`torch.nn.attention.flex_attention`): the CUDA path.

The rule of model/masks.py becomes a `mask_mod`; `create_block_mask` evaluates it block by block
(128 x 128) into a block-sparse description, and the compiled kernel skips the blocks it empties
and applies the rule inside the rest: documents and windows cost what they keep, and no (T, T)
tensor exists. Sinks (gpt-oss) scale the output by the share the real keys keep of the
denominator, exp(L) / (exp(L) + exp(s_h)) = sigmoid(L - s_h), with L the kernel's log-sum-exp;
its gradient flows through L (FlexAttention differentiates its log-sum-exp).

In torch 2.13 FlexAttention has no backward on CPU: CPU trains through model/blockwise.py, and a
test checks this forward on CPU against it.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from fivefold.model.masks import AttentionMask, keep


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process: eager it materialises the scores (no fused kernel)."""
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                        compiled: bool = True, scale: float | None = None) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, T, K, D) under `mask` -> (B, T, H, D), softmax scale `scale` (None:
    1/sqrt(D)). `compiled=False` runs the eager kernel (what runs on CPU, forward only)."""
    B, T, H, _ = q.shape
    doc, window = mask.doc, mask.window

    def mask_mod(b, h, q_idx, kv_idx):
        q_doc = None if doc is None else doc[b, q_idx]
        return keep(q_idx, kv_idx, window, q_doc, None if doc is None else doc[b, kv_idx])

    blocks = create_block_mask(mask_mod, B if doc is not None else None, None, T, T, device=q.device)
    # Inside a compiled block (train.compile) the block's compilation takes flex_attention in whole.
    attend = _compiled_flex() if compiled and not torch.compiler.is_compiling() else flex_attention
    out, aux = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=blocks, scale=scale,
                      enable_gqa=k.shape[2] != H, return_aux=AuxRequest(lse=True))  # (B, H, T, D)
    if mask.sinks is not None:  # aux.lse: (B, H, T), natural log
        out = out * torch.sigmoid(aux.lse - mask.sinks.float()[None, :, None])[..., None].to(out.dtype)
    return out.transpose(1, 2)  # (B, T, H, D)
