"""Config checks of RoPE and the softmax scale (model/rope.py): the scaling's parameters, the local
layers' base, the scale. Part of `validate()` (validate/__init__.py), which has refused nan and
wrongly typed values before these run."""

from __future__ import annotations

from fivefold.config.schema import Config


def _scaling_errors(cfg: Config) -> list[str]:
    r = cfg.model.rope
    kind, errors = r.scaling, []
    if not kind:
        if r.factor != 1:
            errors.append(f"model.rope.factor = {r.factor} does nothing without model.rope.scaling; set "
                          f"scaling = 'linear', 'llama3' or 'yarn', or leave factor = 1")
        return errors
    if r.factor < 1:
        errors.append(f"model.rope.factor = {r.factor}: {kind} scaling stretches the context, so the factor "
                      f"is at least 1 (Llama 3.1: 8, DeepSeek-V3: 40, gpt-oss: 32, Gemma 3: 8)")
    if kind in ("llama3", "yarn") and r.original_context <= 0:
        errors.append(f"model.rope.original_context = {r.original_context}: {kind} scaling needs the "
                      f"pre-training context, at least 1 (Hugging Face's original_max_position_embeddings; "
                      f"Llama 3.1: 8192, DeepSeek-V3 and gpt-oss: 4096)")
    if kind == "llama3" and not 0 < r.low_freq_factor < r.high_freq_factor:
        errors.append(f"model.rope.low_freq_factor = {r.low_freq_factor} and model.rope.high_freq_factor = "
                      f"{r.high_freq_factor}: llama3 needs 0 < low < high (Llama 3.1: 1 and 4)")
    if kind == "yarn":
        if 0 < r.theta <= 1:  # its dimension formula divides by ln(theta) (<= 0: refused below)
            errors.append(f"model.rope.theta = {r.theta}: yarn needs a RoPE base above 1 (DeepSeek-V3: 10000)")
        if not 0 < r.beta_slow <= r.beta_fast:
            errors.append(f"model.rope.beta_fast = {r.beta_fast} and model.rope.beta_slow = {r.beta_slow}: "
                          f"yarn needs 0 < beta_slow <= beta_fast (rotations; the paper's 32 and 1)")
        for field in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(r, field) < 0:
                errors.append(f"model.rope.{field} = {getattr(r, field)}: must be 0 (derived) or positive")
    return errors


def rope_errors(cfg: Config) -> list[str]:
    """The scaling's parameters, the sliding layers' base, the softmax scale: one line each."""
    m = cfg.model
    errors = _scaling_errors(cfg)
    if m.rope.theta <= 0:
        errors.append(f"model.rope.theta = {m.rope.theta}: the RoPE base must be positive (Llama 3: 500000)")
    if m.rope.local_theta < 0:
        errors.append(f"model.rope.local_theta = {m.rope.local_theta}: the sliding layers' RoPE base must be "
                      f"positive (Gemma 3: 10000), or 0 for model.rope.theta on every layer")
    elif m.rope.local_theta and not m.attention.window:
        errors.append(f"model.rope.local_theta = {m.rope.local_theta} applies to sliding-window layers, and "
                      f"model.attention.window = 0 makes none; set a window, or local_theta = 0")
    if m.attention.scale < 0:
        errors.append(f"model.attention.scale = {m.attention.scale}: the softmax scale must be positive, or 0 for "
                      f"1/sqrt(head width) (Gemma 3: query_pre_attn_scalar ** -0.5)")
    return errors
