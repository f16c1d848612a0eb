"""Context parallel: one sample's sequence split over the `cp` ranks, attention made exact again.

What is sharded over `cp`: the tokens of every sequence. Each rank runs the whole model (all
weights, all heads) on T/cp tokens. Everything but attention is per token, so it needs nothing;
attention needs every earlier token's keys and values. Two ways to bring them (the derivations,
the zig-zag arithmetic and the byte counts are in docs/context-parallel.md):

Ring attention (Liu et al. 2023), `method="ring"`. Queries stay; each rank's K/V block (K heads
only) travels around the ring, cp-1 hops, posted before the block in hand is computed so it
travels while the rank computes. Each (query chunk, key chunk) pair runs through an attention
kernel that returns its log-sum-exp (CPU: PyTorch's flash op; CUDA: the memory-efficient one), and
partial results merge by log-sum-exp rescaling (the online softmax), so the result is exact: this
is model/blockwise.py's exact masked path with its blocks arriving from the ring, so documents,
sliding windows and sinks apply as on one process, and a pair the mask empties is not computed
(its K/V still travel; `take_blocks` counts). Backward: the blocks go round again, each with a
buffer accumulating its dK/dV, which arrives back at its owner after the last hop. Collectives:
send/recv of (cp-1) K/V blocks forward; (cp-1) K/V blocks and cp fp32 dK/dV buffers backward.
Layout "zigzag": rank i holds chunks i and 2cp-1-i of 2cp, so every rank computes the same number
of causal query-key pairs. Document ids are of whole rows, which every rank holds before the split:
nothing about the mask travels.

Ulysses (Jacobs et al. 2023), `method="ulysses"`. An all-to-all turns sequence-sharded q/k/v
(B, T/cp, H, D) into head-sharded (B, T, H/cp, D); each rank runs plain causal attention for its
heads over the whole sequence (with the mask, as on one process), and a second all-to-all turns the
output back (backward: the same pair inverted). Layout "contiguous"; needs the query and K/V heads
per tp rank divisible by cp.

What the training step must do (both methods): shard input ids and the already-shifted targets
with `shard`, pass `positions` to the model for RoPE (true positions, not 0..T/cp-1; with
data.reset_positions those of the whole row, restarted per document, then sharded), divide the
loss by the global token count, and sum parameter gradients over cp as well as dp (the mesh's
"grad" view), because cp ranks hold different tokens of the same samples.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.attention import attend, backend_for
from fivefold.model.blockwise import Layout, blockwise_attention
from fivefold.model.masks import AttentionMask
from fivefold.parallel.comm import collectives, regions
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.mesh import Mesh

LAYOUTS = ("zigzag", "contiguous")
METHODS = {"ring": "zigzag", "ulysses": "contiguous"}  # cp method -> the token layout it uses


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


class _Ring:
    """The cp group as model/blockwise.py's BlockSource: K/V blocks hop to the next rank, and the
    chunk pairs each forward computed and skipped are counted for the step's record."""

    def __init__(self, group: AxisGroup, counts: list[int]):
        self.group, self.size, self.rank = group, group.size, group.rank
        self.counts = counts  # [computed, skipped], the ContextParallel's

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> collectives.Pending:
        n, r = self.size, self.rank
        return collectives.exchange(send, recv, (r + 1) % n, (r - 1) % n, self.group, "ring hop", tag)

    def count(self, computed: int, skipped: int) -> None:
        self.counts[0] += computed
        self.counts[1] += skipped


def _check_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1] or q.shape[2] % k.shape[2]:
        raise ValueError(f"expected q (B, T, H, D) and k, v (B, T, K, D) with K dividing H; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                   layout: str = "zigzag", mask: AttentionMask | None = None,
                   counts: list[int] | None = None, scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence under `mask` (None: causal alone),
    K/V passed around `group`: the exact blockwise path of model/blockwise.py, its blocks arriving
    from the ring. q (B, T/cp, H, D), k and v (B, T/cp, K, D), tokens in `layout` order ->
    (B, T/cp, H, D); mask.doc holds the whole rows' (B, T) document ids. `counts` ([computed,
    skipped] chunk pairs) grows by this call's. `scale`: the softmax scale (None: 1/sqrt(D))."""
    _check_gqa(q, k, v)
    n = group.size
    ids = tuple(tuple(_chunk_ids(n, r, layout)) for r in range(n))  # a clear error for an unknown layout
    if q.shape[1] % len(ids[0]):
        raise ValueError(f"{q.shape[1]} local tokens do not split into the {layout} layout's chunks")
    ring = _Ring(group, counts if counts is not None else [0, 0])
    return blockwise_attention(q, k, v, mask, ring, Layout(ids, q.shape[1] // len(ids[0])), scale=scale)


# ---- Ulysses ----


def _all_to_all(x: torch.Tensor, group: AxisGroup, split: int, cat: int) -> torch.Tensor:
    """Split dim `split` into cp parts, send part j to rank j, concatenate what arrives along `cat`
    (in source-rank order). Its gradient is the inverse all-to-all: the same with the dims swapped."""
    ones = [1] * group.size
    send = torch.stack(x.chunk(group.size, dim=split))  # (cp, ...): part j for rank j
    return torch.cat(regions.all_to_all_rows(send, group, ones, ones).unbind(0), dim=cat)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: AxisGroup,
                      mask: AttentionMask | None = None, backend: str = "auto",
                      scale: float | None = None) -> torch.Tensor:
    """Attention by all-to-all over heads: q (B, T/cp, H, D), k and v (B, T/cp, K, D), tokens in the
    contiguous layout -> (B, T/cp, H, D). One all-to-all in (q, k, v packed), one out. Each rank then
    holds the whole sequence for its part of the heads, so `mask` (whole rows' documents, the window,
    its heads' sinks) applies as on one process, through the local kernel `backend` picks, with the
    softmax scale `scale` (None: 1/sqrt(D))."""
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
    heads = H // n
    own = None if mask is None else mask.head_slice(group.rank * heads, (group.rank + 1) * heads)
    out = attend(qh, kh, vh, own, scale, backend)  # (B, T, H/cp, D)
    return _all_to_all(out, group, 1, 2)  # (B, T/cp, H, D)


# ---- what the model and the training loop use ----


class ContextParallel:
    """One cp group and method: the token layout, the positions for RoPE, and the attention core."""

    def __init__(self, group: AxisGroup, method: str = "ring", backend: str = "auto"):
        if method not in METHODS:
            raise ValueError(f"unknown cp_method '{method}'; choose one of {sorted(METHODS)}")
        self.group, self.method, self.backend = group, method, backend
        self.layout = METHODS[method]
        self.blocks = [0, 0]  # ring chunk pairs computed and skipped (fully masked) since take_blocks()

    def positions(self, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
        """True positions of this rank's tokens (T/cp,): what RoPE must rotate by."""
        return positions(seq_len, self.group.size, self.group.rank, self.layout, device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens: (B, T, ...) -> (B, T/cp, ...). Shift targets before sharding."""
        return shard_sequence(x, self.group.size, self.group.rank, self.layout, dim)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             mask: AttentionMask | None = None, scale: float | None = None) -> torch.Tensor:
        """Drop-in for Attention.core: (B, T/cp, H, D), (B, T/cp, K, D) x2, mask, softmax scale ->
        (B, T/cp, H, D)."""
        if self.method == "ulysses":
            return ulysses_attention(q, k, v, self.group, mask, self.backend, scale)
        return ring_attention(q, k, v, self.group, self.layout, mask, self.blocks, scale)

    def kernels(self, cfg: Config, device_type: str) -> dict[str, str]:
        """What attends, by layer kind present ("causal": causality alone; "masked": documents, a
        window or sinks): the local kernel (model/attention.py backend_for), behind Ulysses' all-to-all
        ("ulysses/flex"), or ring attention's blockwise path. For the run's layout event."""
        m = cfg.model
        masked_always = cfg.data.document_mask or m.attention.sinks
        windows = {m.attention.layer_window(i) for i in range(m.n_layers)}
        kinds = {"masked"} if masked_always else {"masked" if w else "causal" for w in windows}
        local = {kind: backend_for(kind == "masked", device_type, self.backend) for kind in sorted(kinds)}
        if self.group.size == 1:
            return local
        return {kind: "ring/blockwise" if self.method == "ring" else f"ulysses/{k}" for kind, k in local.items()}

    def take_blocks(self) -> dict[str, int]:
        """Ring attention's chunk pairs since the last call: {"computed": .., "skipped": ..}, summed
        over layers, micro-batches and forwards (a recomputed forward counts again)."""
        computed, skipped = self.blocks
        self.blocks[:] = [0, 0]
        return {"computed": computed, "skipped": skipped}


def apply_context_parallel(model: nn.Module, mesh: Mesh, cfg: Config, derived: Derived) -> ContextParallel:
    """Swap every block's attention core for the cp one; return the ContextParallel for the loop.

    At cp = 1 the model is left as it is (the local core is already exact) and the returned object
    shards nothing and gives positions 0..T-1, so the loop calls it the same way for any cp.
    """
    cp = ContextParallel(mesh.group("cp"), cfg.parallel.cp_method, cfg.model.attention.backend)
    if cp.group.size > 1:
        for block in model.blocks():
            block.attn.core = cp.core
    return cp
