"""Hugging Face Gemma 3, text only (`Gemma3ForCausalLM`, model_type gemma3_text; transformers models/gemma3).

- Norms before and after each of attention and the MLP (norm.position "sandwich"): `input_layernorm`
  -> attn_norm, `post_attention_layernorm` -> attn_post_norm, `pre_feedforward_layernorm` -> ffn_norm,
  `post_feedforward_layernorm` -> ffn_post_norm; every RMSNorm scales by (1 + weight) (norm.offset 1,
  the weights copied as stored), the per-head q/k norms included.
- Embeddings times sqrt(hidden_size) (embed_scale); GELU-tanh gating (hidden_activation
  gelu_pytorch_tanh: activation "gelu_tanh"); tied embeddings unless tie_word_embeddings = false.
- Softmax scale query_pre_attn_scalar**-0.5 (attention.scale), whatever head_dim is.
- Sliding-window layers beside full ones: layer_types (or the older sliding_window_pattern: every
  pattern-th layer full) -> attention.window_pattern; rope_parameters per layer type: "full_attention" is
  the model's RoPE (rope.theta, its scaling), "sliding_attention" plain RoPE with its own base (rope.local_theta).
The multimodal Gemma3ForConditionalGeneration (4B and up as released) stores its language model under
other names and is not read; its text config is this one.
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import (
    ANY,
    QK_NORMS,
    Family,
    common_fields,
    layer_types,
    pattern_of,
    refuse,
    refuse_common,
)
from fivefold.checkpoint.hf.rope import rope_to_hf
from fivefold.model.config import ModelConfig

# Gemma3TextConfig's, for keys a config.json leaves out.
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "head_dim": 256,
            "num_key_value_heads": 4, "tie_word_embeddings": True, "sliding_window": 4096,
            "sliding_window_pattern": 6, "query_pre_attn_scalar": 256}
BLOCK = {
    "attn_norm.weight": "input_layernorm.weight", "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight", **QK_NORMS,
    "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
}


def _get(hf: dict, key: str) -> Any:
    return hf[key] if hf.get(key) is not None else DEFAULTS[key]


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_activation", "gelu_pytorch_tanh", "fivefold's Gemma FFN is GeGLU (gelu_pytorch_tanh)")
    refuse(hf, problems, "attention_bias", False, "fivefold reads Gemma 3 without attention biases")
    refuse(hf, problems, "final_logit_softcapping", None, "fivefold does not soft-cap logits")
    refuse(hf, problems, "attn_logit_softcapping", None, "fivefold does not soft-cap attention logits")
    refuse(hf, problems, "use_bidirectional_attention", False, "fivefold's attention is causal")
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % _get(hf, "sliding_window_pattern") else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        problems.append(f"layer_types {unknown}: fivefold reads sliding_attention and full_attention layers")
    window = _get(hf, "sliding_window") if "sliding_attention" in types else 0
    fields = common_fields(hf, DEFAULTS, problems)  # RoPE per layer type (hf/rope.py): global scaled, local plain
    if not _states_local(hf) and fields["rope.theta"] != DEFAULTS["rope_local_base_freq"]:
        fields["rope.local_theta"] = DEFAULTS["rope_local_base_freq"]  # transformers' default for the local layers
    return {**fields, "norm.qk": True, "norm.qk_span": "head", "norm.position": "sandwich", "norm.offset": 1.0,
            "embed_scale": True, "activation": "gelu_tanh",
            "attention.scale": float(_get(hf, "query_pre_attn_scalar")) ** -0.5,
            "attention.window": window, "attention.window_pattern": pattern_of(types) if window else ()}


def _states_local(hf: dict) -> bool:
    """Whether config.json states the local layers' RoPE base."""
    local = (hf.get("rope_parameters") or {}).get("sliding_attention") or {}
    return "rope_theta" in local or "rope_local_base_freq" in hf


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    head_dim = m.head_dim or m.dim // m.n_heads
    scalar = (m.attention.scale or head_dim**-0.5) ** -2
    if not any(key in base for key in ("rope_parameters", "rope_theta", "rope_scaling")):
        base = {**base, "rope_parameters": {"sliding_attention": {"rope_type": "default"},
                                            "full_attention": {"rope_type": "default"}}}  # transformers 5's layout
    whole = round(scalar)
    return dict(intermediate_size=m.ffn_dim, hidden_activation="gelu_pytorch_tanh", num_key_value_heads=m.n_kv_heads,
                head_dim=head_dim, query_pre_attn_scalar=whole if abs(scalar - whole) < 1e-6 else scalar,
                sliding_window=m.attention.window or None, layer_types=layer_types(m), **rope_to_hf(m.rope, base))


FAMILY = Family(title="Gemma 3", architecture="Gemma3ForCausalLM", model_type="gemma3_text", block=BLOCK, read=read,
                write=write,
                computes={"norm.qk": (True,), "norm.qk_span": ("head",), "norm.position": ("sandwich",),
                          "norm.offset": (1.0,), "norm.weight_fp32": ANY, "embed_scale": (True,),
                          "activation": ("gelu_tanh",), "attention.scale": ANY, "attention.window": ANY,
                          "attention.window_pattern": ANY, "rope.local_theta": ANY})
