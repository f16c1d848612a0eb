"""Expert parallel: the routed experts of each MoE block split over `ep` ranks, tokens sent to them.

What is sharded: the stacked expert weights (E, dim, hidden) of every MoE block, and their biases
(E, hidden) / (E, dim) with model.moe.linear_bias, along dim 0. The ep ranks of one group hold experts
[r E/ep, (r+1) E/ep) each, and see different tokens (they are data- or context-parallel ranks).
Everything else (attention, router and its bias, shared experts, the routing bias) stays replicated.

Groups: the mesh's "ep" view (parallel/mesh.py carves it out of the grad view, dp_replicate x dp_shard x
cp): the ep ranks of one group hold different experts and see different tokens. The grad ranks
with the same ep rank hold the same experts; they form the "expert_dp" view ("expert data
parallel", size dp x cp / ep, charged to "dp"). An expert's gradient already holds every token of
its ep group that was routed to it, so data parallel sums expert gradients over expert_dp only,
and every other gradient over the whole grad view.

What travels, per MoE block and micro-batch (all-to-alls inside the ep group, charged to "ep"):
  forward:  1. counts: how many copies this rank sends to each expert (E integers), so every rank
               knows how many rows it will receive from each other rank;
            2. dispatch: the token copies, sorted by expert (hence by owning rank), unequal splits;
            3. combine: the experts' outputs go back the same way, splits swapped.
  backward: the conjugates: the combine's gradient travels like a dispatch and the dispatch's
            like a combine (an all-to-all's adjoint is the all-to-all with the splits swapped).
Only rows that leave the rank count as wire bytes: a copy routed to a local expert costs nothing.

With sequence parallel (`parallel.sp`), as in Megatron-LM, the MoE block's input stays split along
the sequence: each tp rank routes its own T/tp tokens (through its own ep group: ep groups are
carved at each tp place), so the MoE's compute is split over tp instead of repeated on every tp
rank. Its weights (router, routed and shared experts) are still whole on every tp rank, but each
rank's gradient now covers only its tokens: they are marked `tp_partial` and summed over tp once
per step (`sum_partial_gradients`, before clipping), and the per-sequence counts of the balance
loss are summed over tp as over cp (the tp ranks hold other tokens of the same sequences).

Load balancing (the routing bias update, the balance loss's scale, the routing statistics) is a
training concern: train/moe_balance.py (with sp it sums the counts over tp too). Capacity dropping
(GShard, Switch) and the balance loss itself live in the model (fivefold/model/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.moe import GroupedExperts, MoE, sort_by_expert
from fivefold.parallel.comm import collectives, regions
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.materialize import carry_marks
from fivefold.parallel.mesh import Mesh


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
                 experts: GroupedExperts, drops: bool = True) -> torch.Tensor:
        ep, n_local = self.group.size, experts.gate.shape[0]  # n_local = E / ep
        order, counts = sort_by_expert(experts_idx, self.n_experts)  # (N k,) dropped copies first, (1 + E,)

        # 1. Counts first: received[s, e] = rows source rank s sends to local expert e.
        sent = counts[1:]  # (E,)
        received = torch.empty_like(sent)  # (ep E/ep,)
        collectives.all_to_all(received, sent, self.group, [n_local] * ep, [n_local] * ep)
        # The layer's one read: every size the all-to-alls below need (`drops`: whether any copy can be dropped).
        host = torch.cat([counts, received]).tolist()
        dropped, sent_host, received_host = host[0], host[1:1 + self.n_experts], host[1 + self.n_experts:]
        order = order[dropped:]  # (M,) the kept copies
        token_of_copy = order // experts_idx.shape[1]  # (M,) source token of each copy
        in_splits = [sum(sent_host[r * n_local:(r + 1) * n_local]) for r in range(ep)]  # rows to each rank
        out_splits = [sum(received_host[s * n_local:(s + 1) * n_local]) for s in range(ep)]  # rows from each rank
        local_sizes = [sum(received_host[s * n_local + e] for s in range(ep)) for e in range(n_local)]

        # 2. Dispatch: rows arrive source-major, (s, e) segments in that order.
        rows = regions.all_to_all_rows(x[token_of_copy], self.group, out_splits, in_splits)  # (R, dim)

        # 3. Regroup expert-major: stable sort of the rows by (expert, source).
        segment = torch.arange(ep * n_local, device=x.device).repeat_interleave(
            received, output_size=sum(out_splits))  # (R,) s E/ep + e; its size given: no read
        regroup = torch.argsort((segment % n_local) * ep + segment // n_local, stable=True)  # (R,)
        y = experts(rows[regroup], received.view(ep, n_local).sum(0), local_sizes)  # (R, dim)
        y = torch.empty_like(y).index_copy(0, regroup, y)  # back to source-major

        # 4. Combine: every row returns to the rank and slot it came from.
        y = regions.all_to_all_rows(y, self.group, in_splits, out_splits)  # (M, dim), in `order`
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
    data parallel and checkpoints tell expert weights apart by it (state_dict.is_expert_parameter).
    """
    for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias"):
        full = getattr(experts, name)
        if full is None:  # no expert biases (model.moe.linear_bias off)
            continue
        part = nn.Parameter(full.detach().chunk(group.size, dim=0)[group.rank].clone(),  # (E/ep, ...)
                            full.requires_grad)  # frozen stays frozen (LoRA's base)
        carry_marks(full, part)
        part.ep_dim = 0
        setattr(experts, name, part)


def _summed_over(groups: list[AxisGroup]):
    def reduce(t: torch.Tensor) -> torch.Tensor:
        for group in groups:
            collectives.all_reduce(t, group)
        return t
    return reduce


def is_tp_partial(p: torch.Tensor) -> bool:
    """Replicated over tp, but fed only this tp rank's tokens (an MoE weight under sp): its
    gradient is this rank's share, summed over tp by `sum_partial_gradients`."""
    return getattr(p, "tp_partial", False)


@dataclass(frozen=True)
class ExpertParallel:
    """The group one MoE block's experts are split over (size 1 without expert parallel), and the
    tp group the tp_partial gradients are summed over: MoE's under sequence parallel, and LoRA's
    whole factors under tensor parallel (parallel/tensor.py `_split_adapter`)."""

    group: AxisGroup
    token_group: AxisGroup  # tp: where tp_partial gradients are summed (sp's MoE, LoRA's whole factors)

    def sum_partial_gradients(self, params: list[nn.Parameter], gradient_of: Callable[[nn.Parameter], torch.Tensor],
                              device: torch.device | None = None) -> None:
        """Sum the tp_partial gradients over tp, in place, once per step after backward (data
        parallel has summed them over the grad view already: the sums commute). `gradient_of`:
        the gradient the optimizer applies (ZeRO: this rank's rows, the same rows on every tp rank).
        Collective over tp, one all-reduce of them all (as the planner prices it), on `device` when
        the gradients are elsewhere (offload = "params": on the host); nothing when none is marked."""
        grads = [gradient_of(p) for p in params if is_tp_partial(p)]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,): the same sums, one collective
        flat = flat.to(device) if device is not None else flat
        collectives.all_reduce(flat, self.token_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


def apply_expert_parallel(model: nn.Module, mesh: Mesh, cfg: Config, derived: Derived) -> ExpertParallel:
    """Shard every MoE block's experts over the mesh's ep group and install the all-to-all dispatch.

    A no-op for the experts at ep = 1; with context parallel (and sequence parallel) the balance loss
    still learns to sum its counts over cp (and tp): its sequences are split there. With sp every
    MoE parameter is marked tp_partial (after the experts are sliced, so the mark is on the kept tensors).
    """
    group, tp = mesh.group("ep"), mesh.group("tp")
    token_split = cfg.parallel.sp and tp.size > 1
    sequence_split = [g for g in (mesh.group("cp"), tp if token_split else None) if g is not None and g.size > 1]
    for moe in moe_blocks(model).values():
        if sequence_split:
            moe.sequence_reduce = _summed_over(sequence_split)
        if group.size > 1:
            if moe.n_experts % group.size:
                raise ValueError(f"{moe.n_experts} experts do not split over ep = {group.size}")
            shard_experts(moe.experts, group)
            moe.dispatch = ExpertParallelDispatch(group, moe.n_experts)
        if token_split:
            for p in moe.parameters():
                p.tp_partial = True
    return ExpertParallel(group, tp)
