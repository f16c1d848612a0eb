"""Expert parallel: the routed experts of each MoE block split over `ep` ranks, tokens sent to them.

What is sharded: the stacked expert weights (E, dim, hidden) of every MoE block, along dim 0. The
ep ranks of one group hold experts [r E/ep, (r+1) E/ep) each, and see different tokens (they are
data- or context-parallel ranks). Everything else (attention, router, shared experts, the routing
bias) stays replicated.

Groups. EP groups are carved out of the `grad` view (dp_replicate x dp_shard x cp, the ranks whose
gradients are summed), one grad view per (pp, tp) position: grad rank g is in ep group g // ep with
ep rank g % ep. The grad ranks with the same ep rank hold the same experts; they form the expert
replica group ("expert data parallel", size dp x cp / ep, charged to "dp"). An expert's gradient
already holds every token of its ep group that was routed to it, so data parallel sums expert
gradients over the replica group only, and every other gradient over the whole grad view.

What travels, per MoE block and micro-batch (all-to-alls inside the ep group, charged to "ep"):
  forward:  1. counts: how many copies this rank sends to each expert (E integers), so every rank
               knows how many rows it will receive from each other rank;
            2. dispatch: the token copies, sorted by expert (hence by owning rank), unequal splits;
            3. combine: the experts' outputs go back the same way, splits swapped.
  backward: the conjugates: the combine's gradient travels like a dispatch and the dispatch's
            like a combine (an all-to-all's adjoint is the all-to-all with the splits swapped).
Only rows that leave the rank count as wire bytes: a copy routed to a local expert costs nothing.

Load balancing (DeepSeek-V3 technical report, sec. 2.1.2), used by the training loop after each step:
- expert_stats(): per-expert copies over the step's micro-batches (counted in backward, so neither
  evaluation nor recomputed forwards count), summed over the grad view in one all-reduce;
- update_expert_bias(): bias_e += u x sign(mean load - load_e), the same on every replica;
- set_balance_loss_scale(): tells each MoE how many sequences the step has (and the fp16 loss
  scale), so the injected balance loss is alpha x its mean over the global batch.
Capacity dropping (GShard, Switch) and the balance loss itself live in the model (fivefold/model.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fivefold.mesh import Mesh
from fivefold.model import MoE, GroupedExperts, sort_by_expert
from fivefold.parallel import comms
from fivefold.parallel.comms import AxisGroup
from fivefold.parallel.tensor import shards_as_dtensors


# ---- groups -------------------------------------------------------------------------------------
@dataclass
class ExpertGroups:
    ep: AxisGroup  # the ranks among which one block's experts are split (label "ep")
    replicas: AxisGroup  # the ranks holding the same experts: expert gradients are summed here (label "dp")
    cp: AxisGroup | None = None  # ranks sharing sequences: the balance loss sums its counts over them
    device_mesh: DeviceMesh | None = None  # the ep group as a 1-D DeviceMesh (ep > 1): checkpoints shard on it


def expert_partitions(grid: torch.Tensor, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every ep group and every expert replica group, for a mesh grid of global
    ranks shaped (pp, dp_replicate, dp_shard, cp, tp). Pure: every rank computes the same lists."""
    pp, dpr, dps, cp, tp = grid.shape
    grad = dpr * dps * cp
    if grad % ep:
        raise ValueError(f"ep = {ep} must divide dp x cp = {grad}")
    views = grid.permute(0, 4, 1, 2, 3).reshape(pp * tp, grad)  # one grad view per (pp, tp), in grad-rank order
    ep_parts, replica_parts = [], []
    for ranks in views.tolist():
        ep_parts += [ranks[i:i + ep] for i in range(0, grad, ep)]  # consecutive grad ranks
        replica_parts += [ranks[j::ep] for j in range(ep)]  # the same ep rank in every ep group
    return ep_parts, replica_parts


def _group(mesh: Mesh, parts: list[list[int]], name: str, label: str, may_be_grad: bool) -> AxisGroup:
    # Every part has the same size, so every rank takes the same branch and new_group (collective
    # over the world) runs for every part in the same order. A group of one needs no process group
    # (comms returns at once). The replica group may be the grad view itself (ep = 1): data
    # parallel's own group then. The ep group always gets its own: its all-to-alls run inside
    # backward, and must not queue behind (or between) gradient all-reduces on the grad view.
    if len(parts[0]) == 1:
        return AxisGroup(name=name, label=label, pg=None, size=1, rank=0, stats=mesh.stats)
    if may_be_grad and len(parts[0]) == mesh.size("grad"):
        return dataclasses.replace(mesh.group("grad"), name=name, label=label)
    return dataclasses.replace(mesh.subgroups(parts, label), name=name)


def expert_groups(mesh: Mesh, ep: int) -> ExpertGroups:
    """This rank's ep group and expert replica group. Collective: every rank must call it."""
    ep_parts, replica_parts = expert_partitions(mesh.device_mesh.mesh, ep)
    # Every rank is in exactly one ep group, so the groups stacked are a mesh of the whole world,
    # and its "ep" dim is this rank's group: what a DTensor Shard(0) of the experts lives on.
    device_mesh = (DeviceMesh(mesh.device_type, torch.tensor(ep_parts), mesh_dim_names=("ep_groups", "ep"))["ep"]
                   if ep > 1 else None)
    return ExpertGroups(ep=_group(mesh, ep_parts, "ep", "ep", may_be_grad=False),
                        replicas=_group(mesh, replica_parts, "expert_dp", "dp", may_be_grad=True), cp=mesh.group("cp"),
                        device_mesh=device_mesh)


# ---- dispatch -----------------------------------------------------------------------------------
class ExpertParallelDispatch:
    """Drop-in for model.local_dispatch: the same math, with each expert's rows computed on its owner.

    Row order is what makes it exact: sorting copies by expert (stably) puts them in owner order;
    an owner receives its rows source-major, regroups them expert-major, so each expert sees the
    rows of rank 0, then rank 1, ... in token order: the rows one process would give it if it
    held every rank's tokens in rank order.
    """

    def __init__(self, group: AxisGroup, n_experts: int):
        self.group, self.n_experts = group, n_experts

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, experts_idx: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        ep, n_local = self.group.size, experts.gate.shape[0]  # n_local = E / ep
        order, counts = sort_by_expert(experts_idx, self.n_experts)  # (M,) sorted kept copies, (E,)
        token_of_copy = order // experts_idx.shape[1]  # (M,) source token of each copy

        # 1. Counts first: received[s, e] = rows source rank s sends to local expert e.
        received = torch.empty_like(counts)  # (ep E/ep,)
        comms.all_to_all(received, counts, self.group, [n_local] * ep, [n_local] * ep)
        received = received.view(ep, n_local)  # (ep, E/ep)
        in_splits = counts.view(ep, n_local).sum(1).tolist()  # rows to each rank
        out_splits = received.sum(1).tolist()  # rows from each rank

        # 2. Dispatch: rows arrive source-major, (s, e) segments in that order.
        rows = comms.all_to_all_rows(x[token_of_copy], self.group, out_splits, in_splits)  # (R, dim)

        # 3. Regroup expert-major: stable sort of the rows by (expert, source).
        segment = torch.arange(ep * n_local, device=x.device).repeat_interleave(received.reshape(-1))  # (R,) s E/ep + e
        regroup = torch.argsort((segment % n_local) * ep + segment // n_local, stable=True)  # (R,)
        y = experts(rows[regroup], received.sum(0).tolist())  # (R, dim)
        y = torch.empty_like(y).index_copy(0, regroup, y)  # back to source-major

        # 4. Combine: every row returns to the rank and slot it came from.
        y = comms.all_to_all_rows(y, self.group, in_splits, out_splits)  # (M, dim), in `order`
        y = y * weights.reshape(-1)[order, None].to(y.dtype)
        return y.new_zeros(x.shape).index_add_(0, token_of_copy, y)  # (N, dim)


# ---- sharding -----------------------------------------------------------------------------------
def moe_blocks(model: nn.Module) -> dict[str, MoE]:
    """Every MoE block of the model by module name ("layers.3.ffn"), in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, MoE)}


@torch.no_grad()
def shard_experts(experts: GroupedExperts, group: AxisGroup) -> None:
    """Keep experts [r E/ep, (r+1) E/ep) of rank r, under the same parameter names.

    Each kept tensor records the dim it was split along (`ep_dim`), as tensor parallel's `tp_dim`:
    data parallel and checkpoints tell expert weights apart by it.
    """
    for name in ("gate", "up", "down"):
        full = getattr(experts, name)
        part = nn.Parameter(full.detach().chunk(group.size, dim=0)[group.rank].clone())  # (E/ep, ...)
        part.ep_dim = 0
        setattr(experts, name, part)


def is_expert_parameter(p: torch.Tensor) -> bool:
    return hasattr(p, "ep_dim")


@torch.no_grad()
def gather_expert_shards(tensors: dict[str, torch.Tensor], model: nn.Module, group: AxisGroup) -> dict[str, torch.Tensor]:
    """Whole (E, ...) tensors from each ep rank's expert slices, for the keys naming expert
    parameters (values: the parameters, their gradients, ...); other entries pass through."""
    sharded = {name for name, p in model.named_parameters() if is_expert_parameter(p)}
    out = dict(tensors)
    for name in sorted(sharded & tensors.keys()):  # the same order on every rank
        local = tensors[name].contiguous()
        full = local.new_empty((group.size * local.shape[0], *local.shape[1:]))
        comms.all_gather(full, local, group)
        out[name] = full
    return out


def expert_shards_as_dtensors(state: dict, model: nn.Module, groups: ExpertGroups | None, prefix: str = "") -> dict:
    """Expert tensors of `state` as DTensors Shard(0) on the ep group, so a checkpoint records all
    E experts and loads under any ep."""
    if groups is None or groups.device_mesh is None:
        return state
    dims = {name: p.ep_dim for name, p in model.named_parameters() if is_expert_parameter(p)}
    return shards_as_dtensors(state, dims, groups.device_mesh, prefix)


def _summed_over(group: AxisGroup):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        comms.all_reduce(t, group)
        return t
    return reduce


def apply_expert_parallel(model: nn.Module, mesh_or_groups: Mesh | ExpertGroups, ep: int = 1) -> ExpertGroups:
    """Shard every MoE block's experts over the ep group and install the all-to-all dispatch.

    Collective when given a Mesh (it builds the groups). A no-op for the experts at ep = 1; with
    context parallel the balance loss still learns to sum its counts over cp. Returns the groups:
    data parallel needs `replicas` for the expert gradients.
    """
    groups = mesh_or_groups if isinstance(mesh_or_groups, ExpertGroups) else expert_groups(mesh_or_groups, ep)
    for moe in moe_blocks(model).values():
        if groups.cp is not None and groups.cp.size > 1:
            moe.sequence_reduce = _summed_over(groups.cp)
        if groups.ep.size == 1:
            continue
        if moe.n_experts % groups.ep.size:
            raise ValueError(f"{moe.n_experts} experts do not split over ep = {groups.ep.size}")
        shard_experts(moe.experts, groups.ep)
        moe.dispatch = ExpertParallelDispatch(groups.ep, moe.n_experts)
    return groups


# ---- load balancing: what the training loop calls --------------------------------------------------
@dataclass
class ExpertStats:
    """One step's routing, summed over the grad view (every rank holds the same numbers)."""

    load: dict[str, list[int]] = field(default_factory=dict)  # block -> copies routed to each expert
    dropped: dict[str, int] = field(default_factory=dict)  # block -> copies over capacity
    balance_loss: dict[str, float] = field(default_factory=dict)  # block -> mean over sequences, without alpha

    def max_over_mean(self) -> dict[str, float]:
        """Per block: the busiest expert's load over the mean load (1.0 = perfectly balanced)."""
        return {k: max(v) * len(v) / max(sum(v), 1) for k, v in self.load.items()}


def set_balance_loss_scale(model: nn.Module, sequences: int, loss_scale: float = 1.0) -> None:
    """Before each step: `sequences` = the step's global batch (sequences over all micro-batches
    and dp ranks; cp ranks share theirs), `loss_scale` = the fp16 loss scale (1 otherwise). The
    balance loss's gradient is then alpha x loss_scale x d(mean over sequences)/d(scores)."""
    for moe in moe_blocks(model).values():
        moe.step_sequences, moe.loss_scale = sequences, loss_scale


def expert_stats(model: nn.Module, group: AxisGroup | None = None, label: str | None = None) -> ExpertStats:
    """The step's loads, drops and balance loss per MoE block, summed over `group` (the grad
    view) in one all-reduce. Collective over `group`; `label` charges it elsewhere ("log")."""
    blocks = moe_blocks(model)
    if not blocks:
        return ExpertStats()
    rows = [torch.cat([m.step_load.double(), m.step_dropped.double().view(1), m.step_balance_loss.view(1)])
            for m in blocks.values()]
    total = torch.stack(rows)  # (blocks, E + 2), float64: integer counts stay exact below 2**53
    if group is not None:
        comms.all_reduce(total, group, label=label)
    stats = ExpertStats()
    for (name, moe), row in zip(blocks.items(), total.tolist()):
        stats.load[name] = [int(v) for v in row[:-2]]
        stats.dropped[name] = int(row[-2])
        stats.balance_loss[name] = row[-1] / max(moe.step_sequences, 1)
    return stats


@torch.no_grad()
def update_expert_bias(model: nn.Module, stats: ExpertStats, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free update after an optimizer step: b_e += u sign(mean - load_e).

    `stats` must be summed over the grad view (expert_stats with mesh.group("grad")), so every
    replica moves its bias identically. A block that saw no tokens stays where it is (sign(0) = 0).
    """
    for name, moe in moe_blocks(model).items():
        load = torch.tensor(stats.load[name], dtype=torch.float32, device=moe.expert_bias.device)  # (E,)
        moe.expert_bias += rate * torch.sign(load.mean() - load)


def reset_expert_counts(model: nn.Module) -> None:
    """Zero the per-step totals: call after reading them, before the next step's first forward."""
    for moe in moe_blocks(model).values():
        moe.step_load.zero_()
        moe.step_dropped.zero_()
        moe.step_balance_loss.zero_()
