"""FLOP conventions (MFU beside HFU, causal attention in full or halved), the measured mode, and the
batch the planner chooses when the user gives none: each against hand arithmetic from the papers."""

import json

import pytest

from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.planner.estimate import estimate
from fivefold.planner.flops import parse_token_budget
from fivefold.planner.machine.datasheet import get_hardware
from fivefold.planner.options import PlanOptions
from fivefold.validate import validate

# Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM"), Table 1, the 18.4B row: h = 6144, l = 40, 48 heads, tp 8, 256 A100s, batch 1024,
# s = 2048, V = 51,200, 135 TFLOP/s per GPU. Their MLP is 4h wide with two matrices (8 h^2 weights);
# fivefold's is SwiGLU with three: ffn_dim = 8h/3 = 16384 gives 3 h ffn = 8 h^2, the same matmul
# FLOPs (neither count counts the elementwise GeLU / SiLU x gate). Dense, multi-head, no biases.
H, L, HEADS, V, S, B = 6144, 40, 48, 51200, 2048, 1024
GPT = [f"--model.dim={H}", f"--model.n_layers={L}", f"--model.n_heads={HEADS}", f"--model.n_kv_heads={HEADS}",
       f"--model.ffn_dim={8 * H // 3}", f"--model.vocab_size={V}"]


def narayanan_f(b: int, s: int, layers: int, h: int, v: int) -> float:
    """F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): hardware FLOPs per step with full recompute, causal
    attention counted in full (Narayanan et al. 2021, the FLOP count behind Table 1)."""
    return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))


def _plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_hardware_flops_of_a_gpt_step_are_narayanans_formula(capsys):
    out = _plan_json(capsys, *GPT, "--gpus", "256", "--gpu", "a100-80gb", "--seq", str(S), "--global-batch", str(B),
                     "--layout", "recompute=full", "--tflops", "100")
    assert out["flops"]["hardware_per_step"] == pytest.approx(narayanan_f(B, S, L, H, V), rel=1e-12)
    # model FLOPs: the same without the recomputed forward, 72 B s l h^2 (1 + s/(6h) + V/(12 l h))
    assert out["flops"]["model_per_step"] == pytest.approx(72 * B * S * L * H**2 * (1 + S / (6 * H) + V / (12 * L * H)),
                                                           rel=1e-12)
    # The estimate fills the same numbers for their layout (tp 8, dp 32).
    cfg = load_config(None, [*GPT, f"--train.seq_len={S}", f"--train.global_batch={B}", "--train.micro_batch=1",
                             "--parallel.tp=8", "--parallel.dp=32", '--train.recompute="full"'])
    assert validate(cfg, 256) == []
    est = estimate(cfg, 256, get_hardware("a100-80gb"))
    assert est.flops["hardware_per_step"] == pytest.approx(narayanan_f(B, S, L, H, V), rel=1e-12)
    assert est.hfu == pytest.approx(est.flops["hardware_per_step"] / (est.step_time_s * 256 * 312e12), rel=1e-12)


def test_narayanans_135_tflops_per_gpu_is_their_hfu(capsys):
    """Their per-GPU throughput counts hardware FLOPs (recompute included): a step of F / (256 x 135e12)
    seconds is an HFU of 135 / 312 on A100s, and an MFU smaller by the recomputed forward's share."""
    step = narayanan_f(B, S, L, H, V) / (256 * 135e12)
    out = _plan_json(capsys, *GPT, "--gpus", "256", "--gpu", "a100-80gb", "--seq", str(S), "--global-batch", str(B),
                     "--layout", "recompute=full", "--step-time", repr(step))
    assert out["hfu"] == pytest.approx(135 / 312, rel=1e-9)
    model_over_hw = (72 * L * H**2 + 12 * L * S * H + 6 * V * H) / (96 * L * H**2 + 16 * L * S * H + 6 * V * H)
    assert out["mfu"] == pytest.approx(135 / 312 * model_over_hw, rel=1e-9)


def _deepseek_v3_activated_matmul() -> int:
    """DeepSeek-V3's matmul weights one token goes through, by hand from its report's shape (arXiv
    2412.19437, sec. 4.2): MLA with d = 7168, 128 heads, query latent 1536, key-value latent 512,
    head widths 128 + 64 (RoPE), values 128; 3 dense blocks of width 18432; 58 MoE blocks of router
    (256 experts), 1 shared and 8 routed experts of width 2048; vocabulary 129,280 (the head). The
    multi-token prediction module is left out (fivefold's preset has none)."""
    d, heads = 7168, 128
    attention = d * 1536 + 1536 * heads * 192 + d * (512 + 64) + 512 * heads * (128 + 128) + heads * 128 * d
    dense, moe = 3 * d * 18432, d * 256 + 3 * d * 2048 * (1 + 8)
    return 61 * attention + 3 * dense + 58 * moe + 129280 * d


def test_deepseek_v3_gpu_hours_give_the_mfu_counted_by_hand(capsys):
    """DeepSeek-V3's report (Table 1): pre-training on 14.8T tokens took 2,664K H800 GPU-hours (2,788K
    with context extension and post-training, run at other sequence lengths), sequences of 4096, on
    2048 GPUs. H800's dense bf16 peak is H100 SXM's 989 TFLOP/s (the catalog's h100)."""
    tokens, gpu_hours, gpus = 14.8e12, 2.664e6, 2048
    per_gpu = tokens / (gpu_hours * 3600)  # 1543 tokens/s/GPU
    out = _plan_json(capsys, "--model", "deepseek-v3", "--gpus", str(gpus), "--gpu", "h100", "--seq", "4096",
                     "--tokens-per-s", repr(per_gpu * gpus), "--token-budget", "14.8T")
    assert out["gpu_hours"] == pytest.approx(gpu_hours, rel=1e-12)
    assert out["days"] == pytest.approx(gpu_hours / gpus / 24, rel=1e-12)  # 54.2: "less than two months"
    n = _deepseek_v3_activated_matmul()
    assert n == pytest.approx(37e9, rel=0.02)  # the report's 37B activated (norms and embedding lookup aside)
    attention = 6 * 61 * 4096 * 128 * (192 + 128)  # QK^T and PV, forward + backward, causal counted in full
    assert out["flops"]["model_per_token"] == 6 * n + attention
    assert out["mfu"] == pytest.approx((6 * n + attention) * per_gpu / 989e12, rel=1e-12)
    assert round(out["mfu"], 3) == 0.439  # against the bf16 peak; it trained in FP8 (twice the peak)


def test_tflops_in_restates_as_tokens_and_mfu(capsys):
    out = _plan_json(capsys, "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--tflops", "400",
                     "--causal-flops", "half")
    assert out["mfu"] == pytest.approx(400 / 989, rel=1e-12)
    assert out["tokens_per_s_per_gpu"] == pytest.approx(400e12 / out["flops"]["model_per_token"], rel=1e-12)
    assert out["causal_flops"] == "half" and out["days"] is None


def _llama_estimate(causal: str, recompute: str = "none"):
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=8192", "--train.global_batch=64",
                             "--train.micro_batch=1", "--parallel.dp=8", "--parallel.zero=1",
                             f'--train.recompute="{recompute}"'])
    return estimate(cfg, 8, get_hardware("h100"), options=PlanOptions(causal_flops=causal))


def test_full_and_half_causal_counts_differ_by_the_masked_half():
    """PaLM (Chowdhery et al. 2022, App. B) counts attention as 12 L H Q T per token, in full; the
    kernels run half of it. The step time prices the half either way: only the numerator moves."""
    full, half = _llama_estimate("full"), _llama_estimate("half")
    assert full.step_time_s == half.step_time_s
    masked_half = 12 * 32 * 32 * 128 * 8192 / 2 * 64 * 8192  # L H Q T / 2 per token, x tokens per step
    assert full.mfu - half.mfu == pytest.approx(masked_half / (full.step_time_s * 8 * 989e12), rel=1e-9)
    assert full.flops["model_per_step"] - half.flops["model_per_step"] == pytest.approx(masked_half, rel=1e-12)


def test_selective_recompute_adds_the_attention_cores_forward_to_hfu_only():
    """Korthikanti et al. 2022: selective recompute runs QK^T and PV forward again, 2 x 2 s h per layer
    and token (counted in full), which HFU counts and MFU does not."""
    none, sel = _llama_estimate("full"), _llama_estimate("full", "selective")
    assert none.hfu == none.mfu and sel.flops["model_per_step"] == none.flops["model_per_step"]
    extra = 4 * 8192 * 4096 * 32 * 64 * 8192  # 4 s h per layer x L x tokens per step
    assert sel.flops["hardware_per_step"] - sel.flops["model_per_step"] == pytest.approx(extra, rel=1e-12)


def test_explain_names_the_convention_its_source_and_both_utilizations(capsys):
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "4096", "--layout", "dp=8,zero=1", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "causal_flops=full" in out and "PaLM" in out and "Narayanan" in out and "MFU / HFU" in out
    assert main([*argv, "--causal-flops", "half"]) == 0
    assert "causal_flops=half" in capsys.readouterr().out


def test_token_budgets_are_decimal():
    assert parse_token_budget("15T") == 15e12 and parse_token_budget("14.8t") == 14.8e12
    assert parse_token_budget("300B") == 300e9 and parse_token_budget("1.5e12") == 1.5e12
    with pytest.raises(ValueError, match="--token-budget"):
        parse_token_budget("lots")


def test_bad_measured_input_is_one_line(capsys):
    assert main(["plan", "--model", "llama3-8b", "--tokens-per-s", "1e6", "--token-budget", "x"]) == 2
    assert "--token-budget 'x'" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--token-budget", "15T"]) == 2
    assert "needs a measured run" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--step-time", "-1"]) == 2
    assert "--step-time" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--layout", "dp=8,nonsense=1"]) == 2  # was a traceback
    assert "--layout item 'nonsense=1'" in capsys.readouterr().err


# ---- item 6: defaults the user did not give never refuse a plan ---------------------------------------------------
def test_a_model_and_a_layout_alone_are_planned(capsys):
    """The config's global batch of 8 sequences (and micro-batch 2) used to refuse dp=8; now the batch
    is the 4M-token default over seq and the micro-batch the fastest of 1, 2, 4 that fits."""
    argv = ["plan", "--model", "llama3-8b", "--gpus", "8", "--seq", "8192", "--layout", "dp=8,zero=1", "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "global batch 512 sequences of 8192 = 4,194,304 tokens" in out  # 4 x 2^20 / 8192
    assert "micro-batch 1, picked" in out  # at 8192 tokens, mb 2 and 4 run out of memory on 80 GB
    assert "dp8 z1 mb1" in out


def test_a_preset_is_planned_at_its_reports_sequence_length(capsys):
    # Llama 3 pre-trains on 8K-token sequences (Dubey et al. 2024, sec. 3.4.1): without --seq the plan
    # is the same as with --seq 8192, not one at the training config's 64-token test default
    base = ["plan", "--model", "llama3-8b", "--gpus", "8", "--layout", "dp=8,zero=1", "--json"]
    assert main(base) == 0
    implied = json.loads(capsys.readouterr().out)
    assert main([*base, "--seq", "8192"]) == 0
    assert implied == json.loads(capsys.readouterr().out)
    assert implied["flops"]["model_per_step"] > 4e6 * 6 * 8e9  # 4M tokens of at least 6N each


def test_the_default_batch_rounds_to_the_layout(capsys):
    # 4 x 2^20 / 8192 = 512 sequences; dp 6 x micro-batch 1 divides 510, the nearest multiple
    assert main(["plan", "--model", "llama3-8b", "--gpus", "6", "--seq", "8192", "--layout", "dp=6,zero=3",
                 "--explain"]) == 0
    assert "global batch 510 sequences" in capsys.readouterr().out


def test_the_picked_micro_batch_is_the_fastest_that_fits(capsys):
    from fivefold.planner.request import MICRO_BATCHES

    # at 512 tokens ZeRO-3's per-micro-batch gathers dominate: 4 micro-batches of 4 beat 16 of 1
    base = ["--model", "llama3-8b", "--gpus", "8", "--seq", "512"]
    picked = _plan_json(capsys, *base, "--layout", "dp=8,zero=3")
    times = {}
    for mb in MICRO_BATCHES:
        out = _plan_json(capsys, *base, "--layout", f"dp=8,zero=3,micro_batch={mb}")
        if out["fits"]:
            times[mb] = out["step_time_s"]
    assert len(set(times.values())) > 1 and picked["step_time_s"] == min(times.values())


def test_values_the_user_gave_are_still_refused(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "12", "--layout", "dp=8"]) == 2
    assert "train.global_batch = 12" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--micro-batch", "2",
                 "--layout", "dp=8"]) == 2
    assert "train.global_batch = 8" in capsys.readouterr().err


def test_a_batch_in_the_users_toml_is_theirs(tmp_path, capsys):
    config = tmp_path / "mine.toml"
    config.write_text('[model]\npreset = "llama3-8b"\n[train]\nseq_len = 4096\nglobal_batch = 12\n')
    assert main(["plan", "--model", str(config), "--gpus", "8", "--layout", "dp=8"]) == 2
    assert "train.global_batch = 12" in capsys.readouterr().err
