"""Masked attention through FlexAttention (`torch.nn.attention.flex_attention`): the CUDA path.

The rule of model/masks.py becomes a `mask_mod`, and a block mask says which 128 x 128 blocks the
compiled kernel skips, computes whole, or computes under the `mask_mod`. The block mask is built
here at block granularity from the document ids at block ends, by the tile rule the blockwise path
plans with (blockwise.tile_kinds): (T/128)^2 entries per row, never a (T, T) tensor (torch's
`create_block_mask` evaluates the rule on every pair, about 14 bytes each: 15 GB at T = 32k). Its
blocks are still exactly those: documents are intervals, so a block is empty iff its closest pair
is cut, and full iff it is below the diagonal, whole, and its farthest pair is kept. It is built once
per micro-batch and window, on the ids' device, and shared by the layers through the micro-batch's
DocumentIds (masks.DocumentIds.block_masks); without documents it depends on T and the window alone.
Sinks (gpt-oss) scale the output by the share the real keys keep of the denominator,
exp(L) / (exp(L) + exp(s_h)) = sigmoid(L - s_h), with L the kernel's log-sum-exp; its gradient flows
through L (FlexAttention differentiates its log-sum-exp).

In torch 2.13 FlexAttention has no backward on CPU: CPU trains through model/blockwise.py, and a
test checks this forward on CPU against it.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from fivefold.model.blockwise import FULL, SKIP, tile_kinds
from fivefold.model.masks import AttentionMask, keep

BLOCK = 128  # the block side of FlexAttention's block mask (its default sparse block size)


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process: eager it materialises the scores (no fused kernel)."""
    return torch.compile(flex_attention, dynamic=False)


def _mask_mod(doc: torch.Tensor | None, window: int) -> Callable[..., torch.Tensor]:
    """The rule on the pairs of a block the block mask marks partial."""

    def mask_mod(b, h, q_idx, kv_idx):
        q_doc = None if doc is None else doc[b, q_idx]
        return keep(q_idx, kv_idx, window, q_doc, None if doc is None else doc[b, kv_idx])

    return mask_mod


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (B, 1, n, n) -> how many each query block keeps (B, 1, n) and their key blocks, ascending
    and first in the row (B, 1, n, n): the int32 form BlockMask.from_kv_blocks takes."""
    blocks = blocks.to(torch.int32)
    indices = torch.argsort(blocks, dim=-1, descending=True, stable=True)  # kept blocks first, in order
    return blocks.sum(-1, dtype=torch.int32), indices.to(torch.int32)


def _build(doc: torch.Tensor | None, window: int, T: int, device: torch.device) -> BlockMask:
    kinds = tile_kinds(T, BLOCK, window, doc, device)[:, None]  # (B or 1, 1, n, n), on doc's device
    full = kinds == FULL
    if T % BLOCK:  # a last block shorter than 128 is never full (create_block_mask pads the rule with False)
        full[..., -1, :] = False
        full[..., -1] = False
    partial = (kinds != SKIP) & ~full  # the diagonal (causal within), and blocks the rule cuts
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=_mask_mod(doc, window), seq_lengths=(T, T))


@functools.lru_cache(maxsize=16)
def _positional(T: int, window: int, device: torch.device) -> BlockMask:
    """Without documents the block mask is a pure function of T, the window and the device (no
    micro-batch carries it to the layers): memoised, as `_compiled_flex` is."""
    return _build(None, window, T, device)


# Built eagerly and shared: under train.compile a block breaks its graph here once (the
# blockwise path does too) and its compiled flex_attention takes the block mask as an input.
@torch.compiler.disable
def block_mask(mask: AttentionMask, T: int, device: torch.device) -> BlockMask:
    """The block mask of `mask` over T tokens: the micro-batch's for this window when the layers share
    one (mask.block_masks), else built here."""
    if mask.doc is None:
        return _positional(T, mask.window, device)
    if mask.block_masks is None:
        return _build(mask.doc, mask.window, T, device)
    if mask.window not in mask.block_masks:
        mask.block_masks[mask.window] = _build(mask.doc, mask.window, T, device)
    return mask.block_masks[mask.window]


def flex_attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                        compiled: bool = True, scale: float | None = None) -> torch.Tensor:
    """q (B, T, H, D), k and v (B, T, K, D) under `mask` -> (B, T, H, D), softmax scale `scale` (None:
    1/sqrt(D)). `compiled=False` runs the eager kernel (what runs on CPU, forward only)."""
    H = q.shape[2]
    blocks = block_mask(mask, q.shape[1], q.device)
    # Inside a compiled block (train.compile) the block's compilation takes flex_attention in whole.
    attend = _compiled_flex() if compiled and not torch.compiler.is_compiling() else flex_attention
    out, aux = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=blocks, scale=scale,
                      enable_gqa=k.shape[2] != H, return_aux=AuxRequest(lse=True))  # (B, H, T, D)
    if mask.sinks is not None:  # aux.lse: (B, H, T), natural log
        out = out * torch.sigmoid(aux.lse - mask.sinks.float()[None, :, None])[..., None].to(out.dtype)
    return out.transpose(1, 2)  # (B, T, H, D)
