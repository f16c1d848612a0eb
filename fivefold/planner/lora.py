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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fivefold.config.schema import Config
from fivefold.model.config import PEFT_NAMES, ModelConfig
from fivefold.model.counts import head_dim
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
    r, tp = cfg.lora.rank, cfg.parallel.tp
    return sum(a.elements(r, tp) for a in rank_adapters(cfg, share))


def partial_elements(cfg: Config, share: RankShare) -> int:
    """Of them, the whole factors whose gradients are summed over tp once a step."""
    r, tp = cfg.lora.rank, cfg.parallel.tp
    return sum(a.partial(r, tp) for a in rank_adapters(cfg, share))


def adapter_params(cfg: Config) -> int:
    """The model's adapter parameters, uncut (PEFT's trainable-parameter count)."""
    return sum(a.elements(cfg.lora.rank, 1) for a in model_adapters(cfg))


def activation_bytes_per_block(cfg: Config, share: RankShare, tokens: int, act_bytes: int) -> float:
    """Bytes the rank's adapters save for backward per block and micro-batch of `tokens` tokens
    (module docstring), averaged over its blocks; 0 under full recompute or without LoRA."""
    adapters, blocks = rank_adapters(cfg, share), len(share.blocks)
    if not adapters or cfg.train.recompute == "full":
        return 0.0
    r, tp, drop = cfg.lora.rank, cfg.parallel.tp, cfg.lora.dropout > 0
    per_token = sum(r * act_bytes + (a.widths(tp)[0] * (act_bytes + 1) if drop else 0) for a in adapters)
    return per_token * tokens / blocks
