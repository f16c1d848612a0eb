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

Shards: each parameter is split along dim 0 like torch.chunk: rank r owns rows [r c, (r+1) c)
with c = ceil(rows / N), so every shard is a DTensor Shard(0) on the dp_shard mesh and
checkpoints can reshard it (`optim_state_dict`). For the collectives a bucket lays its parameters
out rank-major (rank 0's rows of every parameter, then rank 1's, ...) with each parameter padded
to N c rows, so one reduce-scatter hands each rank exactly its rows.

Experts (ep > 1): an expert's gradient is summed over the ranks holding the same experts, the
expert_dp view (ddp.py), so that is the group its state is sharded over: each (E/ep, ...) slice is
split along dim 1 (dim 0, E/ep, is often smaller than expert_dp) over expert_dp, with no replica
reduction after it, and its shards are DTensors on the (expert_dp, ep) mesh: Shard(1) and
Shard(0), so a checkpoint reshards to another ep and ZeRO stage as well.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.config import ParallelConfig
from fivefold.parallel.comm import collectives
from fivefold.parallel.data.ddp import Bucket, DataParallel
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.state_dict import expert_zero_shard_as_dtensor, is_expert_parameter, zero_shard_as_dtensor


class ZeroDataParallel(DataParallel):
    """ZeRO stage 1 or 2 over dp_shard (replicated over dp_replicate): sharded optimizer state."""

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig,
                 chunks: list[list[nn.Module]] | None = None):
        self.stage = parallel.zero
        self.shard_group = mesh.group("dp_shard")
        self.expert_shard_group = mesh.group("expert_dp")  # used only with ep > 1: experts are dense at ep = 1
        # Ranks holding the same shard, whose gradients add up: HSDP replicas and context-parallel
        # ranks (other tokens of the same samples). Their traffic is gradient reduction: "dp".
        replicas = (mesh.group("dp_replicate"), dataclasses.replace(mesh.group("cp"), label="dp"))
        self.replica_groups = [g for g in replicas if g.size > 1]
        self._replicating: Bucket | None = None  # its rows are being all-reduced over the first replica group
        self._last_micro_batch = True  # of the backward reducing now: the replicas sum the step's rows then
        super().__init__(model, mesh, parallel, chunks)
        self._make_shards()

    def group_of(self, p: nn.Parameter) -> collectives.AxisGroup:
        """The ranks p's state is sharded over: expert_dp for an expert, dp_shard for the rest."""
        return self.expert_shard_group if is_expert_parameter(p) else self.shard_group

    def _make_shards(self) -> None:
        self.names = {id(p): name for name, p in self.model.named_parameters()}
        self.rows = {}  # id(param) -> rows each rank owns (c)
        self.zero_dims = {}  # id(param) -> the dim ZeRO splits (its "rows")
        self.shards: dict[int, nn.Parameter] = {}  # id(param) -> fp32 master rows, padded to c, split dim first
        for b in self.buckets:
            for p in b.params:
                # A tensor-parallel slice split along dim 0 is split by ZeRO along dim 1, so the two
                # splits are along different dims and the shard is a plain DTensor on (dp, tp); an
                # expert slice, split along dim 0 by ep, likewise.
                split_dim0 = getattr(p, "tp_dim", None) == 0 or is_expert_parameter(p)
                zd = self.zero_dims[id(p)] = 1 if split_dim0 and p.ndim > 1 else 0
                rows = [p.shape[zd], *(d for i, d in enumerate(p.shape) if i != zd)]  # shape, split dim first
                c = -(-rows[0] // self.group_of(p).size)
                self.rows[id(p)] = c
                # Only the padding rows past the parameter's end are zeroed: the rest is filled now
                # (a real parameter) or on load (from the meta device), so a memset of it is wasted.
                master = torch.empty((c, *rows[1:]), dtype=torch.float32, device=p.device)
                master[self._own_rows(p):].zero_()
                self.shards[id(p)] = nn.Parameter(master, requires_grad=False)
                if p.untyped_storage().nbytes():  # ZeRO-3 from the meta device: the shard is filled on load
                    self._copy_master_rows(p)
                b.shard_numel.append(master.numel())

    def optimizer_params(self) -> list[torch.Tensor]:
        return [self.shards[id(p)] for p in self.params]  # the fp32 masters, in parameter order

    def _own_rows(self, p: nn.Parameter) -> int:
        """How many of this rank's c shard rows lie inside p (the rest pad the last ranks' shards)."""
        c = self.rows[id(p)]
        return max(0, min(c, p.shape[self.zero_dims[id(p)]] - self.group_of(p).rank * c))

    @torch.no_grad()
    def _copy_master_rows(self, p: nn.Parameter) -> None:
        """This rank's rows of the full parameter p into its fp32 master shard."""
        zd, c, r = self.zero_dims[id(p)], self.rows[id(p)], self.group_of(p).rank
        valid = self._own_rows(p)
        self.shards[id(p)][:valid] = p.detach().movedim(zd, 0)[r * c : r * c + valid]

    def _reduces_on(self, last_micro_batch: bool) -> bool:
        return self.stage == 2 or last_micro_batch

    def _needs_reduction(self) -> bool:
        return True  # even alone, gradients must move into the fp32 shards the optimizer steps

    def _bucket_group(self, b: Bucket) -> collectives.AxisGroup:
        """Where a bucket's state is sharded: its reduction group (expert_dp for experts: ddp.make_buckets
        keeps them apart), else dp_shard."""
        return b.group or self.shard_group

    @staticmethod
    def _padded_rows(t: torch.Tensor, c: int, n: int) -> torch.Tensor:
        """t (rows, ...) -> (n c, ...) with zero rows appended."""
        pad = n * c - t.shape[0]
        return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        group = self._bucket_group(b)
        n = group.size
        chunks = [self._padded_rows(p.grad.movedim(self.zero_dims[id(p)], 0), self.rows[id(p)], n).reshape(n, -1)
                  for p in b.params]  # (N, c row numel) each
        b.flat = torch.cat(chunks, dim=1).reshape(-1).to(self.reduce_dtype)  # rank-major: (N sum(shard numel),)
        del chunks
        if self.stage >= 2:
            for p in b.params:
                p.grad = None  # the full gradient is not kept: its rows live on in b.flat until reduced
        b.out = b.flat.new_empty(sum(b.shard_numel))
        b.work = collectives.reduce_scatter(b.out, b.flat, group, async_op=True)

    @torch.no_grad()
    def _finish(self, b: Bucket) -> None:
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
        if b.group is None and self.replica_groups and self._last_micro_batch:
            self._join_accumulated(b)
            b.work = collectives.all_reduce(b.out, self.replica_groups[0], async_op=True)
            self._replicating = b
        else:  # no replicas, or an earlier micro-batch: its rows wait in the shards for the last one's
            self._accumulate(b)

    @torch.no_grad()
    def _join_accumulated(self, b: Bucket) -> None:
        """Add the rows the earlier micro-batches accumulated in b's shard gradients into b.out, the
        last micro-batch's, and clear them: b.out is then the step's sum over this rank's dp_shard
        group, which the replicas' all-reduce completes."""
        accumulated = [self.shards[id(p)].grad for p in b.params]
        if accumulated[0] is None:  # one micro-batch, or ZeRO-1: nothing accumulated yet
            return
        joined = b.out.float() + torch.cat([g.reshape(-1) for g in accumulated])  # (sum(shard numel),) fp32
        b.out = joined.to(b.out.dtype)  # on the wire in parallel.reduce_dtype, as every reduction
        for p in b.params:
            self.shards[id(p)].grad = None

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
            shard = self.shards[id(p)]
            rows = rows.view_as(shard).float()
            shard.grad = rows if shard.grad is None else shard.grad.add_(rows)
            p.grad = None
        b.work = b.out = None

    @contextlib.contextmanager
    def reducing(self, last_micro_batch: bool, chunk: int | None = None) -> Iterator[None]:
        self._last_micro_batch = last_micro_batch
        with super().reducing(last_micro_batch, chunk):
            yield
        self._settle()  # the last bucket's replicas: nothing is left to overlap them with

    def gradients(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.values() if s.grad is not None]

    @property
    def norm_groups(self) -> list[collectives.AxisGroup]:
        return [self.shard_group]

    @property
    def expert_norm_groups(self) -> list[collectives.AxisGroup]:
        return [self.expert_shard_group]

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        return self.shards[id(p)].grad

    @torch.no_grad()
    def after_step(self) -> None:
        """All-gather every parameter's rows, updated by the optimizer on each rank's shard."""
        for b in self.buckets:
            group = self._bucket_group(b)
            local = torch.cat([self.shards[id(p)].reshape(-1) for p in b.params]).to(b.params[0].dtype)
            full = local.new_empty(group.size * local.numel())  # (N sum(shard numel),) rank-major
            collectives.all_gather(full, local, group)
            per_rank = full.view(group.size, -1)
            for p, chunk in zip(b.params, per_rank.split(b.shard_numel, dim=1), strict=True):
                self._write_rows(p, chunk, p)

    def _write_rows(self, p: nn.Parameter, per_rank: torch.Tensor, target: torch.Tensor) -> None:
        """Write every rank's rows of p (N, c row numel), gathered, into `target` (p or p.data)."""
        rows = target.movedim(self.zero_dims[id(p)], 0)
        rows.copy_(per_rank.reshape(self.group_of(p).size * self.rows[id(p)], *rows.shape[1:])[: rows.shape[0]])

    def _dtensor(self, p: nn.Parameter, local: torch.Tensor) -> DTensor:
        """This rank's rows of p as a DTensor of the whole matrix, so a later layout can reshard it."""
        as_dtensor = expert_zero_shard_as_dtensor if is_expert_parameter(p) else zero_shard_as_dtensor
        return as_dtensor(p, local, self.zero_dims[id(p)], self.rows[id(p)], self.mesh)

    # ---- state ----------------------------------------------------------------------------------
    # The same keys as DDP's flattened optimizer state ("state.<param>.exp_avg", ...), each moment a
    # DTensor of the whole parameter, so a checkpoint moves between DDP, ZeRO-1/2/3 and any dp or
    # tp degree. The fp32 masters are not saved: they equal the fp32 parameters, which the model
    # state holds, and they are rebuilt from them on load (ZeRO-3 loads its shards directly).
    def load_model_state_dict(self, state: dict) -> None:
        super().load_model_state_dict(state)
        for p in self.params:
            self._copy_master_rows(p)

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        out = {}
        for p in self.params:
            s, name = self.shards[id(p)], self.names[id(p)]
            state = optimizer.state[s]
            out[f"state.{name}.exp_avg"] = self._dtensor(p, state["exp_avg"])
            out[f"state.{name}.exp_avg_sq"] = self._dtensor(p, state["exp_avg_sq"])
            out[f"state.{name}.step"] = state["step"]
        return out

    @torch.no_grad()
    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        for p in self.params:
            s, name, zd = self.shards[id(p)], self.names[id(p)], self.zero_dims[id(p)]
            mine = optimizer.state[s]
            for key in ("exp_avg", "exp_avg_sq"):
                rows = state[f"state.{name}.{key}"].to_local().movedim(zd, 0)
                target = mine[key][: rows.shape[0]]
                # A checkpoint is read into the views optim_state_dict() made of these moments: then
                # the rows are already in place (strides of a size-1 dim may differ; the memory does not).
                if (rows.data_ptr(), rows.shape) != (target.data_ptr(), target.shape):
                    target.copy_(rows)
            mine["step"].copy_(state[f"state.{name}.step"])
