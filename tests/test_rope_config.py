"""RoPE and softmax-scale values validate() refuses (fivefold/validate/rope.py): one line each, naming the field."""

import pytest
from helpers import tiny_config

from fivefold.validate import validate

YARN = ("--model.rope_scaling=yarn", "--model.rope_factor=4", "--model.rope_original_context=16")
LLAMA3 = ("--model.rope_scaling=llama3", "--model.rope_factor=8", "--model.rope_original_context=16")
ROPE_ERRORS = {
    "factor below 1": (("--model.rope_scaling=linear", "--model.rope_factor=0.5"),
                       "model.rope_factor = 0.5: linear scaling stretches the context"),
    "factor without a scaling": (("--model.rope_factor=8",), "model.rope_factor = 8 does nothing without"),
    "llama3 without its context": (("--model.rope_scaling=llama3", "--model.rope_factor=8"),
                                   "model.rope_original_context = 0: llama3 scaling needs the pre-training context"),
    "yarn without its context": (("--model.rope_scaling=yarn", "--model.rope_factor=4"),
                                 "model.rope_original_context = 0: yarn scaling needs"),
    "low frequency factor not below high": ((*LLAMA3, "--model.rope_low_freq_factor=4"),
                                            "model.rope_low_freq_factor = 4 and model.rope_high_freq_factor = 4.0"),
    "beta slow above beta fast": ((*YARN, "--model.rope_beta_slow=40"), "model.rope_beta_fast = 32.0 and"),
    "negative mscale": ((*YARN, "--model.rope_mscale=-1"), "model.rope_mscale = -1: must be 0"),
    "yarn with a base of 1": ((*YARN, "--model.rope_theta=1"), "model.rope_theta = 1: yarn needs a RoPE base"),
    "negative base": (("--model.rope_theta=-5",), "model.rope_theta = -5: the RoPE base must be positive"),
    "negative local base": (("--model.sliding_window=4", "--model.local_rope_theta=-1"),
                            "model.local_rope_theta = -1: the sliding layers' RoPE base"),
    "local base without sliding layers": (("--model.local_rope_theta=10000",),
                                          "model.local_rope_theta = 10000 applies to sliding-window layers"),
    "negative softmax scale": (("--model.attention_scale=-0.1",), "model.attention_scale = -0.1: the softmax scale"),
}


@pytest.mark.parametrize("name", ROPE_ERRORS)
def test_rope_options_are_refused_by_name(tmp_path, name):
    args, message = ROPE_ERRORS[name]
    errors = validate(tiny_config(tmp_path, *args), 1)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_the_published_settings_pass(tmp_path):
    gpt_oss = (*YARN, "--model.rope_truncate=false", "--model.attention_scale=0.125", "--model.sliding_window=8",
               "--model.window_pattern=['sliding', 'full']", "--model.local_rope_theta=10000")
    for args in (YARN, LLAMA3, ("--model.rope_scaling=linear", "--model.rope_factor=8"), gpt_oss):
        assert validate(tiny_config(tmp_path, *args), 1) == [], args
