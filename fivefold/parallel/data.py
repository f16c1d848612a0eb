"""Data parallel (DDP) with gradient buckets overlapped with backward; the base of ZeRO-1/2/3.

What is sharded: the batch over the `batch` view (dp). With `zero = 1` also the optimizer state
(fp32 master weights and both AdamW moments), with `zero = 2` also the gradients, each over
`dp_shard`; with dp_replicate > 1 the shards are replicated across dp_replicate (HSDP).

Collectives, per optimizer step, with N ranks, G gradient bytes, P parameter bytes, M micro-batches:
- DDP: one all-reduce (SUM) per bucket, on the last micro-batch only: 2(N-1)/N x G per rank.
- ZeRO-1: one reduce-scatter per bucket on the last micro-batch, AdamW on this rank's shard, one
  all-gather of the updated parameters: (N-1)/N x G + (N-1)/N x P.
- ZeRO-2: a reduce-scatter per bucket on *every* micro-batch (the full gradient is freed as soon
  as its bucket is reduced, never kept across micro-batches), then as ZeRO-1: (M+1)(N-1)/N x G.
(Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models".)

Buckets: parameters are grouped in reverse registration order (roughly the order backward
produces their gradients) into buckets of at most `parallel.bucket_mb`. A post-accumulate-grad
hook counts the gradients each bucket still waits for; when a bucket is complete its collective
starts asynchronously and backward goes on computing (Li et al. 2020, "PyTorch Distributed").
Buckets start strictly in order, so every rank issues the same collectives in the same order even
when a parameter gets no gradient on one rank (an MoE expert without tokens): its bucket then
waits for the end of backward, where missing gradients are zeros.

Gradients are summed, not averaged: each rank's loss is already divided by the global token count
of the step (train/loop.py), so the sum is the gradient of the mean over every token.

ZeRO-1/2 (`zero.py`) and ZeRO-3 (`fsdp.py`) build on DataParallel's buckets and reducing.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from fivefold.config import ParallelConfig, TrainConfig
from fivefold.mesh import Mesh
from fivefold.parallel import comms
from fivefold.parallel.expert import (ExpertGroups, expert_shards_as_dtensors, gather_expert_shards,
                                     is_expert_parameter)
from fivefold.parallel.ring import ring_all_reduce
from fivefold.parallel.tensor import dtensors_as_local, gather_tp_shards, tp_shards_as_dtensors
from fivefold.train.optim import build_optimizer


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Bucket:
    params: list[nn.Parameter]
    group: comms.AxisGroup | None = None  # DDP: where its gradients are summed (None: the grad view)
    waiting: int = 0  # gradients of this backward not yet accumulated
    work: object | None = None  # the in-flight collective
    flat: torch.Tensor | None = None  # its send buffer (DDP: also the result)
    out: torch.Tensor | None = None  # ZeRO: this rank's reduced rows
    shard_numel: list[int] = field(default_factory=list)  # ZeRO: numel of one rank's rows per parameter


def make_buckets(params: list[nn.Parameter], cap_bytes: float,
                 group_of: Callable[[nn.Parameter], comms.AxisGroup | None] = lambda p: None) -> list[Bucket]:
    """Consecutive groups of `params` whose bytes stay under cap_bytes (a larger tensor stands alone),
    each reduced over one group: a parameter of another `group_of` starts a new bucket."""
    buckets: list[Bucket] = []
    size = math.inf
    for p in params:
        nbytes = p.numel() * p.element_size()
        if size + nbytes > cap_bytes or group_of(p) is not buckets[-1].group:
            buckets.append(Bucket([], group_of(p)))
            size = 0
        buckets[-1].params.append(p)
        size += nbytes
    return buckets


class DataParallel:
    """DDP: the whole model on every rank; gradients all-reduced bucket by bucket during backward."""

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig,
                 experts: ExpertGroups | None = None):
        self.model, self.mesh, self.experts = model, mesh, experts
        self.group = mesh.group("grad")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = self._make_buckets(parallel)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.overlap = parallel.overlap_comm
        self.ring = parallel.dp_collective == "ring"  # our send/recv ring instead of the backend's all-reduce
        self.reduce_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[parallel.reduce_dtype]
        self._peak: dict[str, int] = {}  # largest model_state_bytes() seen between micro-batches
        self._reducing = False
        self._next = 0  # index of the next bucket to launch
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.optimizer = self._build_optimizer(train)

    def _make_buckets(self, parallel: ParallelConfig) -> list[Bucket]:
        # An expert's gradient already holds every token its ep group routed to it: it is summed
        # over the ranks holding the same experts (the expert replicas), not the whole grad view.
        replicas = self.experts.replicas if self.experts is not None else None
        return make_buckets(self.params[::-1], parallel.bucket_mb * 1e6,
                            lambda p: replicas if is_expert_parameter(p) else None)

    def _build_optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        return build_optimizer(self.model, train)

    # ---- backward ---------------------------------------------------------------------------
    def _reduces_on(self, last_micro_batch: bool) -> bool:
        return last_micro_batch  # DDP and ZeRO-1 talk once per step

    def _needs_reduction(self) -> bool:
        return self.group.size > 1

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last_micro_batch: bool,
                 inputs: list[torch.Tensor] | None = None) -> None:
        """Backward from `out` (a loss, or a pipeline stage's output with its gradient), reducing
        gradients as their buckets complete when this micro-batch talks."""
        with self.reducing(last_micro_batch):
            torch.autograd.backward(out, grad, inputs=inputs)

    @contextlib.contextmanager
    def reducing(self, last_micro_batch: bool) -> Iterator[None]:
        """Around any code that accumulates a micro-batch's gradients (one backward, or the W
        passes of a split backward): buckets reduce as they complete when this micro-batch talks."""
        self._reducing = self._reduces_on(last_micro_batch) and self._needs_reduction()
        if self._reducing:
            self._next = 0
            for b in self.buckets:
                b.waiting = len(b.params)
        yield
        if self._reducing:
            self._launch_ready(force=True)  # buckets with a parameter that got no gradient here
            for b in self.buckets:
                self._finish(b)
            self._reducing = False
        sample = self.model_state_bytes()
        if sample["total"] > self._peak.get("total", -1):
            self._peak = sample

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not (self._reducing and self.overlap):  # without overlap every bucket starts after backward
            return
        self.bucket_of[id(p)].waiting -= 1
        self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next < len(self.buckets) and (force or self.buckets[self._next].waiting == 0):
            b = self.buckets[self._next]
            for p in b.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self._launch(b)
            self._next += 1

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        b.flat = torch.cat([p.grad.reshape(-1) for p in b.params]).to(self.reduce_dtype)  # (bucket numel,)
        group = b.group or self.group
        if not self.ring:
            b.work = comms.all_reduce(b.flat, group, async_op=True)
            return
        numel, n = b.flat.numel(), group.size
        padded = torch.cat([b.flat, b.flat.new_zeros(-numel % n)])  # the ring moves N equal chunks
        ring_all_reduce(padded, group)  # synchronous: each of its 2(N-1) steps waits for the last
        b.flat = padded[:numel]

    @torch.no_grad()
    def _finish(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        for p, chunk in zip(b.params, b.flat.split([p.numel() for p in b.params])):
            p.grad.copy_(chunk.view_as(p))
        b.work = b.flat = None

    # ---- optimizer ---------------------------------------------------------------------------
    def gradients(self) -> list[torch.Tensor]:
        """The reduced gradients the optimizer will apply (ZeRO: this rank's shards of them)."""
        return [p.grad for p in self.params if p.grad is not None]

    @property
    def norm_groups(self) -> list[comms.AxisGroup]:
        """The groups this rank's gradients are split over (none: every rank holds all of them)."""
        return []

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        """The reduced gradient the optimizer will apply to p (ZeRO: this rank's rows of it)."""
        return p.grad

    def skip_step(self) -> None:
        """Drop this step's gradients (fp16 overflow): nothing is applied."""
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # ---- memory ---------------------------------------------------------------------------------
    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]

    def _extra_grads(self) -> list[torch.Tensor]:
        return []

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state (fp32 master
        copies included), each storage counted once; freed (resized-to-zero) storages count 0."""
        seen: set[int] = set()

        def size(tensors: list[torch.Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None or t.untyped_storage().nbytes() == 0 or t.untyped_storage().data_ptr() in seen:
                    continue
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
            return total

        out = {"params": size(list(self.params)),
               "grads": size([p.grad for p in self.params] + self._extra_grads()),
               "optimizer": size(self._optimizer_tensors())}
        return {**out, "total": sum(out.values())}

    def pop_peak_state_bytes(self) -> dict[str, int]:
        """The largest model_state_bytes() sampled after each micro-batch since the last call."""
        peak, self._peak = self._peak, {}
        return peak

    # ---- state: what checkpoints save and tests compare ----------------------------------------
    # Tensor-parallel slices are described as DTensors on the tp axis, so a checkpoint knows each
    # matrix's whole shape and where this rank's slice sits.
    def model_state_dict(self) -> dict:
        state = tp_shards_as_dtensors(get_model_state_dict(self.model), self.model, self.mesh)
        return expert_shards_as_dtensors(state, self.model, self.experts)

    def load_model_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, dtensors_as_local(state))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Plain, unsharded copies of every parameter and buffer, keyed as in the model."""
        local = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        local = gather_tp_shards(local, self.model, self.mesh)
        return gather_expert_shards(local, self.model, self.experts.ep) if self.experts else local

    def optim_state_dict(self) -> dict:
        # Flattened: every entry keyed by parameter name ("state.layers.0...exp_avg"), so ranks that
        # hold different parameters (pipeline stages) never write the same key with other values,
        # and ZeRO's shards of the same moments (zero.py) have the same keys. Hyperparameters
        # ("param_groups.*") are not saved: they come from the config, which may change on resume.
        state = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
        state = {k: v for k, v in state.items() if k.startswith("state.")}
        state = tp_shards_as_dtensors(state, self.model, self.mesh, prefix="state.")
        return expert_shards_as_dtensors(state, self.model, self.experts, prefix="state.")

    def load_optim_state_dict(self, state: dict) -> None:
        current = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
        groups = {k: v for k, v in current.items() if k.startswith("param_groups.")}
        set_optimizer_state_dict(self.model, self.optimizer, {**groups, **dtensors_as_local(state)}, options=FLAT)


def apply_data_parallel(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig,
                        experts: ExpertGroups | None = None) -> DataParallel:
    """DDP for zero = 0, ZeRO-1/2, or FSDP for zero = 3; DDP over one rank reduces nothing.
    `experts`: expert parallel's groups (DDP only: validate() refuses ZeRO with ep > 1)."""
    if parallel.zero == 3:
        from fivefold.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, mesh, parallel, train)
    if parallel.zero in (1, 2):
        from fivefold.parallel.zero import ZeroDataParallel

        return ZeroDataParallel(model, mesh, parallel, train)
    return DataParallel(model, mesh, parallel, train, experts)
