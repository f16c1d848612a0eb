"""Hugging Face Mixtral (`MixtralForCausalLM`, transformers models/mixtral): the Llama block with a MoE FFN.

Experts are saved one nn.Linear per expert, weight (out, in): `block_sparse_moe.experts.{e}.w1` (gate,
(hidden, dim)), `w3` (up, (hidden, dim)), `w2` (down, (dim, hidden)); fivefold stacks them as x @ W:
`experts.gate/up` (E, dim, hidden), `experts.down` (E, hidden, dim), so expert e of a stacked tensor is
HF's weight transposed. (transformers 5 fuses gate and up in memory, `experts.gate_up_proj`, but still
saves this per-expert layout.) The router `block_sparse_moe.gate` is `ffn.router`: softmax, top-k,
renormalised, as fivefold's MoE with moe.router_score = "softmax" and moe.norm_topk = true.
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import (
    ANY,
    LLAMA_BLOCK,
    Family,
    attention_keys,
    common_fields,
    refuse,
    refuse_common,
)
from fivefold.model.config import ModelConfig

# MixtralConfig's defaults for keys a config.json leaves out.
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1e6, "num_key_value_heads": 8}
BLOCK = {**{k: v for k, v in LLAMA_BLOCK.items() if not k.startswith("ffn.") and not k.endswith(".bias")},
         "ffn.router.weight": "block_sparse_moe.gate.weight"}
EXPERTS = {"ffn.experts.gate": "block_sparse_moe.experts.{e}.w1.weight",
           "ffn.experts.up": "block_sparse_moe.experts.{e}.w3.weight",
           "ffn.experts.down": "block_sparse_moe.experts.{e}.w2.weight"}


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's experts are SwiGLU (silu)")
    refuse(hf, problems, "sliding_window", None, "fivefold reads Mixtral without a sliding window")
    refuse(hf, problems, "router_jitter_noise", 0.0, "fivefold's router adds no noise")
    return {**common_fields(hf, DEFAULTS, problems), "moe.n_experts": hf["num_local_experts"],
            "moe.top_k": hf["num_experts_per_tok"]}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    return dict(intermediate_size=m.moe.ffn_dim or m.ffn_dim, hidden_act="silu", num_local_experts=m.moe.n_experts,
                num_experts_per_tok=m.moe.top_k, **attention_keys(m, base))


def experts_everywhere(m: ModelConfig) -> list[str]:
    return ["model.moe.n_experts = 0: every block of HF's Mixtral is a mixture of experts"] if not m.moe.n_experts \
        else []


FAMILY = Family(title="Mixtral", architecture="MixtralForCausalLM", model_type="mixtral", block=BLOCK, read=read,
                write=write, experts=EXPERTS, required=("num_local_experts", "num_experts_per_tok"),
                computes={"moe.n_experts": ANY}, export_checks=experts_everywhere)
