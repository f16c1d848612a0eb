"""Split backward (zero-bubble I and W) on real transformer blocks, in one process.

I must give exactly the input gradient and touch no weight; I then W must give exactly the weight
gradients of one full backward; and W must not redo I's work (counted in matmuls).
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model.config import ModelConfig, MoEConfig, NormConfig
from fivefold.model.rope import rope_cos_sin
from fivefold.model.transformer import Transformer
from fivefold.parallel.pipeline.split_backward import SplitBackward


class _CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _stage(first: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, norm=NormConfig(qk=True))
    model = Transformer(cfg)
    model.init_weights()
    model.norm = model.output = None  # a first or middle stage: blocks only (and the embedding if first)
    if not first:
        model.tok_embeddings = None
    x = torch.randint(0, 64, (2, 8)) if first else torch.randn(2, 8, 32, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(8), model.head_dim, cfg.rope)

    def forward():
        inp = model.tok_embeddings(x) if first else x  # (2, 8, 32)
        h = inp
        for block in model.layers.values():
            h = block(h, cos, sin)
        return inp, h

    return model, forward


def test_i_then_w_equals_one_backward():
    model, forward = _stage(first=False)
    params = list(model.parameters())
    inp, out = forward()
    grad = torch.randn_like(out)
    ref = torch.autograd.grad(out, [inp, *params], grad)

    inp, out = forward()
    split = SplitBackward(out, inp, params)
    with _CountMatmuls() as i_count:
        inp_grad = split.input_grad(grad)
    assert all(p.grad is None for p in params)  # I computes no weight gradient
    torch.testing.assert_close(inp_grad, ref[0], rtol=0, atol=0)
    with _CountMatmuls() as w_count:
        split.weight_grad()
    for p, r in zip(params, ref[1:], strict=True):  # the same kernels on the same operands: bit-identical
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)
    # Each linear layer's backward is two matmuls (dx and dW): I does one, W the other. Attention's
    # own matmuls (scores and values) have no weights, so they all belong to I.
    linears = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert w_count.n == linears
    assert i_count.n >= linears


def test_first_stage_runs_its_whole_backward_in_w():
    """No stage waits for the first stage's input gradient: I computes nothing, W is one backward
    (every matmul of it), bit-identical to a plain backward."""
    model, forward = _stage(first=True)
    params = list(model.parameters())
    inp, out = forward()
    grad = torch.randn_like(out)
    with _CountMatmuls() as full_count:
        ref = torch.autograd.grad(out, params, grad)

    inp, out = forward()
    split = SplitBackward(out, inp, params)
    with _CountMatmuls() as i_count:
        assert split.input_grad(grad) is None
    assert i_count.n == 0 and all(p.grad is None for p in params)
    with _CountMatmuls() as w_count:
        split.weight_grad()
    assert w_count.n == full_count.n
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)


def test_moe_stage_accumulates_each_weight_once():
    """Stacked expert weights are used by one matmul per expert: W must still accumulate each
    parameter once (data parallel's buckets count one accumulation per parameter)."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=4, ffn_dim=64, vocab_size=64,
                      moe=MoEConfig(n_experts=4, top_k=2))
    model = Transformer(cfg)
    model.init_weights()
    block, params = model.layers["0"], list(model.layers.parameters())
    cos, sin = rope_cos_sin(torch.arange(8), model.head_dim, cfg.rope)
    x = torch.randn(2, 8, 32, requires_grad=True)
    out = block(x, cos, sin)
    grad = torch.randn_like(out)
    ref = torch.autograd.grad(out, [x, *params], grad)
    block.ffn.step_load.zero_()
    accumulations = {id(p): 0 for p in params}
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: accumulations.__setitem__(id(p), accumulations[id(p)] + 1))
    out = block(x, cos, sin)
    split = SplitBackward(out, x, params)
    torch.testing.assert_close(split.input_grad(grad), ref[0], rtol=0, atol=0)
    split.weight_grad()
    assert set(accumulations.values()) == {1}
    for p, r in zip(params, ref[1:], strict=True):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=1e-7)


def test_a_weight_used_twice_is_refused():
    lin = torch.nn.Linear(4, 4, bias=False)
    x = torch.randn(3, 4, requires_grad=True)
    out = lin(lin(x))
    with pytest.raises(RuntimeError, match="applied twice in a chain"):
        SplitBackward(out, x, [lin.weight]).input_grad(torch.ones_like(out))
