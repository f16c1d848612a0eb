"""RoPE and softmax-scale values validate() refuses (fivefold/validate/rope.py): one line each, naming the field."""

import pytest
from helpers import tiny_config

from fivefold.validate import validate

YARN = ("--model.rope.scaling=yarn", "--model.rope.factor=4", "--model.rope.original_context=16")
LLAMA3 = ("--model.rope.scaling=llama3", "--model.rope.factor=8", "--model.rope.original_context=16")
ROPE_ERRORS = {
    "factor below 1": (("--model.rope.scaling=linear", "--model.rope.factor=0.5"),
                       "model.rope.factor = 0.5: linear scaling stretches the context"),
    "factor without a scaling": (("--model.rope.factor=8",), "model.rope.factor = 8 does nothing without"),
    "llama3 without its context": (("--model.rope.scaling=llama3", "--model.rope.factor=8"),
                                   "model.rope.original_context = 0: llama3 scaling needs the pre-training context"),
    "yarn without its context": (("--model.rope.scaling=yarn", "--model.rope.factor=4"),
                                 "model.rope.original_context = 0: yarn scaling needs"),
    "low frequency factor not below high": ((*LLAMA3, "--model.rope.low_freq_factor=4"),
                                            "model.rope.low_freq_factor = 4 and model.rope.high_freq_factor = 4.0"),
    "beta slow above beta fast": ((*YARN, "--model.rope.beta_slow=40"), "model.rope.beta_fast = 32.0 and"),
    "negative mscale": ((*YARN, "--model.rope.mscale=-1"), "model.rope.mscale = -1: must be 0"),
    "yarn with a base of 1": ((*YARN, "--model.rope.theta=1"), "model.rope.theta = 1: yarn needs a RoPE base"),
    "negative base": (("--model.rope.theta=-5",), "model.rope.theta = -5: the RoPE base must be positive"),
    "negative local base": (("--model.attention.window=4", "--model.rope.local_theta=-1"),
                            "model.rope.local_theta = -1: the sliding layers' RoPE base"),
    "local base without sliding layers": (("--model.rope.local_theta=10000",),
                                          "model.rope.local_theta = 10000 applies to sliding-window layers"),
    "negative softmax scale": (("--model.attention.scale=-0.1",), "model.attention.scale = -0.1: the softmax scale"),
}


@pytest.mark.parametrize("name", ROPE_ERRORS)
def test_rope_options_are_refused_by_name(tmp_path, name):
    args, message = ROPE_ERRORS[name]
    errors = validate(tiny_config(tmp_path, *args), 1)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_the_published_settings_pass(tmp_path):
    gpt_oss = (*YARN, "--model.rope.truncate=false", "--model.attention.scale=0.125", "--model.attention.window=8",
               "--model.attention.window_pattern=['sliding', 'full']", "--model.rope.local_theta=10000")
    for args in (YARN, LLAMA3, ("--model.rope.scaling=linear", "--model.rope.factor=8"), gpt_oss):
        assert validate(tiny_config(tmp_path, *args), 1) == [], args
