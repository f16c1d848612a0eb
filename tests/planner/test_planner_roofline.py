"""The catalog GPUs' roofline (planner/machine/roofline.py, planner/machine/ops.py) against hand arithmetic.

Tile and wave quantisation follow NVIDIA's "Matrix Multiplication Background User's Guide" (Deep
Learning Performance docs), sec. 3.1 (tile quantization: M and N rounded up to whole tiles) and 3.2
(wave quantization: tiles rounded up to whole waves of one tile per SM). The catalog's constants
are the published measurements datasheet.py cites: H100 SXM bf16 GEMM 794.5 of 989 TFLOP/s (the MAMF
table of stas00/ml-engineering), FlashAttention-2 333 TFLOP/s forward (causal) and 318 backward at
sequence 8192 (Shah et al. 2024, FlashAttention-3, figs. 5-6), HBM at 90% of 3.35 TB/s.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.planner.calibration.opcount import block_tally, ends_tally
from fivefold.planner.compute import busiest_chunk
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.layout import rank_shares
from fivefold.planner.machine import roofline
from fivefold.planner.machine.ops import GROUP_ROWS, Matmul, Ops, RankShapes, block_ops, end_ops, grouped_rows
from fivefold.planner.machine.pricing import Memo
from fivefold.planner.options import DEFAULT, PlanOptions

H100 = get_hardware("h100")
GEMM = 794.5e12  # H100 SXM bf16, the MAMF table
HBM = 0.9 * 3.35e12  # bytes/s a streaming kernel moves
LLAMA8 = dataclasses.replace(PRESETS["llama3-8b"], vocab_size=128256)
MIXTRAL = dataclasses.replace(PRESETS["mixtral-8x7b"], vocab_size=32000)


def _shapes(tokens: int = 8192, seq: int = 8192, **over) -> RankShapes:
    return RankShapes(**{"tokens": tokens, "sp_tokens": tokens, "seq_len": seq, "kernel_seq": seq, **over})


def test_tile_quantisation_rounds_m_and_n_up_to_whole_tiles():
    """Guide sec. 3.1: with 128 x 128 tiles, a 257 x 129 output needs 3 x 2 tiles, of which 257 x 129 /
    (6 x 128^2) = 34% is work. With one SM (units = 1) every tile is a wave of its own, so wave
    quantisation adds nothing."""
    q, tile = roofline.quantisation(257, 129, ((128, 128),), 1)
    assert tile == (128, 128) and q == pytest.approx(257 * 129 / (3 * 2 * 128 * 128))
    # M = 384: three 128-row tiles fit exactly; two 256-row tiles would waste a quarter
    assert roofline.quantisation(384, 128, ((256, 128), (128, 128)), 1) == (1.0, (128, 128))
    assert roofline.quantisation(384, 128, ((256, 128),), 1)[0] == 0.75


def test_wave_quantisation_rounds_tiles_up_to_whole_waves_of_sms():
    """Guide sec. 3.2, on an A100's 108 SMs with 256 x 128 tiles: 27 x 4 = 108 tiles fill one wave
    exactly; one more tile column makes 135 tiles, two waves, the second a fifth full: 135 / 216."""
    tiles = ((256, 128),)
    assert roofline.quantisation(27 * 256, 4 * 128, tiles, 108)[0] == 1.0
    assert roofline.quantisation(27 * 256, 5 * 128, tiles, 108)[0] == pytest.approx(135 / 216)
    assert roofline.quantisation(27 * 256, 8 * 128, tiles, 108)[0] == 1.0  # two full waves


def test_a_skinny_matmul_runs_far_below_peak():
    """16 tokens through a 4096 x 4096 weight on an H100: one row of 32 tiles of 128 x 128, one wave of
    132 SMs, so 16 x 4096 / (132 x 128 x 128) = 3% of the tile work is useful; compute-bound at
    2.4% of peak, its operands (33.8 MB at 3.0 TB/s: 11 us) shorter."""
    q = 16 * 4096 / (132 * 128 * 128)
    expected = 2 * 16 * 4096 * 4096 / (GEMM * q)
    assert roofline.matmul_seconds(16, 4096, 4096, H100, 2, fp8=False) == pytest.approx(expected)
    assert 2 * 16 * 4096**2 / expected / 989e12 == pytest.approx(0.0243, abs=1e-4)
    big = roofline.matmul_seconds(8192, 8192, 8192, H100, 2, fp8=False)  # 64 x 64 tiles, 31.03 -> 32 waves
    assert big == pytest.approx(2 * 8192**3 / (GEMM * 8192 * 8192 / (32 * 132 * 128 * 128)))


def test_backward_prices_input_and_weight_gradients_at_their_own_shapes():
    """A 64-token matmul: the forward and the input gradient (64, 4096, 4096) are compute-bound at
    poor quantisation; the weight gradient (4096, 4096, 64) reduces over the 64 tokens and is bound
    by writing its 4096 x 4096 result: (2 x 64 x 4096 + 4096^2) x 2 bytes at HBM speed."""
    ops = Ops(matmuls=(Matmul("w", 64, 4096, 4096),))
    price = roofline.price_ops(ops, H100, 2, fp8=False)
    forward = 2 * 64 * 4096 * 4096 / (GEMM * 64 * 4096 / (132 * 128 * 128))  # one wave of 32 tiles
    wgrad = (2 * 64 * 4096 + 4096 * 4096) * 2 / HBM
    assert price.forward["matmul"] == pytest.approx(forward)
    assert price.backward["matmul"] == pytest.approx(forward + wgrad)


def test_attention_runs_at_its_kernels_measured_fraction():
    """Llama 3 8B, 8192 tokens of an 8192 sequence: the causal kernel runs T x s x H x (D + D) =
    8192^2 x 32 x 256 FLOPs forward, 2.5 x that backward. On an H100 SDPA runs cuDNN's kernel, 529
    TFLOP/s forward and 518 backward at 8k; FlashAttention-2 (attention_kernel = "fa2") 333 and 318
    (FA3 paper, figs. 5-6). The A100 has no cuDNN curve apart: "fa2" prices what SDPA runs there."""
    ops = block_ops(LLAMA8, 0, _shapes())
    assert ops.attention_flops == 8192 * 8192 * 32 * 256
    price = roofline.price_ops(ops, H100, 2, fp8=False)
    assert price.forward["attention"] == pytest.approx(ops.attention_flops / 529e12)
    assert price.backward["attention"] == pytest.approx(2.5 * ops.attention_flops / 518e12)
    fa2 = roofline.price_ops(ops, H100, 2, fp8=False, kernel="fa2")
    assert fa2.forward["attention"] == pytest.approx(ops.attention_flops / 333e12)
    assert fa2.backward["attention"] == pytest.approx(2.5 * ops.attention_flops / 318e12)
    assert (price.attention_curves, fa2.attention_curves) == ({"sdpa"}, {"fa2"})
    a100 = get_hardware("a100-80gb")
    assert (roofline.price_ops(ops, a100, 2, fp8=False, kernel="fa2").forward
            == roofline.price_ops(ops, a100, 2, fp8=False).forward)
    between = 298 + (math.log(3000) - math.log(2048)) / (math.log(4096) - math.log(2048)) * (319 - 298)
    assert roofline.interpolate(H100.fa2_fwd_curve, 3000) == pytest.approx(between / 989)
    assert roofline.interpolate(H100.fa2_fwd_curve, 100) == pytest.approx(191 / 989)  # flat outside
    assert roofline.interpolate(H100.attention_fwd_curve, 100) == pytest.approx(315 / 989)


def test_elementwise_ops_are_memory_bound():
    """The last stage's final norm, loss and the head's weight cast, 8192 tokens, bf16: RMSNorm's six
    eager kernels move 2 x (2 + 4) + 5 x 4 + 2 x 2 = 36 bytes per element (upcast, square, mean, scale,
    downcast, weight), the loss 6 + 5 x 4 per fp32 logit (upcast; log-sum-exp's max, subtraction, exp
    and sum: model/head.py), the head's fp32 weight 4 + 2 bytes per element cast; all at 90% of
    3.35 TB/s. Backward twice the norm's, the weight's cast once (its gradient cast back to fp32),
    and the loss's own: 2 x 6 + 6 x 4 per logit (cast, subtract, exp, scale, cast back), its input
    gradient copied (2 x 2 per element) and per chunk (8 of 1,024 tokens, train.loss_chunk) the weight
    gradient's bf16 product widened as it is added into the fp32 sum, 2 + 8 bytes per weight element,
    zeroed once (4)."""
    ops = end_ops(LLAMA8, 128256, _shapes(), first=False, last=True, loss_chunk=1024)
    cast, logits, norms = 128256 * 4096 * 6, 8192 * 128256, 8192 * 4096 * 36
    expected = norms + logits * 26 + cast
    assert ops.elementwise_bytes == pytest.approx(expected)
    loss_backward = logits * 36 + 8192 * 4096 * 4 + 128256 * 4096 * (4 + 8 * 10)
    assert ops.backward_elementwise_bytes == pytest.approx(2 * norms + cast + loss_backward)
    whole = end_ops(LLAMA8, 128256, _shapes(), first=False, last=True)  # one chunk: the weight gradient summed once
    assert ops.backward_elementwise_bytes - whole.backward_elementwise_bytes == 7 * 128256 * 4096 * 10
    price = roofline.price_ops(ops, H100, 2, fp8=False)
    assert price.forward["elementwise"] == pytest.approx(expected / HBM)
    assert price.backward["elementwise"] == pytest.approx((2 * norms + cast + loss_backward) / HBM)
    fused = end_ops(LLAMA8, 128256, _shapes(fused=True), first=False, last=True)  # train.compile
    assert fused.parts["norms"] == 8192 * 4096 * 2 * 2  # one read and one write of bf16


def test_fp8_doubles_the_matmul_part_only():
    """FP8 matmuls at the FP8 dense peak (H100 data sheet: 1,979 TFLOP/s to bf16's 989); with the FP8
    fraction set to bf16's, every matmul of a Llama 3 8B block (all compute-bound) runs 1979 / 989
    times faster; attention stays bf16 and the elementwise kernels are untouched."""
    hw = dataclasses.replace(H100, fp8_matmul_efficiency=H100.matmul_efficiency)
    ops = block_ops(LLAMA8, 0, _shapes())
    bf16, fp8 = roofline.price_ops(ops, hw, 2, fp8=False), roofline.price_ops(ops, hw, 2, fp8=True)
    for phase in ("forward", "backward"):
        assert getattr(bf16, phase)["matmul"] == pytest.approx(1979 / 989 * getattr(fp8, phase)["matmul"])
        for cls in ("attention", "elementwise"):
            assert getattr(bf16, phase)[cls] == getattr(fp8, phase)[cls]


def _work(*overrides: str, options: PlanOptions = DEFAULT, world: int = 8):
    cfg = load_config(None, ["--train.seq_len=8192", "--train.global_batch=8", "--train.micro_batch=1",
                             *overrides])
    d = derive(cfg, world, unpadded_vocab(cfg))
    counts = model_counts(cfg.model, d.vocab_size)
    return busiest_chunk(cfg, d, counts, rank_shares(cfg, counts), options)


@pytest.mark.parametrize("fp8,fused,act,w_fwd,w_bwd", [("compute", False, 6, 5, 3), ("compute", True, 4, 5, 3),
                                                       ("weights", False, 6, 0, 2)])
def test_fp8_casts_are_torchaos_tensorwise_bytes(fp8, fused, act, w_fwd, w_bwd):
    """torchao's float8 roofline (testing/training/roofline_utils.py, tensorwise): an input and an output
    gradient each take an amax read (2 bytes, none fused with their producer) and a cast reading 2 and
    writing both FP8 layouts (2 x 1); a weight an amax read and a cast each way (2 + 3, then 3), or,
    gathered in FP8 already, only its transposed copy for the backward (1 + 1)."""
    plain, cast = (block_ops(LLAMA8, 0, _shapes(fused=fused, fp8=f)) for f in ("none", fp8))
    mk = sum(mm.m * mm.k for mm in plain.matmuls)  # every matmul's input, elements
    mn = sum(mm.m * mm.n for mm in plain.matmuls)  # and its output (gradient)
    kn = sum(mm.k * mm.n for mm in plain.matmuls)  # and its weight
    assert cast.parts["fp8 casts"] == act * mk + w_fwd * kn
    assert cast.elementwise_bytes - plain.elementwise_bytes == act * mk + w_fwd * kn
    assert cast.backward_elementwise_bytes - plain.backward_elementwise_bytes == act * mn + w_bwd * kn


def test_fp8_on_a_gpu_without_it_names_the_option_and_the_gpu():
    work = _work("--model.preset=llama3-8b", "--parallel.dp=8", options=PlanOptions(fp8="compute"))
    with pytest.raises(ValueError, match=r"--layout fp8=compute: a100-80gb has no FP8"):
        roofline.chunk_price(work, get_hardware("a100"), Memo())
    assert roofline.chunk_price(work, H100, Memo()).forward_s > 0


def test_expert_imbalance_scales_the_routed_experts_only():
    """Mixtral on ep = 8 ranks, 4096 tokens each: each rank's one local expert gets 4096 x 8 x 2 / 8 =
    8192 rows; the busiest rank under an imbalance of 1.5 gets 12288. In bf16 the grouped matmul runs
    them padded (ops.grouped_rows): round_up(8192, 8) + 8 x 1 = 8200 and 12288 + 8 = 12296. The
    router, attention and the rest of the block are the same; a capacity factor of 1.25 drops what
    exceeds 1.25 x the mean: 10240 rows, 10248 run."""
    base, skewed = (block_ops(MIXTRAL, 0, _shapes(4096, ep=8, imbalance=x)) for x in (1.0, 1.5))
    rows = {mm.name: mm.m for mm in base.matmuls}
    assert rows["expert gate"] == 8192 + 8 and rows["router"] == 4096 and rows["wq"] == 4096
    for a, b in zip(base.matmuls, skewed.matmuls, strict=True):
        assert b.m == (12288 + 8 if a.name.startswith("expert") else a.m)
    assert skewed.attention_flops == base.attention_flops
    for part in ("norms", "rope", "residual adds", "router", "weight casts"):
        assert skewed.parts[part] == base.parts[part]
    assert skewed.parts["expert swiglu"] == pytest.approx(12296 / 8200 * base.parts["expert swiglu"])
    capped_moe = dataclasses.replace(MIXTRAL, moe=dataclasses.replace(MIXTRAL.moe, capacity_factor=1.25))
    capped = block_ops(capped_moe, 0, _shapes(4096, ep=8, imbalance=2))
    assert {mm.name: mm.m for mm in capped.matmuls}["expert up"] == 10240 + 8
    experts = [roofline.price_ops(Ops(matmuls=tuple(mm for mm in o.matmuls if mm.name.startswith("expert"))),
                                  H100, 2, fp8=False).forward["matmul"] for o in (base, skewed)]
    assert experts[1] == pytest.approx(1.5 * experts[0], rel=0.03)  # compute-bound: time follows the rows


def test_grouped_experts_are_priced_on_their_padded_rows():
    """model/moe.py pads each local expert's rows to whole groups of 8 for torch._grouped_mm, in a buffer
    of round_up(N, 8) + 8 E_local rows (N routed rows), in bf16 only (fp32 loops, unpadded). Mixtral, ep
    = 2, 1000 tokens: 4 local experts of 1000 x 2 x 2 / 8 = 500 rows, N = 2000 -> 2000 + 32 = 2032 rows,
    508 each. The buffer is zeroed (2032 rows) and the 2000 rows read and written into it, in the
    stream's dtype (fp32 here: autocast casts each matmul's input); the loop concatenates instead. Its
    backward writes no per-expert gradients to stack (the loop's 3 x 2 x E_local x d x h fp32)."""
    from fivefold.model import moe

    assert GROUP_ROWS == moe.GROUP_ROWS  # the planner imports no torch: its own copy, held equal here
    d, h = MIXTRAL.dim, MIXTRAL.ffn_dim
    fp32_weights = dict(act_bytes=2, weight_bytes=4, residual_bytes=4)
    grouped = block_ops(MIXTRAL, 0, _shapes(1000, ep=2, **fp32_weights))
    loop = block_ops(MIXTRAL, 0, _shapes(1000, ep=2, act_bytes=4))
    assert grouped_rows(2000, 4) == 2032 and grouped_rows(2001, 4) == 2008 + 32
    assert {mm.name: (mm.m, mm.count) for mm in grouped.matmuls}["expert down"] == (508, 4)
    assert {mm.name: (mm.m, mm.count) for mm in loop.matmuls}["expert down"] == (500, 4)
    assert grouped.parts["expert swiglu"] == 2032 * h * 5 * 2  # silu and product: 3 reads, 2 writes of bf16
    # x[token_of_copy] (2000 fp32 rows read and written), the pad, the gather out and the gate weights'
    # product (bf16), the combine (new_zeros + index_add_ of 1000 tokens)
    pad = (2032 + 2 * 2000) * d * 4
    assert grouped.parts["moe dispatch"] == 2 * 2000 * d * 4 + pad + 4 * 2000 * d * 2 + (2000 + 3000) * d * 2
    # backward beyond twice the forward: RoPE's zero-filled slices (q's 32 heads and k's 8), the weights'
    # casts once (not twice), and the loop's stacked expert gradients
    rope, casts = 3 * 1000 * 40 * 128, grouped.parts["weight casts"]
    assert grouped.backward_elementwise_bytes - 2 * grouped.elementwise_bytes == pytest.approx(rope * 2 - casts)
    stacked = 3 * 2 * 4 * d * h * 4  # per weight, 4 experts' fp32 gradients written, then stacked
    assert loop.backward_elementwise_bytes - 2 * loop.elementwise_bytes == pytest.approx(rope * 4 + stacked)


@pytest.mark.parametrize("name,layer,tp", [("tiny", 0, 1), ("tiny", 0, 2), ("tiny-moe", 0, 1), ("tiny-mla", 0, 1),
                                           ("tiny-mla", 1, 1)])
def test_elementwise_bytes_follow_the_model_code(name, layer, tp):
    """ops.py's elementwise bytes against the aten ops model.Block really dispatches (a CPU trace,
    calibration/opcount.py, fp32 throughout: act_bytes = 4 removes autocast's casts): forward within
    7%, backward within 20% (its formula is 2 x forward plus the slices' and the experts' gradients);
    matmul FLOPs exact; the kernel's attention FLOPs half the trace's (the trace counts the full
    score matrix, the causal kernel computes half)."""
    m = dataclasses.replace(PRESETS[name], vocab_size=256)
    forward, backward = block_tally(m, layer, tp, 2, 32)
    ops = block_ops(m, layer, _shapes(64, 32, tp=tp, act_bytes=4))
    assert ops.elementwise_bytes == pytest.approx(sum(forward.elementwise_bytes), rel=0.07)
    assert ops.backward_elementwise_bytes == pytest.approx(sum(backward.elementwise_bytes), rel=0.2)
    assert sum(2 * mm.m * mm.n * mm.k * mm.count for mm in ops.matmuls) == pytest.approx(sum(forward.matmul_flops))
    assert ops.attention_flops == pytest.approx(sum(f for f, _ in forward.attention) / 2)


@pytest.mark.parametrize("name,layer,tp", [("tiny", 0, 1), ("tiny", 0, 2), ("tiny-moe", 0, 1), ("tiny-mla", 0, 1),
                                           ("tiny-mla", 1, 1)])
def test_elementwise_bytes_under_autocast_follow_the_model_code(name, layer, tp):
    """The same trace as training runs it in bf16: fp32 weights and an fp32 residual stream (what the
    embedding writes) under bf16 autocast, against ops.py at act_bytes 2, weight_bytes 4 and
    residual_bytes 4: forward within 13% (a dense block within 3%), backward within 20%. Matmul FLOPs
    exact, forward and backward (twice): the routed experts run torch._grouped_mm (a matmul to the trace)
    on their padded rows, round_up(N, 8) + 8 E for N = 512 x 2 copies whatever the routing: tiny-moe's
    4 experts 1024 + 32 = 4 x 264 rows, tiny-mla's 8 experts 1024 + 64 = 8 x 136."""
    m = dataclasses.replace(PRESETS[name], vocab_size=256)
    forward, backward = block_tally(m, layer, tp, 2, 256, autocast=True)
    ops = block_ops(m, layer, _shapes(512, 256, tp=tp, act_bytes=2, weight_bytes=4, residual_bytes=4))
    dense = not (m.moe.n_experts or m.latent.kv_lora_rank)
    assert ops.elementwise_bytes == pytest.approx(sum(forward.elementwise_bytes), rel=0.03 if dense else 0.13)
    assert ops.backward_elementwise_bytes == pytest.approx(sum(backward.elementwise_bytes), rel=0.2)
    assert sum(mm.flops for mm in ops.matmuls) == sum(forward.matmul_flops) == sum(backward.matmul_flops) / 2


def test_an_fp32_residual_stream_under_autocast_by_hand():
    """Llama 3 8B's block, T = 8192, fp32 weights under bf16 autocast: the stream stays fp32, so each
    of the two norms reads it without a cast (pow, mean, scale and weight over fp32: 28 bytes an
    element, not 36), each residual add reads it and the bf16 sub-layer output and writes fp32 (10),
    and the five matmuls that read the normed input each cast it (wq, wk, wv, gate, up: 4 + 2). The
    weights' casts run once in backward too (the gradient cast back), not twice; SDPA takes the
    grouped K/V heads itself, nothing is repeated."""
    T, d = 8192, 4096
    ops = block_ops(LLAMA8, 0, _shapes(act_bytes=2, weight_bytes=4, residual_bytes=4))
    assert ops.parts["norms"] == 2 * T * d * 28
    assert ops.parts["residual adds"] == 2 * T * d * 10
    assert ops.parts["input casts"] == 5 * T * d * 6
    assert "repeat k/v" not in ops.parts
    weights = ops.parts["weight casts"]
    assert weights == sum(mm.n * mm.k for mm in ops.matmuls) * 6
    rope_slices = 3 * T * 40 * 128 * 2  # RoPE's zero-filled slices in backward (q's 32 heads and k's 8)
    assert ops.backward_elementwise_bytes == pytest.approx(2 * (ops.elementwise_bytes - weights) + weights
                                                           + rope_slices)
    bf16_stream = block_ops(LLAMA8, 0, _shapes(act_bytes=2, weight_bytes=2))  # bf16 weights: no cast at all
    assert (bf16_stream.parts["norms"], bf16_stream.parts["residual adds"]) == (2 * T * d * 36, 2 * T * d * 6)
    assert "input casts" not in bf16_stream.parts and "weight casts" not in bf16_stream.parts


@pytest.mark.parametrize("chunk", [0, 16])
def test_ends_elementwise_bytes_follow_the_model_code(chunk):
    """The ends' bytes against the traced model code (calibration/opcount.py), the dispatcher's view
    of three loss ops set right: it sees logsumexp as one op reading its input (4 bytes per logit;
    its kernels, amax, subtract, exp and sum, move 20), and counts gather's and scatter_add_'s whole
    operand (4 and 8 bytes per logit; the kernels touch one element a row). The rest of backward
    differs by the final norm's backward, which the model prices as twice its forward (a larger share
    at this dim of 64 than in any real model: a vocabulary of 1,024, not 256, keeps the loss the larger
    part, as it is at 128k against 4k; measured 0.82-0.90 of the traced bytes). What chunking adds,
    the weight gradient's sum once per chunk (in fp32 inside its matmul), is exact."""
    m = dataclasses.replace(PRESETS["tiny"], vocab_size=1024)
    for tp in (1, 2):
        forward, backward = ends_tally(m, 1024, tp, 2, 32, True, True, chunk)
        ops = end_ops(m, 1024, _shapes(64, 32, tp=tp, act_bytes=4), True, True, chunk)
        logits = 64 * 1024 // tp
        assert ops.elementwise_bytes == pytest.approx(sum(forward.elementwise_bytes) + 12 * logits, rel=0.2)
        assert ops.backward_elementwise_bytes == pytest.approx(sum(backward.elementwise_bytes) - 8 * logits, rel=0.33)
        whole = ends_tally(m, 1024, tp, 2, 32, True, True)[1]
        added = end_ops(m, 1024, _shapes(64, 32, tp=tp, act_bytes=4), True, True).backward_elementwise_bytes
        assert ops.backward_elementwise_bytes - added == sum(backward.elementwise_bytes) - sum(whole.elementwise_bytes)


def test_recompute_adds_the_forward_or_the_attention_core():
    """Full recompute runs the forward again before the backward, selective only the attention core's
    forward (Korthikanti et al. 2022)."""
    prices = {rc: roofline.chunk_price(_work("--model.preset=llama3-8b", "--parallel.dp=8",
                                             f"--train.recompute={rc}"), H100, Memo())
              for rc in ("none", "selective", "full")}
    none = prices["none"]
    assert prices["full"].backward_s == pytest.approx(none.backward_s + none.forward_s)
    assert prices["selective"].backward_s - none.backward_s == pytest.approx(none.detail.forward["attention"])


def test_per_op_selective_recompute_reruns_every_other_matmul_and_the_elementwise():
    """torchtitan's op-level SAC: of wq, wk, wv, wo, gate, up, down the outputs of the odd ones are
    saved, wk, wo and up rerun, with every elementwise kernel; the attention kernel's output is saved."""
    per_op = PlanOptions(selective_ac="per_op")
    work = _work("--model.preset=llama3-8b", "--parallel.dp=8", "--train.recompute=selective", options=per_op)
    none = roofline.chunk_price(_work("--model.preset=llama3-8b", "--parallel.dp=8", options=per_op), H100, Memo())
    price = roofline.chunk_price(work, H100, Memo())
    (block, n), = roofline.block_prices(work, H100, Memo())
    assert list(block.matmul_forward) == ["wq", "wk", "wv", "wo", "gate", "up", "down"]
    rerun = block.matmul_forward["wk"] + block.matmul_forward["wo"] + block.matmul_forward["up"]
    assert price.backward_s - none.backward_s == pytest.approx(n * (rerun + block.forward["elementwise"]))
    assert per_op.not_runnable(work.cfg) == ["selective_ac=per_op: fivefold's selective recompute reruns the "
                                             "attention core"]
    # HFU counts the rerun matmuls, 2 x (d x kv + d x d + d x f) a token a block, and no attention core
    flops = estimate(work.cfg, 8, H100, options=per_op).flops
    assert flops["hardware_per_token"] - flops["model_per_token"] == 32 * 2 * (4096 * 1024 + 4096 * 4096
                                                                               + 4096 * 14336)


def test_explain_names_each_op_class_its_efficiency_and_source():
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=8192", "--train.global_batch=8",
                             "--train.micro_batch=1", "--parallel.dp=8", "--parallel.zero=3"])
    rows = {what: (arithmetic, source) for what, arithmetic, source in estimate(cfg, 8, H100).explain}
    assert "80.3%" in rows["compute: matmuls"][0] and "ml-engineering" in rows["compute: matmuls"][1]
    assert "Matrix Multiplication Background" in rows["compute: matmuls"][1]
    attention = rows["compute: attention core"]  # SDPA's kernel on an H100: cuDNN's, 529 of 989 at 8k
    assert "SDPA's kernel at 53.5%" in attention[0] and "FlashAttention-3" in attention[1] and "cuDNN" in attention[1]
    assert "90%" in rows["compute: elementwise"][0] and "STREAM" in rows["compute: elementwise"][1]
    assert "of the bf16 peak" in rows["forward per chunk"][0]


def test_default_prediction_sits_below_the_flat_sixty_percent():
    """The roofline's Llama 3 8B block on an H100: matmuls near 80% of peak, the attention core near
    a third, the elementwise kernels bound by HBM, so the chunk runs well below the old flat 60%."""
    work = _work("--model.preset=llama3-8b", "--parallel.dp=8")
    chunk = roofline.chunk_price(work, H100, Memo())
    flops = sum(chunk.detail.flops.values())
    assert 0.35 < flops / (chunk.forward_s + chunk.backward_s) / 989e12 < 0.55


def test_gpu_calibration_turns_timings_into_the_roofline_constants(tmp_path):
    """calibration/gpu.py's arithmetic on made-up timings (no GPU here): an 8192^3 matmul taking
    2 x 8192^3 / (0.7 x 989 TFLOP/s x its quantisation) gives 0.7; an attention kernel at 30% of
    peak gives 0.3; a copy at 85% of HBM 0.85; the profile reads back and prices with them."""
    from fivefold.planner.calibration.gpu import HEAD_DIM, HEADS, TOKENS, catalog_key, gpu_constants
    from fivefold.planner.hardware import load_profile, profile_toml

    q = 8192 * 8192 / (32 * 132 * 128 * 128)
    flops = TOKENS * 8192 * HEADS * 2 * HEAD_DIM
    fields = gpu_constants(H100, 8192, 2 * 8192**3 / (0.7 * 989e12 * q), None,
                           {8192: (flops / (0.3 * 989e12), 2.5 * flops / (0.25 * 989e12))}, 1e9, 1e9 / (0.85 * 3.35e12),
                           fa2={8192: (flops / (0.2 * 989e12), 2.5 * flops / (0.1 * 989e12))})
    assert fields["matmul_efficiency"] == pytest.approx(0.7)
    assert fields["attention_fwd_curve"] == ((8192.0, pytest.approx(0.3)),)
    assert fields["attention_bwd_curve"] == ((8192.0, pytest.approx(0.25)),)
    assert fields["fa2_fwd_curve"] == ((8192.0, pytest.approx(0.2)),)  # SDPA held to its flash backend
    assert fields["fa2_bwd_curve"] == ((8192.0, pytest.approx(0.1)),)
    assert fields["hbm_efficiency"] == pytest.approx(0.85) and "fp8_matmul_efficiency" not in fields
    measured = dataclasses.replace(H100, name="mine", **fields)
    path = tmp_path / "mine.toml"
    path.write_text(profile_toml(measured))
    assert load_profile(path) == measured
    work = _work("--model.preset=llama3-8b", "--parallel.dp=8")
    assert roofline.chunk_price(work, measured, Memo()).forward_s > roofline.chunk_price(work, H100, Memo()).forward_s
    assert catalog_key("NVIDIA H100 80GB HBM3") == "h100" and catalog_key("NVIDIA A100-SXM4-40GB") == "a100-40gb"
    with pytest.raises(ValueError, match="not in the planner's catalog"):
        catalog_key("NVIDIA H100 PCIe")


def test_fused_block_moves_each_chain_once():
    """--kernels fused on a Llama 3 8B block (8192 tokens, bf16, tp 1), by hand: two RMSNorms read and
    write 2 + 2 bytes per element of d = 4096; RoPE on q and k (32 + 8 heads of 128) the same (SDPA
    takes the 8 K/V heads as they are); SwiGLU reads gate and up and writes one (f = 14336); the two
    residual adds read two and write one; the weight casts are fp32 -> bf16 of every matmul weight
    (4 + 2 bytes), once in backward too. Eager adds RoPE's three zero-filled slices in backward."""
    T, d, f, hd = 8192, 4096, 14336, 128
    weights = (2 * d * d + 2 * d * 8 * hd + 3 * d * f) * 6  # wq, wo; wk, wv; gate, up, down
    expected = 2 * T * d * 4 + T * 40 * hd * 4 + 3 * T * f * 2 + 2 * 3 * T * d * 2 + weights
    fused = block_ops(LLAMA8, 0, _shapes(fused=True))
    assert fused.elementwise_bytes == pytest.approx(expected)
    assert fused.backward_elementwise_bytes == pytest.approx(2 * expected - weights)
    eager = block_ops(LLAMA8, 0, _shapes())
    assert eager.backward_elementwise_bytes - 2 * eager.elementwise_bytes == pytest.approx(3 * T * 40 * hd * 2
                                                                                           - weights)


def test_kernels_option_follows_compile_unless_stated(capsys):
    """`--kernels` defaults to train.compile's (auto); stated, it is priced and written as such: fused
    prices exactly what train.compile = true prices, eager under compile prices the eager kernels and
    switched_config writes compile = false; --explain and --json name the kernels."""
    from fivefold.cli import main
    from fivefold.planner.options import switched_config

    over = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--parallel.zero=3", "--train.global_batch=16",
            "--train.micro_batch=1"]
    eager_cfg, compiled = load_config(None, over), load_config(None, [*over, "--train.compile=true"])
    as_fused = estimate(eager_cfg, 8, H100, options=PlanOptions(kernels="fused"))
    assert as_fused.options.kernels == "fused"
    assert as_fused.step_time_s == estimate(compiled, 8, H100).step_time_s
    assert estimate(compiled, 8, H100).options.kernels == "fused"
    as_eager = estimate(compiled, 8, H100, options=PlanOptions(kernels="eager"))
    assert as_eager.step_time_s == estimate(eager_cfg, 8, H100).step_time_s > as_fused.step_time_s
    assert not switched_config(compiled, as_eager.options).train.compile
    assert switched_config(eager_cfg, as_fused.options).train.compile
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8,zero=3", "--kernels", "fused",
                      "--explain"]) == 0
    assert "kernels fused" in " ".join(capsys.readouterr().out.split())
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8,zero=3", "--json"]) == 0
    assert '"kernels": "eager"' in capsys.readouterr().out


def test_materialized_attention_against_hand_arithmetic():
    """attention_kernel = "materialized" (Megatron-LM 2021) for a GPT block of h 6144, 48 heads of 128
    at tp 8 (6 per rank), 8 sequences of 2048 on an H100: S = Q K^T and P V are batched matmuls of
    8 x 6 = 48 (2048, 2048, 128) and (2048, 128, 2048) products, all of the score matrix; each is
    max(FLOPs at the large-GEMM fraction over the batch's tiles in waves, operands and result at
    HBM speed); over its 48 x 2048^2 bf16 scores the fused softmax reads and writes 2 + 2 bytes and
    dropout 2 + 2 + a 1-byte mask forward; backward, softmax 3 x 2 and dropout 2 + 1 + 2, and each
    matmul's two gradients at their own shapes."""
    gpt = dataclasses.replace(PRESETS["llama3-8b"], dim=6144, n_heads=48, n_kv_heads=48, ffn_dim=16384)
    shapes = _shapes(tokens=8 * 2048, seq=2048, tp=8, attention="materialized")
    ops = block_ops(gpt, 0, shapes)
    assert ops.attention_flops == 0 and [mm.name for mm in ops.attention_matmuls] == ["scores", "probs x v"]
    n, S, hd = 48, 2048, 128

    def batched(m, nn, k):
        waves_q = max(n * m * nn / (math.ceil(math.ceil(n * m / tm) * math.ceil(nn / tn) / 132) * 132 * tm * tn)
                      for tm, tn in H100.matmul_tiles)
        compute = 2 * n * m * nn * k / (989e12 * H100.matmul_efficiency * waves_q)
        return max(compute, n * (m * k + k * nn + m * nn) * 2 / HBM)

    forward = batched(S, S, hd) + batched(S, hd, S) + n * S * S * 9 / HBM
    backward = (batched(S, hd, S) + batched(hd, S, S) + batched(S, S, hd) + batched(S, hd, S)
                + n * S * S * 11 / HBM)
    price = roofline.price_ops(ops, H100, 2, fp8=False)
    assert H100.sm_count == 132
    assert price.forward["attention"] == pytest.approx(forward)
    assert price.backward["attention"] == pytest.approx(backward)
    assert price.flops["attention"] == pytest.approx(3 * 2 * 2 * n * S * S * hd)  # no causal half skipped
    flash = roofline.price_ops(block_ops(gpt, 0, dataclasses.replace(shapes, attention="sdpa")), H100, 2, False)
    assert flash.forward["matmul"] == price.forward["matmul"] and flash.bytes == price.bytes
    assert PlanOptions(attention_kernel="materialized").not_runnable()  # fivefold never runs it
    assert PlanOptions(attention_kernel="fa2").not_runnable() == [
        "attention_kernel=fa2: fivefold's attention is the kernel torch's SDPA picks (model/attention.py)"]
    assert not PlanOptions().not_runnable()


def test_keep_busy_runs_batches_until_the_clock_passes_the_burn():
    """calibrate's sustained burn (calibration/gpu.py keep_busy): batches of calls, a synchronisation
    after each, until the clock has passed the seconds asked for; counted on a made-up clock."""
    from fivefold.planner.calibration.gpu import keep_busy

    ticks, calls, syncs = iter([0.0, 0.4, 0.9, 1.3]), [], []
    made = keep_busy(lambda: calls.append(1), 1.0, lambda: syncs.append(1), clock=lambda: next(ticks), batch=4)
    assert made == len(calls) == 8 and len(syncs) == 2  # at 0.4 and 0.9 still burning, at 1.3 done


def test_fp8_leaves_the_head_router_and_routed_experts_in_bf16():
    """fivefold's FP8 (parallel/fp8.py) converts the blocks' dense linears only: Mixtral's routed
    experts and router, and the head, stay at the bf16 peak and cast nothing; PlanOptions.fp8_experts
    (DeepSeek-V3's, Transformer Engine's grouped GEMMs) runs the routed experts in FP8 too."""
    hw = dataclasses.replace(H100, fp8_matmul_efficiency=H100.matmul_efficiency)
    shapes = _shapes(4096, ep=8)
    ops = {f: block_ops(MIXTRAL, 0, dataclasses.replace(shapes, fp8=f)) for f in ("none", "compute")}
    experts = block_ops(MIXTRAL, 0, dataclasses.replace(shapes, fp8="compute", fp8_experts=True))
    assert ops["none"].bf16_matmuls == frozenset()
    assert ops["compute"].bf16_matmuls == {"head", "router", "expert gate", "expert up", "expert down"}
    assert experts.bf16_matmuls == {"head", "router"}
    bf16, fp8, fp8_all = (roofline.price_ops(o, hw, 2, fp8=o is not ops["none"]) for o in (ops["none"], ops["compute"],
                                                                                            experts))
    for name, seconds in bf16.matmul_forward.items():
        dense = name not in ("router", "expert gate", "expert up", "expert down")
        assert fp8.matmul_forward[name] == pytest.approx(seconds * (989 / 1979 if dense else 1.0))
        assert fp8_all.matmul_forward[name] == pytest.approx(seconds * (989 / 1979 if name != "router" else 1.0))
    kept = sum(mm.m * mm.k for mm in ops["compute"].matmuls if mm.name in ops["compute"].bf16_matmuls)
    cast = sum(mm.m * mm.k for mm in ops["compute"].matmuls) - kept  # the converted matmuls' inputs
    weights = sum(mm.k * mm.n for mm in ops["compute"].matmuls if mm.name not in ops["compute"].bf16_matmuls)
    assert ops["compute"].parts["fp8 casts"] == 6 * cast + 5 * weights
    head = end_ops(LLAMA8, 128256, _shapes(fp8="compute"), first=False, last=True)
    assert head.bf16_matmuls >= {"head"} and "fp8 casts" not in head.parts
    assert (roofline.price_ops(head, hw, 2, fp8=True).forward["matmul"]
            == roofline.price_ops(head, hw, 2, fp8=False).forward["matmul"])
    assert PlanOptions(fp8="compute", fp8_experts=True).not_runnable() == [
        "fp8_experts=true: fivefold's FP8 leaves the routed experts in bf16 (parallel/fp8.py)"]
