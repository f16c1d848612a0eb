"""THE composition order: how one model becomes this rank's part of a parallel layout.

    split into pipeline stages (keep this rank's layers)
      -> tensor parallel -> FP8 (train.fp8: on the layers as tp split them) -> expert parallel
      -> context parallel
      -> activation checkpointing / compile
      -> data parallel / ZeRO / FSDP (last: it wraps whatever parameters the others left)
      -> offload (parallel.offload: the optimizer steps host copies of ZeRO's shards, or with "params"
         ZeRO-3's shards live on the host and come up for each gather)

Each step is one `apply_<dim>(model, mesh, cfg, derived)` that changes the model in place, returns
what the rest of the step needs from that dimension, and is a no-op at size 1. Data parallel comes
last because it reduces (or shards) the parameters as the earlier steps left them: after TP a
rank's weights are slices, after PP only its stage's layers remain.

The result, `Parallelized`, is what the training step talks to: the pipeline executor runs
forward and backward over the micro-batches, and `optimizer_step()` unscales, clips and applies
the gradients wherever they live.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.masks import Documents, document_ids
from fivefold.model.mtp import shift_ahead
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.context import ContextParallel, apply_context_parallel
from fivefold.parallel.data import DataParallel, apply_data_parallel
from fivefold.parallel.data.offload import HostOffload, ParamOffload, apply_offload
from fivefold.parallel.expert import ExpertParallel, apply_expert_parallel
from fivefold.parallel.fp8 import apply_fp8
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.optimizer import clip_grad_norm, fused_on, init_optimizer_state, layout_optimizer, set_lr
from fivefold.parallel.pipeline.executor import AttentionInputs, PipelineExecutor
from fivefold.parallel.pipeline.stages import Ahead, apply_pipeline_parallel
from fivefold.parallel.qk_clip import QKClip
from fivefold.parallel.recompute import apply_recompute
from fivefold.parallel.state_dict import is_expert_parameter
from fivefold.parallel.state_memory import ModelStateMeter, frozen_shards
from fivefold.parallel.tensor import apply_tensor_parallel


class LossScale(Protocol):
    """What optimizer_step needs of a loss scaler (train/precision.py's LossScaler)."""

    scale: float

    def unscale(self, grads: list[torch.Tensor], groups: list[AxisGroup],
                device: torch.device | None = None) -> bool: ...
    def update(self, finite: bool) -> None: ...


@dataclass(frozen=True)
class StepOutcome:
    """What an optimizer step leaves on the device, for the training step to read once with its loss."""

    grad_norm: torch.Tensor  # () float64: global L2 norm of the summed gradient before clipping (inf: fp16 overflow)
    applied: torch.Tensor  # () bool: the optimizer stepped; False: the step was skipped, nothing changed
    overflow: bool  # skipped because fp16's scaled gradients overflowed (the scale halves)
    # The gradients the norm was taken over, by parameter name: a non-finite norm names its culprits
    # from them once it has been read (nonfinite_parameters), after the gradients were let go.
    named_gradients: list[tuple[str, torch.Tensor]] = field(default_factory=list)


@dataclass
class Parallelized:
    model: Transformer  # this rank's part of the model
    mesh: Mesh
    pipeline: PipelineExecutor  # runs the step's micro-batches (one stage when pp = 1)
    dp: DataParallel  # reduces (ZeRO: shards) the gradients
    cp: ContextParallel  # which tokens of each sequence this rank holds, and their positions
    experts: ExpertParallel  # the group experts are split over (of size 1 without ep); sp's MoE gradient sum
    optimizer: torch.optim.Optimizer  # AdamW (or Muon with AdamW) over dp.optimizer_params()
    memory: ModelStateMeter  # this rank's model-state bytes, sampled after each chunk's first and last backward
    offload: HostOffload | ParamOffload | None = None  # parallel.offload: the optimizer steps host tensors
    qk_clip: QKClip | None = None  # optim.qk_clip: heads rescaled after each step

    def local_micro_batches(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                            device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's tokens of each (ids, targets) micro-batch (B, T) -> (B, T/cp), on `device`.
        Targets were shifted on the whole sequence, so each token keeps its true next token."""
        return [(self.cp.shard(x).to(device), self.cp.shard(y).to(device)) for x, y in micro_batches]

    def attention_inputs(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], documents: Documents | None,
                         device: torch.device) -> list[AttentionInputs]:
        """Each whole-row micro-batch's attention inputs, before context parallel splits the rows:
        the RoPE positions of this rank's tokens ((T/cp,), or (B, T/cp) restarting at each document)
        and the (B, T) document ids of the whole rows (data.document_mask), else None. Positions
        restart per document on the whole row, then this rank takes its part of them."""
        seq_len = micro_batches[0][0].shape[1]
        if documents is None:
            return [(self.cp.positions(seq_len, device), None)] * len(micro_batches)
        inputs = [documents.on_device(x, device) for x, _ in micro_batches]  # from the loader's host ids
        return [(self.cp.shard(pos, dim=-1), doc) for pos, doc in inputs]

    def ahead_inputs(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], depths: int,
                     documents: Documents | None, device: torch.device) -> list[Ahead] | None:
        """Each whole-row micro-batch's MTP tokens and targets of every depth (model/mtp.py), shifted
        on the whole rows (within documents under data.document_mask), then this rank's part of
        them, on `device`; None without MTP."""
        if not depths:
            return None
        masked = documents is not None and documents.mask
        return [[(self.cp.shard(t).to(device), self.cp.shard(u).to(device))
                 for t, u in shift_ahead(x, y, depths, document_ids(x, documents.eod) if masked else None)]
                for x, y in micro_batches]

    # ---- the optimizer step ---------------------------------------------------------------------
    def optimizer_step(self, lr: float, scaler: LossScale, grad_clip: float) -> StepOutcome:
        """Unscale (fp16), clip to the global norm, step, and let data parallel follow up (ZeRO's
        gather). A non-finite gradient skips the step on every rank alike (every rank sees the same
        global norm); the caller reads the norm and decides whether to stop (nonfinite_parameters
        names the culprits). Collective: the norm and the overflow check reduce over the groups the
        gradients are split across.

        Host reads: none with fused AdamW (CUDA), which skips a non-finite step on the device
        (`found_inf`); elsewhere, and with fp16's loss scaling, the norm is read here to decide
        (on a CPU that waits for nothing)."""
        set_lr(self.optimizer, lr)
        device = self.pipeline.device  # where the collectives run: offload = "params" keeps gradients on the host
        if self.offload is not None:
            self.offload.grads_ready()  # "params": the gradient shards' copies down are complete
        self.experts.sum_partial_gradients(self.dp.params, self.dp.gradient_of, device)  # sp: MoE shares over tp
        both = [self.mesh.group("pp"), self.mesh.group("tp")]  # what dense and expert gradients are split over
        # Expert gradients (ep > 1) are split over ep, and with ZeRO their shards over expert_dp.
        expert_groups = [*self.dp.expert_norm_groups, self.experts.group] if self.experts.group.size > 1 else []
        # The verdict travels over every group any gradient is split over, so every rank agrees.
        if not scaler.unscale(self.dp.gradients(), [*expert_groups, *self.dp.norm_groups, *both], device):
            self._skip()  # fp16 overflow: the scale halves
            scaler.update(False)
            inf = torch.full((), math.inf, dtype=torch.float64, device=device)
            return StepOutcome(inf, torch.zeros((), dtype=torch.bool, device=inf.device), overflow=True)
        named = [(name, g) for name, p in self.model.named_parameters()
                 if p.requires_grad and (g := self.dp.gradient_of(p)) is not None]  # LoRA's frozen base has none
        grad_norm = clip_grad_norm(self.dp.gradients(), grad_clip, both, self._counted_elsewhere(),
                                   (self._expert_gradients(), expert_groups, self.dp.norm_groups), device)
        finite = torch.isfinite(grad_norm)
        # offload: the host's AdamW is foreach, and the host must read the norm anyway before it steps
        if fused_on(grad_norm.device) and not scaler.enabled and self.offload is None:  # decided on the device
            self.optimizer.found_inf = (~finite).float()  # fused AdamW leaves everything as it was when 1
            self.optimizer.step()
            self._clip_heads()
            self.optimizer.zero_grad(set_to_none=True)
            self.dp.after_step()
            return StepOutcome(grad_norm, finite, overflow=False, named_gradients=named)
        applied = math.isfinite(float(grad_norm))  # the host decides: the norm's read
        if applied:
            if self.offload is not None:
                self.offload.to_host()  # "optimizer": the clipped gradient shards down, waited for
            self.optimizer.step()
            self._clip_heads()  # on the tensors it stepped (offload: the host's, copied up next)
            if self.offload is not None:
                self.offload.to_device()  # "optimizer": the updated shards up, before data parallel gathers them
            self._zero_grad()
            self.dp.after_step()
        else:
            self._skip()
        scaler.update(applied)
        return StepOutcome(grad_norm, finite, overflow=False, named_gradients=named)

    def _skip(self) -> None:
        self._zero_grad()  # drop this step's gradients: nothing is applied
        if self.qk_clip is not None:
            self.qk_clip.reset()

    def _clip_heads(self) -> None:
        if self.qk_clip is not None:
            self.qk_clip.clip()

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self.offload is not None:  # the optimizer steps the host copies: the device's shards hold gradients too
            self.offload.zero_grad()

    def _expert_gradients(self) -> list[torch.Tensor]:
        """Gradients of the experts this rank holds (the ep group holds the other experts)."""
        grads = [self.dp.gradient_of(p) for p in self.dp.params if is_expert_parameter(p)]
        return [g for g in grads if g is not None]

    def _counted_elsewhere(self) -> list[torch.Tensor]:
        """Gradients another rank of those groups holds too, so a norm counts them once: the last
        stage's tied embedding, and tp-replicated weights (norms) on tp ranks other than 0."""
        out = self.pipeline.copies_counted_elsewhere()
        if self.mesh.rank("tp") > 0:
            out += [self.dp.gradient_of(p) for p in self.dp.params if not hasattr(p, "tp_dim")]
        return out

    def nonfinite_parameters(self, outcome: StepOutcome) -> list[str]:
        """Which gradients of a step were NaN/Inf, gathered from every rank (they hold different parts).
        Collective over the world; for the error after a non-finite norm was read."""
        local = [name for name, g in outcome.named_gradients if not torch.isfinite(g).all()]
        found = collectives.all_gather_object(local, self.mesh.group("world"), "gather of the non-finite gradients")
        return [f"{n} (rank {r})" for r, part in enumerate(found) for n in part]

    # ---- state: checkpoints and tests -----------------------------------------------------------
    def model_state_dict(self) -> dict:
        return self.dp.model_state_dict()

    def load_model_state_dict(self, state: dict) -> None:
        self.dp.load_model_state_dict(state)
        if self.offload is not None:  # the device's shards were refilled: the host masters follow
            self.offload.pull_masters()

    def optim_state_dict(self) -> dict:
        """Every moment of every tensor the optimizer steps (created now if no step has yet: a
        checkpoint being loaded needs them as its targets)."""
        init_optimizer_state(self.optimizer)
        return self.dp.optim_state_dict(self.optimizer)

    def load_optim_state_dict(self, state: dict) -> None:
        self.dp.load_optim_state_dict(self.optimizer, state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """A plain, unsharded copy of the model's state on every rank, keyed as the single-process model.

        Undoes every sharding of the layout: data parallel's (ZeRO-3 gathers its shards), then the
        pipeline's (each stage contributes its own parameters).
        """
        mine = self.dp.full_state_dict()
        parts = collectives.all_gather_object(mine, self.mesh.group("pp"), "gather of the full state dict")
        return {k: v for part in parts for k, v in part.items()}


def compile_blocks(model: Transformer, **options: object) -> None:
    """torch.compile each transformer block's forward (`train.compile`); `options` go to
    torch.compile (tests pass a backend that needs no C++ compiler).

    The forward, not the module's `__call__` as Module.compile() would: module hooks then run
    outside the compiled code, eagerly and without a graph break. Those are ZeRO-3's gather before a
    unit's forward and its free after it (data/fsdp.py): collectives and storage resizes dynamo cannot
    trace. Tensor parallel's region hooks run inside a block, on its attention and MLP; they and every
    collective are excluded from tracing where they are defined (comm/regions.py, comm/collectives.py),
    so each is one graph break (tests/parallel/test_compile.py counts them). Parameter names stay the
    plain model's, so checkpoints do not depend on compile. Zero-bubble schedules that split a later
    stage's backward are refused with compile (validate.py): a compiled block's backward is one node."""
    for block in model.blocks():
        block.forward = torch.compile(block.forward, **options)


def parallelize(model: Transformer, mesh: Mesh, cfg: Config, derived: Derived) -> Parallelized:
    """Apply every dimension of cfg.parallel to `model` in place, in the composition order."""
    stages = apply_pipeline_parallel(model, mesh, cfg, derived)
    tp = apply_tensor_parallel(model, mesh, cfg, derived)
    apply_fp8(model, mesh, cfg)  # on the layers as tp split them: it reduces each amax over the splits
    experts = apply_expert_parallel(model, mesh, cfg, derived)
    cp = apply_context_parallel(model, mesh, cfg, derived)
    apply_recompute(model, mesh, cfg, derived)
    if cfg.train.compile:
        compile_blocks(model)
    dp = apply_data_parallel(model, mesh, cfg, derived, chunks=stages.reduction_chunks())
    offload = apply_offload(dp, cfg)  # with it dp.optimizer_params() are host copies of the shards
    optimizer = layout_optimizer(dp, mesh, cfg.optim)  # its state comes with its first step
    # LoRA's frozen base too (under ZeRO-3: the shards that are its only copy)
    memory = ModelStateMeter([*model.parameters(), *frozen_shards(dp, model.parameters())], optimizer, offload)
    device = next(model.parameters()).device
    pipeline = PipelineExecutor(stages, dp, device, cfg.model.dim, seq_divisor=tp.seq_divisor,
                                after_backward=memory.sample, lanes=mesh.lanes, mtp_weight=cfg.train.mtp_weight)
    qk_clip = QKClip(model, dp, mesh, cfg.optim.qk_clip) if cfg.optim.qk_clip else None
    return Parallelized(model, mesh, pipeline, dp, cp, experts, optimizer, memory, offload, qk_clip)
