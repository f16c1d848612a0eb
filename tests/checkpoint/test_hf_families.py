"""Hugging Face dense families beyond Llama: each model built by transformers 5.23 from its published
config's structural keys at toy width converts both ways bit-exactly and computes transformers' logits,
in one process and under tp (+sp), pp and cp."""

import dataclasses
import json
import shutil
from operator import attrgetter

import pytest
import torch
import torch.distributed as dist
from helpers import assert_same_hf_directory, converted_hf, parallelized, tiny_config

from fivefold.checkpoint.convert import fivefold_to_hf, hf_to_fivefold
from fivefold.checkpoint.hf import HFFormatError, HFSource, hf_config, model_config_from_hf
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.checkpoint.weights import load_weights
from fivefold.config.load import replace
from fivefold.parallel.context import METHODS, positions
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=320, initializer_range=0.2)  # std 0.2, not 0.02: logits of order 1, so errors show
# Per family: transformers' class prefix, the config class, and the published config's structural keys
# (the flags, not the widths). Windows of 8 tokens on sequences of 16, so that they cut; head_dim and
# query_pre_attn_scalar apart from dim / n_heads, so that a scale taken from the wrong one shows.
FAMILIES = {
    # mistralai/Mistral-7B-v0.1: a window on every layer (v0.3 has none: null)
    "mistral": ("Mistral", "Mistral", dict(sliding_window=8, head_dim=16)),
    # Qwen/Qwen2.5-0.5B: q/k/v biases, tied embeddings, rope_theta 1e6
    "qwen2": ("Qwen2", "Qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
    # Qwen/Qwen3-0.6B: per-head q/k norms, head_dim 128 for dim 1024 / 16 heads, tied
    "qwen3": ("Qwen3", "Qwen3", dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
    # allenai/OLMo-2-0425-1B: post-norms, q/k norms over the whole projection, rope_theta 5e5
    "olmo2": ("Olmo2", "Olmo2", dict(rope_theta=5e5)),
    # google/gemma-3-1b-it: sandwich norms, GeGLU, 5 local : 1 global (here 1 : 1), local base 1e4,
    # query_pre_attn_scalar 256 = head_dim; here 20 and 24
    # meta-llama/Llama-3.2-1B: llama3 RoPE (factor 32, original context 8192, theta 5e5), tied; here an
    # original context of 8 so that the scaling reaches frequencies a 16-token sequence sees
    "llama3.2": ("Llama", "Llama", dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8})),
    "gemma3": ("Gemma3", "Gemma3Text", dict(
        head_dim=24, query_pre_attn_scalar=20, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}})),
}


# What each family's config.json must become beyond the shapes: the features its HF model computes, each
# ModelConfig field by its path.
EXPECTED = {
    "mistral": {"attention.window": 8, "attention.window_pattern": ()},
    "qwen2": {"attention.qkv_bias": True, "attention.out_bias": False, "tie_embeddings": True, "rope.theta": 1e6},
    "qwen3": {"norm.qk": True, "norm.qk_span": "head", "head_dim": 24, "attention.qkv_bias": False},
    "olmo2": {"norm.qk": True, "norm.qk_span": "all", "norm.position": "post", "norm.weight_fp32": True,
              "rope.theta": 5e5},
    "llama3.2": {"rope.scaling": "llama3", "rope.factor": 32.0, "rope.original_context": 8, "tie_embeddings": True},
    "gemma3": {"norm.position": "sandwich", "norm.offset": 1.0, "embed_scale": True, "activation": "gelu_tanh",
               "norm.qk": True, "attention.scale": 20**-0.5, "attention.window": 8,
               "attention.window_pattern": ("sliding", "full"), "rope.theta": 1e6, "rope.local_theta": 10000.0,
               "tie_embeddings": True},
}


def hf_class(kind: str, what: str):
    import transformers

    model, config, _ = FAMILIES[kind]
    return getattr(transformers, (config if what == "Config" else model) + what)


def _build(root, kind):
    """A random fp32 HF model of `kind` saved in 40 KB shards, its logits on a fixed batch, and the seed
    directory `fivefold convert --to fivefold` makes of it."""
    torch.manual_seed(0)
    hf = hf_class(kind, "ForCausalLM")(hf_class(kind, "Config")(**{**SHAPE, **FAMILIES[kind][2]})).eval()
    # transformers starts norms at 1 (Gemma's offsets at 0) and biases at 0: random ones, so that a swapped
    # norm (q for k, pre for post) or a lost bias shows.
    offset = 0.0 if kind == "gemma3" else 1.0
    with torch.no_grad():
        for name, t in hf.named_parameters():
            if name.endswith("norm.weight"):
                t.normal_(offset, 0.2)
            elif name.endswith(".bias"):
                t.normal_(0, 0.2)
    return converted_hf(hf, root, SHAPE["vocab_size"])


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each family's model, built the first time a test asks for it."""
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = _build(tmp_path_factory.mktemp(kind), kind)
        return cache[kind]
    return get


def hf_config_json(kind: str, path) -> dict:
    """The config.json transformers saves for `kind` at toy width (no model built)."""
    config = hf_class(kind, "Config")(**{**SHAPE, **FAMILIES[kind][2]})
    config.architectures = [FAMILIES[kind][0] + "ForCausalLM"]
    config.save_pretrained(path)
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("kind", FAMILIES)
def test_config_round_trip(tmp_path, kind):
    """config.json -> ModelConfig -> config.json gives every key back; written without the original,
    it reads back as the same model (the family chosen by what the model computes), and transformers
    reads it as the same architecture."""
    original = hf_config_json(kind, tmp_path)
    config = hf_class(kind, "Config").from_pretrained(tmp_path)
    m = model_config_from_hf(original)
    assert {k: attrgetter(k)(m) for k in EXPECTED[kind]} == EXPECTED[kind]
    assert hf_config(m, torch.float32, original) == {**original, "dtype": "float32"}
    fresh = hf_config(m, torch.float32)
    assert fresh["architectures"] == original["architectures"]
    assert model_config_from_hf(fresh) == m
    (tmp_path / "config.json").write_text(json.dumps(fresh))
    from transformers import AutoConfig

    again = AutoConfig.from_pretrained(tmp_path)
    assert type(again) is type(config) and again.architectures == config.architectures
    for key in ("num_key_value_heads", "head_dim", "sliding_window", "layer_types", "query_pre_attn_scalar",
                "tie_word_embeddings", "rope_parameters"):
        assert getattr(again, key, None) == getattr(config, key, None), key


def _logits(rank, world, cfg, sources, x):
    """Load each weights directory in turn into this rank's part of the layout and run x (cp: this
    rank's tokens at their true positions); the last rank returns the whole logits of each."""
    par = parallelized(cfg, world)
    mesh = par.mesh
    stride = world // mesh.size("pp")  # pp is the outermost mesh axis: stages are this many ranks apart
    cp, layout = mesh.size("cp"), METHODS[cfg.parallel.cp_method]
    where = positions(x.shape[1], cp, mesh.rank("cp"), layout)  # (T/cp,)
    out = []
    for weights in sources:
        load_weights(weights, par)
        with torch.no_grad():
            h = x[:, where]
            if mesh.rank("pp") > 0:
                h = torch.empty(*h.shape, cfg.model.dim)
                dist.recv(h, src=rank - stride)
            h = par.model(h, positions=where)  # (B, T/cp, dim) on the first stage, (B, T/cp, V/tp) on the last
            if mesh.rank("pp") < mesh.size("pp") - 1:
                dist.send(h, dst=rank + stride)
                continue
            parts = [torch.empty_like(h) for _ in range(mesh.size("tp"))]
            dist.all_gather(parts, h.contiguous(), group=mesh.group("tp").pg)
            h = torch.cat(parts, dim=-1)  # (B, T/cp, V)
            chunks = [torch.empty_like(h) for _ in range(cp)]
            dist.all_gather(chunks, h, group=mesh.group("cp").pg)
            whole = torch.empty(x.shape[0], x.shape[1], h.shape[-1])
            for r, chunk in enumerate(chunks):
                whole[:, positions(x.shape[1], cp, r, layout)] = chunk
            out.append(whole)  # (B, T, V)
    return out


LAYOUTS = {"single": (1, {}), "tp2-sp": (2, {"tp": 2, "sp": True}), "pp2": (2, {"pp": 2}),
           "cp2": (2, {"cp": 2}), "cp2-ulysses": (2, {"cp": 2, "cp_method": "ulysses"})}
# Every family in one process; each layout on the families whose features it splits.
CASES = [("single", kind) for kind in FAMILIES] + [
    ("tp2-sp", "qwen2"), ("tp2-sp", "olmo2"), ("tp2-sp", "gemma3"), ("pp2", "qwen3"), ("pp2", "gemma3"),
    ("tp2-sp", "mistral"), ("cp2", "mistral"), ("cp2", "gemma3"), ("cp2-ulysses", "olmo2"), ("tp2-sp", "llama3.2")]


@pytest.mark.parametrize("layout,kind", CASES)
def test_same_logits_as_transformers(tmp_path, models, layout, kind):
    m = models(kind)
    world, parallel = LAYOUTS[layout]
    cfg = replace(tiny_config(tmp_path), model=dataclasses.asdict(HFSource(m["hf"]).model_cfg), parallel=parallel,
                  train={"global_batch": 2, "micro_batch": 1, "seq_len": 16})
    assert validate(cfg, world) == []
    # The seed directory, and the HF directory read directly: both ways in must agree.
    both = run_workers(_logits, world, cfg, [m["seed"], m["hf"]], m["x"])[-1]
    assert len(both) == 2
    for logits in both:
        # One process, pp and Ulysses: the same kernels on the same rows as transformers, measured bit-equal
        # for every family. tp adds each row-parallel product from two halves (an all-reduce) and ring
        # attention merges blocks by log-sum-exp: measured up to 6.0e-6 (tp2-sp) and 7.6e-6 (cp2) on logits
        # up to 11, bound 2e-5. A wrong mapping (a swapped norm, a lost bias, the wrong softmax scale or
        # window, the local RoPE base on the global layers) moves them by O(0.1-1).
        exact = layout in ("single", "pp2", "cp2-ulysses")
        torch.testing.assert_close(logits, m["logits"], rtol=0, atol=0 if exact else 2e-5)


@pytest.mark.parametrize("kind", FAMILIES)
def test_hf_to_fivefold_to_hf_is_exact(tmp_path, models, kind):
    """Every tensor and every config key back as they were, and transformers loads the result."""
    m = models(kind)
    fivefold_to_hf(m["seed"], tmp_path / "back", max_shard_bytes=30_000)
    assert_same_hf_directory(m["hf"], tmp_path / "back")
    hf = hf_class(kind, "ForCausalLM").from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(m["x"]).logits, m["logits"], rtol=0, atol=0)


def test_missing_and_extra_tensors_are_listed_before_anything_is_written(tmp_path, models):
    from safetensors.torch import save_file

    def broken(drop: str, extra: dict) -> None:
        """The qwen3 model in one file, without the tensors whose names end with `drop`, with `extra`."""
        shutil.rmtree(tmp_path / "hf", ignore_errors=True)
        (tmp_path / "hf").mkdir()
        shutil.copyfile(models("qwen3")["hf"] / "config.json", tmp_path / "hf" / "config.json")
        whole = SafetensorsDir(models("qwen3")["hf"])
        kept = {n: whole.read(n).contiguous() for n in whole.names() if not n.endswith(drop)}
        save_file({**kept, **extra}, tmp_path / "hf" / "model.safetensors")

    broken("-", {f"model.layers.{i}.self_attn.rotary.weight": torch.zeros(2) for i in range(12)})
    with pytest.raises(HFFormatError) as error:
        hf_to_fivefold(tmp_path / "hf", tmp_path / "seed", max_shard_bytes=10**9)
    assert "\n" not in str(error.value) and str(error.value).count("rotary.weight") == 10
    assert "and 2 more" in str(error.value)
    assert not (tmp_path / "seed").exists()
    broken("q_norm.weight", {})  # norms fivefold must not do without
    with pytest.raises(ValueError, match=r"(?s)layers\.0\.attn\.q_norm\.weight: not in the weights.*"
                                         r"layers\.1\.attn\.q_norm\.weight: not in the weights"):
        hf_to_fivefold(tmp_path / "hf", tmp_path / "seed", max_shard_bytes=10**9)
    assert not (tmp_path / "seed").exists()


def test_what_a_family_does_not_compute_is_refused(tmp_path):
    gemma = hf_config_json("gemma3", tmp_path)
    with pytest.raises(HFFormatError, match="(?s)final_logit_softcapping = 30.0.*use_bidirectional_attention = True"):
        model_config_from_hf({**gemma, "final_logit_softcapping": 30.0, "use_bidirectional_attention": True})
    llama = hf_config_json("llama3.2", tmp_path)
    with pytest.raises(HFFormatError, match="rope type 'longrope': fivefold reads default, linear, llama3, yarn"):
        model_config_from_hf({**llama, "rope_parameters": {**llama["rope_parameters"], "rope_type": "longrope"}})
    qwen = hf_config_json("qwen2", tmp_path)
    with pytest.raises(HFFormatError, match="use_sliding_window = True"):
        model_config_from_hf({**qwen, "use_sliding_window": True})
    m = model_config_from_hf(qwen)
    # A model with a window written as Qwen2 (the HF config it came from): refused by name, one line.
    from fivefold.checkpoint.hf import export_problems

    windowed = dataclasses.replace(m, attention=dataclasses.replace(m.attention, window=8))
    assert export_problems(windowed, qwen) == ["model.attention.window = 8: HF's Qwen2 computes attention.window = 0"]



def test_gemma3_1b_preset_is_what_transformers_builds_from_its_config():
    """The preset's 26 layers slide as transformers' default pattern (every sixth full) lays them out,
    and its export reads back as the preset."""
    from transformers import Gemma3TextConfig

    from fivefold.model.presets import PRESETS

    m = PRESETS["gemma3-1b"]
    written = hf_config(m, torch.bfloat16)
    reference = Gemma3TextConfig(num_hidden_layers=26, sliding_window=512)  # sliding_window_pattern 6
    assert written["layer_types"] == reference.layer_types
    assert written["query_pre_attn_scalar"] == 256 and written["architectures"] == ["Gemma3ForCausalLM"]
    assert model_config_from_hf(written) == m


def test_a_converted_window_longer_than_the_default_sequence_trains(tmp_path, models):
    """`fivefold train SEED/fivefold.toml` must accept what convert wrote: a window of 100 tokens (Gemma 3
    1B has 512, Mistral v0.1 4096) gets a train.seq_len it cuts, not the default 64 it would not."""
    from fivefold.config.load import load_config

    shutil.copytree(models("mistral")["hf"], tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "sliding_window": 100}))
    hf_to_fivefold(tmp_path / "hf", tmp_path / "seed", max_shard_bytes=10**9)
    cfg = load_config(tmp_path / "seed" / "fivefold.toml")
    assert cfg.model.attention.window == 100 and cfg.train.seq_len == 128
    assert validate(cfg, 1) == []
