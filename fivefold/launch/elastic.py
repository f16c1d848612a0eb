"""Elastic jobs: the layout for the world a rendezvous round admits, decided alike on every rank.

A job started with `--nnodes MIN:MAX` trains on the nodes the latest rendezvous round admitted
(launch/agent.py). Its config was written, and checked, for MAX nodes. Each worker of a round computes
the layout for its WORLD_SIZE with `layout_for()`, a pure function of (config, world, policy): every
rank and every launcher reaches the same layout without exchanging a message, and a job that grows
back to MAX nodes trains under the config exactly as written.

The policy (`fivefold train` flags):
- default: tp, pp, cp and ep stay; dp = world / (tp x pp x cp);
- `--keep AXES`: the named axes stay; each other one of tp, pp, cp, ep may shrink, to the largest
  divisors of the written degrees (largest product first) that validate() accepts;
- `--replan`: the planner's fastest layout (planner/search.py) among those validate() accepts and
  that fit on the run's hardware (run.hardware, or the catalog GPU of `--gpu`), with the `--keep`
  axes pinned (none unless named).

The global batch stays, and with it the learning-rate schedule and the sample order (the loader's
position is global: data/batches.py); with fewer data-parallel ranks each rank accumulates more
micro-batches. The micro-batch shrinks only where dp x micro_batch no longer divides the global
batch (the largest divisor of global_batch / dp not above it); under `--replan` the planner picks it.

Each round's decision, with the planner's predicted step time of the layout before and after
(None without hardware to price them), is printed by rank 0 and written to the metrics log as a
`replan` event (train/metrics.py). This module imports no torch: the launcher checks every world
of MIN..MAX nodes with it before any process starts.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from fivefold.checkpoint.run_dir import latest_checkpoint, run_dir_of
from fivefold.config.derive import derive
from fivefold.config.load import replace
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.validate import validate

AXES = ("tp", "pp", "cp", "ep")  # the degrees a re-plan may keep; dp always follows the world


class ReplanError(ValueError):
    """No layout of the policy for the ranks left; one line naming the axes, the ranks and the fix."""


def parse_keep(text: str) -> tuple[str, ...]:
    """'tp,pp' -> ('tp', 'pp'); ValueError naming --keep for anything else."""
    axes = tuple(a.strip() for a in text.split(",") if a.strip())
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise ValueError(f"--keep {text!r}: name axes among {', '.join(AXES)}, comma-separated (e.g. --keep tp,pp); "
                         f"dp always follows the number of ranks")
    return tuple(a for a in AXES if a in axes)  # canonical order: every rank prints the same


@dataclass(frozen=True)
class Policy:
    """How an elastic job re-plans; the same on every node (the same command line)."""

    launch_world: int  # ranks the config was written for: --nproc x MAX nodes
    keep: tuple[str, ...] = AXES
    replan: bool = False
    gpu: str = ""  # a catalog GPU to plan and price for when run.hardware is empty

    def describe(self) -> str:
        kept = f"keeping {', '.join(self.keep)}" if self.keep else "no axis pinned"
        return f"the planner's best ({kept})" if self.replan else kept


def _degrees(cfg: Config, world: int) -> dict[str, int]:
    p = cfg.parallel
    return {"dp": derive(cfg, world, unpadded_vocab(cfg)).dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep}


def _named(degrees: dict[str, int], axes: tuple[str, ...]) -> str:
    return ", ".join(f"{a}={degrees[a]}" for a in axes)


def layout_text(cfg: Config, world: int) -> str:
    """The planner's short name of a layout ("dp2 tp2 z0 mb2 -"), with dp resolved (a config may say 0)."""
    from fivefold.planner.search import layout_name

    return layout_name(replace(cfg, parallel={"dp": derive(cfg, world, unpadded_vocab(cfg)).dp}))


def _with_degrees(cfg: Config, world: int, tp: int, pp: int, cp: int, ep: int) -> Config | str:
    """cfg under these degrees on `world` ranks, dp filling the rest and the micro-batch lowered
    where divisibility needs it; or why no such layout exists (validate()'s first complaint)."""
    p, t = cfg.parallel, cfg.train
    rest = tp * pp * cp
    if world % rest:
        return f"tp x pp x cp = {rest} does not divide {world} ranks"
    dp = world // rest
    if t.global_batch % dp:
        return f"dp = {dp} does not divide train.global_batch = {t.global_batch}"
    per_rank = t.global_batch // dp
    micro = max(k for k in range(1, min(t.micro_batch, per_rank) + 1) if per_rank % k == 0)
    parallel: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep,
                                "dp_replicate": math.gcd(p.dp_replicate, dp)}
    if pp != p.pp:  # a written split is for the written stage count; the automatic one balances any
        parallel["stage_layers"] = ()
        if pp == 1:
            parallel.update(pp_schedule="1f1b", virtual_stages=1)
    if tp == 1:
        parallel["sp"] = False
    new = replace(cfg, parallel=parallel, train={"micro_batch": micro})
    errors = validate(new, world)
    return errors[0] if errors else new


def _shrunk(cfg: Config, world: int, keep: tuple[str, ...]) -> Config | str:
    """Kept axes as written, the others the largest divisors of theirs that make a valid layout."""
    p = cfg.parallel
    written = {a: getattr(p, a) for a in AXES}
    choices = [[written[a]] if a in keep else [k for k in range(written[a], 0, -1) if written[a] % k == 0]
               for a in AXES]
    # Largest product first, then the earlier axis larger: one order, so every rank picks the same.
    combos = sorted(itertools.product(*choices), key=lambda c: (-math.prod(c), [-k for k in c]))
    why = "no layout"
    for tp, pp, cp, ep in combos:
        found = _with_degrees(cfg, world, tp, pp, cp, ep)
        if isinstance(found, Config):
            return found
        why = found  # the last tried has the free axes at their smallest: its reason is the kept axes'
    return why


def _planned(cfg: Config, world: int, policy: Policy) -> Config | str:
    """The planner's fastest valid, fitting layout with the kept axes as written."""
    from fivefold.planner.search import search

    hw = hardware_of(cfg, policy)
    if hw is None:
        return "--replan needs hardware to plan for: set run.hardware to a profile, or --gpu NAME (a catalog GPU)"
    result = search(cfg, world, hw, keep=1 << 30)  # every fitting layout, fastest first (ties: search's order)
    written = {a: getattr(cfg.parallel, a) for a in policy.keep}
    pinned = [c for c, _ in result.ranked if all(getattr(c.parallel, a) == k for a, k in written.items())]
    if pinned:
        return pinned[0]
    if result.ranked:
        return f"{len(result.ranked)} layouts are valid and fit on {hw.name}, none of them with those degrees"
    reasons = "; ".join(f"{r} ({n})" for r, n in result.rejected.most_common(3))
    return f"none of {result.tried} layouts is valid and fits on {hw.name}: {reasons}"


def layout_for(cfg: Config, world: int, policy: Policy) -> Config:
    """The config this job trains with on `world` ranks (pure: the same on every rank and node)."""
    if world == policy.launch_world:
        return cfg  # the layout as written, also after growing back
    found = _planned(cfg, world, policy) if policy.replan else _shrunk(cfg, world, policy.keep)
    if isinstance(found, Config):
        return found
    flag = ("--keep " + ",".join(policy.keep) if policy.keep != AXES or policy.replan
            else "the default: only dp changes")
    kept = (f"keeping {_named(_degrees(cfg, policy.launch_world), policy.keep)} ({flag})" if policy.keep
            else "with no axis pinned")
    fix = ("keep fewer axes (--keep), or allow only node counts that work (--nnodes MIN)" if policy.keep
           else "allow only node counts that work (--nnodes MIN)")
    raise ReplanError(f"re-plan for {world} ranks {kept}: {found}; {fix}")


def check_node_range(cfg: Config, nproc: int, min_nodes: int, max_nodes: int, policy: Policy) -> list[str]:
    """Every world of MIN..MAX nodes has a layout: checked before any process starts, so a bad
    --keep fails at once rather than when a node is lost."""
    errors = []
    for nodes in range(min_nodes, max_nodes):  # max_nodes is the config as written: preflight checked it
        try:
            layout_for(cfg, nproc * nodes, policy)
        except ReplanError as e:
            errors.append(f"--nnodes {min_nodes}:{max_nodes}, {nodes} node(s) of --nproc {nproc}: {e}")
    return errors


def hardware_of(cfg: Config, policy: Policy):
    """The hardware the run plans and prices for: run.hardware's profile, else --gpu's catalog entry, else None."""
    from fivefold.planner.hardware import get_hardware, load_profile

    if cfg.run.hardware:
        return load_profile(cfg.run.hardware)
    return get_hardware(policy.gpu) if policy.gpu else None


def checkpoint_world(cfg: Config) -> int | None:
    """Ranks that wrote the checkpoint this round resumes from (state.json), or None without one."""
    latest = latest_checkpoint(run_dir_of(cfg)) if cfg.checkpoint.resume else None
    if latest is None:
        return None
    return int(json.loads((latest / "state.json").read_text()).get("world_size", 0)) or None


@dataclass(frozen=True)
class Decision:
    """A round's layout, and the one it replaces (the checkpoint's, or the launch layout)."""

    world_size: int
    cfg: Config
    previous_world: int
    previous_cfg: Config | None  # None: the checkpoint's world has no layout under this policy (another job's)
    policy: Policy
    predicted_s: tuple[float | None, float | None]  # planner's step time before, after (None: no hardware)
    hardware: str | None
    decide_s: float  # seconds this rank spent deciding

    @property
    def changed(self) -> bool:
        previous = self.previous_cfg
        return self.world_size != self.previous_world or previous is None or self.cfg.parallel != previous.parallel

    def event(self) -> dict[str, Any]:
        """The metrics log's `replan` event fields (train/metrics.py)."""
        before = self.previous_cfg
        old = derive(before, self.previous_world, unpadded_vocab(before)).grad_accum if before is not None else None
        return {"world_size": self.world_size, "from_world_size": self.previous_world,
                "from": layout_text(before, self.previous_world) if before is not None else None,
                "to": layout_text(self.cfg, self.world_size),
                "policy": self.policy.describe(), "kept": list(self.policy.keep),
                "micro_batch": [before.train.micro_batch if before is not None else None, self.cfg.train.micro_batch],
                "grad_accum": [old, derive(self.cfg, self.world_size, unpadded_vocab(self.cfg)).grad_accum],
                "global_batch": self.cfg.train.global_batch,
                "predicted_step_time_s": {"from": self.predicted_s[0], "to": self.predicted_s[1]},
                "hardware": self.hardware, "decide_s": round(self.decide_s, 4)}

    def message(self) -> str:
        e = self.event()
        before, after = e["predicted_step_time_s"]["from"], e["predicted_step_time_s"]["to"]
        if after is None:
            times = "no predicted step time (no hardware: set run.hardware, or --gpu NAME)"
        else:
            was = f"{before:.4g} s" if before is not None else "?"
            times = f"predicted step time {was} -> {after:.4g} s on {self.hardware}"
        return (f"re-planned for {self.world_size} ranks (was {self.previous_world}): {e['from']} -> {e['to']}, "
                f"{self.policy.describe()}; global batch {e['global_batch']} as before: {e['grad_accum'][1]} "
                f"micro-batches of {e['micro_batch'][1]} per rank per step (was {e['grad_accum'][0]} of "
                f"{e['micro_batch'][0]}); {times}")


def _predict(cfg: Config, world: int, hw, device_type: str) -> float | None:
    if hw is None:
        return None
    from fivefold.planner.selfcheck import predict_for_config

    return predict_for_config(cfg, world, hw, device_type)["step_time_s"]


def decide(cfg: Config, world: int, policy: Policy, device_type: str = "cpu") -> Decision:
    """This round's layout on `world` ranks, beside the one the checkpoint (or the launch) had."""
    began = time.perf_counter()
    new = layout_for(cfg, world, policy)
    previous_world = checkpoint_world(cfg) or policy.launch_world
    try:
        previous: Config | None = layout_for(cfg, previous_world, policy) if previous_world != world else new
    except ReplanError:  # a checkpoint of another job's layout: the event says so (from = null)
        previous = None
    hw = hardware_of(cfg, policy)
    before = _predict(previous, previous_world, hw, device_type) if previous is not None else None
    predicted = (before, _predict(new, world, hw, device_type))
    return Decision(world, new, previous_world, previous, policy, predicted, hw.name if hw is not None else None,
                    time.perf_counter() - began)
