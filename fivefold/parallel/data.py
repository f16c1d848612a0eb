"""Data parallel (DDP) with gradient buckets overlapped with backward, and ZeRO-1 / ZeRO-2.

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

Shards (ZeRO): each parameter is split along dim 0 like torch.chunk: rank r owns rows
[r c, (r+1) c) with c = ceil(rows / N), so every shard is a DTensor Shard(0) on the dp_shard mesh
and checkpoints can reshard it (`optim_state_dict`). For the collectives a bucket lays its
parameters out rank-major (rank 0's rows of every parameter, then rank 1's, ...) with each
parameter padded to N c rows, so one reduce-scatter hands each rank exactly its rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.tensor import DTensor, Replicate, Shard

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
        # hold different parameters (pipeline stages) never write the same key with other values.
        state = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
        state = tp_shards_as_dtensors(state, self.model, self.mesh, prefix="state.")
        return expert_shards_as_dtensors(state, self.model, self.experts, prefix="state.")

    def load_optim_state_dict(self, state: dict) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, dtensors_as_local(state), options=FLAT)


class ZeroDataParallel(DataParallel):
    """ZeRO stage 1 or 2 over dp_shard (replicated over dp_replicate): sharded optimizer state."""

    def __init__(self, model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig):
        self.stage = parallel.zero
        self.shard_group = mesh.group("dp_shard")
        # Ranks holding the same shard, whose gradients add up: HSDP replicas and context-parallel
        # ranks (other tokens of the same samples). Their traffic is gradient reduction: "dp".
        self.replica_groups = [mesh.group("dp_replicate"), dataclasses.replace(mesh.group("cp"), label="dp")]
        super().__init__(model, mesh, parallel, train)

    def _build_optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        n, r = self.shard_group.size, self.shard_group.rank
        self.names = {id(p): name for name, p in self.model.named_parameters()}
        self.rows = {}  # id(param) -> rows each rank owns (c)
        self.zero_dims = {}  # id(param) -> the dim ZeRO splits (its "rows")
        self.shards: dict[int, nn.Parameter] = {}  # id(param) -> fp32 master rows, padded to c, split dim first
        for b in self.buckets:
            for p in b.params:
                # A tensor-parallel slice split along dim 0 is split by ZeRO along dim 1, so the two
                # splits are along different dims and the shard is a plain DTensor on (dp, tp).
                zd = self.zero_dims[id(p)] = 1 if getattr(p, "tp_dim", None) == 0 and p.ndim > 1 else 0
                rows = p.detach().movedim(zd, 0)
                c = -(-rows.shape[0] // n)
                master = torch.zeros((c, *rows.shape[1:]), dtype=torch.float32, device=p.device)
                valid = max(0, min(c, rows.shape[0] - r * c))
                master[:valid] = rows[r * c : r * c + valid]
                self.rows[id(p)] = c
                self.shards[id(p)] = nn.Parameter(master, requires_grad=False)
                b.shard_numel.append(master.numel())
        decay = [self.shards[id(p)] for p in self.params if p.ndim >= 2]
        no_decay = [self.shards[id(p)] for p in self.params if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), eps=train.eps, foreach=False)
        for s in self.shards.values():  # the state AdamW would create at its first step, made now for checkpoints
            opt.state[s] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(s), "exp_avg_sq": torch.zeros_like(s)}
        return opt

    def _reduces_on(self, last_micro_batch: bool) -> bool:
        return self.stage == 2 or last_micro_batch

    def _needs_reduction(self) -> bool:
        return True  # even alone, gradients must move into the fp32 shards the optimizer steps

    def _padded_rows(self, t: torch.Tensor, c: int) -> torch.Tensor:
        """t (rows, ...) -> (N c, ...) with zero rows appended."""
        pad = self.shard_group.size * c - t.shape[0]
        return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])

    @torch.no_grad()
    def _launch(self, b: Bucket) -> None:
        n = self.shard_group.size
        chunks = [self._padded_rows(p.grad.movedim(self.zero_dims[id(p)], 0), self.rows[id(p)]).reshape(n, -1)
                  for p in b.params]  # (N, c row numel) each
        b.flat = torch.cat(chunks, dim=1).reshape(-1).to(self.reduce_dtype)  # rank-major: (N sum(shard numel),)
        b.out = b.flat.new_empty(sum(b.shard_numel))
        b.work = comms.reduce_scatter(b.out, b.flat, self.shard_group, async_op=True)
        if self.stage >= 2:
            for p in b.params:
                p.grad = None  # the full gradient is not kept: its rows live on in b.flat until reduced

    @torch.no_grad()
    def _finish(self, b: Bucket) -> None:
        if b.work is not None:
            b.work.wait()
        for group in self.replica_groups:  # replicas of a shard agree
            comms.all_reduce(b.out, group)
        for p, rows in zip(b.params, b.out.split(b.shard_numel)):
            shard = self.shards[id(p)]
            rows = rows.view_as(shard).float()
            shard.grad = rows if shard.grad is None else shard.grad.add_(rows)
            p.grad = None
        b.work = b.flat = b.out = None

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return super()._optimizer_tensors() + list(self.shards.values())  # the fp32 masters

    def _extra_grads(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.values()]

    def gradients(self) -> list[torch.Tensor]:
        return [s.grad for s in self.shards.values() if s.grad is not None]

    @property
    def norm_groups(self) -> list[comms.AxisGroup]:
        return [self.shard_group]

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor:
        return self.shards[id(p)].grad

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on this rank's rows, then all-gather every parameter's rows from all ranks."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        n = self.shard_group.size
        for b in self.buckets:
            local = torch.cat([self.shards[id(p)].reshape(-1) for p in b.params]).to(b.params[0].dtype)
            full = local.new_empty(n * local.numel())  # (N sum(shard numel),) rank-major
            comms.all_gather(full, local, self.shard_group)
            per_rank = full.view(n, -1)
            for p, chunk in zip(b.params, per_rank.split(b.shard_numel, dim=1)):
                self._write_rows(p, chunk, p)

    def _write_rows(self, p: nn.Parameter, per_rank: torch.Tensor, target: torch.Tensor) -> None:
        """Write every rank's rows of p (N, c row numel), gathered, into `target` (p or p.data)."""
        rows = target.movedim(self.zero_dims[id(p)], 0)
        rows.copy_(per_rank.reshape(self.shard_group.size * self.rows[id(p)], *rows.shape[1:])[: rows.shape[0]])

    # ---- checkpoints: every shard as a DTensor, so a later layout can reshard it ------------------
    def _dtensor(self, p: nn.Parameter, local: torch.Tensor) -> DTensor:
        """This rank's rows as a DTensor of the whole matrix: Shard(zero dim) over dp_shard,
        replicated over dp_replicate, and Shard(tp_dim) over tp for a tensor-parallel slice."""
        zd, r, c = self.zero_dims[id(p)], self.shard_group.rank, self.rows[id(p)]
        valid = max(0, min(c, p.shape[zd] - r * c))
        shape, placements = list(p.shape), [Replicate(), Shard(zd), Replicate()]
        if hasattr(p, "tp_dim"):
            shape[p.tp_dim] *= self.mesh.size("tp")
            placements[2] = Shard(p.tp_dim)
        mesh = self.mesh.device_mesh["dp_replicate", "dp_shard", "tp"]
        return DTensor.from_local(local[:valid].movedim(0, zd), mesh, placements, run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    def optim_state_dict(self) -> dict:
        out = {}
        for p in self.params:
            s = self.shards[id(p)]
            state = self.optimizer.state[s]
            out[self.names[id(p)]] = {
                "master": self._dtensor(p, s.detach()),
                "exp_avg": self._dtensor(p, state["exp_avg"]),
                "exp_avg_sq": self._dtensor(p, state["exp_avg_sq"]),
                "step": state["step"],
            }
        return out

    @torch.no_grad()
    def load_optim_state_dict(self, state: dict) -> None:
        for p in self.params:
            s, saved = self.shards[id(p)], state[self.names[id(p)]]
            zd = self.zero_dims[id(p)]
            rows = {k: saved[k].to_local().movedim(zd, 0) for k in ("master", "exp_avg", "exp_avg_sq")}
            valid = rows["master"].shape[0]
            s[:valid] = rows["master"]
            mine = self.optimizer.state[s]
            mine["exp_avg"][:valid] = rows["exp_avg"]
            mine["exp_avg_sq"][:valid] = rows["exp_avg_sq"]
            mine["step"].copy_(saved["step"])


def apply_data_parallel(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig,
                        experts: ExpertGroups | None = None) -> DataParallel:
    """DDP for zero = 0, ZeRO-1/2, or FSDP for zero = 3; DDP over one rank reduces nothing.
    `experts`: expert parallel's groups (DDP only: validate() refuses ZeRO with ep > 1)."""
    if parallel.zero == 3:
        from fivefold.parallel.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel(model, mesh, parallel, train)
    if parallel.zero in (1, 2):
        return ZeroDataParallel(model, mesh, parallel, train)
    return DataParallel(model, mesh, parallel, train, experts)
