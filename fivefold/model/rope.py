"""Rotary position embeddings (RoPE; Su et al. 2021, arXiv 2104.09864) and their long-context scalings.

RoPE rotates the pair (x_i, x_{i+D/2}) of each query and key by the angle p * w_i, position p times
the pair's inverse frequency w_i = theta^(-2i/D), i < D/2. A scaling changes the w_i (and, for
YaRN, multiplies cos and sin by an attention factor), so a model trained at one context length
reads a longer one; the rules (what transformers' `modeling_rope_utils` computes for each
`rope_type`, which is the reference our tests compare with):

- "linear" (position interpolation, Chen et al. 2023, arXiv 2306.15595): every w_i / factor.
  Gemma 3's global layers.
- "llama3" (Meta's Llama 3.1 release, `apply_scaling` in its reference code): with wavelength
  l_i = 2 pi / w_i and the pre-training context L, frequencies with l_i > L / low_freq_factor are
  divided by factor, those with l_i < L / high_freq_factor are kept, and between the two
  w_i <- (1 - s) w_i / factor + s w_i with s = (L / l_i - low) / (high - low).
- "yarn" (Peng et al. 2023, "YaRN", arXiv 2309.00071, sec. 3.2 "NTK-by-parts" and 3.4): the
  dimension where a pair turns r times over L is d(r) = D ln(L / (2 pi r)) / (2 ln theta); pairs
  below d(beta_fast) keep w_i, pairs above d(beta_slow) take w_i / factor, a linear ramp between
  (its ends rounded outward to whole dimensions unless truncate is off: gpt-oss). cos and sin are
  multiplied by the attention factor 0.1 ln(factor) + 1 (sec. 3.4's sqrt(1/t)), or by DeepSeek's
  ratio mscale(factor, mscale) / mscale(factor, mscale_all_dim), or by a factor given outright.

Per layer (`layer_is_local`): a sliding-window layer rotates with `local_theta`, unscaled, when
that is set (Gemma 3: local layers base 10^4, global layers base 10^6 with linear scaling); every
other layer with `theta` and the scaling.

Each function takes the [model.rope] table whole (`RopeConfig`) and, where it needs one, a number
of the layer (its window, its rotated width): nothing else of the model reaches RoPE.

Everything is computed in fp32 in the order the reference computes it, so the inverse
frequencies and the attention factor equal transformers' bit for bit (tests/model/test_rope.py).
"""

from __future__ import annotations

import math

import torch

from fivefold.model.config import RopeConfig


def layer_is_local(rope: RopeConfig, window: int) -> bool:
    """Does a block whose sliding window is `window` (0: none; AttentionConfig.layer_window) rotate
    with the local base, unscaled?"""
    return rope.local_theta > 0 and window > 0


def _plain(theta: float, dim: int, device: torch.device | None) -> torch.Tensor:
    """theta^(-2i/dim), i < dim/2, in fp32: (dim/2,)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)


def _llama3(rope: RopeConfig, dim: int, device: torch.device | None) -> torch.Tensor:
    w = _plain(rope.theta, dim, device)  # (dim/2,)
    factor, low, high, context = rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_context
    wavelength = 2 * math.pi / w
    long_waves = wavelength > context / low  # scaled whole
    short_waves = wavelength < context / high  # kept
    s = (context / wavelength - low) / (high - low)  # 0 at the long end of the band, 1 at the short end
    between = (1 - s) * w / factor + s * w
    return torch.where(long_waves, w / factor, torch.where(short_waves, w, between))


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 mscale ln(factor) + 1 (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(rope: RopeConfig) -> float:
    """What YaRN multiplies cos and sin by: rope.attention_factor when given, else DeepSeek's ratio
    when both mscales are set, else 0.1 ln(factor) + 1."""
    if rope.attention_factor > 0:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim)
    return _yarn_mscale(rope.factor)


def _yarn(rope: RopeConfig, dim: int, device: torch.device | None) -> torch.Tensor:
    theta, factor, context = rope.theta, rope.factor, rope.original_context

    def dimension(turns: float) -> float:  # the (fractional) pair index turning `turns` times over the context
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    start, end = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        start, end = math.floor(start), math.ceil(end)
    start, end = max(start, 0), min(end, dim - 1)
    if start == end:
        end += 0.001  # a ramp of zero width would divide by zero
    pair = torch.arange(dim // 2, dtype=torch.float32, device=device)  # (dim/2,)
    ramp = ((pair - start) / (end - start)).clamp(0, 1)
    kept = 1 - ramp  # the share of each pair's original frequency
    wavelength = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    return 1.0 / (factor * wavelength) * (1 - kept) + 1.0 / wavelength * kept


def inverse_frequencies(rope: RopeConfig, dim: int, local: bool = False,
                        device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """(w (dim/2,) fp32 on `device`, the factor cos and sin are multiplied by) for a rotated width
    `dim`: the local layers' plain base when `local`, else rope.theta with rope.scaling.
    Computed where the positions are: a copy from the host every forward would wait for the GPU."""
    if local:
        return _plain(rope.local_theta, dim, device), 1.0
    if rope.scaling == "linear":
        return _plain(rope.theta, dim, device) / rope.factor, 1.0
    if rope.scaling == "llama3":
        return _llama3(rope, dim, device), 1.0
    if rope.scaling == "yarn":
        return _yarn(rope, dim, device), yarn_attention_factor(rope)
    return _plain(rope.theta, dim, device), 1.0


def rope_cos_sin(positions: torch.Tensor, dim: int, rope: RopeConfig,
                 local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each position's rotation angles, times the attention factor: (..., T) -> (..., T, dim)."""
    w, factor = inverse_frequencies(rope, dim, local, positions.device)
    angles = positions.float()[..., None] * w  # (..., T, dim/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, dim): the "rotate half" layout Hugging Face uses
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) of x (B, T, H, D) by the angles in cos/sin (T, D), or (B, T, D) when
    each row has its own positions (data.reset_positions)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, D) or (B, T, 1, D): broadcast over heads
    return (x.float() * cos + rotated.float() * sin).type_as(x)


def yarn_softmax_scale(qk_head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """DeepSeek-V3's softmax scale under YaRN (its published inference code, as transformers 5.23's
    DeepseekV3Attention): qk_head_dim^-0.5 times mscale(factor, mscale_all_dim)^2, the YaRN
    temperature applied to the logits rather than to cos/sin (where its ratio of mscales is 1 for
    mscale = mscale_all_dim). With mscale_all_dim 0 or factor <= 1, the plain 1/sqrt(qk_head_dim).
    gpt-oss and Qwen keep the plain scale: their YaRN temperature is in cos/sin only."""
    m = _yarn_mscale(factor, mscale_all_dim) if mscale_all_dim else 1.0
    return qk_head_dim ** -0.5 * m * m
