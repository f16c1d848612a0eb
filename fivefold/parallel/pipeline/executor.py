"""The pipeline executor: one rank's action list of a schedule, run over its stage chunks.

`schedules.py` builds, per rank, a list of actions (F, B, and for zero-bubble schedules I and W);
`simulate()` times and draws the same lists, and `messages.py` plans which sends and receives a
rank posts before each action (`p2p.py` posts them). `PipelineExecutor` runs the list: every action
kind reads alone below, and the data parallel part (`parallel/data/`) reduces a chunk's gradients
at its last backward of the step. See `__init__.py` for what is sharded and what travels.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from fivefold.model.masks import DocumentIds
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.lanes import Lanes
from fivefold.parallel.data import DataParallel
from fivefold.parallel.pipeline.messages import Batch, Message, check_plans, forward_schedule, message_plans
from fivefold.parallel.pipeline.overlap import chunk_streams, on_stream, paired_plans, run_pair
from fivefold.parallel.pipeline.p2p import Mailbox, Sends, sends_for
from fivefold.parallel.pipeline.schedules import Action, Schedule
from fivefold.parallel.pipeline.split_backward import SplitBackward
from fivefold.parallel.pipeline.stages import Ahead, PipelineStages, StageChunk


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
    loss: torch.Tensor | None = None  # () float64 on the device: this rank's sum of micro-batch losses (last stage)
    mtp_loss: torch.Tensor | None = None  # the same of the MTP depths' mean loss (model.mtp_layers > 0), else None
    timeline: list[tuple[Any, Any, str]] = field(default_factory=list)  # (start, end, action): marks of `clock`
    peak_held_bytes: int = 0  # most bytes of stage inputs and outputs kept for backward at once
    freed_bytes: int = 0  # stage outputs released once sent (their backward needs no values)


# One micro-batch's attention inputs, the same on every stage (built by the step from the token ids
# of whole rows, which every stage holds: no message carries them): the RoPE positions of this
# rank's tokens, (T_local,) or (B, T_local), and the (B, T) document ids of whole rows or None.
AttentionInputs = tuple[torch.Tensor, DocumentIds | None]


def _plain_inputs(micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[AttentionInputs]:
    """Positions 0..T_local-1 and no documents, for every micro-batch."""
    x = micro_batches[0][0]
    return [(torch.arange(x.shape[1], device=x.device), None)] * len(micro_batches)


def _values_unused(out: torch.Tensor) -> bool:
    """Does backward need `out`'s node only, not its values? True after a residual add (a block's
    last op) or a dtype cast; anything else (a compiled block, say) keeps its storage."""
    return type(out.grad_fn).__name__ in ("AddBackward0", "ToCopyBackward0")


def travel_dtype(autocast: Callable[[], contextlib.AbstractContextManager], device: torch.device) -> torch.dtype:
    """The dtype activations and gradients travel in between ranks: the compute dtype, i.e. the one
    `autocast` casts matmuls to on `device` (bf16 halves the pipeline's bytes), fp32 without one."""
    if not torch.amp.is_autocast_available(device.type):  # the dry run's meta device computes nothing
        return torch.float32
    with autocast():
        return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else torch.float32


@dataclass
class _Step:
    """What one call of `PipelineExecutor.run` carries from action to action."""

    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # this rank's (ids, targets), (B, T_local) each
    attention: list[AttentionInputs]  # per micro-batch: positions and document ids
    autocast: Callable[[], contextlib.AbstractContextManager]
    global_tokens: int  # every loss is divided by the step's global token count
    loss_scale: float
    act_dtype: torch.dtype  # what travels between ranks (travel_dtype)
    mail: Mailbox
    sends: Sends
    slots: dict[tuple[int, int], _Slot] = field(default_factory=dict)  # (micro-batch, stage) -> forward's leftovers
    ahead: list[Ahead] | None = None  # per micro-batch: the MTP depths' tokens and targets, or None without MTP
    loss_sum: torch.Tensor | None = None  # on the device, read once at the end: a read per micro-batch would wait
    mtp_sum: torch.Tensor | None = None
    stats: PipelineStats = field(default_factory=PipelineStats)


class PipelineExecutor:
    """Runs one rank's action list of a schedule over its stage chunks.

    An interpreter: before action i it posts batch i of the message plan (sends produced so far,
    receives due by now), takes the action's input from a neighbouring stage, and runs the method
    of the action's kind: `_forward` (F), `_backward` (B), and for zero-bubble schedules
    `_backward_input` (I) and `_backward_weights` (W). after_backward: called after the first and
    the last action of each chunk that accumulates gradients (B, W), e.g. to sample the model
    state's memory. With `lanes` (parallel.ep_overlap under dualpipe_v) the F right before a B of the
    other chunk runs with it as one overlapped pair (`_pair`, pipeline/overlap.py).
    """

    def __init__(self, stages: PipelineStages, dp: DataParallel, device: torch.device, dim: int,
                 seq_divisor: int = 1, after_backward: Callable[[], None] = lambda: None,
                 lanes: Lanes | None = None, mtp_weight: float = 0.0):
        self.schedule, self.chunks, self.group, self.dp = stages.schedule, stages.chunks, stages.group, dp
        self.mtp_weight = mtp_weight  # train.mtp_weight: the MTP depths' mean loss joins the main loss times this
        self.seq_divisor = seq_divisor  # activations between stages hold T / seq_divisor tokens (sp)
        self.device = device  # where received activations and gradients are put
        self.after_backward = after_backward
        # A received activation joins the residual stream in the dtype it has in one process: fp32
        # (the weights are fp32 master weights and autocast casts only inside the matmuls).
        self.hidden_dtype = torch.float32
        self.rank = self.group.rank
        self.n_stages = self.schedule.num_stages
        self.has_last_stage = self.n_stages - 1 in self.chunks
        self.dim = dim  # activations between stages are (micro_batch, T / seq_divisor, dim)
        weight = stages.tied_weight()
        # a frozen one (LoRA's base) has no gradient to sum
        self.tied = (weight, stages.tied_group) if weight is not None and weight.requires_grad else None
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
        self.lanes = lanes  # the side lane of DualPipe's pairs, or None: every action alone
        self.streams = chunk_streams(device, list(self.chunks)) if lanes else dict.fromkeys(self.chunks)
        self.act = {"F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weights}

    @functools.cached_property
    def plan(self) -> list[Batch]:
        """What this rank posts before each action, proven to match and complete when the first
        step asks for it, before any message is posted: a schedule whose messages would hang on
        NCCL stops there. A fraction of a second for the largest schedules, paid on first use so
        that building many positions and running none (train/dry_run.py) does not pay it each time.
        With lanes, the plan that runs the pairs (overlap.paired_plans)."""
        return self._paired[1] if self.lanes else check_plans(self.schedule)[self.rank]

    @functools.cached_property
    def _paired(self) -> tuple[set[int], list[Batch]]:
        """This rank's pairs (positions of their F's) and its plan of the paired schedule."""
        pairs, plans = paired_plans(self.schedule)
        return pairs[self.rank], plans[self.rank]

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
                 sends: Sends, dtype: torch.dtype) -> Mailbox:
        """This run's messages; what travels for micro-batch mb is (B, T / seq_divisor, dim) in `dtype`."""
        def shape(mb: int) -> tuple[int, ...]:
            x = micro_batches[mb][0]
            return x.shape[0], x.shape[1] // self.seq_divisor, self.dim
        return Mailbox(schedule, plan, self.group, shape, dtype, self.device, self._tag, sends)

    # ---- one step -------------------------------------------------------------------------------
    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], global_tokens: int,
            loss_scale: float = 1.0, autocast=contextlib.nullcontext, clock=None,
            attention: list[AttentionInputs] | None = None, ahead: list[Ahead] | None = None) -> PipelineStats:
        """Run this rank's actions for one step; gradients accumulate as in one process.

        `micro_batches` hold this rank's tokens (B, T_local); `attention` each one's positions and
        document ids (AttentionInputs: Parallel.attention_inputs builds them), when not given
        positions 0..T_local-1 and no documents; `ahead` each one's MTP inputs (Parallel.ahead_inputs).
        Returns this rank's sum of micro-batch losses (non-zero on the last stage only), each
        already divided by the step's global token count, and the MTP depths' likewise.
        """
        sends, act_dtype = sends_for(self.device), travel_dtype(autocast, self.device)
        zero = torch.zeros((), dtype=torch.float64, device=self.device)  # fp64, as a Python sum
        step = _Step(micro_batches, attention or _plain_inputs(micro_batches), autocast, global_tokens, loss_scale,
                     act_dtype, self._mailbox(self.schedule, self.plan, micro_batches, sends, act_dtype), sends,
                     ahead=ahead, loss_sum=zero, mtp_sum=zero.clone() if ahead else None)
        actions, pairs = self.schedule.actions[self.rank], self._paired[0] if self.lanes else set()
        index = 0
        while index < len(actions):
            action = actions[index]
            if index in pairs:
                self._pair(step, index, action, actions[index + 1], clock)
                index += 2
                continue
            step.mail.post(index)  # what the plan posts here: sends produced so far, receives due by now
            received = self._receive(step, action)  # inputs first, then the clock: waiting shows as gaps
            began = clock() if clock else 0.0
            on_chunk = on_stream(self.streams[action.stage], received)  # records the input on the chunk's stream
            with self.group.timer.span("compute", "compute", str(action)), on_chunk:
                self.act[action.kind](step, index, action, received)  # minus the collectives inside
            self._record(step, began, str(action), clock)
            index += 1
        return self._finish(step)

    def _pair(self, step: _Step, index: int, f: Action, b: Action, clock) -> None:
        """DualPipe's F&B (pipeline/overlap.py): the F at `index` on the side lane, the B after it on
        this thread, at once; one action of the timeline, "F<mb>s<stage>&B<mb>s<stage>"."""
        step.mail.post(index)  # both halves' inputs (paired_plans moved the B's here)
        f_in, b_in = self._receive(step, f), self._receive(step, b)
        step.mail.post(index + 1)  # empty: only the polling of sends done
        began, name = clock() if clock else 0.0, f"{f}&{b}"

        def forward() -> None:
            with on_stream(self.streams[f.stage], f_in):
                self._forward(step, index, f, f_in)

        def backward() -> None:
            with on_stream(self.streams[b.stage], b_in):
                self._backward(step, index + 1, b, b_in)

        with self.group.timer.span("compute", "compute", name):
            run_pair(forward, backward, self.lanes, self.group.timer, name)
        self._record(step, began, name, clock)

    def _record(self, step: _Step, began: Any, name: str, clock) -> None:
        """After an action (or a pair): its span on the timeline, and the bytes the slots hold now."""
        if clock:  # marks of the step timer's clock (CUDA: events), read as times after the step
            step.stats.timeline.append((began, clock(), name))
        step.stats.peak_held_bytes = max(step.stats.peak_held_bytes, _held_bytes(step.slots))

    def _receive(self, step: _Step, action: Action) -> torch.Tensor | None:
        """What `action` needs from a neighbouring stage: F of a later stage its input activation (a
        leaf that collects the gradient to send back), B and I of an earlier stage the gradient of
        their output. None where the action starts from this rank's own data (the first stage's
        tokens, the last stage's loss; a W takes nothing)."""
        if action.kind == "F" and action.stage > 0:
            return step.mail.take(action).to(self.hidden_dtype).requires_grad_()
        if action.kind in ("B", "I") and action.stage < self.n_stages - 1:
            return step.mail.take(action)
        return None

    def _forward(self, step: _Step, index: int, action: Action, received: torch.Tensor | None) -> None:
        """F: the chunk's forward of one micro-batch; its output goes to the next stage (storage freed
        once sent), or on the last stage becomes the loss that backward starts from."""
        mb, s, chunk = action.microbatch, action.stage, self.chunks[action.stage]
        tokens, targets = step.micro_batches[mb]
        slot = step.slots.setdefault((mb, s), _Slot())
        pos, doc = step.attention[mb]
        with step.autocast():
            slot.inp = chunk.embed(tokens if received is None else received)  # received, or the embeddings
            out = chunk(slot.inp, pos, doc)  # (B, T, dim) ((B, T/tp, dim) with sp)
            if s == self.n_stages - 1:  # the head, its loss (and the MTP depths'), in the compute dtype
                loss, mtp = chunk.losses(out, targets, pos, doc, step.ahead[mb] if step.ahead else [])
        if s == self.n_stages - 1:
            out = loss / step.global_tokens  # the loss: backward starts here
            step.loss_sum += out.detach()
            if mtp is not None:  # L = L_main + lambda mean_k L_k (DeepSeek-V3 eq. 25), each per trained token
                step.mtp_sum += mtp.detach() / step.global_tokens
                out = out + self.mtp_weight * mtp / step.global_tokens
            out = out * step.loss_scale
        else:
            if step.mail.travels(action):  # in the compute dtype (autocast may have left fp32)
                out = out.to(step.act_dtype)
            step.mail.put(action, out.detach(), free=_values_unused(out))
        slot.out = out

    def _backward(self, step: _Step, index: int, action: Action, received: torch.Tensor | None) -> None:
        """B: the whole backward of one micro-batch's chunk; data parallel reduces the chunk's
        gradients as they complete when this is its last backward of the step."""
        slot = step.slots.pop((action.microbatch, action.stage))  # its activations on this stage go with it
        self.dp.backward(slot.out, received, last_micro_batch=index == self.last_backward[action.stage],
                         chunk=self.chunk_of[action.stage])
        if index in self.sampled:
            self.after_backward()
        if action.stage > 0:
            self._send_input_grad(step, action, slot.inp.grad)

    def _backward_input(self, step: _Step, index: int, action: Action, received: torch.Tensor | None) -> None:
        """I: only the gradient of the stage input, which the previous stage waits for; W finishes
        this backward later (split_backward.py)."""
        slot = step.slots[(action.microbatch, action.stage)]
        slot.split = SplitBackward(slot.out, slot.inp, self._params(self.chunks[action.stage]))
        input_grad = slot.split.input_grad(received)
        if action.stage > 0:
            self._send_input_grad(step, action, input_grad)

    def _backward_weights(self, step: _Step, index: int, action: Action, received: torch.Tensor | None) -> None:
        """W: the weight gradients of a split backward, reduced like a B's when they are final."""
        slot = step.slots.pop((action.microbatch, action.stage))
        with self.dp.reducing(last_micro_batch=index == self.last_backward[action.stage],
                              chunk=self.chunk_of[action.stage]):
            slot.split.weight_grad()
        if index in self.sampled:
            self.after_backward()

    def _send_input_grad(self, step: _Step, action: Action, grad: torch.Tensor) -> None:
        """The gradient of the stage input to the previous stage, in the compute dtype if it leaves the rank."""
        step.mail.put(action, grad.to(step.act_dtype) if step.mail.travels(action) else grad)

    def _finish(self, step: _Step) -> PipelineStats:
        """Post what the last actions produced, wait until every send has left (their buffers are
        reused next step), and sum a tied embedding's two copies of its gradient."""
        step.mail.post(len(self.plan) - 1)
        # A pipeline of one stage sends nothing: joining the helper thread is no pp time.
        pp = self.group.size > 1
        with self.group.timer.blocked(self.group.label, "sends in flight") if pp else contextlib.nullcontext():
            step.sends.finish()
        step.stats.freed_bytes = step.sends.freed_bytes
        if self.tied is not None:  # both copies of a tied embedding take the sum of their gradients
            param, group = self.tied
            collectives.all_reduce(self.dp.gradient_of(param), group)
        step.stats.loss, step.stats.mtp_loss = step.loss_sum, step.mtp_sum  # read by the training step
        return step.stats

    # ---- evaluation -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward_only(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                     autocast=contextlib.nullcontext, attention: list[AttentionInputs] | None = None) -> float:
        """Sum of token losses over the micro-batches (last stage only), for evaluation."""
        m = len(micro_batches)
        if m not in self.forward_plans:  # each micro-batch through the stages in order
            schedule, ends = forward_schedule(self.schedule, m)
            self.forward_plans[m] = schedule, check_plans(schedule, message_plans(schedule, ends))[self.rank]
        schedule, plan = self.forward_plans[m]
        sends, act_dtype = sends_for(self.device), travel_dtype(autocast, self.device)
        mail = self._mailbox(schedule, plan, micro_batches, sends, act_dtype)
        total = torch.zeros((), dtype=torch.float64, device=self.device)  # read once, at the end
        attention = attention or _plain_inputs(micro_batches)
        for index, action in enumerate(schedule.actions[self.rank]):
            mb, s = action.microbatch, action.stage
            x, y = micro_batches[mb]
            mail.post(index)
            h = mail.take(action).to(self.hidden_dtype) if s > 0 else x
            pos, doc = attention[mb]
            with autocast():
                h = self.chunks[s](self.chunks[s].embed(h), pos, doc)
                if s == self.n_stages - 1:  # the main loss only: evaluation trains no MTP depth
                    total += self.chunks[s].losses(h, y, pos, doc, [])[0]
            if s != self.n_stages - 1:
                mail.put(action, h.to(act_dtype) if mail.travels(action) else h)
        mail.post(len(plan) - 1)
        sends.finish()
        return float(total)
