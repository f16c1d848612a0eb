"""Pipeline parallel: layers split into stages; micro-batches flow through a schedule.

What is sharded: the layers, over the `pp` axis. A rank keeps only the blocks of the stages it
owns (one stage, or v chunks for interleaved and V schedules); the first stage also keeps the
embedding, the last the final norm, head and loss; how many blocks each stage holds is
stage_split.py's, the split the planner and the dry run use too. Collectives: point-to-point
only. Forward sends each micro-batch's activation (micro_batch, T, dim) to the next stage;
backward sends its gradient back, both in the compute dtype (`act_dtype`: bf16 under bf16 autocast halves the bytes);
the receiver computes on the fp32 residual stream, as one process does. Each rank posts its
messages in the batches `messages.py` plans from the schedule: between two ranks every message is
sent and received in one order, as NCCL (which ignores tags) requires, and the plan is proven not
to deadlock. Tags (kind, micro-batch, stage) stay, for gloo; correctness does not depend on them.
With a document mask or per-document positions (documents.py) every stage builds them from the
micro-batch's token ids, which each rank holds: nothing more travels.

`apply_pipeline_parallel()` keeps this rank's stages of the model; `PipelineExecutor` is the one
executor: it runs, action by action, the per-rank lists that
`schedules.py` builds (and `simulate()` times and draws), so what is planned, drawn and executed
cannot drift apart. Split backward (zero-bubble schedules): "I" computes only the gradient of the
stage input, which the previous stage is waiting for; "W" later computes only the weight
gradients (`split_backward.py`). Data parallel reduces each chunk's gradients at the chunk's last
backward (B or W) of the step, when they are final.

Memory: once a stage output has been sent, its storage is freed (Megatron-LM's "deallocate
output tensor", Narayanan et al. 2021): the next stage holds the data now, and backward needs
only the output's autograd node and shape, not its values, because a block ends with a residual
add, whose backward saves nothing.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from fivefold.config import Config
from fivefold.documents import Documents
from fivefold.mesh import Mesh
from fivefold.model import Transformer, cross_entropy_sum
from fivefold.parallel import comms
from fivefold.parallel.comms import AxisGroup
from fivefold.parallel.ddp import DataParallel
from fivefold.parallel.messages import Batch, Message, check_plans, forward_schedule, message_plans
from fivefold.parallel.pipeline_p2p import Mailbox, Sends
from fivefold.parallel.schedules import Action, Schedule, build_schedule
from fivefold.parallel.split_backward import SplitBackward
from fivefold.parallel.stage_split import stage_split
from fivefold.validate import Derived


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
        return self.model.tok_embeddings(x) if self.first else x

    def modules(self) -> list[nn.Module]:
        """What this chunk computes with: its blocks, the embedding if first, norm and head if last
        (read now: tensor and expert parallel replace some of these modules)."""
        mods = [self.model.layers[n] for n in self.layers]
        mods += [self.model.tok_embeddings] if self.first else []
        return mods + ([self.model.norm, self.model.output] if self.last else [])

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The stage's blocks (and on the last stage norm and head) on its input (B, T, dim): the
        model's own forward over this stage's layers (positions (T,) or (B, T); mask: documents.py's)."""
        return self.model(h, positions, layers=self.layers, embed=False, head=self.last,
                          mask=mask)  # (B, T, dim) or (B, T, V)


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
        their gradients become final, in which data parallel reduces them (ddp.py, "Chunks")."""
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


@dataclass
class _Slot:
    """What one (micro-batch, stage) keeps between its forward and its backward."""

    inp: torch.Tensor | None = None  # received activation (a leaf collecting its gradient) or embeddings
    out: torch.Tensor | None = None  # the stage output (storage freed once sent), or the loss on the last stage
    split: SplitBackward | None = None  # what I keeps for W


def _held_bytes(slots: dict[tuple[int, int], _Slot]) -> int:
    """Bytes of the stage inputs and outputs that slots keep (each storage once; freed ones are 0)."""
    storages = {}
    for slot in slots.values():
        for t in (slot.inp, slot.out):
            if t is not None:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@dataclass
class PipelineStats:
    loss: float = 0.0  # this rank's sum of micro-batch losses (last stage only), read from the device once
    timeline: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, action)
    peak_held_bytes: int = 0  # most bytes of stage inputs and outputs kept for backward at once
    freed_bytes: int = 0  # stage outputs released once sent (their backward needs no values)


def _attention_inputs(tokens: torch.Tensor, positions: torch.Tensor,
                      documents: Documents | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE positions and attention mask of one micro-batch on any stage. Built from its token ids
    (B, T), which every stage holds (a later stage's input is an activation, but micro_batches keep
    the ids): no message carries a mask. Both options off: the row positions and no mask."""
    return (positions, None) if documents is None else documents.inputs(tokens, positions)


def _values_unused(out: torch.Tensor) -> bool:
    """Does backward need `out`'s node only, not its values? True after a residual add (a block's
    last op) or a dtype cast; anything else (a compiled block, say) keeps its storage."""
    return type(out.grad_fn).__name__ in ("AddBackward0", "ToCopyBackward0")


class PipelineExecutor:
    """Runs one rank's action list of a schedule over its stage chunks.

    act_dtype: the dtype activations and gradients travel in between ranks (the compute dtype:
    `train.precision.compute_dtype`). after_backward: called after the first and the last action
    of each chunk that accumulates gradients (B, W), e.g. to sample the model state's memory.
    """

    def __init__(self, stages: PipelineStages, dp: DataParallel, device: torch.device, dim: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
                 seq_divisor: int = 1, after_backward: Callable[[], None] = lambda: None,
                 act_dtype: torch.dtype = torch.float32):
        self.schedule, self.chunks, self.group, self.dp = stages.schedule, stages.chunks, stages.group, dp
        self.loss_fn = loss_fn  # sum of token losses from the last stage's output (vocab-parallel under tp)
        self.seq_divisor = seq_divisor  # activations between stages hold T / seq_divisor tokens (sp)
        self.device = device  # where received activations and gradients are put
        self.after_backward = after_backward
        self.act_dtype = act_dtype
        # A received activation joins the residual stream in the dtype it has in one process: fp32
        # (the weights are fp32 master weights and autocast casts only inside the matmuls).
        self.hidden_dtype = torch.float32
        self.rank = self.group.rank
        self.n_stages = self.schedule.num_stages
        self.has_last_stage = self.n_stages - 1 in self.chunks
        self.dim = dim  # activations between stages are (micro_batch, T / seq_divisor, dim)
        weight = stages.tied_weight()
        self.tied = (weight, stages.tied_group) if weight is not None else None
        actions = self.schedule.actions[self.rank]
        # Data parallel reduces a chunk's gradients at its last backward (B or W) of the step, when
        # they are final; `chunk_of` names the chunk as data parallel's buckets do (reduction order).
        self.chunk_of = {s: i for i, s in enumerate(stages.reduction_order())}
        self.last_backward = {a.stage: i for i, a in enumerate(actions) if a.kind in ("B", "W")}
        # after_backward (the model-state sample) runs at a chunk's first and last backward only: in
        # between, each backward leaves the same gradient tensors (accumulated, or reduced and freed
        # alike); sampling all of them took 1.6% of a 1F1B step in a cProfile of the pipeline benchmark's model.
        firsts = {a.stage: i for i, a in reversed(list(enumerate(actions))) if a.kind in ("B", "W")}
        self.sampled = {*firsts.values(), *self.last_backward.values()}
        self.forward_plans: dict[int, tuple[Schedule, list[Batch]]] = {}  # micro-batches -> forward_only's

    @functools.cached_property
    def plan(self) -> list[Batch]:
        """What this rank posts before each action, proven to match and complete when the first
        step asks for it, before any message is posted: a schedule whose messages would hang on
        NCCL stops there. A fraction of a second for the largest schedules, paid on first use so
        that building many positions and running none (train/dry_run.py) does not pay it each time."""
        return check_plans(self.schedule)[self.rank]

    def copies_counted_elsewhere(self) -> list[torch.Tensor]:
        """Gradients another rank holds too (the last stage's tied embedding copy): count them once."""
        if self.tied is None or 0 in self.chunks:
            return []
        return [self.dp.gradient_of(self.tied[0])]

    def _tag(self, msg: Message) -> int:
        """Names the message on gloo, which matches by tag; NCCL matches by order (messages.py)."""
        kind = 0 if msg.kind == "activation" else 1
        return (kind * self.schedule.microbatches + msg.microbatch) * self.n_stages + msg.stage

    def _params(self, chunk: StageChunk) -> list[nn.Parameter]:
        return [p for m in chunk.modules() for p in m.parameters() if p.requires_grad]

    def _mailbox(self, schedule: Schedule, plan: list[Batch], micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                 sends: Sends) -> Mailbox:
        """This run's messages; what travels for micro-batch mb is (B, T / seq_divisor, dim)."""
        def shape(mb: int) -> tuple[int, ...]:
            x = micro_batches[mb][0]
            return x.shape[0], x.shape[1] // self.seq_divisor, self.dim
        return Mailbox(schedule, plan, self.group, shape, self.act_dtype, self.device, self._tag, sends)

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, clock=None,
            positions: torch.Tensor | None = None, documents: Documents | None = None) -> PipelineStats:
        """Run this rank's actions for one step; gradients accumulate as in one process.

        `micro_batches` hold this rank's tokens (B, T_local); `positions` (T_local,) are their
        true positions (context parallel), 0..T_local-1 when not given. `documents`: keep packed
        documents apart (document mask, per-document positions), None for plain causal attention.
        Returns this rank's sum of micro-batch losses (non-zero on the last stage only), each
        already divided by the step's global token count.
        """
        slots: dict[tuple[int, int], _Slot] = {}
        stats = PipelineStats()
        sends = Sends()
        mail = self._mailbox(self.schedule, self.plan, micro_batches, sends)
        # Summed on the device, read once at the end: a float() per micro-batch would wait for the
        # device each time. fp64, as the Python float sum it replaces.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        last = self.n_stages - 1
        for index, action in enumerate(self.schedule.actions[self.rank]):
            mb, s, chunk = action.microbatch, action.stage, self.chunks[action.stage]
            x, y = micro_batches[mb]
            final = index == self.last_backward[s]  # this chunk's last backward: its gradients are final
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            mail.post(index)  # what the plan posts here: sends produced so far, receives due by now
            # Inputs first, then the clock: a timeline shows compute, and waiting shows as gaps.
            if action.kind == "F" and s > 0:
                x = mail.take(action).to(self.hidden_dtype).requires_grad_()
            elif action.kind in ("B", "I") and s < last:
                grad = mail.take(action)
            elif action.kind in ("B", "I"):
                grad = None  # the last stage starts backward from its loss
            began = clock() if clock else 0.0
            with self.group.timer.span("compute", "compute", str(action)):  # minus the collectives inside
                if action.kind == "F":
                    slot = slots.setdefault((mb, s), _Slot())
                    pos, mask = _attention_inputs(micro_batches[mb][0], positions, documents)
                    with autocast():
                        slot.inp = chunk.embed(x)  # the received activation, or the first stage's embeddings
                        out = chunk(slot.inp, pos, mask)  # (B, T, dim) ((B, T/tp, dim) with sp), or (B, T, V/tp) logits
                    if s == last:
                        out = self.loss_fn(out, y) / global_tokens  # the loss: backward starts here
                        loss_sum += out.detach()
                        out = out * loss_scale
                    else:
                        if mail.travels(action):  # in the compute dtype (autocast may have left fp32)
                            out = out.to(self.act_dtype)
                        mail.put(action, out.detach(), free=_values_unused(out))
                    slot.out = out
                elif action.kind == "B":
                    slot = slots.pop((mb, s))  # this micro-batch's activations on this stage go with it
                    self.dp.backward(slot.out, grad, last_micro_batch=final, chunk=self.chunk_of[s])
                    if index in self.sampled:
                        self.after_backward()
                    if s > 0:
                        mail.put(action, self._outgoing_grad(action, slot.inp.grad, mail))
                elif action.kind == "I":  # input gradient only; W finishes this backward later
                    slot = slots[(mb, s)]
                    slot.split = SplitBackward(slot.out, slot.inp, self._params(chunk))
                    inp_grad = slot.split.input_grad(grad)
                    if s > 0:
                        mail.put(action, self._outgoing_grad(action, inp_grad, mail))
                else:  # "W": the weight gradients of a split backward
                    slot = slots.pop((mb, s))
                    with self.dp.reducing(last_micro_batch=final, chunk=self.chunk_of[s]):
                        slot.split.weight_grad()
                    if index in self.sampled:
                        self.after_backward()
            if clock:
                stats.timeline.append((began, clock(), str(action)))
            stats.peak_held_bytes = max(stats.peak_held_bytes, _held_bytes(slots))
        mail.post(len(self.plan) - 1)  # what the last actions produced
        # A pipeline of one stage sends nothing: joining the helper thread is no pp time.
        pp = self.group.size > 1
        with self.group.timer.blocked(self.group.label, "sends in flight") if pp else contextlib.nullcontext():
            sends.finish()  # every activation and gradient has left before its buffer is reused
        stats.freed_bytes = sends.freed_bytes
        if self.tied is not None:  # both copies of a tied embedding take the sum of their gradients
            param, group = self.tied
            comms.all_reduce(self.dp.gradient_of(param), group)
        stats.loss = float(loss_sum)
        return stats

    def _outgoing_grad(self, action: Action, grad: torch.Tensor, mail: Mailbox) -> torch.Tensor:
        """The gradient of the stage input, cast to the compute dtype if it goes to another rank."""
        return grad.to(self.act_dtype) if mail.travels(action) else grad

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     autocast=contextlib.nullcontext, positions: torch.Tensor | None = None,
                     documents: Documents | None = None) -> float:
        """Sum of token losses over the micro-batches (last stage only), for evaluation."""
        m = len(micro_batches)
        if m not in self.forward_plans:  # each micro-batch through the stages in order
            schedule, ends = forward_schedule(self.schedule, m)
            self.forward_plans[m] = schedule, check_plans(schedule, message_plans(schedule, ends))[self.rank]
        schedule, plan = self.forward_plans[m]
        sends = Sends()
        mail = self._mailbox(schedule, plan, micro_batches, sends)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, at the end
        for index, action in enumerate(schedule.actions[self.rank]):
            mb, s = action.microbatch, action.stage
            x, y = micro_batches[mb]
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            mail.post(index)
            h = mail.take(action).to(self.hidden_dtype) if s > 0 else x
            pos, mask = _attention_inputs(x, positions, documents)
            with autocast():
                h = self.chunks[s](self.chunks[s].embed(h), pos, mask)
            if s == self.n_stages - 1:
                total += self.loss_fn(h, y)
            else:
                mail.put(action, h.to(self.act_dtype) if mail.travels(action) else h)
        mail.post(len(plan) - 1)
        sends.finish()
        return float(total)
