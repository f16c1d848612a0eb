"""What a query may see (model/masks.py), done by kernels without a (T, T) mask.

The blockwise path (model/blockwise.py) against the rule written out densely (masks.dense_attention)
in fp64, where the only difference is summation order (~1e-15): forward, and the gradients of q, k, v
and the sinks. Its tile plan by hand. FlexAttention's forward (the CUDA path; CPU has no backward)
against it. The largest tensor attention allocates at T = 8k. Which kernel each case takes.
"""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model.attention import attend, backend_for
from fivefold.model.blockwise import CAUSAL, FULL, MASKED, SKIP, Layout, blockwise_attention, plan_tiles
from fivefold.model.flex import flex_attention_core
from fivefold.model.masks import AttentionMask, dense_attention, document_ids

B, H, K, D = 2, 4, 2, 8


def _inputs(T, dtype=torch.float64, seed=0):
    """q, k, v, an upstream gradient, sinks and document ids: an eod (id 0) in about one token of 6."""
    g = torch.Generator().manual_seed(seed)
    q, dout = torch.randn(B, T, H, D, generator=g, dtype=dtype), torch.randn(B, T, H, D, generator=g, dtype=dtype)
    k, v = torch.randn(B, T, K, D, generator=g, dtype=dtype), torch.randn(B, T, K, D, generator=g, dtype=dtype)
    sinks = torch.randn(H, generator=g, dtype=dtype)
    return q, k, v, dout, sinks, document_ids(torch.randint(0, 6, (B, T), generator=g), 0)


def _mask(name, doc, sinks):
    return {"documents": AttentionMask(doc), "window": AttentionMask(window=5),
            "sinks": AttentionMask(sinks=sinks), "documents+window+sinks": AttentionMask(doc, 5, sinks)}[name]


def _run(fn, q, k, v, dout, mask):
    """Output and the gradients of q, k, v (and the sinks when the mask has them)."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    sinks = None if mask.sinks is None else mask.sinks.clone().requires_grad_()
    out = fn(*leaves, AttentionMask(mask.doc, mask.window, sinks))
    out.backward(dout)
    return [out.detach()] + [x.grad for x in leaves] + ([sinks.grad] if sinks is not None else [])


@pytest.mark.parametrize("name", ["documents", "window", "sinks", "documents+window+sinks"])
@pytest.mark.parametrize("T,tile", [(24, 512), (64, 8)], ids=["one-tile", "tiles-of-8"])
def test_blockwise_is_the_rule(name, T, tile):
    q, k, v, dout, sinks, doc = _inputs(T)
    mask = _mask(name, doc, sinks)
    ours = _run(lambda *a: blockwise_attention(*a, tile=tile), q, k, v, dout, mask)
    ref = _run(dense_attention, q, k, v, dout, mask)
    assert len(ours) == len(ref) == (5 if mask.sinks is not None else 4)
    for what, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], ours, ref, strict=False):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=what)
    # The mask matters: causal attention alone is another result.
    assert (ours[0] - dense_attention(q, k, v)).abs().max() > 0.05


def test_the_plan_by_hand():
    """16 tokens, tiles of 4 (a 4 x 4 grid of (query tile, key tile) pairs)."""
    one = Layout(((0,),), 16)
    causal = plan_tiles(one, 0, 0, None, tile=4)
    assert [(t.q, t.k, t.kind) for t in causal.steps[0]] == [(slice(0, 16), slice(0, 16), CAUSAL)]  # one call

    window = plan_tiles(one, 0, 4, None, tile=4)  # query i sees i-3..i: the diagonal, and part of the tile before
    kinds = {(t.q.start // 4, t.k.start // 4): t.kind for t in window.steps[0]}
    assert kinds == {**{(i, i): CAUSAL for i in range(4)}, **{(i, i - 1): MASKED for i in range(1, 4)}}

    doc = torch.tensor([[0] * 8 + [1] * 8])  # two documents of 8: tiles across them are skipped
    docs = plan_tiles(one, 0, 0, doc, tile=4)
    kinds = {(t.q.start // 4, t.k.start // 4): t.kind for t in docs.steps[0]}
    assert kinds == {(0, 0): CAUSAL, (1, 0): FULL, (1, 1): CAUSAL, (2, 2): CAUSAL, (3, 2): FULL, (3, 3): CAUSAL}
    assert (docs.computed, docs.skipped) == (1, 0)  # one chunk pair, computed tile by tile

    # Ring attention at cp = 2, zig-zag: rank 0 holds chunks 0 and 3 (of 4 tokens), rank 1 chunks 1 and 2.
    zigzag = Layout(((0, 3), (1, 2)), 4)
    plain = plan_tiles(zigzag, 0, 0, None, tile=4)
    assert [[t.kind for t in step] for step in plain.steps] == [[CAUSAL, FULL, CAUSAL], [FULL, FULL]]
    assert (plain.computed, plain.skipped) == (5, 3)  # (0,3), (0,1), (0,2): later chunks
    ring_docs = plan_tiles(zigzag, 0, 0, doc, tile=4)  # chunk 3 (document 1) skips chunks 0 and 1
    assert [[(t.q_pos, t.k_pos) for t in step] for step in ring_docs.steps] == [[(0, 0), (12, 12)], [(12, 8)]]
    assert (ring_docs.computed, ring_docs.skipped) == (3, 5)
    assert SKIP not in {t.kind for step in ring_docs.steps for t in step}


@pytest.mark.parametrize("name", ["documents", "window", "documents+window+sinks"])
def test_flex_forward_on_cpu_is_the_blockwise_path(name):
    """FlexAttention (eager: the CPU has no compiled kernel for it) with the rule as its mask_mod and
    sinks through its log-sum-exp. fp32: the kernels sum in other orders (~5e-7 measured)."""
    q, k, v, _, sinks, doc = _inputs(40, torch.float32)
    mask = _mask(name, doc, sinks)
    with warnings.catch_warnings():  # eager FlexAttention warns (once) that it materialises the scores
        warnings.simplefilter("ignore", UserWarning)
        flex = flex_attention_core(q, k, v, mask, compiled=False)
    torch.testing.assert_close(flex, blockwise_attention(q, k, v, mask, tile=8), rtol=0, atol=5e-6)


class _Largest(TorchDispatchMode):
    """The largest tensor any operation returns while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("name", ["causal", "documents", "documents+window+sinks"])
def test_no_tensor_of_t_by_t_at_8k(name):
    """T = 8192, documents of mean length T/8: forward and backward allocate nothing near T x T (67M
    entries, 268 MB in fp32); the largest tensors are q/k/v-sized (T H D) or one 512 x 512 bias tile."""
    T, g = 8192, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, h, 16, generator=g, requires_grad=True) for h in (2, 1, 1))
    tokens = torch.ones(1, T, dtype=torch.long)
    tokens[0, torch.randint(0, T, (7,), generator=g)] = 0  # 8 documents
    doc, sinks = document_ids(tokens, 0), torch.zeros(2, requires_grad=True)
    mask = {"causal": None, "documents": AttentionMask(doc),
            "documents+window+sinks": AttentionMask(doc, 1000, sinks)}[name]
    with _Largest() as largest:
        attend(q, k, v, mask).sum().backward()
    assert largest.numel <= T * 2 * 16  # q's size (262k): bias tiles (262k) and the tile grid fit too
    assert largest.numel * 64 < T * T


def test_the_kernel_each_case_takes():
    assert backend_for(False, "cpu") == backend_for(False, "cuda") == "sdpa"  # is_causal: flash
    assert backend_for(True, "cpu") == "blockwise" and backend_for(True, "cuda") == "flex"
    assert backend_for(False, "cpu", "blockwise") == "blockwise"  # named in model.attention.backend
    assert AttentionMask().plain and not AttentionMask(window=4).plain
    doc, q = torch.zeros(1, 8, dtype=torch.long), torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="attention.backend = 'sdpa' does causal attention only"):
        attend(q, q, q, AttentionMask(doc), backend="sdpa")
