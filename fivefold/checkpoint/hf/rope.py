"""RoPE in a Hugging Face config.json, both ways: the model's RopeConfig (model.rope) from it, and back.

Two styles exist. transformers 5 writes `rope_parameters`: one dict {"rope_type", "rope_theta",
"factor", ...}, or one per layer type ({"sliding_attention": {...}, "full_attention": {...}}:
Gemma 3, whose local layers rotate plain with their own base). Older files (and DeepSeek-V3's,
gpt-oss's as published) have `rope_theta` beside a `rope_scaling` dict whose kind is "rope_type"
or, older still, "type"; Gemma 3's give the local base as `rope_local_base_freq`. Defaults follow
transformers 5.23's reading (modeling_rope_utils: standardize_rope_params, _compute_yarn_parameters):
yarn's beta_fast / beta_slow fall back to 32 / 1, its factor to max_position_embeddings /
original_max_position_embeddings, the original context to a top-level
original_max_position_embeddings, else max_position_embeddings.
"""

from __future__ import annotations

from typing import Any

from fivefold.model.config import RopeConfig

READ = ("default", "linear", "llama3", "yarn")  # the rope types fivefold reads (model/rope.py)
LAYER_TYPES = ("full_attention", "sliding_attention")
_SCALING_KEYS = ("rope_type", "type", "factor", "original_max_position_embeddings", "low_freq_factor",
                 "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor",
                 "truncate", "rope_theta")
# yarn's optional keys, each RopeConfig's field of the same name: (key, the value that means "not given")
_YARN_OPTIONAL = (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", 0.0), ("mscale_all_dim", 0.0),
                  ("attention_factor", 0.0), ("truncate", True))


def _nested(params: dict) -> bool:
    return any(key in params for key in LAYER_TYPES)


def _scaling_fields(hf: dict, params: dict, problems: list[str], where: str) -> dict[str, Any]:
    """The scaling fields of one rope dict (its "rope_type" / "type", factor, ...)."""
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in READ:
        problems.append(f"{where}: rope type '{kind}': fivefold reads {', '.join(READ)}")
        return {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        problems.append(f"{where}: partial_rotary_factor {partial}: fivefold rotates whole heads")
    if kind == "default":
        return {}
    fields: dict[str, Any] = {"scaling": kind}
    original = hf.get("original_max_position_embeddings", params.get("original_max_position_embeddings",
                                                                     hf.get("max_position_embeddings")))
    factor = params.get("factor")
    if factor is None and kind == "yarn" and original:
        factor = hf.get("max_position_embeddings", original) / original  # as transformers: the context's stretch
    if factor is None:
        problems.append(f"{where}: rope type '{kind}' without its 'factor'")
        return {}
    fields["factor"] = float(factor)
    if kind in ("llama3", "yarn"):
        if not isinstance(original, int):
            problems.append(f"{where}: rope type '{kind}' needs original_max_position_embeddings "
                            f"(or max_position_embeddings)")
            return {}
        fields["original_context"] = original
    if kind == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if params.get(key) is None:
                problems.append(f"{where}: rope type 'llama3' without its '{key}'")
            else:
                fields[key] = float(params[key])
    if kind == "yarn":
        for key, unset in _YARN_OPTIONAL:
            value = params.get(key)
            if key == "truncate":
                fields[key] = bool(unset if value is None else value)
            else:
                fields[key] = float(value or unset)  # transformers: `or` (0 and None both mean the default)
    return fields


def rope_fields_from_hf(hf: dict, problems: list[str]) -> dict[str, Any]:
    """RopeConfig's fields (theta, scaling, factor, ..., local_theta) from a config.json of either style;
    only those it states (theta absent: the caller's default).
    A rope type fivefold does not read is appended to `problems` by name."""
    params = hf.get("rope_parameters") or {}
    if params and _nested(params):
        full = params.get("full_attention") or {}
        local = params.get("sliding_attention") or {}
        fields = _scaling_fields(hf, full, problems, "rope_parameters.full_attention")
        local_kind = local.get("rope_type", local.get("type")) or "default"
        if local_kind != "default":
            problems.append(f"rope_parameters.sliding_attention: rope type '{local_kind}': fivefold rotates "
                            f"sliding-window layers with a plain base (rope.local_theta)")
        theta = full.get("rope_theta", hf.get("rope_theta"))
        local_theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
    else:
        scaling = params or hf.get("rope_scaling") or {}
        fields = _scaling_fields(hf, scaling, problems, "rope_parameters" if params else "rope_scaling")
        theta = params.get("rope_theta", hf.get("rope_theta"))
        local_theta = hf.get("rope_local_base_freq")
    if theta is not None:
        fields["theta"] = float(theta)
    # The local layers' own base: needed when it differs, or when the global layers are scaled.
    if local_theta is not None and (local_theta != theta or fields.get("scaling")):
        fields["local_theta"] = float(local_theta)
    return fields


def _like(base: Any, value: Any) -> Any:
    """value as the base file wrote it: an integral float as an int where the base had an int."""
    if isinstance(base, int) and not isinstance(base, bool) and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _scaling_dict(rope: RopeConfig, base: dict, kind_key: str) -> dict[str, Any]:
    """One rope dict for the global layers: the rope type and its parameters, base's other keys kept."""
    out = {k: v for k, v in base.items() if k not in _SCALING_KEYS}
    for key in [k for k in ("rope_type", "type") if k in base] or [kind_key]:  # transformers 5 may keep both
        out[key] = rope.scaling or "default"
    if not rope.scaling:
        return out
    out["factor"] = _like(base.get("factor"), rope.factor)
    if rope.scaling in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = rope.original_context
    if rope.scaling == "llama3":
        out["low_freq_factor"] = _like(base.get("low_freq_factor"), rope.low_freq_factor)
        out["high_freq_factor"] = _like(base.get("high_freq_factor"), rope.high_freq_factor)
    if rope.scaling == "yarn":
        for key, unset in _YARN_OPTIONAL:
            value = getattr(rope, key)
            if key in base or value != unset:  # what the base stated, and what differs from the default
                out[key] = _like(base.get(key), value)
    return out


def rope_to_hf(rope: RopeConfig, base: dict) -> dict[str, Any]:
    """The config.json keys that carry a model's RoPE (model.rope), in the style of `base` (the config the model came
    from, or a template): transformers 5's rope_parameters (per layer type when base has them so), or
    rope_theta with rope_scaling (and Gemma 3's rope_local_base_freq). Merge into base."""
    params = base.get("rope_parameters")
    local_theta = rope.local_theta or rope.theta
    if params and _nested(params):
        full = _scaling_dict(rope, params.get("full_attention") or {}, "rope_type")
        full["rope_theta"] = _like((params.get("full_attention") or {}).get("rope_theta"), rope.theta)
        local = {k: v for k, v in (params.get("sliding_attention") or {}).items() if k not in _SCALING_KEYS}
        local.update(rope_type="default", rope_theta=_like((params.get("sliding_attention") or {}).get("rope_theta"),
                                                          local_theta))
        return {"rope_parameters": {**params, "full_attention": full, "sliding_attention": local}}
    if params is not None or "rope_theta" not in base and "rope_scaling" not in base:  # transformers 5's style
        flat = _scaling_dict(rope, params or {}, "rope_type")
        flat["rope_theta"] = _like((params or {}).get("rope_theta"), rope.theta)
        out: dict[str, Any] = {"rope_parameters": flat}
    else:
        old = base.get("rope_scaling") or {}
        kind_key = "type" if "type" in old and "rope_type" not in old else "rope_type"
        out = {"rope_theta": _like(base.get("rope_theta"), rope.theta)}
        if rope.scaling or "rope_scaling" in base:
            out["rope_scaling"] = _scaling_dict(rope, old, kind_key) if rope.scaling else None
    if "rope_local_base_freq" in base or rope.local_theta:
        out["rope_local_base_freq"] = _like(base.get("rope_local_base_freq"), local_theta)
    return out
