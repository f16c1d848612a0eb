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


# One micro-batch's multi-token-prediction inputs: per depth, this rank's (tokens, targets) k ahead
# (model/mtp.py), each (B, T_local); empty without MTP.
Ahead = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class StageChunk:
    """One stage's slice of this rank's model: the embedding if first, its blocks, the head (with the
    MTP depths) if last."""

    model: Transformer
    layers: list[str]
    first: bool
    last: bool
    loss_chunk: int = 0  # train.loss_chunk: tokens whose logits the loss makes at once (0: all)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The stage input: token ids (B, T) -> embeddings (B, T, dim) on the first stage, else x."""
        return self.model.embed(x) if self.first else x

    def modules(self) -> list[nn.Module]:
        """What this chunk computes with: its blocks, the embedding if first, norm and head if last
        (read now: tensor and expert parallel replace some of these modules)."""
        mods = [self.model.layers[n] for n in self.layers]
        mods += [self.model.tok_embeddings] if self.first or (self.last and self.model.mtp) else []
        return mods + ([self.model.norm, self.model.mtp, self.model.output] if self.last else [])

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, doc: DocumentIds | None = None) -> torch.Tensor:
        """The stage's blocks (and on the last stage the final norm) on its input (B, T, dim): the
        model's own forward over this stage's layers (positions (T,) or (B, T); doc: whole rows' (B, T)
        document ids, model/masks.py). The head is the loss's (`losses`)."""
        return self.model(h, positions, layers=self.layers, embed=False, head=self.last, logits=False, doc=doc)

    def losses(self, h: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor, doc: DocumentIds | None,
               ahead: Ahead) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The last stage's losses of one micro-batch from its final hidden states h (B, T, dim): the
        sum of its token losses, and with MTP the mean over depths of each depth's sum (else None).
        One call of the head for all of them (its tokens side by side along the batch), so ZeRO-3
        gathers it once and its loss's chunks span the depths alike."""
        if not ahead:
            return self.model.output(h, targets, self.loss_chunk).sum(), None
        hs = self.model.predict_ahead(h, [tokens for tokens, _ in ahead], positions, doc)  # D x (B, T, dim)
        every = torch.cat([targets, *(y for _, y in ahead)])  # ((1 + D) B, T)
        losses = self.model.output(torch.cat([h, *hs]), every, self.loss_chunk)  # ((1 + D) B, T)
        main, *depths = losses.chunk(1 + len(ahead))
        return main.sum(), torch.stack([d.sum() for d in depths]).mean()


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


def split_stages(model: Transformer, schedule: Schedule, pp_rank: int, sizes: tuple[int, ...],
                 loss_chunk: int = 0) -> dict[int, StageChunk]:
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
    tok_embeddings = model.tok_embeddings
    if 0 not in mine:
        model.tok_embeddings = None
    if n_stages - 1 not in mine:
        model.norm = model.output = None
        model.mtp = nn.ModuleDict()
    elif 0 not in mine and model.mtp:  # the MTP depths embed on the last stage: a copy kept there, as a tied head's
        model.tok_embeddings = tok_embeddings
    return {s: StageChunk(model, layers[s], s == 0, s == n_stages - 1, loss_chunk) for s in mine}


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
    chunks = split_stages(model, schedule, mesh.rank("pp"), stage_split(cfg, derived.vocab_size), cfg.train.loss_chunk)
    # The embedding's two copies (a tied head's, the MTP depths') on the first and last stage
    shared = cfg.model.tie_embeddings or cfg.model.mtp_layers > 0
    tied = tied_embedding_group(mesh, schedule) if shared else None
    return PipelineStages(schedule, chunks, mesh.group("pp"), tied)
