"""Hugging Face Qwen3-MoE (`Qwen3MoeForCausalLM`, transformers models/qwen3_moe): Qwen3's attention, MoE FFNs.

Checked against transformers 5.23 (random-weight logits in tests/checkpoint/test_hf_moe_families.py):
- Attention: the Llama projections (no biases) with an RMSNorm over each head of q and k before RoPE
  (`q_norm`, `k_norm`, (head_dim,)): fivefold's norm.qk with norm.qk_span "head"; head_dim its own key.
- num_experts (released configs) is saved by transformers 5 as num_local_experts: either is read, and
  written back under the name it came with.
- Router `mlp.gate` (E, dim): softmax over all experts in fp32, the top num_experts_per_tok, renormalised
  when norm_topk_prob (Qwen3-30B-A3B: true; the config class's default is false): fivefold's MoE with
  moe.router_score "softmax" and moe.norm_topk. No shared expert.
- Experts saved one nn.Linear per expert, `mlp.experts.{e}.gate_proj/up_proj/down_proj` (transformers 5
  fuses them in memory and writes this layout back, its conversion mapping "qwen2_moe"); stacked and
  transposed as Mixtral's (mixtral.py).
- Which blocks are MoE: block i is dense (`mlp.gate_proj` ..., width intermediate_size) when i is in
  mlp_only_layers or (i + 1) % decoder_sparse_step != 0. fivefold keeps leading dense blocks only
  (moe.first_dense_layers), so mlp_only_layers = [0, ..., k - 1] with decoder_sparse_step = 1 is read, any
  other layout refused.
- The router's auxiliary loss (router_aux_loss_coef, Switch-style) is a training option, not a weight:
  not converted (fivefold's model.moe.aux_loss is DeepSeek-V3's sequence-wise loss).
"""

from __future__ import annotations

from typing import Any

from fivefold.checkpoint.hf.family import (
    ANY,
    LLAMA_BLOCK,
    QK_NORMS,
    Family,
    attention_keys,
    common_fields,
    refuse,
    refuse_common,
)
from fivefold.model.config import ModelConfig

DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_key_value_heads": 4}  # Qwen3MoeConfig's
BLOCK = {**{k: v for k, v in LLAMA_BLOCK.items() if not k.endswith(".bias")}, **QK_NORMS,
         "ffn.router.weight": "mlp.gate.weight"}
EXPERTS = {"ffn.experts.gate": "mlp.experts.{e}.gate_proj.weight", "ffn.experts.up": "mlp.experts.{e}.up_proj.weight",
           "ffn.experts.down": "mlp.experts.{e}.down_proj.weight"}


def read(hf: dict, problems: list[str]) -> dict[str, Any]:
    refuse_common(hf, problems)
    refuse(hf, problems, "hidden_act", "silu", "fivefold's experts are SwiGLU (silu)")
    refuse(hf, problems, "attention_bias", False, "fivefold reads Qwen3-MoE without attention biases")
    refuse(hf, problems, "use_sliding_window", False, "fivefold reads Qwen3-MoE without a sliding window")
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # the released name; transformers 5 saves the other
    if not isinstance(experts, int):
        problems.append("num_experts (or num_local_experts) missing or not an integer")
    step, dense = hf.get("decoder_sparse_step", 1), sorted(hf.get("mlp_only_layers") or [])
    if step != 1:
        problems.append(f"decoder_sparse_step = {step!r}: fivefold's dense blocks lead (moe.first_dense_layers); "
                        f"only 1 (every block MoE but mlp_only_layers) is read")
    if dense != list(range(len(dense))):
        problems.append(f"mlp_only_layers = {dense}: fivefold's dense blocks lead (moe.first_dense_layers): only "
                        f"[0, 1, ..., k - 1] is read")
    return {**common_fields(hf, DEFAULTS, problems), "norm.qk": True, "moe.n_experts": experts,
            "moe.top_k": hf["num_experts_per_tok"], "moe.ffn_dim": hf["moe_intermediate_size"],
            "moe.norm_topk": bool(hf.get("norm_topk_prob", False)), "moe.first_dense_layers": len(dense)}


def write(m: ModelConfig, base: dict) -> dict[str, Any]:
    experts = "num_local_experts" if "num_local_experts" in base else "num_experts"  # the name it came with
    return dict({experts: m.moe.n_experts}, intermediate_size=m.ffn_dim,
                moe_intermediate_size=m.moe.ffn_dim or m.ffn_dim, hidden_act="silu", num_experts_per_tok=m.moe.top_k,
                norm_topk_prob=m.moe.norm_topk, decoder_sparse_step=1,
                mlp_only_layers=list(range(m.moe.first_dense_layers)), attention_bias=False,
                use_sliding_window=False, **{**attention_keys(m, base), "head_dim": m.head_dim or m.dim // m.n_heads})


def experts_somewhere(m: ModelConfig) -> list[str]:
    return ["model.moe.n_experts = 0: Qwen3-MoE has mixture-of-experts blocks (write a dense model as Qwen3)"] \
        if not m.moe.n_experts else []


FAMILY = Family(title="Qwen3-MoE", architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", block=BLOCK,
                read=read, write=write, experts=EXPERTS,
                required=("num_experts_per_tok", "moe_intermediate_size"),
                computes={"norm.qk": (True,), "norm.qk_span": ("head",), "moe.n_experts": ANY, "moe.norm_topk": ANY,
                          "moe.first_dense_layers": ANY},
                export_checks=experts_somewhere)
