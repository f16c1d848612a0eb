"""MoE load balancing, as a hook around each training step (DeepSeek-V3 technical report, sec. 2.1.2).

- before the step: tell each MoE block how many sequences the step has and the fp16 loss scale,
  so the balance loss it injects in backward is alpha x its mean over the global batch
  (`set_balance_loss_scale`);
- after the optimizer step: the step's per-expert loads, drops and balance loss per block, summed
  over the grad view in one all-reduce (and over tp with sequence parallel, where each tp rank
  routed its own tokens) (`expert_stats`; counted in backward, so neither evaluation
  nor recomputed forwards count), then the auxiliary-loss-free bias update
  b_e += u x sign(mean load - load_e), the same on every replica (`update_expert_bias`), then the
  counters start again (`reset_expert_counts`).

The routing itself, capacity dropping and the balance loss live in the model (fivefold/model/moe.py);
how experts are split over ranks in parallel/expert.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.config.schema import Config
from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup
from fivefold.parallel.expert import moe_blocks
from fivefold.parallel.mesh import Mesh


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
    and dp ranks; cp ranks, and tp ranks under sp, share theirs), `loss_scale` = the fp16 loss scale (1 otherwise). The
    balance loss's gradient is then alpha x loss_scale x d(mean over sequences)/d(scores)."""
    for moe in moe_blocks(model).values():
        moe.step_sequences, moe.loss_scale = sequences, loss_scale


def expert_stats(model: nn.Module, *groups: AxisGroup, label: str | None = None) -> ExpertStats:
    """The step's loads, drops and balance loss per MoE block, summed over `groups` (the grad
    view; and tp under sp, whose ranks route other tokens) in one all-reduce each. Collective over
    `groups`; `label` charges it elsewhere ("log")."""
    blocks = moe_blocks(model)
    if not blocks:
        return ExpertStats()
    rows = [torch.cat([m.step_load.double(), m.step_dropped.double().view(1), m.step_balance_loss.view(1)])
            for m in blocks.values()]
    total = torch.stack(rows)  # (blocks, E + 2), float64: integer counts stay exact below 2**53
    for group in groups:
        collectives.all_reduce(total, group, label=label)
    stats = ExpertStats()
    for (name, moe), row in zip(blocks.items(), total.tolist(), strict=True):
        stats.load[name] = [int(v) for v in row[:-2]]
        stats.dropped[name] = int(row[-2])
        stats.balance_loss[name] = row[-1] / max(moe.step_sequences, 1)
    return stats


@torch.no_grad()
def update_expert_bias(model: nn.Module, stats: ExpertStats, rate: float, applied: torch.Tensor | bool = True) -> None:
    """DeepSeek-V3's auxiliary-loss-free update after an optimizer step: b_e += u sign(mean - load_e).

    `stats` must be summed over the grad view (expert_stats with mesh.group("grad"), and tp under
    sp), so every replica moves its bias identically. A block that saw no tokens stays where it is (sign(0) = 0).
    `applied`: whether the optimizer stepped, a bool tensor on the device (decided there, not read):
    a skipped step moves no bias.
    """
    for name, moe in moe_blocks(model).items():
        load = torch.tensor(stats.load[name], dtype=torch.float32, device=moe.expert_bias.device)  # (E,)
        moe.expert_bias += torch.where(torch.as_tensor(applied, device=load.device),
                                       rate * torch.sign(load.mean() - load), 0.0)


def reset_expert_counts(model: nn.Module) -> None:
    """Zero the per-step totals: call after reading them, before the next step's first forward."""
    for moe in moe_blocks(model).values():
        moe.step_load.zero_()
        moe.step_dropped.zero_()
        moe.step_balance_loss.zero_()


class MoEBalancing:
    """The hook the training step calls: before(), then after() the optimizer step."""

    def __init__(self, model: nn.Module, mesh: Mesh, cfg: Config):
        self.model, self.mesh = model, mesh
        # Ranks that routed other tokens: the grad view, and with sp the tp ranks (parallel/expert.py).
        self.groups = [mesh.group("grad")] + ([mesh.group("tp")] if cfg.parallel.sp else [])
        self.sequences, self.rate = cfg.train.global_batch, cfg.model.moe.bias_update
        self.enabled = cfg.model.moe.n_experts > 0

    def before(self, loss_scale: float) -> None:
        set_balance_loss_scale(self.model, self.sequences, loss_scale)

    def after(self, applied: torch.Tensor | bool) -> dict:
        """Read, apply and reset the step's routing; returns its metrics for the step record (MoE only).
        Collective over the grad view (and, with several stages holding MoE blocks, over pp)."""
        routing = expert_stats(self.model, *self.groups, label="log")  # summed over every token of the step
        if self.rate:  # a skipped step (applied False on the device) moves nothing
            update_expert_bias(self.model, routing, self.rate, applied)
        reset_expert_counts(self.model)
        return self._metrics(routing) if self.enabled else {}

    def _metrics(self, routing: ExpertStats) -> dict:
        """Copies routed to each expert per MoE block (all stages), and each block's max/mean load."""
        # Each stage counted its own blocks (a group of one stage returns its own at once).
        parts = collectives.all_gather_object(routing, self.mesh.group("pp"), "gather of the routing statistics")
        every = ExpertStats(load={k: v for part in parts for k, v in part.load.items()},
                            dropped={k: v for part in parts for k, v in part.dropped.items()})
        return {"expert_load": every.load, "expert_dropped": every.dropped,
                "expert_max_over_mean": every.max_over_mean()}
