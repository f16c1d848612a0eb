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

from functools import partial
from typing import Literal

from torch.utils.checkpoint import checkpoint

from fivefold.model import Transformer


def _recomputed(fn, *args):
    return checkpoint(fn, *args, use_reentrant=False)


def apply_recompute(model: Transformer, mode: Literal["none", "selective", "full"]) -> None:
    for block in model.layers.values():
        if mode == "full":
            block.forward = partial(_recomputed, partial(type(block).forward, block))
        elif mode == "selective":
            block.attn.core = partial(_recomputed, block.attn.core)
