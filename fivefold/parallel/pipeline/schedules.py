"""Pipeline-parallel schedules as plain data: for every rank, the ordered list of what it computes.

A batch is split into m micro-batches; each goes forward through stages 0..S-1 and backward back
down. A schedule is, per rank, the order of those actions ("F3s1": forward of micro-batch 3 on
stage 1; "B" a full backward; zero-bubble schedules split it into "I", the input gradient the
upstream rank waits for, and "W", the weight gradients nobody waits for) plus where each stage
lives. The order decides the step time (the pipeline bubble: GPipe and 1F1B idle (p-1)/m of their
compute) and how many activations a rank holds.

The generators below never touch torch. The same lists are run by the executor (pipeline/executor.py),
timed by `simulate()` (simulate.py, which also proves they cannot deadlock), priced by the planner
and drawn by `fivefold viz schedule`: one source of truth. The bubble formulas, each schedule's
memory and why zero-bubble and V schedules work are derived in docs/pipeline-schedules.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

__all__ = [
    "Action", "Schedule", "SCHEDULES", "gpipe", "one_f_one_b", "interleaved_1f1b", "zero_bubble_h1",
    "zero_bubble_v", "dualpipe_v", "build_schedule",
]

Kind = Literal["F", "B", "I", "W"]
KINDS = ("F", "B", "I", "W")


@dataclass(frozen=True)
class Action:
    """One unit of work: ``kind`` of ``microbatch`` on global (virtual) ``stage``."""

    kind: Kind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}s{self.stage}"


@dataclass
class Schedule:
    """Per-rank ordered action lists plus the stage -> rank placement.

    ``layout`` is "loop" (stage s on rank s % p; with v > 1 rank r holds
    r, r+p, r+2p, ... as in interleaved 1F1B) or "v" (v = 2; rank r holds
    stage r and stage 2p-1-r, so the first and last stage share rank 0 and the
    model's data path goes down the ranks and back up, a "V").
    """

    name: str
    pp: int
    microbatches: int
    virtual_stages: int
    actions: list[list[Action]]
    layout: Literal["loop", "v"] = "loop"

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def splits_backward(self) -> bool:
        """Does a stage other than the first run a backward split into I and W (split_backward.py)?
        The first stage's I computes nothing and its W the whole backward: it splits nothing."""
        return any(a.kind == "I" and a.stage > 0 for acts in self.actions for a in acts)

    def stage_to_rank(self, stage: int) -> int:
        if not 0 <= stage < self.num_stages:
            raise ValueError(f"stage {stage} outside 0..{self.num_stages - 1}")
        if self.layout == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp


# ---------------------------------------------------------------- generators

def _check_pm(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"need pp >= 1 and microbatches >= 1, got pp={p}, m={m}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): all forwards, then all backwards.

    Simple, but every rank holds all m micro-batches' activations at once.
    """
    _check_pm(p, m)
    acts = [[Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)]
            for r in range(p)]
    return Schedule("gpipe", p, m, 1, acts)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, "Memory-efficient
    pipeline-parallel DNN training").

    Rank r runs p-1-r warm-up forwards, then alternates one forward with one
    backward, then drains the remaining backwards. Same bubble as GPipe, but a
    micro-batch's activations are freed as soon as possible, so rank r never
    holds more than p-r micro-batches (GPipe: m).
    """
    _check_pm(p, m)
    acts = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        seq = [Action("F", i, r) for i in range(warm)]
        for i in range(m - warm):
            seq += [Action("F", warm + i, r), Action("B", i, r)]
        seq += [Action("B", i, r) for i in range(m - warm, m)]
        acts.append(seq)
    return Schedule("1f1b", p, m, 1, acts)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, "Efficient large-scale language
    model training on GPU clusters using Megatron-LM").

    Each rank holds v model chunks (stages r, r+p, ...). Micro-batches are
    processed in groups of p: forward group g through chunk 0, then chunk 1,
    ... (depth first). Each chunk is 1/v of a rank's layers, so the fill/drain
    time shrinks by v and the bubble ratio becomes (p-1)/(v*m). Like Megatron we
    require m % p == 0 so every group is full.
    """
    _check_pm(p, m)
    if v < 2:
        raise ValueError("interleaved_1f1b needs virtual_stages >= 2 (v=1 is plain '1f1b')")
    if m % p != 0:
        raise ValueError(
            f"interleaved_1f1b needs microbatches to be a multiple of pp (m % p == 0, "
            f"m >= p); got m={m}, p={p}. Use m={max(p, (m + p - 1) // p * p)} or '1f1b'.")
    total = m * v  # (micro-batch, chunk) pairs each rank computes

    def unit(k: int, r: int, backward: bool) -> Action:
        # k-th forward (or backward) on this rank -> which micro-batch and chunk.
        chunk = (k // p) % v
        if backward:
            chunk = v - 1 - chunk  # backwards walk the chunks in reverse
        mb = (k // (p * v)) * p + k % p
        return Action("B" if backward else "F", mb, chunk * p + r)

    acts = []
    for r in range(p):
        # Megatron's warm-up: one extra round of chunks, plus 2 per hop from the
        # last rank so that steady state lines up; capped by the work available.
        warm = min((v - 1) * p + 2 * (p - 1 - r), total)
        seq = [unit(k, r, False) for k in range(warm)]
        for k in range(total - warm):
            seq += [unit(warm + k, r, False), unit(k, r, True)]
        seq += [unit(k, r, True) for k in range(total - warm, total)]
        acts.append(seq)
    return Schedule("interleaved_1f1b", p, m, v, acts)


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", sec. 3).

    1F1B order, but each backward is split into I (input grad, on the critical
    path) and W (weight grad, off it). Rank r keeps up to r W's pending and
    runs them later: the last rank, which would otherwise idle at the end while
    the input gradients travel up, spends that time on its deferred W's. With
    F = I = W the bubble is (p-1)(F+I-W) = (p-1) per rank, a third of 1F1B's
    (p-1)(F+I+W). Activations of a micro-batch live until its W, so every
    rank peaks at p micro-batches: the same maximum as 1F1B (rank 0's p).
    """
    _check_pm(p, m)
    acts = [_zb_h1_rank(p, m, r) for r in range(p)]
    return Schedule("zb_h1", p, m, 1, acts)


def _zb_h1_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's actions in `zero_bubble_h1`."""
    warm = min(p - 1 - r, m)
    seq = [Action("F", i, r) for i in range(warm)]
    pending: deque[int] = deque()

    def backward(i: int) -> None:
        seq.append(Action("I", i, r))
        pending.append(i)
        if len(pending) > r:  # keep r weight-grads in hand to fill the tail
            seq.append(Action("W", pending.popleft(), r))

    for i in range(m - warm):
        seq.append(Action("F", warm + i, r))
        backward(i)
    for i in range(m - warm, m):
        backward(i)
    seq += [Action("W", i, r) for i in pending]
    return seq


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV: the "V" schedule of DeepSeek's DualPipe (DeepSeek-V3
    technical report, 2024) folded onto p ranks, in the spirit of ZB-V
    (Qi et al. 2024, "Pipeline parallelism with controllable memory").

    Rank r holds stage r (chunk 0, on the way down) and stage 2p-1-r (chunk 1,
    on the way up). The phases below follow DeepSeek's published DualPipeV
    algorithm. In the steady phase each rank pairs a forward of one chunk with
    a full backward of the other; DualPipe runs such a pair concurrently to
    hide MoE all-to-all, so the pair is listed as F then B and run at once with
    parallel.ep_overlap (pipeline/overlap.py; simulate's Costs.fb times it).
    Warm-up and cool-down split backwards into I + W and defer the W's into
    the gaps. Needs m >= 2p (as PyTorch's DualPipeV).
    """
    _check_pm(p, m)
    if m < 2 * p:
        raise ValueError(f"dualpipe_v needs microbatches >= 2*pp (one per stage); "
                         f"got m={m}, p={p}. Use m >= {2 * p}.")
    acts = [_dualpipe_v_rank(p, m, r) for r in range(p)]
    return Schedule("dualpipe_v", p, m, 2, acts, layout="v")


def _dualpipe_v_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's actions in `dualpipe_v`."""
    c0, c1 = r, 2 * p - 1 - r
    seq: list[Action] = []
    nxt = dict.fromkeys([("F", c0), ("F", c1), ("B", c0), ("B", c1)], 0)  # next mb
    w_queue: deque[Action] = deque()

    def fwd(s: int) -> None:
        seq.append(Action("F", nxt["F", s], s))
        nxt["F", s] += 1

    def bwd(s: int, split: bool) -> None:
        mb = nxt["B", s]
        nxt["B", s] += 1
        if split:  # input grad now, weight grad queued for a gap later
            seq.append(Action("I", mb, s))
            w_queue.append(Action("W", mb, s))
        else:
            seq.append(Action("B", mb, s))

    def weight() -> None:
        if w_queue:
            seq.append(w_queue.popleft())

    for _ in range(2 * (p - r - 1)):        # 1: fill the way down
        fwd(c0)
    for _ in range(r + 1):                  # 2: reach the bottom of the V
        fwd(c0)
        fwd(c1)
    for _ in range(p - r - 1):              # 3: first backwards, split
        bwd(c1, True)
        weight()
        fwd(c1)
    for _ in range(m - 2 * p + r + 1):      # 4: steady, F of one chunk + B of the other
        fwd(c0)
        bwd(c1, False)
        fwd(c1)
        bwd(c0, False)
    for _ in range(p - r - 1):              # 5: chunk 0 forwards are done
        bwd(c1, False)
        fwd(c1)
        bwd(c0, False)
    split = False
    for i in range(r + 1):                  # 6: drain; 2nd half switches to I+W
        half = i == (r + 1) // 2            # (odd ranks switch one chunk earlier)
        split = split or (half and r % 2 == 1)
        bwd(c1, split)
        split = split or half
        bwd(c0, split)
    for _ in range(p - r - 1):              # 7: fill gaps with deferred W's
        weight()
        bwd(c0, split)
    while w_queue:                          # 8: the rest of the W's
        weight()
    return seq


def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").

    The V placement of DualPipeV (rank r holds stages r and 2p-1-r), with every backward split
    into I and W. The forward warm-up is sized so that the way down and the way back up are both
    full when the first backward arrives; then each rank alternates F, I, W of one chunk with
    F, I, W of the other; in the cool-down it runs the remaining I's first (they are on the
    critical path of the ranks below) and fills the tail with its W's, holding back more of them
    the deeper it sits in the V. With F = I = W the bubble is close to zero, while every rank
    holds at most 2p chunk activations, the same as 1F1B's first rank with its full stage.
    Needs m >= 2p. Its per-rank order equals PyTorch's ScheduleZBVZeroBubble (tested).
    """
    _check_pm(p, m)
    if m < 2 * p:
        raise ValueError(f"zb_v needs microbatches >= 2*pp; got m={m}, p={p}. Use m >= {2 * p}.")
    acts = [_zb_v_rank(p, m, r) for r in range(p)]
    return Schedule("zb_v", p, m, 2, acts, layout="v")


def _zb_v_rank(p: int, m: int, r: int) -> list[Action]:
    """Rank r's actions in `zero_bubble_v`."""
    c0, c1 = r, 2 * p - 1 - r
    seq: list[Action] = []
    nxt = dict.fromkeys([("F", c0), ("F", c1), ("I", c0), ("I", c1)], 0)  # next micro-batch
    held: dict[int, deque[Action]] = {c0: deque(), c1: deque()}  # W's waiting in the cool-down

    def run(kind: str, s: int) -> None:
        seq.append(Action(kind, nxt[kind, s] if kind != "W" else nxt["I", s] - 1, s))
        if kind != "W":
            nxt[kind, s] += 1

    for _ in range(2 * (p - r) - 1):          # warm-up: the way down
        run("F", c0)
    for _ in range(r):                        # both chunks, until the bottom of the V is full
        run("F", c1)
        run("F", c0)
    for _ in range(p - r):                    # the first backwards come back up
        run("F", c1)
        run("I", c1)
        run("W", c1)
    while nxt["F", c1] < m:                   # steady: F, I, W of each chunk in turn
        if nxt["F", c0] < m:
            run("F", c0)
        run("I", c0)
        run("W", c0)
        run("F", c1)
        run("I", c1)
        run("W", c1)
    done = 0                                  # cool-down: I's first, W's held back
    while nxt["I", c0] < m or nxt["I", c1] < m:
        for s in (c0, c1):
            if nxt["I", s] < m:
                run("I", s)
                held[s].append(Action("W", nxt["I", s] - 1, s))
                done += 1
                if s == c0 and done >= 2 * r + 1:
                    seq.append(held[c0].popleft())
    seq += [*held[c1], *held[c0]]
    return seq


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zero_bubble_h1,
    "zb_v": zero_bubble_v,
    "dualpipe_v": dualpipe_v,
}


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """Build a registered schedule; ``v`` is only meaningful for interleaved
    (>= 2) and the V schedules (always 2, so 1 or 2 is accepted)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid names: {', '.join(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(p, m, v)
    if name in ("dualpipe_v", "zb_v"):
        if v not in (1, 2):
            raise ValueError(f"{name} always uses 2 stages per rank; got virtual_stages={v}")
        return SCHEDULES[name](p, m)
    if v != 1:
        raise ValueError(f"{name} has one stage per rank; got virtual_stages={v} "
                         "(use 'interleaved_1f1b' for v > 1)")
    return SCHEDULES[name](p, m)
