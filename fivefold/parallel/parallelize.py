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

from dataclasses import dataclass

import torch
import torch.distributed as dist

from fivefold.config import Config
from fivefold.mesh import Mesh
from fivefold.model import Transformer
from fivefold.parallel.data import DataParallel, apply_data_parallel
from fivefold.parallel.pipeline import PipelineExecutor, split_stages, tied_embedding_group
from fivefold.parallel.schedules import build_schedule
from fivefold.validate import derive


@dataclass
class Parallelized:
    model: Transformer  # this rank's part of the model
    dp: DataParallel  # owns the optimizer and the gradient reduction
    pipeline: PipelineExecutor  # runs the step's micro-batches (one stage when pp = 1)
    mesh: Mesh


def parallelize(model: Transformer, mesh: Mesh, cfg: Config) -> Parallelized:
    """Apply every dimension of cfg.parallel to `model` in place."""
    p = cfg.parallel
    schedule = build_schedule(p.pp_schedule, p.pp, derive(cfg, mesh.world_size).grad_accum, p.virtual_stages)
    chunks = split_stages(model, schedule, mesh.rank("pp"))
    if cfg.train.compile:
        # Module.compile() per block keeps parameter names, so checkpoints do not depend on it.
        for block in model.layers.values():
            block.compile()
    tied = None
    if cfg.model.tie_embeddings:
        group = tied_embedding_group(mesh, schedule)  # collective: every rank takes part
        holder = model.tok_embeddings or model.output  # neither on middle stages
        tied = (holder.weight, group) if holder is not None else None
    dp = apply_data_parallel(model, mesh, p, cfg.train)
    device = next(model.parameters()).device
    return Parallelized(model, dp, PipelineExecutor(schedule, chunks, mesh.group("pp"), dp, device, tied), mesh)


def full_state_dict(par: Parallelized) -> dict[str, torch.Tensor]:
    """A plain, unsharded copy of the model's state on every rank, keyed as the single-process model.

    Undoes every sharding of the layout: data parallel's (ZeRO-3 gathers its shards), then the
    pipeline's (each stage contributes its own parameters).
    """
    mine = par.dp.full_state_dict()
    pp = par.mesh.group("pp")
    if pp.size == 1:
        return mine
    parts: list[dict] = [None] * pp.size  # type: ignore[list-item]
    dist.all_gather_object(parts, mine, group=pp.pg)
    return {k: v for part in parts for k, v in part.items()}
