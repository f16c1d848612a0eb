"""Memory of one rank: model state (parameters, gradients, optimizer state), activations, buffers.

Model state follows the ZeRO paper's accounting (Rajbhandari et al. 2020, sec. 3.1: mixed-precision
Adam keeps 2 + 2 + 12 = 16 bytes per parameter, a bf16 weight and gradient and fp32 master weight,
momentum and variance): with N = dp_shard ranks and b_p, b_g, b_o bytes per parameter for the
weight, its gradient and its optimizer state (sec. 5),

    DDP     (b_p + b_g + b_o) P           ZeRO-2   (b_p + (b_g + b_o) / N) P
    ZeRO-1  (b_p + b_g + b_o / N) P       ZeRO-3   (b_p + b_g + b_o) P / N

where P is the parameters this rank holds after tp / ep / pp splitting (layout.rank_shares).
Activations use the shared per-block formula (activations.py) times the blocks of one stage chunk
times the chunks a schedule keeps in flight (simulate().peak_inflight), plus the logits of the
last stage. Buffers are the communication staging the parallel code allocates (below).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.config import Config
from fivefold.planner.activations import block_activation_bytes
from fivefold.planner.layout import RankShare
from fivefold.validate import Derived, reshard_after_forward


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes of one parameter's weight, gradient and optimizer state (`--bytes 2,2,12`)."""

    param: float = 2.0  # bf16 weight
    grad: float = 2.0  # bf16 gradient
    optimizer: float = 12.0  # fp32 master weight + two fp32 Adam moments (8 without the master copy)

    @classmethod
    def parse(cls, text: str) -> "BytesPerParam":
        parts = [float(x) for x in text.split(",")]
        if len(parts) != 3 or min(parts) < 0:
            raise ValueError(f"--bytes '{text}': give three numbers, weight,gradient,optimizer (e.g. 2,2,12)")
        return cls(*parts)

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


def model_state_bytes(params: float, b: BytesPerParam, zero: int, n: int) -> dict[str, float]:
    """Bytes per rank of `params` parameters under ZeRO stage `zero` sharded over n ranks."""
    out = {"params": params * b.param / (n if zero >= 3 else 1),
           "grads": params * b.grad / (n if zero >= 2 else 1),
           "optimizer": params * b.optimizer / (n if zero >= 1 else 1)}
    return {**out, "total": sum(out.values())}


def largest_fitting_model(memory_bytes: float, b: BytesPerParam, zero: int, n: int) -> float:
    """Parameters whose model state alone fills `memory_bytes` per rank (the "does it fit" table)."""
    return memory_bytes / model_state_bytes(1.0, b, zero, n)["total"]


def fivefold_state_bytes(cfg: Config, params: float, n: int, grad_accum: int) -> dict[str, float]:
    """What fivefold's own data-parallel code holds, as its metrics log samples it (after each
    micro-batch's backward): weights and gradients stay fp32 whatever train.dtype (autocast
    computes in bf16), AdamW keeps two fp32 moments (DDP), and ZeRO steps fp32 master shards
    (4 + 8 bytes per parameter over N). ZeRO-1 keeps the full gradient across micro-batches and
    frees it once reduced into the shard; ZeRO-2/3 never keep it; ZeRO-3 frees gathered weights.
    """
    zero = cfg.parallel.zero
    if zero == 0:
        out = {"params": 4.0 * params, "grads": 4.0 * params, "optimizer": 8.0 * params}
    else:
        # ZeRO-1 with accumulation: the largest sample is a non-last micro-batch's, full gradient
        # held and the shard's gradient not yet made (it is dropped after each optimizer step)
        grads = 4.0 * params if zero == 1 and grad_accum > 1 else 4.0 * params / n
        out = {"params": 0.0 if zero == 3 else 4.0 * params, "grads": grads,
               "optimizer": 12.0 * params / n}
    return {**out, "total": sum(out.values())}


def rank_state_bytes(cfg: Config, d: Derived, share: RankShare, b: BytesPerParam,
                     implementation: bool) -> dict[str, float]:
    """A pipeline rank's model state, ZeRO's accounting (or fivefold's own with `implementation`):
    its dense parameters sharded over dp_shard and, with ZeRO and ep > 1, its experts over the
    ranks holding the same experts (expert_dp = dp x cp / ep), as parallel/zero.py shards them."""
    p = cfg.parallel
    expert = share.expert_params if p.ep > 1 and p.zero else 0
    parts = [(share.params - expert, d.dp_shard), (expert, d.dp * p.cp // p.ep)]
    states = [fivefold_state_bytes(cfg, n_params, n, d.grad_accum) if implementation
              else model_state_bytes(n_params, b, p.zero, n) for n_params, n in parts]
    return {k: sum(st[k] for st in states) for k in states[0]}


def activation_bytes(cfg: Config, share: RankShare, inflight_chunks: int, local_seq: int, vocab: int,
                     act_bytes: int) -> dict[str, float]:
    """Bytes kept for backward on one pipeline rank at its peak.

    blocks: block_activation_bytes (activations.py) for one micro-batch of (micro_batch, seq/cp)
    tokens, x the blocks of one chunk, x the chunks in flight (1 without a pipeline: each
    micro-batch's backward runs before the next forward). logits: the last stage keeps its
    (micro_batch, seq/cp, V/tp) logits and their fp32 copy for the loss, one micro-batch at a time.
    """
    m, p, t = cfg.model, cfg.parallel, cfg.train
    per_block = block_activation_bytes(m, t.micro_batch, local_seq, p.tp, p.sp, t.recompute, act_bytes)
    blocks = per_block * share.chunk_blocks * inflight_chunks
    logits = t.micro_batch * local_seq * (vocab / p.tp) * (act_bytes + 4) if share.last else 0.0
    return {"blocks": blocks, "logits": logits, "per_block_microbatch": per_block, "total": blocks + logits}


def buffer_bytes(cfg: Config, share: RankShare, b: BytesPerParam, local_seq: int, act_bytes: int,
                 grad_ranks: int) -> dict[str, float]:
    """Communication staging (order of magnitude, not a byte count):

    dp: two gradient buckets in flight (parallel.bucket_mb each: one reducing while the next
    fills, data.py; no more than the gradients); ZeRO-3: the gathered weights of two units (current and
    prefetched, fsdp.py), or kept gathered (the default with pipelines) the rank's whole stages and
    their unsharded gradients during the step;
    pp: one activation sent and one received per micro-batch; tp with sp: one gathered input.
    """
    p, t, d = cfg.parallel, cfg.train, cfg.model.dim
    dp = (0.0 if grad_ranks <= 1 else min(2 * p.bucket_mb * 1e6, share.params * b.grad) if p.zero < 3
          else 2 * share.largest_unit * b.param if reshard_after_forward(p) else share.params * (b.param + b.grad))
    out = {"dp": dp,
           "pp": 2 * t.micro_batch * local_seq * d * act_bytes / (p.tp if p.sp else 1) if p.pp > 1 else 0.0,
           "tp": t.micro_batch * local_seq * d * act_bytes if p.tp > 1 and p.sp else 0.0}
    return {**out, "total": sum(out.values())}
