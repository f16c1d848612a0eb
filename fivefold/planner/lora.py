"""LoRA's share of a layout (lora.rank > 0, model/lora.py), by formula from the model's shape: which
linear layers get an adapter, how tp cuts each, its elements, FLOPs and saved activations on a rank.
Pure arithmetic: the planner imports no torch (model/lora.py apply_lora is what this mirrors; a test
checks the two lists agree on the meta model).

An adapted layer (out, in) gets A (r, in) and B (out, r): r (in + out) elements. Routed experts get
none; everything else is frozen. Cut by tp as parallel/tensor.py _split_adapter cuts them:
- "column" (wq, wk, wv, MLA's wq_b / wkv_b, a dense SwiGLU's gate and up): B split by output rows, A
  whole on every tp rank, its gradient a partial sum (tp_partial);
- "row" (wo, a dense SwiGLU's down): A split by input columns, B whole and partial;
- "whole" (MLA's wq_a, wkv_a, the shared experts, the MTP depths' eh_proj): whole on every tp rank,
  each computing the same gradient (no sum).
The partial factors' gradients are all-reduced over tp once a step, all in one collective
(parallel/expert.py sum_partial_gradients: this rank's ZeRO rows of them).

Compute per token and adapted layer (Hu et al. 2021): forward x A^T then (.) B^T, 2 r (in + out)
FLOPs on the rank's widths; backward twice that (input and weight gradients of both factors).
Saved for backward: the r-wide intermediate x A^T (B's weight gradient reads it), r elements per
token in the compute dtype; the input x the base layer already saves (the same tensor, counted
once), and with lora.dropout the dropped copy and its mask (in x (a + 1) bytes). Under full
recompute the blocks keep their inputs only, so nothing more.

Under ZeRO-3 (parallel/data/fsdp.py) every parameter is sharded, the frozen base too (its fp32 rows its
only copy: no gradient, no optimizer state), and gathered unit by unit (the embedding, each block, the
final norm and head with the MTP depths) in parallel.param_dtype, base and adapters together; only the
adapters are reduce-scattered. A frozen embedding's output needs no gradient: its unit has no backward
and is not gathered again for one (unless it holds the tied head). Per step with M micro-batches over N
ranks, resharding: M (2 W - H - E + A) (N-1)/N wire bytes (W every weight, H the head's unit kept
gathered across, E the frozen embeddings, A the adapters' gradients); kept gathered: (W + A) (N-1)/N.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from fivefold.config.schema import Config
from fivefold.model.config import NF4_BLOCK, NF4_GROUP, PEFT_NAMES, ModelConfig
from fivefold.model.counts import block_params, block_rank_params, head_dim
from fivefold.planner.layout import RankShare

Cut = Literal["column", "row", "whole"]


@dataclass(frozen=True)
class Adapted:
    """One adapted linear layer: its module path in the model, (in, out) features and tp cut."""

    name: str
    shape: tuple[int, int]  # (in, out), as nn.Linear's in_features, out_features
    cut: Cut

    def elements(self, r: int, tp: int) -> int:
        """A's and B's elements on one tp rank."""
        i, o = self.shape
        return {"column": r * i + o // tp * r, "row": r * i // tp + o * r, "whole": r * (i + o)}[self.cut]

    def partial(self, r: int, tp: int) -> int:
        """Elements of its whole factor whose gradient is summed over tp (0 at tp = 1, or when whole)."""
        i, o = self.shape
        return 0 if tp == 1 else {"column": r * i, "row": o * r, "whole": 0}[self.cut]

    def forward_flops(self, r: int, tp: int) -> int:
        """Forward FLOPs per token on one tp rank: 2 r (in + out) over its widths."""
        i, o = self.shape
        return 2 * r * {"column": i + o // tp, "row": i // tp + o, "whole": i + o}[self.cut]

    def widths(self, tp: int) -> tuple[int, int]:
        """(in, out) as this tp rank's adapter computes them."""
        i, o = self.shape
        return {"column": (i, o // tp), "row": (i // tp, o), "whole": (i, o)}[self.cut]


def block_layers(m: ModelConfig, layer: int, prefix: str) -> list[tuple[str, tuple[int, int], Cut]]:
    """Every linear layer of block `layer` a target could name, in model order (model/attention.py,
    ffn.py, moe.py), as (path, (in, out), cut)."""
    d, H, lat = m.dim, m.n_heads, m.latent
    if lat.kv_lora_rank:
        qk, rope = lat.qk_nope_head_dim + lat.qk_rope_head_dim, lat.qk_rope_head_dim
        q = ([("wq_a", (d, lat.q_lora_rank), "whole"), ("wq_b", (lat.q_lora_rank, H * qk), "column")]
             if lat.q_lora_rank else [("wq", (d, H * qk), "column")])
        attn = [*q, ("wkv_a", (d, lat.kv_lora_rank + rope), "whole"),
                ("wkv_b", (lat.kv_lora_rank, H * (lat.qk_nope_head_dim + lat.v_head_dim)), "column"),
                ("wo", (H * lat.v_head_dim, d), "row")]
    else:
        hd, K = head_dim(m), m.n_kv_heads
        attn = [("wq", (d, H * hd), "column"), ("wk", (d, K * hd), "column"), ("wv", (d, K * hd), "column"),
                ("wo", (H * hd, d), "row")]
    out = [(f"{prefix}attn.{n}", s, c) for n, s, c in attn]
    if m.moe.n_experts and layer >= m.moe.first_dense_layers:
        h = (m.moe.ffn_dim or m.ffn_dim) * m.moe.n_shared_experts
        if h:  # the shared experts: one SwiGLU, whole on every tp rank; routed experts get no adapter
            out += [(f"{prefix}ffn.shared.{n}", s, "whole") for n, s in (("gate", (d, h)), ("up", (d, h)),
                                                                          ("down", (h, d)))]
        return out
    f = m.ffn_dim
    return out + [(f"{prefix}ffn.gate", (d, f), "column"), (f"{prefix}ffn.up", (d, f), "column"),
                  (f"{prefix}ffn.down", (f, d), "row")]


def block_adapters(cfg: Config, block: int) -> list[Adapted]:
    """The adapted layers of block `block` in the runtime's numbering (an MTP depth's: n_layers + k,
    its eh_proj first), those whose PEFT name is in lora.targets; [] with lora.rank = 0."""
    m, lo = cfg.model, cfg.lora
    if not lo.rank:
        return []
    if block < m.n_layers:
        layers = block_layers(m, block, f"layers.{block}.")
    else:
        k = block - m.n_layers
        layers = [(f"mtp.{k}.eh_proj", (2 * m.dim, m.dim), "whole"), *block_layers(m, block, f"mtp.{k}.block.")]
    return [Adapted(name, shape, cut) for name, shape, cut in layers
            if PEFT_NAMES[name.rsplit(".", 1)[1]] in lo.targets]


def model_adapters(cfg: Config) -> list[Adapted]:
    """Every adapted layer of the model, in model order (what apply_lora returns, with shapes)."""
    return [a for b in range(cfg.model.n_layers + cfg.model.mtp_layers) for a in block_adapters(cfg, b)]


def rank_adapters(cfg: Config, share: RankShare) -> list[Adapted]:
    """The adapted layers of one pipeline rank's blocks (its MTP depths' included)."""
    return [a for b in share.blocks for a in block_adapters(cfg, b)]


def adapter_elements(cfg: Config, share: RankShare) -> int:
    """Adapter elements one rank of this pipeline rank holds and trains (after tp's cut)."""
    return sum(block_adapter_elements(cfg, b) for b in share.blocks)


def partial_elements(cfg: Config, share: RankShare) -> int:
    """Of them, the whole factors whose gradients are summed over tp once a step."""
    r, tp = cfg.lora.rank, cfg.parallel.tp
    return sum(a.partial(r, tp) for a in rank_adapters(cfg, share))


def adapter_params(cfg: Config) -> int:
    """The model's adapter parameters, uncut (PEFT's trainable-parameter count)."""
    return sum(a.elements(cfg.lora.rank, 1) for a in model_adapters(cfg))


def nf4_bytes(elements: int, dtype_bytes: float = 4) -> float:
    """One weight's bytes as an NF4 base (lora.base_dtype = "nf4", model/lora.py NF4Base): its 4-bit codes,
    one int8 scale per 64 elements, and in the weight's dtype a factor per group of 256 scales, their
    mean and the 16 NF4 values: 0.515625 bytes an element and a few more."""
    return elements // 2 + elements // NF4_BLOCK + (elements // NF4_GROUP + 1 + 16) * dtype_bytes


def nf4_base(cfg: Config, share: RankShare, dtype_bytes: float = 4) -> tuple[int, float]:
    """(elements, NF4 bytes) of this pipeline rank's adapted weights under lora.base_dtype = "nf4" (whole on
    each rank: tp is refused with it), (0, 0) otherwise: a caller pricing the base at its dtype replaces
    those elements' bytes by these."""
    if not (cfg.lora.rank and cfg.lora.base_dtype == "nf4"):
        return 0, 0
    sizes = [a.shape[0] * a.shape[1] for a in rank_adapters(cfg, share)]
    return sum(sizes), sum(nf4_bytes(n, dtype_bytes) for n in sizes)


@dataclass(frozen=True)
class TrainedShare(RankShare):
    """A rank's share as LoRA's data parallel and optimizer see it (lora_step.trainable_share): `params` the
    adapters, what trains, and `weights` every parameter of the rank, base and adapters; under ZeRO-3 its
    largest_unit and kept_unit are whole units (gathered_units), which its gathers move."""

    weights: int = 0


def trained_share(cfg: Config, share: RankShare) -> TrainedShare:
    """`share` (layout.rank_shares: the base) as a TrainedShare: the adapters train, no expert or vocabulary
    parameter does; ZeRO-3 gathers whole units, the other stages no unit (module docstring)."""
    n = adapter_elements(cfg, share)
    largest, kept = gathered_units(cfg, share) if cfg.parallel.zero == 3 else (n, 0)
    whole = {f.name: getattr(share, f.name) for f in dataclasses.fields(RankShare)}
    return TrainedShare(**{**whole, "params": n, "expert_params": 0, "vocab_params": 0, "largest_unit": largest,
                           "kept_unit": kept, "kept_vocab": share.kept_vocab if kept else 0},
                        weights=share.params + n)


def block_adapter_elements(cfg: Config, block: int) -> int:
    """Adapter elements of block `block` on one tp rank (ZeRO-3 gathers them with the block's unit)."""
    return sum(a.elements(cfg.lora.rank, cfg.parallel.tp) for a in block_adapters(cfg, block))


def gathered_units(cfg: Config, share: RankShare) -> tuple[int, int]:
    """(largest unit, the head's unit kept gathered or 0) in elements as ZeRO-3 gathers them under LoRA, base
    and adapters: each block with its adapters, the head's unit with its MTP depths'. When the head's unit
    is not the largest, the MTP depths' adapters make it at most that much larger (an upper bound)."""
    m, p = cfg.model, cfg.parallel
    mtp = sum(block_adapter_elements(cfg, b) for b in share.blocks if b >= m.n_layers)
    blocks = [block_rank_params(block_params(m, b), p.tp, p.ep) + block_adapter_elements(cfg, b)
              for b in share.blocks if b < m.n_layers]
    return max([share.largest_unit + mtp, *blocks]), share.kept_unit + mtp if share.kept_unit else 0


def dp_gathers(cfg: Config, share: RankShare, vocab_size: int, param_b: float, block_b: float) -> tuple[float, float]:
    """Data parallel's weight gathers under LoRA, as comm.dp_traffic takes them: (bytes of the rank's dense
    weights a gather moves, of them those gathered for the forward only). ZeRO-1/2: the adapters (nothing
    gathered for a pass). ZeRO-3 (module docstring): base and adapters, the routed experts (ep > 1: over
    expert_dp) apart, and gathered for the forward only the head's unit kept across (share.kept_unit, without
    a pipeline) and each frozen embedding's unit, which has no backward: the first stage's unless it holds the
    tied head, and the last stage's copy the MTP depths embed with. Blocks' base weights in `block_b` (FP8
    weights' 1 byte), the rest in `param_b`."""
    m, p = cfg.model, cfg.parallel
    if p.zero != 3:
        return adapter_elements(cfg, share) * param_b, 0.0
    expert = share.expert_params if p.ep > 1 else 0
    base = (share.params - expert - share.vocab_params) * block_b + share.vocab_params * param_b
    _, kept = gathered_units(cfg, share)
    mtp = kept - share.kept_unit if kept else 0  # the MTP depths' adapters in the head's unit
    kept_bytes = (share.kept_unit - share.kept_vocab) * block_b + (share.kept_vocab + mtp) * param_b
    tied = m.tie_embeddings
    frozen = (int(share.first and not (tied and share.last))
              + int(share.last and not share.first and m.mtp_layers > 0 and not tied))
    return base + adapter_elements(cfg, share) * param_b, kept_bytes + frozen * vocab_size * m.dim // p.tp * param_b


def activation_bytes_per_block(cfg: Config, share: RankShare, tokens: int, act_bytes: int) -> float:
    """Bytes the rank's adapters save for backward per block and micro-batch of `tokens` tokens
    (module docstring), averaged over its blocks; 0 under full recompute or without LoRA."""
    adapters, blocks = rank_adapters(cfg, share), len(share.blocks)
    if not adapters or cfg.train.recompute == "full":
        return 0.0
    r, tp, drop = cfg.lora.rank, cfg.parallel.tp, cfg.lora.dropout > 0
    per_token = sum(r * act_bytes + (a.widths(tp)[0] * (act_bytes + 1) if drop else 0) for a in adapters)
    return per_token * tokens / blocks
