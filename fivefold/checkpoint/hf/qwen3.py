"""Hugging Face Qwen3 (`Qwen3ForCausalLM`, transformers models/qwen3): the Llama block with an RMSNorm
over each head of the queries and keys before RoPE (`self_attn.q_norm` / `k_norm`, (head_dim,): model
norm.qk with norm.qk_span "head"), and a head_dim of its own (128 when left out, not dim / n_heads).
attention_bias puts a bias on all four projections, as Llama's."""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import LLAMA_BLOCK, QK_NORMS, Family, attention_keys, common_fields
from fivefold.checkpoint.hf.llama import same_biases
from fivefold.checkpoint.hf.qwen2 import refuse_qwen
from fivefold.model.config import ModelConfig

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "head_dim": 128}  # Qwen3Config's


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_qwen(hf, problems)
    bias = bool(hf.get("attention_bias", False))
    return {**common_fields(hf, DEFAULTS, problems), "norm.qk": True, "norm.qk_span": "head",
            "attention.qkv_bias": bias, "attention.out_bias": bias}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    keys = attention_keys(m, base)
    keys["head_dim"] = m.head_dim or m.dim // m.n_heads  # always: transformers' default is 128
    return dict(intermediate_size=m.ffn_dim, hidden_act="silu", attention_bias=m.attention.qkv_bias, **keys)


FAMILY = Family(title="Qwen3", architecture="Qwen3ForCausalLM", model_type="qwen3", block={**LLAMA_BLOCK, **QK_NORMS},
                read=read, write=write, export_checks=same_biases,
                computes={"norm.qk": (True,), "norm.qk_span": ("head",), "attention.qkv_bias": (False, True),
                          "attention.out_bias": (False, True)})
