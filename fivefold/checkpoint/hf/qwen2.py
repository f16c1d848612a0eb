"""Hugging Face Qwen2 and Qwen2.5 (`Qwen2ForCausalLM`, transformers models/qwen2): the Llama block with
biases on the query, key and value projections (always: there is no attention_bias switch) and none
on the output one. Its optional sliding window (use_sliding_window, on the layers past
max_window_layers) is used by no released model and is refused."""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import LLAMA_BLOCK, Family, attention_keys, common_fields, refuse, refuse_common
from fivefold.model.config import ModelConfig

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}  # Qwen2Config's, for keys a config.json leaves out
BLOCK = {k: v for k, v in LLAMA_BLOCK.items() if k != "attn.wo.bias"}


def refuse_qwen(hf: dict, problems: list[str]) -> None:
    """What Qwen2 and Qwen3 configs may say that fivefold does not read."""
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu)")
    refuse(hf, problems, "use_sliding_window", False, "fivefold reads Qwen without its sliding window")


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_qwen(hf, problems)
    return {**common_fields(hf, DEFAULTS, problems), "attention.qkv_bias": True}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    return dict(intermediate_size=m.ffn_dim, hidden_act="silu", **attention_keys(m, base))


FAMILY = Family(title="Qwen2", architecture="Qwen2ForCausalLM", model_type="qwen2", block=BLOCK, read=read,
                write=write, computes={"attention.qkv_bias": (True,)})
