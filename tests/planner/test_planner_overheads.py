"""The planner's Python-side step costs (calibration/overheads.py), per-collective latencies (comm.py)
and the profile arithmetic of `fivefold calibrate`: counts from the layout times profile figures,
nothing timed here (the measured-vs-predicted table is benchmarks/planner_selfcheck.py's report)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from helpers import tiny_config

from fivefold.model.presets import PRESETS
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.planner.calibration.collectives import alpha_per_op
from fivefold.planner.calibration.measure import _median_of
from fivefold.planner.calibration.noise import expected_max_normal
from fivefold.planner.calibration.opcount import block_tally, ends_tally
from fivefold.planner.calibration.overheads import host_costs
from fivefold.planner.calibration.pricer import MeasuredPricer
from fivefold.planner.calibration.profile import MeasuredProfile
from fivefold.planner.comm import AxisTraffic, activation_traffic, loss_gathers, time_of
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware, load_profile, profile_toml

TINY = dataclasses.replace(PRESETS["tiny"], vocab_size=320)


def _synthetic(collective_alpha=(), **over):
    """A CPU-like profile where only what the test sets costs anything (`over`: MeasuredProfile fields)."""
    return dataclasses.replace(get_hardware("h100"), peak_flops=1e30, hbm_bw=1e30, intra_latency=0.0,
                               inter_latency=0.0, intra_bw=1e30, inter_bw=1e30, collective_alpha=collective_alpha,
                               pricer=MeasuredPricer(MeasuredProfile(**over)))


def _measured(hw, **over):
    """`hw` with some of its measured figures replaced."""
    return dataclasses.replace(hw, pricer=MeasuredPricer(dataclasses.replace(hw.pricer.profile, **over)))


def test_traces_count_module_calls_and_python_functions():
    fwd, _ = block_tally(TINY, 0, 1, 2, 32)
    assert fwd.modules == 12  # the block, 2 norms, attention + 4 linears, the MLP + 3 linears
    assert fwd.functions == 0
    fwd, _ = ends_tally(TINY, 320, 1, 2, 32, True, True)
    assert fwd.modules == 3  # embedding, final norm, head
    assert fwd.functions == 1  # the chunked loss (model/head.py ChunkedCrossEntropy), one Function at any tp
    fwd, _ = ends_tally(TINY, 320, 2, 2, 32, True, True)
    assert fwd.functions == 1  # the same Function, its gather over tp inside it


def test_host_costs_are_counts_times_profile_figures(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.pp=2")
    hw = _synthetic(module_call_s=1e-6, function_s=2e-6, hook_s=3e-6, tensor_query_s=4e-6, thread_s=5e-4)
    counts = dict(modules=10, functions=2, tensors=7, rank_tensors=9, rank_params=1000, micro=4, chunks=1,
                  tp_calls=8, grad_bytes=4000, dp_ranks=1)
    h = host_costs(cfg, hw.pricer.profile, hw, **counts)
    assert h.forward_s == pytest.approx(10 * 1e-6 + (2 + 8 / 4) * 2e-6 / 2)
    # model-state sampling: after 2 of the 4 backwards (a chunk's first and last)
    assert h.backward_s == pytest.approx((2 + 8 / 4) * 2e-6 / 2 + 7 * 3e-6 + 9 * 4e-6 * 2 / 4)
    assert h.step_s == pytest.approx(5e-4)
    assert {w for w, _, _ in h.explain} == {"module calls", "autograd Functions", "gradient hooks",
                                            "model-state sampling", "send thread"}
    assert host_costs(tiny_config(tmp_path), hw.pricer.profile, hw, **counts).step_s == 0  # pp = 1: no thread


def test_gradient_accumulation_and_bucket_packing_are_priced_as_ops(tmp_path):
    cfg = tiny_config(tmp_path)
    curve = ((1.0, 1e9), (1e12, 1e9))  # 1 GB/s at every size
    hw = _synthetic(op_overhead_s=1e-5, view_overhead_s=1e-6, elementwise_curve=curve)
    h = host_costs(cfg, hw.pricer.profile, hw, modules=0, functions=0, tensors=10, rank_tensors=10, rank_params=1000,
                   micro=4, chunks=1, tp_calls=0, grad_bytes=4000, dp_ranks=2)
    per_add = 1e-5 + 3 * 400 / 1e9  # one 100-element fp32 gradient added in place
    assert h.backward_s == pytest.approx(3 / 4 * 10 * per_add)
    assert h.step_s == pytest.approx((1 + 10) * 1e-5 + 20 * 1e-6 + 4 * 4000 / 1e9)  # cat + copies back
    alone = host_costs(cfg, hw.pricer.profile, hw, modules=0, functions=0, tensors=10, rank_tensors=10,
                       rank_params=1000, micro=1, chunks=1, tp_calls=0, grad_bytes=4000, dp_ranks=1)
    assert alone.backward_s == 0 and alone.step_s == 0  # one micro-batch, one rank: nothing to add or pack


def test_estimate_adds_the_host_terms_to_the_pipeline_and_the_step(tmp_path):
    cfg = tiny_config(tmp_path, "--parallel.pp=2")
    hw = _synthetic(op_overhead_s=1e-5, module_call_s=1e-6, hook_s=2e-6, thread_s=1e-3)
    est = estimate(cfg, 2, hw, act_bytes=4, implementation=True)
    split = est.time_split
    assert split["host"] > 1e-3
    assert sum(split.values()) == pytest.approx(est.step_time_s)
    bare = estimate(cfg, 2, _measured(hw, module_call_s=0.0, hook_s=0.0, thread_s=0.0), act_bytes=4,
                    implementation=True)
    assert est.step_time_s > bare.step_time_s + 1e-3  # the thread, and the rest inside the pipeline


def test_per_collective_latency_prices_each_op_at_its_own_alpha():
    t = AxisTraffic()
    t.add("all_reduce", 1000, 2, count=3)  # 2 steps each
    t.add("send", 1000, 2, count=5)  # 1 step each
    hw = dataclasses.replace(_synthetic(), intra_latency=1.0, collective_alpha=(("all_reduce", 1e-3), ("send", 1e-4)))
    assert time_of(t, hw) == pytest.approx(6 * 1e-3 + 5 * 1e-4)
    assert time_of(t, dataclasses.replace(hw, collective_alpha=())) == pytest.approx(11 * 1.0)  # one alpha for all


def test_tensor_parallel_traffic_counts_the_loss_gathers(tmp_path):
    """The vocabulary-parallel loss: one all-gather per chunk of (2, c) fp32 values per rank, counted
    by its output, (tp, 2, c): here one chunk of the micro-batch's 2 x 32 tokens (loss_chunk 1024)."""
    cfg = tiny_config(tmp_path, "--parallel.tp=2")
    assert loss_gathers(cfg, 32) == [(2 * 2 * 64 * 4, 1)]
    tp = activation_traffic(cfg, 8, 0, True, True, 32, 4, 4, 0)["tp"]
    per_micro = 4 * 8 + 2 + 1
    assert tp.calls == 4 * per_micro
    act = 2 * 32 * 64 * 4
    assert tp.bytes == pytest.approx(4 * ((4 * 8 + 2) * wire_bytes("all_reduce", act, 2)
                                          + wire_bytes("all_gather", 2 * 2 * 64 * 4, 2)))


@pytest.mark.parametrize("chunk,mtp,expected", [
    (0, 0, [(2 * 2 * 64 * 4, 1)]),  # the whole micro-batch: one gather
    (16, 0, [(2 * 2 * 16 * 4, 4)]),  # 64 tokens in 4 chunks
    (24, 0, [(2 * 2 * 24 * 4, 2), (2 * 2 * 16 * 4, 1)]),  # the last chunk shorter
    (48, 1, [(2 * 2 * 48 * 4, 2), (2 * 2 * 32 * 4, 1)]),  # an MTP depth doubles the head's tokens: 128
])
def test_loss_gathers_follow_the_chunks(tmp_path, chunk, mtp, expected):
    cfg = tiny_config(tmp_path, "--parallel.tp=2", f"--train.loss_chunk={chunk}", f"--model.mtp_layers={mtp}")
    assert loss_gathers(cfg, 32) == expected
    assert loss_gathers(tiny_config(tmp_path, f"--train.loss_chunk={chunk}"), 32) == []  # tp = 1: no collective


@pytest.mark.parametrize("sp", [False, True])
def test_moe_blocks_are_one_tp_region_and_sp_routes_a_tp_rank_s_tokens(tmp_path, sp):
    # Measured on tiny-moe, 8 blocks, tp 2, one step of 8 x 32 tokens: tp 1,182,728 wire bytes
    # without sp (this formula: 1,182,720; counting two regions per block gave 2,231,296), 2,768,136
    # with sp (2,767,872: the norms' gradient sums are left out).
    cfg = tiny_config(tmp_path, "--model.preset=tiny-moe", "--parallel.tp=2", f"--parallel.sp={str(sp).lower()}",
                      "--parallel.ep=2")
    out = activation_traffic(cfg, 8, 8, True, True, 32, 4, 4, 0)
    assert out["tp"].calls == 4 * (2 * 8 + 2 + 1)  # attention only: experts are not tp-split; the loss's gather
    copies = 2 * 32 * cfg.model.moe.top_k * cfg.model.dim * 4 / (2 if sp else 1)  # with sp each tp rank its own half
    assert out["ep"].bytes == pytest.approx(4 * 8 * 4 * wire_bytes("all_to_all", copies, 2))


def test_alpha_per_op_is_the_smallest_size_less_its_wire_time():
    rows = [("all_reduce", 1000, 0.004), ("all_reduce", 10**6, 0.1), ("send", 1000, 0.0011)]
    beta = 1e6
    got = dict(alpha_per_op(rows, 2, beta))
    assert got["all_reduce"] == pytest.approx((0.004 - wire_bytes("all_reduce", 1000, 2) / beta) / 2)
    assert got["send"] == pytest.approx(0.0011 - 1000 / beta)


def test_sessions_merge_by_median_field_by_field():
    a = {"x": 1.0, "curve": {1.0: 10.0, 2.0: 20.0}, "t": (1.0, 5.0), "d": {("send", 4): 1.0}}
    b = {"x": 3.0, "curve": {1.0: 30.0, 2.0: 40.0}, "t": (3.0, 7.0), "d": {("send", 4): 2.0}}
    c = {"x": 2.0, "curve": {2.0: 30.0}, "t": (2.0, 6.0), "d": {("send", 4): 9.0}}  # a point missing
    assert _median_of([a, b, c]) == {"x": 2.0, "curve": {1.0: 20.0, 2.0: 30.0}, "t": (2.0, 6.0),
                                     "d": {("send", 4): 2.0}}


def test_profile_round_trip_with_the_python_costs_and_per_op_alpha(tmp_path):
    hw = _synthetic(op_overhead_s=1e-5, module_call_s=2e-6, function_s=1e-5, hook_s=5e-7, tensor_query_s=3e-6,
                    thread_s=4e-4, collective_alpha=(("all_reduce", 5e-4), ("send", 2e-4)),
                    noise_curve=((1e-3, 1e-4), (0.256, 2e-2)),
                    layer_times=(("block dim=64 heads=4/4 head_dim=16 ffn=128 batch=2 seq=32", 1e-3, 2e-3),
                                 ("head vocab=320 dim=64 tp=1 batch=2 seq=32", 3e-4, 4e-4)))
    path = tmp_path / "p.toml"
    path.write_text(profile_toml(hw))
    assert load_profile(path) == hw


def test_expected_maximum_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)  # E|X - Y| / 2
    assert expected_max_normal(4) == pytest.approx(1.0294, abs=1e-4)  # tables of normal order statistics
    assert expected_max_normal(64) == pytest.approx(2.3437, abs=1e-3)


@pytest.mark.parametrize("layout,waits", [
    (("--parallel.dp=2",), "dp"),  # DDP: once a step, after the whole step's compute
    (("--parallel.tp=2",), "tp"),  # at every tensor-parallel collective
])
def test_each_collective_waits_for_the_slowest_rank(tmp_path, layout, waits):
    """With a measured noise scale sigma(d), a collective of n ranks after d seconds of compute waits
    E[max of n normals] x sigma(d): a constant sigma makes the added time exact."""
    cfg = tiny_config(tmp_path, *layout)
    quiet = dataclasses.replace(_synthetic(op_overhead_s=1e-5), intra_latency=1e-4)
    noisy = _measured(quiet, noise_curve=((1e-6, 2e-4), (10.0, 2e-4)))
    a, b = (estimate(cfg, 2, hw, act_bytes=4, implementation=True) for hw in (quiet, noisy))
    syncs = 1 if waits == "dp" else a.comm["tp"].calls
    key = "dp_exposed" if waits == "dp" else "tp_cp_ep"
    assert b.time_split[key] - a.time_split[key] == pytest.approx(syncs * expected_max_normal(2) * 2e-4)
    # the step: the same, up to the pipeline simulation's cache rounding its cost ratios to 1e-4
    assert b.step_time_s - a.step_time_s == pytest.approx(syncs * expected_max_normal(2) * 2e-4, rel=1e-3)
