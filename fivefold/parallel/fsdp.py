"""ZeRO-3 / FSDP: parameters sharded too; each unit gathers its weights only while it computes.

What is sharded over dp_shard (replicated over dp_replicate for HSDP): parameters, gradients and
optimizer state. Units: the embedding, each transformer block, and the head (final norm + output).
Per micro-batch, with N ranks and P parameter bytes:
- forward: a unit's parameters are all-gathered before it runs and freed after (unless
  `parallel.reshard_after_forward = false`, which keeps them until its backward);
- backward: gathered again before the unit's backward, freed after it, and its gradients
  reduce-scattered at once, so the full gradient never outlives its unit;
- the next unit's all-gather is issued asynchronously while the current one computes (prefetch):
  at most two units are gathered at a time.
Traffic: 3 M (N-1)/N x P (two all-gathers and one reduce-scatter per micro-batch), 1.5x DDP's at
M = 1. The optimizer steps the fp32 shards and no all-gather follows: the next forward gathers.
(Rajbhandari et al. 2020, ZeRO stage 3; Zhao et al. 2023, "PyTorch FSDP".)

How a parameter is freed: its storage is resized to zero and back (the tensor object, which
autograd saved for backward, stays the same), so the model code is untouched. The shards and the
optimizer are ZeRO-1/2's (`ZeroDataParallel`): each parameter split along dim 0 like torch.chunk,
so checkpoints save DTensor shards and reshard to any layout.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from fivefold.config import ParallelConfig
from fivefold.mesh import Mesh
from fivefold.parallel import comms
from fivefold.parallel.ddp import Bucket
from fivefold.parallel.materialize import freed, materialize
from fivefold.parallel.state_dict import gather_tp_shards
from fivefold.parallel.zero import ZeroDataParallel


@dataclass
class Unit:
    modules: list[nn.Module]  # run in this order in forward
    params: list[nn.Parameter]
    gathered: bool = True  # full parameters materialised (true at construction)
    pending: tuple | None = None  # (work, flat buffer) of an all-gather in flight
    bucket: Bucket | None = None
    prev: "Unit | None" = field(default=None, repr=False)  # neighbours in forward order, for prefetch
    next: "Unit | None" = field(default=None, repr=False)


def sharding_units(model: nn.Module) -> list[list[nn.Module]]:
    """Module groups in forward order: embedding, each block, then final norm + head."""
    groups = [[model.tok_embeddings]] + [[block] for block in model.layers.values()] + [[model.norm, model.output]]
    return [[m for m in g if m is not None] for g in groups if any(m is not None for m in g)]


class FullyShardedDataParallel(ZeroDataParallel):
    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig):
        # Built on the meta device, the full parameters never hold storage: only the shards do.
        materialize(model, mesh.device, freed)
        self.reshard_after_forward = parallel.reshard_after_forward
        self.units = [Unit(mods, [p for m in mods for p in m.parameters() if p.requires_grad])
                      for mods in sharding_units(model)]
        for a, b in zip(self.units, self.units[1:], strict=False):
            a.next, b.prev = b, a
        self.max_gathered = 0  # most units holding full parameters at once, prefetches included
        super().__init__(model, mesh, parallel)  # makes the fp32 shards from the full weights
        for unit in self.units:
            self._free(unit)
            unit.modules[0].register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u))
            unit.modules[-1].register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    def _make_buckets(self, parallel: ParallelConfig) -> list[Bucket]:
        # One bucket per unit, in backward order: a unit's gradients leave as soon as it is done.
        for unit in self.units:
            unit.bucket = Bucket(unit.params)
        return [u.bucket for u in reversed(self.units)]

    def _reduces_on(self, last_micro_batch: bool) -> bool:
        return True  # every micro-batch: the full gradient is not kept

    # ---- gather and free ------------------------------------------------------------------------
    @torch.no_grad()
    def _issue_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.pending is not None:
            return
        local = torch.cat([self.shards[id(p)].reshape(-1) for p in unit.params]).to(unit.params[0].dtype)
        full = local.new_empty(self.shard_group.size * local.numel())  # (N sum(shard numel),) rank-major
        work = comms.all_gather(full, local, self.shard_group, async_op=True)
        unit.pending = (work, full)
        in_use = sum(u.gathered or u.pending is not None for u in self.units)
        self.max_gathered = max(self.max_gathered, in_use)

    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        """Make the unit's full parameters available (waiting for a prefetch if one is in flight)."""
        if unit.gathered:
            return
        self._issue_gather(unit)
        work, full = unit.pending
        if work is not None:
            work.wait()
        n = self.shard_group.size
        for p, chunk in zip(unit.params, full.view(n, -1).split(unit.bucket.shard_numel, dim=1), strict=True):
            p.untyped_storage().resize_(p.numel() * p.element_size())
            # Through .data: a refill is not a modification autograd must see (the values are the
            # ones forward used), and bumping p's version would fail the saved-tensor check.
            self._write_rows(p, chunk, p.data)
        unit.pending, unit.gathered = None, True

    def _free(self, unit: Unit) -> None:
        for p in unit.params:
            p.untyped_storage().resize_(0)
        unit.gathered = False

    # ---- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.next is not None:
            self._issue_gather(unit.next)  # prefetch: overlaps the next unit's gather with this compute

    def _post_forward(self, unit: Unit, out: torch.Tensor) -> None:
        if self.reshard_after_forward:
            self._free(unit)
        if torch.is_grad_enabled() and out.requires_grad:
            # Fires when the gradient of the unit's output is complete, i.e. just before its backward.
            out.register_hook(lambda grad: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.prev is not None:
            self._issue_gather(unit.prev)  # backward runs the units in reverse order

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        super()._launch(b)  # reduce-scatter the unit's gradients (and drop the full ones)
        unit = next(u for u in self.units if u.bucket is b)
        self._free(unit)

    @contextlib.contextmanager
    def reducing(self, last_micro_batch: bool) -> Iterator[None]:
        with super().reducing(last_micro_batch):
            yield
        for unit in self.units:  # a unit whose output needed no gradient is still gathered
            if unit.gathered:
                self._free(unit)

    def after_step(self) -> None:
        """The shards are the weights now: the next forward gathers them, no all-gather here."""
        for unit in self.units:  # anything still gathered (kept after an evaluation) is stale now
            if unit.gathered:
                self._free(unit)

    # ---- state ----------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers (an MoE's routing bias): replicated, saved as they are."""
        params = set(self.names.values())
        return {k: v for k, v in self.model.state_dict().items() if k not in params}

    def model_state_dict(self) -> dict:
        shards = {self.names[id(p)]: self._dtensor(p, self.shards[id(p)].detach()) for p in self.params}
        return {**shards, **self._buffers()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict) -> None:
        for p in self.params:
            local = state[self.names[id(p)]].to_local().movedim(self.zero_dims[id(p)], 0)
            self.shards[id(p)][: local.shape[0]] = local
        for name, buffer in self._buffers().items():
            buffer.copy_(state[name])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for unit in self.units:
            self._gather(unit)
            out.update({self.names[id(p)]: p.detach().clone() for p in unit.params})
            self._free(unit)
        out.update({k: v.detach().clone() for k, v in self._buffers().items()})
        return gather_tp_shards(out, self.model, self.mesh)
