"""The planner counts what the mask keeps (model/mask_counts.py): the roofline prices the tiles the
kernel computes, documents of a stated mean length cut the attention and the step, and `--explain`
states the MFU convention for masked attention (kept pairs, the causal full sequence beside)."""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.model.config import AttentionConfig
from fivefold.model.counts import model_counts
from fivefold.model.mask_counts import kept_pairs, tile_ratio, window_pairs
from fivefold.model.presets import PRESETS
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.machine import roofline
from fivefold.planner.machine.ops import RankShapes, block_ops
from fivefold.planner.options import DEFAULT, PlanOptions

H100 = get_hardware("h100")
LLAMA8 = dataclasses.replace(PRESETS["llama3-8b"], vocab_size=128256)


def test_the_roofline_prices_the_tiles_the_kernel_computes():
    """Llama 3 8B, 8192 tokens: its causal kernel runs 8192^2 x 32 x 256 FLOPs forward. Under a
    window of 1024 the FLOPs are the kept pairs' and the time the kept tiles' share of the causal
    kernel's: each query tile keeps its diagonal and 8 back (the closest pair 8 tiles back is
    7 x 128 + 1 = 897 apart, 9 back 1025), the first 8 fewer: 1 + 2 + .. + 9 + 55 x 9 = 540 of 64 x 65 / 2.
    The window runs FlexAttention, priced at FlashAttention-2's causal rate; causality alone SDPA's kernel."""
    causal = 8192 * 8192 * 32 * 256
    shapes = RankShapes(tokens=8192, sp_tokens=8192, seq_len=8192, kernel_seq=8192)
    windowed = block_ops(dataclasses.replace(LLAMA8, attention=AttentionConfig(window=1024)), 0, shapes)
    assert windowed.attention_flops == pytest.approx(causal * window_pairs(8192, 1024) / (8192 * 8192 / 2))
    assert windowed.attention_work == pytest.approx(causal * 540 / (64 * 65 / 2))
    assert windowed.attention_flex and not block_ops(LLAMA8, 0, shapes).attention_flex
    plain = roofline.price_ops(block_ops(LLAMA8, 0, shapes), H100, 2, fp8=False, kernel="fa2")
    masked = roofline.price_ops(windowed, H100, 2, fp8=False)
    assert masked.attention_curves == {"fa2"}
    assert masked.forward["attention"] == pytest.approx(plain.forward["attention"] * 540 / (64 * 65 / 2))
    assert masked.backward["attention"] == pytest.approx(plain.backward["attention"] * 540 / (64 * 65 / 2))
    documents = block_ops(LLAMA8, 0, dataclasses.replace(shapes, document_tokens=1024))
    assert documents.attention_work == pytest.approx(causal * tile_ratio(8192, 0, 1024))
    assert documents.attention_flops == pytest.approx(causal * kept_pairs(8192, 0, 1024) / (8192 * 8192 / 2))


def _estimate(*overrides: str, options: PlanOptions = DEFAULT):
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=8192", "--train.global_batch=64",
                             "--train.micro_batch=1", "--parallel.dp=8", "--parallel.zero=1", *overrides])
    return estimate(cfg, 8, H100, options=options)


def test_documents_of_a_stated_length_cut_the_attention_and_the_step():
    plain = _estimate("--data.document_mask=true")  # no length stated: the whole row, at FlexAttention's rate
    as_fa2 = _estimate(options=PlanOptions(attention_kernel="fa2"))
    assert plain.step_time_s == as_fa2.step_time_s > _estimate().step_time_s and plain.mfu == as_fa2.mfu
    docs = _estimate("--data.document_mask=true", options=PlanOptions(document_tokens=1024))
    assert docs.step_time_s < plain.step_time_s
    matmul = 6 * model_counts(LLAMA8).active_matmul
    kept = 6 * 32 * 32 * 256 * kept_pairs(8192, 0, 1024) / 8192 * 2  # 32 layers, counted in full
    assert docs.flops["model_per_token"] == pytest.approx(matmul + kept, rel=1e-12)
    assert "the causal full sequence" in " ".join(text for _, text, _ in docs.explain)


def test_explain_states_the_masked_convention_and_bad_document_lengths_are_refused(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--layout", "dp=8,zero=1", "--explain",
            "--model.attention.window=1024", "--model.attention.window_pattern=[\"sliding\", \"full\"]"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines at its width
    assert "a window of 1024 tokens in 16 of 32 layers" in out and "counted as the pairs they keep" in out
    assert "counting the causal full sequence instead" in out
    assert main([*argv, "--document-tokens", "512"]) != 0
    err = capsys.readouterr().err
    assert "--document-tokens 512: data.document_mask is off" in err and "--data.document_mask=true" in err
    assert main([*argv, "--data.document_mask=true", "--document-tokens", "0.5"]) != 0
    assert "--document-tokens 0.5: a document holds at least one token" in capsys.readouterr().err
