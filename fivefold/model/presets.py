"""Named model shapes, from the published model cards and config files.

`PUBLISHED_PARAMS` holds each preset's total parameter count as its authors state it; a test
builds every preset on the meta device and checks our count against it, so the planner and the
model cannot disagree about what "llama3-70b" is.
"""

from __future__ import annotations

import dataclasses
import math

from fivefold.model.config import AttentionConfig, LatentConfig, ModelConfig, MoEConfig, NormConfig, RopeConfig

_LLAMA3 = dict(n_kv_heads=8, vocab_size=128256, rope=RopeConfig(theta=500000.0), norm=NormConfig(eps=1e-5))
# Llama 3.1+ RoPE (Hugging Face config.json rope_scaling: rope_type llama3): low frequencies divided by the
# factor (8 for 3.1, 32 for 3.2), high ones kept, a ramp between; pre-training context 8192.
_LLAMA31 = {**_LLAMA3, "rope": RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, original_context=8192,
                                          low_freq_factor=1.0, high_freq_factor=4.0)}
_LLAMA32 = {**_LLAMA31, "rope": dataclasses.replace(_LLAMA31["rope"], factor=32.0)}
_QWEN3 = dict(head_dim=128, vocab_size=151936, rope=RopeConfig(theta=1000000.0), norm=NormConfig(eps=1e-6, qk=True))
_QWEN25 = dict(vocab_size=151936, rope=RopeConfig(theta=1000000.0), norm=NormConfig(eps=1e-6),
               attention=AttentionConfig(qkv_bias=True))
_OLMO2 = dict(vocab_size=100352, rope=RopeConfig(theta=500000.0),
              norm=NormConfig(eps=1e-6, qk=True, qk_span="all", position="post", weight_fp32=True))
_GPT_OSS = dict(dim=2880, n_heads=64, n_kv_heads=8, head_dim=64, ffn_dim=2880, vocab_size=201088,
                rope=RopeConfig(theta=150000.0, scaling="yarn", factor=32.0, original_context=4096, truncate=False),
                attention=AttentionConfig(qkv_bias=True, out_bias=True, window=128, window_pattern=("sliding", "full"),
                                          sinks=True))
_GPT_OSS_MOE = dict(ffn_dim=2880, top_k=4, linear_bias=True, swiglu_limit=7.0)
# DeepSeek-V3's latent attention (sec. 2.1.1): latents 1536 / 512, head widths 128 + 64 rope, values 128.
_MLA = LatentConfig(kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)


def _yarn_mla(theta: float, factor: float, beta_fast: float) -> dict:
    """DeepSeek-V3's (and Kimi K2's) YaRN: mscale = mscale_all_dim = 1, so cos/sin keep factor 1 and the
    softmax scale is 1/sqrt(128 + 64) times (0.1 ln(factor) + 1)^2 (transformers' DeepseekV3Attention;
    YaRN, Peng et al. 2023, eq. 22's sqrt(1/t) = 0.1 ln(s) + 1, applied to both q and k)."""
    return dict(rope=RopeConfig(theta=theta, scaling="yarn", factor=factor, original_context=4096,
                                beta_fast=beta_fast, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
                attention=AttentionConfig(scale=(128 + 64) ** -0.5 * (0.1 * math.log(factor) + 1) ** 2))


PRESETS: dict[str, ModelConfig] = {
    # Test and demo sizes: every count divisible by 4, so tp/pp/cp/ep up to 4 (and 8 for layers) fit.
    "tiny": ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=128),
    "tiny-moe": ModelConfig(dim=64, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=128,
                            moe=MoEConfig(n_experts=4, top_k=2, ffn_dim=64)),
    # DeepSeek-V3's architecture in miniature: latent attention (values narrower than query/key heads),
    # one dense block, then 8 experts in 4 groups, top-2 within 2 groups, a shared expert.
    "tiny-mla": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=128,
                            latent=LatentConfig(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                                                qk_rope_head_dim=8, v_head_dim=12),
                            moe=MoEConfig(n_experts=8, top_k=2, ffn_dim=32, n_shared_experts=1, first_dense_layers=1,
                                          router_score="sigmoid", n_groups=4, topk_groups=2, routed_scale=2.5),
                            norm=NormConfig(eps=1e-6)),  # DeepSeek-V3's (its latent norms' in Hugging Face): exportable
    "debug": ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=384),
    # Llama 3 (Meta, "The Llama 3 Herd of Models", 2024).
    "llama3-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **_LLAMA3),
    "llama3-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA3),
    "llama3-405b": ModelConfig(dim=16384, n_layers=126, n_heads=128, ffn_dim=53248, **_LLAMA3),
    # Llama 3.1-3.3 (Meta, Hugging Face config.json): 3.1 and 3.3 are Llama 3's shapes with llama3 RoPE; 3.2's
    # small models share their embedding with the head.
    "llama3.1-8b": ModelConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=14336, **_LLAMA31),
    "llama3.3-70b": ModelConfig(dim=8192, n_layers=80, n_heads=64, ffn_dim=28672, **_LLAMA31),
    "llama3.2-1b": ModelConfig(dim=2048, n_layers=16, n_heads=32, ffn_dim=8192, tie_embeddings=True, **_LLAMA32),
    "llama3.2-3b": ModelConfig(dim=3072, n_layers=28, n_heads=24, ffn_dim=8192, tie_embeddings=True, **_LLAMA32),
    # Mistral 7B v0.3 (mistralai/Mistral-7B-v0.3 config.json): no sliding window (v0.1 had 4096).
    "mistral-7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                              rope=RopeConfig(theta=1e6)),
    # Qwen2.5 (Qwen team, 2024; config.json): biases on q, k and v.
    "qwen2.5-0.5b": ModelConfig(dim=896, n_layers=24, n_heads=14, n_kv_heads=2, ffn_dim=4864, tie_embeddings=True,
                                **_QWEN25),
    "qwen2.5-7b": ModelConfig(dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, ffn_dim=18944,
                              **{**_QWEN25, "vocab_size": 152064}),
    "qwen3-0.6b": ModelConfig(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, ffn_dim=3072, tie_embeddings=True,
                              **_QWEN3),
    # OLMo 2 (Ai2, "2 OLMo 2 Furious", 2024; allenai/OLMo-2-0425-1B and OLMo-2-1124-7B config.json): norms
    # after each sub-layer, q/k norms over the whole projection.
    "olmo2-1b": ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=16, ffn_dim=8192, **_OLMO2),
    "olmo2-7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, **_OLMO2),
    # Gemma 3 1B (google/gemma-3-1b-pt config.json): sandwich norms as (1 + w), GeGLU, embeddings times
    # sqrt(dim), per-head q/k norms, softmax scale 256**-0.5, 5 local layers (window 512, RoPE base 1e4)
    # to 1 global (1e6) over its 26 layers (the pattern written whole: 6 does not divide 26), tied.
    "gemma3-1b": ModelConfig(dim=1152, n_layers=26, n_heads=4, n_kv_heads=1, head_dim=256, ffn_dim=6912,
                             vocab_size=262144, tie_embeddings=True, embed_scale=True, activation="gelu_tanh",
                             norm=NormConfig(qk=True, position="sandwich", offset=1.0, eps=1e-6),
                             rope=RopeConfig(theta=1e6, local_theta=10000.0),
                             attention=AttentionConfig(scale=256**-0.5, window=512, window_pattern=(
                                 ("sliding",) * 5 + ("full",)) * 4 + ("sliding",) * 2)),
    # Mixtral (Mistral AI, "Mixtral of Experts", 2024): every FFN is 8 experts, top-2.
    "mixtral-8x7b": ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32000,
                                rope=RopeConfig(theta=1e6), moe=MoEConfig(n_experts=8, top_k=2)),
    "mixtral-8x22b": ModelConfig(dim=6144, n_layers=56, n_heads=48, n_kv_heads=8, ffn_dim=16384, vocab_size=32768,
                                 rope=RopeConfig(theta=1e6), moe=MoEConfig(n_experts=8, top_k=2)),
    # Qwen3 (Qwen team, 2025): QK-norm, head_dim 128 independent of dim.
    "qwen3-8b": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, ffn_dim=12288, **_QWEN3),
    "qwen3-30b-a3b": ModelConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, ffn_dim=6144,
                                 moe=MoEConfig(n_experts=128, top_k=8, ffn_dim=768), **_QWEN3),
    "qwen3-235b-a22b": ModelConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, ffn_dim=12288,
                                   moe=MoEConfig(n_experts=128, top_k=8, ffn_dim=1536), **_QWEN3),
    # DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437, sec. 4.2) as published, without the multi-token
    # prediction module: multi-head latent attention (128 heads, latents 1536 / 512, head widths
    # 128 + 64 rope, values 128), 3 dense blocks of width 18432, then 256 routed experts of width
    # 2048 plus 1 shared, top-8 within 4 of 8 groups, sigmoid scores, routed scale 2.5, and the
    # bias-based balancing (gamma 0.001) with a sequence-wise loss of alpha 0.0001. RoPE with the YaRN
    # extension to 128K context (sec. 4.3) as its config.json (deepseek-ai/DeepSeek-V3) states it.
    "deepseek-v3": ModelConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                               vocab_size=129280, norm=NormConfig(eps=1e-6), latent=_MLA,
                               moe=MoEConfig(n_experts=256, top_k=8, ffn_dim=2048, n_shared_experts=1,
                                             first_dense_layers=3, router_score="sigmoid", n_groups=8, topk_groups=4,
                                             routed_scale=2.5, bias_update=0.001, aux_loss=0.0001),
                               **_yarn_mla(10000.0, 40.0, 32.0)),
    # Kimi K2 (Moonshot AI, arXiv 2507.20534, sec. 2.3 and its Table 2; moonshotai/Kimi-K2-Base config.json):
    # DeepSeek-V3's architecture with 64 heads, 384 experts, 1 dense block, no expert groups, routed
    # scale 2.827, RoPE base 50000 and YaRN to 128K with beta_fast = beta_slow = 1.
    "kimi-k2": ModelConfig(dim=7168, n_layers=61, n_heads=64, n_kv_heads=64, ffn_dim=18432, vocab_size=163840,
                           norm=NormConfig(eps=1e-6), latent=_MLA,
                           moe=MoEConfig(n_experts=384, top_k=8, ffn_dim=2048, n_shared_experts=1,
                                         first_dense_layers=1, router_score="sigmoid", n_groups=1, topk_groups=1,
                                         routed_scale=2.827, bias_update=0.001),
                           **_yarn_mla(50000.0, 32.0, 1.0)),
    # gpt-oss (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025, sec. 2.1; openai/gpt-oss-*b
    # config.json): every block MoE with biases and the clamped SwiGLU (limit 7), top-4 softmax router,
    # 64 query / 8 key-value heads of 64 with biases and sinks, sliding (128) and full layers alternating,
    # YaRN x32 of RoPE base 150000 without truncation.
    "gpt-oss-20b": ModelConfig(n_layers=24, moe=MoEConfig(n_experts=32, **_GPT_OSS_MOE), **_GPT_OSS),
    "gpt-oss-120b": ModelConfig(n_layers=36, moe=MoEConfig(n_experts=128, **_GPT_OSS_MOE), **_GPT_OSS),
}

# Totals as published (model cards / Hugging Face safetensors metadata).
PUBLISHED_PARAMS: dict[str, float] = {
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "llama3-405b": 405.85e9,
    # Hugging Face safetensors totals (the Hub's count of every stored tensor):
    "llama3.1-8b": 8.030261248e9,  # meta-llama/Llama-3.1-8B: 8,030,261,248 (model card: 8B)
    "llama3.3-70b": 70.553706496e9,  # meta-llama/Llama-3.3-70B-Instruct: 70,553,706,496 (model card: 70B)
    "llama3.2-1b": 1.235814400e9,  # meta-llama/Llama-3.2-1B: 1,235,814,400 (model card: 1.23B)
    "llama3.2-3b": 3.212749824e9,  # meta-llama/Llama-3.2-3B: 3,212,749,824 (model card: 3.21B)
    "mistral-7b": 7.248023552e9,  # mistralai/Mistral-7B-v0.3: 7,248,023,552
    "qwen2.5-0.5b": 0.494032768e9,  # Qwen/Qwen2.5-0.5B: 494,032,768 (model card: 0.49B)
    "qwen2.5-7b": 7.615616512e9,  # Qwen/Qwen2.5-7B: 7,615,616,512 (model card: 7.61B)
    # Qwen/Qwen3-0.6B stores its tied embedding twice (lm_head.weight too): 751,632,384 less one
    # 151936 x 1024 copy; the model card's 0.6B = 0.44B non-embedding + 0.16B embedding.
    "qwen3-0.6b": 0.751632384e9 - 151936 * 1024,
    "olmo2-1b": 1.484916736e9,  # allenai/OLMo-2-0425-1B: 1,484,916,736
    "olmo2-7b": 7.298617344e9,  # allenai/OLMo-2-1124-7B: 7,298,617,344
    "gemma3-1b": 0.999885952e9,  # google/gemma-3-1b-pt: 999,885,952 (model card: 1B)
    "mixtral-8x7b": 46.70e9,
    "mixtral-8x22b": 140.6e9,
    "qwen3-8b": 8.19e9,
    "qwen3-30b-a3b": 30.5e9,
    "qwen3-235b-a22b": 235.1e9,
    "deepseek-v3": 671e9,
    # Hugging Face's safetensors metadata of moonshotai/Kimi-K2-Instruct: 1026.5B, the fp8 block scales
    # (~0.06B) included. The report's "1.04T" (arXiv 2507.20534, Table 2) is 1.3% above what the
    # released architecture holds (1026.4B, counted here as transformers counts it), so it is not used.
    "kimi-k2": 1026.5e9,
    # gpt-oss model card (OpenAI, 2025), Table 1: 20.91B and 116.83B total parameters.
    "gpt-oss-20b": 20.91e9,
    "gpt-oss-120b": 116.83e9,
}

# Sequence length of each model's main pre-training stage, as its report states it: what `fivefold
# plan` assumes when it is given no --seq (the training config's default, 64 tokens, is for tests).
PRETRAIN_SEQ_LEN: dict[str, int] = {
    "llama3-8b": 8192,  # Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.4.1: 8K-token sequences
    "llama3-70b": 8192,
    "llama3-405b": 8192,
    "mixtral-8x7b": 32768,  # Jiang et al. 2024, "Mixtral of Experts", sec. 2: a context of 32k tokens
    "mixtral-8x22b": 32768,
    "qwen3-8b": 4096,  # Qwen3 technical report (2025), sec. 3.2: general stage S1 at 4,096 tokens
    "qwen3-30b-a3b": 4096,
    "qwen3-235b-a22b": 4096,
    "deepseek-v3": 4096,  # DeepSeek-V3 technical report (2024), sec. 4.2: maximum sequence length 4K
    "kimi-k2": 4096,  # Kimi K2 report (2025), sec. 2.4 (training recipe): 4,096-token context for pre-training
    "gpt-oss-20b": 4096,  # config.json's rope_scaling.original_max_position_embeddings (the card states no length)
    "gpt-oss-120b": 4096,
    "llama3.1-8b": 8192,  # the Llama 3 report above (Llama 3.1 is the model it describes)
    "llama3.3-70b": 8192,
    "qwen2.5-0.5b": 4096,  # Qwen2.5 technical report (2024), long-context pre-training: 4,096 tokens at first
    "qwen2.5-7b": 4096,
    "qwen3-0.6b": 4096,  # as qwen3-8b
    "olmo2-1b": 4096,  # OLMo 2 report (2024): the context of 4,096 tokens kept from OLMo-0424
    "olmo2-7b": 4096,
    "gemma3-1b": 32768,  # Gemma 3 technical report (2025): pre-trained on 32K sequences (1B: no 128K stage)
}
