"""gpt-oss's MoE features (router and expert biases, the clamped SwiGLU) under expert, tensor (with
sp) and pipeline parallel, against one process; an ep2 checkpoint of them resumed at ep1."""

import shutil

import pytest
import torch
from helpers import (
    BF16,
    EQUIVALENCE,
    MOE_ARGS,
    Layout,
    assert_layout_reproduces,
    one_process,
    one_process_bf16,
    parallelized,
    tiny_config,
)

from fivefold.parallel.forked_ranks import run_workers

# The biases start at zero (seeded init) and move from the first step on. A limit of 0.2 (gpt-oss:
# 7) clamps part of the tiny model's gate and up values (about 0.1-0.3 at init), so the clamp's
# zero gradients are exercised too. Not 0.1: there one value sat at the clamp's edge, where the
# one-process run's rounding (one micro-batch of 8) flipped it against every layout's, moving one
# expert's hidden unit by 4.6e-3 (measured with the chunked loss; 0.12 and 0.15 left 1.4e-4 and
# 9.8e-5, 0.2 leaves 6.4e-6). Two steps: the second runs with moved biases.
BIAS_ARGS = (*EQUIVALENCE, *MOE_ARGS, "--model.moe.linear_bias=true", "--model.moe.swiglu_limit=0.2", "--train.steps=2")
# as test_expert_parallel.py's MOE_ROW, and why
ROW = dict(reference="bias_reference", param_atol=2e-4, exact=("expert_bias",))
LAYOUTS = {
    "ep2": Layout(2, ("--parallel.ep=2",), **ROW),
    # each tp rank routes its own half of every sequence: the router's bias gradient is summed over tp
    "tp2-sp-ep2": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.ep=2"), **ROW),
    # FSDP shards the (E/ep, hidden) biases over expert_dp along their second dim, as the weights
    "dp4-ep2-zero3": Layout(4, ("--parallel.ep=2", "--parallel.zero=3", "--train.micro_batch=1"), **ROW),
    # bf16 autocast (helpers.BF16): the biases added to bf16 products, the clamp on bf16 values
    "ep2-bf16": Layout(2, ("--parallel.ep=2", *BF16), **ROW),
}


@pytest.fixture(scope="module")
def bias_reference(tmp_path_factory):
    return one_process(tmp_path_factory.mktemp("moe-bias"), *BIAS_ARGS)


@pytest.fixture(scope="module")
def bf16_bias_reference(tmp_path_factory):
    return one_process_bf16(tmp_path_factory, "moe-bias", *BIAS_ARGS)


def test_reference_trains_the_biases(bias_reference):
    """The biases are there and moved: a layout that lost or froze them could not match."""
    _, _, state = bias_reference
    biases = {k: v for k, v in state.items() if k.endswith(("router.bias", "_bias")) and "expert_bias" not in k}
    assert len(biases) == 8 * 4  # 8 blocks: router, gate, up, down
    assert all(v.abs().max() > 0 for v in biases.values())


@pytest.mark.parametrize("name", LAYOUTS)
def test_training_reproduces_single_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *BIAS_ARGS, *layout.overrides), layout)


def _train_losses(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def test_ep2_checkpoint_resumes_at_ep1(tmp_path):
    """The expert biases are saved as shards of one (E, ...) tensor, like the expert weights: the step-1
    checkpoint of an ep2 run resumes at ep1 and trains step 2 as the ep2 run did."""
    from fivefold.checkpoint.run_state import complete_checkpoints

    args = (*BIAS_ARGS, "--checkpoint.every=1", "--checkpoint.keep=2", "--train.micro_batch=1")
    losses = run_workers(_train_losses, 2, tiny_config(tmp_path, *args, "--parallel.ep=2"))[0]
    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])
    resumed = run_workers(_train_losses, 1, tiny_config(tmp_path, *args, "--parallel.ep=1",
                                                        "--checkpoint.resume=true"))[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[1:]), rtol=1e-5, atol=0)


def _undecayed_matrices(rank, world, cfg):
    """The 2-D tensors the optimizer steps without weight decay (ZeRO: their fp32 masters)."""
    _, no_decay = parallelized(cfg, world).optimizer.param_groups
    return sum(1 for t in no_decay["params"] if t.ndim >= 2)


@pytest.mark.parametrize("zero", [0, 3])
def test_expert_biases_get_no_weight_decay_in_any_layout(tmp_path, zero):
    """optim.weight_decay is never applied to biases: the experts' stacked (E/ep, w) biases keep their
    no_decay mark through the meta device, the ep slicing and ZeRO's masters (8 blocks x 3 biases)."""
    cfg = tiny_config(tmp_path, *BIAS_ARGS, "--parallel.ep=2", f"--parallel.zero={zero}")
    assert run_workers(_undecayed_matrices, 2, cfg) == [8 * 3] * 2
