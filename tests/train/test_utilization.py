"""The logged step's achieved TFLOP/s, MFU, HFU and memory (train/utilization.py), against hand
calculations in the planner's FLOP convention (planner/flops.py: causal attention counted in full,
windows and documents as the pairs they keep, recompute in HFU only)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.data.resolve import unpadded_vocab
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_metrics
from fivefold.train.utilization import Peak, document_keys, formula_keys, run_flops, utilization
from fivefold.validate import validate

V = 320  # vocabulary (the head's V x d is a matmul every token goes through)
# d 64, 2 blocks, 4 heads of 16, SwiGLU 128, rows of T = 32, 8 rows a step: 256 tokens
SHAPE = ("--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.ffn_dim=128", "--model.head_dim=0",
         "--model.tie_embeddings=false", "--train.seq_len=32", "--train.global_batch=8")
TOKENS = 8 * 32
STEP_S, RANKS, PEAK = 0.5, 2, Peak(1e12, "setting")


def mfu_of(tmp_path, *args: str, step_s: float = STEP_S, keys: float | None = None) -> dict:
    cfg = tiny_config(tmp_path, *SHAPE, *args)
    return utilization(run_flops(cfg, V), step_s, RANKS, PEAK, keys, formula_keys(cfg))


def check(u: dict, model_per_token: float, hardware_per_token: float | None = None) -> None:
    hardware_per_token = hardware_per_token or model_per_token
    per_rank = model_per_token * TOKENS / STEP_S / RANKS  # FLOP/s per rank
    assert u["achieved_tflops"] == pytest.approx(per_rank / 1e12, rel=1e-12)
    assert u["mfu"] == pytest.approx(per_rank / 1e12, rel=1e-12)  # a peak of 1e12 FLOP/s
    assert u["hfu"] == pytest.approx(hardware_per_token * TOKENS / STEP_S / RANKS / 1e12, rel=1e-12)
    assert u["peak_tflops"] == 1.0 and u["peak_from"] == "setting"


# Per block, attention projections: wq d x H hd, wk and wv d x K hd, wo H hd x d; SwiGLU 3 d f.
ATTN = 64 * 64 + 2 * 64 * 64 + 64 * 64  # 16,384 (K = H = 4)
FFN = 3 * 64 * 128  # 24,576
HEAD = V * 64  # 20,480
# Attention core, causal counted in full: 6 x H x (hd + hd) x T/2 keys x 2, per block
CORE = 6 * 4 * 32 * 16 * 2  # 24,576 = 12 T H hd


def test_dense_mfu_and_hfu_by_hand(tmp_path):
    model = 6 * (2 * (ATTN + FFN) + HEAD) + 2 * CORE  # 614,400 + 49,152 = 663,552 per token
    check(mfu_of(tmp_path / "a"), model)
    # full recompute: one more forward of the blocks (2 x their matmul weights) and of the core (1/3 of it)
    check(mfu_of(tmp_path / "b", "--train.recompute=full"), model, model + 2 * 2 * (ATTN + FFN) + 2 * CORE / 3)
    check(mfu_of(tmp_path / "c", "--train.recompute=selective"), model, model + 2 * CORE / 3)


def test_gqa_mfu_counts_the_narrow_key_value_projections(tmp_path):
    attn = 64 * 64 + 2 * 64 * 16 + 64 * 64  # one key/value head: wk, wv are d x hd = 10,240
    check(mfu_of(tmp_path, "--model.n_kv_heads=1"), 6 * (2 * (attn + FFN) + HEAD) + 2 * CORE)  # 589,824


def test_moe_mfu_counts_active_parameters(tmp_path):
    # 4 experts of width 32, 2 per token: router d x E, then 2 x 3 d 32 of the 4 x 3 d 32 held
    block = ATTN + 64 * 4 + 2 * 3 * 64 * 32  # 28,928
    u = mfu_of(tmp_path, "--model.moe.n_experts=4", "--model.moe.top_k=2", "--model.moe.ffn_dim=32",
               "--model.moe.n_shared_experts=0", "--model.moe.first_dense_layers=0")
    check(u, 6 * (2 * block + HEAD) + 2 * CORE)  # 519,168


def test_windowed_mfu_counts_the_kept_pairs(tmp_path):
    # a window of 8 keeps T w - w (w - 1) / 2 = 256 - 28 = 228 pairs of a row of 32: 7.125 keys a query
    core = 6 * 4 * 32 * (228 / 32) * 2  # 10,944 per block, against 24,576 causal
    check(mfu_of(tmp_path, "--model.attention.window=8"), 6 * (2 * (ATTN + FFN) + HEAD) + 2 * core)


def test_documents_count_the_pairs_the_mask_keeps(tmp_path):
    eod = 9
    rows = torch.full((2, 32), 1)  # (2, 32): row 0 documents of 10, 22 (its eod at 9); row 1 one of 32
    rows[0, 9] = eod
    keys = document_keys(tiny_config(tmp_path, *SHAPE), [rows[:1], rows[1:]], eod)
    pairs = 10 * 11 / 2 + 22 * 23 / 2 + 32 * 33 / 2  # each document's causal pairs: 55 + 253 + 528
    assert keys == pytest.approx(2 * pairs / 64)  # both blocks, over 64 tokens
    # the core scales by kept keys / the formula's T/2 a block; recompute's rerun of it too
    u = mfu_of(tmp_path / "a", "--train.recompute=selective", keys=keys)
    core = 6 * 4 * 32 * (pairs / 64) * 2
    model = 6 * (2 * (ATTN + FFN) + HEAD) + 2 * core
    check(u, model, model + 2 * core / 3)


def test_no_peak_leaves_mfu_out(tmp_path):
    cfg = tiny_config(tmp_path, *SHAPE)
    u = utilization(run_flops(cfg, V), STEP_S, RANKS, Peak(None, None))
    assert u["mfu"] is None and u["hfu"] is None and u["peak_tflops"] is None and u["peak_from"] is None
    assert u["achieved_tflops"] > 0


def test_peak_tflops_is_validated(tmp_path):
    errors = validate(tiny_config(tmp_path, "--train.peak_tflops=-1"), 1)
    assert "train.peak_tflops = -1: must be 0 or more" in errors


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    train(cfg, progress=False)


@pytest.mark.parametrize("peak", [0.0, 0.5])
def test_logging_steps_carry_utilization_and_memory(tmp_path, peak):
    cfg = tiny_config(tmp_path, "--train.steps=3", "--train.log_every=2", f"--train.peak_tflops={peak}",
                      "--data.max_bytes=20000")
    run_workers(_train, 1, cfg)
    records = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [("utilization" in r, "memory" in r) for r in records] == [(False, False), (True, True), (True, True)]
    flops = run_flops(cfg, derive(cfg, 1, unpadded_vocab(cfg)).vocab_size)
    for r in records[1:]:
        u, mem = r["utilization"], r["memory"]
        assert u["achieved_tflops"] == pytest.approx(flops.model_per_step / r["step_time_s"] / 1e12, rel=1e-9)
        if peak:
            assert u["peak_from"] == "setting" and u["peak_tflops"] == 0.5
            assert u["mfu"] == pytest.approx(u["achieved_tflops"] / 0.5, rel=1e-9)
        else:  # a CPU run with neither a setting nor a profile: no peak, MFU left out
            assert u["mfu"] is None and u["hfu"] is None and u["peak_from"] is None
        assert list(mem) == ["peak_rss_bytes"] and mem["peak_rss_bytes"] > 10 * 2**20  # this process's: > 10 MiB
        assert r["predicted"]["peak_bytes"] == pytest.approx(
            r["predicted"]["model_state_bytes"]["total"] + r["predicted"]["activation_bytes"]
            + r["predicted"]["buffer_bytes"])


def test_the_peak_comes_from_the_setting_the_profile_or_the_catalog(tmp_path, monkeypatch):
    from fivefold.train.utilization import peak_of

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_of(tiny_config(tmp_path), cuda) == Peak(989e12, "catalog:h100")  # the datasheet's bf16 dense
    assert peak_of(tiny_config(tmp_path), cpu) == Peak(None, None)  # no catalog entry for a CPU
    profile = tmp_path / "box.toml"
    profile.write_text('[hardware]\nbase = "h100"\npeak_flops = 5e14\n')
    assert peak_of(tiny_config(tmp_path, f"--run.hardware={profile}"), cuda) == Peak(5e14, "profile")
    assert peak_of(tiny_config(tmp_path, f"--run.hardware={profile}", "--train.peak_tflops=700"),
                   cuda) == Peak(7e14, "setting")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")  # not in the catalog
    assert peak_of(tiny_config(tmp_path), cuda) == Peak(None, None)


def test_cuda_memory_is_read_and_reset_per_window(monkeypatch):
    from fivefold.train.utilization import memory_peaks

    stats = {"allocated_bytes.all.peak": 7 * 2**20, "reserved_bytes.all.peak": 9 * 2**20, "num_alloc_retries": 4}
    resets = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    cuda = torch.device("cuda", 0)
    assert memory_peaks(cuda) == {"peak_allocated_bytes": 7 * 2**20, "peak_reserved_bytes": 9 * 2**20,
                                  "alloc_retries": 4}
    assert resets == [cuda]  # the next logging step's peaks are its own window's


def test_allocation_retries_are_counted_per_logged_window(tmp_path, monkeypatch):
    import fivefold.train.step as step

    totals = iter([1, 3, 6])  # the allocator's count since the process started, at each logging step
    monkeypatch.setattr(step, "memory_peaks", lambda device: {"peak_allocated_bytes": 1, "peak_reserved_bytes": 2,
                                                              "alloc_retries": next(totals)})
    run_workers(_train, 1, tiny_config(tmp_path, "--train.steps=3", "--data.max_bytes=20000"))  # forked: patched
    records = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    assert [r["memory"]["alloc_retries"] for r in records] == [1, 2, 3]
