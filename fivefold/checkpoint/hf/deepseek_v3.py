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
  says, fivefold uses model.norm.eps for every norm: only rms_norm_eps = 1e-6 (DeepSeek-V3's)
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
  loads only when model.moe.bias_update > 0: a converted config sets DeepSeek-V3's 0.001 (report
  sec. 4.2, gamma). On the way out an absent bias is written as zeros, always in fp32 (transformers
  keeps it in fp32).
- Multi-token prediction (report sec. 2.2; DeepSeek's README_WEIGHTS.md): the num_nextn_predict_layers
  layers past num_hidden_layers are model.mtp_layers depths (model/transformer.py MTPLayer): depth k is
  `model.layers.{N + k}`, with enorm, hnorm, eh_proj (fp8 in the release, dequantized as the rest),
  shared_head.norm (fivefold's mtp.{k}.norm) and a block named as every other. Each such layer also stores
  embed_tokens and shared_head.head, which README_WEIGHTS.md says are the main model's embedding and head:
  import checks they are (HFSource.copy_problems) and keeps one of each, export writes them back as
  copies. transformers 5.23 builds no MTP module (its DeepSeek-V3 runs num_hidden_layers blocks) and
  ignores these tensors on load.
- As released (deepseek-ai/DeepSeek-V3, and Kimi K2: the same architecture, other sizes, n_group 1) the
  weights are fp8 with 128 x 128 block scales: HFSource reads them dequantized (checkpoint/dequant.py).
- A model with latent attention (model.latent.kv_lora_rank > 0) is written as DeepSeek-V3.
- The keys of DeepSeek's original config.json that transformers ignores (scoring_func, topk_method,
  moe_layer_freq) are refused unless they say what transformers computes (sigmoid, noaux_tc, 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fivefold.checkpoint.hf.family import ANY, Family, part, refuse, refuse_common, rope_fields
from fivefold.checkpoint.hf.rope import rope_to_hf
from fivefold.model.config import ModelConfig, RopeConfig

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
MTP = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
       "norm.weight": "shared_head.norm.weight"}  # per MTP depth, beside its block: fivefold name -> HF name
MTP_COPIES = {"embed_tokens.weight": "tok_embeddings.weight", "shared_head.head.weight": "output.weight"}
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
                        f"says, and fivefold has one norm.eps for every norm")
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads")
    if kv_heads not in (None, heads):
        problems.append(f"num_key_value_heads = {kv_heads}: latent attention expands keys and values for each of "
                        f"the {heads} heads (num_key_value_heads = num_attention_heads)")
    for key in ("n_group", "topk_group"):
        if not isinstance(_get(hf, key), int):
            problems.append(f"{key} = {_get(hf, key)!r}: an integer (1 = no group limit)")
    depths = mtp_depths(hf)
    if not isinstance(depths, int) or depths < 0:
        problems.append(f"num_nextn_predict_layers = {depths!r}: a whole number of multi-token-prediction layers")
    for key, fine in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if hf.get(key, fine) != fine:
            problems.append(f"{key} = {hf[key]!r}: DeepSeek-V3 (and transformers) computes {key} = {fine!r}")
    return problems


def mtp_depths(hf: dict) -> Any:
    """num_nextn_predict_layers (transformers also reads it as num_mtp_layers); 0 when config.json has neither
    (DeepSeek's and Kimi K2's state it; a file without one holds no MTP layer)."""
    return hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    """The ModelConfig values (by path) of a DeepSeek-V3 config.json; what fivefold cannot compute into
    `problems`."""
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's FFN is SwiGLU (silu)")
    refuse(hf, problems, "attention_bias", False, "fivefold reads DeepSeek-V3 without attention biases")
    problems += config_problems(hf)
    rope = rope_fields(hf, DEFAULTS["rope_theta"], problems)
    latent = dict(kv_lora_rank=hf["kv_lora_rank"], q_lora_rank=_get(hf, "q_lora_rank") or 0,
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"])
    dense = _get(hf, "first_k_dense_replace")
    moe = dict(n_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"], ffn_dim=hf["moe_intermediate_size"],
               n_shared_experts=_get(hf, "n_shared_experts"), first_dense_layers=dense, router_score="sigmoid",
               norm_topk=bool(_get(hf, "norm_topk_prob")), n_groups=_get(hf, "n_group"),
               topk_groups=_get(hf, "topk_group"), routed_scale=float(_get(hf, "routed_scaling_factor")),
               bias_update=BIAS_UPDATE)
    heads = hf["num_attention_heads"]
    return {
        "dim": hf["hidden_size"], "n_layers": hf["num_hidden_layers"], "n_heads": heads, "n_kv_heads": heads,
        "ffn_dim": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "norm.eps": _get(hf, "rms_norm_eps"),
        "init_std": hf.get("initializer_range", 0.02), "mtp_layers": mtp_depths(hf),
        "attention.scale": softmax_scale(hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], RopeConfig(**rope)),
        **part("rope", rope), **part("latent", latent),
        **(part("moe", moe) if dense < hf["num_hidden_layers"] else {})}  # every block dense: no experts


def softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """The attention scale HF's DeepSeek-V3 computes, as model.attention.scale (0: fivefold's default
    1/sqrt(Dn + Dr)). With scaled RoPE and mscale_all_dim set it is 1/sqrt(Dn + Dr) times
    (0.1 mscale_all_dim ln(factor) + 1)^2 (DeepSeek's YaRN: the attention factor YaRN puts on cos/sin, Peng
    et al. 2023 eq. 22, applied to q.k instead; transformers models/deepseek_v3 `yarn_apply_mscale`)."""
    if not rope.scaling or not rope.mscale_all_dim or rope.factor <= 1 or not qk_head_dim:
        return 0.0
    return qk_head_dim ** -0.5 * (0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1) ** 2


def export_checks(m: ModelConfig) -> list[str]:
    """What a fivefold model has that HF's DeepSeek-V3 cannot express, beyond FAMILY.computes."""
    scale = softmax_scale(m.latent.qk_nope_head_dim + m.latent.qk_rope_head_dim, m.rope)
    checks = [(not math.isclose(m.attention.scale, scale, rel_tol=1e-12),
               f"model.attention.scale = {m.attention.scale!r} (HF's DeepSeek-V3 computes {scale!r} from the head "
               f"widths and RoPE scaling; 0 = 1/sqrt(qk_nope_head_dim + qk_rope_head_dim))"),
              (m.latent.kv_lora_rank == 0, "model.latent.kv_lora_rank = 0 (HF's DeepSeek-V3 has latent attention)"),
              (m.moe.n_experts == 0, "model.moe.n_experts = 0 (fivefold writes DeepSeek-V3 with its MoE blocks)"),
              (m.moe.n_experts > 0 and m.moe.n_shared_experts == 0,
               "model.moe.n_shared_experts = 0 (every DeepSeek-V3 MoE block has shared experts)"),
              (m.norm.eps != LATENT_NORM_EPS,
               f"model.norm.eps = {m.norm.eps} (HF's DeepSeek-V3 latent norms use {LATENT_NORM_EPS} whatever "
               f"rms_norm_eps says; train with model.norm.eps = {LATENT_NORM_EPS} to export)")]
    return [what for bad, what in checks if bad]


def write(m: ModelConfig, base: dict) -> dict:
    """The DeepSeek-V3 keys of config.json for model `m` (registry.hf_config writes the common ones)."""
    latent, moe = m.latent, m.moe
    grouped = moe.n_groups > 1
    return dict(hidden_act="silu", intermediate_size=m.ffn_dim, moe_intermediate_size=moe.ffn_dim or m.ffn_dim,
                num_key_value_heads=m.n_heads, kv_lora_rank=latent.kv_lora_rank,
                q_lora_rank=latent.q_lora_rank or None, qk_nope_head_dim=latent.qk_nope_head_dim,
                qk_rope_head_dim=latent.qk_rope_head_dim, v_head_dim=latent.v_head_dim,
                qk_head_dim=latent.qk_nope_head_dim + latent.qk_rope_head_dim, head_dim=latent.qk_rope_head_dim,
                n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k, n_shared_experts=moe.n_shared_experts,
                first_k_dense_replace=moe.first_dense_layers, norm_topk_prob=moe.norm_topk,
                n_group=moe.n_groups if grouped else 1, topk_group=moe.topk_groups if grouped else 1,
                routed_scaling_factor=moe.routed_scale, num_nextn_predict_layers=m.mtp_layers,
                rope_interleave=bool(_get(base, "rope_interleave")), **rope_to_hf(m.rope, base))


def rope_rows(name: str, m: ModelConfig, hf: dict) -> torch.Tensor | None:
    """For a weight whose rows include interleaved RoPE features (when config.json `hf` says
    rope_interleave): the HF row behind each of fivefold's rows (fivefold = hf[rows]); None for every
    other tensor."""
    if not _get(hf, "rope_interleave"):
        return None
    nope, rope, kv_rank = m.latent.qk_nope_head_dim, m.latent.qk_rope_head_dim, m.latent.kv_lora_rank
    pairs = torch.arange(rope).view(rope // 2, 2).T.reshape(-1)  # (Dr,) 0, 2, 4, ..., 1, 3, 5, ...
    if name.endswith((".attn.wq_b.weight", ".attn.wq.weight")):
        head = torch.cat([torch.arange(nope), nope + pairs])  # (Dn + Dr,)
        return (torch.arange(m.n_heads)[:, None] * (nope + rope) + head).reshape(-1)  # (H (Dn + Dr),)
    if name.endswith(".attn.wkv_a.weight"):
        return torch.cat([torch.arange(kv_rank), kv_rank + pairs])  # (Ckv + Dr,)
    return None


FAMILY = Family(title="DeepSeek-V3", architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", block=BLOCK,
                read=read, write=write, experts=EXPERTS, required=REQUIRED, rows=rope_rows, mtp=MTP,
                mtp_copies=MTP_COPIES,
                computes={"latent.kv_lora_rank": ANY, "moe.n_experts": ANY, "moe.n_shared_experts": ANY,
                          "moe.first_dense_layers": ANY, "moe.router_score": ("sigmoid",), "moe.norm_topk": ANY,
                          "moe.n_groups": ANY, "moe.routed_scale": ANY, "attention.scale": ANY, "mtp_layers": ANY},
                export_checks=export_checks)
