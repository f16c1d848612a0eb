"""RoPE keys of a Hugging Face config.json, both styles, both ways (checkpoint/hf/rope.py).

Each published configuration's RoPE keys (as released: the older rope_theta / rope_scaling, and as
transformers 5.23 saves them: rope_parameters, per layer type for Gemma 3) become RopeConfig
fields whose inverse frequencies equal transformers' for that file, and are written back as they
were read.
"""

import copy

import pytest
import torch

from fivefold.checkpoint.hf.rope import rope_fields_from_hf, rope_to_hf
from fivefold.model.config import ModelConfig, RopeConfig
from fivefold.model.rope import inverse_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

# The RoPE keys of the published config.json files (the rest of each file does not matter here).
RELEASED = {
    "llama3.1-8b": ("LlamaConfig", 128, {
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}}),
    "deepseek-v3": ("DeepseekV3Config", 64, {
        "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"}}),
    "gpt-oss-20b": ("GptOssConfig", 64, {
        "max_position_embeddings": 131072, "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False}}),
    "gemma3-4b": ("Gemma3TextConfig", 256, {
        "max_position_embeddings": 131072, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}}),
    "qwen3-0.6b": ("Qwen3Config", 128, {"max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None}),
}
WANT = {
    "llama3.1-8b": dict(theta=500000.0, scaling="llama3", factor=8.0, original_context=8192, low_freq_factor=1.0,
                        high_freq_factor=4.0),
    "deepseek-v3": dict(theta=10000.0, scaling="yarn", factor=40.0, original_context=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, attention_factor=0.0, truncate=True),
    "gpt-oss-20b": dict(theta=150000.0, scaling="yarn", factor=32.0, original_context=4096, beta_fast=32.0,
                        beta_slow=1.0, mscale=0.0, mscale_all_dim=0.0, attention_factor=0.0, truncate=False),
    "gemma3-4b": dict(theta=1000000.0, scaling="linear", factor=8.0, local_theta=10000.0),
    "qwen3-0.6b": dict(theta=1000000.0),
}


def _styles(name):
    """(as released, as transformers 5.23 saves it) for one model."""
    cls, _, keys = RELEASED[name]
    hf = getattr(transformers, cls)(**copy.deepcopy(keys))  # (transformers edits the dicts it is given)
    saved = {k: v for k, v in hf.to_dict().items() if "rope" in k or k == "max_position_embeddings"}
    return keys, saved, hf


@pytest.mark.parametrize("style", ["released", "transformers5"])
@pytest.mark.parametrize("name", RELEASED)
def test_released_and_saved_configs_read_as_transformers_reads_them(name, style):
    released, saved, hf = _styles(name)
    keys = released if style == "released" else saved
    problems = []
    fields = rope_fields_from_hf(keys, problems)
    assert problems == [] and fields == WANT[name]
    # The fields give transformers' own inverse frequencies and attention factor for this file.
    m, dim = ModelConfig(rope=RopeConfig(**fields)), RELEASED[name][1]
    nested = isinstance(hf.rope_parameters.get("full_attention"), dict)
    params = hf.rope_parameters["full_attention"] if nested else hf.rope_parameters
    if params["rope_type"] != "default":
        kwargs = {"layer_type": "full_attention"} if nested else {}
        theirs, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu", **kwargs)
        ours, our_factor = inverse_frequencies(m.rope, dim)
        assert torch.equal(ours, theirs) and our_factor == factor
    # Written back in the style read, as it was.
    assert {**keys, **rope_to_hf(m.rope, keys)} == keys


def test_gemma3_local_base_written_for_transformers_to_read():
    rope = RopeConfig(**WANT["gemma3-4b"])
    _, saved, _ = _styles("gemma3-4b")
    again = transformers.Gemma3TextConfig(**rope_to_hf(rope, saved))
    assert again.rope_parameters == saved["rope_parameters"]
    assert rope_to_hf(rope, {})["rope_parameters"]["rope_type"] == "linear"  # no base: transformers 5's style


@pytest.mark.parametrize("keys, message", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling: rope type 'dynamic': fivefold reads default, linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
     "rope_parameters: rope type 'longrope': fivefold reads default, linear, llama3, yarn"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "yarn"}}},
     "rope_parameters.sliding_attention: rope type 'yarn': fivefold rotates sliding-window layers with a plain base"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}},
     "rope_scaling: rope type 'llama3' without its 'low_freq_factor'"),
    ({"partial_rotary_factor": 0.5, "rope_theta": 1e4}, "rope_scaling: partial_rotary_factor 0.5"),
])
def test_what_fivefold_does_not_read_is_named(keys, message):
    problems = []
    rope_fields_from_hf(keys, problems)
    assert problems and problems[0].startswith(message), problems
