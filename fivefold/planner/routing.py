"""The expert imbalance a run measured: `--expert-imbalance RUN_DIR` instead of a number.

An MoE run logs each step's routing in its metrics.jsonl (train/metrics.py, `expert_load`: per
MoE block, the copies the router sent to each expert over the whole step, all ranks). Under
expert parallelism rank r holds experts [r E/ep, (r + 1) E/ep) (parallel/expert.py), so for the ep
of the layout being priced the busiest rank of a block receives max_r sum(its experts' loads)
against a mean of sum(loads) / ep. The planner's imbalance is that ratio averaged over the logged
(step, block) pairs: each block's busiest rank sets the pace of its all-to-alls and expert
matmuls, and the average is what a step of many blocks and micro-batches pays. Another ep
regroups the same loads, so one run prices every layout a search tries: the ratio is worked out
once per ep that divides the experts (imbalance_by_ep), not on every estimate.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_expert_loads(path: str | Path) -> tuple[tuple[int, ...], ...]:
    """Every (step, block) load vector of a run directory's metrics.jsonl (or of that file);
    ValueError naming the file and the fix when it has none."""
    p = Path(path)
    file = p / "metrics.jsonl" if p.is_dir() else p
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"--expert-imbalance {path}: cannot read {file} ({e.strerror}); give a number (1.2) or a "
                         "run directory with a metrics.jsonl") from None
    loads = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a crash: the others still count
        if isinstance(record, dict) and "event" not in record:
            loads += [tuple(int(x) for x in v) for v in (record.get("expert_load") or {}).values()]
    if not loads:
        raise ValueError(f"--expert-imbalance {path}: {file} has no expert_load records (an MoE run logs them "
                         "every step); give a number instead")
    return tuple(loads)


def busiest_rank_share(loads: tuple[tuple[int, ...], ...], ep: int) -> float:
    """Mean over the (step, block) vectors of the busiest of ep ranks' copies over the mean rank's
    (module docstring), ep dividing the experts; 1 at ep = 1."""
    if ep <= 1:
        return 1.0
    ratios = []
    for load in loads:
        n, total = len(load) // ep, sum(load)
        if total:
            ratios.append(max(sum(load[r * n:(r + 1) * n]) for r in range(ep)) * ep / total)
    return sum(ratios) / len(ratios) if ratios else 1.0


def imbalance_by_ep(loads: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, float], ...]:
    """(ep, busiest_rank_share) for every ep that divides the run's experts."""
    experts = len(loads[0])
    return tuple((ep, busiest_rank_share(loads, ep)) for ep in range(1, experts + 1) if experts % ep == 0)
