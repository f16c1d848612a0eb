"""The numbers a layout derives from its config: degrees, micro-batches, per-rank shapes.

`derive(cfg, world_size, vocab)` computes, once, what follows from a config that `validate()`
accepted (fivefold/validate/): the data-parallel degree that fills the world, micro-batches per step,
the tokens a rank holds of one sequence, the padded vocabulary, ... Every dimension's
`apply_<dim>`, the planner and the training loop read these from one `Derived`, so no module
recomputes them its own way. Pure arithmetic: it reads no files and imports no torch. The one
number that comes from files, the vocabulary, is resolved by fivefold/data/ (`unpadded_vocab`)
and handed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivefold.config.schema import Config, ParallelConfig


@dataclass(frozen=True)
class Derived:
    world_size: int
    dp: int  # data-parallel degree (dp_replicate x dp_shard)
    dp_shard: int
    grad_accum: int  # micro-batches per optimizer step on each rank
    tokens_per_step: int  # global_batch x seq_len
    local_seq_len: int  # tokens of one sequence held by one rank (seq_len / cp)
    vocab_size: int  # model vocabulary after padding
    vocab_limit: int  # token ids from here on are padding: the loss gives them no probability
    head_dim: int
    reshard_after_forward: bool  # zero=3: parallel.reshard_after_forward with "auto" resolved


def padded_vocab(cfg: Config, vocab: int) -> int:
    """model.vocab_size, or `vocab` (data/resolve.py: unpadded_vocab) padded to a multiple of
    data.vocab_multiple, which the tp degrees divide."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    m = max(cfg.data.vocab_multiple, 1)
    return math.ceil(vocab / m) * m


def data_parallel_degree(cfg: Config, world_size: int) -> int:
    """parallel.dp, or with dp = 0 every process that pp x cp x tp leaves (0: they do not divide it)."""
    p = cfg.parallel
    if p.dp:
        return p.dp
    rest = p.pp * p.cp * p.tp
    return world_size // rest if rest > 0 and world_size % rest == 0 else 0


def reshard_after_forward(p: ParallelConfig) -> bool:
    """parallel.reshard_after_forward with "auto" resolved: reshard without pipelines, keep gathered
    with them (a pipeline's next forward of the same chunk follows soon; fsdp.py)."""
    return p.pp == 1 if p.reshard_after_forward == "auto" else p.reshard_after_forward


def derive(cfg: Config, world_size: int, vocab: int) -> Derived:
    """Dependent numbers of a config that validate() accepted, on `world_size` processes; `vocab`:
    the model's vocabulary before padding (fivefold/data/resolve.py: unpadded_vocab)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = data_parallel_degree(cfg, world_size)
    return Derived(
        world_size=world_size,
        dp=dp,
        dp_shard=dp // p.dp_replicate,
        grad_accum=t.global_batch // (dp * t.micro_batch),
        tokens_per_step=t.global_batch * t.seq_len,
        local_seq_len=t.seq_len // p.cp,
        vocab_size=padded_vocab(cfg, vocab),
        vocab_limit=vocab,
        head_dim=m.head_dim or m.dim // m.n_heads,
        reshard_after_forward=reshard_after_forward(p),
    )
