"""Context parallel: one sample's sequence split over the `cp` ranks, attention made exact again.

What is sharded over `cp`: the tokens of every sequence. Each rank runs the whole model (all
weights, all heads) on T/cp tokens. Everything but attention is per token, so it needs nothing;
attention needs every earlier token's keys and values. Two ways to bring them (the derivations,
the zig-zag arithmetic and the byte counts are in docs/context-parallel.md):

Ring attention (Liu et al. 2023), `method="ring"`. Queries stay; each rank's K/V block (K heads
only: grouped-query heads are repeated locally, after communication) travels around the ring,
cp-1 hops, posted before the block in hand is computed so it travels while the rank computes.
Partial results merge by log-sum-exp rescaling (the online softmax), so the result is exact.
Backward is written by hand: the blocks go round again, each with a buffer accumulating its dK/dV,
which arrives back at its owner after the last hop. Collectives: send/recv of (cp-1) K/V blocks
forward; (cp-1) K/V blocks and cp fp32 dK/dV buffers backward. Layout "zigzag": rank i holds
chunks i and 2cp-1-i of 2cp, so every rank computes the same number of causal query-key pairs.

Ulysses (Jacobs et al. 2023), `method="ulysses"`. An all-to-all turns sequence-sharded q/k/v
(B, T/cp, H, D) into head-sharded (B, T, H/cp, D); each rank runs plain causal attention for its
heads over the whole sequence, and a second all-to-all turns the output back (backward: the same
pair inverted). Layout "contiguous"; needs the query and K/V heads per tp rank divisible by cp.

What the training step must do (both methods): shard input ids and the already-shifted targets
with `shard`, pass `positions` to the model for RoPE (true positions, not 0..T/cp-1), divide the
loss by the global token count, and sum parameter gradients over cp as well as dp (the mesh's
"grad" view), because cp ranks hold different tokens of the same samples.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import Config
from fivefold.model.attention import causal_attention
from fivefold.parallel.comm import collectives, regions
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.derive import Derived
from fivefold.parallel.mesh import Mesh

LAYOUTS = ("zigzag", "contiguous")
METHODS = {"ring": "zigzag", "ulysses": "contiguous"}  # cp method -> the token layout it uses
_TAG_KV, _TAG_DKV = 1, 2  # distinct tags: a K/V block and a dK/dV buffer can be in flight together


# ---- layouts: which tokens each rank holds ----


def _chunk_ids(cp: int, rank: int, layout: str) -> list[int]:
    """Indices of the equal chunks rank `rank` holds, in local order (2cp chunks for zigzag, cp else)."""
    if layout == "zigzag":
        return [rank, 2 * cp - 1 - rank]
    if layout == "contiguous":
        return [rank]
    raise ValueError(f"unknown context-parallel layout '{layout}'; choose one of {LAYOUTS}")


def _check_seq_len(seq_len: int, cp: int, layout: str) -> int:
    """The chunk length; a clear error if the sequence does not cut evenly."""
    n_chunks = cp * len(_chunk_ids(cp, 0, layout))
    if seq_len % n_chunks:
        raise ValueError(f"sequence length {seq_len} is not divisible by {n_chunks}: the '{layout}' layout "
                         f"cuts it into {n_chunks} equal chunks for cp = {cp}")
    return seq_len // n_chunks


def positions(seq_len: int, cp: int, rank: int, layout: str, device: torch.device | None = None) -> torch.Tensor:
    """True positions of this rank's tokens, in local order: a LongTensor (T/cp,)."""
    c = _check_seq_len(seq_len, cp, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in _chunk_ids(cp, rank, layout)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, layout: str, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor: (B, T, ...) -> (B, T/cp, ...) with dim=1."""
    return x.index_select(dim, positions(x.shape[dim], cp, rank, layout, x.device))


def attention_work(seq_len: int, cp: int, layout: str) -> list[int]:
    """Query-key pairs each rank computes under a causal mask: the token at position p sees p+1 keys."""
    return [int((positions(seq_len, cp, r, layout) + 1).sum()) for r in range(cp)]


# ---- ring attention ----


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


def _check_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"expected q (B, T, H, D) and k, v (B, T, K, D) with K dividing H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


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


# ---- Ulysses ----


def _all_to_all(x: torch.Tensor, group: AxisGroup, split: int, cat: int) -> torch.Tensor:
    """Split dim `split` into cp parts, send part j to rank j, concatenate what arrives along `cat`
    (in source-rank order). Its gradient is the inverse all-to-all: the same with the dims swapped."""
    ones = [1] * group.size
    send = torch.stack(x.chunk(group.size, dim=split))  # (cp, ...): part j for rank j
    return torch.cat(regions.all_to_all_rows(send, group, ones, ones).unbind(0), dim=cat)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Causal attention by all-to-all over heads: q (B, T/cp, H, D), k and v (B, T/cp, K, D), tokens
    in the contiguous layout -> (B, T/cp, H, D). One all-to-all in (q, k, v packed), one out."""
    _check_gqa(q, k, v)
    n, H, K = group.size, q.shape[2], k.shape[2]
    if H % n or K % n:
        raise ValueError(f"Ulysses splits heads over cp = {n}, but the {H} query heads and {K} key/value heads "
                         f"(per tensor-parallel rank) are not both divisible by {n}; use cp_method = 'ring'")
    B, T_local, _, D = q.shape
    # Pack so that head part j of the packed tensor is [q heads j, k heads j, v heads j]: GQA groups
    # stay whole on each rank (query head h and its K/V head h // G land on the same rank).
    parts = [x.reshape(B, T_local, n, x.shape[2] // n, D) for x in (q, k, v)]
    packed = torch.cat(parts, dim=3).flatten(2, 3)  # (B, T/cp, H + 2K, D)
    full = _all_to_all(packed, group, 2, 1)  # (B, T, (H + 2K)/cp, D), rank order = token order
    qh, kh, vh = full.split([H // n, K // n, K // n], dim=2)
    out = causal_attention(qh, kh, vh)  # (B, T, H/cp, D)
    return _all_to_all(out, group, 1, 2)  # (B, T/cp, H, D)


# ---- what the model and the training loop use ----


class ContextParallel:
    """One cp group and method: the token layout, the positions for RoPE, and the attention core."""

    def __init__(self, group: AxisGroup, method: str = "ring"):
        if method not in METHODS:
            raise ValueError(f"unknown cp_method '{method}'; choose one of {sorted(METHODS)}")
        self.group, self.method = group, method
        self.layout = METHODS[method]

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """True positions of this rank's tokens (T/cp,): what RoPE must rotate by."""
        return positions(seq_len, self.group.size, self.group.rank, self.layout, device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens: (B, T, ...) -> (B, T/cp, ...). Shift targets before sharding."""
        return shard_sequence(x, self.group.size, self.group.rank, self.layout, dim)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Drop-in for Attention.core: (B, T/cp, H, D), (B, T/cp, K, D) x2 -> (B, T/cp, H, D)."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group)
        return ring_attention(q, k, v, self.group, self.layout)


def apply_context_parallel(model: nn.Module, mesh: Mesh, cfg: Config, derived: Derived) -> ContextParallel:
    """Swap every block's attention core for the cp one; return the ContextParallel for the loop.

    At cp = 1 the model is left as it is (the local core is already exact) and the returned object
    shards nothing and gives positions 0..T-1, so the loop calls it the same way for any cp.
    """
    cp = ContextParallel(mesh.group("cp"), cfg.parallel.cp_method)
    if cp.group.size > 1:
        for block in model.layers.values():
            block.attn.core = cp.core
    return cp
