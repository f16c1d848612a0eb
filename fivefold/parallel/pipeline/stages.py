"""Pipeline stages: which of the model's layers this rank keeps, and the groups they talk on.

`apply_pipeline_parallel()` is the pipeline dimension's entry (the folder's `__init__.py` says what
is sharded and what travels): it builds the schedule, keeps this rank's stage chunks of the model
(deleting the other layers) and names the pp group and, with tied embeddings, the group of the
first and last stage. The executor (executor.py) then runs the schedule's actions over the chunks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import nn

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.masks import DocumentIds
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline.schedules import Schedule, build_schedule
from fivefold.parallel.pipeline.stage_split import stage_split


def stage_layers(sizes: tuple[int, ...]) -> list[list[str]]:
    """Block names of each stage, in model order, from its block count (stage_split.stage_split)."""
    starts = [sum(sizes[:s]) for s in range(len(sizes))]
    return [[str(i) for i in range(start, start + n)] for start, n in zip(starts, sizes, strict=True)]


@dataclass
class StageChunk:
    """One stage's slice of this rank's model: the embedding if first, its blocks, the head if last."""

    model: Transformer
    layers: list[str]
    first: bool
    last: bool

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The stage input: token ids (B, T) -> embeddings (B, T, dim) on the first stage, else x."""
        return self.model.embed(x) if self.first else x

    def modules(self) -> list[nn.Module]:
        """What this chunk computes with: its blocks, the embedding if first, norm and head if last
        (read now: tensor and expert parallel replace some of these modules)."""
        mods = [self.model.layers[n] for n in self.layers]
        mods += [self.model.tok_embeddings] if self.first else []
        return mods + ([self.model.norm, self.model.output] if self.last else [])

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, doc: DocumentIds | None = None) -> torch.Tensor:
        """The stage's blocks (and on the last stage norm and head) on its input (B, T, dim): the
        model's own forward over this stage's layers (positions (T,) or (B, T); doc: whole rows' (B, T)
        document ids, model/masks.py)."""
        return self.model(h, positions, layers=self.layers, embed=False, head=self.last,
                          doc=doc)  # (B, T, dim) or (B, T, V)


def tied_embedding_group(mesh: Mesh, schedule: Schedule) -> AxisGroup:
    """Each rank holding the first stage with its peer holding the last (same dp/cp/tp place).

    With tied embeddings both keep a copy of the matrix: the copies start equal and stay equal
    because each step applies the sum of both gradients to both (the V layout puts the two
    stages on one rank: a group of one, nothing to send).
    """
    grid = mesh.device_mesh.mesh  # (pp, dp_replicate, dp_shard, cp, tp) -> global rank
    first, last = schedule.stage_to_rank(0), schedule.stage_to_rank(schedule.num_stages - 1)
    parts = []
    for place in itertools.product(*(range(n) for n in grid.shape[1:])):
        column = grid[(slice(None), *place)].tolist()  # the pipeline of this place, by pp rank
        ends = sorted({column[first], column[last]})
        parts += [ends] + [[r] for r in column if r not in ends]
    return mesh.subgroups(parts, "pp")


def split_stages(model: Transformer, schedule: Schedule, pp_rank: int, sizes: tuple[int, ...]) -> dict[int, StageChunk]:
    """Keep in `model` only what this rank's stages use (deleting the rest); return its chunks.
    `sizes`: the blocks of each stage (stage_split.stage_split), one entry per schedule stage."""
    n_stages = schedule.num_stages
    if len(sizes) != n_stages or sum(sizes) != len(model.layers):
        raise ValueError(f"stage sizes {list(sizes)} do not split {len(model.layers)} blocks into {n_stages} stages")
    layers = stage_layers(sizes)
    mine = [s for s in range(n_stages) if schedule.stage_to_rank(s) == pp_rank]
    keep = {name for s in mine for name in layers[s]}
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if 0 not in mine:
        model.tok_embeddings = None
    if n_stages - 1 not in mine:
        model.norm = model.output = None
    return {s: StageChunk(model, layers[s], s == 0, s == n_stages - 1) for s in mine}


@dataclass
class PipelineStages:
    """What apply_pipeline_parallel leaves: the schedule, this rank's chunks, and the groups."""

    schedule: Schedule
    chunks: dict[int, StageChunk]  # stage -> chunk, for the stages this rank holds
    group: AxisGroup  # the pp axis
    tied_group: AxisGroup | None = None  # first and last stage's ranks, with tied embeddings

    def reduction_order(self) -> list[int]:
        """This rank's stages in the order of their last backward (B or W) of the step: the order
        their gradients become final, in which data parallel reduces them (parallel/data/buckets.py, "Chunks")."""
        actions = self.schedule.actions[self.group.rank]
        last = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
        return sorted(self.chunks, key=last.__getitem__)

    def reduction_chunks(self) -> list[list[nn.Module]]:
        """The modules of each of this rank's chunks, in reduction order (what data parallel buckets by)."""
        return [self.chunks[s].modules() for s in self.reduction_order()]

    def tied_weight(self) -> nn.Parameter | None:
        """The embedding matrix the first and last stage share, where this rank holds one of them
        (read when the executor is built: after every dimension has replaced what it replaces)."""
        if self.tied_group is None:
            return None
        model = next(iter(self.chunks.values())).model
        holder = model.tok_embeddings or model.output  # neither on middle stages
        return holder.weight if holder is not None else None


def apply_pipeline_parallel(model: Transformer, mesh: Mesh, cfg: Config, derived: Derived) -> PipelineStages:
    """Keep this rank's stages of `model` (deleting the other layers) under the configured schedule.

    The blocks per stage are stage_split()'s, the split the planner and the dry run use too. At pp = 1
    the one stage holds everything and its schedule is gradient accumulation over the
    step's micro-batches. Collective with tied embeddings (the tied group spans the world).
    """
    p = cfg.parallel
    schedule = build_schedule(p.pp_schedule, p.pp, derived.grad_accum, p.virtual_stages)
    chunks = split_stages(model, schedule, mesh.rank("pp"), stage_split(cfg, derived.vocab_size))
    tied = tied_embedding_group(mesh, schedule) if cfg.model.tie_embeddings else None
    return PipelineStages(schedule, chunks, mesh.group("pp"), tied)
