"""RoPE scaling, the per-layer RoPE base and the softmax scale under context parallel.

The tiny model with YaRN (factor 4 over an original context of 16: the attention factor 0.1 ln 4 + 1
on cos and sin, most pairs interpolated), a softmax scale of 0.2 (not 1/sqrt(16) = 0.25), a window
of 6 tokens on every other layer and those sliding layers rotating with their own base of 100,
unscaled (as Gemma 3's local layers): ring attention and Ulysses must hand the scale to their
kernels, and every rank's blocks must get their layer's rotation at the rank's true positions. (Under
tp nothing of this is split: the conversion tests run llama3 and yarn models under tp2 with sp.)
"""

import pytest
from helpers import EQUIVALENCE, Layout, assert_layout_reproduces, tiny_config, train_and_gather

from fivefold.parallel.forked_ranks import run_workers

ROPE_ON = ("--model.rope.scaling=yarn", "--model.rope.factor=4", "--model.rope.original_context=16",
           "--model.attention.scale=0.2", "--model.attention.window=6",
           "--model.attention.window_pattern=['sliding', 'full']", "--model.rope.local_theta=100")

# Bounds as test_masks_layouts.py's, for its reason (cp: blocks merged by log-sum-exp).
LAYOUTS = {
    "cp2-ring": Layout(2, ("--parallel.cp=2",), "rope_reference", param_atol=5e-4),
    "cp2-ulysses": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses"), "rope_reference", param_atol=5e-4),
}


@pytest.fixture(scope="module")
def rope_reference(tmp_path_factory):
    """One process with ROPE_ON, each global batch in one micro-batch."""
    cfg = tiny_config(tmp_path_factory.mktemp("rope"), *EQUIVALENCE, *ROPE_ON, "--train.micro_batch=8")
    return run_workers(train_and_gather, 1, cfg)[0]


@pytest.mark.parametrize("name", LAYOUTS)
def test_rope_options_under_cp_reproduce_single_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    cfg = tiny_config(tmp_path, *EQUIVALENCE, *ROPE_ON, *layout.overrides)
    assert_layout_reproduces(request, cfg, layout)
