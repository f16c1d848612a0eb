"""DualPipe's overlapped F&B pairs (parallel.ep_overlap): a forward and a backward as one action.

In DualPipeV's steady phases a rank runs a forward of one chunk right before a full backward of
its other chunk (schedules.dualpipe_v; simulate.overlapped_pairs finds them). DeepSeek-V3
(DeepSeek-AI 2024, sec. 3.2.1) runs each such pair at once, so that the expert all-to-alls of
either half (dispatch and combine forward, their transposes backward) travel while the other half
computes. Here the backward runs on the step's thread and the forward on the side lane's
(comm/lanes.py: its own twin of every process group, made at setup; the two lanes launch their
collectives in turns, one order on every rank; on CUDA each chunk on its own stream, and what an
action takes from another stream is recorded on its own: `on_stream`). Proven on gloo (CPU); not
yet run on NCCL.

What changes and what does not:
- the values: none. Each half runs the ops it runs alone, on its own tensors; a backward only
  reads the forward of its own micro-batch, done earlier. So a run equals the unpaired schedule bit
  for bit, and the bytes and calls per axis are the same.
- the messages: a pair starts once both halves have their inputs, as simulate() models Costs.fb,
  and what the forward produces is posted after the pair. `paired_plans` places the messages on
  that clock (so the B's input is received before the pair) and posts what would fall between the
  two halves after the pair; `check_plans` proves the plan matches and completes under the
  strictest reading of point-to-point, as it does the unpaired one (moving the receives in front of
  the pair instead deadlocks there: a posted receive holds NCCL's stream for what comes after it).
- data parallel: no pair holds a chunk's first forward or its last backward (every dualpipe_v
  shape: tests/parallel/test_ep_overlap.py), where DDP and ZeRO reduce and ZeRO-3 kept gathered
  gathers and frees, so their collectives stay on the step's thread. ZeRO-3 resharding around every
  forward and backward would gather and prefetch units from both halves: refused (validate/speed.py).
- the step's time parts: comm/timing.py charges the overlap as the rank spent it, so exposed ep
  time is the time neither half computed while one waited.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from fivefold.parallel.comm.lanes import Lanes
from fivefold.parallel.comm.timing import StepTimer
from fivefold.parallel.pipeline.messages import Batch, check_plans, message_plans
from fivefold.parallel.pipeline.schedules import Schedule
from fivefold.parallel.pipeline.simulate import Costs, overlapped_pairs, simulate


def paired_plans(schedule: Schedule) -> tuple[list[set[int]], list[list[Batch]]]:
    """Every rank's pairs (the positions of their F's) and the message plan that runs them (module
    docstring), proven by check_plans. The clock is simulate()'s with each pair started together
    (Costs.fb), its F's output made at the pair's end (the executor posts it then); what a rank
    would post between the two halves is posted after the pair."""
    pairs = overlapped_pairs(schedule)
    unit = Costs()  # simulate's default durations; a pair as long as its two halves
    paired = dataclasses.replace(unit, fb=unit.f + unit.b)
    ends = [[end for _, end, _ in events] for events in simulate(schedule, paired).timeline]
    for r, ks in enumerate(pairs):
        for k in ks:
            ends[r][k] = ends[r][k + 1] - 1e-6  # still before the B's end: the clock stays increasing
    plans = message_plans(schedule, ends)
    for r, plan in enumerate(plans):
        for k in sorted(pairs[r]):
            between = plan[k + 1]
            plan[k + 2].sends[:0], plan[k + 2].recvs[:0] = between.sends, between.recvs
            plan[k + 1] = Batch()
    return pairs, check_plans(schedule, plans)


def chunk_streams(device: torch.device, stages: list[int]) -> dict[int, torch.cuda.Stream | None]:
    """On CUDA one stream per chunk of the rank (the first chunk's: the current one), so that the
    two halves of a pair, always of different chunks, run their kernels side by side; autograd runs a
    backward on its forward's stream, and each tensor is freed on the stream it was made on. None
    elsewhere: a CPU op runs on the thread that calls it."""
    if device.type != "cuda":
        return dict.fromkeys(stages)
    return {s: torch.cuda.current_stream(device) if i == 0 else torch.cuda.Stream(device)
            for i, s in enumerate(sorted(stages))}


def on_stream(stream: torch.cuda.Stream | None, *inputs: torch.Tensor | None) -> contextlib.AbstractContextManager:
    """Run a block on `stream` after what the current stream has queued (the received inputs), and
    have the current stream wait for it after (the sends read its outputs). A no-op without a stream.

    `inputs`: the tensors the block takes from elsewhere (a received activation or gradient, made on
    the step's stream; a handover from the other chunk, made on its stream), each recorded on
    `stream` (`Tensor.record_stream`). The block may drop their last reference (a backward frees the
    activations it kept) while its kernels still read them; without the record the caching allocator
    would at once hand the memory to the next tensor made on the stream it came from, whose kernels,
    the other half of a pair's among them, need not wait for this stream (PyTorch's documentation of
    Tensor.record_stream). Recording on the stream a tensor was made on is a no-op. What the block
    makes and another stream reads after it (the sends) is read only after the caller waited for the
    block, by the process group, which holds it for its own stream. The all-to-alls inside the block
    (parallel/expert.py) are synchronous calls on its stream: their buffers are made and read there,
    and ProcessGroupNCCL joins its stream back to the block's before the call returns (PyTorch PR
    111431), so they need no record."""
    if stream is None:
        return contextlib.nullcontext()
    for t in inputs:
        if t is not None:
            t.record_stream(stream)
    return _OnStream(stream)


class _OnStream:
    def __init__(self, stream: torch.cuda.Stream):
        self.stream, self.caller = stream, torch.cuda.current_stream(stream.device)
        self.inner = torch.cuda.stream(stream)

    def __enter__(self) -> None:
        self.stream.wait_stream(self.caller)
        self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)
        self.caller.wait_stream(self.stream)


def run_pair(forward: Callable[[], None], backward: Callable[[], None], lanes: Lanes, timer: StepTimer,
             name: str) -> None:
    """The forward half on the side lane while this thread runs the backward half; returns when both
    are done (re-raising what either raised). The halves launch their collectives in turns
    (comm/lanes.py), each leaving the turns when it is done. `timer` charges the wait for the side lane."""
    def side() -> None:
        try:
            with timer.side_lane(), timer.span("compute", "compute", f"{name} (forward half)"):
                forward()
        finally:
            lanes.finish()

    with lanes.taking_turns():
        half = lanes.beside(side)
        try:
            backward()
        finally:
            lanes.finish()  # before waiting: the forward half's launches must not wait for this one
            with timer.lane_wait(f"{name}: wait for the forward half"):
                half.result()
