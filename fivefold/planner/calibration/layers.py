"""`fivefold calibrate --layers CONFIG`: time the model's own parts whole, at the shapes a config runs.

The pricer prices a part (a block, the embedding, the head with its loss) op by op from what the
calibration's generic chains cost (pricer.py, opcount.py). On a GPU that is enough; on a CPU a
small model's ops cost more in the model than in any chain: measured on the 2-core test machine,
one tiny block's forward and backward took 1.4-1.5x its op price, its matmuls 1.7x what the same
matmuls cost replayed alone, its reductions 2-5x, while both a larger block (debug: dim 128, 1024
tokens) and a block small enough to be all fixed cost came within 15%. What a cache and an
allocator do to an op depends on the ops around it, which no chain reproduces. So, as cost models
that plan parallel layouts do (Alpa, Zheng et al. 2022, and Galvatron, Miao et al. 2022, profile
the layers they place), the profile can time the parts themselves: each is built at one rank's
shapes (opcount.Part.build, initialised weights, the rank's heads, FFN width and vocabulary / tp)
and run forward and backward on real tensors, on every rank at once as training runs them, in
samples as long as a step (sampling.py). The pricer then takes a timed part's forward and backward
as they are and prices the rest of the step as before: tp, cp and ep collectives, the pipeline
schedule, the gradient reduction and its overlap, the optimizer and the Python around the parts
(overheads.py).

Nothing here sees a training run: the parts run alone, on fresh inputs, with no other block, no
loop and no collective.
"""

from __future__ import annotations

from typing import Any, Callable

from fivefold.config.derive import derive
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.planner.calibration.opcount import Part, end_parts
from fivefold.planner.calibration.sampling import SAMPLE_S, sample_turns
from fivefold.planner.layout import rank_shares


def config_parts(cfg: Config, world_size: int) -> list[Part]:
    """The distinct parts the ranks of `cfg` on `world_size` processes run (cfg must validate)."""
    m, t, tp = cfg.model, cfg.train, cfg.parallel.tp
    d = derive(cfg, world_size, unpadded_vocab(cfg))
    parts: dict[str, Part] = {}
    for share in rank_shares(cfg, model_counts(m, d.vocab_size)):
        for blk in share.blocks:
            part = Part("block", m, blk, 0, tp, t.micro_batch, d.local_seq_len)
            parts.setdefault(part.key, part)
        for part in end_parts(m, d.vocab_size, tp, t.micro_batch, d.local_seq_len, share.first, share.last,
                              t.loss_chunk):
            parts.setdefault(part.key, part)
    return list(parts.values())


def time_parts(parts: list[Part], samples: int = 5, min_s: float = SAMPLE_S) -> dict[str, tuple[float, float]]:
    """{part key: (forward s, backward s)}, medians of samples of at least min_s; the forward alone
    and forward + backward take turns (sampling.sample_turns), the backward is their difference."""
    timed = {}
    for part in parts:
        forward, params, inputs = part.build()
        t = sample_turns({"f": forward, "fb": _forward_backward(forward, params + inputs)}, samples, min_s)
        timed[part.key] = (t["f"], max(t["fb"] - t["f"], 0.0))
    return timed


def _forward_backward(forward: Callable[[], Any], leaves: list) -> Callable[[], None]:
    """forward() and its backward, the leaves' gradients dropped after: each sample starts as a
    step's first micro-batch does."""
    import torch

    def both() -> None:
        out = forward()
        out.backward(torch.ones_like(out))
        for p in leaves:
            p.grad = None

    return both

