"""The ring attention core as it was before issue 30's item 4 (commit 515adb9, fivefold/parallel/context.py),
kept unchanged for comparison only: benchmarks/document_mask.py times it against today's ring
(model/blockwise.py on the CPU flash kernel) on the plain causal case. Nothing in fivefold imports it.

It computed each (query chunk, key chunk) pair as dense fp32 `einsum` score tiles (B, K, G, c, c)
with a hand-written backward, and knew causality only (no documents, windows or sinks).
"""

from __future__ import annotations

import torch

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.context import _check_gqa, _chunk_ids

_TAG_KV, _TAG_DKV = 1, 2  # distinct tags: a K/V block and a dK/dV buffer can be in flight together


def _exchange(send: torch.Tensor, recv: torch.Tensor, group: AxisGroup, tag: int) -> collectives.Pending | None:
    """Post: send `send` to the next rank, receive `recv` from the previous one; wait() on the result.

    A group of size 1 is its own neighbour: copy, nothing to wait for.
    """
    if group.size == 1:
        recv.copy_(send)
        return None
    n, r = group.size, group.rank
    return collectives.exchange(send, recv, (r + 1) % n, (r - 1) % n, group, "ring hop", tag)


def _wait(hop: collectives.Pending | None) -> None:
    if hop is not None:
        hop.wait()


def _pair_mode(q_chunk: int, kv_chunk: int) -> str | None:
    """Causal attention between two chunks of the true sequence: all, the diagonal, or nothing."""
    if kv_chunk < q_chunk:
        return "full"  # every key precedes every query
    return "causal" if kv_chunk == q_chunk else None  # a later chunk is masked out entirely


def _scores(q: torch.Tensor, k: torch.Tensor, mode: str, scale: float) -> torch.Tensor:
    """q (B, K, G, c, D), k (B, K, c', D) -> scaled scores (B, K, G, c, c'), -inf above the diagonal."""
    s = torch.einsum("bkgqd,bktd->bkgqt", q, k) * scale  # K/V heads broadcast over their G query heads
    if mode == "causal":
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, T, H, D) -> fp32 (B, K, G, T, D): query head h uses K/V head h // G, as repeat_interleave."""
    B, T, H, D = x.shape
    return x.float().permute(0, 2, 1, 3).reshape(B, kv_heads, H // kv_heads, T, D)


def _ungrouped(x: torch.Tensor) -> torch.Tensor:
    """(B, K, G, T, D) -> (B, T, H, D)."""
    B, K, G, T, D = x.shape
    return x.reshape(B, K * G, T, D).permute(0, 2, 1, 3)


class _RingAttention(torch.autograd.Function):
    """Exact causal attention with K/V blocks passed around the cp ring; hand-written backward.

    Blocks are computed with plain fp32 matmuls rather than a fused kernel: one code path on every
    device (the CPU flash op's signature and outputs differ from CUDA's), and forward and backward
    share `_scores`, so the probabilities the backward recomputes are those the forward summed. The
    price is a (B, H, T/2cp, T/2cp) fp32 score tile per chunk pair; a fused kernel returning
    (out, lse) can replace `_scores` + softmax without changing the ring or the merge.
    """

    @staticmethod
    def forward(ctx, q, k, v, group: AxisGroup, layout: str):
        n, K, D = group.size, k.shape[2], q.shape[-1]
        scale = D ** -0.5
        q_ids = _chunk_ids(n, group.rank, layout)
        qg = _grouped(q, K).chunk(len(q_ids), dim=3)  # chunks of (B, K, G, c, D)
        outs: list[torch.Tensor | None] = [None] * len(q_ids)  # normalised partial outputs, fp32
        lses: list[torch.Tensor | None] = [None] * len(q_ids)  # (B, K, G, c) log-sum-exp so far
        kv = torch.stack([k, v])  # (2, B, T/cp, K, D): one message per hop, K heads only
        for step in range(n):
            src = (group.rank - step) % n  # whose block is in hand
            if step < n - 1:  # post the next hop first: it travels while this block is computed
                kv_next = torch.empty_like(kv)
                hop = _exchange(kv, kv_next, group, _TAG_KV)
            kc = kv[0].float().transpose(1, 2).chunk(len(q_ids), dim=2)  # (B, K, c, D) each
            vc = kv[1].float().transpose(1, 2).chunk(len(q_ids), dim=2)
            for i, a in enumerate(q_ids):
                for j, b in enumerate(_chunk_ids(n, src, layout)):
                    mode = _pair_mode(a, b)
                    if mode is None:
                        continue
                    s = _scores(qg[i], kc[j], mode, scale)  # (B, K, G, c, c)
                    lse = torch.logsumexp(s, dim=-1)  # (B, K, G, c)
                    out = torch.einsum("bkgqt,bktd->bkgqd", torch.exp(s - lse[..., None]), vc[j])
                    if outs[i] is None:
                        outs[i], lses[i] = out, lse
                    else:  # online softmax: rescale both partial results to the merged normaliser
                        merged = torch.logaddexp(lses[i], lse)
                        outs[i] = (outs[i] * torch.exp(lses[i] - merged)[..., None]
                                   + out * torch.exp(lse - merged)[..., None])
                        lses[i] = merged
            if step < n - 1:
                _wait(hop)
                kv = kv_next
        # Every query chunk met its own diagonal block, so no entry of outs/lses is None here.
        out = _ungrouped(torch.cat(outs, dim=3)).to(q.dtype)  # (B, T/cp, H, D)
        ctx.save_for_backward(q, k, v, out, torch.cat(lses, dim=3))
        ctx.group, ctx.layout = group, layout
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        n, K, D = group.size, k.shape[2], q.shape[-1]
        scale = D ** -0.5
        q_ids = _chunk_ids(n, group.rank, layout)
        nq = len(q_ids)
        qg = _grouped(q, K).chunk(nq, dim=3)  # (B, K, G, c, D) each
        dog = _grouped(dout, K)  # (B, K, G, T/cp, D)
        # FlashAttention's backward: with P recomputed from the final lse, dS = P o (dP - rowsum(dO o O)).
        delta = (dog * _grouped(out, K)).sum(-1).chunk(nq, dim=3)  # (B, K, G, c) each
        dog, lse = dog.chunk(nq, dim=3), lse.chunk(nq, dim=3)
        dq = [torch.zeros_like(x) for x in qg]  # stays here: the queries never move
        kv = torch.stack([k, v])  # (2, B, T/cp, K, D)
        incoming = None  # (handles, buffers) of the dK/dV buffer arriving for the block in hand
        for step in range(n):
            src = (group.rank - step) % n
            if step < n - 1:
                kv_next = torch.empty_like(kv)
                hop = _exchange(kv, kv_next, group, _TAG_KV)
            kc = kv[0].float().transpose(1, 2).chunk(nq, dim=2)  # (B, K, c, D) each
            vc = kv[1].float().transpose(1, 2).chunk(nq, dim=2)
            dkv = torch.zeros(2, *kc[0].shape[:2], kv.shape[2], D,
                              device=q.device)  # (2, B, K, T/cp, D) fp32: this rank's share
            dk, dv = dkv[0].chunk(nq, dim=2), dkv[1].chunk(nq, dim=2)  # views, accumulated in place
            for i, a in enumerate(q_ids):
                for j, b in enumerate(_chunk_ids(n, src, layout)):
                    mode = _pair_mode(a, b)
                    if mode is None:
                        continue
                    p = torch.exp(_scores(qg[i], kc[j], mode, scale) - lse[i][..., None])  # (B, K, G, c, c)
                    dv[j].add_(torch.einsum("bkgqt,bkgqd->bktd", p, dog[i]))
                    dp = torch.einsum("bkgqd,bktd->bkgqt", dog[i], vc[j])
                    ds = p * (dp - delta[i][..., None]) * scale  # (B, K, G, c, c)
                    dq[i].add_(torch.einsum("bkgqt,bktd->bkgqd", ds, kc[j]))
                    dk[j].add_(torch.einsum("bkgqt,bkgqd->bktd", ds, qg[i]))
            if incoming is not None:  # add what the ranks before us contributed to this block
                _wait(incoming[0])
                dkv.add_(incoming[1])
            # Pass the block's gradient on; after the last step it reaches the block's owner.
            buf = torch.empty_like(dkv)
            incoming = (_exchange(dkv, buf, group, _TAG_DKV), buf, dkv)  # dkv kept alive while in flight
            if step < n - 1:
                _wait(hop)
                kv = kv_next
        _wait(incoming[0])
        dkv = incoming[1].transpose(2, 3)  # (2, B, T/cp, K, D): this rank's own block, summed over the ring
        dq = _ungrouped(torch.cat(dq, dim=3))  # (B, T/cp, H, D)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                   layout: str = "zigzag") -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence, K/V passed around `group`.

    q (B, T/cp, H, D), k and v (B, T/cp, K, D), tokens in `layout` order -> (B, T/cp, H, D).
    """
    _check_gqa(q, k, v)
    _chunk_ids(group.size, group.rank, layout)  # a clear error for an unknown layout
    if q.shape[1] % len(_chunk_ids(group.size, 0, layout)):
        raise ValueError(f"{q.shape[1]} local tokens do not split into the {layout} layout's chunks")
    return _RingAttention.apply(q, k, v, group, layout)
