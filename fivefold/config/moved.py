"""Keys that moved: the flat [model] keys of earlier versions, now in their part's table, and the
optimizer's keys, now in [optim]. `MOVED` maps each old dotted key to its new one.

A run or seed directory made before the move holds a config.toml (fivefold.toml) with the old keys:
load.py reads it through this table, with one line saying so, so resume, `sample` and
`convert --to hf` keep working on it. An old key typed on the command line or in a new TOML file is
refused with its new place: `model.rope_theta is now model.rope.theta`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

# part -> {old flat key of [model]: its key in [model.<part>]}
_MODEL_PARTS = {
    "rope": {"rope_theta": "theta", "rope_scaling": "scaling", "rope_factor": "factor",
             "rope_original_context": "original_context", "rope_low_freq_factor": "low_freq_factor",
             "rope_high_freq_factor": "high_freq_factor", "rope_beta_fast": "beta_fast",
             "rope_beta_slow": "beta_slow", "rope_mscale": "mscale", "rope_mscale_all_dim": "mscale_all_dim",
             "rope_attention_factor": "attention_factor", "rope_truncate": "truncate",
             "local_rope_theta": "local_theta"},
    "attention": {"sliding_window": "window", "window_pattern": "window_pattern", "attention_sinks": "sinks",
                  "attention_scale": "scale", "qkv_bias": "qkv_bias", "out_bias": "out_bias",
                  "attention_backend": "backend"},
    "latent": {k: k for k in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")},
    "norm": {"norm_position": "position", "norm_offset": "offset", "norm_eps": "eps",
             "norm_weight_fp32": "weight_fp32", "qk_norm": "qk", "qk_norm_span": "qk_span"},
    "moe": {**{k: k for k in ("n_experts", "top_k", "n_shared_experts", "first_dense_layers", "router_score",
                               "norm_topk", "topk_groups", "swiglu_limit")},
            "moe_ffn_dim": "ffn_dim", "n_expert_groups": "n_groups", "moe_bias": "linear_bias",
            "moe_routed_scale": "routed_scale", "moe_bias_update": "bias_update", "moe_aux_loss": "aux_loss",
            "moe_capacity_factor": "capacity_factor"},
}
_TO_OPTIM = ("lr", "min_lr_ratio", "lr_schedule", "warmup_steps", "decay_fraction", "weight_decay", "beta1", "beta2",
             "eps", "grad_clip")

MOVED: Mapping[str, str] = MappingProxyType({
    **{f"model.{old}": f"model.{part}.{new}" for part, keys in _MODEL_PARTS.items() for old, new in keys.items()},
    **{f"train.{key}": f"optim.{key}" for key in _TO_OPTIM},
})


def moved_error(old: str) -> str:
    """The one line for an old key a user typed."""
    return f"{old} is now {MOVED[old]}"
