"""Hugging Face gpt-oss (`GptOssForCausalLM`, transformers models/gpt_oss): sinks, windows, biased MoE.

Checked against transformers 5.23 (random-weight logits in tests/checkpoint/test_hf_moe_families.py):
- Attention: q/k/v/o projections with biases (attention_bias: attention.qkv_bias and .out_bias), a learned sink
  logit per head (`self_attn.sinks`, (H,): model.attention.sinks); layer_types[i] "sliding_attention"
  sees the last sliding_window keys, the query's own included (transformers' sliding-window mask:
  kv > q - w), "full_attention" the causal prefix: model.attention.window with attention.window_pattern from
  layer_types (released: sliding, full, alternating, window 128). Scale 1/sqrt(head_dim).
- Router `mlp.router` (E, dim) with a bias: top-k of the logits, softmax over those k, which is fivefold's
  softmax over all experts renormalised over the top k (moe.router_score "softmax", moe.norm_topk,
  moe.linear_bias).
- Experts are saved fused, as the model holds them (no conversion mapping for gpt_oss in
  transformers/conversion_mapping.py): `mlp.experts.gate_up_proj` (E, dim, 2 I) with gate and up
  interleaved on the last dim (gate = [..., 0::2], up = [..., 1::2], `GptOssExperts._apply_gate`),
  `gate_up_proj_bias` (E, 2 I) the same way, `down_proj` (E, I, dim) and `down_proj_bias` (E, dim): x @ W
  as fivefold stores them, so only the interleaving is undone (Family.fused).
- Expert activation: gate clamped above at swiglu_limit, up to [-limit, limit], out = gate sigmoid(1.702
  gate) (up + 1): fivefold's ffn.gated with model.moe.swiglu_limit (swiglu_alpha other than 1.702 refused).
- As released (openai/gpt-oss-20b, -120b) the experts are MXFP4 (`gate_up_proj_blocks` / `_scales`, ...):
  HFSource reads them dequantized (checkpoint/dequant.py).
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import ANY, LLAMA_BLOCK, Family, attention_keys, common_fields, refuse, refuse_common
from fivefold.model.config import ModelConfig

SWIGLU_ALPHA = 1.702  # fixed in fivefold's ffn.gated (gpt-oss's own value)
DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 150000.0, "num_key_value_heads": 8}  # GptOssConfig's
BLOCK = {**{k: v for k, v in LLAMA_BLOCK.items() if not k.startswith("ffn.")}, "attn.sinks": "self_attn.sinks",
         "ffn.router.weight": "mlp.router.weight", "ffn.router.bias": "mlp.router.bias"}
FUSED = {"ffn.experts.gate": ("mlp.experts.gate_up_proj", 0, 2), "ffn.experts.up": ("mlp.experts.gate_up_proj", 1, 2),
         "ffn.experts.down": ("mlp.experts.down_proj", 0, 1),
         "ffn.experts.gate_bias": ("mlp.experts.gate_up_proj_bias", 0, 2),
         "ffn.experts.up_bias": ("mlp.experts.gate_up_proj_bias", 1, 2),
         "ffn.experts.down_bias": ("mlp.experts.down_proj_bias", 0, 1)}
LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}


def _pattern(types: list[str]) -> tuple[str, ...]:
    """The shortest repeating prefix of layer_types, in fivefold's words (attention.window_pattern)."""
    words = tuple(LAYER_TYPES[t] for t in types)
    for n in range(1, len(words) + 1):
        if all(w == words[i % n] for i, w in enumerate(words)):
            return words[:n]
    return words


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "swiglu_alpha", SWIGLU_ALPHA, f"fivefold's clamped SwiGLU uses alpha {SWIGLU_ALPHA}")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown or len(types) != layers:
        problems.append(f"layer_types = {types!r}: {layers} of {' or '.join(LAYER_TYPES)}")
        types = []
    window = hf.get("sliding_window") or 0
    bias = bool(hf.get("attention_bias", True))
    return {**common_fields(hf, DEFAULTS, problems), "attention.qkv_bias": bias, "attention.out_bias": bias,
            "attention.sinks": True, "attention.window": window if "sliding_attention" in types else 0,
            "attention.window_pattern": _pattern(types) if window and "full_attention" in types else (),
            "moe.n_experts": hf["num_local_experts"], "moe.top_k": hf["num_experts_per_tok"],
            "moe.ffn_dim": hf["intermediate_size"], "moe.linear_bias": True,
            "moe.swiglu_limit": float(hf.get("swiglu_limit", 7.0))}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    pattern = m.attention.window_pattern or ("sliding",)
    kinds = {word: name for name, word in LAYER_TYPES.items()}
    types = [kinds[pattern[i % len(pattern)]] if m.attention.window else "full_attention" for i in range(m.n_layers)]
    return dict(intermediate_size=m.moe.ffn_dim or m.ffn_dim, hidden_act="silu", attention_bias=m.attention.qkv_bias,
                num_local_experts=m.moe.n_experts, num_experts_per_tok=m.moe.top_k, swiglu_limit=m.moe.swiglu_limit,
                swiglu_alpha=SWIGLU_ALPHA, sliding_window=m.attention.window or None, layer_types=types,
                **{**attention_keys(m, base), "head_dim": m.head_dim or m.dim // m.n_heads})


def checks(m: ModelConfig) -> list[str]:
    problems = []
    if not m.moe.n_experts:
        problems.append("model.moe.n_experts = 0: every block of HF's gpt-oss is a mixture of experts")
    if m.moe.swiglu_limit <= 0:
        problems.append("model.moe.swiglu_limit = 0: HF's gpt-oss always clamps its experts' SwiGLU (released: 7.0)")
    if m.attention.qkv_bias != m.attention.out_bias:
        problems.append(f"model.attention.qkv_bias = {m.attention.qkv_bias}, model.attention.out_bias = "
                        f"{m.attention.out_bias}: HF's gpt-oss has biases on all four attention projections or on "
                        f"none (attention_bias)")
    return problems


FAMILY = Family(title="gpt-oss", architecture="GptOssForCausalLM", model_type="gpt_oss", block=BLOCK, read=read,
                write=write, fused=FUSED, required=("num_local_experts", "num_experts_per_tok"),
                computes={"attention.qkv_bias": (False, True), "attention.out_bias": (False, True),
                          "attention.sinks": (True,), "attention.window": ANY, "attention.window_pattern": ANY,
                          "moe.n_experts": ANY, "moe.linear_bias": (True,), "moe.swiglu_limit": ANY},
                export_checks=checks)
