"""Config checks of the model's shape: attention heads (grouped-query and latent) and expert groups.
Part of `validate()` (validate/__init__.py), which has refused nan, wrongly typed values and
non-positive sizes before these run."""

from __future__ import annotations

from fivefold.config.schema import Config
from fivefold.validate.hints import divisors_near


def head_errors(cfg: Config) -> list[str]:
    """Attention heads: their width splits into RoPE pairs, query heads into key/value groups."""
    m = cfg.model
    if m.latent.kv_lora_rank:  # latent attention: head_dim and n_kv_heads are unused
        return _latent_attention_errors(cfg)
    errors = []
    if m.head_dim == 0 and m.dim % m.n_heads:
        errors.append(f"model.dim = {m.dim} is not divisible by model.n_heads = {m.n_heads}; "
                      f"use n_heads in {{{divisors_near(m.dim, 128)}}} or set model.head_dim")
    head_dim = m.head_dim or m.dim // m.n_heads
    if head_dim % 2:
        errors.append(f"head dimension {head_dim} is odd; RoPE rotates pairs, so choose an even model.head_dim")
    if m.n_heads % m.n_kv_heads:
        errors.append(f"model.n_heads = {m.n_heads} is not divisible by model.n_kv_heads = {m.n_kv_heads}; "
                      f"use n_kv_heads in {{{divisors_near(m.n_heads, m.n_heads)}}}")
    return errors


def _latent_attention_errors(cfg: Config) -> list[str]:
    """Multi-head latent attention (model.latent.kv_lora_rank > 0): its head widths."""
    m = cfg.model
    errors = []
    if m.latent.qk_rope_head_dim < 2 or m.latent.qk_rope_head_dim % 2:
        errors.append(f"model.latent.qk_rope_head_dim = {m.latent.qk_rope_head_dim}: latent attention needs an even "
                      f"RoPE width of at least 2 (RoPE rotates pairs; DeepSeek-V3: 64)")
    qk = m.latent.qk_nope_head_dim + m.latent.qk_rope_head_dim
    if not 1 <= m.latent.v_head_dim <= qk:  # values are padded to the query/key width for the attention core
        errors.append(f"model.latent.v_head_dim = {m.latent.v_head_dim}: latent attention needs a value width "
                      f"between 1 and qk_nope_head_dim + qk_rope_head_dim = {qk} (DeepSeek-V3: 128 of 192)")
    for key, on, why in [("model.attention.qkv_bias", m.attention.qkv_bias, "has no q/k/v projections to bias"),
                         ("model.norm.qk", m.norm.qk, "normalises its latents instead (q_a_norm, kv_a_norm)")]:
        if on:
            errors.append(f"{key} = true: latent attention (model.latent.kv_lora_rank = {m.latent.kv_lora_rank}) "
                          f"{why}; set {key} = false")
    return errors


def expert_group_errors(cfg: Config) -> list[str]:
    """Group-limited routing (model.moe.n_groups > 1): groups of equal size, at least 2 experts
    each (a group is scored by its top 2), enough experts in the chosen groups for top_k."""
    m = cfg.model
    groups, chosen = m.moe.n_groups, m.moe.topk_groups
    if m.moe.n_experts % groups or m.moe.n_experts // groups < 2:
        return [f"model.moe.n_groups = {groups} must divide model.moe.n_experts = {m.moe.n_experts} into groups of at "
                f"least 2 (a group's score is its top-2 sum); use one of "
                f"{{{divisors_near(m.moe.n_experts, m.moe.n_experts // 2)}}}"]
    if not 1 <= chosen <= groups:
        return [f"model.moe.topk_groups = {chosen}: must be between 1 and model.moe.n_groups = {groups}"]
    if m.moe.top_k > chosen * (m.moe.n_experts // groups):
        return [f"model.moe.top_k = {m.moe.top_k} exceeds the {chosen * (m.moe.n_experts // groups)} experts of "
                f"model.moe.topk_groups = {chosen} groups; raise topk_groups or lower top_k"]
    return []
