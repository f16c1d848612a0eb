"""benchmarks/gpu_check.py, kept runnable without a GPU: its smallest run on the CPU, and its guard
(a part that fails or runs past its budget is one line, and the next part still runs)."""

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
from helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def test_the_tiny_check_runs_on_cpu(tmp_path):
    # calibrate's budget of 1 s stops it during its imports: the guard, at the cost of nothing (its
    # measurements run in tests/planner/test_planner_search.py). The training part's budget is far
    # above what it takes, so a loaded machine does not make it skip a case.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--budget", "off=600",
                          "--budget", "calibrate=1", "--deadline-s", "900", "--profile", str(tmp_path / "p.toml")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(out.stdout)
    env_line, *cases, compare, off, calibrate, summary = lines
    assert env_line["environment"] and env_line["missing_dependencies"] == []
    assert [(c["runtime"], c["model"], c["compile"]) for c in cases] == [("fivefold", "tiny", False),
                                                                          ("plain", "tiny", False)]
    for case in cases:
        assert "error" not in case, case
        assert case["tokens_per_s"] > 0 and case["predicted_memory_gb"] > 0 and case["loss_last"] > 0
        assert case["mfu"] is None and case["peak_memory_gb"] is None  # a CPU has no peak, no allocator counter
    assert compare["compare"] and compare["tokens_per_s_fivefold_over_plain"] > 0
    assert off == {"part": "off", "status": "ok", "wall_s": off["wall_s"]}
    assert calibrate["part"] == "calibrate" and calibrate["status"] == "stopped at its budget of 1 s"
    assert summary["summary"] and summary["parts"] == ["off", "calibrate"]


def test_the_attention_check_runs_on_cpu(capsys):
    """gpu_check.py's attention part (attention_check.py), its smallest run, in this process: each
    kernel against the rule (fp32: rounding; bf16: its 2^-8), then the times."""
    spec = importlib.util.spec_from_file_location("attention_check", ROOT / "benchmarks" / "attention_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    with warnings.catch_warnings():  # eager FlexAttention warns that it materialises the scores
        warnings.simplefilter("ignore", UserWarning)
        assert check.main(["--device", "cpu", "--tiny"]) == 0
    env, *checks, timing = _lines(capsys.readouterr().out)
    assert env["device"] == "cpu"
    assert [(c["check"], c["dtype"]) for c in checks] == [("blockwise", "float32"), ("blockwise", "bfloat16"),
                                                          ("flex", "float32")]
    assert max(checks[0]["relative_max_error"].values()) < 1e-5 and max(checks[2]["relative_max_error"].values()) < 1e-5
    assert max(checks[1]["relative_max_error"].values()) < 0.05
    assert set(timing["ms"]) == {"sdpa_causal", "sdpa_dense_mask", "blockwise"}  # no FlexAttention backward on CPU


def test_a_failed_part_is_one_line(tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.gpu_check import run_part
    finally:
        sys.path.remove(str(ROOT))
    failed = run_part("off", [sys.executable, "-c", "import sys; sys.exit(3)"], 60.0)
    assert failed["part"] == "off" and failed["status"] == "failed with exit status 3"


def test_the_roofline_check_runs_on_cpu(capsys):
    """gpu_check.py's roofline part (roofline_check.py), its smallest run, in this process: a line per
    matmul and part (forward, input and weight gradients), SDPA's and FlashAttention-2's attention
    forward and backward, the block's; each with the planner's milliseconds and the ratio."""
    spec = importlib.util.spec_from_file_location("roofline_check", ROOT / "benchmarks" / "roofline_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.main(["--device", "cpu", "--tiny"]) == 0
    env, *lines = _lines(capsys.readouterr().out)
    assert env["device"] == "cpu" and env["priced_as"] == "h100"
    matmuls = [(x["matmul"], x["part"]) for x in lines if "matmul" in x]
    assert matmuls == [(name, part) for name in ("wq", "wk", "wv", "wo", "gate", "up", "down")
                       for part in ("forward", "input_grad", "weight_grad")]
    assert [(x["attention"], x["part"]) for x in lines if "attention" in x] == [
        ("sdpa", "forward"), ("sdpa", "backward"), ("fa2", "forward"), ("fa2", "backward")]
    assert [x["block"] for x in lines if "block" in x] == ["forward", "backward"]
    for x in lines:
        assert x["measured_ms"] > 0 and x["planner_ms"] > 0 and x["ratio"] == pytest.approx(
            x["measured_ms"] / x["planner_ms"], rel=1e-2)
    assert check.main(["--device", "cpu", "--preset", "nope"]) == 1  # bad input: one line naming the flag
    (error,) = _lines(capsys.readouterr().out)
    assert error["error"].startswith("--preset nope: not a model preset; one of ")
