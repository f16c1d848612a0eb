"""Collectives as autograd Functions: each forward's collective has its conjugate in backward.

Tensor and sequence parallel's region boundaries (Megatron-LM's conjugate pairs, Shoeybi et al.
2019 and Korthikanti et al. 2022): copy to the region / all-reduce out of it, all-gather into it /
reduce-scatter out of it; and the all-to-all of expert dispatch and Ulysses, whose backward is the
all-to-all with the splits swapped; and a sum over tp ranks whose backward sums too (a norm's
statistics over features split by tp). The collectives themselves are collectives.py's: counted,
timed and named on failure like any other.

The functions that apply them are excluded from torch.compile's tracing (`torch.compiler.disable`),
as the collectives are: a compiled block calls each as one opaque step (one graph break) instead of
tracing the autograd Function, whose forward and backward hold collectives it cannot trace.
"""

from __future__ import annotations

import torch

from fivefold.parallel.comm.collectives import AxisGroup, all_gather, all_reduce, all_to_all, reduce_scatter

# ---- autograd-aware collectives of tensor and sequence parallel (Megatron-LM's conjugate pairs) ----
# Each forward collective has its conjugate in backward: identity <-> all-reduce, and (sequence
# parallel) all-gather <-> reduce-scatter along the sequence dim (dim 1 of (B, T, ...)).


def _seq_gather(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, T/n, ...) on each rank -> (B, T, ...), rank-ordered along T."""
    local = x.transpose(0, 1).contiguous()  # (T/n, B, ...): the flat all-gather concatenates dim 0
    out = local.new_empty((group.size * local.shape[0], *local.shape[1:]))
    all_gather(out, local, group)
    # One contiguous copy here; a strided view would be copied again by each of the region's
    # linears (q, k and v each), tripling what autograd keeps.
    return out.transpose(0, 1).contiguous()


def _seq_reduce_scatter(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/n, ...) slice of their sum."""
    full = x.transpose(0, 1).contiguous()  # (T, B, ...)
    out = full.new_empty((full.shape[0] // group.size, *full.shape[1:]))
    reduce_scatter(out, full, group)
    return out.transpose(0, 1).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)  # the sum replaces a copy, not autograd's input
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_reduce_scatter(grad, ctx.group), None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_gather(grad, ctx.group), None


@torch.compiler.disable
def copy_to_tensor_parallel_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: identity (every tp rank has x). Backward: all-reduce the partial input gradients."""
    return x if group.size == 1 else _CopyToRegion.apply(x, group)


@torch.compiler.disable
def reduce_from_tensor_parallel_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: all-reduce the partial sums of a row-parallel product. Backward: identity."""
    return x if group.size == 1 else _ReduceFromRegion.apply(x, group)


@torch.compiler.disable
def gather_from_sequence_parallel_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: all-gather the sequence shards. Backward: reduce-scatter the gradient to them."""
    return x if group.size == 1 else _GatherFromSequenceRegion.apply(x, group)


@torch.compiler.disable
def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: reduce-scatter partial sums into sequence shards. Backward: all-gather."""
    return x if group.size == 1 else _ReduceScatterToSequenceRegion.apply(x, group)


class _SumOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone(memory_format=torch.contiguous_format)
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.group)
        return grad, None


@torch.compiler.disable
def sum_over_tensor_parallel_ranks(x: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Forward: the sum over tp of a statistic each rank computed from its slice of the features (a
    norm's sum of squares over heads split by tp), which every rank then uses. Backward: the sum over
    tp of its gradient, since each rank's own features reached the loss through every rank's use of it."""
    return x if group.size == 1 else _SumOverRanks.apply(x, group)


# ---- autograd-aware all-to-all (expert dispatch, Ulysses) ----


class _AllToAll(torch.autograd.Function):
    """Rows to other ranks by splits; backward sends the gradients back (splits swapped)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        all_to_all(out, x.contiguous(), group, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        all_to_all(grad_in, grad.contiguous(), ctx.group, in_splits, out_splits)
        return grad_in, None, None, None


@torch.compiler.disable
def all_to_all_rows(x: torch.Tensor, group: AxisGroup, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Autograd-aware all-to-all along dim 0: x's rows in_splits[j] go to rank j; receive out_splits[j]."""
    return _AllToAll.apply(x, group, out_splits, in_splits)
