"""ZeRO-3 / FSDP: parameters sharded too; each unit gathers its weights only while it computes.

What is sharded over dp_shard (replicated over dp_replicate for HSDP): parameters, gradients and
optimizer state. Units: the embedding, each transformer block, and the head (final norm + output).
With N ranks, P parameter bytes and M micro-batches, two modes (`parallel.reshard_after_forward`):
- resharding (the default without pipelines), per micro-batch: a unit's parameters are
  all-gathered before its forward and freed after it, gathered again before its backward, freed
  after it, and its gradients reduce-scattered at once, so the full gradient never outlives its
  unit. Traffic 3 M (N-1)/N x P, 1.5x DDP's at M = 1, less the head's unit's: without a pipeline
  its backward follows its forward with only the loss between, so it stays gathered across (as
  FSDP2 keeps its root unit), one gather a micro-batch instead of two.
- kept gathered (the default with pipelines, as torchtitan composes FSDP2 with pipelining): a
  unit is gathered at its first forward of the step and kept until its chunk's last backward,
  where its gradients, accumulated unsharded (in fp32, bf16 weights or not), are reduce-scattered
  once. Traffic 2 (N-1)/N x P whatever M is; in memory the step holds this rank's stages whole,
  as ZeRO-1 would. With a pipeline, gathering around every F, B (and the zero-bubble I and W)
  would multiply the traffic by the micro-batch count for little memory: the next micro-batch's
  forward follows soon.
The next unit's all-gather is issued asynchronously while the current one computes (prefetch).
The optimizer steps the fp32 shards and no all-gather follows: the next forward gathers.
(Rajbhandari et al. 2020, ZeRO stage 3; Zhao et al. 2023, "PyTorch FSDP".)

Reading it: this file holds the units, their gathers and frees, and the hooks that run them. What
it shares with ZeRO-1/2 are parts it uses, not a class whose methods it overrides: the shards and
their optimizer state (shards.py: ZeroShards and the ShardedOptimizer methods), the reduce-scatter
of a bucket into them (zero.py's ShardedReduction) and the bucket machinery that decides when
(buckets.py). `FullyShardedDataParallel` is that machinery's reduction: ZeRO's, then the unit's
weights are freed.

How a parameter is freed: its storage is resized to zero and back (the tensor object, which
autograd saved for backward, stays the same), so the model code is untouched. Checkpoints save
the DTensor shards and reshard to any layout. With `parallel.fp8_gather` the FP8 layers' weights
are gathered in e4m3 instead and their full-precision storage stays empty (fp8_gather.py).

Frozen parameters (LoRA's base, model/lora.py) are sharded and gathered like the rest, in buckets
of their own that no reduction holds: they get no gradient, no reduce-scatter and no optimizer
state. The trainable weights of a unit go at their bucket's reduce-scatter, which their gradients
trigger; a frozen weight's backward use (dx = dy W, which the adapters below need) leaves no
gradient to wait for, so each unit's frozen weights go when the gradient of the unit's input is
complete, the point past which its backward needs no weight (FSDP2 frees a unit there too, from
an autograd function around the unit's inputs). A unit whose input needs no gradient (the first
block after a frozen embedding) keeps them until the end of its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.config.schema import ParallelConfig
from fivefold.parallel.data.buckets import Bucket, BucketReducer, ReducesInBuckets, chunk_index
from fivefold.parallel.data.fp8_gather import Finish, Float8Gather
from fivefold.parallel.data.shards import ShardedOptimizer, ZeroShards
from fivefold.parallel.data.zero import ShardedReduction
from fivefold.parallel.materialize import freed, materialize
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.state_dict import gather_expert_shards, gather_tp_shards, is_expert_parameter


@dataclass
class Unit:
    modules: list[nn.Module]  # run in this order in forward
    params: list[nn.Parameter]  # trainable and frozen
    gathered: bool = True  # full parameters materialised (true at construction)
    kept_for_backward: bool = False  # the head's unit without a pipeline: gathered from its forward to its backward
    has_backward: bool = True  # its last forward's output needed a gradient (a frozen embedding's does not)
    pending: list | None = None  # of each all-gather in flight: what waits for it and writes what it brings
    buckets: list[Bucket] = field(default_factory=list)  # its experts' (ep > 1: over expert_dp), then the rest
    frozen: list[Bucket] = field(default_factory=list)  # its frozen parameters: gathered, never reduced
    prev: "Unit | None" = field(default=None, repr=False)  # neighbours in forward order, for prefetch
    next: "Unit | None" = field(default=None, repr=False)


def sharding_units(model: nn.Module) -> list[list[nn.Module]]:
    """Module groups in forward order: embedding, each block, then final norm + head. A head that
    shares the embedding's matrix (tied embeddings, both on this rank) joins the embedding's unit:
    one parameter belongs to one unit, which then stays gathered from the embedding's forward to
    the head's (as an FSDP2 root unit holding both does). The MTP depths (model.mtp_layers) join the
    head's unit: they run between the final norm and the head's one call for all depths
    (pipeline/stages.py StageChunk.losses), so the unit's gather before the norm serves them."""
    emb, head = model.tok_embeddings, model.output
    tied = emb is not None and head is not None and head.weight is emb.weight
    mtp = [model.mtp] if len(model.mtp) else []
    ends = [[emb, model.norm, *mtp, head]] if tied else [[emb]]
    groups = ends + [[block] for block in model.layers.values()] + ([] if tied else [[model.norm, *mtp, head]])
    return [[m for m in g if m is not None] for g in groups if any(m is not None for m in g)]


def unit_buckets(units: list[Unit], mesh: Mesh, chunks: list[list[nn.Module]] | None) -> list[Bucket]:
    """One bucket per unit and group, in backward order: a unit's gradients leave as soon as it is
    done, or (kept gathered) at the last backward of its chunk, the last of its parameters' chunks.
    Experts (ep > 1) are sharded over expert_dp, so they make a bucket of their own. The frozen
    parameters make the units' `frozen` buckets, split alike; only the reduced ones are returned."""
    chunk_of = chunk_index(chunks)
    for unit in units:
        in_chunks = [chunk_of[id(p)] for p in unit.params if id(p) in chunk_of]
        chunk = max(in_chunks) if in_chunks else None

        def split(params: list[nn.Parameter], chunk: int | None = chunk) -> list[Bucket]:
            expert = [p for p in params if is_expert_parameter(p)]
            dense = [p for p in params if not is_expert_parameter(p)]
            return ([Bucket(expert, mesh.group("expert_dp"), chunk)] if expert else []) + (
                [Bucket(dense, None, chunk)] if dense else [])

        unit.buckets = split([p for p in unit.params if p.requires_grad])
        unit.frozen = split([p for p in unit.params if not p.requires_grad])
    return [b for u in reversed(units) for b in u.buckets]


class _AfterBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward runs once their gradients are complete, i.e.
    once the unit's backward has used its weights for the last time, and calls `done` there."""

    @staticmethod
    def forward(ctx, done, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.done = done
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple:
        ctx.done()
        return (None, *grads)


class FullyShardedDataParallel(ReducesInBuckets, ShardedOptimizer):
    """ZeRO-3 over dp_shard (replicated over dp_replicate): each unit's weights gathered only while
    it computes (`reshard_after_forward`), or from its first forward to its chunk's last backward."""

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig,
                 chunks: list[list[nn.Module]] | None = None, reshard_after_forward: bool = True):
        self.model, self.mesh = model, mesh
        # Built on the meta device, the full parameters never hold storage: only the shards do.
        materialize(model, mesh.device, freed)
        self.params = [p for p in model.parameters() if p.requires_grad]  # what trains (LoRA: the adapters)
        self.reshard_after_forward = reshard_after_forward  # derive() resolves "auto" (config/derive.py)
        # A pipeline runs other actions between a head's forward and its backward (all of them in
        # GPipe): kept gathered across, the head would hold its memory all that while.
        head_next = mesh.size("pp") == 1
        self.units = [Unit(mods, list(dict.fromkeys(p for m in mods for p in m.parameters())),
                           kept_for_backward=head_next and model.output in mods)
                      for mods in sharding_units(model)]
        for a, b in zip(self.units, self.units[1:], strict=False):
            a.next, b.prev = b, a
        if len(self.units) > 1 and model.output is not None and model.output in self.units[0].modules:
            self.units[0].prev = self.units[-1]  # the tied head's unit runs first in backward, then the last block
        self.max_gathered = 0  # most units holding full parameters at once, prefetches included
        self.buckets = unit_buckets(self.units, mesh, chunks)  # reduced: the trainable parameters'
        self.unit_of = {id(b): u for u in self.units for b in u.buckets}
        self.all_buckets = self.buckets + [b for u in self.units for b in u.frozen]  # the frozen ones too
        self.sharded = [p for b in self.all_buckets for p in b.params]  # every parameter: its shard is its only copy
        self.shards = ZeroShards(model, mesh, self.all_buckets)
        self.fp8 = Float8Gather(model, self.shards, self.all_buckets) if parallel.fp8_gather else None
        # The full weights live only while gathered, in parallel.param_dtype: with bf16 they are
        # gathered, computed with and get their gradients in bf16, which the reduce-scatter takes in
        # reduce_dtype into the fp32 shards, as FSDP2 with MixedPrecisionPolicy(param_dtype=bf16,
        # reduce_dtype=fp32) does (torch 2.13, torch/distributed/fsdp/_fully_shard/: _fsdp_param.py
        # casts the shard to param_dtype as all-gather input; _fsdp_collectives.py foreach_reduce
        # copies the bf16 gradients into a reduce_dtype buffer, reduce-scatters it and casts the
        # result to the sharded parameter's fp32).
        param_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.param_dtype]
        for p in self.sharded:
            if p.dtype != param_dtype:
                p.data = freed(p.to("meta", param_dtype), p.device)  # its values are in the shards now
        reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.reduce_dtype]
        # Resharding: every micro-batch, the full gradient is not kept (its reduced rows add up in
        # the fp32 shards' gradients). Kept gathered: once, at the chunk's last backward; the full
        # gradients accumulate until then, in fp32 as the masters they go into: added in bf16, each
        # micro-batch's add would round the sum to 8 bits of mantissa (why Megatron-LM accumulates
        # into an fp32 main_grad; FSDP2's _fsdp_param.py to_accumulated_grad_if_needed upcasts its
        # unsharded accumulated gradient to reduce_dtype). reduce_dtype is then the wire's only.
        self.accumulated: dict[int, torch.Tensor] = {}  # id(p) -> fp32 sum of its earlier micro-batches' gradients
        if not reshard_after_forward and param_dtype != torch.float32:
            for p in self.params:  # in either order with the reducer's hook: a reducing backward keeps .grad
                p.register_post_accumulate_grad_hook(self._accumulate_in_fp32)
        self.reduction = ShardedReduction(self.shards, mesh, reduce_dtype, every_micro_batch=reshard_after_forward,
                                          drop_full_grads=True, full_grad=self._full_grad)
        self.reducer = BucketReducer(self.params, self.buckets, self, parallel.overlap_comm,
                                     parallel.buckets_in_flight)
        for unit in self.units:
            self._free(unit)
            unit.modules[0].register_forward_pre_hook(lambda m, args, u=unit: self._pre_forward(u, args))
            unit.modules[-1].register_forward_hook(lambda m, args, out, u=unit: self._post_forward(u, out))

    # ---- gather and free ------------------------------------------------------------------------
    def _issue_gather(self, unit: Unit) -> None:
        if unit.gathered or unit.pending is not None:
            return
        unit.pending = [f for b in unit.buckets + unit.frozen
                        for f in (self.fp8.issue(b, self._issue_plain) if self.fp8 else [self._issue_plain(b)])]
        in_use = sum(u.gathered or u.pending is not None for u in self.units)
        self.max_gathered = max(self.max_gathered, in_use)

    @torch.no_grad()
    def _gather(self, unit: Unit) -> None:
        """Make the unit's full parameters available (waiting for a prefetch if one is in flight)."""
        if unit.gathered:
            return
        self._issue_gather(unit)
        for finish in unit.pending:
            finish()
        unit.pending, unit.gathered = None, True

    def _issue_plain(self, b: Bucket) -> Finish:
        """Start gathering the bucket's parameters in their dtype; the returned call waits and fills them."""
        work, full = self.shards.all_gather(b, async_op=True)

        def finish() -> None:
            if work is not None:
                work.wait()
            for p in b.params:
                p.untyped_storage().resize_(p.numel() * p.element_size())
            # Through .data: a refill is not a modification autograd must see (the values are the
            # ones forward used), and bumping p's version would fail the saved-tensor check.
            self.shards.write_gathered(b, full, into_data=True)

        return finish

    def _free(self, unit: Unit, params: list[nn.Parameter] | None = None) -> None:
        """Free the unit's full parameters (`params`: only those; the unit counts as freed, so its
        next use gathers it whole)."""
        for p in unit.params if params is None else params:
            p.untyped_storage().resize_(0)
        if self.fp8 is not None:
            self.fp8.free(unit.params if params is None else params)
        unit.gathered = False

    # ---- hooks ----------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, args: tuple) -> tuple | None:
        self._gather(unit)
        if unit.next is not None:
            self._issue_gather(unit.next)  # prefetch: overlaps the next unit's gather with this compute
        needs_grad = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        if not (unit.frozen and self.reshard_after_forward and needs_grad and torch.is_grad_enabled()):
            return None  # kept gathered, a unit's weights stay until its chunk's last backward anyway
        frozen = [p for b in unit.frozen for p in b.params]
        wrapped = iter(_AfterBackward.apply(lambda: self._free(unit, frozen), *(args[i] for i in needs_grad)))
        return tuple(next(wrapped) if i in needs_grad else a for i, a in enumerate(args))

    def _post_forward(self, unit: Unit, out: torch.Tensor) -> None:
        backward_follows = unit.has_backward = torch.is_grad_enabled() and out.requires_grad
        if self.reshard_after_forward and not (unit.kept_for_backward and backward_follows):
            self._free(unit)  # the head's backward comes next: freed now, it would be gathered again at once
        if backward_follows:
            # Fires when the gradient of the unit's output is complete, i.e. just before its backward.
            out.register_hook(lambda grad: self._pre_backward(unit))

    def _pre_backward(self, unit: Unit) -> None:
        self._gather(unit)
        if unit.prev is not None and unit.prev.has_backward:
            self._issue_gather(unit.prev)  # backward runs the units in reverse order

    # ---- kept gathered with bf16 weights: full gradients accumulated in fp32 ------------------
    @torch.no_grad()
    def _accumulate_in_fp32(self, p: nn.Parameter) -> None:
        """A micro-batch's gradient of p is complete in p.grad (bf16): unless this backward reduces
        p's bucket, it moves into p's fp32 sum, so autograd puts the next one into an empty .grad
        instead of adding it there in bf16. (One micro-batch a step accumulates nothing: no copy.)"""
        if self.reducer.bucket_of[id(p)].armed:
            return  # the reduction reads this last one with the sum (_full_grad)
        acc = self.accumulated.get(id(p))
        if acc is None:
            self.accumulated[id(p)] = p.grad.float()
        else:
            acc.add_(p.grad)  # in fp32: the bf16 operand is widened exactly
        p.grad = None

    def _full_grad(self, p: nn.Parameter) -> torch.Tensor:
        """p's gradient of the step, for the reduce-scatter: its fp32 sum plus the last micro-batch's."""
        acc = self.accumulated.pop(id(p), None)
        return p.grad if acc is None else acc.add_(p.grad)

    # ---- the reduction of a bucket (buckets.Reduction): ZeRO's, then the unit's weights go ------
    def reduces(self, last_micro_batch: bool) -> bool:
        return self.reduction.reduces(last_micro_batch)

    def launch(self, b: Bucket, last_micro_batch: bool) -> None:
        self.reduction.launch(b, last_micro_batch)  # reduce-scatter the unit's gradients (and drop the full ones)
        # the unit's other buckets (its experts', its frozen weights) may still be computing
        self._free(self.unit_of[id(b)], b.params)

    def finish(self, b: Bucket, last_micro_batch: bool) -> None:
        self.reduction.finish(b, last_micro_batch)

    def after_backward(self, reduced: list[Bucket], last_micro_batch: bool) -> None:
        self.reduction.after_backward(reduced, last_micro_batch)
        ids, chunks = {id(b) for b in reduced}, {b.chunk for b in reduced}
        for unit in self.units:  # a unit whose output needed no gradient may still be gathered
            frozen_done = (unit.gathered and self.reshard_after_forward and not unit.buckets  # wholly frozen
                           and any(b.chunk in chunks for b in unit.frozen))
            # its reduced buckets went at their launch, its frozen weights may not have (its input
            # needed no gradient): freed whatever `gathered` says
            if frozen_done or any(id(b) in ids for b in unit.buckets):
                self._free(unit)

    # ---- the optimizer (ShardedOptimizer: the shards it steps) ---------------------------------
    def after_step(self) -> None:
        """The shards are the weights now: the next forward gathers them, no all-gather here."""
        for unit in self.units:  # anything still gathered (kept after an evaluation) is stale now
            if unit.gathered:
                self._free(unit)

    # ---- state ----------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers (an MoE's routing bias): replicated, saved as they are."""
        params = {name for name, _ in self.model.named_parameters(remove_duplicate=False)}
        return {k: v for k, v in self.model.state_dict().items() if k not in params}

    def _aliases(self) -> dict[str, str]:
        """Second names of shared parameters (a tied head's "output.weight") -> their first name.
        The state lists both, as the replicated model's does, so checkpoints move between them."""
        names = self.shards.names
        return {name: names[id(p)] for name, p in self.model.named_parameters(remove_duplicate=False)
                if names.get(id(p), name) != name}

    def model_state_dict(self) -> dict:
        names, masters = self.shards.names, self.shards.masters
        shards = {names[id(p)]: self.shards.dtensor(p, masters[id(p)].detach()) for p in self.sharded}
        return {**shards, **{alias: shards[name] for alias, name in self._aliases().items()}, **self._buffers()}

    @torch.no_grad()
    def load_model_state_dict(self, state: dict) -> None:
        for p in self.sharded:
            local = state[self.shards.names[id(p)]].to_local().movedim(self.shards.zero_dims[id(p)], 0)
            self.shards.masters[id(p)][: local.shape[0]] = local
        for name, buffer in self._buffers().items():
            buffer.copy_(state[name])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for b in self.all_buckets:  # the fp32 masters, whatever dtype the weights compute in
            _, full = self.shards.all_gather(b, dtype=torch.float32)
            out.update(self.shards.gathered_copies(b, full))
        out.update({alias: out[name] for alias, name in self._aliases().items()})
        out.update({k: v.detach().clone() for k, v in self._buffers().items()})
        return gather_expert_shards(gather_tp_shards(out, self.model, self.mesh), self.model, self.mesh.group("ep"))

