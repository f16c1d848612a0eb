"""Collective matmuls (`parallel.tp_overlap`): sequence parallel's all-gather and reduce-scatter
cut into tp pieces that travel around the ring while the matmul works on the piece already here.

The decomposition of Wang et al. 2022 ("Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models"); Megatron-LM's userbuffers and PyTorch's async TP
do the same on GPUs. With sp, a column-parallel region starts from this rank's T/n tokens and
needs all T; a row-parallel layer's partial sums leave it summed and split along T:

    blocking                          decomposed, n steps on rank r
    x = all_gather(x_r)               step s: rank r holds the tokens of rank (r - s) mod n; it posts
    y = x Wᵀ                          their send to r + 1 and the receive of the next piece from
                                      r - 1, then multiplies the piece it holds while they travel
    y_r = reduce_scatter(x Wᵀ)        step s: rank r computes its share of the piece it must send
                                      next while the previous partial sum travels, adds what it
                                      received, sends on (comm/ring.py's reduce-scatter, each chunk
                                      computed one step before the ring needs it)

Only one piece's matmul has nothing to hide behind (the last to arrive, or the first to be
sent), so with compute to spare 1/n of the communication stays exposed. Each rank sends n - 1
pieces of S/n bytes, the (n-1)/n x S the ring collectives move: the wire bytes per axis are the
blocking path's; the calls are n - 1 sends in place of one collective.

Backward runs the conjugates the same way. The all-gather's is a reduce-scatter of the input
gradient dx = Σ_i dy_i W_i, each piece computed as the ring needs it; the reduce-scatter's is an
all-gather of dy whose pieces feed dx = dy W as they arrive. Weight gradients wait for the
whole gathered tensor and are one matmul each, as the blocking path's are, so they are the same
numbers; outputs and input gradients are computed piece by piece (rows of the same matmuls) and
summed in the ring's order. The pieces are numbered as comm/ring.py numbers its chunks.

Under autocast (bf16) the backward runs under the forward's autocast, so its matmuls cast what
the blocking path's autocast casts (bf16 gradients against bf16 copies of the fp32 weights), and
the input gradient's branches are summed in the input's dtype, as autograd sums the blocking
path's after each branch's cast back: the same numbers as the blocking path in bf16 too.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.comm.ring import all_gather_step, reduce_scatter_step


def _ring_gather(local: torch.Tensor, group: AxisGroup, use: Callable[[int, torch.Tensor], None]) -> list[torch.Tensor]:
    """All-gather (B, T/n, ...) pieces along the sequence in n - 1 ring steps, calling use(c, piece)
    on each piece (rank c's tokens) while the next one travels. Returns the pieces in rank order."""
    n, r = group.size, group.rank
    pieces: list[torch.Tensor | None] = [None] * n
    pieces[r] = local.contiguous()
    for s in range(n):
        held = (r - s) % n
        pending = None
        if s < n - 1:
            step = all_gather_step(n, r, s)  # sends the piece it holds, receives the one rank r - 1 held
            pieces[step.recv_chunk] = torch.empty_like(pieces[r])
            pending = collectives.exchange(pieces[step.send_chunk], pieces[step.recv_chunk], step.send_to,
                                           step.recv_from, group, "tp_overlap all-gather")
        use(held, pieces[held])
        if pending is not None:
            pending.wait()
    return pieces


def _ring_reduce_scatter(part: Callable[[int], torch.Tensor], group: AxisGroup) -> torch.Tensor:
    """This rank's piece of Σ_ranks part(c), where part(c) is this rank's share of piece c: each
    share is computed while the partial sum before it travels. Pieces in comm/ring.py's order."""
    n, r = group.size, group.rank
    acc = part(reduce_scatter_step(n, r, 0).send_chunk)  # (B, T/n, ...) this rank's share of piece r - 1
    for s in range(n - 1):
        step = reduce_scatter_step(n, r, s)
        received = torch.empty_like(acc)
        pending = collectives.exchange(acc, received, step.send_to, step.recv_from, group,
                                       "tp_overlap reduce-scatter")
        mine = part(step.recv_chunk)  # computed while acc travels
        pending.wait()
        acc = received.add_(mine)  # received + own, as ring.py sums
    return acc  # piece r, summed over every rank


def _autocast_of(x: torch.Tensor) -> dict:
    """torch.autocast's arguments for the state the forward ran under on x's device, for its backward to
    run under: autograd runs a Function's backward outside any autocast region (torch.amp.custom_bwd does
    the same for one device type fixed when it decorates; here the device is the input's)."""
    device = x.device.type
    return dict(device_type=device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device))


def _weight_grad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dW = dyᵀ x over every token: (B, T, out), (B, T, in) -> (out, in), F.linear's backward's matmul."""
    return dy.reshape(-1, dy.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))


class _AllGatherMatmul(torch.autograd.Function):
    """x_r (B, T/n, d) -> [x Wᵢᵀ + bᵢ] (B, T, outᵢ) for each of a region's column-parallel layers,
    the gather of x overlapped with their matmuls."""

    @staticmethod
    def forward(ctx, x, group, n_layers, *weights_and_biases):
        weights, biases = weights_and_biases[:n_layers], weights_and_biases[n_layers:]
        outs: list[list[torch.Tensor | None]] = [[None] * group.size for _ in weights]

        def use(c: int, piece: torch.Tensor) -> None:
            for out, w, b in zip(outs, weights, biases, strict=True):
                out[c] = F.linear(piece, w, b)  # (B, T/n, out_i)

        x_full = torch.cat(_ring_gather(x, group, use), dim=1)  # (B, T, d), kept for the weight gradients
        ctx.group, ctx.n_layers, ctx.has_bias = group, n_layers, [b is not None for b in biases]
        ctx.autocast = _autocast_of(x)
        ctx.save_for_backward(x_full, *weights)
        return tuple(torch.cat(out, dim=1) for out in outs)  # (B, T, out_i) each

    @staticmethod
    def backward(ctx, *grads):
        with torch.autocast(**ctx.autocast):
            return _AllGatherMatmul._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        x_full, *weights = ctx.saved_tensors
        group, n = ctx.group, ctx.group.size
        grads = [g.contiguous() for g in grads]  # (B, T, out_i)
        pieces = [g.chunk(n, dim=1) for g in grads]  # (B, T/n, out_i) each

        def part(c: int) -> torch.Tensor:  # this rank's share of piece c of dx: Σ_i dy_i W_i
            # Summed last layer first, as autograd sums the branches of the blocking path's gathered x
            # (the layer called last is differentiated first), each in x's dtype (under autocast a
            # branch's bf16 product is cast back before autograd adds it): the same numbers.
            acc = pieces[-1][c].matmul(weights[-1]).to(x_full.dtype)  # (B, T/n, d)
            for g, w in zip(pieces[-2::-1], weights[-2::-1], strict=True):
                acc.add_(g[c].matmul(w))
            return acc

        dx = _ring_reduce_scatter(part, group)  # (B, T/n, d)
        need = ctx.needs_input_grad[3:]
        dws = [_weight_grad(g, x_full) if need[i] else None for i, g in enumerate(grads)]
        dbs = [g.reshape(-1, g.shape[-1]).sum(0) if has and need[ctx.n_layers + i] else None
               for i, (g, has) in enumerate(zip(grads, ctx.has_bias, strict=True))]
        return dx, None, None, *dws, *dbs


class _MatmulReduceScatter(torch.autograd.Function):
    """x (B, T, in/n) -> this rank's (B, T/n, out) piece of Σ_ranks (x Wᵀ + extra), the reduce-scatter of
    the partial sums overlapped with their matmul."""

    @staticmethod
    def forward(ctx, x, weight, group, extra):
        pieces = x.chunk(group.size, dim=1)  # (B, T/n, in/n) each
        extras = extra.chunk(group.size, dim=1) if extra is not None else None  # (B, T/n, out) each
        ctx.group, ctx.autocast = group, _autocast_of(x)
        ctx.extra_dtype = None if extra is None else extra.dtype
        ctx.save_for_backward(x, weight)

        def part(c: int) -> torch.Tensor:
            y = F.linear(pieces[c], weight)  # (B, T/n, out)
            return y if extras is None else y + extras[c]

        return _ring_reduce_scatter(part, group)  # (B, T/n, out)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(**ctx.autocast):
            return _MatmulReduceScatter._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx: list[torch.Tensor | None] = [None] * ctx.group.size

        def use(c: int, piece: torch.Tensor) -> None:
            dx[c] = piece.matmul(weight)  # (B, T/n, in/n)

        dy = torch.cat(_ring_gather(grad, ctx.group, use), dim=1)  # (B, T, out)
        dw = _weight_grad(dy, x) if ctx.needs_input_grad[1] else None
        dextra = dy.to(ctx.extra_dtype) if ctx.needs_input_grad[3] else None  # the sum's gradient reaches each term
        return torch.cat(dx, dim=1), dw, None, dextra  # (B, T, in/n)


@torch.compiler.disable
def all_gather_matmul(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                      group: AxisGroup) -> tuple[torch.Tensor, ...]:
    """[gather(x) Wᵢᵀ + bᵢ]: the sequence pieces (B, T/n, d) gathered around the tp ring while each
    layer multiplies the piece already here. Backward: the reduce-scatter of dx, overlapped likewise."""
    if group.size == 1:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases, strict=True))
    return _AllGatherMatmul.apply(x, group, len(weights), *weights, *biases)


@torch.compiler.disable
def matmul_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: AxisGroup,
                          extra: torch.Tensor | None = None) -> torch.Tensor:
    """reduce_scatter(x Wᵀ + extra) along the sequence, each piece's partial sum computed while the one
    before it travels: (B, T, in/n) -> (B, T/n, out); `extra` (B, T, out), another share of the partial
    sum (a LoRA adapter's), joins each piece. Backward: the all-gather of dy, overlapped."""
    if group.size == 1:
        y = F.linear(x, weight)
        return y if extra is None else y + extra
    return _MatmulReduceScatter.apply(x, weight, group, extra)
