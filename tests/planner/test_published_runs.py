"""The published figures of benchmarks/published_runs.py against the other figures of the same sources.

A transcription error in a run (a GPU count, a TFLOP/s figure, a shape) would make the comparison
with the planner wrong without anything failing; each source states some figures twice (per GPU
and aggregate, TFLOP/s and MFU, total and per trillion tokens), so the two must agree by the
source's own arithmetic. Arithmetic only: no estimate is made here.
"""

from __future__ import annotations

import pytest

from benchmarks.published_common import megatron_2021_flops, megatron_core_flops
from benchmarks.published_runs import RUNS
from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts

BY_NAME = {r.name: r for r in RUNS}

# Aggregate petaFLOP/s of the same rows: Narayanan et al. 2021 Table 1 (Megatron-LM images/cases_april2021.png)
# and Megatron-LM README 2024 images/model_table.png.
AGGREGATE_PFLOPS = {"megatron21-1T-3072xA100": 502.0, "megatron21-530B-2520xA100": 410.2,
                    "megatron21-146B-1536xA100": 227.1, "megatron21-18B-256xA100": 34.6,
                    "megatron24-7B-96xH100": 44.7, "megatron24-177B-2304xH100": 997.2,
                    "megatron24-462B-6144xH100": 2825.6}
# Percent of peak in the same tables (312 TFLOP/s A100, 989 H100).
PERCENT_OF_PEAK = {"megatron21-1T-3072xA100": (52, 312), "megatron21-18B-256xA100": (43, 312),
                   "megatron24-177B-2304xH100": (44, 989), "megatron24-462B-6144xH100": (47, 989)}


@pytest.mark.parametrize("name", sorted(AGGREGATE_PFLOPS))
def test_per_gpu_times_gpus_is_the_aggregate(name):
    run = BY_NAME[name]
    assert run.published * run.world / 1e3 == pytest.approx(AGGREGATE_PFLOPS[name], rel=3e-3)


@pytest.mark.parametrize("name", sorted(PERCENT_OF_PEAK))
def test_per_gpu_over_peak_is_the_stated_percentage(name):
    percent, peak = PERCENT_OF_PEAK[name]
    assert round(100 * BY_NAME[name].published / peak) == percent


def test_torchtitan_mfu_and_wps_agree_by_its_formula():
    """docs/performance.md @4d88a8a: 2973 WPS and 58.2% MFU on A100 (312 TFLOP/s), 6N + 12 l h q t."""
    run = BY_NAME["torchtitan-8B-64xA100"]
    assert run.published * 312e12 / run.flops_per_token == pytest.approx(2973, rel=2e-3)


def test_deepseek_per_trillion_is_the_total_over_the_tokens():
    """DeepSeek-V3 report: 2664K H800 GPU hours of pre-training for 14.8T tokens, 180K per trillion."""
    assert BY_NAME["deepseek-v3-2048xH800"].published == pytest.approx(2664e3 / 14.8, rel=1e-3)


@pytest.mark.parametrize("name", ["korthikanti22-175B-ratio", "korthikanti22-530B-ratio", "korthikanti22-1T-ratio"])
def test_korthikanti_ratio_is_its_formulas_ratio(name):
    """Korthikanti et al. 2022 (as quoted in Megatron-LM issue #523): model FLOPs 72 B L s h^2 (1 + s/6h +
    V/12hL), hardware FLOPs with selective recompute 72 B L s h^2 (1 + s/3h + V/12hL); the published
    HFU / MFU pair must be that ratio for the run's shape (each figure rounded to 0.1%)."""
    cfg = load_config(None, list(BY_NAME[name].overrides))
    h, L, s, V = cfg.model.dim, cfg.model.n_layers, cfg.train.seq_len, cfg.model.vocab_size
    formula = (1 + s / (3 * h) + V / (12 * h * L)) / (1 + s / (6 * h) + V / (12 * h * L))
    assert BY_NAME[name].published == pytest.approx(formula, abs=2e-3)


def test_megatron_2021_formula_is_the_papers():
    """Narayanan et al. 2021, eq. for F per iteration: 96 B s l h^2 (1 + s/6h + V/16lh); per token for the
    1T model (h 25600, l 128, s 2048, V 51200) by hand: s/6h = 1/75, V/16lh = 1/1024."""
    assert megatron_2021_flops(25600, 128, 2048, 51200) == pytest.approx(96 * 128 * 25600**2 * (1 + 1 / 75 + 1 / 1024))


# llm-foundry scripts/train/benchmarking/README.md @8c8dd48, the same rows: (Model TFLOP, HFU %, Throughput T/s,
# Throughput T/s/GPU, GradAccum).
FOUNDRY = {"mpt-1b-8xH100": (413, 41.82, 363645, 45455, 1), "mpt-7b-8xH100": (459, 46.44, 85144, 10643, 1),
           "mpt-13b-8xH100": (393, 39.79, 38336, 4792, 1), "mpt-30b-8xH100": (377, 50.82, 16022, 2002, 21),
           "mpt-70b-512xH100": (408, 55.0, 515636, 1007, 1), "mpt-7b-8xA100": (200, 64.23, 37130, 4641, 2)}


@pytest.mark.parametrize("name", sorted(FOUNDRY))
def test_llm_foundry_mfu_tokens_and_hfu_agree(name):
    """collect_results.py: MFU = (6 N + 12 l d s) T/s / (GPUs x peak), Model TFLOP the same numerator per GPU,
    HFU = 4/3 MFU with activation checkpointing (one more forward) and MFU without; T/s/GPU = T/s / GPUs
    (each rounded in the table)."""
    run = BY_NAME[name]
    tflop, hfu, tps, tps_gpu, accum = FOUNDRY[name]
    peak = {"h100": 989e12, "a100-80gb": 312e12}[run.gpu]
    assert run.published * peak / run.flops_per_token == pytest.approx(tps_gpu, rel=1e-3)
    assert run.published * peak / 1e12 == pytest.approx(tflop, abs=1.0)
    assert tps / run.world == pytest.approx(tps_gpu, abs=1.0)
    cfg = load_config(None, list(run.overrides))
    ratio = 4 / 3 if cfg.train.recompute == "full" else 1.0
    assert hfu / 100 == pytest.approx(run.published * ratio, abs=2e-4)
    assert derive(cfg, run.world, unpadded_vocab(cfg)).grad_accum == accum


# Megatron-Bridge docs/performance-summary.md @5776a6d (25.11) and @fa0315a (25.09), DGX-H100 tables: the model
# TFLOP/s/GPU and GA of the same rows.
MBRIDGE = {"mbridge-llama3-8B-8xH100-fp8": (744, 16), "mbridge-llama3-70B-64xH100-fp8": (719, 64),
           "mbridge-llama31-405B-1024xH100-fp8": (737, 64), "mbridge-qwen3-30B-A3B-16xH100-fp8": (121, 32),
           "mbridge-deepseek-v3-1024xH100": (338, 128)}


@pytest.mark.parametrize("name", sorted(MBRIDGE))
def test_megatron_bridge_tokens_times_its_flops_is_its_tflops(name):
    """The table's tokens/s/GPU times Megatron-Bridge's FLOPs per token (flop_utils.py) is its model TFLOP/s/GPU
    (tokens rounded to the unit); GA = GBS / (dp x MBS) for the row's degrees."""
    run = BY_NAME[name]
    tflops, ga = MBRIDGE[name]
    assert run.published * run.flops_per_token / 1e12 == pytest.approx(tflops, rel=3e-3)
    cfg = load_config(None, list(run.overrides))
    assert derive(cfg, run.world, unpadded_vocab(cfg)).grad_accum == ga


def test_megatron_core_flops_by_hand():
    """Llama 3 8B (h 4096, 32 layers, 32 heads, 8 groups, ffn 14336, s 8192, V 128256, tp 1) by hand:
    MLP 18 l h f, attention 12 l h^2 (1 + 8/32 + 8192/8192), logits 6 h V."""
    by_hand = 18 * 32 * 4096 * 14336 + 12 * 32 * 4096**2 * 2.25 + 6 * 4096 * 128256
    assert megatron_core_flops(4096, 32, 8192, 128256, 1, 32, groups=8, head_dim=128, ffn=14336) == by_hand


def test_moe_zoo_step_time_and_tflops_agree():
    """Megatron-MoE-ModelZoo qwen3 H100 table, intra-node EP row: step 17.6 s for GBS 2048 x 4096 tokens on 256
    GPUs, 276 TFLOP/s per GPU, by Megatron-Core's FLOPs per token; GA 4."""
    run = BY_NAME["mcore-qwen3-235B-256xH100"]
    tokens_per_gpu = 2048 * 4096 / 17.6 / 256
    assert tokens_per_gpu * run.flops_per_token / 1e12 == pytest.approx(run.published, rel=3e-3)
    cfg = load_config(None, list(run.overrides))
    assert derive(cfg, run.world, unpadded_vocab(cfg)).grad_accum == 4


def test_torchao_b200_speedups_are_the_tokens_ratio():
    """torchao training.md, B200 table: speedup over bf16 20.0% (mxfp8_cublas) and 25.4% (float8 tensorwise)."""
    base = BY_NAME["torchao-8B-8xB200-bf16"].published
    assert round(100 * (BY_NAME["torchao-8B-8xB200-mxfp8"].published / base - 1), 1) == 20.0
    assert round(100 * (BY_NAME["torchao-8B-8xB200-float8"].published / base - 1), 1) == 25.4


@pytest.mark.parametrize("run", [r for r in RUNS if r.params_b], ids=lambda r: r.name)
def test_shape_matches_the_published_parameter_count(run):
    """The SwiGLU stand-in for a GeLU MLP (8h/3) and the presets: within 0.5% of the source's count,
    and the layout's degrees multiply to the GPU count."""
    cfg = load_config(None, list(run.overrides))
    d = derive(cfg, run.world, unpadded_vocab(cfg))
    assert model_counts(cfg.model, d.vocab_size).total / 1e9 == pytest.approx(run.params_b, rel=5e-3)
    p = cfg.parallel
    assert d.dp * p.tp * p.pp * p.cp == run.world


def test_the_summary_leans_by_gpu_and_trainer():
    """planner_vs_published.summary on made-up figures for real rows: medians of |error| over the rows that
    have one, the signed tokens/s error per GPU and per trainer (a row without a time-based figure counts in
    neither) and its quartiles, and the rows beyond 15% and 25% with what each says differs."""
    from benchmarks.planner_vs_published import summary

    rows = [{"run": "megatron24-7B-96xH100", "gpu": "h100", "error": 0.2, "tokens_error": 0.2},
            {"run": "torchtitan-8B-8xH100", "gpu": "h100", "error": -0.1, "tokens_error": 0.1},
            {"run": "torchtitan-8B-128xH100", "gpu": "h100", "error": -0.3, "tokens_error": 0.4},
            {"run": "mpt-7b-8xA100", "gpu": "a100-80gb", "error": -0.05, "tokens_error": -0.05},
            {"run": "torchtitan-8B-64xA100", "gpu": "a100-80gb", "error": 0.01, "tokens_error": None},
            {"run": "llama3-405B-8192xH100"}]  # refused
    s = summary(rows)
    assert (s["rows"], s["compared"], s["tokens_compared"]) == (6, 5, 4)
    assert s["median_abs_error"] == pytest.approx(0.1) and s["median_abs_tokens_error"] == pytest.approx(0.15)
    assert s["median_tokens_error_by_gpu"] == {"a100-80gb": (1, -0.05), "h100": (3, pytest.approx(0.2))}
    assert s["median_tokens_error_by_trainer"] == {"megatron": (1, 0.2), "mosaic": (1, -0.05),
                                                   "torchtitan": (2, pytest.approx(0.25))}
    assert s["tokens_error_quartiles"] == pytest.approx([-0.0125, 0.15, 0.35])
    assert [(name, why.split(":")[0]) for name, _, why in s["beyond_15"]] == [
        ("megatron24-7B-96xH100", "not explained"), ("torchtitan-8B-128xH100", "differs")]
    assert [name for name, _, _ in s["beyond_25"]] == ["torchtitan-8B-128xH100"]
