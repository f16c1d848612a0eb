"""Hugging Face Mistral (`MistralForCausalLM`, transformers models/mistral): the Llama block without
biases; `sliding_window`, when set, is a window of that many tokens (the query included) on every
layer (model.attention.window: transformers' sliding-window mask keeps keys with q - k < window), and
null is full causal attention (Mistral 7B v0.2 and later). `layer_types` is not read: MistralModel
ignores it too."""

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

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 8}  # MistralConfig's
BLOCK = {k: v for k, v in LLAMA_BLOCK.items() if not k.endswith(".bias")}
SLIDING_WINDOW = 4096  # MistralConfig's when the key is left out (null, written, turns it off)


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu) or GeGLU (gelu_pytorch_tanh)")
    return {**common_fields(hf, DEFAULTS, problems),
            "attention.window": hf.get("sliding_window", SLIDING_WINDOW) or 0}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    return dict(intermediate_size=m.ffn_dim, hidden_act="silu", sliding_window=m.attention.window or None,
                **attention_keys(m, base))


FAMILY = Family(title="Mistral", architecture="MistralForCausalLM", model_type="mistral", block=BLOCK, read=read,
                write=write, computes={"attention.window": ANY})
