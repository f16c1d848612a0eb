"""DDP: the whole model on every rank, gradients all-reduced in buckets overlapped with backward.

What is sharded: the batch over the `batch` view (dp); gradients are summed over the `grad` view
(dp x cp). Collectives, per optimizer step, with N ranks and G gradient bytes: one all-reduce (SUM)
per bucket, on the last micro-batch only: 2(N-1)/N x G per rank. ZeRO-1/2 (`zero.py`) and ZeRO-3
(`fsdp.py`) build on these buckets; `apply_data_parallel` (`__init__.py`) chooses among them.

Buckets: parameters are grouped in reverse registration order (roughly the order backward
produces their gradients) into buckets of at most `parallel.bucket_mb`. A post-accumulate-grad
hook counts the gradients each bucket still waits for; when a bucket is complete its collective
starts asynchronously and backward goes on computing (Li et al. 2020, "PyTorch Distributed").
Buckets start strictly in order, so every rank issues the same collectives in the same order even
when a parameter gets no gradient on one rank (an MoE expert without tokens): its bucket then
waits for the end of backward, where missing gradients are zeros.

Chunks: under pipeline parallel a rank runs the backward of each of its stage chunks (one, or v
with interleaved and V schedules) at other times, so buckets never span two chunks and a chunk's
buckets reduce on *its* last backward of the step (Megatron-LM and torch.distributed.pipelining
do the same), overlapped with the other chunks' work. The data-parallel peers of a rank hold the
same chunks and run the same action list, so they still issue the same collectives in one order.

Gradients are summed, not averaged: each rank's loss is already divided by the global token count
of the step (train/step.py), so the sum is the gradient of the mean over every token. An expert's
gradient already holds every token its ep group routed to it: it is summed over the ranks holding
the same experts (the mesh's "expert_dp" view), not over the whole grad view.

The optimizer is not in here: `optimizer_params()` says what it steps (the parameters themselves
for DDP, fp32 shards for ZeRO) and `after_step()` does what must follow a step (ZeRO's gather).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from fivefold.config import ParallelConfig
from fivefold.parallel import state_dict
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.ring import ring_all_reduce
from fivefold.parallel.materialize import materialize
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.state_dict import is_expert_parameter


@dataclass
class Bucket:
    params: list[nn.Parameter]
    group: collectives.AxisGroup | None = None  # DDP: where its gradients are summed (None: the grad view)
    chunk: int | None = None  # the pipeline chunk whose backward makes its gradients (its reduction-order index)
    waiting: int = 0  # gradients of this backward not yet accumulated
    armed: bool = False  # reduces in the backward running now
    work: object | None = None  # the in-flight collective
    flat: torch.Tensor | None = None  # its send buffer (DDP: also the result)
    out: torch.Tensor | None = None  # ZeRO: this rank's reduced rows
    shard_numel: list[int] = field(default_factory=list)  # ZeRO: numel of one rank's rows per parameter


def make_buckets(params: list[nn.Parameter], cap_bytes: float,
                 group_of: Callable[[nn.Parameter], collectives.AxisGroup | None] = lambda p: None,
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


class DataParallel:
    """DDP: the whole model on every rank; gradients all-reduced bucket by bucket during backward.

    `chunks`: this rank's pipeline chunks as module lists, in the order of their last backward
    (`PipelineStages.reduction_chunks`); None: one chunk, the whole model.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig,
                 chunks: list[list[nn.Module]] | None = None):
        self.model, self.mesh = model, mesh
        materialize(model, mesh.device)  # a model built on the meta device: this rank's tensors, empty
        self.group = mesh.group("grad")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.chunk_of = chunk_index(chunks)
        self._armed: list[Bucket] = []  # the buckets this backward reduces, in launch order
        self.buckets = self._make_buckets(parallel)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.overlap = parallel.overlap_comm
        self.ring = parallel.dp_collective == "ring"  # our send/recv ring instead of the backend's all-reduce
        self.reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.reduce_dtype]
        self._next = 0  # index of the next armed bucket to launch
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def _make_buckets(self, parallel: ParallelConfig) -> list[Bucket]:
        experts = self.mesh.group("expert_dp")
        return make_buckets(self.params[::-1], parallel.bucket_mb * 1e6,
                            lambda p: experts if is_expert_parameter(p) else None,
                            lambda p: self.chunk_of.get(id(p)))

    # ---- backward ---------------------------------------------------------------------------
    def _reduces_on(self, last_micro_batch: bool) -> bool:
        return last_micro_batch  # DDP and ZeRO-1 talk once per step

    def _needs_reduction(self) -> bool:
        return self.group.size > 1

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
        reducing = self._reduces_on(last_micro_batch) and self._needs_reduction()
        self._armed = [b for b in self.buckets if chunk is None or b.chunk in (None, chunk)] if reducing else []
        self._next = 0
        for b in self._armed:
            b.waiting, b.armed = len(b.params), True
        yield
        if self._armed:
            self._launch_ready(force=True)  # buckets with a parameter that got no gradient here
            self._finish(self._armed[-1])  # the others were finished as the next one launched
        for b in self._armed:
            b.armed = False
        self._armed = []

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not (self._armed and self.overlap):  # without overlap every bucket starts after backward
            return
        bucket = self.bucket_of[id(p)]
        if bucket.armed:  # not a weight shared with a chunk that reduces later (its own backward counts)
            bucket.waiting -= 1
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next < len(self._armed) and (force or self._armed[self._next].waiting == 0):
            b = self._armed[self._next]
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            # One bucket reduces while the next fills (the planner's buffer model: two buckets). The
            # one in flight is finished before this one's buffer is made, so its send buffer and
            # reduced copy are freed now, not at the end of backward (on NCCL its wait only orders
            # the streams; it had the whole filling of this bucket to complete).
            if self._next >= 1:
                self._finish(self._armed[self._next - 1])
            self._launch(b)
            if b.work is None:  # it completed in the call (synchronous): its buffers go now
                self._finish(b)
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        b.flat = torch.cat([p.grad.reshape(-1) for p in b.params]).to(self.reduce_dtype)  # (bucket numel,)
        group = b.group or self.group
        if not self.ring:
            b.work = collectives.all_reduce(b.flat, group, async_op=True)
            return
        numel, n = b.flat.numel(), group.size
        padded = torch.cat([b.flat, b.flat.new_zeros(-numel % n)])  # the ring moves N equal chunks
        ring_all_reduce(padded, group)  # synchronous: each of its 2(N-1) steps waits for the last
        b.flat = padded[:numel]

    @torch.no_grad()
    def _finish(self, b: Bucket) -> None:
        if b.flat is None:  # finished already
            return
        if b.work is not None:
            b.work.wait()
        for p, chunk in zip(b.params, b.flat.split([p.numel() for p in b.params]), strict=True):
            p.grad.copy_(chunk.view_as(p))
        b.work = b.flat = None

    # ---- optimizer ---------------------------------------------------------------------------
    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in parameter order: the parameters themselves (ZeRO: their shards)."""
        return list(self.params)

    def after_step(self) -> None:
        """After an optimizer step (DDP: nothing; ZeRO gathers the updated rows)."""

    def gradients(self) -> list[torch.Tensor]:
        """The reduced gradients the optimizer will apply (ZeRO: this rank's shards of them)."""
        return [p.grad for p in self.params if p.grad is not None]

    @property
    def norm_groups(self) -> list[collectives.AxisGroup]:
        """The groups this rank's gradients are split over (none: every rank holds all of them)."""
        return []

    @property
    def expert_norm_groups(self) -> list[collectives.AxisGroup]:
        """The groups this rank's expert gradients are split over besides ep (ZeRO: expert_dp)."""
        return []

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        """The reduced gradient the optimizer will apply to p (ZeRO: this rank's rows of it)."""
        return p.grad

    # ---- state: what checkpoints save and tests compare (state_dict.py) ---------------------------
    def model_state_dict(self) -> dict:
        return state_dict.model_state_dict(self.model, self.mesh)

    def load_model_state_dict(self, state: dict) -> None:
        state_dict.load_model_state_dict(self.model, state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Plain, unsharded copies of every parameter and buffer, keyed as in the model."""
        return state_dict.full_state_dict(self.model, self.mesh)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return state_dict.optim_state_dict(self.model, optimizer, self.mesh)

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        state_dict.load_optim_state_dict(self.model, optimizer, state)
