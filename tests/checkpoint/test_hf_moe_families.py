"""Qwen3-MoE, Kimi K2, gpt-oss, and DeepSeek-V3 as released (fp8 block scales, an MTP layer) in and out."""

import dataclasses
import json

import pytest
import torch
from helpers import assert_same_hf_directory, converted_hf, tiny_config
from safetensors.torch import load_file, save_file
from test_hf import LAYOUTS, _logits

from fivefold.checkpoint.convert import fivefold_to_hf, hf_to_fivefold
from fivefold.checkpoint.hf import HFFormatError, HFSource, model_config_from_hf
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.config.load import replace
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=320,
             initializer_range=0.2)  # std 0.2: logits of order 1, so errors show
# Each published config's structural keys at toy width (widths, counts and vocabulary shrunk):
# Qwen/Qwen3-30B-A3B (128 experts top-8 -> 8 top-4, head_dim 128 independent of dim / heads -> 32).
QWEN3_MOE = dict(num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                 num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                 rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
# moonshotai/Kimi-K2-Base: DeepSeek-V3's architecture with no expert groups (n_group 1), one dense block,
# routed scale 2.827 (384 experts top-8 -> 8 top-2; with its YaRN below).
KIMI_K2 = dict(num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
               num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
               routed_scaling_factor=2.827, norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, rope_theta=50000.0, rms_norm_eps=1e-6,
               num_nextn_predict_layers=0)
# deepseek-ai/DeepSeek-V3 as in tests/checkpoint/test_hf.py, released as fp8 with one MTP layer (below).
DEEPSEEK = {**KIMI_K2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5, "rope_theta": 10000.0}
# openai/gpt-oss-20b: q/k/v/o biases, sinks, sliding (128 -> 8, so that it cuts 16 tokens) and full layers
# alternating, 32 experts top-4 -> 4 top-2 with biases, head_dim 64 apart from dim / heads -> 16, the clamped
# SwiGLU (its limit 7 -> 1, so that the clamp acts on logits of order 1). RoPE plain here, YaRN below.
GPT_OSS = dict(num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_bias=True,
               swiglu_limit=1.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
# Their YaRN as released (DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1, so a softmax scale of
# (0.1 ln 40 + 1)^2 / sqrt(Dn + Dr); Kimi K2: factor 32, beta_fast 1; gpt-oss: factor 32, no truncation), with
# an original context of 4 so that the scaling reaches the frequencies 16 tokens see.
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
KINDS = {"qwen3-moe": ("Qwen3Moe", QWEN3_MOE),
         "qwen3-moe-dense-first": ("Qwen3Moe", {**QWEN3_MOE, "mlp_only_layers": [0], "norm_topk_prob": False}),
         "kimi-k2": ("DeepseekV3", KIMI_K2), "gpt-oss": ("GptOss", GPT_OSS),
         "deepseek-v3-yarn": ("DeepseekV3", {**KIMI_K2, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
                                             "rope_parameters": {**YARN, "rope_theta": 10000.0}}),
         "kimi-k2-yarn": ("DeepseekV3", {**KIMI_K2, "rope_parameters": {
             **YARN, "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0}}),
         "gpt-oss-yarn": ("GptOss", {**GPT_OSS, "rope_parameters": {
             "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
             "truncate": False, "original_max_position_embeddings": 4}})}
BLOCK = [32, 48]  # fp8 block scales of the toy: 96 x 64 and 64 x 96 weights end in partial blocks both ways
FP8_MAX = 448.0  # the largest finite float8 e4m3fn


def hf_class(kind: str, what: str):
    import transformers

    return getattr(transformers, kind + what)


def _random_model(kind: str, extra: dict):
    torch.manual_seed(0)
    hf = hf_class(kind, "ForCausalLM")(hf_class(kind, "Config")(**{**SHAPE, **extra})).eval()
    with torch.no_grad():  # norms and the routing bias random too, so a swapped or lost one shows
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:
            if name.endswith("norm.weight"):
                t.normal_(1, 0.2)
            elif name.endswith(("e_score_correction_bias", "sinks")) or name.endswith("bias"):
                t.normal_(0, 0.2)
    return hf


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per kind: a random fp32 HF model saved by save_pretrained, its logits on a fixed batch, and the
    seed directory `fivefold convert --to fivefold` makes of it."""
    out = {}
    for name, (kind, extra) in KINDS.items():
        root = tmp_path_factory.mktemp(name)
        hf = _random_model(kind, extra)
        out[name] = dict(converted_hf(hf, root, SHAPE["vocab_size"], max_shard_size="60KB"), kind=kind)
    return out


def _run_config(tmp_path, m, parallel):
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(m["hf"]).model_cfg), parallel=parallel,
                  train={"global_batch": 2, "micro_batch": 1})
    return cfg


# Under tp2 and ep2 each family once, with its released RoPE (the plain-RoPE variants read the same names).
CASES = [(layout, kind) for kind in KINDS for layout in ("single", "tp2", "dp2-ep2")
         if layout == "single" or kind in ("qwen3-moe", "deepseek-v3-yarn", "kimi-k2-yarn", "gpt-oss-yarn")]


@pytest.mark.parametrize("layout,kind", CASES)
def test_same_logits_as_transformers(tmp_path, models, layout, kind):
    m = models[kind]
    world, parallel = LAYOUTS[layout]
    cfg = _run_config(tmp_path, m, parallel)
    assert validate(cfg, world) == []
    both = run_workers(_logits, world, cfg, [m["seed"], m["hf"]], m["x"])[-1]
    assert len(both) == 2
    for logits in both:
        # The experts are summed in another order than transformers' (and DeepSeek-V3's attention pads its
        # values): fp32 rounding, measured on logits up to 6.8 (one process / tp2 / ep2): Qwen3-MoE 1.9e-6 /
        # 3.9e-6 / 1.9e-6, Kimi K2 6.7e-6 / 6.9e-6 / 6.7e-6, gpt-oss 3.8e-6 in all three; with YaRN DeepSeek-V3
        # 8.6e-6 / 7.6e-6 / 8.6e-6, Kimi K2 7.3e-6 / 8.7e-6 / 7.3e-6, gpt-oss 6.2e-6 / 5.4e-6 / 6.2e-6. A wrong
        # mapping (a transposed expert, gate and up swapped, a lost q/k norm, windows on every layer, a lost
        # softmax scale) moves them by O(0.1-1).
        torch.testing.assert_close(logits, m["logits"], rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_fivefold_to_hf_is_exact(tmp_path, models, kind):
    m = models[kind]
    fivefold_to_hf(m["seed"], tmp_path / "back", max_shard_bytes=60_000)
    assert_same_hf_directory(m["hf"], tmp_path / "back")
    hf = hf_class(m["kind"], "ForCausalLM").from_pretrained(tmp_path / "back").eval()  # transformers reads it
    with torch.no_grad():
        torch.testing.assert_close(hf(m["x"]).logits, m["logits"], rtol=0, atol=0)


def test_qwen3_moe_reads_leading_dense_blocks_and_refuses_other_layouts(models):
    config = json.loads((models["qwen3-moe-dense-first"]["hf"] / "config.json").read_text())
    m = model_config_from_hf(config)
    assert (m.moe.first_dense_layers, m.ffn_dim, m.moe.ffn_dim, m.moe.norm_topk, m.norm.qk) == (1, 96, 32, False, True)
    for bad, message in [({"mlp_only_layers": [1]}, "mlp_only_layers = [1]"),
                         ({"decoder_sparse_step": 2}, "decoder_sparse_step = 2"),
                         ({"use_sliding_window": True}, "use_sliding_window = True")]:
        with pytest.raises(HFFormatError) as e:
            model_config_from_hf({**config, **bad})
        assert message in str(e.value)


# The released config.json of each MoE preset, its model keys as published (Hugging Face model pages of
# Qwen/Qwen3-30B-A3B, deepseek-ai/DeepSeek-V3, moonshotai/Kimi-K2-Base, openai/gpt-oss-20b and -120b).
DEEPSEEK_V3_CONFIG = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
    n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
    qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="noaux_tc", n_group=8, topk_group=4,
    num_experts_per_tok=8, moe_layer_freq=1, first_k_dense_replace=3, norm_topk_prob=True, scoring_func="sigmoid",
    aux_loss_alpha=0.001, seq_aux=True, hidden_act="silu", max_position_embeddings=163840, initializer_range=0.02,
    rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000, attention_bias=False, attention_dropout=0.0,
    vocab_size=129280, num_nextn_predict_layers=1, torch_dtype="bfloat16",
    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                      mscale=1.0, mscale_all_dim=1.0),
    quantization_config=dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]))
RELEASED = {
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_window_layers=48, use_sliding_window=False, sliding_window=None, router_aux_loss_coef=0.001,
        output_router_logits=False, attention_bias=False, attention_dropout=0.0, hidden_act="silu",
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, vocab_size=151936, tie_word_embeddings=False,
        initializer_range=0.02, torch_dtype="bfloat16"),
    "deepseek-v3": DEEPSEEK_V3_CONFIG,
    "kimi-k2": {**DEEPSEEK_V3_CONFIG, "model_type": "kimi_k2", "num_attention_heads": 64, "num_key_value_heads": 64,
                "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 2.827, "rope_theta": 50000.0, "vocab_size": 163840,
                "num_nextn_predict_layers": 0, "max_position_embeddings": 131072,
                "rope_scaling": dict(type="yarn", factor=32.0, original_max_position_embeddings=4096, beta_fast=1.0,
                                     beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)},
    **{f"gpt-oss-{size}": dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=layers, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=experts,
        num_experts_per_tok=4, experts_per_token=4, attention_bias=True, sliding_window=128, swiglu_limit=7.0,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2), rms_norm_eps=1e-5, rope_theta=150000,
        vocab_size=201088, tie_word_embeddings=False, hidden_act="silu", initializer_range=0.02,
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        quantization_config=dict(quant_method="mxfp4"), torch_dtype="bfloat16")
        for size, layers, experts in [("20b", 24, 32), ("120b", 36, 128)]},
}


@pytest.mark.parametrize("preset", RELEASED)
def test_released_configs_convert_to_their_presets(preset):
    """A preset and the conversion of its model's released config.json agree field by field (YaRN and
    DeepSeek's softmax scale included), but for what config.json does not state (DeepSeek-V3's
    balance-loss weight, a training option; its MTP depth, which the presets leave off)."""
    from fivefold.model.presets import PRESETS

    read, want = model_config_from_hf(RELEASED[preset]), PRESETS[preset]
    assert read.mtp_layers == RELEASED[preset].get("num_nextn_predict_layers", 0)  # DeepSeek-V3: 1
    assert read == dataclasses.replace(want, moe=dataclasses.replace(want.moe, aux_loss=0.0),
                                       mtp_layers=read.mtp_layers)


# ---- DeepSeek-V3 as released: fp8 weights with block scales, a multi-token-prediction layer --------------------
def _quantize(weight: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (R, C) -> fp8 e4m3 and the fp32 scale of each block (its largest |value| / 448), as
    DeepSeek's released weights are stored (W = fp8 x scale_inv)."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / FP8_MAX
    wide = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:rows, :cols]
    return (weight / wide).to(torch.float8_e4m3fn), scale


# The names of DeepSeek-V3's MTP layer as released (model.layers.61.* in deepseek-ai/DeepSeek-V3's
# model.safetensors.index.json, README_WEIGHTS.md), for the toy's layer 2: its own norms and projection, the
# copies of the embedding and head, and a MoE block of 8 experts; fp8 projections with their block scales.
MTP_OWN = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "embed_tokens.weight",
           "shared_head.head.weight"]
MTP_BLOCK = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_a_proj.weight",
             "self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
             "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
             "mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.shared_experts.gate_proj.weight",
             "mlp.shared_experts.up_proj.weight", "mlp.shared_experts.down_proj.weight",
             *[f"mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")]]
MTP_NAMES = {f"model.layers.2.{n}" for n in MTP_OWN + MTP_BLOCK}
MTP_SCALES = {n + "_scale_inv" for n in MTP_NAMES if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))}


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A DeepSeek-V3 toy saved by transformers, then written as DeepSeek released its weights: every
    projection fp8 with `weight_scale_inv`, quantization_config, and an MTP layer past the last block
    (its block layer 1's with every tensor reversed along its first dimension, so that it differs; its
    norms and projection random; its embed_tokens and shared_head.head copies of the main model's).
    Beside it the same weights dequantized by transformers' own function, unquantized ("deq"): what the
    conversion must read, and transformers' logits of it (transformers builds no MTP module)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    root = tmp_path_factory.mktemp("released")
    hf = _random_model("DeepseekV3", DEEPSEEK)
    hf.save_pretrained(root / "saved")
    tensors = load_file(str(root / "saved" / "model.safetensors"))
    layers = SHAPE["num_hidden_layers"]  # the MTP layer: a block plus its own norms, projection and head
    tensors |= {f"model.layers.{layers}.{k.split('.', 3)[3]}": v.flip(0) for k, v in tensors.items()
                if k.startswith("model.layers.1.")}
    tensors |= {f"model.layers.{layers}.{k}": torch.randn(s) for k, s in
                [("enorm.weight", (64,)), ("hnorm.weight", (64,)), ("shared_head.norm.weight", (64,)),
                 ("eh_proj.weight", (64, 128))]}
    tensors |= {f"model.layers.{layers}.embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                f"model.layers.{layers}.shared_head.head.weight": tensors["lm_head.weight"].clone()}
    quantized, dequantized = {}, {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, scale = _quantize(t, BLOCK)
            quantized |= {name: q, name + "_scale_inv": scale}
            dequantized[name] = _dequantize_fp8_weight(q, scale, BLOCK, torch.float32)
        else:
            quantized[name] = dequantized[name] = t
    config = {**json.loads((root / "saved" / "config.json").read_text()), "num_nextn_predict_layers": 1}
    for name, weights, extra in [("deq", dequantized, {}),
                                 ("fp8", quantized, {"quantization_config": {
                                     "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": BLOCK}})]:
        (root / name).mkdir()
        save_file(weights, str(root / name / "model.safetensors"), {"format": "pt"})
        (root / name / "config.json").write_text(json.dumps({**config, **extra}))
    reference = hf_class("DeepseekV3", "ForCausalLM").from_pretrained(root / "deq").eval()
    x = torch.randint(0, SHAPE["vocab_size"], (2, 16))
    with torch.no_grad():
        logits = reference(x).logits
    return dict(root=root, x=x, logits=logits, fp8=len(quantized) - len(dequantized), quantized=quantized,
                dequantized=dequantized)


def test_released_deepseek_converts_to_the_dequantized_weights(tmp_path, released, capsys):
    root = released["root"]
    hf_to_fivefold(root / "fp8", tmp_path / "seed", max_shard_bytes=10**9)
    said = capsys.readouterr().out
    assert f"dequantized {released['fp8']} fp8 tensors (32 x 48 block scales) to float32" in said
    assert ("read model.layers.2.* as multi-token prediction (mtp.0); its 2 stored copies of the embedding and "
            "head kept once") in said
    hf_to_fivefold(root / "deq", tmp_path / "from-deq", max_shard_bytes=10**9)
    ours, want = SafetensorsDir(tmp_path / "seed"), SafetensorsDir(tmp_path / "from-deq")
    assert ours.names() == want.names()
    for name in want.names():
        assert ours.dtype(name) == want.dtype(name) and torch.equal(ours.read(name), want.read(name)), name
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(root / "fp8").model_cfg),
                  train={"global_batch": 2, "micro_batch": 1})
    assert cfg.model.mtp_layers == 1  # the MTP depth loaded too, from the seed and from the fp8 directory itself
    for logits in run_workers(_logits, 1, cfg, [tmp_path / "seed", root / "fp8"], released["x"])[-1]:
        torch.testing.assert_close(logits, released["logits"], rtol=0, atol=2e-5)  # as DeepSeek-V3 in test_hf.py

    # Out again: unquantized, in the dtype asked, which transformers loads; the message says so.
    fivefold_to_hf(tmp_path / "seed", tmp_path / "back", dtype=torch.bfloat16)
    assert "written unquantized in bfloat16 (the checkpoint it came from was fp8" in capsys.readouterr().out
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
    back = SafetensorsDir(tmp_path / "back")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert back.dtype(name) == torch.bfloat16 and torch.equal(back.read(name), want.read(
        "layers.1.ffn.experts.up")[3].T.bfloat16())
    hf_class("DeepseekV3", "ForCausalLM").from_pretrained(tmp_path / "back")


def test_released_deepseek_dequantizes_to_the_dtype_asked(tmp_path, released):
    source = HFSource(released["root"] / "fp8", dtype=torch.bfloat16)
    name = "layers.0.attn.wo.weight"
    assert source.dtype(name) == torch.bfloat16 and source.dtype("layers.0.attn_norm.weight") == torch.float32
    deq = SafetensorsDir(released["root"] / "deq").read("model.layers.0.self_attn.o_proj.weight")
    assert torch.equal(source.read(name), deq.bfloat16())  # one rounding of the fp32 product


def test_fp8_weights_without_their_scales_are_refused(tmp_path, released):
    tensors = load_file(str(released["root"] / "fp8" / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    (tmp_path / "bad" / "config.json").write_text((released["root"] / "fp8" / "config.json").read_text())
    with pytest.raises(ValueError, match="^model.layers.0.self_attn.o_proj.weight is fp8 without its block scales "
                                         "model.layers.0.self_attn.o_proj.weight_scale_inv[^\n]*$"):
        hf_to_fivefold(tmp_path / "bad", tmp_path / "out", max_shard_bytes=10**9)
    assert not (tmp_path / "out").exists()


# ---- gpt-oss as released: MXFP4 experts -----------------------------------------------------------------------
def test_released_gpt_oss_converts_to_the_dequantized_experts(tmp_path, capsys):
    """A gpt-oss toy whose experts are stored as openai/gpt-oss-20b stores them (`*_blocks` of packed FP4
    pairs, `*_scales` of E8M0 exponents, quant_method mxfp4): random codes, and beside it the same experts
    dequantized by transformers' own function. Both convert to the same seed, whose logits are
    transformers' on the dequantized model; written back unquantized, which transformers loads."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = _random_model("GptOss", GPT_OSS)
    hf.save_pretrained(tmp_path / "saved")
    tensors = load_file(str(tmp_path / "saved" / "model.safetensors"))
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    g = torch.Generator().manual_seed(1)
    packed, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # (E, in, out), stored (E, out, in/32, 16)
            experts, ins, outs = t.shape
            blocks = torch.randint(0, 256, (experts, outs, ins // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(121, 124, (experts, outs, ins // 32), generator=g, dtype=torch.uint8)  # 2^-6..2^-4
            packed |= {name + "_blocks": blocks, name + "_scales": scales}
            plain[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
        else:
            packed[name] = plain[name] = t
    for name, weights, extra in [("deq", plain, {}), ("mxfp4", packed, {"quantization_config": {
            "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}})]:
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "model.safetensors"), {"format": "pt"})
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    hf_to_fivefold(tmp_path / "mxfp4", tmp_path / "seed", max_shard_bytes=10**9)
    assert "dequantized 4 MXFP4 tensors (blocks of 32 with a shared scale) to float32" in capsys.readouterr().out
    hf_to_fivefold(tmp_path / "deq", tmp_path / "from-deq", max_shard_bytes=10**9)
    ours, want = SafetensorsDir(tmp_path / "seed"), SafetensorsDir(tmp_path / "from-deq")
    assert ours.names() == want.names()
    for name in want.names():
        assert ours.dtype(name) == want.dtype(name) and torch.equal(ours.read(name), want.read(name)), name
    reference = hf_class("GptOss", "ForCausalLM").from_pretrained(tmp_path / "deq").eval()
    x = torch.randint(0, SHAPE["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = reference(x).logits
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(tmp_path / "mxfp4").model_cfg),
                  train={"global_batch": 2, "micro_batch": 1})
    logits = run_workers(_logits, 1, cfg, [tmp_path / "seed"], x)[-1][0]
    torch.testing.assert_close(logits, expected, rtol=0, atol=2e-5)
    fivefold_to_hf(tmp_path / "seed", tmp_path / "back")
    assert "written unquantized in float32 (the checkpoint it came from was mxfp4" in capsys.readouterr().out
    back = SafetensorsDir(tmp_path / "back")
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert torch.equal(back.read(name), plain[name]), name
    hf_class("GptOss", "ForCausalLM").from_pretrained(tmp_path / "back")
