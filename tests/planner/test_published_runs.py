"""The published figures of benchmarks/published_runs.py against the other figures of the same sources.

A transcription error in a run (a GPU count, a TFLOP/s figure, a shape) would make the comparison
with the planner wrong without anything failing; each source states some figures twice (per GPU
and aggregate, TFLOP/s and MFU, total and per trillion tokens), so the two must agree by the
source's own arithmetic. Arithmetic only: no estimate is made here.
"""

from __future__ import annotations

import pytest

from benchmarks.published_runs import RUNS, megatron_2021_flops
from fivefold.config import load_config
from fivefold.model.counts import model_counts
from fivefold.parallel.derive import derive

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


@pytest.mark.parametrize("run", [r for r in RUNS if r.params_b], ids=lambda r: r.name)
def test_shape_matches_the_published_parameter_count(run):
    """The SwiGLU stand-in for a GeLU MLP (8h/3) and the presets: within 0.5% of the source's count,
    and the layout's degrees multiply to the GPU count."""
    cfg = load_config(None, list(run.overrides))
    d = derive(cfg, run.world)
    assert model_counts(cfg.model, d.vocab_size).total / 1e9 == pytest.approx(run.params_b, rel=5e-3)
    p = cfg.parallel
    assert d.dp * p.tp * p.pp * p.cp == run.world
