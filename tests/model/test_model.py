"""The parallel-free model: its imports, its presets' sizes, and the pieces parallelism swaps."""

import ast
import dataclasses
import math
from pathlib import Path

import pytest
import torch

from fivefold.model import moe as moe_module
from fivefold.model import transformer as model_module
from fivefold.model.attention import LatentAttention, causal_attention
from fivefold.model.config import ModelConfig
from fivefold.model.counts import model_counts
from fivefold.model.masks import dense_attention
from fivefold.model.moe import MoE
from fivefold.model.presets import PRESETS, PUBLISHED_PARAMS
from fivefold.model.rope import rope_cos_sin
from fivefold.model.transformer import Transformer, count_parameters, cross_entropy_sum


def tiny(**changes) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=320, **changes))
    m.init_weights(0)
    return m


def moe_of(preset: str, **moe_keys) -> MoE:
    """The MoE block of `preset`, some of its [model.moe] keys changed."""
    m = PRESETS[preset]
    return MoE(dataclasses.replace(m.moe, **moe_keys), m.dim, m.ffn_dim, m.activation)


MODEL_FILES = sorted((Path(model_module.__file__).parent).glob("*.py"))


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.name)
def test_the_model_package_imports_nothing_parallel(path):
    """model/ is the ground floor: no torch.distributed, and nothing of fivefold outside model/
    (the config schema, the parallel code and the planner all build on it, never the reverse)."""
    tree = ast.parse(path.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert names or path.name == "__init__.py", "the import scan found nothing: it would pass on any file"
    bad = [n for n in names if n.startswith("torch.distributed")
           or (n.startswith("fivefold") and not n.startswith("fivefold.model"))]
    assert not bad, bad


def test_the_model_package_scan_sees_its_modules():
    assert {p.name for p in MODEL_FILES} >= {"transformer.py", "attention.py", "masks.py", "counts.py"}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_counts_match_published(name):
    with torch.device("meta"):
        n = count_parameters(Transformer(PRESETS[name]))
    excess = n / PUBLISHED_PARAMS[name] - 1
    # Published totals are rounded to 3-4 digits; 0.2% covers the rounding, not a missing tensor
    # (the smallest block of any preset is > 0.5% of its total).
    assert abs(excess) < 0.002, f"{name}: {n / 1e9:.3f}B"


def test_deepseek_v3_counts_671b_and_37b_activated_as_published():
    # DeepSeek-V3 report, abstract and sec. 4.2: 671B total, 37B activated per token, without the
    # 14B multi-token-prediction module. The planner's formula (the meta-device model agrees with
    # it for every preset, tests/planner/test_planner.py) gives 671.026B; activated (all but the 248
    # routed experts a token skips in each MoE block) 36.63B without the embedding table, a lookup
    # rather than a matmul, 37.55B with it: "37B" is the first, to its 2 digits.
    c = model_counts(PRESETS["deepseek-v3"])
    assert abs(c.total / 671e9 - 1) < 1e-4, c.total
    assert 36.5e9 <= c.active - c.embedding < 37.5e9, c.active


def test_tied_embeddings_share_one_matrix():
    m = tiny(tie_embeddings=True)
    assert m.output.weight is m.tok_embeddings.weight
    assert count_parameters(m) == count_parameters(tiny()) - 320 * 64


def test_stage_without_embedding_or_head_passes_through():
    full = tiny()
    x = torch.randint(0, 320, (2, 16))
    ref = full(x)  # (2, 16, 320)
    h = full.tok_embeddings(x)
    first, last = tiny(), tiny()
    first.output, first.norm = None, None
    last.tok_embeddings = None
    for name in ["4", "5", "6", "7"]:
        del first.layers[name]
    for name in ["0", "1", "2", "3"]:
        del last.layers[name]
    assert list(last.layers) == ["4", "5", "6", "7"]  # names, hence checkpoint keys, are kept
    torch.testing.assert_close(last(first(x)), ref, rtol=0, atol=0)
    assert first(x).shape == h.shape


def test_rope_depends_on_relative_positions_only():
    m = tiny()
    x = torch.randint(0, 320, (2, 16))
    pos = torch.arange(16)
    torch.testing.assert_close(m(x, pos + 1000), m(x, pos), atol=2e-5, rtol=0)
    assert not torch.allclose(m(x, pos.flip(0)), m(x, pos), atol=1e-3)


def test_grouped_query_attention_matches_explicit_softmax():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    out = causal_attention(q, k, v)  # (B, T, H, D)
    ref = dense_attention(q, k, v)  # the causal rule written out: head h uses K/V head h // 2
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_in_the_kernel_equals_the_copy():
    """On CPU SDPA takes the grouped K/V heads itself (enable_gqa): forward and gradients equal,
    bit for bit in fp32, those of K and V repeated to the query heads."""
    import fivefold.model.attention as attention

    torch.manual_seed(0)
    # Dv = D as in every GQA model here (MLA's narrower values come with K = H: nothing to group; with
    # Dv != D the CPU kernels' sums differ from the copy's by ~4e-7, fp32 rounding).
    q, k, v = torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    dout = torch.randn(2, 8, 4, 16)

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = causal_attention(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)

    calls = []
    sdpa = attention.F.scaled_dot_product_attention

    def logged(*args, **kwargs):
        calls.append((args[1].shape[1], kwargs["enable_gqa"]))  # K/V heads SDPA was handed
        return sdpa(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention.F, "scaled_dot_product_attention", logged)
        grouped = run()
        mp.setattr(attention, "gqa_in_kernel", lambda *a: False)
        copied = run()
    assert calls == [(2, True), (4, False)]  # no K/V copy, then the copy
    assert torch.equal(grouped[0], copied[0])
    assert all(torch.equal(a, b) for a, b in zip(grouped[1], copied[1], strict=True))
    # On CUDA only the flash kernel takes GQA (torch 2.11): half precision.
    assert attention.gqa_in_kernel("cuda", torch.bfloat16)
    assert not attention.gqa_in_kernel("cuda", torch.float32)


def _rms(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def _rope_pairs(x, positions, theta):
    """RoPE written out: pair j of a width-D vector is (x_j, x_{j+D/2}), turned by pos x theta^(-2j/D)."""
    half = x.shape[-1] // 2
    angle = positions[:, None].float() * theta ** (-2 * torch.arange(half).float() / x.shape[-1])  # (T, D/2)
    a, b = x[..., :half], x[..., half:]
    cos, sin = angle.cos(), angle.sin()
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


@pytest.mark.parametrize("q_lora_rank", [48, 0], ids=["q-latent", "q-direct"])
def test_latent_attention_matches_per_head_math(q_lora_rank):
    """MLA (DeepSeek-V2 eqs. 9-19) head by head, token by token, against LatentAttention."""
    base = PRESETS["tiny-mla"]
    cfg = dataclasses.replace(base, vocab_size=320, latent=dataclasses.replace(base.latent, q_lora_rank=q_lora_rank))
    torch.manual_seed(0)
    attn = LatentAttention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.ndim == 1 else 0.0, std=0.2)  # norm weights away from 1 too
    B, T, H, mla = 2, 6, cfg.n_heads, cfg.latent
    Dn, Dr, Dv, Ckv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim, mla.kv_lora_rank
    x, pos = torch.randn(B, T, cfg.dim), torch.arange(T) + 3
    cos, sin = rope_cos_sin(pos, Dr, cfg.rope)  # what Transformer hands its blocks (its rope_dim = Dr)
    out = attn(x, cos, sin)  # (B, T, dim)

    eps, theta = cfg.norm.eps, cfg.rope.theta
    c_q = _rms(x @ attn.wq_a.weight.T, attn.q_a_norm.weight, eps) @ attn.wq_b.weight.T if q_lora_rank \
        else x @ attn.wq.weight.T  # (B, T, H (Dn + Dr))
    kv_a = x @ attn.wkv_a.weight.T  # (B, T, Ckv + Dr)
    c_kv, k_shared = _rms(kv_a[..., :Ckv], attn.kv_a_norm.weight, eps), kv_a[..., Ckv:]
    k_shared = _rope_pairs(k_shared, pos, theta)  # (B, T, Dr): one roped key for every head
    up = c_kv @ attn.wkv_b.weight.T  # (B, T, H (Dn + Dv))
    heads = []
    for h in range(H):
        q_h = c_q[..., h * (Dn + Dr):(h + 1) * (Dn + Dr)]
        q_h = torch.cat([q_h[..., :Dn], _rope_pairs(q_h[..., Dn:], pos, theta)], dim=-1)  # rope on the last Dr only
        kv_h = up[..., h * (Dn + Dv):(h + 1) * (Dn + Dv)]
        k_h, v_h = torch.cat([kv_h[..., :Dn], k_shared], dim=-1), kv_h[..., Dn:]
        o_h = torch.zeros(B, T, Dv)
        for t in range(T):  # query t attends keys 0..t
            s = (q_h[:, t:t + 1] * k_h[:, :t + 1]).sum(-1) / math.sqrt(Dn + Dr)  # (B, t + 1)
            o_h[:, t] = (s.softmax(-1)[..., None] * v_h[:, :t + 1]).sum(1)
        heads.append(o_h)
    ref = torch.cat(heads, dim=-1) @ attn.wo.weight.T  # (B, T, dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_group_limited_routing_picks_top_k_within_the_best_groups():
    """DeepSeek-V3 sec. 2.1.2: groups ranked by the sum of their 2 best biased scores, top-k
    experts among the topk_groups best groups, weights renormalised then scaled by 2.5."""
    cfg = PRESETS["tiny-mla"]
    torch.manual_seed(0)
    moe = moe_of("tiny-mla")
    moe.expert_bias.copy_(torch.randn(8) * 0.1)
    scores = torch.rand(64, 8)  # sigmoid-like affinities
    weights, idx = moe.select(scores)
    per_group = cfg.moe.n_experts // cfg.moe.n_groups
    for n in range(64):
        biased = (scores[n] + moe.expert_bias).tolist()
        group_score = [sum(sorted(biased[g * per_group:(g + 1) * per_group])[-2:]) for g in range(cfg.moe.n_groups)]
        groups = sorted(range(cfg.moe.n_groups), key=lambda g: -group_score[g])[:cfg.moe.topk_groups]
        allowed = [e for e in range(cfg.moe.n_experts) if e // per_group in groups]
        expected = sorted(allowed, key=lambda e: -biased[e])[:cfg.moe.top_k]
        assert sorted(idx[n].tolist()) == sorted(expected), n
    chosen = scores.gather(-1, idx)
    torch.testing.assert_close(weights, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    # Without the group limit the same scores pick other experts for some tokens: the limit acts.
    free = moe_of("tiny-mla", n_groups=0)
    free.expert_bias.copy_(moe.expert_bias)
    assert (free.select(scores)[1].sort(-1).values != idx.sort(-1).values).any()


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_moe_dispatch_equals_per_token_loop(score):
    torch.manual_seed(0)
    moe = moe_of("tiny-moe", n_shared_experts=1, router_score=score)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 5, 64)
    out = moe(x)
    flat = x.reshape(-1, 64)
    weights, idx = moe.route(flat)
    ref = torch.stack([
        sum(w * ((torch.nn.functional.silu(t @ moe.experts.gate[e]) * (t @ moe.experts.up[e])) @ moe.experts.down[e])
            for w, e in zip(weights[i], idx[i].tolist(), strict=True))
        for i, t in enumerate(flat)
    ]) + moe.shared(flat)
    torch.testing.assert_close(out.reshape(-1, 64), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))  # norm_topk


def test_moe_model_trains_backward_through_router():
    m = Transformer(dataclasses.replace(PRESETS["tiny-moe"], vocab_size=320))
    m.init_weights(0)
    x = torch.randint(0, 320, (2, 16))
    cross_entropy_sum(m(x), x).backward()
    assert m.layers["0"].ffn.router.weight.grad.abs().sum() > 0


def test_loss_is_a_sum_that_skips_padding():
    logits = torch.randn(2, 3, 10)
    targets = torch.tensor([[1, 2, -100], [3, -100, -100]])
    manual = -sum(logits[b, t].log_softmax(-1)[targets[b, t]] for b, t in [(0, 0), (0, 1), (1, 0)])
    torch.testing.assert_close(cross_entropy_sum(logits, targets), manual)


def test_vocab_must_be_resolved():
    with pytest.raises(ValueError, match="vocab_size"):
        Transformer(ModelConfig())


@pytest.mark.parametrize("capacity", [0.0, 0.5], ids=["all-kept", "capacity-drops"])
def test_grouped_experts_equal_the_loop_in_bf16(monkeypatch, capacity):
    """torch._grouped_mm runs on the CPU (torch 2.13, fp32 and bf16, forward and backward): under
    bf16 autocast the experts take it, and its outputs and gradients, the input's included, are
    bit-identical to the loop's per-expert matmuls here (on CUDA the kernels differ: equal within bf16
    rounding). The input's needs each matmul's own cast of it, as autocast casts the loop's: its gate
    and up gradients are then summed in fp32, not in bf16."""
    results = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(moe_module, "grouped_dtype", lambda *args: None)
        torch.manual_seed(0)
        x = torch.randn(2, 16, 64, requires_grad=True)
        moe = moe_of("tiny-moe", capacity_factor=capacity)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert moe.experts.grouped(x) is grouped
            out = moe(x)
        out.float().square().sum().backward()
        results.append([out, x.grad, *(p.grad for p in moe.experts.parameters())])
    for ours, loop in zip(*results, strict=True):
        assert torch.equal(ours, loop)
    assert results[0][0].dtype == torch.bfloat16


@pytest.mark.parametrize("counts,ends", [([5, 0, 13, 1], [8, 16, 32, 56]), ([0, 0, 0, 19], [8, 16, 24, 56]),
                                         ([8, 16, 0, 0], [8, 24, 32, 56]), ([0, 0, 0, 0], [8, 16, 24, 32])],
                         ids=["ragged", "last-only", "aligned", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "biases"])
def test_grouped_experts_pad_each_expert_to_whole_groups_and_equal_the_loop(monkeypatch, counts, ends, bias):
    """CUDA's grouped GEMM needs groups of whole GROUP_ROWS (8) rows for its weight gradient, and an
    empty group can hang its backward (pytorch/pytorch#152668): each expert's rows are padded with
    zero rows to a multiple of 8, an expert without rows gets 8, and the last group takes the buffer's
    tail: round_up(N, 8) + 8 E rows. Ragged, 5 + 0 + 13 + 1 = 19 rows: groups of 8, 8, 16 and the
    rest of round_up(19, 8) + 8 x 4 = 56, so torch._grouped_mm's offs are 8, 16, 32, 56. The output,
    the input's gradient and every weight's (and bias's: gpt-oss) are bit-identical to the loop's on the CPU."""
    seen = []
    grouped_mm = torch._grouped_mm

    def recording(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        seen.append((a.shape[0], offs.tolist()))
        return grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    torch.manual_seed(0)
    experts = moe_module.GroupedExperts(4, 16, 24, bias)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x0, dy = torch.randn(sum(counts), 16), torch.randn(sum(counts), 16)
    results = []
    for grouped in (True, False):
        if not grouped:
            monkeypatch.setattr(moe_module, "grouped_dtype", lambda *args: None)
        experts.zero_grad()
        x = x0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = experts(x, torch.tensor(counts))
        out.float().backward(dy)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in experts.parameters()]
        results.append([out, x.grad, *grads])
    assert seen == [(ends[-1], ends)] * 3  # gate, up, down: the loop calls none
    for ours, loop in zip(*results, strict=True):
        assert torch.equal(ours, loop)


def test_local_dispatch_reads_the_device_once_or_not_at_all(monkeypatch):
    """One read of the split sizes per call (the loop, or capacity dropping); none when the experts run
    grouped and nothing can be dropped: their offsets stay on the device."""
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or original(self))
    moe = moe_of("tiny-moe")
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, 16, 64)
    moe(x)  # fp32: the loop
    assert reads == [torch.Size([PRESETS["tiny-moe"].moe.n_experts + 1])]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(x)  # grouped, nothing dropped
        assert len(reads) == 1
        moe.capacity_factor = 0.5
        moe(x)  # grouped, but how many copies were dropped is read
    assert len(reads) == 2
