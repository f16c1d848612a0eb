"""The planner's op-priced step time (calibration/opcount.py and pricer.py, calibrated profiles): the
op counts come from the model's own code and the arithmetic is what the profile says. No timing
here: the self-check's measured-vs-predicted table is a report, not a test."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.config import MoEConfig
from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.planner.calibration.opcount import Part, block_tally, ends_tally, part_tally
from fivefold.planner.calibration.pricer import MeasuredPricer, op_priced
from fivefold.planner.calibration.profile import MeasuredProfile, tally_time
from fivefold.planner.compute import busiest_chunk
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware, load_profile, profile_toml
from fivefold.planner.layout import rank_shares
from fivefold.planner.machine import roofline
from fivefold.planner.machine.datasheet import DatasheetPricer
from fivefold.planner.machine.pricing import Memo

TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=320)


def _synthetic(**over):
    """A CPU-like profile where only what the test sets costs anything (`over`: MeasuredProfile fields)."""
    return dataclasses.replace(get_hardware("h100"), peak_flops=1e30, hbm_bw=1e30, intra_latency=0.0,
                               inter_latency=0.0, intra_bw=1e30, inter_bw=1e30,
                               pricer=MeasuredPricer(MeasuredProfile(**over)))


def _measured(hw, **over):
    """`hw` with some of its measured figures replaced."""
    return dataclasses.replace(hw, pricer=MeasuredPricer(dataclasses.replace(hw.pricer.profile, **over)))


def test_block_op_count_is_stable_positive_and_matches_the_matmul_flops():
    part = Part("block", TINY, 0, 0, 1, 2, 32)
    fwd, bwd = part_tally(part)  # traced twice (nothing is cached between calls)
    again = part_tally(part)
    assert (fwd.ops, fwd.views, bwd.ops, bwd.views) == (again[0].ops, again[0].views, again[1].ops, again[1].views)
    assert fwd.ops > 0 and bwd.ops > fwd.ops  # backward runs more ops than forward
    tokens = 2 * 32
    matmul_params = model_counts(TINY).blocks[0].tp_split  # wq wk wv wo gate up down
    assert len(fwd.matmul_flops) == 7
    assert sum(fwd.matmul_flops) == 2 * tokens * matmul_params
    assert sum(bwd.matmul_flops) == 4 * tokens * matmul_params  # input and weight gradients
    assert fwd.params == 9  # 7 matrices, 2 norms
    assert len(fwd.attention) == 1 and len(bwd.attention) == 1


def test_tensor_parallel_block_halves_the_matmuls_not_the_op_count():
    (f1, _), (f2, _) = block_tally(TINY, 0, 1, 2, 32), block_tally(TINY, 0, 2, 2, 32)
    assert sum(f2.matmul_flops) == sum(f1.matmul_flops) / 2
    assert f2.ops == f1.ops


def test_tally_time_is_the_profile_arithmetic():
    fwd, _ = block_tally(TINY, 0, 1, 2, 32)
    hw = _synthetic(op_overhead_s=1e-5, view_overhead_s=2e-6)
    t = tally_time(fwd, hw.pricer.profile, hw)
    assert t["total"] == pytest.approx(fwd.ops * 1e-5 + fwd.views * 2e-6)
    curve = ((1.0, 1e9), (1e12, 1e9))  # 1 GFLOP/s at every size
    t = tally_time(fwd, MeasuredProfile(matmul_curve=curve), hw)
    assert t["matmul"] == pytest.approx(sum(fwd.matmul_flops) / 1e9)


def test_estimate_prices_every_op_and_the_optimizer_from_the_profile(tmp_path):
    cfg = tiny_config(tmp_path)  # global batch 8, micro-batch 2: 4 micro-batches on one rank
    hw = _synthetic(op_overhead_s=1e-5, optimizer_s_per_tensor=1e-3, optimizer_s_per_element=1e-9)
    est = estimate(cfg, 1, hw, act_bytes=4, implementation=True)
    share = rank_shares(cfg, model_counts(cfg.model, 320))[0]
    ops = 0
    for blk in share.blocks:
        f, b = block_tally(cfg.model, blk, 1, 2, 32)
        ops += f.ops + b.ops
    f, b = ends_tally(cfg.model, est_vocab(cfg), 1, 2, 32, True, True)
    ops += f.ops + b.ops
    assert est.time_split["compute"] == pytest.approx(4 * ops * 1e-5)
    tensors = len(share.blocks) * 9 + 3  # blocks, embedding, final norm, head
    assert est.time_split["optimizer"] == pytest.approx(tensors * 1e-3 + share.params * 1e-9)
    # and the one op the trace does not see: micro-batches 2..4 add their gradients into .grad
    assert est.time_split["host"] == pytest.approx(3 * tensors * 1e-5)
    # (terms.simulate_scaled rounds the backward-to-forward ratio to 1e-4: a bubble of that order)
    assert est.step_time_s == pytest.approx(est.time_split["compute"] + est.time_split["optimizer"]
                                            + est.time_split["host"], rel=1e-4)


def test_parts_timed_whole_replace_their_op_prices(tmp_path):
    """A profile's layer_times (calibrate --layers) price the parts they name; the rest stay op-priced."""
    cfg = tiny_config(tmp_path, "--train.recompute=full")
    vocab = est_vocab(cfg)
    hw = _synthetic(op_overhead_s=1e-5)
    block = Part("block", cfg.model, 0, 0, 1, 2, 32)
    timed = _measured(hw, layer_times=((block.key, 1e-3, 2e-3),))
    est = estimate(cfg, 1, timed, act_bytes=4, implementation=True)
    f, b = ends_tally(cfg.model, vocab, 1, 2, 32, True, True)
    ends = (2 * f.ops + b.ops) * 1e-5  # full recompute: their forward again
    blocks = 8 * (1e-3 + 2e-3 + 1e-3)  # forward, backward, the forward recomputed
    assert est.time_split["compute"] == pytest.approx(4 * (blocks + ends))
    assert any("8 of 10 parts timed whole" in arithmetic for _, arithmetic, _ in est.explain)
    # a profile timing another shape (micro-batch 4) prices every op as before
    other = Part("block", cfg.model, 0, 0, 1, 4, 32)
    assert estimate(cfg, 1, _measured(hw, layer_times=((other.key, 1.0, 1.0),)), act_bytes=4,
                    implementation=True).time_split == estimate(cfg, 1, hw, act_bytes=4, implementation=True).time_split


def test_part_keys_name_what_a_part_costs_depend_on():
    tp2 = Part("block", TINY, 0, 0, 2, 2, 32)
    assert tp2.key == "block dim=64 heads=2/2 head_dim=16 ffn=64 batch=2 seq=32"
    assert Part("head", TINY, 0, 320, 2, 2, 32).key == "head vocab=160 dim=64 tp=2 batch=2 seq=32"
    moe = dataclasses.replace(TINY, moe=MoEConfig(n_experts=4, top_k=2, ffn_dim=64, first_dense_layers=1))
    assert Part("block", moe, 0, 0, 1, 2, 32).key == Part("block", TINY, 0, 0, 1, 2, 32).key  # a dense first block
    assert "experts=4x64 top_k=2" in Part("block", moe, 1, 0, 1, 2, 32).key


def est_vocab(cfg):
    return derive(cfg, 1, unpadded_vocab(cfg)).vocab_size


def test_catalog_gpu_keeps_its_data_sheet_price(tmp_path):
    """A catalog GPU is priced from its data sheet and published kernel measurements (the roofline,
    roofline.py), never from traced ops; hardware without an SM count keeps the flat FLOP price."""
    cfg = tiny_config(tmp_path)
    d = derive(cfg, 1, unpadded_vocab(cfg))
    counts = model_counts(cfg.model, d.vocab_size)
    work = busiest_chunk(cfg, d, counts, rank_shares(cfg, counts), weight_bytes=2)  # the textbook's bf16 weights
    h100 = get_hardware("h100")
    assert isinstance(h100.pricer, DatasheetPricer)  # the catalog prices from its data sheets
    assert op_priced(MeasuredProfile(), work, h100, Memo()) is None  # a profile with no per-op cost: FLOPs
    est = estimate(cfg, 1, h100)
    chunk = roofline.chunk_price(work, h100, Memo())
    assert est.time_split["compute"] == pytest.approx(4 * (chunk.forward_s + chunk.backward_s))  # 4 micro-batches
    assert not any(what == "forward per chunk (ops)" for what, _, _ in est.explain)
    flat = dataclasses.replace(h100, sm_count=0)
    eff = flat.peak_flops * flat.compute_efficiency
    # F + 2F, and the head's matmul once more: the loss's backward makes the logits again (model/head.py)
    assert work.loss_recompute_flops == 2 * 320 * cfg.model.dim * 64
    assert estimate(cfg, 1, flat).time_split["compute"] == pytest.approx(
        4 * (3 * work.forward_flops + work.loss_recompute_flops) / eff)


def test_profile_round_trip_with_measured_fields(tmp_path):
    hw = _synthetic(threads=1, op_overhead_s=1e-5, view_overhead_s=3e-6, matmul_curve=((8192.0, 2e9), (5e5, 4e10)),
                    elementwise_curve=((32768.0, 3e10),), optimizer_s_per_tensor=1e-4, optimizer_s_per_element=7e-9)
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(hw))
    back = load_profile(path)
    for f in ("threads", "op_overhead_s", "view_overhead_s", "matmul_curve", "elementwise_curve",
              "optimizer_s_per_tensor", "optimizer_s_per_element"):
        assert getattr(back.pricer.profile, f) == getattr(hw.pricer.profile, f), f
    # a profile without them (written before they existed) still loads, with the GPU defaults
    old = "\n".join(line for line in profile_toml(hw).splitlines() if not line.startswith(
        ("threads", "op_", "view_", "matmul_curve", "elementwise_curve", "optimizer_s")))
    path.write_text(old)
    measured = load_profile(path).pricer.profile
    assert measured.op_overhead_s == 0.0 and measured.matmul_curve == ()
    # a profile without any measured key (a GPU's, by hand) is priced from its figures, like the catalog
    path.write_text(profile_toml(get_hardware("h100")))
    assert load_profile(path) == get_hardware("h100")
