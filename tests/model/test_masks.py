"""What a query may see (model/masks.py), done by kernels without a (T, T) mask.

The blockwise path (model/blockwise.py) against the rule written out densely (masks.dense_attention)
in fp64, where the only difference is summation order (~1e-15): forward, and the gradients of q, k, v
and the sinks. Its tile plan by hand, and the bias tiles it hands the memory-efficient kernel.
FlexAttention's forward (the CUDA path; CPU has no backward) against it, and its block mask: what
torch's dense builder makes, nothing of T x T at 32k, once per micro-batch and window. The largest
tensor attention allocates at T = 8k. Which kernel each case takes.
"""

import dataclasses
import types
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.model import blockwise, flex
from fivefold.model.attention import attend, backend_for
from fivefold.model.blockwise import CAUSAL, FULL, MASKED, SKIP, Layout, blockwise_attention, plan_tiles
from fivefold.model.flex import flex_attention_core
from fivefold.model.masks import AttentionMask, Documents, dense_attention, document_ids
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer

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


class _EfficientBiasCheck(TorchDispatchMode):
    """The bias each tile kernel gets, checked as the memory-efficient kernel checks it: every stride but
    the last a multiple of 16 bytes, the last 1 (xFormers' fmha bias check; the CUDA kernel refuses
    others). Records the biases' widths and row strides."""

    def __init__(self):
        super().__init__()
        self.seen = []  # (width, row stride) of each bias

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bias = {torch.ops.aten._scaled_dot_product_efficient_attention.default: lambda: args[3],
                torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: lambda: args[4],
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default: lambda: kwargs.get("attn_mask"),
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                    lambda: kwargs.get("attn_mask")}.get(func, lambda: None)()
        if bias is not None:
            align = 128 // torch.finfo(bias.dtype).bits
            assert bias.stride(-1) == 1 and all(st % align == 0 for st in bias.stride()[:-1]), bias.stride()
            self.seen.append((bias.shape[-1], bias.stride(-2)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("T", [1000, 2000])
def test_memory_efficient_bias_is_aligned_on_meta(T, monkeypatch):
    """Chunks of 1000 and 2000 are cut into tiles of 500; in bf16 the CUDA kernel needs bias rows 8
    entries apart. On meta (shapes only) through the CUDA kernel pair, forward and backward."""
    monkeypatch.setattr(blockwise, "kernels", lambda device: (blockwise._cuda_forward, blockwise._cuda_backward))
    g = torch.Generator().manual_seed(0)
    tokens = torch.ones(1, T, dtype=torch.long)
    tokens[0, torch.randint(0, T, (3,), generator=g)] = 0
    doc = document_ids(tokens, 0)  # (1, T) on the host: the plan reads it there
    meta = dict(device="meta", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = torch.empty(1, T, 4, 16, **meta), torch.empty(1, T, 2, 16, **meta), torch.empty(1, T, 2, 16, **meta)
    mask = AttentionMask(doc.to("meta"), 300, torch.empty(4, **meta), doc_host=doc)
    with _EfficientBiasCheck() as check:
        blockwise_attention(q, k, v, mask).sum().backward()
    assert check.seen and {w for w, _ in check.seen} == {500}  # masked tiles of 500, forward and backward
    assert {st for _, st in check.seen} == {512}


def test_an_unaligned_tile_keeps_the_rule_on_cpu():
    """The same padded bias on CPU: tiles of 12 (rows 16 apart), values still the rule's in fp64."""
    q, k, v, dout, sinks, doc = _inputs(24)
    mask = AttentionMask(doc, 5, sinks)
    with _EfficientBiasCheck() as check:
        ours = _run(lambda *a: blockwise_attention(*a, tile=12), q, k, v, dout, mask)
    assert check.seen and {st for _, st in check.seen} == {16}
    ref = _run(dense_attention, q, k, v, dout, mask)
    for what, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=what)


def _dense_blocks(num: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A block mask's ordered form (B, H, n), (B, H, n, n) -> which blocks it lists, (B, H, n, n)."""
    listed = torch.arange(indices.shape[-1]) < num[..., None]  # (B, H, n, n): the first num of each row
    return torch.zeros_like(indices).scatter_(-1, indices.long(), listed.int()).bool()


@pytest.mark.parametrize("name", ["documents", "window", "documents+window+sinks"])
def test_flex_blocks_are_what_torch_builds_densely(name):
    """T = 1000 (the last block of 104), two rows of documents ~300 long, a window of 300: the blocks
    kept and the full ones are those create_block_mask finds evaluating the rule on every pair."""
    T = 1000
    doc = document_ids(torch.randint(0, 300, (B, T), generator=torch.Generator().manual_seed(1)), 0)
    mask = _mask(name, doc, torch.zeros(H))
    mask = dataclasses.replace(mask, window=300 if mask.window else 0)
    ours = flex.block_mask(mask, T, torch.device("cpu"))
    ref = create_block_mask(flex._mask_mod(mask.doc, mask.window), B if mask.doc is not None else None, None, T, T,
                            device="cpu")
    full, ref_full = (_dense_blocks(m.full_kv_num_blocks, m.full_kv_indices) for m in (ours, ref))
    kept, ref_kept = (_dense_blocks(m.kv_num_blocks, m.kv_indices) | f for m, f in ((ours, full), (ref, ref_full)))
    assert torch.equal(full, ref_full) and torch.equal(kept, ref_kept)
    assert full.any() and (kept & ~full).any() and (~kept).any()  # all three kinds occur


def _no_kernel(seen):
    """FlexAttention's kernel replaced: the block mask it is handed is kept, zeros come out."""

    def kernel(q, k, v, block_mask, **_):
        seen.append(block_mask)
        return torch.zeros_like(q), types.SimpleNamespace(lse=q.new_zeros(q.shape[:3]))

    return kernel


@pytest.mark.parametrize("name", ["documents", "window", "documents+window+sinks"])
def test_flex_block_mask_has_no_t_by_t_at_32k(name, monkeypatch):
    """T = 32768 on meta: building the block mask allocates (T/128)^2 entries a row at most, not the
    T x T (1.07G entries, about 15 GB as create_block_mask builds it) of evaluating the rule on every pair."""
    T, seen = 32768, []
    monkeypatch.setattr(flex, "flex_attention", _no_kernel(seen))
    q, k, v = (torch.empty(1, T, h, 16, device="meta") for h in (2, 1, 1))
    doc = torch.zeros(1, T, dtype=torch.long, device="meta")
    mask = {"documents": AttentionMask(doc), "window": AttentionMask(window=1000),
            "documents+window+sinks": AttentionMask(doc, 1000, torch.zeros(2, device="meta"))}[name]
    with _Largest() as largest:
        flex_attention_core(q, k, v, mask, compiled=False)
    assert seen and seen[0].kv_indices.shape == (1, 1, T // 128, T // 128)
    assert largest.numel <= max(T * 2 * 16, (T // 128) ** 2)  # q (1M), or one row's block table (65k)
    assert largest.numel * 1000 < T * T


def test_flex_block_mask_is_built_once_per_micro_batch_and_window(monkeypatch):
    """Four layers, windows 8 and 0 alternating, two micro-batches: two block masks each, shared by
    the layers of that window, never one per layer."""
    builds = []
    real = BlockMask.from_kv_blocks

    def counted(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(BlockMask, "from_kv_blocks", counted)
    monkeypatch.setattr(flex, "_compiled_flex", lambda: flex_attention)  # eager: the CPU compiles no kernel
    attention = dataclasses.replace(PRESETS["tiny"].attention, window=8, window_pattern=("sliding", "full"),
                                    backend="flex")
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=64, n_layers=4, attention=attention))
    documents = Documents(eod=0, mask=True, reset_positions=False)
    g = torch.Generator().manual_seed(0)
    docs = []
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # eager FlexAttention materialises the scores (T = 32 here)
        for _ in range(2):
            tokens = torch.randint(0, 8, (2, 32), generator=g)
            positions, doc = documents.on_device(tokens, torch.device("cpu"))
            model(tokens, positions, doc=doc)
            docs.append(doc)
    assert len(builds) == 4
    assert [sorted(doc.block_masks) for doc in docs] == [[0, 8], [0, 8]]
