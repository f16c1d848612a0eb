"""QK-clip (optim.qk_clip; parallel/qk_clip.py, model/logit_max.py): the blockwise tiles record each
head's largest logit exactly, the clip brings every head that passed tau back to tau, and every layout
clips as one process does."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import BF16, EQUIVALENCE, MLA_ARGS, QK, Layout, OneRank, assert_layout_reproduces, tiny_config

from fivefold.model.attention import Attention, LatentAttention
from fivefold.model.blockwise import blockwise_attention
from fivefold.model.masks import AttentionMask, dense_keep
from fivefold.model.rope import rope_cos_sin
from fivefold.model.transformer import Transformer
from fivefold.parallel.qk_clip import QKClip


def _dense_max(q, k, mask, scale) -> torch.Tensor:
    """(H,) each head's largest kept logit, written out densely."""
    H, T = q.shape[2], q.shape[1]
    k = k.repeat_interleave(H // k.shape[2], dim=2)
    scores = torch.einsum("bqhd,bthd->bhqt", q.double(), k.double()) * scale  # (B, H, T, T)
    return scores.masked_fill(~dense_keep(mask, T), -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("window,documents,kv_heads", [(0, False, 4), (5, True, 2)], ids=["causal", "masked-gqa"])
def test_tiles_record_each_heads_largest_logit(window, documents, kv_heads):
    """Every tile kind (full, causal, masked, skipped), grouped heads: the recorded maxima are the
    dense rule's, to fp32's rounding of the products."""
    torch.manual_seed(0)
    B, T, H, D = 2, 40, 4, 8
    q, k, v = torch.randn(B, T, H, D) * 3, torch.randn(B, T, kv_heads, D), torch.randn(B, T, kv_heads, D)
    doc = torch.cumsum(torch.rand(B, T) < 0.15, dim=1) if documents else None
    record = torch.full((H,), -math.inf)
    mask = AttentionMask(doc, window, logit_max=record)
    blockwise_attention(q, k, v, mask, tile=8, scale=0.3)
    torch.testing.assert_close(record.double(), _dense_max(q, k, mask, 0.3), rtol=1e-6, atol=0)


@pytest.mark.parametrize("overrides", [(), ("--model.n_kv_heads=2",), ("--model.preset=tiny-mla",)],
                         ids=["mha", "gqa", "mla"])
def test_clip_brings_each_head_back_to_tau(tmp_path, overrides):
    """After the clip, the same input's largest logit is tau for every head that passed it (the
    scalings multiply each logit by gamma exactly: RoPE and the projections are linear), and the
    other heads keep theirs."""
    cfg = tiny_config(tmp_path, *overrides)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=64))
    model.init_weights()
    layer = next(m for m in model.modules() if isinstance(m, (Attention, LatentAttention)))
    for p in layer.parameters():  # logits of a few units
        p.data.mul_(4.0)
    clip = QKClip(model, OneRank(model), OneRank(model), tau=0.0)
    x = torch.randn(2, 16, cfg.model.dim)
    cos, sin = rope_cos_sin(torch.arange(16), model.rope_dim, cfg.model.rope)
    layer(x, cos, sin)
    before = layer.logit_max.clone()
    ranked = before.sort().values
    clip.tau = float(ranked[1] + ranked[2]) / 2  # half the heads above it
    clip.clip()
    layer(x, cos, sin)
    torch.testing.assert_close(layer.logit_max, before.clamp(max=clip.tau), rtol=2e-6, atol=0)
    assert clip.last["clipped_heads"] == 2


# ---- every layout clips as one process -------------------------------------------------------------------
# helpers.QK (tau 0.1: most heads clipped at every step). Losses and norms at the shared bounds; weights as
# Muon's rows (helpers.MUON).
QK_ROW = dict(reference="qk_reference", param_atol=5e-4)
QK_LAYOUTS = {
    "tp2-sp-zero1": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
                               "--train.micro_batch=2"), **QK_ROW),
    "ring-cp2-zero3": Layout(4, ("--parallel.cp=2", "--parallel.zero=3"), **QK_ROW),
    "ulysses-cp2": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses"), **QK_ROW),
    "mla-tp2": Layout(2, ("--parallel.tp=2", "--train.micro_batch=4", *MLA_ARGS),
                      reference="qk_mla_reference", param_atol=5e-4),
    # bf16 autocast (helpers.BF16): the tiles' logits from bf16 q and k, the maxima max-reduced over cp
    "ulysses-cp2-bf16": Layout(2, ("--parallel.cp=2", "--parallel.cp_method=ulysses", *BF16), reference="qk_reference"),
}


@pytest.mark.parametrize("name", QK_LAYOUTS)
def test_layouts_clip_as_one_process(tmp_path, request, name):
    layout = QK_LAYOUTS[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *QK, *layout.overrides), layout)
