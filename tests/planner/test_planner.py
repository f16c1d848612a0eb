"""The planner against numbers worked by hand (ZeRO's model-state accounting, ring all-reduce bytes,
the 1F1B bubble), the model's own parameter count, validate(), and its JSON / CLI contract. Pure
Python: no process group, no tensor allocated."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.cli import main
from fivefold.config.load import load_config, replace
from fivefold.model.counts import count_on_meta, model_counts
from fivefold.model.presets import PRESETS
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.planner.comm import dp_traffic
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import CATALOG, GB, get_hardware
from fivefold.planner.memory import BytesPerParam, largest_fitting_model, model_state_bytes
from fivefold.validate import validate

ANCHOR = 27_781_427_952  # a 27.8B-parameter model, the worked example of the tests below
TWELVE = BytesPerParam(2, 2, 8)  # 12 bytes per parameter: bf16 weight and gradient, two fp32 Adam moments


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_the_meta_device_model(name):
    m = PRESETS[name]
    vocab = m.vocab_size or 320
    assert model_counts(m, vocab).total == count_on_meta(m, vocab)


def test_does_it_fit_table_at_twelve_bytes_per_parameter():
    # 8 x A100-80G: 80 GB / 12 = 6.67B (DDP), / (2 + 2 + 8/8) = 16B, / (2 + 10/8) = 24.6B, / (12/8) = 53.3B
    mem = get_hardware("a100-80gb").memory_bytes
    got = [round(largest_fitting_model(mem, TWELVE, zero, 8) / 1e9, 2) for zero in range(4)]
    assert got == [6.67, 16.0, 24.62, 53.33]


def test_anchor_model_state_and_zero_stages():
    b = BytesPerParam()  # 2,2,12 = 16 bytes
    totals = [model_state_bytes(ANCHOR, b, zero, 8)["total"] / GB for zero in range(4)]
    # 16, 2 + 2 + 12/8, 2 + 14/8 and 16/8 bytes per parameter (Rajbhandari et al. 2020, Figure 1)
    assert [round(x, 1) for x in totals] == [444.5, 152.8, 104.2, 55.6]


def test_ring_all_reduce_traffic_and_zero3_ratio():
    grads = ANCHOR * 2  # bf16 gradients
    assert round(dp_traffic(0, 8, grads, grads, 1).bytes / GB, 1) == 97.2  # 2(N-1)/N x 55.6 GB at N = 8
    assert round(dp_traffic(0, 64, grads, grads, 1).bytes / GB, 1) == 109.4  # N = 64
    assert dp_traffic(0, 8, grads, grads, 1).bytes == wire_bytes("all_reduce", grads, 8)
    ddp, z1 = dp_traffic(0, 8, grads, grads, 1).bytes, dp_traffic(1, 8, grads, grads, 1).bytes
    z3 = dp_traffic(3, 8, grads, grads, 1).bytes
    assert z1 == pytest.approx(ddp) and z3 == pytest.approx(1.5 * ddp)  # ZeRO sec. 7: 3 x vs 2 x the parameters


def test_hsdp_reduces_its_shards_inside_a_node_and_all_reduces_them_across_nodes():
    """16 GPUs, 2 nodes: ZeRO-3 over the 8 GPUs of a node, replicated across the 2 (dp_replicate).
    The reduce-scatters and gathers stay on NVLink, one reduction per micro-batch; once a step, at
    the last, the node's shard of the gradients, G / 8, is all-reduced over the 2 replicas, across
    nodes, bucket by bucket behind the backward (parallel/data/zero.py): only the last bucket is exposed."""
    cfg = load_config(None, ["--model.preset=llama3-8b", "--parallel.dp=16", "--parallel.dp_replicate=2",
                             "--parallel.zero=3", "--train.global_batch=32", "--train.micro_batch=1",
                             "--train.seq_len=4096"])
    assert validate(cfg, 16) == []
    hw = get_hardware("h100")
    est = estimate(cfg, 16, hw)
    counts = model_counts(cfg.model, cfg.model.vocab_size)
    grads = counts.total * 2  # bf16 gradients
    head = (counts.head + counts.final_norm) * 2  # gathered for its forward only (parallel/data/fsdp.py)
    replicas = wire_bytes("all_reduce", grads / 8, 2)  # once, for M = 32 / 16 = 2 micro-batches
    flat = estimate(replace(cfg, parallel={"dp_replicate": 1}), 16, hw)  # ZeRO-3 over all 16
    shards = dp_traffic(3, 8, grads, grads, 2, kept_bytes=head)
    assert est.comm["dp"].bytes == pytest.approx(shards.bytes + replicas, rel=1e-6)
    rows = rows_of(est)
    assert "inside a node" in rows["dp traffic"] and "across nodes" in rows["dp traffic, replicas over dp_replicate"]
    replica_s = est.comm["dp"].merged["replicas over dp_replicate"].time_s

    def replicas_exposed(e):  # what ZeRO-3's gathers and reduce-scatters leave exposed is their own row
        return e.exposed_dp_s - e.overlaps["zero3_prefetch"].exposed_s

    assert replica_s > 0 and 0 < replicas_exposed(est) < 0.01 * replica_s
    serial = estimate(replace(cfg, parallel={"overlap_comm": False}), 16, hw)  # buckets after the backward
    assert replicas_exposed(serial) == pytest.approx(replica_s, rel=1e-6)
    assert "across nodes" in rows_of(flat)["dp traffic"]  # the flat layout gathers over the network


def rows_of(est):
    return {name: text for name, text, _ in est.explain}


def _ideal(hw_name="h100"):
    """Links of infinite speed: what is left of the bubble is the schedule's own."""
    return dataclasses.replace(get_hardware(hw_name), intra_bw=1e30, inter_bw=1e30, intra_latency=0.0,
                               inter_latency=0.0)


def test_1f1b_bubble_from_the_simulator():
    cfg = load_config(None, ["--model.preset=llama3-8b", "--parallel.pp=8", "--parallel.dp=1",
                             "--train.global_batch=32", "--train.micro_batch=1", "--train.seq_len=4096"])
    assert validate(cfg, 8) == []
    est = estimate(cfg, 8, _ideal())
    # (p-1)/m = 7/32 and (p-1)/(m+p-1) = 7/39 (Narayanan et al. 2021)
    assert round(est.bubble_ratio, 3) == 0.219 and round(est.bubble_fraction, 3) == 0.179


def test_estimate_json_has_exactly_the_issue_keys(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "4096", "--global-batch", "64",
               "--layout", "dp=4,tp=2,sp=true,zero=1,recompute=selective,micro_batch=1", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"memory_gb", "comm_bytes_per_step", "bubble", "step_time_s", "tokens_per_s_per_gpu", "mfu",
                        "hfu", "flops", "fits", "kernels", "conventions", "host_memory_gb", "runnable", "not_runnable"}
    assert set(out["flops"]) == {"model_per_token", "hardware_per_token", "model_per_step", "hardware_per_step"}
    assert out["hfu"] > out["mfu"]  # selective recompute runs the attention core's forward again
    assert out["runnable"] and out["not_runnable"] == [] and out["host_memory_gb"] == 0
    assert set(out["memory_gb"]) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    assert set(out["comm_bytes_per_step"]) == {"dp", "tp", "pp", "cp", "ep"}
    assert set(out["bubble"]) == {"ratio", "fraction"}
    assert out["comm_bytes_per_step"]["tp"] > 0 and 0 < out["mfu"] < 1


def test_params_table_through_the_cli(capsys):
    assert main(["plan", "--params", "7.5e9", "--gpus", "8", "--gpu", "a100-80gb", "--bytes", "2,2,8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert not out["DDP"]["fits"] and out["ZeRO-1"]["fits"]  # 7.5B > 6.67B, < 16B
    assert out["DDP"]["total"] == pytest.approx(90.0)


def test_explain_names_a_source_for_every_number(capsys):
    main(["plan", "--model", "llama3-8b", "--gpus", "16", "--gpu", "h100", "--seq", "4096", "--global-batch", "64",
          "--layout", "dp=2,tp=8,pp=1,zero=1,sp=true", "--explain"])
    out = capsys.readouterr().out
    assert out.count("source:") >= 8 and "Rajbhandari" in out and "simulate" in out


def test_catalog_has_sources_for_every_number():
    assert {"a100-40gb", "a100-80gb", "h100", "h200", "b200", "mi300x"} <= set(CATALOG)
    for hw in CATALOG.values():
        for f in ("peak_flops", "memory_bytes", "intra_bw", "inter_bw", "compute_efficiency", "bw_efficiency",
                  "sm_count", "matmul_tiles", "matmul_efficiency", "fp8_peak_flops", "fp8_matmul_efficiency",
                  "attention_fwd_curve", "attention_bwd_curve", "hbm_efficiency",  # the roofline's too
                  "comm_sms"):
            assert hw.sources.get(f), (hw.name, f)


def test_axes_inside_or_across_nodes():
    cfg = load_config(None, ["--model.preset=llama3-70b", "--parallel.tp=8", "--parallel.pp=4", "--parallel.dp=2",
                             "--train.seq_len=4096", "--train.global_batch=64", "--train.micro_batch=1"])
    est = estimate(cfg, 64, get_hardware("h100"))
    assert not est.comm["tp"].inter_node and est.comm["dp"].inter_node and est.comm["pp"].inter_node
    # tp traffic: 4 all-reduces per block and micro-batch of (b, s, d) bf16, each 2(t-1)/t on the wire: 8 b s h (t-1)/t;
    # the busiest rank holds the head (one more) and the vocabulary-parallel loss: 4 chunks of 1,024
    # tokens (train.loss_chunk), each one all-gather of (tp, 2, 1024) fp32
    per_block = 4 * wire_bytes("all_reduce", 1 * 4096 * 8192 * 2, 8)
    micro, blocks = 64 // 2, 80 // 4
    ends = wire_bytes("all_reduce", 4096 * 8192 * 2, 8) + 4 * wire_bytes("all_gather", 8 * 2 * 1024 * 4, 8)
    assert est.comm["tp"].bytes == pytest.approx(micro * (blocks * per_block + ends))


def test_a_group_over_whole_nodes_runs_one_ring_per_member_of_a_node():
    """ZeRO-1 over 16 H100s, two nodes of 8: NCCL's rings each leave a node through another rank's NIC,
    so 8 rings carry 1/8 of the bytes each: the NIC part at 8 x 50 GB/s, NVLink's 7/8 at 450 GB/s,
    bytes / min(400, 450 x 8/7) GB/s after the links' 80%. Under tp = 8 a dp group has one rank a
    node: its own NIC, 50 GB/s."""
    h100 = get_hardware("h100")
    base = ["--model.preset=llama3-8b", "--train.seq_len=4096", "--train.global_batch=16", "--train.micro_batch=1",
            "--parallel.zero=1"]
    wide = estimate(load_config(None, [*base, "--parallel.dp=16"]), 16, h100)
    narrow = estimate(load_config(None, [*base, "--parallel.dp=2", "--parallel.tp=8"]), 16, h100)
    for est, ranks, bw in ((wide, 8, 400e9 * 0.8), (narrow, 1, 50e9 * 0.8)):
        dp = est.comm["dp"]
        assert dp.inter_node and dp.ranks_per_node == ranks
        latency = sum(steps * h100.inter_latency for steps in dp.op_steps.values())
        assert dp.time_s == pytest.approx(latency + dp.bytes / bw)
    assert "8 rings at once" in dict((w, a) for w, a, _ in wide.explain)["dp traffic"]


# Layouts at the scale these models were trained at (the Llama 3 and DeepSeek-V3 reports publish
# theirs: TP 8 / PP 16 / DP 128, and ZeRO-1 / EP 64 / PP 16); sequence lengths and batch sizes as
# the reports give them where they do; GPUs the closest catalog entry (H100 for H800 and TPU).
RECIPES = {
    "Llama 3 405B (DP=128, TP=8, PP=16)": ("llama3-405b", 16384,
        ["--parallel.dp=128", "--parallel.tp=8", "--parallel.pp=16", "--parallel.sp=true", "--train.seq_len=8192",
         "--train.global_batch=2048", "--train.micro_batch=1", "--parallel.pp_schedule=\"interleaved_1f1b\"",
         "--parallel.virtual_stages=2", "--parallel.zero=1"]),
    "DeepSeek-V3 (ZeRO-1, TP=1, EP=64, PP=16)": ("deepseek-v3", 2048,
        ["--parallel.dp=128", "--parallel.ep=64", "--parallel.pp=16", "--parallel.zero=1", "--train.seq_len=4096",
         "--train.global_batch=15360", "--train.micro_batch=1", "--parallel.pp_schedule=\"dualpipe_v\"",
         "--parallel.virtual_stages=2", "--model.n_layers=64"]),
    "Mixtral 8x22B (TP/PP/CP/EP = 4/4/1/8)": ("mixtral-8x22b", 128,
        ["--parallel.dp=8", "--parallel.tp=4", "--parallel.pp=4", "--parallel.ep=8", "--train.seq_len=4096",
         "--train.global_batch=512", "--train.micro_batch=1", "--train.recompute=\"full\""]),
    "Qwen 3 (EP=32, TP=2, PP=8)": ("qwen3-235b-a22b", 512,
        ["--parallel.dp=32", "--parallel.tp=2", "--parallel.pp=8", "--parallel.ep=32", "--train.seq_len=4096",
         "--train.global_batch=1024", "--train.micro_batch=1", "--train.recompute=\"full\""]),
    "Gemma 2 27B shape (ZeRO-3, TP+SP, DP=768)": ("", 6144,
        ["--model.dim=4608", "--model.n_layers=46", "--model.n_heads=32", "--model.n_kv_heads=16",
         "--model.head_dim=128", "--model.ffn_dim=36864", "--model.vocab_size=256000", "--parallel.dp=768",
         "--parallel.tp=8", "--parallel.sp=true", "--parallel.zero=3", "--train.seq_len=8192",
         "--train.global_batch=1536", "--train.micro_batch=1", "--train.recompute=\"selective\""]),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_real_recipes_evaluate(name):
    preset, world, overrides = RECIPES[name]
    cfg = load_config(None, ([f"--model.preset={preset}"] if preset else []) + overrides)
    est = estimate(cfg, world, get_hardware("h100"))
    out = est.to_json()
    assert all(math.isfinite(v) for v in out["memory_gb"].values()) and out["step_time_s"] > 0
    assert 0 < out["mfu"] < 1
    print(f"{name}: {out['memory_gb']['total']:.1f} GB/GPU, fits={out['fits']}, "
          f"validate: {validate(cfg, world)[:1] or 'ok'}")


def test_the_planner_imports_no_torch():
    # `fivefold plan` is arithmetic: importing torch (seconds) would be most of its time.
    code = "import sys, fivefold.planner.search, fivefold.planner.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
