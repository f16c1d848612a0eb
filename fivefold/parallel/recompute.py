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
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from fivefold.model import Transformer
from fivefold.parallel.timing import TIMER


def _timed_recompute():
    """checkpoint()'s contexts: none around the forward, the step timer's "recompute" part around
    the forward it runs again inside backward (its collectives still count to their axes)."""
    return contextlib.nullcontext(), TIMER.span("recompute")


def _recomputed(fn, *args):
    if torch.compiler.is_compiling():  # traced contexts must be TorchDispatchModes: left in compute
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_timed_recompute)


def apply_recompute(model: Transformer, mode: Literal["none", "selective", "full"]) -> None:
    for block in model.layers.values():
        if mode == "full":
            block.forward = partial(_recomputed, partial(type(block).forward, block))
        elif mode == "selective":
            block.attn.core = partial(_recomputed, block.attn.core)
