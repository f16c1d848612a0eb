"""RoPE scalings, the per-layer RoPE base and the softmax scale (model/rope.py) against transformers 5.23.

The inverse frequencies and attention factors of the published configurations equal transformers'
ROPE_INIT_FUNCTIONS bit for bit; tiny Llamas with llama3 and yarn scaling give LlamaForCausalLM's
logits, and DeepSeek-V3's latent attention under YaRN with its softmax scale gives
DeepseekV3Attention's output; every attention kernel honours model.attention.scale; sliding-window
layers rotate with their own base.
"""

import dataclasses

import pytest
import torch

from fivefold.model.attention import LatentAttention, attend
from fivefold.model.config import AttentionConfig, LatentConfig, ModelConfig, NormConfig, RopeConfig
from fivefold.model.flex import flex_attention_core
from fivefold.model.masks import AttentionMask, dense_attention
from fivefold.model.rope import inverse_frequencies, layer_is_local, rope_cos_sin, yarn_softmax_scale
from fivefold.model.transformer import Transformer

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# The published RoPE parameters: (ours, the transformers config they come from, rotated width).
LLAMA31_8B = RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_context=8192)
DEEPSEEK_V3 = RopeConfig(theta=10000.0, scaling="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                         original_context=4096, beta_fast=32.0, beta_slow=1.0)
GPT_OSS = RopeConfig(theta=150000.0, scaling="yarn", factor=32.0, original_context=4096, beta_fast=32.0, beta_slow=1.0,
                     truncate=False)
GEMMA3_GLOBAL = RopeConfig(theta=1000000.0, scaling="linear", factor=8.0)


def _hf_configs():
    from transformers import DeepseekV3Config, Gemma3TextConfig, GptOssConfig, LlamaConfig

    return {
        "llama3.1-8b": (LLAMA31_8B, LlamaConfig(
            hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), 128),
        "deepseek-v3": (DEEPSEEK_V3, DeepseekV3Config(
            qk_rope_head_dim=64, max_position_embeddings=163840,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1}), 64),
        "gpt-oss": (GPT_OSS, GptOssConfig(
            head_dim=64, max_position_embeddings=131072,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False}), 64),
        "gemma3-global": (GEMMA3_GLOBAL, Gemma3TextConfig(
            head_dim=256, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                               "rope_theta": 1000000.0},
                                           "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
         256),
    }


@pytest.mark.parametrize("name", ["llama3.1-8b", "deepseek-v3", "gpt-oss", "gemma3-global"])
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    ours, hf, dim = _hf_configs()[name]
    layer_type = "full_attention" if name.startswith("gemma3") else None
    kwargs = {"layer_type": layer_type} if layer_type else {}
    theirs, their_factor = ROPE_INIT_FUNCTIONS[ours.scaling](hf, "cpu", **kwargs)
    w, factor = inverse_frequencies(ours, dim)
    assert torch.equal(w, theirs)  # bit for bit
    assert factor == their_factor
    assert not torch.equal(w, inverse_frequencies(RopeConfig(theta=ours.theta), dim)[0])


def test_gemma3_local_layers_rotate_with_their_own_base_unscaled():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    _, hf, dim = _hf_configs()["gemma3-global"]
    theirs, _ = Gemma3RotaryEmbedding.compute_default_rope_parameters(hf, "cpu", layer_type="sliding_attention")
    rope = dataclasses.replace(GEMMA3_GLOBAL, local_theta=10000.0)
    windows = AttentionConfig(window=512, window_pattern=("sliding",) * 5 + ("full",))
    assert torch.equal(inverse_frequencies(rope, dim, local=True)[0], theirs)
    assert [layer_is_local(rope, windows.layer_window(i)) for i in range(6)] == [True] * 5 + [False]
    assert not layer_is_local(GEMMA3_GLOBAL, windows.layer_window(0))  # local_theta unset: theta everywhere


def test_each_block_gets_its_layers_rotation():
    """Transformer.forward hands sliding layers the local rotation, the others the scaled global one."""
    cfg = ModelConfig(dim=32, n_layers=4, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                      attention=AttentionConfig(window=4, window_pattern=("sliding", "full")),
                      rope=dataclasses.replace(GPT_OSS, local_theta=100.0))
    model = Transformer(cfg)
    seen = {}

    def record(name):
        def hook(module, args):
            seen[name] = args[1:3]  # (cos, sin)
        return hook

    for name, block in model.layers.items():
        block.register_forward_pre_hook(record(name))
    model(torch.randint(0, 64, (1, 8)))
    pos, D = torch.arange(8), model.head_dim
    local, full = rope_cos_sin(pos, D, cfg.rope, local=True), rope_cos_sin(pos, D, cfg.rope)
    for name, (cos, sin) in seen.items():
        want = local if int(name) % 2 == 0 else full
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]), name
    assert not torch.equal(local[0], full[0])


def _llama_pair(rope_parameters: dict, ours: RopeConfig):
    """A tiny LlamaForCausalLM and our Transformer holding its weights (Llama's names mapped by hand)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=96, rms_norm_eps=1e-5,
                                      max_position_embeddings=256, rope_parameters=rope_parameters)).eval()
    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=96, norm=NormConfig(eps=1e-5),
                      rope=ours)
    model = Transformer(cfg)
    names = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head", "attn.wq": "q_proj",
             "attn.wk": "k_proj", "attn.wv": "v_proj", "attn.wo": "o_proj", "ffn.gate": "gate_proj",
             "ffn.up": "up_proj", "ffn.down": "down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    theirs = hf.state_dict()
    state = {}
    for key in model.state_dict():
        module = key.rsplit(".", 1)[0]
        if key.startswith("layers."):
            _, i, rest = module.split(".", 2)
            where = "self_attn" if rest.startswith("attn.") else "mlp" if rest.startswith("ffn.") else None
            hf_key = ".".join(x for x in ("model.layers", i, where, names[rest], "weight") if x)
        else:
            hf_key = f"{names[module]}.weight"
        state[key] = theirs[hf_key]
    model.load_state_dict(state)
    return hf, model


@pytest.mark.parametrize("kind", ["llama3", "yarn"])
def test_tiny_llama_with_scaled_rope_gives_transformers_logits(kind):
    # llama3: wavelengths 6, 33, 170, ... over a context of 64: one pair kept, one smoothed, the rest scaled
    if kind == "llama3":
        hf_rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        ours = RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, original_context=64)
    else:
        hf_rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
        ours = RopeConfig(theta=10000.0, scaling="yarn", factor=4.0, original_context=64)
    hf, model = _llama_pair(hf_rope, ours)
    x = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        theirs, mine = hf(x).logits, model(x)  # (2, 40, 96)
        plain = Transformer(dataclasses.replace(model.cfg, rope=dataclasses.replace(ours, scaling="")))
        plain.load_state_dict(model.state_dict())
        unscaled = plain(x)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)
    assert (unscaled - theirs).abs().max() > 1e-3  # the scaling matters at these positions


def test_deepseek_v3_latent_attention_with_yarn_and_its_softmax_scale_equals_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
    hf_cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                              rms_norm_eps=1e-6, rope_interleave=False, max_position_embeddings=640,
                              rope_parameters=rope)
    hf_cfg._attn_implementation = "sdpa"  # causal without a mask tensor
    torch.manual_seed(0)
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.2)
    scale = yarn_softmax_scale(16 + 8, 40.0, 1.0)
    assert scale == hf.scaling
    cfg = ModelConfig(dim=64, n_heads=4, n_kv_heads=4, norm=NormConfig(eps=1e-6),
                      latent=LatentConfig(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                          v_head_dim=12),
                      rope=RopeConfig(scaling="yarn", factor=40.0, mscale=1.0, mscale_all_dim=1.0, original_context=16),
                      attention=AttentionConfig(scale=scale))
    ours = LatentAttention(cfg)
    names = {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj", "wkv_a": "kv_a_proj_with_mqa",
             "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    theirs = hf.state_dict()
    ours.load_state_dict({k: theirs[f"{names[k.split('.')[0]]}.weight"] for k in ours.state_dict()})
    x, pos = torch.randn(2, 24, 64), torch.arange(24)
    with torch.no_grad():
        want = hf(x, DeepseekV3RotaryEmbedding(hf_cfg)(x, pos[None]), None)[0]  # (2, 24, 64)
        got = ours(x, *rope_cos_sin(pos, 8, cfg.rope))
        plain_scale = dataclasses.replace(cfg, attention=AttentionConfig(scale=0.0))
        off = LatentAttention(plain_scale)
        off.load_state_dict(ours.state_dict())
        without = off(x, *rope_cos_sin(pos, 8, cfg.rope))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (without - want).abs().max() > 1e-3


def test_softmax_scale_of_deepseek_v3_as_published():
    """192-wide query/key heads, factor 40, mscale_all_dim 1: (0.1 ln 40 + 1)^2 / sqrt(192)."""
    assert yarn_softmax_scale(192, 40.0, 1.0) == pytest.approx((0.1 * 2.302585093 * 1.602059991 + 1) ** 2 / 192 ** 0.5)
    assert yarn_softmax_scale(192, 40.0, 0.0) == 192 ** -0.5  # no mscale_all_dim: the plain scale
    assert yarn_softmax_scale(192, 1.0, 1.0) == 192 ** -0.5  # not stretched


@pytest.mark.parametrize("backend", ["sdpa", "blockwise", "flex"])
def test_every_kernel_takes_the_softmax_scale(backend):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 16, 4, 8), torch.randn(2, 16, 2, 8), torch.randn(2, 16, 2, 8)
    mask = None if backend == "sdpa" else AttentionMask(window=5, sinks=torch.randn(4))
    if backend == "flex":
        got = flex_attention_core(q, k, v, mask, compiled=False, scale=0.9)  # eager: CPU has no flex backward
    else:
        got = attend(q, k, v, mask, 0.9, backend)
    torch.testing.assert_close(got, dense_attention(q, k, v, mask, 0.9), rtol=0, atol=2e-6)
    assert (got - dense_attention(q, k, v, mask)).abs().max() > 1e-2


@pytest.mark.parametrize("latent", [False, True])
def test_both_attentions_call_their_core_with_the_softmax_scale(latent):
    mla = LatentConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    cfg = ModelConfig(dim=32, n_heads=2, n_kv_heads=2, attention=AttentionConfig(scale=0.3),
                      latent=mla if latent else LatentConfig())
    model = Transformer(dataclasses.replace(cfg, n_layers=1, vocab_size=16))
    seen = []
    model.layers["0"].attn.core = lambda q, k, v, mask, scale: seen.append(scale) or attend(q, k, v, mask, scale)
    model(torch.randint(0, 16, (1, 4)))
    assert seen == [0.3]
