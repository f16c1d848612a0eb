"""The open families' block features, one process: attention biases (Qwen2, gpt-oss), q/k norm over the
whole projection (OLMo 2), post and sandwich norms (OLMo 2, Gemma 3), norms scaling by (1 + weight) and
embeddings scaled by sqrt(dim) (Gemma), GeGLU; each against the block written out by hand, and the cast
order of norms and embeddings against transformers' own modules."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from fivefold.model.attention import RMSNorm
from fivefold.model.config import AttentionConfig, ModelConfig, NormConfig
from fivefold.model.counts import count_on_meta, model_counts
from fivefold.model.masks import dense_attention
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer

# The two families the tests train (tests/parallel/test_block_layouts.py uses the same keys), on the
# tiny preset, whose norm and attention tables are the defaults.
OLMO2_LIKE = dict(n_kv_heads=2, norm=NormConfig(position="post", qk=True, qk_span="all", weight_fp32=True))
GEMMA_QWEN2_LIKE = dict(embed_scale=True, activation="gelu_tanh",
                        norm=NormConfig(position="sandwich", offset=1.0, qk=True),
                        attention=AttentionConfig(qkv_bias=True, out_bias=True))
FAMILIES = {"olmo2-like": OLMO2_LIKE, "gemma-qwen2-like": GEMMA_QWEN2_LIKE}
# Each feature's key (a part's as "part.key") and its value when off: the tiny preset's.
FEATURES_OFF = {"norm.position": "pre", "norm.qk_span": "head", "embed_scale": False, "activation": "silu",
                "norm.offset": 0.0, "attention.qkv_bias": False, "attention.out_bias": False}


def with_key(cfg: ModelConfig, key: str, value) -> ModelConfig:
    """cfg with one key changed: a top-level one, or "part.key" inside one of its tables."""
    part, _, name = key.rpartition(".")
    if not part:
        return dataclasses.replace(cfg, **{name: value})
    return dataclasses.replace(cfg, **{part: dataclasses.replace(getattr(cfg, part), **{name: value})})


def key_of(cfg: ModelConfig, key: str):
    """The value of `key` (as with_key names it) in cfg."""
    part, _, name = key.rpartition(".")
    return getattr(getattr(cfg, part) if part else cfg, name)


def tiny(**changes) -> Transformer:
    m = Transformer(dataclasses.replace(PRESETS["tiny"], vocab_size=320, n_layers=2, **changes))
    m.init_weights(0)
    return m


def randomised(m: Transformer) -> Transformer:
    """Every parameter drawn anew (biases and norm weights too, which start as 0 or a scale of 1)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.05))
    return m


def _rms(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def _rope(x, theta):
    """Rotate-half RoPE at positions 0..T-1 of x (B, T, H, D), written out."""
    T, D = x.shape[1], x.shape[-1]
    inv = theta ** -(torch.arange(0, D, 2).float() / D)
    angles = torch.arange(T).float()[:, None] * inv  # (T, D/2)
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1)[:, None] for f in (torch.cos, torch.sin))  # (T, 1, D)
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], dim=-1) * sin


def reference_logits(m: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """The model written out from its parameters: what each of the block features means."""
    c, p = m.cfg, dict(m.named_parameters())
    B, T = tokens.shape
    hd = m.head_dim

    def norm(name, x):
        w = p.get(name)
        return x if w is None else _rms(x, w, c.norm.eps, c.norm.offset)

    h = F.embedding(tokens, p["tok_embeddings.weight"]) * (math.sqrt(c.dim) if c.embed_scale else 1.0)
    for i in range(c.n_layers):
        pre = f"layers.{i}."
        a = norm(pre + "attn_norm.weight", h)
        q, k, v = (F.linear(a, p[f"{pre}attn.{w}.weight"], p.get(f"{pre}attn.{w}.bias")) for w in ("wq", "wk", "wv"))
        if c.norm.qk and c.norm.qk_span == "all":  # over the H x D (K x D) features of each token
            q, k = norm(pre + "attn.q_norm.weight", q), norm(pre + "attn.k_norm.weight", k)
        q, k, v = (t.view(B, T, -1, hd) for t in (q, k, v))
        if c.norm.qk and c.norm.qk_span == "head":
            q, k = norm(pre + "attn.q_norm.weight", q), norm(pre + "attn.k_norm.weight", k)
        o = dense_attention(_rope(q, c.rope.theta), _rope(k, c.rope.theta), v).reshape(B, T, -1)
        o = F.linear(o, p[pre + "attn.wo.weight"], p.get(pre + "attn.wo.bias"))
        h = h + norm(pre + "attn_post_norm.weight", o)
        f = norm(pre + "ffn_norm.weight", h)
        gate = F.linear(f, p[pre + "ffn.gate.weight"])
        act = F.gelu(gate, approximate="tanh") if c.activation == "gelu_tanh" else F.silu(gate)
        f = F.linear(act * F.linear(f, p[pre + "ffn.up.weight"]), p[pre + "ffn.down.weight"])
        h = h + norm(pre + "ffn_post_norm.weight", f)
    return F.linear(norm("norm.weight", h), p["output.weight"])


BLOCK_NAMES = {
    "olmo2-like": {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight", "attn.q_norm.weight",
                   "attn.k_norm.weight", "attn_post_norm.weight", "ffn_post_norm.weight", "ffn.gate.weight",
                   "ffn.up.weight", "ffn.down.weight"},
    "gemma-qwen2-like": {"attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight", "attn.wq.bias",
                         "attn.wk.bias", "attn.wv.bias", "attn.wo.bias", "attn.q_norm.weight", "attn.k_norm.weight",
                         "attn_norm.weight", "attn_post_norm.weight", "ffn_norm.weight", "ffn_post_norm.weight",
                         "ffn.gate.weight", "ffn.up.weight", "ffn.down.weight"},
}


@pytest.mark.parametrize("family", FAMILIES)
def test_block_features_equal_the_block_written_out(family):
    m = randomised(tiny(**FAMILIES[family]))
    names = {n.removeprefix("layers.0.") for n in m.state_dict() if n.startswith("layers.0.")}
    assert names == BLOCK_NAMES[family]
    q_norm = m.layers["0"].attn.q_norm.weight
    assert q_norm.shape == ((4 * 16,) if family == "olmo2-like" else (16,))  # H x D over the projection, or D
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(m(tokens), reference_logits(m, tokens), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_feature_changes_the_logits(family):
    """The reference is not blind to them: turning each feature off moves the logits (the parameters
    a feature adds, set to 0 or dropped, as the smaller model has them)."""
    m = randomised(tiny(**FAMILIES[family]))
    tokens = torch.randint(0, 320, (2, 12), generator=torch.Generator().manual_seed(2))
    logits = m(tokens)
    for key, off in FEATURES_OFF.items():
        if key_of(m.cfg, key) == off:  # not a feature of this family
            continue
        other = Transformer(with_key(m.cfg, key, off))
        state = {n: t for n, t in m.state_dict().items() if n in other.state_dict()
                 and other.state_dict()[n].shape == t.shape}
        other.init_weights(0)
        other.load_state_dict(state, strict=False)
        assert (other(tokens) - logits).abs().max() > 1e-3, key


def test_seeded_init_starts_biases_at_zero_and_offset_norms_at_a_scale_of_one():
    m = tiny(**GEMMA_QWEN2_LIKE)
    biases = [t for n, t in m.named_parameters() if n.endswith("bias")]
    norms = [t for n, t in m.named_parameters() if "norm" in n]
    assert len(biases) == 2 * 4 and len(norms) == 2 * 6 + 1
    assert all(torch.equal(t, torch.zeros_like(t)) for t in biases + norms)
    # A scale of 1 either way: the offset model starts as the one without the offset.
    plain = tiny(**dict(GEMMA_QWEN2_LIKE, norm=dataclasses.replace(GEMMA_QWEN2_LIKE["norm"], offset=0.0)))
    assert all(torch.equal(t, torch.ones_like(t)) for n, t in plain.named_parameters() if "norm" in n)
    tokens = torch.randint(0, 320, (2, 12))
    torch.testing.assert_close(m(tokens), plain(tokens), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_casts_as_transformers_does(dtype):
    """Bit for bit against transformers' Llama norm (cast, then scaled), OLMo 2's (scaled in fp32, then
    cast: model.norm.weight_fp32) and Gemma 3's ((1 + w) applied in fp32, then cast): they differ in bf16."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(3, 5, 64, generator=g) * 4).to(dtype), torch.randn(64, generator=g).to(dtype)
    pairs = {"llama": (RMSNorm(64, 1e-6), LlamaRMSNorm(64, 1e-6)),
             "olmo2": (RMSNorm(64, 1e-6, weight_fp32=True), Olmo2RMSNorm(64, 1e-6)),
             "gemma3": (RMSNorm(64, 1e-6, 1.0), Gemma3RMSNorm(64, 1e-6))}
    outputs = {}
    for family, (ours, theirs) in pairs.items():
        ours.to(dtype), theirs.to(dtype)
        with torch.no_grad():
            ours.weight.copy_(w)
            theirs.weight.copy_(w)
        outputs[family] = ours(x)
        assert torch.equal(outputs[family], theirs(x)), family
    assert torch.equal(outputs["llama"], outputs["olmo2"]) == (dtype == torch.float32)


def test_embed_scale_casts_as_transformers_does():
    """sqrt(dim) rounded to the embeddings' dtype first (bf16: sqrt(64) exact, sqrt(40) not)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    m = tiny(dim=40, n_heads=4, n_kv_heads=4, embed_scale=True).to(torch.bfloat16)
    theirs = Gemma3TextScaledWordEmbedding(320, 40, 0, embed_scale=40 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(m.tok_embeddings.weight)
    tokens = torch.randint(0, 320, (2, 7))
    assert torch.equal(m.embed(tokens), theirs(tokens))


COUNTED = {**{family: ("tiny", keys) for family, keys in FAMILIES.items()},
           "mla-out-bias": ("tiny-mla", dict(attention=AttentionConfig(out_bias=True))),
           "sinks-pre": ("tiny", dict(attention=AttentionConfig(sinks=True, qkv_bias=True),
                                      norm=NormConfig(qk=True, qk_span="all")))}


@pytest.mark.parametrize("case", COUNTED)
def test_counts_equal_the_meta_model(case):
    preset, keys = COUNTED[case]
    cfg = dataclasses.replace(PRESETS[preset], **keys)
    assert model_counts(cfg, 320).total == count_on_meta(cfg, 320)


def test_the_planner_prices_a_sandwich_block_s_four_norms():
    from fivefold.planner.machine.ops import RankShapes, block_ops

    shapes = RankShapes(tokens=64, sp_tokens=64, seq_len=32, kernel_seq=32)
    base = dataclasses.replace(PRESETS["tiny"], vocab_size=320)
    norms = {position: block_ops(with_key(base, "norm.position", position), 0, shapes).parts["norms"]
             for position in ("pre", "post", "sandwich")}
    assert norms["post"] == norms["pre"] and norms["sandwich"] == 2 * norms["pre"]
