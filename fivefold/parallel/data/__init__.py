"""Data parallel: the batch split over dp ranks, and with ZeRO the model state too.

Which implementation a layout gets, by `parallel.zero` (Rajbhandari et al. 2020, "ZeRO"):

| zero | module | sharded over dp_shard | traffic per rank per step (N ranks, M micro-batches) |
| --- | --- | --- | --- |
| 0 | ddp.py (DDP) | nothing | 2(N-1)/N x G, one all-reduce per bucket on the last micro-batch |
| 1 | zero.py | optimizer state | (N-1)/N x G + (N-1)/N x P |
| 2 | zero.py | + gradients | (M+1)(N-1)/N x G |
| 3 | fsdp.py | + parameters | 3M(N-1)/N x P (the head's 2M: no pipeline); kept gathered 2(N-1)/N x P |

G: gradient bytes, P: parameter bytes. With dp_replicate > 1 the shards are replicated across
dp_replicate (HSDP). Every one of them reduces gradients over the grad view (dp x cp), expert
gradients over expert_dp (where ZeRO also shards the experts' state), and is a no-op reduction
over one rank. With pipelines each of a rank's chunks reduces at its own last backward.

The folder: buckets.py is the one bucket machinery (when a bucket of gradients is reduced, for all
three); ddp.py, zero.py and fsdp.py each say what a reduction is (all-reduce; reduce-scatter into
the fp32 shards of shards.py; that, and freeing a unit's gathered weights) and use the machinery as
a part, not as a base class; offload.py moves ZeRO's optimizer state to the host (ZeRO-Offload,
parallel.offload = "optimizer"), and with "params" ZeRO-3's parameter shards too (ZeRO-Infinity);
fp8_gather.py gathers ZeRO-3's FP8 weights in e4m3 (parallel.fp8_gather). `DataParallel` below is
what the step asks of any of them.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch
from torch import nn

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.data.ddp import DDP
from fivefold.parallel.data.fsdp import FullyShardedDataParallel
from fivefold.parallel.data.zero import ZeroDataParallel
from fivefold.parallel.mesh import Mesh


class DataParallel(Protocol):
    """What the pipeline executor, the optimizer step and checkpoints ask of a data-parallel strategy."""

    model: nn.Module
    params: list[nn.Parameter]  # this rank's trainable parameters, in model order

    def backward(self, out: torch.Tensor, grad: torch.Tensor | None = None, *, last_micro_batch: bool,
                 inputs: list[torch.Tensor] | None = None, chunk: int | None = None) -> None:
        """Backward from `out`, reducing the chunk's buckets as they complete when it talks."""

    def reducing(self, last_micro_batch: bool, chunk: int | None = None) -> contextlib.AbstractContextManager:
        """Around code that accumulates a micro-batch's gradients (a split backward's W passes)."""

    def optimizer_params(self) -> list[torch.Tensor]:
        """What the optimizer steps, in parameter order (ZeRO: this rank's fp32 shards)."""

    def after_step(self) -> None:
        """What follows an optimizer step (ZeRO-1/2: gather the updated rows)."""

    def gradients(self) -> list[torch.Tensor]:
        """The reduced gradients the optimizer will apply (ZeRO: this rank's rows of them)."""

    def gradient_of(self, p: nn.Parameter) -> torch.Tensor | None:
        """The reduced gradient the optimizer will apply to p."""

    @property
    def norm_groups(self) -> list[AxisGroup]:
        """The groups this rank's gradients are split over (none: every rank holds all of them)."""

    @property
    def expert_norm_groups(self) -> list[AxisGroup]:
        """The groups this rank's expert gradients are split over besides ep (ZeRO: expert_dp)."""

    def model_state_dict(self) -> dict: ...
    def load_model_state_dict(self, state: dict) -> None: ...
    def full_state_dict(self) -> dict[str, torch.Tensor]: ...
    def optim_state_dict(self, optimizer: torch.optim.Optimizer) -> dict: ...
    def load_optim_state_dict(self, optimizer: torch.optim.Optimizer, state: dict) -> None: ...


def apply_data_parallel(model: nn.Module, mesh: Mesh, cfg: Config, derived: Derived, *,
                        chunks: list[list[nn.Module]] | None = None) -> DataParallel:
    """Wrap `model` (this rank's part of it, after every other dimension) for gradient reduction:
    DDP for zero = 0, ZeRO-1/2, or FSDP for zero = 3. `chunks`: this rank's pipeline chunks in the
    order of their last backward (`PipelineStages.reduction_chunks`), each reduced when it is done."""
    p = cfg.parallel
    if p.zero == 3:
        return FullyShardedDataParallel(model, mesh, p, chunks, derived.reshard_after_forward)
    if p.zero in (1, 2):
        return ZeroDataParallel(model, mesh, p, chunks)
    return DDP(model, mesh, p, chunks)
