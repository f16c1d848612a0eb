"""Hugging Face Llama (`LlamaForCausalLM`, transformers models/llama): the plain pre-norm block.

RoPE needs nothing: HF's Llama rotates the pairs (x_i, x_{i+D/2}) ("rotate_half"), and so does
`model.apply_rope`. (Meta's original checkpoints rotate adjacent pairs (x_2i, x_2i+1); HF's conversion
script, transformers/models/llama/convert_llama_weights_to_hf.py, permutes the rows of wq and wk once,
per head: view(H, D/2, 2, dim).transpose(1, 2). HF weights are already in the layout fivefold uses;
tests/checkpoint/test_hf.py shows that permutation applied again is caught.)
`attention_bias` puts a bias on all four projections (q, k, v and o): attention.qkv_bias and .out_bias together.
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import LLAMA_BLOCK, Family, attention_keys, common_fields, refuse, refuse_common
from fivefold.model.config import ModelConfig

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}  # LlamaConfig's, for keys a config.json leaves out


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)")
    bias = bool(hf.get("attention_bias", False))
    return {**common_fields(hf, DEFAULTS, problems), "attention.qkv_bias": bias, "attention.out_bias": bias}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    return dict(intermediate_size=m.ffn_dim, hidden_act="silu", attention_bias=m.attention.qkv_bias,
                **attention_keys(m, base))


def same_biases(m: ModelConfig) -> list[str]:
    """attention_bias is one switch for all four projections."""
    if m.attention.qkv_bias != m.attention.out_bias:
        return [f"model.attention.qkv_bias = {m.attention.qkv_bias}, model.attention.out_bias = "
                f"{m.attention.out_bias}: HF's Llama has biases on all four attention projections or on none "
                f"(attention_bias)"]
    return []


FAMILY = Family(title="Llama", architecture="LlamaForCausalLM", model_type="llama", block=LLAMA_BLOCK, read=read,
                write=write, computes={"attention.qkv_bias": (False, True), "attention.out_bias": (False, True)},
                export_checks=same_biases)
