"""THE composition order: how one model becomes this rank's part of a parallel layout.

    split into pipeline stages (keep this rank's layers)
      -> tensor parallel -> expert parallel -> context parallel
      -> activation checkpointing / compile
      -> data parallel / ZeRO / FSDP (last: it wraps whatever parameters the others left)

Each step is one `apply_<dim>(model, mesh, cfg)` that is a no-op at size 1. Data parallel comes
last because it reduces (or shards) the parameters as the earlier steps left them: after TP a
rank's weights are slices, after PP only its stage's layers remain.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.config import Config
from fivefold.mesh import Mesh
from fivefold.parallel.data import DataParallel, apply_data_parallel


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config) -> DataParallel:
    """Apply every dimension of cfg.parallel to `model` in place; return the data-parallel wrapper,
    which owns the optimizer (ZeRO steps on shards) and the gradient reduction."""
    if cfg.train.compile:
        # Per block, so each compiled graph is small and pipeline stages compile only their own.
        # Module.compile() keeps parameter names, so checkpoints do not depend on this switch.
        for block in model.layers.values():
            block.compile()
    return apply_data_parallel(model, mesh, cfg.parallel, cfg.train)


def full_state_dict(dp: DataParallel) -> dict[str, torch.Tensor]:
    """A plain, unsharded copy of the model's state on every rank, keyed as the single-process model.

    Undoes every sharding of the layout: data parallel's (ZeRO-3 gathers its shards) for now.
    """
    return dp.full_state_dict()
