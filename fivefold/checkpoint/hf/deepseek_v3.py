"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`, transformers models/deepseek_v3) in and out.

Checked against transformers 5.23's models/deepseek_v3 (random-weight logits in tests/checkpoint/test_hf.py):
- Attention is multi-head latent (model/attention.py `LatentAttention`); names in BLOCK below. Queries
  come from `q_a_proj` -> `q_a_layernorm` -> `q_b_proj`, or `q_proj` alone when q_lora_rank is null
  (fivefold's q_lora_rank = 0); keys/values from `kv_a_proj_with_mqa` (latent, then the shared
  RoPE key) -> `kv_a_layernorm` -> `kv_b_proj`. Scale 1/sqrt(Dn + Dr) in both.
- RoPE: with rope_interleave = true (DeepSeek's layout and HF's default), HF rotates adjacent
  pairs (x_2i, x_2i+1) of the RoPE part by frequency i and returns the result as [evens, odds]
  (`apply_rotary_pos_emb_interleave`); fivefold rotates (x_i, x_{i+Dr/2}) ("rotate half"). So the
  RoPE rows, per head of q_b_proj (q_proj) and the last Dr rows of kv_a_proj_with_mqa, are put in
  [even, odd] order on the way in (`rope_rows`) and back on the way out; the roped q and k are
  then HF's element for element. With rope_interleave = false nothing is reordered.
- Latent norms: HF builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever rms_norm_eps
  says, fivefold uses model.norm_eps for every norm: only rms_norm_eps = 1e-6 (DeepSeek-V3's)
  converts exactly, and another is refused both ways by name.
- Experts: saved one nn.Linear per expert, `mlp.experts.{e}.gate_proj/up_proj/down_proj` (transformers
  5 fuses gate_up_proj (E, 2I, H) in memory but save_pretrained writes this layout, as DeepSeek's own
  checkpoints have it); stacked and transposed as Mixtral's (mixtral.py). The shared experts are one
  SwiGLU of width n_shared_experts x moe_intermediate_size in both.
- Router `mlp.gate`: sigmoid scores, groups scored by their top-2 biased scores, top-k within the
  topk_group best, renormalised (norm_topk_prob) and times routed_scaling_factor: fivefold's
  MoE.select, except that HF adds 1e-20 to the renormalising sum (below fp32's resolution unless
  the top-k scores sum to under ~1e-13).
- `mlp.gate.e_score_correction_bias` is fivefold's `ffn.expert_bias`, which the model saves and
  loads only when model.moe_bias_update > 0: a converted config sets DeepSeek-V3's 0.001 (report
  sec. 4.2, gamma). On the way out an absent bias is written as zeros, always in fp32 (transformers
  keeps it in fp32).
- Multi-token prediction: the layers past num_hidden_layers (num_nextn_predict_layers of them) are
  not read (fivefold has no MTP module); the way out writes num_nextn_predict_layers = 0.
- A model with latent attention (model.kv_lora_rank > 0) is written as DeepSeek-V3.
- The keys of DeepSeek's original config.json that transformers ignores (scoring_func, topk_method,
  moe_layer_freq) are refused unless they say what transformers computes (sigmoid, noaux_tc, 1).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from fivefold.checkpoint.hf.family import ANY, Family, refuse, refuse_common, rope_fields, rope_keys
from fivefold.model.config import ModelConfig

LATENT_NORM_EPS = 1e-6  # HF's q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm's default, not rms_norm_eps
BIAS_UPDATE = 0.001  # DeepSeek-V3's bias update speed gamma (sec. 4.2): keeps expert_bias in the state dict
BLOCK = {  # per block: fivefold name -> HF name
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_a_norm.weight": "self_attn.q_a_layernorm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight", "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
    "ffn.down.weight": "mlp.down_proj.weight",
    "ffn.router.weight": "mlp.gate.weight", "ffn.expert_bias": "mlp.gate.e_score_correction_bias",
    "ffn.shared.gate.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared.up.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared.down.weight": "mlp.shared_experts.down_proj.weight",
}
EXPERTS = {"ffn.experts.gate": "mlp.experts.{e}.gate_proj.weight", "ffn.experts.up": "mlp.experts.{e}.up_proj.weight",
           "ffn.experts.down": "mlp.experts.{e}.down_proj.weight"}
REQUIRED = ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim")
# What DeepseekV3Config assumes for the other keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "q_lora_rank": 1536, "n_shared_experts": 1,
                            "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                            "norm_topk_prob": True, "rope_interleave": True}


def _get(hf: dict, key: str) -> Any:
    return hf[key] if key in hf else DEFAULTS[key]


def config_problems(hf: dict) -> list[str]:
    """What of a DeepSeek-V3 config.json fivefold cannot compute (beyond the common checks)."""
    problems: list[str] = []
    eps = _get(hf, "rms_norm_eps")
    if eps != LATENT_NORM_EPS:
        problems.append(f"rms_norm_eps = {eps!r}: HF's DeepSeek-V3 latent norms use {LATENT_NORM_EPS} whatever it "
                        f"says, and fivefold has one norm_eps for every norm")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        problems.append(f"num_key_value_heads = {kv_heads}: latent attention expands keys and values for each of "
                        f"the {heads} heads (num_key_value_heads = num_attention_heads)")
    for key in ("n_group", "topk_group"):
        if not isinstance(_get(hf, key), int):
            problems.append(f"{key} = {_get(hf, key)!r}: an integer (1 = no group limit)")
    for key, fine in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, fine) != fine:
            problems.append(f"{key} = {hf[key]!r}: DeepSeek-V3 (and transformers) computes {key} = {fine!r}")
    return problems


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig fields of a DeepSeek-V3 config.json; what fivefold cannot compute into `problems`."""
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu)")
    refuse(hf, problems, "attention_bias", False, "fivefold reads DeepSeek-V3 without attention biases")
    problems += config_problems(hf)
    rope = rope_fields(hf, DEFAULTS["rope_theta"], problems)
    dense = _get(hf, "first_k_dense_replace")
    moe = dict(n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
               moe_ffn_dim=hf["moe_intermediate_size"], n_shared_experts=_get(hf, "n_shared_experts"),
               first_dense_layers=dense, router_score="sigmoid", norm_topk=bool(_get(hf, "norm_topk_prob")),
               n_expert_groups=_get(hf, "n_group"), topk_groups=_get(hf, "topk_group"),
               moe_routed_scale=float(_get(hf, "routed_scaling_factor")), moe_bias_update=BIAS_UPDATE)
    heads = hf["num_attention_heads"]
    return dict(
        dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=heads, n_kv_heads=heads,
        ffn_dim=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm_eps=_get(hf, "rms_norm_eps"),
        init_std=hf.get("initializer_range", 0.02), **rope,
        kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=_get(hf, "q_lora_rank") or 0,
        qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        **(moe if dense < hf["num_hidden_layers"] else {}))  # every block dense: no experts


def export_checks(m: ModelConfig) -> list[str]:
    """What a fivefold model has that HF's DeepSeek-V3 cannot express, beyond FAMILY.computes."""
    checks = [(m.kv_lora_rank == 0, "model.kv_lora_rank = 0 (HF's DeepSeek-V3 has latent attention)"),
              (m.n_experts == 0, "model.n_experts = 0 (fivefold writes DeepSeek-V3 with its MoE blocks)"),
              (m.n_experts > 0 and m.n_shared_experts == 0,
               "model.n_shared_experts = 0 (every DeepSeek-V3 MoE block has shared experts)"),
              (m.norm_eps != LATENT_NORM_EPS,
               f"model.norm_eps = {m.norm_eps} (HF's DeepSeek-V3 latent norms use {LATENT_NORM_EPS} whatever "
               f"rms_norm_eps says; train with model.norm_eps = {LATENT_NORM_EPS} to export)")]
    return [what for bad, what in checks if bad]


def write(m: ModelConfig, base: dict) -> dict:
    """The DeepSeek-V3 keys of config.json for model `m` (registry.hf_config writes the common ones)."""
    grouped = m.n_expert_groups > 1
    return dict(hidden_act="silu", intermediate_size=m.ffn_dim, moe_intermediate_size=m.moe_ffn_dim or m.ffn_dim,
                num_key_value_heads=m.n_heads, kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or None,
                qk_nope_head_dim=m.qk_nope_head_dim, qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                qk_head_dim=m.qk_nope_head_dim + m.qk_rope_head_dim, head_dim=m.qk_rope_head_dim,
                n_routed_experts=m.n_experts, num_experts_per_tok=m.top_k, n_shared_experts=m.n_shared_experts,
                first_k_dense_replace=m.first_dense_layers, norm_topk_prob=m.norm_topk,
                n_group=m.n_expert_groups if grouped else 1, topk_group=m.topk_groups if grouped else 1,
                routed_scaling_factor=m.moe_routed_scale, num_nextn_predict_layers=0,
                rope_interleave=bool(_get(base, "rope_interleave")), **rope_keys(m, base))


def rope_rows(name: str, m: ModelConfig, hf: dict) -> torch.Tensor | None:
    """For a weight whose rows include interleaved RoPE features (when config.json `hf` says
    rope_interleave): the HF row behind each of fivefold's rows (fivefold = hf[rows]); None for every
    other tensor."""
    if not _get(hf, "rope_interleave"):
        return None
    rope = m.qk_rope_head_dim
    pairs = torch.arange(rope).view(rope // 2, 2).T.reshape(-1)  # (Dr,) 0, 2, 4, ..., 1, 3, 5, ...
    if name.endswith((".attn.wq_b.weight", ".attn.wq.weight")):
        width = m.qk_nope_head_dim + rope
        head = torch.cat([torch.arange(m.qk_nope_head_dim), m.qk_nope_head_dim + pairs])  # (Dn + Dr,)
        return (torch.arange(m.n_heads)[:, None] * width + head).reshape(-1)  # (H (Dn + Dr),)
    if name.endswith(".attn.wkv_a.weight"):
        return torch.cat([torch.arange(m.kv_lora_rank), m.kv_lora_rank + pairs])  # (Ckv + Dr,)
    return None


def mtp_layer(name: str, hf: dict) -> bool:
    """A tensor of the multi-token-prediction layers, which follow the num_hidden_layers blocks."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return match is not None and int(match.group(1)) >= hf["num_hidden_layers"]


FAMILY = Family(title="DeepSeek-V3", architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", block=BLOCK,
                read=read, write=write, experts=EXPERTS, required=REQUIRED, rows=rope_rows, skips=mtp_layer,
                computes={"kv_lora_rank": ANY, "n_experts": ANY, "n_shared_experts": ANY, "first_dense_layers": ANY,
                          "router_score": ("sigmoid",), "norm_topk": ANY, "n_expert_groups": ANY,
                          "moe_routed_scale": ANY},
                export_checks=export_checks)
