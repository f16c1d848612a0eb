"""The bucket machinery DDP, ZeRO-1/2 and ZeRO-3 share: when a bucket of gradients is reduced.

Every data-parallel strategy reduces gradients in buckets during backward (Li et al. 2020,
"PyTorch Distributed"); they differ only in *what* a reduction is (an all-reduce for DDP, a
reduce-scatter into fp32 shards for ZeRO, that and freeing the unit's weights for ZeRO-3). This
module decides *when*, the same way for all of them, and calls the strategy's `Reduction`:

- Buckets: parameters in reverse registration order (roughly the order backward produces their
  gradients), grouped into buckets of at most `parallel.bucket_mb` (`make_buckets`; ZeRO-3 makes
  one per unit). A bucket never spans two reduction groups (experts reduce over expert_dp) or two
  pipeline chunks.
- Arming: `reducing(last_micro_batch, chunk)` wraps any code that accumulates one micro-batch's
  gradients. When the strategy's reduction talks on this micro-batch (`Reduction.reduces`), the
  buckets of that chunk are armed.
- Launching: a post-accumulate-grad hook counts the gradients each armed bucket still waits for.
  Buckets launch strictly in order, as soon as each is complete (with `parallel.overlap_comm`),
  so every rank issues the same collectives in the same order even when a parameter gets no
  gradient on one rank (an MoE expert without tokens): that bucket waits for the end of backward,
  where missing gradients are zeros. Up to `parallel.buckets_in_flight` (K) buckets are in
  flight at once: the oldest is finished (waited for, its buffers freed) just before the (K+1)-th
  would launch, so on NCCL a bucket's reduction is never waited for while the ones after it could
  still be queued behind it (the planner prices K + 1 buckets of buffers: K reducing, one filling).
  Finishing is in launch order, whatever K: every rank issues the same collectives in one order.
- Chunks: under pipeline parallel a rank runs the backward of each of its stage chunks at other
  times; a chunk's buckets reduce on *its* last backward of the step (Megatron-LM and
  torch.distributed.pipelining do the same). The peers of a rank hold the same chunks and run the
  same action list, so they still issue the same collectives in one order.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from fivefold.parallel.comm.collectives import AxisGroup


@dataclass
class Bucket:
    params: list[nn.Parameter]
    group: AxisGroup | None = None  # where its gradients are summed (None: the strategy's own group)
    chunk: int | None = None  # the pipeline chunk whose backward makes its gradients (its reduction-order index)
    waiting: int = 0  # gradients of this backward not yet accumulated
    armed: bool = False  # reduces in the backward running now
    work: object | None = None  # the in-flight collective
    flat: torch.Tensor | None = None  # its send buffer (DDP: also the result)
    out: torch.Tensor | None = None  # ZeRO: this rank's reduced rows
    shard_numel: list[int] = field(default_factory=list)  # ZeRO: numel of one rank's rows per parameter


def make_buckets(params: list[nn.Parameter], cap_bytes: float,
                 group_of: Callable[[nn.Parameter], AxisGroup | None] = lambda p: None,
                 chunk_of: Callable[[nn.Parameter], int | None] = lambda p: None) -> list[Bucket]:
    """Consecutive groups of `params` whose bytes stay under cap_bytes (a larger tensor stands alone),
    each reduced over one group at one chunk's backward: a parameter of another `group_of` or
    `chunk_of` starts a new bucket."""
    buckets: list[Bucket] = []
    size = math.inf
    for p in params:
        nbytes = p.numel() * p.element_size()
        if (size + nbytes > cap_bytes or group_of(p) is not buckets[-1].group
                or chunk_of(p) != buckets[-1].chunk):
            buckets.append(Bucket([], group_of(p), chunk_of(p)))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets


def chunk_index(chunks: list[list[nn.Module]] | None) -> dict[int, int]:
    """id(parameter) -> the chunk it reduces with: its position in `chunks`, which are listed in the
    order of their last backward of the step, so a parameter two chunks share (a tied embedding
    when one rank holds the first and the last stage) reduces after both are done."""
    return {id(p): i for i, modules in enumerate(chunks or []) for m in modules for p in m.parameters()}


class Reduction(Protocol):
    """What a strategy does with a bucket; `BucketReducer` decides when. `last_micro_batch`: this
    backward is its chunk's last of the step."""

    def reduces(self, last_micro_batch: bool) -> bool:
        """Does this micro-batch's backward reduce (DDP and ZeRO-1: only the last one)?"""

    def launch(self, bucket: Bucket, last_micro_batch: bool) -> None:
        """Start the bucket's collective (its gradients are complete); set `bucket.work`, or leave
        it None when the collective completed in the call."""

    def finish(self, bucket: Bucket, last_micro_batch: bool) -> None:
        """Complete the bucket's collective and put its result where the optimizer reads it; a
        second call does nothing."""

    def after_backward(self, reduced: list[Bucket], last_micro_batch: bool) -> None:
        """After the backward and every bucket it reduced (`reduced`; empty when it did not talk)."""


class BucketReducer:
    """Reduces `buckets` of `params` with `reduction` as backward completes them (module docstring).

    overlap: launch each bucket as soon as it is complete; False launches every bucket after the
    backward (the serial baseline the overlap is measured against). in_flight: how many buckets'
    collectives may run at once (`parallel.buckets_in_flight`).
    """

    def __init__(self, params: list[nn.Parameter], buckets: list[Bucket], reduction: Reduction, overlap: bool,
                 in_flight: int = 2):
        self.buckets, self.reduction, self.overlap, self.in_flight = buckets, reduction, overlap, in_flight
        self.bucket_of = {id(p): b for b in buckets for p in b.params}
        self.armed: list[Bucket] = []  # the buckets this backward reduces, in launch order
        self._next = 0  # index of the next armed bucket to launch
        self._last_micro_batch = True
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last_micro_batch: bool,
                 inputs: list[torch.Tensor] | None = None, chunk: int | None = None) -> None:
        """Backward from `out` (a loss, or a pipeline stage's output with its gradient), reducing
        gradients as their buckets complete when this micro-batch talks. `last_micro_batch`: this
        is the chunk's last backward of the step; `chunk`: whose backward it is (None: every chunk)."""
        with self.reducing(last_micro_batch, chunk):
            torch.autograd.backward(out, grad, inputs=inputs)

    @contextlib.contextmanager
    def reducing(self, last_micro_batch: bool, chunk: int | None = None) -> Iterator[None]:
        """Around any code that accumulates a micro-batch's gradients (one backward, or the W
        passes of a split backward): the chunk's buckets reduce as they complete when this
        micro-batch talks."""
        talks = self.reduction.reduces(last_micro_batch)
        self.armed = [b for b in self.buckets if chunk is None or b.chunk in (None, chunk)] if talks else []
        self._next, self._last_micro_batch = 0, last_micro_batch
        for b in self.armed:
            b.waiting, b.armed = len(b.params), True
        yield
        reduced, self.armed = self.armed, []
        if reduced:
            self._launch_ready(reduced, force=True)  # buckets with a parameter that got no gradient here
            for b in reduced[-self.in_flight:]:  # still in flight, oldest first (finishing twice does nothing)
                self.reduction.finish(b, last_micro_batch)
        for b in reduced:
            b.armed = False
        self.reduction.after_backward(reduced, last_micro_batch)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not (self.armed and self.overlap):  # without overlap every bucket starts after backward
            return
        bucket = self.bucket_of[id(p)]
        if bucket.armed:  # not a weight shared with a chunk that reduces later (its own backward counts)
            bucket.waiting -= 1
            self._launch_ready(self.armed, force=False)

    def _launch_ready(self, armed: list[Bucket], force: bool) -> None:
        while self._next < len(armed) and (force or armed[self._next].waiting == 0):
            b = armed[self._next]
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # At most `in_flight` buckets reduce while the next fills (the planner's buffer model:
            # in_flight + 1 buckets). The oldest in flight is finished before this one's buffer is
            # made, so its send buffer and reduced copy are freed now, not at the end of backward (on
            # NCCL its wait only orders the streams; it had the filling of the later buckets to complete).
            if self._next >= self.in_flight:
                self.reduction.finish(armed[self._next - self.in_flight], self._last_micro_batch)
            self.reduction.launch(b, self._last_micro_batch)
            if b.work is None:  # it completed in the call (synchronous): its buffers go now
                self.reduction.finish(b, self._last_micro_batch)
            self._next += 1


class ReducesInBuckets:
    """The backward of a strategy whose `reducer` is a BucketReducer (DDP, ZeRO-1/2, ZeRO-3 all are)."""

    reducer: BucketReducer

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last_micro_batch: bool,
                 inputs: list[torch.Tensor] | None = None, chunk: int | None = None) -> None:
        self.reducer.backward(out, grad, last_micro_batch=last_micro_batch, inputs=inputs, chunk=chunk)

    def reducing(self, last_micro_batch: bool, chunk: int | None = None) -> contextlib.AbstractContextManager:
        return self.reducer.reducing(last_micro_batch, chunk)
