"""Config checks of RoPE and the softmax scale (model/rope.py): the scaling's parameters, the local
layers' base, the scale. Part of `validate()` (validate/__init__.py), which has refused nan and
wrongly typed values before these run."""

from __future__ import annotations

from fivefold.config import Config


def _scaling_errors(cfg: Config) -> list[str]:
    m = cfg.model
    kind, errors = m.rope_scaling, []
    if not kind:
        if m.rope_factor != 1:
            errors.append(f"model.rope_factor = {m.rope_factor} does nothing without model.rope_scaling; set "
                          f"rope_scaling = 'linear', 'llama3' or 'yarn', or leave rope_factor = 1")
        return errors
    if m.rope_factor < 1:
        errors.append(f"model.rope_factor = {m.rope_factor}: {kind} scaling stretches the context, so the factor "
                      f"is at least 1 (Llama 3.1: 8, DeepSeek-V3: 40, gpt-oss: 32, Gemma 3: 8)")
    if kind in ("llama3", "yarn") and m.rope_original_context <= 0:
        errors.append(f"model.rope_original_context = {m.rope_original_context}: {kind} scaling needs the "
                      f"pre-training context, at least 1 (Hugging Face's original_max_position_embeddings; "
                      f"Llama 3.1: 8192, DeepSeek-V3 and gpt-oss: 4096)")
    if kind == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        errors.append(f"model.rope_low_freq_factor = {m.rope_low_freq_factor} and model.rope_high_freq_factor = "
                      f"{m.rope_high_freq_factor}: llama3 needs 0 < low < high (Llama 3.1: 1 and 4)")
    if kind == "yarn":
        if 0 < m.rope_theta <= 1:  # its dimension formula divides by ln(rope_theta) (<= 0: refused below)
            errors.append(f"model.rope_theta = {m.rope_theta}: yarn needs a RoPE base above 1 (DeepSeek-V3: 10000)")
        if not 0 < m.rope_beta_slow <= m.rope_beta_fast:
            errors.append(f"model.rope_beta_fast = {m.rope_beta_fast} and model.rope_beta_slow = {m.rope_beta_slow}: "
                          f"yarn needs 0 < beta_slow <= beta_fast (rotations; the paper's 32 and 1)")
        for field in ("rope_mscale", "rope_mscale_all_dim", "rope_attention_factor"):
            if getattr(m, field) < 0:
                errors.append(f"model.{field} = {getattr(m, field)}: must be 0 (derived) or positive")
    return errors


def rope_errors(cfg: Config) -> list[str]:
    """The scaling's parameters, the sliding layers' base, the softmax scale: one line each."""
    m = cfg.model
    errors = _scaling_errors(cfg)
    if m.rope_theta <= 0:
        errors.append(f"model.rope_theta = {m.rope_theta}: the RoPE base must be positive (Llama 3: 500000)")
    if m.local_rope_theta < 0:
        errors.append(f"model.local_rope_theta = {m.local_rope_theta}: the sliding layers' RoPE base must be "
                      f"positive (Gemma 3: 10000), or 0 for rope_theta on every layer")
    elif m.local_rope_theta and not m.sliding_window:
        errors.append(f"model.local_rope_theta = {m.local_rope_theta} applies to sliding-window layers, and "
                      f"model.sliding_window = 0 makes none; set a window, or local_rope_theta = 0")
    if m.attention_scale < 0:
        errors.append(f"model.attention_scale = {m.attention_scale}: the softmax scale must be positive, or 0 for "
                      f"1/sqrt(head width) (Gemma 3: query_pre_attn_scalar ** -0.5)")
    return errors
