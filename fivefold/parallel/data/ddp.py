"""DDP: the whole model on every rank, gradients all-reduced in buckets overlapped with backward.

What is sharded: the batch over the `batch` view (dp); gradients are summed over the `grad` view
(dp x cp). Collectives, per optimizer step, with N ranks and G gradient bytes: one all-reduce (SUM)
per bucket, on the last micro-batch only: 2(N-1)/N x G per rank. When a bucket is reduced is the
bucket machinery's (buckets.py, shared with ZeRO-1/2 in zero.py and ZeRO-3 in fsdp.py); what a
reduction is lives here (`AllReduce`).

Gradients are summed, not averaged: each rank's loss is already divided by the global token count
of the step (train/step.py), so the sum is the gradient of the mean over every token. An expert's
gradient already holds every token its ep group routed to it: it is summed over the ranks holding
the same experts (the mesh's "expert_dp" view), not over the whole grad view.

The optimizer is not in here: `optimizer_params()` says what it steps (the parameters themselves
for DDP, fp32 shards for ZeRO) and `after_step()` does what must follow a step (ZeRO's gather).
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config.schema import ParallelConfig
from fivefold.parallel import state_dict
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.ring import ring_all_reduce
from fivefold.parallel.data.buckets import Bucket, BucketReducer, ReducesInBuckets, chunk_index, make_buckets
from fivefold.parallel.materialize import materialize
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.state_dict import is_expert_parameter


class AllReduce:
    """DDP's reduction of a bucket: its gradients flattened into one buffer, all-reduced over the
    grad view (experts: expert_dp), copied back into each `.grad` (buckets.Reduction)."""

    def __init__(self, group: collectives.AxisGroup, reduce_dtype: torch.dtype, ring: bool):
        self.group, self.reduce_dtype = group, reduce_dtype
        self.ring = ring  # our send/recv ring instead of the backend's all-reduce

    def reduces(self, last_micro_batch: bool) -> bool:
        return last_micro_batch and self.group.size > 1  # once a step; alone there is nothing to sum

    @torch.no_grad()
    def launch(self, b: Bucket, last_micro_batch: bool) -> None:
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
    def finish(self, b: Bucket, last_micro_batch: bool) -> None:
        if b.flat is None:  # finished already
            return
        if b.work is not None:
            b.work.wait()
        for p, chunk in zip(b.params, b.flat.split([p.numel() for p in b.params]), strict=True):
            p.grad.copy_(chunk.view_as(p))
        b.work = b.flat = None

    def after_backward(self, reduced: list[Bucket], last_micro_batch: bool) -> None:
        pass


def dense_and_expert_buckets(params: list[nn.Parameter], mesh: Mesh, parallel: ParallelConfig,
                             chunks: list[list[nn.Module]] | None) -> list[Bucket]:
    """DDP's and ZeRO-1/2's buckets: `params` in reverse order, experts (reduced over expert_dp)
    apart from the rest, each chunk's apart (buckets.make_buckets)."""
    experts, chunk_of = mesh.group("expert_dp"), chunk_index(chunks)
    return make_buckets(params[::-1], parallel.bucket_mb * 1e6,
                        lambda p: experts if is_expert_parameter(p) else None, lambda p: chunk_of.get(id(p)))


class DDP(ReducesInBuckets):
    """DDP: the whole model on every rank; gradients all-reduced bucket by bucket during backward.

    `chunks`: this rank's pipeline chunks as module lists, in the order of their last backward
    (`PipelineStages.reduction_chunks`); None: one chunk, the whole model.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig,
                 chunks: list[list[nn.Module]] | None = None):
        self.model, self.mesh = model, mesh
        materialize(model, mesh.device)  # a model built on the meta device: this rank's tensors, empty
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = dense_and_expert_buckets(self.params, mesh, parallel, chunks)
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.reduce_dtype]
        reduction = AllReduce(mesh.group("grad"), reduce_dtype, parallel.dp_collective == "ring")
        self.reducer = BucketReducer(self.params, self.buckets, reduction, parallel.overlap_comm,
                                     parallel.buckets_in_flight)

    # ---- optimizer ---------------------------------------------------------------------------
    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in parameter order: the parameters themselves."""
        return list(self.params)

    def after_step(self) -> None:
        """After an optimizer step: nothing (every rank updated its whole copy)."""

    def gradients(self) -> list[torch.Tensor]:
        """The reduced gradients the optimizer will apply."""
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
        """The reduced gradient the optimizer will apply to p."""
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
