"""The deepseek activation layout (planner/activations.py) against hand arithmetic, and its recompute time
(planner/machine/roofline.py chunk_price).

What DeepSeek-V3 keeps for backward (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv
2412.19437): sec. 3.2.3 rebuilds every RMSNorm and the MLA up-projections in backward; sec. 3.3.3
caches the linear layers' inputs in FP8 (1 byte), the input of the linear after attention in E5M6
(12 bits: 1.5 bytes) and the SwiGLU's input in FP8, its output rebuilt in backward. The sizes are
the deepseek-v3 preset's (model/presets.py: its config.json).
"""

from __future__ import annotations

import dataclasses

import pytest

from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.planner.activations import (
    block_activation_bytes,
    block_activation_elements_per_token,
    deepseek_block_bytes,
    fp8_matmul_input_elements,
    layout_applies,
    routed_expert_elements_per_token,
)
from fivefold.planner.compute import busiest_chunk
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.layout import rank_shares
from fivefold.planner.machine import roofline
from fivefold.planner.machine.ops import block_ops
from fivefold.planner.machine.pricing import Memo
from fivefold.planner.options import PlanOptions

DSV3 = PRESETS["deepseek-v3"]
H100 = get_hardware("h100")
# deepseek-v3's sizes: model width, heads, query and key-value latents, RoPE width, value head width,
# routed experts, experts per token, expert width, shared experts, the dense blocks' SwiGLU width
d, H, rq, rkv, R, v = 7168, 128, 1536, 512, 64, 128
E, k, h, n_shared, f = 256, 8, 2048, 1, 18432
BF16, FP8, E5M6 = 2, 1, 1.5  # bytes: the compute dtype, sec. 3.3.3's FP8 and its 12-bit E5M6

ATTENTION = (2 * d * BF16  # the two norms' inputs x and h, all backward needs to rebuild the norms
             + rq * BF16  # wq_a's output, the query latent norm's input
             + (rkv + R) * BF16  # wkv_a's output: the key-value latent norm's input and k's RoPE part
             # (nothing of the norms' outputs, the up-projections' outputs or the kernel's q, k, v)
             + H * v * E5M6  # the kernel's output, wo's input, which the kernel's backward reads too
             + H * BF16)  # the kernel's log-sum-exp, counted as fivefold counts it
MOE_BLOCK = (ATTENTION
             + (2 * E + 4) * BF16  # the router's scores and top-k bookkeeping (fivefold's count)
             + k * d * FP8  # each routed copy's dispatched row, the up-projections' input
             + k * 2 * h * FP8  # each copy's SwiGLU input: its gate and up outputs
             + k * d * BF16  # each copy's output, which the gate weight's gradient reads
             + 2 * n_shared * h * FP8)  # the shared expert's SwiGLU input
DENSE_BLOCK = ATTENTION + 2 * f * FP8  # the dense SwiGLU's input; silu and product rebuilt


def test_the_hand_arithmetic_reads_the_presets_sizes():
    m = DSV3
    mla = m.latent
    assert (m.dim, m.n_heads, mla.q_lora_rank, mla.kv_lora_rank) == (d, H, rq, rkv)
    assert (mla.qk_rope_head_dim, mla.v_head_dim) == (R, v)
    assert (m.moe.n_experts, m.moe.top_k, m.moe.ffn_dim, m.moe.n_shared_experts, m.ffn_dim) == (E, k, h, n_shared, f)
    assert m.moe.first_dense_layers == 3 and layout_applies(m, "deepseek")


def test_a_moe_block_keeps_the_listed_bytes():
    """267,656 bytes per token (0.27 MB) where fivefold's layout keeps 410,312 bf16 elements (0.82 MB)."""
    assert MOE_BLOCK == 267656
    assert block_activation_bytes(DSV3, 1, 1, bytes_per_element=BF16, layout="deepseek") == MOE_BLOCK
    assert block_activation_bytes(DSV3, 1, 1, bytes_per_element=BF16, layout="deepseek", layer=3) == MOE_BLOCK
    assert sum(deepseek_block_bytes(DSV3).values()) == MOE_BLOCK
    # in bf16 elements: an FP8 byte is half of one, an E5M6 value three quarters
    assert block_activation_elements_per_token(DSV3, layout="deepseek") == MOE_BLOCK / BF16
    assert block_activation_elements_per_token(DSV3) == 410312
    # micro-batch x sequence tokens
    assert block_activation_bytes(DSV3, 2, 4096, bytes_per_element=BF16, layout="deepseek") == 2 * 4096 * MOE_BLOCK


def test_a_dense_first_block_keeps_the_same_attention_and_its_swiglu_input():
    """94,592 bytes per token where fivefold's keeps 237,764 bf16 elements (0.48 MB)."""
    assert DENSE_BLOCK == 94592
    for layer in range(3):
        assert block_activation_bytes(DSV3, 1, 1, bytes_per_element=BF16, layout="deepseek", layer=layer) == DENSE_BLOCK
    assert block_activation_elements_per_token(DSV3, layout="deepseek", layer=0) == DENSE_BLOCK / BF16
    assert block_activation_elements_per_token(DSV3, layer=0) == 237764  # fivefold's: a dense SwiGLU's 4f


def test_fp8_and_e5m6_bytes_stay_whatever_the_compute_dtype():
    """In fp32 (4 bytes) only the compute-dtype tensors double."""
    fp8_terms = k * d * FP8 + k * 2 * h * FP8 + 2 * n_shared * h * FP8 + H * v * E5M6
    assert block_activation_bytes(DSV3, 1, 1, bytes_per_element=4, layout="deepseek") == (
        2 * (MOE_BLOCK - fp8_terms) + fp8_terms)


def test_sequence_parallel_splits_every_term():
    """With tp = 2 and sp every tensor holds T/2 tokens or H/2 heads or f/2 units: half of tp = 1.
    Without sp only the per-head and SwiGLU tensors split."""
    for layer in (0, 3):
        one = block_activation_bytes(DSV3, 1, 1, 1, False, "none", BF16, "deepseek", layer)
        assert block_activation_bytes(DSV3, 1, 1, 2, True, "none", BF16, "deepseek", layer) == one / 2
    split = H * v * E5M6 / 2 + H * BF16 / 2 + 2 * f * FP8 / 2
    assert block_activation_bytes(DSV3, 1, 1, 2, False, "none", BF16, "deepseek", 0) == DENSE_BLOCK - split


def test_fp8_storage_is_counted_once():
    """The layout's bytes hold the FP8 storage already: memory.py's FP8 adjustment gets nothing to
    move, and the routed copies' share (what expert imbalance scales) is the layout's own."""
    assert fp8_matmul_input_elements(DSV3, layout="deepseek") == (0.0, 0.0)
    assert fp8_matmul_input_elements(DSV3)[0] > 0  # fivefold's layout: some inputs move to 1 byte
    routed = k * d * FP8 + k * 2 * h * FP8 + k * d * BF16
    assert routed_expert_elements_per_token(DSV3, layout="deepseek") == (routed / BF16, 0.0)


def _small_dsv3(*extra: str):
    """deepseek-v3 cut to 4 blocks (3 dense, 1 MoE) on one GPU: 4096 tokens of one micro-batch."""
    return load_config(None, ["--model.preset=deepseek-v3", "--model.n_layers=4", "--train.seq_len=4096",
                              "--train.global_batch=1", "--train.micro_batch=1", *extra])


def test_estimate_counts_fp8_storage_once_under_the_layout():
    """Under the deepseek layout the activations are the same with FP8 compute or without (the layout
    is DeepSeek-V3's FP8 recipe); under fivefold's, FP8 compute moves some to 1 byte."""
    cfg = _small_dsv3()
    acts = {(lay, fp8): estimate(cfg, 1, H100, options=PlanOptions(activations=lay, fp8=fp8)).memory["activations"]
            for lay in ("fivefold", "deepseek") for fp8 in ("none", "compute")}
    assert acts["deepseek", "none"] == pytest.approx(acts["deepseek", "compute"])
    assert acts["fivefold", "compute"] < acts["fivefold", "none"]
    assert acts["deepseek", "compute"] < acts["fivefold", "compute"]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_fivefolds_recompute_replaces_the_layout(recompute):
    """Under selective or full recompute the layout keeps fivefold's counts and adds no time."""
    for layer in (0, 3):
        assert (block_activation_bytes(DSV3, 1, 4096, 1, False, recompute, BF16, "deepseek", layer)
                == block_activation_bytes(DSV3, 1, 4096, 1, False, recompute, BF16, "fivefold", layer))
    assert (fp8_matmul_input_elements(DSV3, 1, False, recompute, "deepseek")
            == fp8_matmul_input_elements(DSV3, 1, False, recompute, "fivefold"))
    assert (routed_expert_elements_per_token(DSV3, 1, False, recompute, "deepseek")
            == routed_expert_elements_per_token(DSV3, 1, False, recompute))
    prices = [roofline.chunk_price(_chunk(_small_dsv3(f"--train.recompute={recompute}"), PlanOptions(activations=lay)),
                                   H100, Memo()) for lay in ("fivefold", "deepseek")]
    assert prices[0].backward_s == prices[1].backward_s and prices[0].forward_s == prices[1].forward_s


def test_the_layout_leaves_a_dense_grouped_query_model_alone():
    """Llama 3 8B (grouped-query attention, no experts) and Mixtral (experts without latent attention):
    the same bytes and seconds as fivefold's layout."""
    for name in ("llama3-8b", "mixtral-8x7b"):
        m = PRESETS[name]
        assert not layout_applies(m, "deepseek")
        for recompute in ("none", "selective", "full"):
            for tp, sp in ((1, False), (2, True)):
                assert (block_activation_bytes(m, 1, 4096, tp, sp, recompute, BF16, "deepseek")
                        == block_activation_bytes(m, 1, 4096, tp, sp, recompute, BF16, "fivefold"))
                assert (fp8_matmul_input_elements(m, tp, sp, recompute, "deepseek")
                        == fp8_matmul_input_elements(m, tp, sp, recompute, "fivefold"))
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=4096", "--train.global_batch=1",
                             "--train.micro_batch=1"])
    prices = [roofline.chunk_price(_chunk(cfg, PlanOptions(activations=lay)), H100, Memo())
              for lay in ("fivefold", "deepseek")]
    assert prices[0].backward_s == prices[1].backward_s


def _chunk(cfg, options: PlanOptions, world: int = 1):
    d_ = derive(cfg, world, unpadded_vocab(cfg))
    counts = model_counts(cfg.model, d_.vocab_size)
    return busiest_chunk(cfg, d_, counts, rank_shares(cfg, counts), options.with_config(cfg), weight_bytes=2)


@pytest.mark.parametrize("fp8", ["none", "compute"])
def test_recompute_time_is_the_rebuilt_ops_forward(fp8):
    """The backward under the layout is fivefold's plus, per block, the forward seconds of what it
    rebuilds, taken from price_ops' own pricing of block_ops: the norms' and latent norms' bytes and
    the SwiGLUs' (dense, routed, shared) at the HBM rate, and the wq_b and wkv_b matmuls."""
    cfg = _small_dsv3()
    work = _chunk(cfg, PlanOptions(activations="deepseek", fp8=fp8))
    base = roofline.chunk_price(dataclasses.replace(work, options=dataclasses.replace(work.options,
                                                                                      activations="fivefold")),
                                H100, Memo())
    chunk = roofline.chunk_price(work, H100, Memo())
    shapes, bw, low = roofline.rank_shapes(work), H100.hbm_bw * H100.hbm_efficiency, fp8 != "none"
    parts = ("norms", "latent norms", "swiglu", "expert swiglu", "shared swiglu")
    expected, seen = 0.0, set()
    for layer in work.share.blocks:
        ops = block_ops(cfg.model, layer, shapes)
        expected += sum(ops.parts.get(p, 0.0) for p in parts) / bw
        expected += sum(roofline.matmul_seconds(mm.m, mm.n, mm.k, H100, shapes.act_bytes, low) * mm.count
                        for mm in ops.matmuls if mm.name in ("wq_b", "wkv_b"))
        seen |= {p for p in parts if ops.parts.get(p)}
    assert work.share.blocks == [0, 1, 2, 3] and seen == set(parts)  # 3 dense blocks and an MoE one
    assert chunk.forward_s == base.forward_s
    assert chunk.backward_s - base.backward_s == pytest.approx(expected / work.chunks, rel=1e-12)
    assert 0 < expected < base.forward_s


def test_print_the_deepseek_v3_published_row_under_the_layout():
    """Printed, not asserted: benchmarks/planner_vs_published.py's DeepSeek-V3 row (2048 H800, FP8)
    with the deepseek layout at recompute none."""
    from benchmarks.planner_vs_published import config, hardware, plan_options
    from benchmarks.published_runs import RUNS

    run = next(r for r in RUNS if r.name.startswith("deepseek-v3-"))
    options, _ = plan_options(run.options)
    cfg = config(run, "none")
    for lay in ("fivefold", "deepseek"):
        est = estimate(cfg, run.world, hardware(run), options=dataclasses.replace(options, activations=lay))
        print(f"{run.name} activations={lay} recompute=none: memory {est.memory['total'] / 1e9:.1f} GB "
              f"(activations {est.memory['activations'] / 1e9:.1f} GB), fits 80 GB: "
              f"{est.memory['total'] <= 80e9} (estimate.fits {est.fits}), step {est.step_time_s:.2f} s, "
              f"{1e12 / est.tokens_per_s_per_gpu / 3600 / 1e3:.1f}K GPU-hours per trillion tokens "
              f"(published {run.published / 1e3:.0f}K)")
    assert cfg.train.recompute == "none"
