"""Activation recomputation: keep less for backward, compute it again when backward needs it.

- "full": each transformer block keeps only its input; backward re-runs the block's forward
  (about one extra forward per step, the biggest memory saving).
- "selective" (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models"): only the attention core is recomputed. With an attention kernel that materialises
  the score matrix its memory grows with the square of the sequence length while its compute is
  small, so recomputing it is cheap; flash kernels keep no score matrix and gain little.

Both wrap forward functions in place (parameter names, hence checkpoints, are unchanged) and work
under tensor and sequence parallel: a recomputed region runs its collectives again.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.model.transformer import Transformer
from fivefold.parallel.comm.timing import StepTimer
from fivefold.parallel.mesh import Mesh


def _recomputed(timer: StepTimer, fn, *args):
    if torch.compiler.is_compiling():  # traced contexts must be TorchDispatchModes: left in compute
        return checkpoint(fn, *args, use_reentrant=False)
    # checkpoint()'s contexts: none around the forward, the step timer's "recompute" part around
    # the forward it runs again inside backward (its collectives still count to their axes).
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=lambda: (contextlib.nullcontext(), timer.span("recompute")))


def apply_recompute(model: Transformer, mesh: Mesh, cfg: Config, derived: Derived) -> None:
    """Wrap each block (full) or its attention core (selective) in activation checkpointing."""
    mode = cfg.train.recompute
    for block in model.blocks():
        if mode == "full":
            block.forward = partial(_recomputed, mesh.timer, partial(type(block).forward, block))
        elif mode == "selective":
            block.attn.core = partial(_recomputed, mesh.timer, block.attn.core)
