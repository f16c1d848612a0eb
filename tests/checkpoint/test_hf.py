"""Hugging Face Llama, Mixtral and DeepSeek-V3 in and out: same logits in every layout, exact round trips."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from helpers import SPECIAL_EOS, assert_same_hf_directory, converted_hf, parallelized, tiny_bpe, tiny_config

from fivefold.checkpoint.convert import fivefold_to_hf, hf_to_fivefold
from fivefold.checkpoint.hf import HFFormatError, HFSource, model_config_from_hf
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.checkpoint.weights import check_init_from, load_weights
from fivefold.config.load import replace
from fivefold.data.resolve import resolved_model
from fivefold.model.transformer import Transformer
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=320, initializer_range=0.2)  # std 0.2, not 0.02: logits of order 1, so errors show
# DeepSeek-V3 in miniature: a dense block then a MoE block of 8 experts in 4 groups (top-2 within 2),
# a shared expert, routed scale 2.5, latent attention with a RoPE part of 8 per head.
DEEPSEEK = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, num_mtp_layers=0)
KINDS = {"llama": ("Llama", {}),  # transformers' classes by name: importing it costs seconds, so only when used
         "llama-tied": ("Llama", dict(tie_word_embeddings=True)),  # no lm_head.weight saved
         "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
         "deepseek": ("DeepseekV3", DEEPSEEK),
         # queries straight from x (q_proj), RoPE rows in fivefold's own order
         "deepseek-plain": ("DeepseekV3", {**DEEPSEEK, "q_lora_rank": None, "rope_interleave": False})}


def hf_class(kind: str, what: str):
    import transformers

    return getattr(transformers, KINDS[kind][0] + what)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per kind: a random fp32 HF model saved in 40 KB shards (the sharded index path), its logits
    on a fixed batch, and the seed directory `fivefold convert --to fivefold` makes of it."""
    out = {}
    for kind, (_, extra) in KINDS.items():
        root = tmp_path_factory.mktemp(kind)
        torch.manual_seed(0)
        hf = hf_class(kind, "ForCausalLM")(hf_class(kind, "Config")(**{**SHAPE, **extra})).eval()
        # transformers starts norms at 1 and the routing bias at 0; DeepSeek's get random ones, so that
        # swapped norms (latent ones included) and a lost bias (std 0.2 changes which experts are picked) show.
        with torch.no_grad():
            for name, t in [*hf.named_parameters(), *hf.named_buffers()] if kind.startswith("deepseek") else []:
                if name.endswith("norm.weight"):
                    t.normal_(1, 0.2)
                elif name.endswith("e_score_correction_bias"):
                    t.normal_(0, 0.2)
        out[kind] = converted_hf(hf, root, SHAPE["vocab_size"])
    return out


def _logits(rank, world, cfg, sources, x, save_to=None):
    """Load each weights directory in turn into this rank's part of the layout and run x; the
    last rank returns the whole logits of each. `save_to`: also write a run checkpoint of it."""
    par = parallelized(cfg, world)
    mesh = par.mesh
    stride = world // mesh.size("pp")  # pp is the outermost mesh axis: stages are this many ranks apart
    out = []
    for weights in sources:
        load_weights(weights, par)
        if save_to is not None:  # what a run checkpoint holds: DTensor shards written by every rank
            dcp.save({"model": par.model_state_dict()}, checkpoint_id=str(save_to))
        with torch.no_grad():
            h = x
            if mesh.rank("pp") > 0:
                h = torch.empty(*x.shape, cfg.model.dim)
                dist.recv(h, src=rank - stride)
            h = par.model(h)  # (B, T, dim) on the first stage, (B, T, V/tp) on the last
            if mesh.rank("pp") < mesh.size("pp") - 1:
                dist.send(h, dst=rank + stride)
                continue
            parts = [torch.empty_like(h) for _ in range(mesh.size("tp"))]
            dist.all_gather(parts, h.contiguous(), group=mesh.group("tp").pg)
            out.append(torch.cat(parts, dim=-1))  # (B, T, V)
    return out


LAYOUTS = {"single": (1, {}), "tp2": (2, {"tp": 2}), "pp2": (2, {"pp": 2}), "dp2-ep2": (2, {"ep": 2})}
# ep needs experts; deepseek-plain differs from deepseek in its attention's reading only.
# DeepSeek-V3 under tp2 and ep2: test_hf_moe_families.py (with its released YaRN).
CASES = [(layout, kind) for layout in LAYOUTS for kind in KINDS
         if (layout != "dp2-ep2" or kind == "mixtral")
         and (layout in ("single", "pp2") or not kind.startswith("deepseek"))
         and (layout == "single" or kind != "deepseek-plain")]


@pytest.mark.parametrize("layout,kind", CASES)
def test_same_logits_as_transformers_in_every_layout(tmp_path, models, layout, kind):
    m = models[kind]
    world, parallel = LAYOUTS[layout]
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(m["hf"]).model_cfg), parallel=parallel,
                  train={"global_batch": 2, "micro_batch": 1})
    assert validate(cfg, world) == []
    # The seed directory, and the HF directory read directly: both ways in must agree.
    both = run_workers(_logits, world, cfg, [m["seed"], m["hf"]], m["x"])[-1]
    assert len(both) == 2
    for logits in both:
        # One process, pp and ep: the same kernels as transformers on the same rows, measured
        # bit-equal. tp adds each row-parallel product from two halves (an all-reduce), another fp32
        # rounding: measured 5.5e-6 on logits up to 6.4, bound 2e-5. DeepSeek-V3 is bit-equal in no
        # layout: its attention (HF's SDPA call takes values of width 12, fivefold pads them to 24) and
        # its MoE (the experts added in another order) each differ by one or two fp32 ulps (measured
        # per module); logits up to 6.5 differ by 6.4e-6 (one process, pp2, ep2) and 7.2e-6 (tp2),
        # deepseek-plain's up to 8.0 by 6.6e-6; bound 2e-5. A wrong mapping (w1 and w3 swapped, a
        # transposed expert, a permuted head, RoPE rows in HF's order, a lost routing bias) moves
        # them by O(0.1-1).
        exact = layout != "tp2" and not kind.startswith("deepseek")
        torch.testing.assert_close(logits, m["logits"], rtol=0, atol=0 if exact else 2e-5)


def test_a_wrong_rope_permutation_is_caught(models):
    """Meta's adjacent-pair layout (HF's conversion script permutes wq and wk out of it,
    per head: view(H, D/2, 2, dim).transpose(1, 2)) applied once more must change the logits."""
    m = models["llama"]
    model = Transformer(HFSource(m["hf"]).model_cfg)
    seed = SafetensorsDir(m["seed"])
    model.load_state_dict({n: seed.read(n) for n in seed.names()})
    wq = model.layers["0"].attn.wq.weight
    with torch.no_grad():
        torch.testing.assert_close(model(m["x"]), m["logits"], rtol=0, atol=0)
        wq.copy_(wq.view(4, 8, 2, 64).transpose(1, 2).reshape(64, 64))  # (H D, dim) rows re-ordered per head
        assert (model(m["x"]) - m["logits"]).abs().max() > 0.1


def _seed_model(m) -> Transformer:
    model = Transformer(HFSource(m["hf"]).model_cfg)
    seed = SafetensorsDir(m["seed"])
    model.load_state_dict({n: seed.read(n) for n in seed.names()})
    return model


@pytest.mark.parametrize("tensor", ["wq_b", "wkv_a"])
def test_deepseek_rope_rows_in_hf_order_are_caught(models, tensor):
    """HF's DeepSeek-V3 rotates adjacent pairs of the RoPE part (rope_interleave); taken in HF's order,
    without the [evens, odds] reordering, either the queries' or the shared key's rows must show."""
    m = models["deepseek"]
    model = _seed_model(m)
    hf = SafetensorsDir(m["hf"])
    weight = getattr(model.layers["0"].attn, tensor).weight
    with torch.no_grad():
        torch.testing.assert_close(model(m["x"]), m["logits"], rtol=0, atol=2e-5)  # as in every layout above
        weight.copy_(hf.read({"wq_b": "model.layers.0.self_attn.q_b_proj.weight",
                              "wkv_a": "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"}[tensor]))
        assert (model(m["x"]) - m["logits"]).abs().max() > 0.1


def test_deepseek_without_its_routing_bias_is_caught(models):
    """e_score_correction_bias is expert_bias: a model that dropped it picks other experts."""
    m = models["deepseek"]
    model = _seed_model(m)
    with torch.no_grad():
        model.layers["1"].ffn.expert_bias.zero_()
        assert (model(m["x"]) - m["logits"]).abs().max() > 0.1


def test_fivefold_model_to_deepseek_for_transformers(tmp_path):
    """A model fivefold made (no HF config to start from, no routing bias kept): transformers reads
    the export and computes fivefold's logits."""
    from fivefold.checkpoint.seed import write_seed_checkpoint

    cfg = tiny_config(tmp_path, "--model.preset=tiny-mla", "--model.n_layers=2", "--model.norm.eps=1e-6",
                      "--model.init_std=0.2")
    write_seed_checkpoint(cfg, tmp_path / "seed", progress=False)
    fivefold_to_hf(tmp_path / "seed", tmp_path / "hf")
    model = Transformer(resolved_model(cfg))
    seed = SafetensorsDir(tmp_path / "seed")
    model.load_state_dict({n: seed.read(n) for n in seed.names()})
    hf = hf_class("deepseek", "ForCausalLM").from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    with torch.no_grad():
        # Measured 7.9e-6 on logits up to 7.2; bound as in test_same_logits_as_transformers_in_every_layout.
        torch.testing.assert_close(hf(x).logits, model(x), rtol=0, atol=2e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["rope_interleave"] and config["num_nextn_predict_layers"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_hf_to_fivefold_to_hf_is_exact(tmp_path, models, kind):
    m = models[kind]
    fivefold_to_hf(m["seed"], tmp_path / "back", max_shard_bytes=30_000)
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()  # sharded on the way out too
    assert_same_hf_directory(m["hf"], tmp_path / "back")


@pytest.mark.parametrize("layout,kind", [("tp2", "llama"), ("dp2-ep2", "mixtral"), ("tp2", "deepseek")])
def test_run_checkpoint_to_hf_is_exact(tmp_path, models, layout, kind):
    """A checkpoint saved as DTensor shards (tp slices, ep expert groups) -> HF, read tensor by tensor
    (DeepSeek-V3: its routing bias kept, its RoPE rows put back in HF's order)."""
    m = models[kind]
    world, parallel = LAYOUTS[layout]
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(m["hf"]).model_cfg), parallel=parallel,
                  train={"global_batch": 2, "micro_batch": 1})
    run_workers(_logits, world, cfg, [m["hf"]], m["x"], tmp_path / "step")
    fivefold_to_hf(tmp_path / "step", tmp_path / "back", config=m["seed"] / "fivefold.toml",
                   hf_base=m["hf"] / "config.json")
    assert_same_hf_directory(m["hf"], tmp_path / "back")
    hf = hf_class(kind, "ForCausalLM").from_pretrained(tmp_path / "back").eval()  # transformers itself reads it back
    with torch.no_grad():
        torch.testing.assert_close(hf(m["x"]).logits, m["logits"], rtol=0, atol=0)


def test_what_fivefold_cannot_represent_is_refused(tmp_path, models):
    config = json.loads((models["llama"]["hf"] / "config.json").read_text())
    with pytest.raises(HFFormatError, match=r"architectures \['GPT2LMHeadModel'\]: fivefold reads LlamaForCausalLM, "
                                            r".*DeepseekV3ForCausalLM"):
        model_config_from_hf({**config, "architectures": ["GPT2LMHeadModel"]})
    scaled = {**config, "mlp_bias": True, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5}}
    with pytest.raises(HFFormatError, match="(?s)mlp_bias = True.*rope type 'dynamic': fivefold reads default, "
                                            "linear, llama3, yarn"):
        model_config_from_hf(scaled)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(config))
    (tmp_path / "bin" / "pytorch_model.bin").write_bytes(b"")
    error = check_init_from(tiny_config(tmp_path, f"--checkpoint.init_from={tmp_path / 'bin'}"))[0]
    assert "checkpoint.init_from" in error and "pickle" in error and "save_pretrained" in error
    mismatch = check_init_from(tiny_config(tmp_path, f"--checkpoint.init_from={models['llama']['hf']}"))[0]
    assert "model.rope.theta = 10000.0, this run has 10000.0" not in mismatch  # only real differences
    assert "layers.0.ffn.gate.weight: weights (96, 64), this model (128, 64)" in mismatch


def test_convert_copies_the_tokenizer_and_names_it(tmp_path, models, capsys):
    """An HF directory with a tokenizer: the seed directory gets its files and data.tokenizer names it,
    so training and sampling on the converted model use the model's own ids."""
    from fivefold.cli import main
    from fivefold.config.load import load_config
    from fivefold.data.tokenizer import load_tokenizer

    assert not (models["llama"]["seed"] / "tokenizer.json").exists()  # none in the HF directory: none copied
    hf = tmp_path / "hf"
    shutil.copytree(models["llama"]["hf"], hf)
    tiny_bpe(hf)
    (hf / "generation_config.json").write_text('{"eos_token_id": 0}')
    hf_to_fivefold(hf, tmp_path / "seed", max_shard_bytes=10**9)
    seed = tmp_path / "seed"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (seed / name).read_bytes() == (hf / name).read_bytes(), name
    cfg = load_config(seed / "fivefold.toml")
    assert cfg.data.tokenizer == str(seed) and cfg.checkpoint.init_from == str(seed)
    tok = load_tokenizer(cfg.data.tokenizer)
    assert tok.eod == tok.tok.token_to_id(SPECIAL_EOS)  # found through the copied tokenizer_config.json
    assert validate(cfg, 1) == []  # `fivefold train SEED/fivefold.toml` accepts it
    shutil.rmtree(hf)  # the seed directory stands alone
    assert main(["sample", str(seed), "--prompt", "def f(x):", "--max-new-tokens", "5", "--ignore-eod"]) == 0
    assert capsys.readouterr().out.startswith("def f(x):")


def test_what_deepseek_conversion_cannot_represent_is_refused(tmp_path, models):
    from fivefold.checkpoint.hf import export_problems
    from fivefold.model.presets import PRESETS

    config = json.loads((models["deepseek"]["hf"] / "config.json").read_text())
    unsupported = {**config, "rms_norm_eps": 1e-5, "quantization_config": {"quant_method": "awq"},
                   "scoring_func": "softmax",
                   "rope_scaling": {"type": "dynamic", "factor": 40}}
    del unsupported["rope_parameters"]  # DeepSeek's own config.json: the older rope_theta / rope_scaling keys
    with pytest.raises(HFFormatError, match="(?s)quantization_config.*rms_norm_eps = 1e-05.*latent norms.*"
                                            "scoring_func = 'softmax'.*rope type 'dynamic'"):
        model_config_from_hf(unsupported)
    assert export_problems(PRESETS["deepseek-v3"]) == []
    mla, tiny = PRESETS["tiny-mla"], PRESETS["tiny"]
    assert export_problems(mla) == []  # its norm.eps is DeepSeek-V3's 1e-6
    problems = export_problems(dataclasses.replace(mla, norm=dataclasses.replace(mla.norm, eps=1e-5)))  # HF's: 1e-6
    assert len(problems) == 1 and "model.norm.eps = 1e-05" in problems[0]
    # DeepSeek's routing without latent attention
    grouped = dataclasses.replace(mla, latent=dataclasses.replace(mla.latent, kv_lora_rank=0))
    assert export_problems(grouped) == ["model.latent.kv_lora_rank = 0 (HF's DeepSeek-V3 has latent attention)"]
    assert export_problems(PRESETS["tiny-moe"]) == []
    # A window is Mistral's (the family that lacks the fewest of the model's options is named), sinks no dense family's.
    windowed = dataclasses.replace(tiny, attention=dataclasses.replace(tiny.attention, window=8, sinks=True))
    assert export_problems(windowed) == ["model.attention.sinks = True: HF's Mistral computes attention.sinks = False"]
    # A run that does not keep the routing bias (moe.bias_update = 0) would load the weights without it.
    model = dataclasses.asdict(HFSource(models["deepseek"]["hf"]).model_cfg)
    model["moe"]["bias_update"] = 0.0
    error = check_init_from(replace(tiny_config(tmp_path), model=model,
                                    checkpoint={"init_from": str(models["deepseek"]["hf"])}))
    assert len(error) == 1 and "layers.1.ffn.expert_bias" in error[0] and "model.moe.bias_update = 0" in error[0]
