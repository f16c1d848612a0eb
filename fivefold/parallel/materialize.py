"""From the meta device to this rank's memory: empty tensors for exactly what this rank holds.

The training loop builds the model on the meta device (shapes, no memory) and parallelizes it there:
pipeline stages delete the layers they do not run, tensor and expert parallel keep their slices of
the rest. Only then does a rank allocate, and only what it holds: data parallel (ddp.py) makes
every remaining meta parameter a tensor on the rank's device, and ZeRO-3 (fsdp.py) makes its
parameters placeholders without storage (their values live in the shards). The values come next,
from one source, written through the layout's own state dict (train/loop.py): the seeded
initialisation (model/seeded_init.py), `checkpoint.init_from` weights, or a checkpoint being resumed.
A model already holding real tensors (tests, the benchmarks' peers) is left as it is.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

# Attributes the parallel code sets on the tensors it slices (the dim they were split along) or
# whose gradients it completes (tp_partial, expert.py), and the model's no_decay (the experts'
# stacked biases, parallel/optimizer.py): a replacement carries them over.
MARKS = ("tp_dim", "ep_dim", "tp_partial", "no_decay")
# Set on every tensor made here: on the meta device (the dry run, dry_run.py) a made parameter is
# still meta, and must not be made again (hooks and ZeRO-3's units hold the tensor itself).
_MADE = "_materialized"


def _unmade(p: torch.Tensor | None) -> bool:
    return p is not None and p.is_meta and not getattr(p, _MADE, False)


def _empty(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dtype, device=device)


def freed(p: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of p's shape whose storage is released at once (ZeRO-3 gathers into it later). The
    allocation is momentary: on a CPU its pages are never touched; on a GPU the caching allocator
    keeps the block for the next tensor, no larger than the parameter a gather fills anyway."""
    t = _empty(p, device)
    t.untyped_storage().resize_(0)
    return t


def carry_marks(p: torch.Tensor, new: torch.Tensor, marks: tuple[str, ...] = MARKS) -> torch.Tensor:
    """`new`, which replaces p (a slice, a materialised tensor), with p's `marks`."""
    for mark in marks:
        if hasattr(p, mark):
            setattr(new, mark, getattr(p, mark))
    return new


def _replacement(p: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    new = nn.Parameter(data, requires_grad=p.requires_grad)
    setattr(new, _MADE, True)
    return carry_marks(p, new)


def materialize(module: nn.Module, device: torch.device,
                make: Callable[[torch.Tensor, torch.device], torch.Tensor] = _empty) -> None:
    """Replace every meta parameter of `module` by `make(p, device)` (empty by default) and every
    meta buffer by zeros (every buffer of the model starts at zero). A parameter two modules share
    (tied embeddings) stays one parameter; requires_grad and the slicing marks are kept."""
    made: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if _unmade(p):
                if id(p) not in made:
                    made[id(p)] = _replacement(p, make(p, device))
                sub._parameters[name] = made[id(p)]
        for name, b in list(sub._buffers.items()):
            if b is not None and b.is_meta:
                sub._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def materialize_parameter(module: nn.Module, name: str, device: torch.device) -> nn.Parameter:
    """Parameter `name` of `module` on `device` (allocated empty if it is still meta), for code that
    must attach a hook to the tensor itself before data parallel allocates the rest."""
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    p = owner._parameters[leaf]
    if _unmade(p):
        owner._parameters[leaf] = _replacement(p, _empty(p, device))
    return owner._parameters[leaf]
