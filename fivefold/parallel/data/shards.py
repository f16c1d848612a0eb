"""ZeRO's shards: the fp32 master rows each rank owns of every parameter, and their optimizer state.

ZeRO-1/2 (zero.py) and ZeRO-3 (fsdp.py) keep the same shards; they differ in when the full
parameters exist. Each parameter is split along one dim like torch.chunk: rank r owns rows
[r c, (r+1) c) with c = ceil(rows / N), padded with zero rows past the parameter's end, so every
shard is a plain `Shard` placement of one DTensor and checkpoints reshard it to any layout.

The split dim is 0, except dim 1 for a tensor-parallel slice split along dim 0 (the two splits
then lie along different dims, and the shard is a DTensor on (dp, tp)) and for an expert slice
(E/ep, ...), which ep splits along dim 0 and which is sharded over expert_dp, the ranks holding
the same experts (their gradients are summed there), as DTensors on the (expert_dp, ep) mesh.

For the collectives a bucket lays its parameters out rank-major (rank 0's rows of every
parameter, then rank 1's, ...), so one reduce-scatter hands each rank exactly its rows and one
all-gather returns every rank's.

State: the same keys as DDP's flattened optimizer state ("state.<param>.exp_avg", ...; Muon's
"state.<param>.momentum_buffer"), each moment a DTensor of the whole parameter, so a checkpoint
moves between DDP, ZeRO-1/2/3 and any dp or tp degree. The fp32 masters are not saved: they equal
the fp32 parameters, which the model state holds, and they are rebuilt from them on load (ZeRO-3
loads its shards directly).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fivefold.parallel.comm import collectives
from fivefold.parallel.data.buckets import Bucket
from fivefold.parallel.materialize import carry_marks
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.state_dict import expert_zero_shard_as_dtensor, is_expert_parameter, zero_shard_as_dtensor


class HostMasters(Protocol):
    """Where ZeRO-3's masters live on the host (offload = "params", offload.py's ParamOffload): what
    the shards ask of it to bring rows up for a gather and to take reduced gradient rows down."""

    def stage(self, b: Bucket) -> torch.Tensor:
        """The bucket's master rows copied up into a new device buffer, (sum(shard numel),) fp32."""

    def add_grad(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """This rank's reduced rows of p (on the device, shaped as its master) into its host gradient."""

    def take_accumulated(self, b: Bucket) -> torch.Tensor | None:
        """The rows the bucket's host gradients accumulated, flat on the device; the gradients cleared."""


class ZeroShards:
    """The fp32 master rows this rank owns of each parameter of `buckets`, over dp_shard (experts:
    expert_dp). Fills each bucket's `shard_numel`: one rank's numel of each of its parameters."""

    def __init__(self, model: nn.Module, mesh: Mesh, buckets: list[Bucket]):
        self.mesh = mesh
        self.shard_group = mesh.group("dp_shard")
        self.expert_shard_group = mesh.group("expert_dp")  # used only with ep > 1: experts are dense at ep = 1
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.rows: dict[int, int] = {}  # id(param) -> rows each rank owns (c)
        self.zero_dims: dict[int, int] = {}  # id(param) -> the dim ZeRO splits (its "rows")
        self.masters: dict[int, nn.Parameter] = {}  # id(param) -> fp32 master rows, padded to c, split dim first
        for b in buckets:
            for p in b.params:
                split_dim0 = getattr(p, "tp_dim", None) == 0 or is_expert_parameter(p)
                zd = self.zero_dims[id(p)] = 1 if split_dim0 and p.ndim > 1 else 0
                rows = [p.shape[zd], *(d for i, d in enumerate(p.shape) if i != zd)]  # shape, split dim first
                self.rows[id(p)] = -(-rows[0] // self.group_of(p).size)
                # Only the padding rows past the parameter's end are zeroed: the rest is filled now
                # (a real parameter) or on load (from the meta device), so a memset of it is wasted.
                master = torch.empty((self.rows[id(p)], *rows[1:]), dtype=torch.float32, device=p.device)
                master[self.own_rows(p):].zero_()
                # the optimizer's decay rule reads no_decay off the tensors it steps (the slicing marks
                # describe p, not its shard)
                self.masters[id(p)] = carry_marks(p, nn.Parameter(master, requires_grad=False), ("no_decay",))
                if p.untyped_storage().nbytes():  # ZeRO-3 from the meta device: the shard is filled on load
                    self.copy_master_rows(p)
                b.shard_numel.append(master.numel())
        # What the optimizer steps for each parameter, keying its state: the masters, or their host
        # copies with parallel.offload = "optimizer" (offload.py replaces this)
        self.stepped: dict[int, nn.Parameter] = self.masters
        # offload = "params": the masters are host tensors and this brings them up and gradients
        # down (offload.py sets it); None: the masters are on the device
        self.host: HostMasters | None = None

    def group_of(self, p: nn.Parameter) -> collectives.AxisGroup:
        """The ranks p's state is sharded over: expert_dp for an expert, dp_shard for the rest."""
        return self.expert_shard_group if is_expert_parameter(p) else self.shard_group

    def bucket_group(self, b: Bucket) -> collectives.AxisGroup:
        """Where a bucket's state is sharded: its reduction group (expert_dp for experts: the buckets
        keep them apart), else dp_shard."""
        return b.group or self.shard_group

    def own_rows(self, p: nn.Parameter) -> int:
        """How many of this rank's c shard rows lie inside p (the rest pad the last ranks' shards)."""
        c = self.rows[id(p)]
        return max(0, min(c, p.shape[self.zero_dims[id(p)]] - self.group_of(p).rank * c))

    @torch.no_grad()
    def copy_master_rows(self, p: nn.Parameter) -> None:
        """This rank's rows of the full parameter p into its fp32 master shard."""
        zd, c, r = self.zero_dims[id(p)], self.rows[id(p)], self.group_of(p).rank
        valid = self.own_rows(p)
        self.masters[id(p)][:valid] = p.detach().movedim(zd, 0)[r * c : r * c + valid]

    @torch.no_grad()
    def all_gather(self, b: Bucket, async_op: bool = False,
                   dtype: torch.dtype | None = None) -> tuple[collectives.Pending | None, torch.Tensor]:
        """Every rank's rows of the bucket's parameters, in `dtype` (None: the parameters' own, which
        is parallel.param_dtype's for ZeRO-3): (work, (N sum(shard numel),) rank-major); work is
        None when not async. The fp32 masters are cast as they are packed (one copy): casting
        commutes with gathering, so every rank gets exactly its own cast of each shard."""
        group = self.bucket_group(b)
        local = self.packed(b, dtype or b.params[0].dtype)  # (sum(shard numel),)
        full = local.new_empty(group.size * local.numel())  # (N sum(shard numel),) rank-major
        return collectives.all_gather(full, local, group, async_op=async_op), full

    def packed(self, b: Bucket, dtype: torch.dtype) -> torch.Tensor:
        """This rank's master rows of the bucket, concatenated on the device in `dtype`, (sum(shard
        numel),): host masters (offload = "params") come up into a staging buffer first, which is
        what is returned in fp32 (freed with the gather that sends it), else cast from it."""
        if self.host is not None:
            staged = self.host.stage(b)  # (sum(shard numel),) fp32 on the device
            return staged if staged.dtype == dtype else staged.to(dtype)
        masters = [self.masters[id(p)].reshape(-1) for p in b.params]
        local = masters[0].new_empty(sum(b.shard_numel), dtype=dtype)  # (sum(shard numel),)
        return torch.cat(masters, out=local)

    def device_rows(self, b: Bucket) -> list[torch.Tensor]:
        """Each parameter's fp32 master rows on the device, (c, ...) split dim first (staged up from
        the host with offload = "params")."""
        if self.host is None:
            return [self.masters[id(p)] for p in b.params]
        parts = self.packed(b, torch.float32).split(b.shard_numel)
        return [part.view_as(self.masters[id(p)]) for p, part in zip(b.params, parts, strict=True)]

    @torch.no_grad()
    def add_grad(self, p: nn.Parameter, rows: torch.Tensor) -> None:
        """This rank's reduced rows of p (a micro-batch's, or the step's) into its master's gradient:
        the first become it, later ones add to it in fp32 (on the host with offload = "params")."""
        if self.host is not None:
            self.host.add_grad(p, rows)
            return
        shard = self.masters[id(p)]
        rows = rows.view_as(shard).float()
        shard.grad = rows if shard.grad is None else shard.grad.add_(rows)

    @torch.no_grad()
    def take_accumulated(self, b: Bucket) -> torch.Tensor | None:
        """The rows the bucket's master gradients accumulated over earlier micro-batches, flat
        (sum(shard numel),) on the device, and those gradients cleared; None when there are none."""
        if self.host is not None:
            return self.host.take_accumulated(b)
        accumulated = [self.masters[id(p)].grad for p in b.params]
        if accumulated[0] is None:
            return None
        for p in b.params:
            self.masters[id(p)].grad = None
        return torch.cat([g.reshape(-1) for g in accumulated])

    def unpacked(self, b: Bucket, full: torch.Tensor) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(p, every rank's rows of p: (N c, ...) split dim first) of the gathered `full`, one parameter
        at a time: each rank's rows of p lie apart in `full`, so the reshape copies them, and a caller
        that uses each before the next holds one such copy, not the bucket's."""
        per_rank = full.view(self.bucket_group(b).size, -1)
        for p, chunk in zip(b.params, per_rank.split(b.shard_numel, dim=1), strict=True):
            yield p, chunk.reshape(self.group_of(p).size * self.rows[id(p)],
                                   *(d for i, d in enumerate(p.shape) if i != self.zero_dims[id(p)]))

    def write_gathered(self, b: Bucket, full: torch.Tensor, into_data: bool = False) -> None:
        """Every rank's rows `full` (all_gather's) into the bucket's full parameters (or their
        `.data`: a refill autograd must not see)."""
        for p, rows in self.unpacked(b, full):
            target = (p.data if into_data else p).movedim(self.zero_dims[id(p)], 0)
            target.copy_(rows[: target.shape[0]])

    def gathered_copies(self, b: Bucket, full: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every rank's rows `full` as new tensors shaped like the bucket's parameters, in full's
        dtype, by parameter name."""
        zd = self.zero_dims
        return {self.names[id(p)]: rows[: p.shape[zd[id(p)]]].movedim(0, zd[id(p)]).contiguous()
                for p, rows in self.unpacked(b, full)}

    def dtensor(self, p: nn.Parameter, local: torch.Tensor) -> DTensor:
        """This rank's rows of p as a DTensor of the whole matrix, so a later layout can reshard it."""
        as_dtensor = expert_zero_shard_as_dtensor if is_expert_parameter(p) else zero_shard_as_dtensor
        return as_dtensor(p, local, self.zero_dims[id(p)], self.rows[id(p)], self.mesh)

    # ---- the optimizer's state of these rows --------------------------------------------------
    def optim_state_dict(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
        out = {}
        for p in params:
            state, name = optimizer.state[self.stepped[id(p)]], self.names[id(p)]
            for key, value in state.items():  # AdamW's moments and step, Muon's momentum_buffer
                out[f"state.{name}.{key}"] = value if key == "step" else self.dtensor(p, value)
        return out

    @torch.no_grad()
    def load_optim_state_dict(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, state: dict) -> None:
        for p in params:
            mine, name, zd = optimizer.state[self.stepped[id(p)]], self.names[id(p)], self.zero_dims[id(p)]
            for key in [k for k in mine if k != "step"]:
                rows = state[f"state.{name}.{key}"].to_local().movedim(zd, 0)
                target = mine[key][: rows.shape[0]]
                # A checkpoint is read into the views optim_state_dict() made of these moments: then
                # the rows are already in place (strides of a size-1 dim may differ; the memory does not).
                if (rows.data_ptr(), rows.shape) != (target.data_ptr(), target.shape):
                    target.copy_(rows)
            if "step" in mine:
                mine["step"].copy_(state[f"state.{name}.step"])


class ShardedOptimizer:
    """What ZeRO-1/2 and ZeRO-3 tell the optimizer step alike: it steps this rank's fp32 shards
    (`shards`) of `params`, whose gradients are split over dp_shard (experts: expert_dp)."""

    shards: ZeroShards
    params: list[nn.Parameter]

    def optimizer_params(self) -> list[torch.Tensor]:
        # the fp32 masters (offload: their host copies), in parameter order
        return [self.shards.stepped[id(p)] for p in self.params]

    def gradients(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.masters.values() if s.grad is not None]

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor | None:
        return self.shards.masters[id(p)].grad

    @property
    def norm_groups(self) -> list[collectives.AxisGroup]:
        return [self.shards.shard_group]

    @property
    def expert_norm_groups(self) -> list[collectives.AxisGroup]:
        return [self.shards.expert_shard_group]

    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        return self.shards.optim_state_dict(self.params, optimizer)

    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self.shards.load_optim_state_dict(self.params, optimizer, state)
