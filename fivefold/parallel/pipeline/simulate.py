"""The pipeline simulator: run per-rank action lists against their dependencies and time them.

Every rank runs its list strictly in order; an action starts when its rank is free and its inputs
exist. That is enough to prove a schedule has no deadlock and that every micro-batch's forward
precedes its backward on every stage, and to report makespan, idle time per rank, both bubble
figures (see `schedules.py`) and peak activations in flight. The planner, the explainers and the
pictures all time schedules with this one function; the executor's measured timeline is tested
against it, and its messages are posted in the order of this timeline (`messages.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fivefold.parallel.pipeline.schedules import KINDS, Action, Schedule

__all__ = ["Costs", "SimResult", "DeadlockError", "simulate"]


@dataclass(frozen=True)
class Costs:
    """Durations of one action (one micro-batch through one stage).

    ``b`` is a full backward. If the split parts are not given, I = W = b/2;
    if only one is given the other is b minus it, so I + W == b either way.
    ``comm`` is added to every dependency that crosses ranks.
    ``fb``, when given, is DualPipe's F&B: a forward and a backward of two micro-batches run as one
    overlapped pair (DeepSeek-V3 technical report, 2024, sec. 3.2.1: one's all-to-all hidden under
    the other's compute). Each F that `dualpipe_v` lists right before a B of its other chunk then
    runs with that B as one action of this length, started once both have their inputs. None: the
    pair runs as two actions, F then B, as fivefold's executor runs it without parallel.ep_overlap
    (with it, pipeline/overlap.py runs the pair at once, posting the F's output at the pair's end).
    """

    f: float = 1.0
    b: float = 2.0
    i: float | None = None
    w: float | None = None
    comm: float = 0.0
    fb: float | None = None

    def duration(self, kind: str) -> float:
        if kind in ("F", "B"):
            return self.f if kind == "F" else self.b
        i, w = self.i, self.w
        if i is None:
            i = self.b / 2 if w is None else self.b - w
        if w is None:
            w = self.b - i
        return i if kind == "I" else w


class DeadlockError(RuntimeError):
    """No rank can start its next action, yet actions remain."""

    def __init__(self, message: str, blocked: dict[int, Action]):
        super().__init__(message)
        self.blocked = blocked


@dataclass
class SimResult:
    makespan: float
    busy: list[float]
    idle: list[float]
    bubble_ratio: float       # total idle / total compute
    bubble_fraction: float    # total idle / (p * makespan)
    peak_inflight: list[int]  # per rank, in units of (micro-batch, stage) activations
    timeline: list[list[tuple[float, float, Action]]] = field(repr=False)


def _validate(s: Schedule) -> None:
    """Every (micro-batch, stage) needs one F and one backward (B, or I + W),
    on the rank that owns the stage; anything else is a broken schedule."""
    seen: dict[tuple[str, int, int], int] = {}
    for r, seq in enumerate(s.actions):
        for a in seq:
            if a.kind not in KINDS or not (0 <= a.microbatch < s.microbatches
                                            and 0 <= a.stage < s.num_stages):
                raise ValueError(f"rank {r}: bad action {a} (kinds {KINDS}, "
                                 f"m={s.microbatches}, stages={s.num_stages})")
            if s.stage_to_rank(a.stage) != r:
                raise ValueError(f"{a} is listed on rank {r} but stage {a.stage} "
                                 f"lives on rank {s.stage_to_rank(a.stage)}")
            seen[a.kind, a.microbatch, a.stage] = seen.get((a.kind, a.microbatch, a.stage), 0) + 1
    problems = []
    for mb in range(s.microbatches):
        for st in range(s.num_stages):
            n = tuple(seen.get((k, mb, st), 0) for k in KINDS)  # counts of F, B, I, W
            if n not in ((1, 1, 0, 0), (1, 0, 1, 1)):
                problems.append(f"mb {mb} stage {st}: F/B/I/W x {n}")
    if problems:
        raise ValueError("each (microbatch, stage) needs exactly one F and one B (or one I "
                         f"and one W): {'; '.join(problems[:8])}{' ...' * (len(problems) > 8)}")


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Time ``schedule`` with ``costs``: every rank runs its list strictly in
    order, starting each action as soon as the rank is free and the action's
    inputs exist (F after the previous stage's F; B/I after the same stage's F
    and the next stage's B/I; W after the same stage's I; ``comm`` added when
    the input comes from another rank). Raises :class:`DeadlockError` if the
    orders can never complete, ValueError if the schedule is malformed."""
    costs = costs or Costs()
    _validate(schedule)
    p, last, to_rank = schedule.pp, schedule.num_stages - 1, schedule.stage_to_rank
    # Finish times keyed by (what, mb, stage); "G" = the input gradient sent
    # upstream, produced by either B or I, so waiters need not know which.
    done: dict[tuple[str, int, int], float] = {}

    def needs(a: Action) -> list[tuple[str, int, int]]:
        mb, s = a.microbatch, a.stage
        if a.kind == "F":
            return [("F", mb, s - 1)] if s > 0 else []
        if a.kind == "W":
            return [("I", mb, s)]
        return [("F", mb, s)] + ([("G", mb, s + 1)] if s < last else [])

    pairs = overlapped_pairs(schedule) if costs.fb is not None else [set() for _ in range(p)]
    ptr, free = [0] * p, [0.0] * p
    timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(p)]
    remaining = sum(len(seq) for seq in schedule.actions)
    while remaining:
        progressed = False
        # The start time of an action depends only on its rank's previous action
        # and its inputs' finish times, so any visiting order gives the same answer.
        for r, seq in enumerate(schedule.actions):
            while ptr[r] < len(seq):
                unit = seq[ptr[r]:ptr[r] + (2 if ptr[r] in pairs[r] else 1)]  # an action, or an F&B pair
                deps = [d for a in unit for d in needs(a)]
                if any(d not in done for d in deps):
                    break  # this rank waits; try the others
                ready = max((done[d] + (costs.comm if to_rank(d[2]) != r else 0.0)
                             for d in deps), default=0.0)
                start = max(free[r], ready)
                # a pair's F&B split between its two actions in the ratio of their own lengths
                scale = costs.fb / (costs.f + costs.b) if len(unit) == 2 else 1.0
                for a in unit:
                    free[r] = end = start + scale * costs.duration(a.kind)
                    timeline[r].append((start, end, a))
                    done[a.kind, a.microbatch, a.stage] = end
                    if a.kind in ("B", "I"):
                        done["G", a.microbatch, a.stage] = end
                    start = end
                ptr[r] += len(unit)
                remaining -= len(unit)
                progressed = True
        if not progressed:
            blocked = {r: seq[ptr[r]] for r, seq in enumerate(schedule.actions) if ptr[r] < len(seq)}
            desc = "; ".join(
                f"rank {r} stuck at {a} (step {ptr[r]}), waiting for "
                + ", ".join(f"{'B/I' if d[0] == 'G' else d[0]}{d[1]}s{d[2]}"
                            for d in needs(a) if d not in done)
                for r, a in blocked.items())
            raise DeadlockError(f"schedule {schedule.name!r} deadlocks: {desc}", blocked)

    makespan = max(free, default=0.0)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    idle = [makespan - b for b in busy]
    return SimResult(
        makespan=makespan, busy=busy, idle=idle,
        bubble_ratio=sum(idle) / sum(busy) if sum(busy) else 0.0,
        bubble_fraction=sum(idle) / (p * makespan) if makespan else 0.0,
        peak_inflight=[peak_inflight(seq) for seq in schedule.actions],
        timeline=timeline,
    )


def overlapped_pairs(schedule: Schedule) -> list[set[int]]:
    """Per rank, the positions of the F's that run overlapped with the B after them: in
    `dualpipe_v`, an F directly followed by a B of the rank's other chunk (its steady phases). The
    executor runs those pairs with parallel.ep_overlap (pipeline/overlap.py)."""
    if schedule.name != "dualpipe_v":
        return [set() for _ in schedule.actions]
    return [{k for k in range(len(seq) - 1) if seq[k].kind == "F" and seq[k + 1].kind == "B"
             and seq[k].stage != seq[k + 1].stage} for seq in schedule.actions]


def peak_inflight(seq: list[Action], sizes: Sequence[int] | None = None) -> int:
    """Most (micro-batch, stage) activations a rank holds at once.

    A rank runs its list one action at a time, so this depends only on the
    order, not on timing. Our choice: a unit is held from its F until its
    backward *completes*, i.e. after B, or after W for a split backward. (I
    frees part of it in practice, but W still needs the layer inputs, so we
    count the whole unit; with this count ZB-H1's worst rank holds p, the same
    as 1F1B's rank 0.) For v > 1 one unit is one chunk = 1/v of a rank's layers;
    with `sizes` (per global stage) each unit weighs its stage's size, so uneven chunks count
    as they are (the planner's blocks in flight).
    """
    live = peak = 0
    for a in seq:
        if a.kind == "F":
            live += sizes[a.stage] if sizes else 1
            peak = max(peak, live)
        elif a.kind in ("B", "W"):
            live -= sizes[a.stage] if sizes else 1
    return peak
