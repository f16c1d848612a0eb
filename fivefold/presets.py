"""Named model shapes, from the published model cards and config files.

`PUBLISHED_PARAMS` holds each preset's total parameter count as its authors state it; a test
builds every preset on the meta device and checks our count against it, so the planner and the
model cannot disagree about what "llama3-70b" is.
"""

from __future__ import annotations

from fivefold.model_config import ModelConfig

_LLAMA3 = dict(n_kv_heads=8, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5)
_QWEN3 = dict(head_dim=128, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True)

PRESETS: dict[str, ModelConfig] = {
    # Test and demo sizes: every count divisible by 4, so tp/pp/cp/ep up to 4 (and 8 for layers) fit.
    "tiny": ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=128),
    "tiny-moe": ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=128, n_experts=4, top_k=2,
                            moe_ffn_dim=64),
    "debug": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384),
    # Llama 3 (Meta, "The Llama 3 Herd of Models", 2024).
    "llama3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **_LLAMA3),
    "llama3-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA3),
    "llama3-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, **_LLAMA3),
    # Mixtral (Mistral AI, "Mixtral of Experts", 2024): every FFN is 8 experts, top-2.
    "mixtral-8x7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                                rope_theta=1e6, n_experts=8, top_k=2),
    "mixtral-8x22b": ModelConfig(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32768,
                                 rope_theta=1e6, n_experts=8, top_k=2),
    # Qwen3 (Qwen team, 2025): QK-norm, head_dim 128 independent of dim.
    "qwen3-8b": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    "qwen3-30b-a3b": ModelConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144, n_experts=128, top_k=8,
                                 moe_ffn_dim=768, **_QWEN3),
    "qwen3-235b-a22b": ModelConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288, n_experts=128,
                                   top_k=8, moe_ffn_dim=1536, **_QWEN3),
    # DeepSeek-V3 (DeepSeek-AI 2024) WITHOUT multi-head latent attention and without the MTP module.
    # The MoE part is exact (3 dense blocks of width 18432, then 256 routed experts of width 2048
    # plus 1 shared, top-8, sigmoid scores). Attention is plain multi-head, 128 heads of 128, at
    # 4 x 7168 x 16384 = 469.8M parameters per layer where MLA's low-rank projections hold ~187.2M:
    # +17.2B over 61 layers, so this preset counts 688.3B against the published 671B (+2.6%).
    "deepseek-v3": ModelConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, head_dim=128, ffn_dim=18432,
                               vocab_size=129280, rope_theta=10000.0, norm_eps=1e-6, n_experts=256, top_k=8,
                               moe_ffn_dim=2048, n_shared_experts=1, first_dense_layers=3, router_score="sigmoid"),
}

# Totals as published (model cards / Hugging Face safetensors metadata).
PUBLISHED_PARAMS: dict[str, float] = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "llama3-405b": 405.85e9,
    "mixtral-8x7b": 46.70e9,
    "mixtral-8x22b": 140.6e9,
    "qwen3-8b": 8.19e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235.1e9,
    "deepseek-v3": 671e9,
}

# Presets whose architecture differs from the published model, with the expected relative excess.
KNOWN_DIFFERENCE: dict[str, float] = {"deepseek-v3": 17.2e9 / 671e9}
