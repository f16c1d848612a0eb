"""Hugging Face OLMo 2 (`Olmo2ForCausalLM`, transformers models/olmo2): norms on each sub-layer's output
before the residual add (`post_attention_layernorm` -> attn_post_norm, `post_feedforward_layernorm` ->
ffn_post_norm, and no norm before either: model.norm.position "post"), and an RMSNorm over the whole
query and key projections before RoPE (`self_attn.q_norm` (H head_dim,), `k_norm` (K head_dim,):
norm.qk_span "all"). Its RMSNorm weighs in fp32 before the cast back (norm.weight_fp32), unlike
Llama's. attention_bias puts a bias on all four projections."""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import (
    LLAMA_BLOCK,
    QK_NORMS,
    Family,
    attention_keys,
    common_fields,
    refuse,
    refuse_common,
)
from fivefold.checkpoint.hf.llama import same_biases
from fivefold.model.config import ModelConfig

DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 10000.0}  # Olmo2Config's, for keys a config.json leaves out
BLOCK = {**{k: v for k, v in LLAMA_BLOCK.items() if not k.endswith("norm.weight")}, **QK_NORMS,
         "attn_post_norm.weight": "post_attention_layernorm.weight",
         "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu)")
    bias = bool(hf.get("attention_bias", False))
    return {**common_fields(hf, DEFAULTS, problems), "norm.qk": True, "norm.qk_span": "all", "norm.position": "post",
            "norm.weight_fp32": True, "attention.qkv_bias": bias, "attention.out_bias": bias}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    return dict(intermediate_size=m.ffn_dim, hidden_act="silu", attention_bias=m.attention.qkv_bias,
                **attention_keys(m, base))


FAMILY = Family(title="OLMo 2", architecture="Olmo2ForCausalLM", model_type="olmo2", block=BLOCK, read=read,
                write=write, export_checks=same_biases,
                computes={"norm.qk": (True,), "norm.qk_span": ("all",), "norm.position": ("post",),
                          "norm.weight_fp32": (True,), "attention.qkv_bias": (False, True),
                          "attention.out_bias": (False, True)})
