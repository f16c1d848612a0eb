"""gpt-oss's MoE in one process: the router's and experts' biases (moe.linear_bias) and the clamped
SwiGLU (moe.swiglu_limit), against a hand reference and against transformers' GptOssMLP."""

import dataclasses

import pytest
import torch

from fivefold.model import moe as moe_module
from fivefold.model.config import ModelConfig
from fivefold.model.counts import count_on_meta, model_counts
from fivefold.model.ffn import gated
from fivefold.model.moe import MoE
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer

DIM, HIDDEN, EXPERTS, TOP_K, LIMIT = 64, 32, 8, 2, 7.0


def moe_config(activation: str = "silu", n_layers: int = 8, **moe_keys) -> ModelConfig:
    """tiny-moe with gpt-oss's experts (biases, the clamped SwiGLU); `moe_keys` change [model.moe]'s."""
    base = PRESETS["tiny-moe"]
    moe = dataclasses.replace(base.moe, n_experts=EXPERTS, top_k=TOP_K, ffn_dim=HIDDEN, linear_bias=True,
                              swiglu_limit=LIMIT)
    return dataclasses.replace(base, vocab_size=320, dim=DIM, activation=activation, n_layers=n_layers,
                               moe=dataclasses.replace(moe, **moe_keys))


def moe_layer(cfg: ModelConfig) -> MoE:
    """The MoE block `cfg`'s transformer builds."""
    return MoE(cfg.moe, cfg.dim, cfg.ffn_dim, cfg.activation)


def random_moe(cfg, std=0.5, seed=0) -> MoE:
    torch.manual_seed(seed)
    moe = moe_layer(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=std)
    return moe


def test_biases_exist_with_linear_bias_only():
    names = {n: tuple(p.shape) for n, p in moe_layer(moe_config()).named_parameters()}
    assert names["router.bias"] == (EXPERTS,)
    assert names["experts.gate_bias"] == names["experts.up_bias"] == (EXPERTS, HIDDEN)
    assert names["experts.down_bias"] == (EXPERTS, DIM)
    plain = {n for n, _ in moe_layer(moe_config(linear_bias=False)).named_parameters()}
    assert not any("bias" in n for n in plain)


@pytest.mark.parametrize("activation,limit", [("silu", LIMIT), ("gelu_tanh", 0.0), ("silu", 0.0)])
def test_moe_with_biases_equals_a_per_token_loop(activation, limit):
    """Each token: sum over its top-k experts of w x (gated(x G_e + g_e, x U_e + u_e) D_e + d_e)."""
    moe = random_moe(moe_config(activation=activation, swiglu_limit=limit, n_shared_experts=1))
    x = torch.randn(2, 5, DIM) * 2
    out = moe(x).reshape(-1, DIM)
    flat = x.reshape(-1, DIM)
    logits = flat @ moe.router.weight.T + moe.router.bias
    ex = moe.experts
    ref = []
    for t in range(flat.shape[0]):
        probs = logits[t].softmax(-1)
        idx = probs.topk(TOP_K).indices
        weights = probs[idx] / probs[idx].sum()
        token = flat[t]
        y = sum(w * (gated(token @ ex.gate[e] + ex.gate_bias[e], token @ ex.up[e] + ex.up_bias[e], activation, limit)
                     @ ex.down[e] + ex.down_bias[e]) for w, e in zip(weights, idx.tolist(), strict=True))
        ref.append(y + moe.shared(token))
    ref = torch.stack(ref)
    scale = ref.abs().max()  # values in the hundreds: fp32 rounding relative to the largest
    torch.testing.assert_close(out / scale, ref / scale, atol=1e-6, rtol=0)


def _gpt_oss_pair(seed=0):
    """transformers' GptOssMLP at tiny width with random weights, and our MoE holding the same numbers:
    its fused gate_up_proj (E, dim, 2 hidden) interleaves gate (even columns) and up (odd), bias likewise."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_cfg = GptOssConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=EXPERTS,
                          num_experts_per_tok=TOP_K, swiglu_limit=LIMIT, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=16, vocab_size=320)
    torch.manual_seed(seed)
    hf = GptOssMLP(hf_cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = moe_layer(moe_config(n_shared_experts=0))
    with torch.no_grad():
        ours.router.weight.copy_(hf.router.weight)
        ours.router.bias.copy_(hf.router.bias)
        ours.experts.gate.copy_(hf.experts.gate_up_proj[..., ::2])
        ours.experts.up.copy_(hf.experts.gate_up_proj[..., 1::2])
        ours.experts.gate_bias.copy_(hf.experts.gate_up_proj_bias[..., ::2])
        ours.experts.up_bias.copy_(hf.experts.gate_up_proj_bias[..., 1::2])
        ours.experts.down.copy_(hf.experts.down_proj)
        ours.experts.down_bias.copy_(hf.experts.down_proj_bias)
    return hf, ours


def test_moe_equals_transformers_gpt_oss_mlp():
    """Outputs and every weight's gradient within fp32 rounding; the clamp is exercised (std 0.5
    weights and inputs of std 2 put gate and up values past +-7)."""
    hf, ours = _gpt_oss_pair()
    x = torch.randn(2, 6, DIM) * 2
    flat = x.reshape(-1, DIM)
    gate_up = torch.einsum("nd,edh->enh", flat, hf.experts.gate_up_proj)
    assert (gate_up[..., ::2] > LIMIT).any() and (gate_up[..., 1::2].abs() > LIMIT).any()
    # The router: top-k of the logits then softmax over the k (transformers) is softmax, top-k,
    # renormalise (ours): the same experts, weights within fp32 rounding.
    _, hf_weights, hf_idx = hf.router(flat)
    weights, idx = ours.route(flat)
    assert torch.equal(idx, hf_idx)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)

    expected, _ = hf(x)
    out = ours(x)
    scale = expected.abs().max()  # values in the hundreds: fp32 rounding relative to the largest
    torch.testing.assert_close(out / scale, expected / scale, atol=1e-6, rtol=0)
    expected.square().sum().backward()
    out.square().sum().backward()
    g, o = hf.experts, ours.experts
    pairs = [(ours.router.weight.grad, hf.router.weight.grad), (ours.router.bias.grad, hf.router.bias.grad),
             (o.gate.grad, g.gate_up_proj.grad[..., ::2]), (o.up.grad, g.gate_up_proj.grad[..., 1::2]),
             (o.gate_bias.grad, g.gate_up_proj_bias.grad[..., ::2]),
             (o.up_bias.grad, g.gate_up_proj_bias.grad[..., 1::2]),
             (o.down.grad, g.down_proj.grad), (o.down_bias.grad, g.down_proj_bias.grad)]
    for ours_grad, hf_grad in pairs:
        scale = hf_grad.abs().max()
        torch.testing.assert_close(ours_grad / scale, hf_grad / scale, atol=1e-5, rtol=0)


@pytest.mark.parametrize("capacity", [0.0, 0.5], ids=["all-kept", "capacity-drops"])
def test_grouped_experts_with_biases_equal_the_loop_in_bf16(monkeypatch, capacity):
    """torch._grouped_mm takes no bias: each row's expert bias is looked up from the counts on the
    device. Under bf16 autocast outputs and gradients (biases included) equal the loop's bit for bit."""
    cfg = moe_config(capacity_factor=capacity)
    x = torch.randn(2, 16, DIM) * 2
    results = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(moe_module, "grouped_dtype", lambda *args: None)
        moe = random_moe(cfg, std=0.3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert moe.experts.grouped(x) is grouped
            out = moe(x)
        out.float().square().sum().backward()
        results.append([out, *(p.grad for p in moe.parameters())])
    assert len(results[0]) == 1 + 8  # router weight and bias, gate, up, down and their biases
    for ours, loop in zip(*results, strict=True):
        assert torch.equal(ours, loop)
    assert results[0][0].dtype == torch.bfloat16


def test_grouped_experts_with_biases_read_nothing_to_the_host(monkeypatch):
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    moe = random_moe(moe_config())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(2, 16, DIM))
    assert reads == []


def test_seeded_init_starts_the_moe_biases_at_zero():
    cfg = moe_config(n_layers=2)
    model = Transformer(cfg)
    model.init_weights(0)
    biases = {n: p for n, p in model.named_parameters() if n.endswith(("router.bias", "_bias"))}
    assert len(biases) == 2 * 4
    assert all(torch.equal(p, torch.zeros_like(p)) for p in biases.values())
    assert model.layers["0"].ffn.experts.gate.std() > 0  # the weights are still drawn


@pytest.mark.parametrize("changes", [{}, {"n_shared_experts": 1, "first_dense_layers": 1}])
def test_counts_include_the_moe_biases(changes):
    cfg = moe_config(**changes)
    counts = model_counts(cfg)
    assert counts.total == count_on_meta(cfg)
    plain = model_counts(moe_config(**changes, linear_bias=False))
    moe_layers = cfg.n_layers - cfg.moe.first_dense_layers
    per_expert = 2 * HIDDEN + DIM
    assert counts.expert_total - plain.expert_total == moe_layers * EXPERTS * per_expert
    assert counts.total - plain.total == moe_layers * (EXPERTS * per_expert + EXPERTS)
    # a token goes through top_k experts' biases and the router's; the biases are no matmul
    assert counts.active - plain.active == moe_layers * (TOP_K * per_expert + EXPERTS)
    assert counts.active_matmul == plain.active_matmul



def test_switch_balance_loss_of_one_sequence_and_layer_is_top_k_times_ours():
    """transformers' load_balancing_loss_func (Mixtral, Qwen3-MoE: Switch's E sum_e f_e P_e with f the
    share of the k copies) pools a micro-batch and every layer; fivefold's balance loss is per sequence
    and per layer (layout-independent). For one sequence and one layer of a softmax router the two are
    the same loss up to the factor top_k, in value and gradient: what maps router_aux_loss_coef."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from fivefold.model.moe import sequence_balance_loss

    logits = torch.randn(12, EXPERTS, requires_grad=True)  # (T, E)
    theirs = load_balancing_loss_func((logits,), EXPERTS, TOP_K)
    (grad_theirs,) = torch.autograd.grad(theirs, logits)
    scores = logits.softmax(-1)
    ours = sequence_balance_loss(scores[None], scores.topk(TOP_K, dim=-1).indices[None]).sum()
    (grad_ours,) = torch.autograd.grad(ours, logits)
    torch.testing.assert_close(theirs, TOP_K * ours)
    torch.testing.assert_close(grad_theirs, TOP_K * grad_ours)


def test_weights_made_with_another_swiglu_limit_are_named():
    """The limit changes no shape: init_from must name it, or gpt-oss weights would load into a plain SwiGLU."""
    from fivefold.checkpoint.weights import config_differences

    (problem,) = config_differences(moe_config(), moe_config(swiglu_limit=0.0))
    assert "model.moe.swiglu_limit = 7.0" in problem


@pytest.mark.parametrize("overrides,words", [
    (("--model.preset=tiny-moe", "--model.moe.swiglu_limit=-1"), ("model.moe.swiglu_limit = -1", "must be 0")),
    (("--model.preset=tiny-moe", "--model.moe.swiglu_limit=7", "--model.activation=gelu_tanh"),
     ("model.moe.swiglu_limit = 7", "activation = 'silu'")),
    (("--model.moe.linear_bias=true",), ("model.moe.linear_bias applies to the experts only",)),
    (("--model.moe.swiglu_limit=7",), ("model.moe.swiglu_limit applies to the experts only",)),
])
def test_bad_moe_settings_are_named(overrides, words):
    from helpers import ROOT

    from fivefold.config.load import read_config
    from fivefold.validate import validate

    cfg, errors = read_config(ROOT / "configs" / "tiny.toml", list(overrides))
    hits = [e for e in errors + validate(cfg, 1) if all(w in e for w in words)]
    assert len(hits) == 1, errors + validate(cfg, 1)


def test_no_weight_decay_on_the_moe_biases():
    from fivefold.config.schema import OptimConfig
    from fivefold.parallel.optimizer import build_optimizer

    model = Transformer(moe_config(n_layers=2))
    _, no_decay = build_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    biases = {names[id(p)] for p in no_decay["params"] if names[id(p)].endswith("bias")}
    assert biases == {f"layers.{i}.ffn.{b}" for i in range(2)
                      for b in ("router.bias", "experts.gate_bias", "experts.up_bias", "experts.down_bias")}
