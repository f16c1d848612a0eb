"""Data parallel: every rank holds the whole model and sees different samples; gradients are summed.

What is sharded: the batch, over the `batch` view (dp). Collectives: none in forward; in backward
one all-reduce (SUM) of the gradients over the `grad` view (dp x cp), once per optimizer step,
after the last micro-batch, so gradient accumulation costs no communication on the others.

Gradients are summed, not averaged: each rank's loss is already divided by the global token count
of the step (train/loop.py), so the sum over ranks is exactly the gradient of the mean loss over
every token of the global batch, however the tokens are spread over ranks, micro-batches and
padding.

This first version reduces all gradients in one coalesced all-reduce after backward. The bucketed
version that overlaps the all-reduce with backward, and ZeRO-1/2, build on this class.
"""

from __future__ import annotations

import torch
from torch import nn

from fivefold.parallel import comms
from fivefold.parallel.comms import AxisGroup


class DataParallel:
    """Sums the gradients of `model` over `group` when `reduce_gradients()` is called."""

    def __init__(self, model: nn.Module, group: AxisGroup):
        self.model = model
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """All-reduce every gradient (SUM) over the group in one flat buffer.

        A parameter without a gradient on this rank (an MoE expert that got no tokens here) takes
        part with zeros: every rank must contribute the same buffer layout, or the collective hangs.
        """
        if self.group.size == 1:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])  # (total numel,)
        comms.all_reduce(flat, self.group)
        for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(chunk.view_as(g))
