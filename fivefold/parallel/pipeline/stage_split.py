"""How many blocks each pipeline stage holds: the one split that validate, the planner, the runtime
(pipeline/executor.py) and the dry run all use, so what is planned is what runs.

`stage_split(cfg, vocab_size)` gives the blocks of each (virtual) stage, in model order:

- `parallel.stage_layers` when given (validate() checks it);
- the even split when pp x virtual_stages divides model.n_layers;
- otherwise a split balanced by the planner's cost of each part (`balance`).

What the balanced split minimises, in this order, over contiguous splits with at least one block
per stage:

1. the costliest stage's forward FLOPs per token: its blocks (counts.block_forward_flops), and on
   the last stage the head's V x d matmul (counts.head_forward_flops); the embedding is a lookup,
   no FLOPs. With model.mtp_layers the last stage runs each MTP depth too: its block, its eh_proj
   (2d -> d) and the head once more (model/transformer.py MTPLayer, pipeline/stages.py). A
   pipeline runs at the pace of its slowest stage, and the planner prices backward as 2 x forward,
   so forward FLOPs rank stages as training time does. The micro-batch and cp multiply every part
   alike, so they do not move the split; tp does for MoE blocks (experts run whole).
2. then the fullest stage's parameters on one rank (counts.block_rank_params; the first stage adds
   the embedding's V x d, the last the head's V x d, or a tied copy, and the final norm, and with
   MTP its depths' parameters and, untied, a copy of the embedding (the depths embed tokens): model
   state, gradients and AdamW moments grow with them. This is what lightens the first stage too:
   Llama 3 405B, 126 layers over 16 stages, gets 7, 8 x 14, 7, the split its authors chose by hand
   (Llama 3 paper, Dubey et al. 2024, sec. 3.3.2).
3. then the spread of compute (the sum of squared stage FLOPs), and last the most blocks on the
   earliest stages (the largest counts in model order): one answer for one config.

Each virtual stage is balanced on its own: under interleaved and V schedules a rank runs several
(Schedule.stage_to_rank; the V schedules put the first and last stage on one rank), and the sum
per rank is not what is minimised. Not counted: activations in flight (1F1B's first stage holds
the most), the loss's elementwise work, anything measured. Pure: no torch, microseconds.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Callable

from fivefold.config.schema import Config
from fivefold.model.counts import (
    ModelCounts,
    attention_keys,
    block_forward_flops,
    block_rank_params,
    head_forward_flops,
    model_counts,
    mtp_attention_keys,
)


@dataclass(frozen=True)
class PartCosts:
    """What each part costs, in integers so that ties are exact."""

    flops: tuple[int, ...]  # forward FLOPs per token of each block, on one tp rank
    params: tuple[int, ...]  # parameters of each block on one rank
    first: tuple[int, int]  # (FLOPs, parameters) the first stage adds: the embedding
    last: tuple[int, int]  # (FLOPs, parameters) the last stage adds: final norm, head and loss


def part_costs(cfg: Config, counts: ModelCounts) -> PartCosts:
    """The planner's costs of `cfg`'s parts (module docstring, points 1 and 2)."""
    m, p = cfg.model, cfg.parallel
    head = (counts.head or counts.embedding) // p.tp + counts.final_norm  # tied: the last stage keeps a copy
    # A sliding layer attends to fewer keys (Gemma's local layers); documents' lengths are the data's.
    keys = [k if m.attention.layer_window(i) else None
            for i, k in enumerate(attention_keys(m, cfg.train.seq_len) + mtp_attention_keys(m, cfg.train.seq_len))]
    flops = [block_forward_flops(m, b, cfg.train.seq_len, p.tp, p.sp, keys=k)
             for b, k in zip((*counts.blocks, *counts.mtp), keys, strict=True)]
    n, depths = len(counts.blocks), len(counts.mtp)
    last = (head_forward_flops(counts, p.tp), head)
    if depths:  # the MTP depths (last stage): per depth its block, eh_proj (replicated over tp) and the head again
        eh_proj = 2 * counts.mtp_extra_matmul // (p.tp if p.sp else 1)  # on this rank's T/tp tokens with sp
        embedding_copy = counts.embedding // p.tp if counts.head else 0  # the tied head's copy is counted above
        last = (last[0] * (1 + depths) + sum(flops[n:]) + depths * eh_proj,
                last[1] + embedding_copy + sum(block_rank_params(b, p.tp, p.ep) + counts.mtp_extra for b in counts.mtp))
    return PartCosts(flops=tuple(flops[:n]), params=tuple(block_rank_params(b, p.tp, p.ep) for b in counts.blocks),
                     first=(0, counts.embedding // p.tp), last=last)


def stage_split(cfg: Config, vocab_size: int) -> tuple[int, ...]:
    """Blocks of each (virtual) stage in model order, for a config validate() accepted and its
    padded vocabulary (derive.py's vocab_size)."""
    return split_of_counts(cfg, model_counts(cfg.model, vocab_size))


def split_of_counts(cfg: Config, counts: ModelCounts) -> tuple[int, ...]:
    """stage_split() for a caller that holds the model's counts already (the planner)."""
    p, n = cfg.parallel, cfg.model.n_layers
    stages = p.pp * p.virtual_stages
    if p.stage_layers:
        return tuple(p.stage_layers)
    if n % stages == 0:
        return (n // stages,) * stages
    return balance(part_costs(cfg, counts), stages)


def is_automatic_and_uneven(cfg: Config) -> bool:
    """Did balance() choose the split (no stage_layers given, and the layers do not divide)?"""
    p = cfg.parallel
    return not p.stage_layers and cfg.model.n_layers % (p.pp * p.virtual_stages) != 0


def split_note(cfg: Config, split: tuple[int, ...]) -> str:
    """The line a run prints when balance() chose its split; "" otherwise."""
    if not is_automatic_and_uneven(cfg):
        return ""
    return (f"pipeline stages: {list(split)} blocks, balanced by FLOPs then parameters ({len(split)} stages do "
            f"not divide {cfg.model.n_layers} layers and parallel.stage_layers is empty)")


Bounds = tuple[int, int]  # (FLOPs, parameters) no stage may exceed


@dataclass(frozen=True)
class _Blocks:
    """Prefix sums of the parts' costs, for `stages` stages: what balance() computes with."""

    flops: list[int]  # flops[i]: blocks 0 .. i-1
    params: list[int]
    first: tuple[int, int]
    last: tuple[int, int]
    stages: int
    n: int = 0  # blocks
    extras: tuple[tuple[int, int], ...] = ()  # per stage: what it holds besides blocks (embedding, head)

    @classmethod
    def of(cls, flops: list[int], params: list[int], first: tuple[int, int], last: tuple[int, int],
           stages: int) -> _Blocks:
        ends = [[0, 0] for _ in range(stages)]
        for i in (0, 1):
            ends[0][i] += first[i]
            ends[-1][i] += last[i]
        return cls(flops, params, first, last, stages, len(flops) - 1, tuple((f, p) for f, p in ends))

    def reversed(self) -> _Blocks:
        """The same blocks from the last to the first (the head's stage first)."""
        n, f, p = self.n, self.flops, self.params
        return _Blocks.of([f[n] - f[n - i] for i in range(n + 1)], [p[n] - p[n - i] for i in range(n + 1)],
                          self.last, self.first, self.stages)

    def cost(self, s: int, a: int, b: int) -> tuple[int, int]:
        """(FLOPs, parameters) of stage s over blocks a .. b-1."""
        ef, ep = self.extras[s]
        return self.flops[b] - self.flops[a] + ef, self.params[b] - self.params[a] + ep

    def furthest(self, s: int, a: int, bounds: Bounds) -> int:
        """The furthest end of stage s from block a within `bounds` (a: not even one block fits)."""
        ef, ep = self.extras[s]
        if bounds[0] < ef or bounds[1] < ep:
            return a
        return min(bisect.bisect_right(self.flops, self.flops[a] + bounds[0] - ef),
                   bisect.bisect_right(self.params, self.params[a] + bounds[1] - ep)) - 1

    def reaches(self, bounds: Bounds) -> list[int] | None:
        """reach[s]: the furthest stages 0 .. s-1 can end within `bounds`, each leaving a block for
        every stage after it (for s < stages); None when a stage cannot take one block. Any end from
        block s to reach[s] can be had too: shortening stages keeps them within bounds."""
        reach = [0]
        for s in range(self.stages - 1):
            end = min(self.furthest(s, reach[-1], bounds), self.n - (self.stages - 1 - s))
            if end <= reach[-1]:
                return None
            reach.append(end)
        return reach


def balance(costs: PartCosts, stages: int) -> tuple[int, ...]:
    """The split the module docstring describes: the least bound on each stage's FLOPs, then on
    its parameters (each by bisection over a greedy test), then the most even FLOPs within both."""
    n = len(costs.flops)
    if not 1 <= stages <= n:
        raise ValueError(f"{n} blocks cannot make {stages} stages of at least one block each")
    fwd = _Blocks.of(list(itertools.accumulate(costs.flops, initial=0)),
                     list(itertools.accumulate(costs.params, initial=0)), costs.first, costs.last, stages)
    back = fwd.reversed()

    def feasible(bounds: Bounds) -> bool:
        """The stages before the last reach as far as they can; the last takes the rest, which fits
        from its earliest start on (the furthest the reversed blocks' first stage reaches)."""
        reach = fwd.reaches(bounds)
        return reach is not None and n - back.furthest(0, 0, bounds) <= reach[-1]

    # Each bound lies between the mean stage and a split that meets it: the costliest stage of the
    # split by count (the earliest stages one block more), then all of it in one stage
    total_flops, total_params = (fwd.flops[n] + costs.first[0] + costs.last[0],
                                 fwd.params[n] + costs.first[1] + costs.last[1])
    by_count = list(itertools.accumulate((n // stages + (s < n % stages) for s in range(stages)), initial=0))
    high = max(fwd.cost(s, a, b)[0] for s, (a, b) in enumerate(itertools.pairwise(by_count)))
    max_flops = _least(lambda bound: feasible((bound, total_params)), -(-total_flops // stages), high)
    max_params = _least(lambda bound: feasible((max_flops, bound)), -(-total_params // stages), total_params)
    return _most_even(fwd, back, (max_flops, max_params))


def _least(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The least integer from `low` to `high` for which `holds` (monotone, true at `high`), by bisection."""
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid + 1
    return low


def _most_even(fwd: _Blocks, back: _Blocks, bounds: Bounds) -> tuple[int, ...]:
    """Of the splits within `bounds` (one exists), the least sum of squared stage FLOPs; ties: the
    largest counts in model order. Dynamic programming over (stage, first block), where the first
    block of stage s ranges only over what both the stages before it can reach and the stages from
    it can complete: a few blocks of slack once the bounds are tight."""
    n, stages = fwd.n, fwd.stages
    front, rear = fwd.reaches(bounds), back.reaches(bounds)
    assert front is not None and rear is not None, bounds
    starts = [range(0, 1)] + [range(max(s, n - rear[stages - s]), front[s] + 1) for s in range(1, stages)]
    best: list[dict[int, int]] = [{} for _ in range(stages)]  # stage s from block a on -> least sum of squares
    best[-1] = {a: fwd.cost(stages - 1, a, n)[0] ** 2 for a in starts[-1]}
    choice: list[dict[int, int]] = [{} for _ in range(stages)]  # stage s from block a -> its end
    for s in range(stages - 2, -1, -1):
        for a in starts[s]:
            nxt = starts[s + 1]
            for b in range(min(fwd.furthest(s, a, bounds), nxt[-1]), max(a, nxt[0] - 1), -1):
                # from the longest stage on: a tie keeps the first found
                if b in best[s + 1]:
                    total = fwd.cost(s, a, b)[0] ** 2 + best[s + 1][b]
                    if a not in best[s] or total < best[s][a]:
                        best[s][a], choice[s][a] = total, b
    ends, a = [], 0
    for s in range(stages - 1):
        a = choice[s][a]
        ends.append(a)
    return tuple(b - a for a, b in zip((0, *ends), (*ends, n), strict=True))
