"""Pipeline parallel: layers split into stages; micro-batches flow through a schedule.

What is sharded: the layers, over the `pp` axis. A rank keeps only the blocks of the stages it
owns (one stage, or v chunks for interleaved and V schedules); the first stage also keeps the
embedding, the last the final norm, head and loss. Collectives: point-to-point only. Forward sends
each micro-batch's activation (micro_batch, T, dim) to the next stage; backward sends its
gradient back. Both use asynchronous isend, and a message's tag names its kind, micro-batch and
stage, so the order in which two ranks post them does not matter.

`apply_pipeline_parallel()` keeps this rank's stages of the model; `PipelineExecutor` is the one
executor: it runs, action by action, the per-rank lists that
`schedules.py` builds (and `simulate()` times and draws), so what is planned, drawn and executed
cannot drift apart. Split backward (zero-bubble schedules): "I" computes only the gradient of the
stage input, which the previous stage is waiting for; "W" later computes only the weight
gradients (`split_backward.py`). Data parallel starts reducing on the rank's last backward (B or
W), when every gradient of the step is final.

Memory: once a stage output has been sent, its storage is freed (Megatron-LM's "deallocate
output tensor", Narayanan et al. 2021): the next stage holds the data now, and backward needs
only the output's autograd node and shape, not its values, because a block ends with a residual
add, whose backward saves nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from fivefold.config import Config
from fivefold.mesh import Mesh
from fivefold.model import Transformer, cross_entropy_sum
from fivefold.parallel import comms
from fivefold.parallel.comms import AxisGroup
from fivefold.parallel.ddp import DataParallel
from fivefold.parallel.schedules import Schedule, build_schedule
from fivefold.parallel.split_backward import SplitBackward
from fivefold.validate import Derived


def stage_layers(n_layers: int, n_stages: int, counts: tuple[int, ...] = ()) -> list[list[str]]:
    """Block names of each stage: `counts` blocks each when given (e.g. fewer on the last stage,
    which also computes the head and loss), else balanced by count (validate() checks both)."""
    counts = counts or (n_layers // n_stages,) * n_stages
    starts = [sum(counts[:s]) for s in range(n_stages)]
    return [[str(i) for i in range(start, start + n)] for start, n in zip(starts, counts, strict=True)]


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

    def __call__(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The stage's blocks (and on the last stage norm and head) on its input (B, T, dim): the
        model's own forward over this stage's layers."""
        return self.model(h, positions, layers=self.layers, embed=False, head=self.last)  # (B, T, dim) or (B, T, V)


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


def split_stages(model: Transformer, schedule: Schedule, pp_rank: int,
                 counts: tuple[int, ...] = ()) -> dict[int, StageChunk]:
    """Keep in `model` only what this rank's stages use (deleting the rest); return its chunks."""
    n_stages = schedule.num_stages
    layers = stage_layers(len(model.layers), n_stages, counts)
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

    At pp = 1 the one stage holds everything and its schedule is gradient accumulation over the
    step's micro-batches. Collective with tied embeddings (the tied group spans the world).
    """
    p = cfg.parallel
    schedule = build_schedule(p.pp_schedule, p.pp, derived.grad_accum, p.virtual_stages)
    chunks = split_stages(model, schedule, mesh.rank("pp"), p.stage_layers)
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
    loss: float = 0.0  # this rank's sum of micro-batch losses (last stage only)
    timeline: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, action)
    peak_held_bytes: int = 0  # most bytes of stage inputs and outputs kept for backward at once
    freed_bytes: int = 0  # stage outputs released once sent (their backward needs no values)


def _values_unused(out: torch.Tensor) -> bool:
    """Does backward need `out`'s node only, not its values? True after a residual add (a block's
    last op) or a dtype cast; anything else (a compiled block, say) keeps its storage."""
    return type(out.grad_fn).__name__ in ("AddBackward0", "ToCopyBackward0")


class _Sends:
    """Outstanding sends. When one completes, the stage output it carried (if any) is freed.

    Completion is observed by a helper thread that waits on each send in turn (the wait releases
    the GIL): gloo's Work.is_completed() reports False until someone waits (measured, torch 2.13),
    so polling from the executor would free nothing before the end of the step.
    """

    def __init__(self, stats: PipelineStats):
        self.stats = stats
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None  # started by the first send: pp = 1 sends nothing

    def add(self, pending: comms.Pending, free: torch.Tensor | None) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._drain, daemon=True)
            self.thread.start()
        self.queue.put((pending, free))

    def _drain(self) -> None:
        while (item := self.queue.get()) is not None:
            pending, t = item
            try:
                pending.wait()  # names a failure (comms); counts no exposed time on this thread
            except BaseException as e:  # noqa: BLE001 - re-raised by finish() on the executor's thread
                self.error = self.error or e
                continue
            if t is not None:
                self.stats.freed_bytes += t.untyped_storage().nbytes()
                t.untyped_storage().resize_(0)  # shape and autograd node stay; the values are gone

    def finish(self) -> None:
        """Wait until every send has completed."""
        if self.thread is None:
            return
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error


class PipelineExecutor:
    """Runs one rank's action list of a schedule over its stage chunks.

    after_backward: called after each action that accumulates gradients (B, W), e.g. to sample
    the model state's memory.
    """

    def __init__(self, stages: PipelineStages, dp: DataParallel, device: torch.device, dim: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy_sum,
                 seq_divisor: int = 1, after_backward: Callable[[], None] = lambda: None):
        self.schedule, self.chunks, self.group, self.dp = stages.schedule, stages.chunks, stages.group, dp
        self.loss_fn = loss_fn  # sum of token losses from the last stage's output (vocab-parallel under tp)
        self.seq_divisor = seq_divisor  # activations between stages hold T / seq_divisor tokens (sp)
        self.device = device  # where received activations and gradients are put
        self.after_backward = after_backward
        self.rank = self.group.rank
        self.n_stages = self.schedule.num_stages
        self.has_last_stage = self.n_stages - 1 in self.chunks
        self.dim = dim  # activations between stages are (micro_batch, T / seq_divisor, dim)
        weight = stages.tied_weight()
        self.tied = (weight, stages.tied_group) if weight is not None else None
        actions = self.schedule.actions[self.rank]
        # Data parallel may start reducing on the rank's last backward: every gradient is final then.
        self.last_backward = max(i for i, a in enumerate(actions) if a.kind in ("B", "W"))

    def copies_counted_elsewhere(self) -> list[torch.Tensor]:
        """Gradients another rank holds too (the last stage's tied embedding copy): count them once."""
        if self.tied is None or 0 in self.chunks:
            return []
        return [self.dp.gradient_of(self.tied[0])]

    def _tag(self, kind: int, mb: int, stage: int) -> int:
        return (kind * self.schedule.microbatches + mb) * self.n_stages + stage

    def _send(self, t: torch.Tensor, to_stage: int, key: tuple[int, int, int], local: dict, sends: _Sends,
              free: bool = False) -> None:
        """Send `t` to the rank of `to_stage`; with `free`, release its storage once it has left."""
        if self.schedule.stage_to_rank(to_stage) == self.rank:
            local[key] = t  # both stages live here (V layout): hand over in memory, nothing to free
            return
        t = t.contiguous()
        name = f"send {'activation' if key[0] == 0 else 'gradient'} mb {key[1]} to stage {to_stage}"
        pending = comms.send(t, self.schedule.stage_to_rank(to_stage), self.group, name, self._tag(*key))
        sends.add(pending, t if free else None)

    def _recv(self, shape: torch.Size, dtype: torch.dtype, from_stage: int, key: tuple[int, int, int],
              local: dict) -> torch.Tensor:
        if key in local:
            return local.pop(key)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        # The stage has nothing to do until this arrives: the pipeline bubble. The wait also holds
        # the transfer itself, small on CPU with these activations; on a slow link it is pp time.
        name = f"recv {'activation' if key[0] == 0 else 'gradient'} mb {key[1]} from stage {from_stage}"
        comms.recv(buf, self.schedule.stage_to_rank(from_stage), self.group, name, self._tag(*key), part="bubble")
        return buf

    def _params(self, chunk: StageChunk) -> list[nn.Parameter]:
        mods = [chunk.model.layers[n] for n in chunk.layers]
        mods += [chunk.model.tok_embeddings] if chunk.first else []
        mods += [chunk.model.norm, chunk.model.output] if chunk.last else []
        return [p for m in mods for p in m.parameters() if p.requires_grad]

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, clock=None,
            positions: torch.Tensor | None = None) -> PipelineStats:
        """Run this rank's actions for one step; gradients accumulate as in one process.

        `micro_batches` hold this rank's tokens (B, T_local); `positions` (T_local,) are their
        true positions (context parallel), 0..T_local-1 when not given. Returns this rank's sum of
        micro-batch losses (non-zero on the last stage only), each already divided by the step's
        global token count.
        """
        ACT, GRAD = 0, 1
        slots: dict[tuple[int, int], _Slot] = {}
        local: dict = {}
        stats = PipelineStats()
        sends = _Sends(stats)
        last = self.n_stages - 1
        for index, action in enumerate(self.schedule.actions[self.rank]):
            mb, s, chunk = action.microbatch, action.stage, self.chunks[action.stage]
            x, y = micro_batches[mb]
            shape, final = (x.shape[0], x.shape[1] // self.seq_divisor, self.dim), index == self.last_backward
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            # Inputs first, then the clock: a timeline shows compute, and waiting shows as gaps.
            if action.kind == "F" and s > 0:
                x = self._recv(shape, torch.float32, s - 1, (ACT, mb, s - 1), local).requires_grad_()
            elif action.kind in ("B", "I") and s < last:
                grad = self._recv(shape, torch.float32, s + 1, (GRAD, mb, s + 1), local)
            elif action.kind in ("B", "I"):
                grad = None  # the last stage starts backward from its loss
            began = clock() if clock else 0.0
            with self.group.timer.span("compute", "compute", str(action)):  # minus the collectives inside
                if action.kind == "F":
                    slot = slots.setdefault((mb, s), _Slot())
                    with autocast():
                        slot.inp = chunk.embed(x)  # the received activation, or the first stage's embeddings
                        out = chunk(slot.inp, positions)  # (B, T, dim) ((B, T/tp, dim) with sp), or (B, T, V/tp) logits
                    if s == last:
                        out = self.loss_fn(out, y) / global_tokens  # the loss: backward starts here
                        stats.loss += float(out.detach())
                        out = out * loss_scale
                    else:
                        out = out.float()  # activations travel in fp32 (autocast may have produced bf16)
                        self._send(out.detach(), s + 1, (ACT, mb, s), local, sends, free=_values_unused(out))
                    slot.out = out
                elif action.kind == "B":
                    slot = slots.pop((mb, s))  # this micro-batch's activations on this stage go with it
                    self.dp.backward(slot.out, grad, last_micro_batch=final)
                    self.after_backward()
                    if s > 0:
                        self._send(slot.inp.grad, s - 1, (GRAD, mb, s), local, sends)
                elif action.kind == "I":  # input gradient only; W finishes this backward later
                    slot = slots[(mb, s)]
                    slot.split = SplitBackward(slot.out, slot.inp, self._params(chunk))
                    inp_grad = slot.split.input_grad(grad)
                    if s > 0:
                        self._send(inp_grad, s - 1, (GRAD, mb, s), local, sends)
                else:  # "W": the weight gradients of a split backward
                    slot = slots.pop((mb, s))
                    with self.dp.reducing(last_micro_batch=final):
                        slot.split.weight_grad()
                    self.after_backward()
            if clock:
                stats.timeline.append((began, clock(), str(action)))
            stats.peak_held_bytes = max(stats.peak_held_bytes, _held_bytes(slots))
        # A pipeline of one stage sends nothing: joining the helper thread is no pp time.
        pp = self.group.size > 1
        with self.group.timer.blocked(self.group.label, "sends in flight") if pp else contextlib.nullcontext():
            sends.finish()  # every activation and gradient has left before its buffer is reused
        if self.tied is not None:  # both copies of a tied embedding take the sum of their gradients
            param, group = self.tied
            comms.all_reduce(self.dp.gradient_of(param), group)
        return stats

    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     autocast=contextlib.nullcontext, positions: torch.Tensor | None = None) -> float:
        """Sum of token losses over the micro-batches (last stage only), for evaluation."""
        ACT, total, local, sends = 0, 0.0, {}, _Sends(PipelineStats())
        for mb, (x, y) in enumerate(micro_batches):
            h = x
            if positions is None:
                positions = torch.arange(x.shape[1], device=x.device)
            for s in sorted(self.chunks):  # each micro-batch through the stages in order: no deadlock
                if s > 0:  # from the previous stage: another rank, or this one (then `local` has it)
                    shape = (x.shape[0], x.shape[1] // self.seq_divisor, self.dim)
                    h = self._recv(shape, torch.float32, s - 1, (ACT, mb, s - 1), local)
                with autocast():
                    h = self.chunks[s](self.chunks[s].embed(h), positions)
                if s == self.n_stages - 1:
                    total += float(self.loss_fn(h, y))
                else:
                    h = h.float()
                    self._send(h, s + 1, (ACT, mb, s), local, sends)
        sends.finish()
        return total
