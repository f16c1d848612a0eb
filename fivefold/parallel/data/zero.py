"""ZeRO-1 and ZeRO-2: optimizer state (and with stage 2 gradients) sharded over dp_shard.

What is sharded: with `zero = 1` the optimizer state (fp32 master weights and both AdamW moments),
with `zero = 2` also the gradients, each over `dp_shard`; with dp_replicate > 1 (HSDP) and with
context parallel the shards are replicated, and their gradients summed, over those ranks too: a
bucket's reduced rows are all-reduced over its replicas while the backward fills the next bucket,
and waited for when that one is reduced (FSDP2's HSDP overlaps its all-reduce with backward too).
That sum runs once a step, at the last micro-batch, whatever the stage: ZeRO-2 (and resharding
ZeRO-3, fsdp.py) reduce-scatter every micro-batch, but the earlier micro-batches' rows only
accumulate in the fp32 shard gradients, which the last one's rows join before the all-reduce. Over
the replicas' link, usually the slower one between nodes, a step sends the shard's gradient once,
not M times (FSDP2 does so when told `set_requires_all_reduce(False)` on all but the last).
Collectives per optimizer step, with N ranks, G gradient bytes, P parameter bytes, M micro-batches
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"):
- ZeRO-1: one reduce-scatter per bucket on the last micro-batch, AdamW on this rank's shard, one
  all-gather of the updated parameters: (N-1)/N x G + (N-1)/N x P.
- ZeRO-2: a reduce-scatter per bucket on *every* micro-batch (the full gradient is freed as soon
  as its bucket is reduced, never kept across micro-batches), then as ZeRO-1: (M+1)(N-1)/N x G.
- with R replicas, at either stage: 2(R-1)/R x G/N more per step, on the replicas' link.

Shards (shards.py): each parameter split along one dim like torch.chunk, fp32 masters and the
optimizer state of this rank's rows only; the buckets' when is buckets.py's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

from fivefold.config.schema import ParallelConfig
from fivefold.parallel import state_dict
from fivefold.parallel.comm import collectives
from fivefold.parallel.data.buckets import Bucket, BucketReducer, ReducesInBuckets
from fivefold.parallel.data.ddp import dense_and_expert_buckets
from fivefold.parallel.data.shards import ShardedOptimizer, ZeroShards
from fivefold.parallel.materialize import materialize
from fivefold.parallel.mesh import Mesh


class ShardedReduction:
    """ZeRO's reduction of a bucket (buckets.Reduction): a reduce-scatter over dp_shard (experts:
    expert_dp) hands this rank the sum of its rows, which go into the fp32 shards' gradients once the
    shard's replicas (HSDP's dp_replicate, and cp) have summed them, once a step.

    every_micro_batch: reduce on every micro-batch (ZeRO-2, resharding ZeRO-3), else on the last
    only; drop_full_grads: free each full gradient as soon as its rows are on their way (ZeRO-2, 3);
    full_grad: where a parameter's full gradient is read (ZeRO-3 with bf16 weights kept gathered
    adds .grad to its fp32 accumulation there), else its .grad.
    """

    def __init__(self, shards: ZeroShards, mesh: Mesh, reduce_dtype: torch.dtype, every_micro_batch: bool,
                 drop_full_grads: bool, full_grad: Callable[[nn.Parameter], torch.Tensor] | None = None):
        self.shards, self.reduce_dtype = shards, reduce_dtype
        self.full_grad = full_grad or (lambda p: p.grad)
        self.every_micro_batch, self.drop_full_grads = every_micro_batch, drop_full_grads
        # Ranks holding the same shard, whose gradients add up: HSDP replicas and context-parallel
        # ranks (other tokens of the same samples). Their traffic is gradient reduction: "dp".
        replicas = (mesh.group("dp_replicate"), dataclasses.replace(mesh.group("cp"), label="dp"))
        self.replica_groups = [g for g in replicas if g.size > 1]
        self._replicating: Bucket | None = None  # its rows are being all-reduced over the first replica group

    def reduces(self, last_micro_batch: bool) -> bool:
        return self.every_micro_batch or last_micro_batch  # even alone: the rows go into the fp32 shards

    @staticmethod
    def _padded_rows(t: torch.Tensor, c: int, n: int) -> torch.Tensor:
        """t (rows, ...) -> (n c, ...) with zero rows appended."""
        pad = n * c - t.shape[0]
        return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])

    @torch.no_grad()
    def launch(self, b: Bucket, last_micro_batch: bool) -> None:
        s = self.shards
        group = s.bucket_group(b)
        n = group.size
        chunks = [self._padded_rows(self.full_grad(p).movedim(s.zero_dims[id(p)], 0), s.rows[id(p)], n).reshape(n, -1)
                  for p in b.params]  # (N, c row numel) each
        b.flat = torch.cat(chunks, dim=1).reshape(-1).to(self.reduce_dtype)  # rank-major: (N sum(shard numel),)
        del chunks
        if self.drop_full_grads:
            for p in b.params:
                p.grad = None  # the full gradient is not kept: its rows live on in b.flat until reduced
        b.out = b.flat.new_empty(sum(b.shard_numel))
        b.work = collectives.reduce_scatter(b.out, b.flat, group, async_op=True)

    @torch.no_grad()
    def finish(self, b: Bucket, last_micro_batch: bool) -> None:
        """b's reduce-scatter is done: its rows go into the shards' gradients, once the shard's
        replicas have summed them (dense rows only: expert_dp spans those ranks already). That
        all-reduce is launched here and waited for at the next bucket's finish, or at the end of
        the backward, so it runs while the backward fills the next bucket."""
        if b.flat is None:  # finished already
            return
        if b.work is not None:
            b.work.wait()
        b.work = b.flat = None  # the send buffer goes; b.out holds this rank's reduced rows
        self._settle()
        if b.group is None and self.replica_groups and last_micro_batch:
            self._join_accumulated(b)
            b.work = collectives.all_reduce(b.out, self.replica_groups[0], async_op=True)
            self._replicating = b
        else:  # no replicas, or an earlier micro-batch: its rows wait in the shards for the last one's
            self._accumulate(b)

    def after_backward(self, reduced: list[Bucket], last_micro_batch: bool) -> None:
        self._settle()  # the last bucket's replicas: nothing is left to overlap them with

    @torch.no_grad()
    def _join_accumulated(self, b: Bucket) -> None:
        """Add the rows the earlier micro-batches accumulated in b's shard gradients into b.out, the
        last micro-batch's, and clear them: b.out is then the step's sum over this rank's dp_shard
        group, which the replicas' all-reduce completes."""
        accumulated = self.shards.take_accumulated(b)  # (sum(shard numel),) fp32, or None
        if accumulated is None:  # one micro-batch, or ZeRO-1: nothing accumulated yet
            return
        b.out = (b.out.float() + accumulated).to(b.out.dtype)  # on the wire in reduce_dtype, as every reduction

    @torch.no_grad()
    def _settle(self) -> None:
        """Complete the replicas' sum of the bucket in flight (the rest of the replica groups one
        after the other: with HSDP and cp both) and accumulate its rows."""
        b, self._replicating = self._replicating, None
        if b is None:
            return
        b.work.wait()
        for group in self.replica_groups[1:]:
            collectives.all_reduce(b.out, group)
        self._accumulate(b)

    def _accumulate(self, b: Bucket) -> None:
        for p, rows in zip(b.params, b.out.split(b.shard_numel), strict=True):
            self.shards.add_grad(p, rows)
            p.grad = None
        b.work = b.out = None


class ZeroDataParallel(ReducesInBuckets, ShardedOptimizer):
    """ZeRO stage 1 or 2 over dp_shard (replicated over dp_replicate): sharded optimizer state.

    The whole model stays on every rank for forward and backward; the optimizer steps this rank's
    fp32 shards (`ZeroShards`), reduced by `ShardedReduction` through the bucket machinery, and
    after the step every rank gathers the updated rows of every parameter.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig,
                 chunks: list[list[nn.Module]] | None = None):
        self.model, self.mesh, self.stage = model, mesh, parallel.zero
        materialize(model, mesh.device)  # a model built on the meta device: this rank's tensors, empty
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = dense_and_expert_buckets(self.params, mesh, parallel, chunks)
        self.shards = ZeroShards(model, mesh, self.buckets)
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.reduce_dtype]
        reduction = ShardedReduction(self.shards, mesh, reduce_dtype, every_micro_batch=self.stage == 2,
                                     drop_full_grads=self.stage == 2)
        self.reducer = BucketReducer(self.params, self.buckets, reduction, parallel.overlap_comm,
                                     parallel.buckets_in_flight)

    # ---- the optimizer (ShardedOptimizer: the shards it steps) ---------------------------------
    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every parameter's rows, updated by the optimizer on each rank's shard."""
        for b in self.buckets:
            _, full = self.shards.all_gather(b)
            self.shards.write_gathered(b, full)

    # ---- state: the replicated model's, and the shards' optimizer state ----------------------
    def model_state_dict(self) -> dict:
        return state_dict.model_state_dict(self.model, self.mesh)

    def load_model_state_dict(self, state: dict) -> None:
        state_dict.load_model_state_dict(self.model, state)
        for p in self.params:
            self.shards.copy_master_rows(p)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return state_dict.full_state_dict(self.model, self.mesh)

