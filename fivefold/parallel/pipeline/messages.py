"""Pipeline messages: which travel between ranks, and in which batch each rank posts them.

NCCL matches the point-to-point messages between two ranks by the order they are posted and
ignores tags (gloo matches by tag), so the k-th send from a rank to a neighbour must be the k-th
receive that neighbour posts from it. A schedule's ranks need their inputs in an order of their
own: in ZB-V at p = 2, rank 0 computes the activation of micro-batch 2 (stage 0) before the
gradient of micro-batch 0 (stage 3), while rank 1 uses that gradient first: sent as produced and
received as used, the activation would land where the gradient is due (same shape) on NCCL.

So every message is placed on one clock, the timeline `simulate()` computes for the schedule:
a message exists when the action that produces it ends. A sender posts its sends in the order it
produces them, right after each action; a receiver posts each receive in the batch it posts once
its own actions reach the time the message is produced, and waits on it only before the action
that uses it (it may arrive early and wait in its buffer). Per pair of ranks both ends then post
in one order, the sender's (DESIGN's rule: messages are sent in the order the receiver posts its
receives), and all messages of a step fall into one global order. A rank posts what falls between
two of its actions as one batch (`comms.batch`): on NCCL, one group on the pp communicator, so a
send and a receive between two neighbours that each send to the other progress together.

Why this cannot deadlock: on the clock, an action's input exists by the time it starts, and each
action takes time. So everything a rank posts or runs before the batch holding a message M
involves only messages made strictly before M. Take the earliest message not yet delivered:
everything before its batch has completed, on both of its ranks, so both ends are posted and it
is delivered. By induction every message is.

`message_plans()` returns those batches; the executor (pipeline/executor.py) posts exactly them, and
`check_plans()` proves, for a schedule, that they match every message and complete under the
strictest reading of point-to-point: a rank's batches run one after the other (NCCL's one stream
per communicator), a batch starts once the actions that produced its sends are done, completes
only when each of its peers has started the batch holding the matching operation (no message is
buffered), and an action waits for the batch holding its input. A backend that buffers, or whose
operations progress independently (gloo), only lifts constraints of that model. Pure Python.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Literal

from fivefold.parallel.pipeline.schedules import Action, Schedule
from fivefold.parallel.pipeline.simulate import DeadlockError, simulate

__all__ = ["Message", "Batch", "MessageOrderError", "incoming", "outgoing", "forward_schedule", "message_plans",
           "check_plans"]


@dataclass(frozen=True)
class Message:
    """What `stage` sends to its neighbour for `microbatch`: its output forward ("activation"),
    the gradient of its input backward ("gradient"); from pp rank `src` to `dst`."""

    kind: Literal["activation", "gradient"]
    microbatch: int
    stage: int
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.kind} of mb {self.microbatch} from stage {self.stage} (rank {self.src} -> {self.dst})"


@dataclass
class Batch:
    """What a rank posts at once between two of its actions."""

    sends: list[Message] = field(default_factory=list)
    recvs: list[Message] = field(default_factory=list)


class MessageOrderError(RuntimeError):
    """A rank's k-th send to a neighbour is not the k-th receive that neighbour posts from it."""


def incoming(schedule: Schedule, action: Action) -> Message | None:
    """The message `action` needs from another rank (None: none, or it comes from this rank)."""
    s, to_rank = action.stage, schedule.stage_to_rank
    if action.kind == "F" and s > 0 and to_rank(s - 1) != to_rank(s):
        return Message("activation", action.microbatch, s - 1, to_rank(s - 1), to_rank(s))
    if action.kind in ("B", "I") and s < schedule.num_stages - 1 and to_rank(s + 1) != to_rank(s):
        return Message("gradient", action.microbatch, s + 1, to_rank(s + 1), to_rank(s))
    return None


def outgoing(schedule: Schedule, action: Action) -> Message | None:
    """The message `action` produces for another rank (None: none, or it stays on this rank)."""
    s, to_rank = action.stage, schedule.stage_to_rank
    if action.kind == "F" and s < schedule.num_stages - 1 and to_rank(s + 1) != to_rank(s):
        return Message("activation", action.microbatch, s, to_rank(s), to_rank(s + 1))
    if action.kind in ("B", "I") and s > 0 and to_rank(s - 1) != to_rank(s):
        return Message("gradient", action.microbatch, s, to_rank(s), to_rank(s - 1))
    return None


def forward_schedule(schedule: Schedule, microbatches: int) -> tuple[Schedule, list[list[float]]]:
    """Forward only (evaluation): each micro-batch through every stage in order, and that order as a
    clock (action (mb, s) ends at mb x stages + s + 1), for `message_plans`."""
    n = schedule.num_stages
    acts: list[list[Action]] = [[] for _ in range(schedule.pp)]
    ends: list[list[float]] = [[] for _ in range(schedule.pp)]
    for mb in range(microbatches):
        for s in range(n):
            acts[schedule.stage_to_rank(s)].append(Action("F", mb, s))
            ends[schedule.stage_to_rank(s)].append(float(mb * n + s + 1))
    return Schedule(f"{schedule.name} (forward)", schedule.pp, microbatches, schedule.virtual_stages, acts,
                    schedule.layout), ends


def message_plans(schedule: Schedule, ends: list[list[float]] | None = None) -> list[list[Batch]]:
    """Per rank, the batches it posts: batch i before its action i, the last after its last action.

    `ends[r][i]`: when action i of rank r ends on a common clock, strictly increasing per rank;
    by default simulate()'s timeline under its default costs (any costs give a valid plan).
    """
    if ends is None:
        ends = [[end for _, end, _ in events] for events in simulate(schedule).timeline]
    plans = [[Batch() for _ in range(len(seq) + 1)] for seq in schedule.actions]
    produced: list[tuple[float, int, Message]] = []
    for r, seq in enumerate(schedule.actions):
        for i, a in enumerate(seq):
            if (msg := outgoing(schedule, a)) is not None:
                plans[r][i + 1].sends.append(msg)  # posted as soon as it exists
                produced.append((ends[r][i], r, msg))
    for at, _, msg in sorted(produced, key=lambda p: p[:2]):  # one clock: the global order
        plans[msg.dst][bisect_right(ends[msg.dst], at)].recvs.append(msg)  # once the receiver gets there
    return plans


def check_plans(schedule: Schedule, plans: list[list[Batch]] | None = None) -> list[list[Batch]]:
    """`plans` (default: `message_plans(schedule)`), after proving that posting them matches every
    message and completes (the model in this module's docstring).

    Raises MessageOrderError if a pair's k-th send is not its k-th receive or a receive is posted
    after the action that needs it, and simulate's DeadlockError if the batches cannot complete.
    """
    plans = message_plans(schedule) if plans is None else plans
    sends: dict[tuple[int, int], list[tuple[Message, int]]] = defaultdict(list)  # pair -> (message, batch)
    recvs: dict[tuple[int, int], list[tuple[Message, int]]] = defaultdict(list)
    needed_in: dict[tuple[int, int], int] = {}  # (rank, action) -> the batch holding its input
    for r, batches in enumerate(plans):
        for i, b in enumerate(batches):
            for m in b.sends:
                sends[m.src, m.dst].append((m, i))
            for m in b.recvs:
                recvs[m.src, m.dst].append((m, i))
        posted = {m: i for i, b in enumerate(batches) for m in b.recvs}
        for i, a in enumerate(schedule.actions[r]):
            if (msg := incoming(schedule, a)) is not None:
                if posted.get(msg, len(batches)) > i:
                    raise MessageOrderError(f"schedule {schedule.name!r}: rank {r} needs {msg} for {a} (action {i}) "
                                            f"but receives it in batch {posted.get(msg)}")
                needed_in[r, i] = posted[msg]
    # Matched by position, as NCCL matches them: batch i of one rank meets batch j of the other.
    meets: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # (rank, batch) -> [(peer, batch)]
    for pair in sorted(sends.keys() | recvs.keys()):
        out, into = sends.get(pair, []), recvs.get(pair, [])
        for k, ((sent, i), (wanted, j)) in enumerate(zip(out, into, strict=False)):
            if sent != wanted:
                raise MessageOrderError(f"schedule {schedule.name!r}: rank {pair[0]}'s send #{k} to rank {pair[1]} is "
                                        f"the {sent}, but rank {pair[1]} receives the {wanted} there")
            meets[pair[0], i].append((pair[1], j))
            meets[pair[1], j].append((pair[0], i))
        if len(out) != len(into):
            raise MessageOrderError(f"schedule {schedule.name!r}: rank {pair[0]} sends {len(out)} messages to rank "
                                    f"{pair[1]}, which receives {len(into)}")
    _run_plans(schedule, plans, meets, needed_in)
    return plans


def _run_plans(schedule: Schedule, plans: list[list[Batch]], meets: dict[tuple[int, int], list[tuple[int, int]]],
               needed_in: dict[tuple[int, int], int]) -> None:
    """Advance every rank's actions and batches until all are done, or raise DeadlockError."""
    p = schedule.pp
    done = [0] * p  # actions completed
    batch = [0] * p  # the batch each rank's communication runs (earlier ones completed)

    def started(r: int, j: int) -> bool:  # batch j of rank r is running or done: its sends exist
        return batch[r] > j or (batch[r] == j and done[r] >= j)

    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while True:
                i, j = done[r], batch[r]
                if j < len(plans[r]) and started(r, j) and all(started(q, k) for q, k in meets[r, j]):
                    batch[r] += 1
                elif i < len(schedule.actions[r]) and needed_in.get((r, i), -1) < batch[r]:
                    done[r] += 1
                else:
                    break
                progressed = True
    stuck = [r for r in range(p) if batch[r] < len(plans[r]) or done[r] < len(schedule.actions[r])]
    if stuck:
        blocked = {r: schedule.actions[r][min(done[r], len(schedule.actions[r]) - 1)] for r in stuck}
        desc = "; ".join(f"rank {r} after {done[r]} actions, in batch {batch[r]} (waiting for rank(s) "
                         f"{sorted({q for q, k in meets[r, batch[r]] if not started(q, k)})})" for r in stuck)
        raise DeadlockError(f"schedule {schedule.name!r}: posting its messages deadlocks: {desc}", blocked)
