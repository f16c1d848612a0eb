"""Exact attention in tiles, each through a fused kernel that returns its log-sum-exp: the masked
path on any device, and the engine ring attention runs on (parallel/context.py).

The keys are cut into blocks; each (query tile, key tile) pair is one of
- skipped: the mask keeps none of its pairs (a later tile, another document, beyond the window);
- full: it keeps every pair (the kernel runs unmasked);
- causal: a tile on the diagonal, kept below it (the kernel's own `is_causal`);
- masked: anything else: the kernel gets a small additive bias tile (0 / -inf) built from the rule
  in model/masks.py, at most `tile` x `tile` per row of the batch. Never a (T, T) tensor.
The decision needs the document ids at tile boundaries only (`plan_tiles`), read where they were
computed, on the host (masks.DocumentIds): a plan waits for nothing on the device.
Partial results merge by their log-sum-exp (the online softmax, Milakov & Gimelshein 2018), in fp32.

Backward is FlashAttention's (Dao et al. 2022, alg. 4), tile by tile through the kernel's own
backward: given the *final* output O and log-sum-exp L of every query row, a tile's gradients are
those of P = exp(S - L) with dS = P o (dP - rowsum(dO o O)), so each tile's backward needs nothing
from the other tiles. Forward and backward run the same kernel pair in the same dtype (whatever
autocast made q, k, v), so the probabilities the backward rebuilds are those the forward summed.

Attention sinks (gpt-oss) are a key every query sees with logit s_h and a zero value: the final
L' = logaddexp(L, s_h) and O' = O exp(L - L'). With O' and L' the tiles' backward is again exact
for q, k, v (the sink adds nothing to dP), and ds_h = -sum over rows of exp(s_h - L') rowsum(dO o O').

Where the key/value blocks come from is a `BlockSource`: this rank alone (`LOCAL`), or a ring of
ranks passing them on (context parallel), posted before the block in hand is computed.
Shapes: B batch, T tokens (this rank's), H query heads, K key/value heads, D head width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from fivefold.model.logit_max import raise_logit_max
from fivefold.model.masks import AttentionMask, keep

SKIP, FULL, CAUSAL, MASKED = 0, 1, 2, 3
TILE = 512  # the largest masked tile's side: its bias is (B, 1, TILE, TILE) in the compute dtype
_BIAS_ALIGN = 16  # entries a bias row is padded to: 16 bytes in any dtype of at least one byte (_bias)
_TAG_KV, _TAG_DKV = 1, 2  # distinct tags: a K/V block and a dK/dV buffer can be in flight together


class Hop(Protocol):
    def wait(self) -> None: ...


class BlockSource(Protocol):
    """Where key/value blocks come from: `size` ranks in a ring, this one `rank`."""

    size: int
    rank: int

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> Hop:
        """Send `send` to the next rank, receive `recv` from the previous one (never called alone)."""

    def count(self, computed: int, skipped: int) -> None:
        """Chunk pairs this forward computed and skipped (a fully masked pair's K/V still travel)."""


@dataclass(frozen=True)
class _Local:
    size: int = 1
    rank: int = 0

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, tag: int) -> Hop:
        raise AssertionError("a single rank exchanges nothing")

    def count(self, computed: int, skipped: int) -> None:
        pass


LOCAL = _Local()


@dataclass(frozen=True)
class Layout:
    """Which chunks of the whole sequence each rank holds: `chunks[r]` in r's local order, each
    `chunk` tokens (one chunk of T for a single rank; zig-zag's two of T/2cp under ring attention)."""

    chunks: tuple[tuple[int, ...], ...]
    chunk: int


@dataclass(frozen=True)
class Tile:
    q: slice  # this rank's query rows
    k: slice  # rows of the key/value block in hand (its owner's local order)
    kind: int  # FULL, CAUSAL or MASKED
    q_pos: int  # place in the row of the first query and the first key: a masked tile's bias
    k_pos: int


@dataclass(frozen=True)
class Plan:
    steps: tuple[tuple[Tile, ...], ...]  # per ring step: the tiles with the block of rank (rank - step)
    computed: int  # chunk pairs with work
    skipped: int  # chunk pairs the mask empties


def _sub_tile(chunk: int, tile: int) -> int:
    """The side of the tiles a chunk is cut into where the mask needs it: the largest divisor <= tile."""
    return max(d for d in range(1, min(chunk, tile) + 1) if chunk % d == 0)


def tile_kinds(T: int, s: int, window: int, doc: torch.Tensor | None,
               device: torch.device | None = None) -> torch.Tensor:
    """The kind of every (query tile i, key tile j) of side s over the whole row, per row of the batch:
    (B, n, n) with documents, else (1, n, n), n = ceil(T / s) (a last tile may be shorter), on doc's
    device (else `device`). The blockwise plan and FlexAttention's block mask (model/flex.py) read it.

    Documents are contiguous and their ids grow along the row, so the ids at tile ends decide: every
    pair shares one document iff key tile j's first token and query tile i's last are in the same
    one; none does iff key tile j's last document ends before query tile i's first begins."""
    device = doc.device if doc is not None else device
    starts = torch.arange(0, T, s, device=device)  # (n,) each tile's first place
    ends = (starts + s - 1).clamp(max=T - 1)  # (n,) and its last
    n = starts.numel()
    i = torch.arange(n, device=device)[:, None]  # (n, 1) query tiles
    j = torch.arange(n, device=device)[None, :]  # (1, n) key tiles
    skip = (j > i)[None]  # (1, n, n): causal
    partial = torch.zeros(1, n, n, dtype=torch.bool, device=device)
    if window:
        skip = skip | (starts[:, None] - ends[None, :] >= window)  # the nearest pair is already out of the window
        partial = partial | (ends[:, None] - starts[None, :] >= window)  # the farthest pair is
    if doc is not None:
        first, last = doc[:, starts], doc[:, ends]  # (B, n) each: ids at tile ends
        skip = skip | (last[:, None, :] < first[:, :, None])  # (B, n, n): [b, i, j], no pair shares one
        partial = partial | (first[:, None, :] != last[:, :, None])  # not every pair does
    kind = torch.where(partial, MASKED, torch.where(i == j, CAUSAL, FULL))
    return torch.where(skip, SKIP, kind)


def _whole(block: list[list[int]], diagonal: bool) -> int | None:
    """One call for the chunk pair when its tiles allow (the kind), None to go tile by tile."""
    flat = {k for row in block for k in row}
    if flat == {SKIP}:
        return SKIP
    if not diagonal:
        return FULL if flat == {FULL} else None
    m = len(block)
    lower = all(block[u][w] == (FULL if u > w else CAUSAL if u == w else SKIP) for u in range(m) for w in range(m))
    return CAUSAL if lower else None


def plan_tiles(layout: Layout, rank: int, window: int, doc: torch.Tensor | None, tile: int = TILE) -> Plan:
    """Every tile rank `rank` computes, per ring step, and how many chunk pairs the mask empties."""
    n, c = len(layout.chunks), layout.chunk
    s = _sub_tile(c, tile)
    m = c // s
    rows = tile_kinds(c * sum(len(ids) for ids in layout.chunks), s, window, doc)  # (B or 1, T/s, T/s)
    # One plan for the batch: a tile pair of one kind in every row is of that kind, else masked
    # (each row's bias then says what it keeps). Read once, on the host where the ids were computed.
    kinds = torch.where((rows == rows[:1]).all(0), rows[0], MASKED).tolist()
    steps, computed, skipped = [], 0, 0
    for step in range(n):
        tiles = []
        for i, a in enumerate(layout.chunks[rank]):
            for j, b in enumerate(layout.chunks[(rank - step) % n]):
                block = [row[b * m:(b + 1) * m] for row in kinds[a * m:(a + 1) * m]]
                whole = _whole(block, a == b)
                skipped += whole == SKIP
                computed += whole != SKIP
                if whole is not None:
                    if whole != SKIP:
                        tiles.append(Tile(slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), whole, a * c, b * c))
                    continue
                for u in range(m):
                    for w in range(m):
                        if block[u][w] != SKIP:
                            tiles.append(Tile(slice(i * c + u * s, i * c + (u + 1) * s),
                                              slice(j * c + w * s, j * c + (w + 1) * s),
                                              block[u][w], a * c + u * s, b * c + w * s))
        steps.append(tuple(tiles))
    return Plan(tuple(steps), computed, skipped)


def _bias(tile: Tile, window: int, doc: torch.Tensor | None, dtype: torch.dtype,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A masked tile's additive bias (B or 1, 1, t, t) and which query rows see any key (B or 1, 1, t).

    The bias is a view of rows padded to a multiple of 16 entries: the memory-efficient kernel wants
    every stride but the last a multiple of 16 bytes (8 entries in bf16, 4 in fp32; xFormers' bias
    check), and tiles of 500 (chunks of 1000, 2000, 4000, 6000) are not. SDPA pads its own masks so
    (aten's pad_bias). One path on every device: the CPU kernel takes the view as it is."""
    t = tile.q.stop - tile.q.start
    qp = torch.arange(tile.q_pos, tile.q_pos + t, device=device)  # (t,)
    kp = torch.arange(tile.k_pos, tile.k_pos + t, device=device)
    q_doc = None if doc is None else doc[:, None, qp, None]  # (B, 1, t, 1)
    k_doc = None if doc is None else doc[:, None, None, kp]  # (B, 1, 1, t)
    allowed = keep(qp[:, None], kp[None, :], window, q_doc, k_doc)  # (B, 1, t, t) or (t, t)
    allowed = allowed.view(-1, 1, t, t)
    width = t + -t % _BIAS_ALIGN  # t rounded up to 16
    bias = torch.zeros(*allowed.shape[:3], width, dtype=dtype, device=device)[..., :t]  # (B or 1, 1, t, t) view
    bias.masked_fill_(~allowed, float("-inf"))
    return bias, allowed.any(-1)


# ---- the kernels: (B, H, t, D) queries, (B, K, t, D) keys and values, K dividing H ----

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _cpu_forward(q, k, v, causal: bool, bias, scale: float):
    """PyTorch's CPU flash attention: (out, lse), grouped K/V heads taken as they are."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                      scale=scale)


def _cpu_backward(dout, q, k, v, out, lse, causal: bool, bias, scale: float):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


# The memory-efficient kernel's log-sum-exp rows come padded to a multiple of 32 (not on ROCm,
# pytorch/pytorch#146848), and its backward reads them so.
_LSE_ALIGN = 1 if torch.version.hip else 32


def _repeat(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1).contiguous()  # (B, H, t, D)


def _cuda_forward(q, k, v, causal: bool, bias, scale: float):
    """CUDA's memory-efficient attention (xFormers' kernel in PyTorch): any dtype, an additive bias,
    and the log-sum-exp. It takes K/V repeated to the query heads."""
    H, t = q.shape[1], q.shape[2]
    if bias is not None:
        bias = bias.expand(q.shape[0], H, t, k.shape[2])
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q.contiguous(), _repeat(k, H), _repeat(v, H), bias, True, 0.0, causal, scale=scale)
    return out, lse[..., :t]


def _cuda_backward(dout, q, k, v, out, lse, causal: bool, bias, scale: float):
    B, H, t, _ = q.shape
    K = k.shape[1]
    if bias is not None:
        bias = bias.expand(B, H, t, k.shape[2])
    lse = torch.nn.functional.pad(lse, (0, -t % _LSE_ALIGN))  # (B, H, t rounded up)
    no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # no dropout: the seed is never read
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q.contiguous(), _repeat(k, H), _repeat(v, H), bias, out.contiguous(), lse,
        no_rng, no_rng, 0.0, [True, True, True, False], causal, scale=scale)
    # A K/V head served H/K query heads: its gradient is their sum.
    return dq, dk.view(B, K, H // K, *dk.shape[2:]).sum(2), dv.view(B, K, H // K, *dv.shape[2:]).sum(2)


def kernels(device: torch.device) -> tuple[Forward, Backward]:
    """The tile kernel pair for a device."""
    return (_cuda_forward, _cuda_backward) if device.type == "cuda" else (_cpu_forward, _cpu_backward)


# ---- the autograd function ----


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    """What partial results and gradients add up in: fp32, or fp64 for fp64 inputs (the tests')."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_o: torch.Tensor) -> None:
    """Fold a tile's (o, lse_o) into the running (out, lse) in place: (B, H, t, D) and (B, H, t), fp32.
    Rows that have seen no key yet hold lse = -inf and count nothing."""
    merged = torch.logaddexp(lse, lse_o)
    base = merged.masked_fill(merged == float("-inf"), 0.0)  # exp(-inf - base) = 0, never exp(nan)
    out.mul_(torch.exp(lse - base)[..., None]).add_(o.to(out.dtype) * torch.exp(lse_o - base)[..., None])
    lse.copy_(merged)


@dataclass(frozen=True)
class _Call:
    source: BlockSource
    layout: Layout
    window: int
    tile: int
    doc_host: torch.Tensor | None  # the document ids the plan reads (on the host when given so)
    scale: float | None  # the softmax scale; None: 1/sqrt(D)
    logit_max: torch.Tensor | None = None  # (H,) each head's largest logit, raised by every tile (logit_max.py)


def _no_autocast(device: torch.device):
    """Autocast off inside: the kernels run in the dtype autocast gave q, k, v, forward and backward."""
    if device.type in ("cpu", "cuda"):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()  # a device without autocast (meta: the fake-device test)


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, doc, call: _Call):
        with _no_autocast(q.device):
            plan = plan_tiles(call.layout, call.source.rank, call.window, call.doc_host, call.tile)
            call.source.count(plan.computed, plan.skipped)
            out, lse = _forward(q, k, v, sinks, doc, call, plan)
        ctx.save_for_backward(q, k, v, out, lse, sinks, doc)
        ctx.call, ctx.plan = call, plan
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks, doc = ctx.saved_tensors
        with _no_autocast(q.device):
            dq, dk, dv, dsinks = _backward(dout, q, k, v, out, lse, sinks, doc, ctx.call, ctx.plan)
        return dq, dk, dv, dsinks, None, None


def _forward(q, k, v, sinks, doc, call: _Call, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, T, H, D) in q's dtype, lse (B, H, T) in the accumulator's dtype) of this rank's
    queries over every block."""
    source, n, dtype = call.source, call.source.size, q.dtype
    fwd, _ = kernels(q.device)
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    qh = q.transpose(1, 2)  # (B, H, T, D)
    acc = _accumulator(dtype)
    out = torch.zeros(qh.shape, dtype=acc, device=q.device)  # normalised partial outputs
    lse = torch.full(qh.shape[:3], float("-inf"), dtype=acc, device=q.device)  # (B, H, T)
    kv = torch.stack([k.to(dtype), v.to(dtype)])  # (2, B, T, K, D): one message per hop, K heads only
    for step in range(n):
        if step < n - 1:  # post the next hop first: it travels while this block is computed
            kv_next = torch.empty_like(kv)
            hop = source.exchange(kv, kv_next, _TAG_KV)
        kh, vh = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, K, T, D)
        for t in plan.steps[step]:
            bias, seen = _bias(t, call.window, doc, dtype, q.device) if t.kind == MASKED else (None, None)
            o, lse_o = fwd(qh[:, :, t.q], kh[:, :, t.k], vh[:, :, t.k], t.kind == CAUSAL, bias, scale)
            if call.logit_max is not None:
                raise_logit_max(call.logit_max, qh[:, :, t.q], kh[:, :, t.k], t.kind == CAUSAL, bias, scale)
            if seen is not None:  # a row that sees no key of this tile: nothing (the kernel says lse 0)
                lse_o = lse_o.masked_fill(~seen, float("-inf"))
                o = o.masked_fill(~seen[..., None], 0.0)
            _merge(out[:, :, t.q], lse[:, :, t.q], o, lse_o)
        if step < n - 1:
            hop.wait()
            kv = kv_next
    if sinks is not None:  # one more key, logit s_h, value 0: it only grows the denominator
        final = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])  # (B, H, T)
        out.mul_(torch.exp(lse - final)[..., None])
        lse = final
    return out.to(dtype).transpose(1, 2), lse  # (B, T, H, D), (B, H, T)


def _backward(dout, q, k, v, out, lse, sinks, doc, call: _Call, plan: Plan):
    source, n, dtype = call.source, call.source.size, q.dtype
    _, bwd = kernels(q.device)
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    qh, oh = q.transpose(1, 2), out.transpose(1, 2)  # (B, H, T, D)
    doh = dout.to(dtype).transpose(1, 2)  # (B, H, T, D)
    dsinks = None
    if sinks is not None:  # ds_h = -sum_rows p_sink * rowsum(dO o O)
        delta = (doh.to(lse.dtype) * oh.to(lse.dtype)).sum(-1)  # (B, H, T)
        dsinks = -(torch.exp(sinks.to(lse.dtype)[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
    dq = torch.zeros(qh.shape, dtype=lse.dtype, device=q.device)  # the queries never move
    kv = torch.stack([k.to(dtype), v.to(dtype)])  # (2, B, T, K, D)
    incoming = None  # (hop, buffer, kept) of the dK/dV arriving for the block in hand (a ring only)
    for step in range(n):
        if step < n - 1:
            kv_next = torch.empty_like(kv)
            hop = source.exchange(kv, kv_next, _TAG_KV)
        kh, vh = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # (B, K, T, D)
        dkv = torch.zeros(2, *kh.shape, dtype=lse.dtype, device=q.device)  # (2, B, K, T, D): our share
        for t in plan.steps[step]:
            bias = _bias(t, call.window, doc, dtype, q.device)[0] if t.kind == MASKED else None
            gq, gk, gv = bwd(doh[:, :, t.q], qh[:, :, t.q], kh[:, :, t.k], vh[:, :, t.k], oh[:, :, t.q],
                             lse[:, :, t.q].contiguous(), t.kind == CAUSAL, bias, scale)
            dq[:, :, t.q] += gq
            dkv[0, :, :, t.k] += gk
            dkv[1, :, :, t.k] += gv
        if n == 1:  # alone: the block in hand is this rank's own
            break
        if incoming is not None:  # add what the ranks before us contributed to this block
            incoming[0].wait()
            dkv.add_(incoming[1])
        # Pass the block's gradient on; after the last step it reaches the block's owner.
        buf = torch.empty_like(dkv)
        incoming = (source.exchange(dkv, buf, _TAG_DKV), buf, dkv)  # dkv kept alive while in flight
        if step < n - 1:
            hop.wait()
            kv = kv_next
    if incoming is not None:
        incoming[0].wait()
        dkv = incoming[1]  # this rank's own block, summed over the ring
    dkv = dkv.transpose(2, 3)  # (2, B, T, K, D)
    return dq.transpose(1, 2).to(dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsinks


@torch.compiler.disable  # host-side planning and Python loops: never traced
def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None,
                        source: BlockSource = LOCAL, layout: Layout | None = None, tile: int = TILE,
                        scale: float | None = None) -> torch.Tensor:
    """Exact attention under `mask`: q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D).

    Alone (`source` LOCAL, `layout` None) the T tokens are the whole row; in a ring they are this
    rank's chunks of it, as `layout` says, and `mask.doc` is still the whole row's (B, T_all).
    `scale`: the softmax scale, handed to the kernels (None: 1/sqrt(D)).
    """
    mask = mask or AttentionMask()
    layout = layout or Layout(((0,),), q.shape[1])
    call = _Call(source, layout, mask.window, tile, mask.doc if mask.doc_host is None else mask.doc_host, scale,
                 mask.logit_max)
    return _BlockwiseAttention.apply(q, k, v, mask.sinks, mask.doc, call)
