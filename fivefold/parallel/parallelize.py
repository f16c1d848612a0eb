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
from fivefold.parallel.comms import AxisGroup
from fivefold.parallel.context import ContextParallel, apply_context_parallel
from fivefold.parallel.data import DataParallel, apply_data_parallel
from fivefold.parallel.expert import ExpertGroups, apply_expert_parallel, is_expert_parameter
from fivefold.parallel.pipeline import PipelineExecutor, split_stages, tied_embedding_group
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.schedules import build_schedule
from fivefold.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from fivefold.validate import derive, tokenizer_vocab


@dataclass
class Parallelized:
    model: Transformer  # this rank's part of the model
    dp: DataParallel  # owns the optimizer and the gradient reduction
    pipeline: PipelineExecutor  # runs the step's micro-batches (one stage when pp = 1)
    cp: ContextParallel  # which tokens of each sequence this rank holds, and their positions
    experts: ExpertGroups  # expert parallel's groups (of size 1 without it)
    mesh: Mesh

    def local_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                            device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's tokens of each (ids, targets) micro-batch (B, T) -> (B, T/cp), on `device`.
        Targets were shifted on the whole sequence, so each token keeps its true next token."""
        return [(self.cp.shard(x).to(device), self.cp.shard(y).to(device)) for x, y in micro_batches]

    def positions(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """True positions (T/cp,) of this rank's tokens, for RoPE."""
        return self.cp.positions(seq_len, device)

    def gradient_split_groups(self) -> list[AxisGroup]:
        """Groups over which this rank's gradients are parts of the whole (for norms and overflow checks)."""
        return [*self.dp.norm_groups, self.mesh.group("pp"), self.mesh.group("tp")]

    def expert_gradients(self) -> tuple[list[torch.Tensor], AxisGroup]:
        """Gradients of the experts this rank holds, and the ep group that holds the other experts."""
        grads = [self.dp.gradient_of(p) for p in self.dp.params if is_expert_parameter(p)]
        return [g for g in grads if g is not None], self.experts.ep

    def gradients_counted_elsewhere(self) -> list[torch.Tensor]:
        """Gradients another rank of those groups holds too, so a norm counts them once: the last
        stage's tied embedding, and tp-replicated weights (norms) on tp ranks other than 0."""
        out = self.pipeline.copies_counted_elsewhere()
        if self.mesh.rank("tp") > 0:
            out += [self.dp.gradient_of(p) for p in self.dp.params if not hasattr(p, "tp_dim")]
        return out


def parallelize(model: Transformer, mesh: Mesh, cfg: Config) -> Parallelized:
    """Apply every dimension of cfg.parallel to `model` in place."""
    p = cfg.parallel
    schedule = build_schedule(p.pp_schedule, p.pp, derive(cfg, mesh.world_size).grad_accum, p.virtual_stages)
    chunks = split_stages(model, schedule, mesh.rank("pp"), p.stage_layers)
    apply_tensor_parallel(model, mesh, p.sp)
    experts = apply_expert_parallel(model, mesh, p.ep)  # collective: builds the expert groups
    cp = apply_context_parallel(model, mesh.group("cp"), p.cp_method)
    tp = mesh.group("tp")
    real_vocab = tokenizer_vocab(cfg) if not cfg.model.vocab_size else cfg.model.vocab_size
    apply_recompute(model, cfg.train.recompute)
    if cfg.train.compile:
        # Module.compile() per block keeps parameter names, so checkpoints do not depend on it.
        for block in model.layers.values():
            block.compile()
    tied = None
    if cfg.model.tie_embeddings:
        group = tied_embedding_group(mesh, schedule)  # collective: every rank takes part
        holder = model.tok_embeddings or model.output  # neither on middle stages
        tied = (holder.weight, group) if holder is not None else None
    dp = apply_data_parallel(model, mesh, p, cfg.train, experts)
    device = next(model.parameters()).device
    pipeline = PipelineExecutor(schedule, chunks, mesh.group("pp"), dp, device, tied,
                                loss_fn=lambda logits, y: vocab_parallel_cross_entropy(logits, y, tp, real_vocab),
                                seq_divisor=tp.size if p.sp else 1)
    return Parallelized(model, dp, pipeline, cp, experts, mesh)


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
