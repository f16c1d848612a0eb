"""benchmarks/gpu_check.py, kept runnable without a GPU: both stages at their smallest on the CPU,
writing every part's JSONL and a summary naming each check; its supervisor (a worker that dies is
one failed check, as is a part past its budget, and a fresh worker runs the parts after it);
attention_check.py's smallest run."""

import importlib.util
import json
import os
import subprocess
import sys
import types
import warnings

import pytest
from helpers import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
sys.path.insert(0, str(ROOT))
from benchmarks.gpu_check import run_stage  # noqa: E402
from benchmarks.gpucheck.records import STAGES, read_part  # noqa: E402

sys.path.remove(str(ROOT))

ROOFLINE = [f"roofline matmul {m} {p}: measured / planner ms" for m in ("wq", "wk", "wv", "wo", "gate", "up", "down")
            for p in ("forward", "input_grad", "weight_grad")] + [
    f"roofline attention {a} {p}: measured / planner ms" for a in ("sdpa", "fa2") for p in ("forward", "backward")] + [
    f"roofline block {p}: measured / planner ms" for p in ("forward", "backward")]
CHECKS = {
    "precision": ["bf16 dense step vs fp32", "fp8 tensorwise vs bf16", "fp8 rowwise vs bf16",
                  "fp8 shape rule in validate (dims multiples of 16)"],
    "moe": ["moe grouped vs loop, counts [5, 0, 13, 1]", "moe grouped vs loop, counts [0, 0, 0, 7, 0, 33, 2, 0]"],
    "sharding": ["zero3 param_dtype bf16 vs unsharded bf16", "offload optimizer (zero 1) vs without",
                 "offload optimizer: pinned host bytes", "offload params (zero 3) vs without",
                 "offload params: pinned host bytes"],
    "attention": ["memory-efficient tiles vs fp32 rule, T=1000", "memory-efficient tiles vs fp32 rule, T=2000",
                  "flex (documents, window, sinks) vs fp32 rule, T=128", "flex at T=32768: peak memory (GB)"],
    "compile": ["compile (aot_eager) vs eager, no recompute", "compile (aot_eager) vs eager, full recompute",
                "chunked loss vs the whole loss"],
    "optimizer": ["muon vs torch.optim.Muon + AdamW, one process", "muon bf16 step vs fp32",
                  "qk_clip holds the largest logit at tau (bf16)"],
    "training": [f"tiny {r} eager: {what}" for r in ("fivefold", "plain")
                 for what in ("tokens/s", "MFU", "peak memory / planner")] + [
        "tiny eager: fivefold / plain tokens/s", "tiny compiled: fivefold / plain tokens/s"],
    "fp8": ["tiny fp8 tensorwise / bf16 tokens/s", "tiny fp8 rowwise / bf16 tokens/s"],
    "loss_chunk": [f"head + loss, train.loss_chunk / eager cross-entropy: {what}"
                   for what in ("peak memory", "time", "summed loss gap")],
    "roofline": ROOFLINE,
    "calibrate": ["calibrate: the command"],
}
SKIPPED = {"tiny compiled: fivefold / plain tokens/s", "calibrate: the command"}


def test_the_tiny_check_writes_every_part_and_a_summary(tmp_path):
    # calibrate's budget of 1 s is under its cost: skipped, at the cost of nothing (its measurements
    # run in tests/planner/test_planner_search.py)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out),
                          "--budget", "calibrate=1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    parts = [p for stage in STAGES.values() for p in stage]
    assert sorted(os.listdir(out)) == sorted([f"{p}.jsonl" for p in parts] + ["stderr.log", "summary.md"])
    summary = (out / "summary.md").read_text()
    assert '"device": "cpu"' in summary.splitlines()[2]  # the machine, under the title
    for part in parts:
        checks, end = read_part(out / f"{part}.jsonl")
        assert [c["check"] for c in checks] == CHECKS[part], part
        assert end["status"] == "ok", end
        for c in checks:
            assert set(c) >= {"check", "value", "bound", "pass", "status", "detail"}
            row = f"| {part} | {c['check']} | "
            assert row in summary and summary.split(row)[1].split(" | ")[2] == c["status"].upper(), c
            if c["check"] in SKIPPED:
                assert c["status"] == "skip" and c["detail"].startswith("skipped: "), c
                assert part != "calibrate" or c["detail"].startswith("skipped: over the stage's budget"), c
            else:  # the CPU's correct stage passes; its speed bounds are a GPU's
                assert c["status"] == "pass", c
    roofline = read_part(out / "roofline.jsonl")[0]
    assert all(c["value"] > 0 and c["detail"]["bound on a GPU"] == "0.5 .. 2" for c in roofline)
    printed = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"check"')]
    assert len(printed) == sum(len(v) for v in CHECKS.values())  # each printed as it was measured


# A stand-in worker: each of its parts writes a check and its end line; in `moe` it dies (exit 3, a
# CUDA fault, say) or hangs, as argv[3] says.
FAKE_WORKER = """import json, pathlib, sys, time
out, parts, moe = pathlib.Path(sys.argv[1]), sys.argv[2].split(','), sys.argv[3]
def w(p, r): (out / f'{p}.jsonl').open('a').write(json.dumps(r) + '\\n')
for p in parts:
    w(p, {'check': p + ' x', 'value': 1, 'bound': '<= 2', 'pass': True, 'status': 'pass', 'detail': None})
    if p == 'moe':
        sys.exit(3) if moe == 'dies' else time.sleep(600)
    w(p, {'part': p, 'status': 'ok', 'wall_s': 0})
"""


@pytest.mark.parametrize("moe", ["dies", "hangs"])
def test_a_part_that_dies_or_overruns_is_one_failed_check_and_the_next_parts_run(tmp_path, moe):
    """The first worker writes precision whole, then dies or hangs in moe; moe is one failed check
    (with what it measured before), and a fresh worker runs sharding alone."""
    calls = []

    def command(args, parts):
        calls.append(parts)
        return [sys.executable, "-c", FAKE_WORKER, str(args.out), ",".join(parts), moe]

    args = types.SimpleNamespace(out=tmp_path, deadline_s=60.0, grace_s=0.0, env=None,
                                 budgets={**dict.fromkeys(STAGES["correct"], 60.0), "moe": 2.0})
    run_stage("correct", ["precision", "moe", "sharding"], args, command)
    assert calls == [["precision", "moe", "sharding"], ["sharding"]]
    why = "its worker exited with status 3" if moe == "dies" else "stopped at its budget of 2 s"
    checks, end = read_part(tmp_path / "moe.jsonl")
    assert [(c["check"], c["status"], c["detail"]) for c in checks] == [("moe x", "pass", None),
                                                                       ("moe: the part", "fail", why)]
    assert end["status"] == "stopped"
    for part in ("precision", "sharding"):
        assert read_part(tmp_path / f"{part}.jsonl")[1]["status"] == "ok"
    assert f"| correct | moe | moe: the part |  |  | FAIL | {why} |" in (tmp_path / "summary.md").read_text()


def test_the_attention_check_runs_on_cpu(capsys):
    """attention_check.py (the kernels against the rule, then their time beside SDPA), its smallest
    run, in this process: each kernel against the rule (fp32: rounding; bf16: its 2^-8), then the times."""
    spec = importlib.util.spec_from_file_location("attention_check", ROOT / "benchmarks" / "attention_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    with warnings.catch_warnings():  # eager FlexAttention warns that it materialises the scores
        warnings.simplefilter("ignore", UserWarning)
        assert check.main(["--device", "cpu", "--tiny"]) == 0
    env, *checks, timing = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert env["device"] == "cpu"
    assert [(c["check"], c["dtype"]) for c in checks] == [("blockwise", "float32"), ("blockwise", "bfloat16"),
                                                          ("flex", "float32")]
    assert max(checks[0]["relative_max_error"].values()) < 1e-5 and max(checks[2]["relative_max_error"].values()) < 1e-5
    assert max(checks[1]["relative_max_error"].values()) < 0.05
    assert set(timing["ms"]) == {"sdpa_causal", "sdpa_dense_mask", "blockwise"}  # no FlexAttention backward on CPU


def test_the_roofline_check_refuses_an_unknown_preset(capsys):
    """roofline_check.py's bad input is one line naming the flag (its lines are checked above, as the
    speed stage's roofline part)."""
    spec = importlib.util.spec_from_file_location("roofline_check", ROOT / "benchmarks" / "roofline_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert check.main(["--device", "cpu", "--preset", "nope"]) == 1
    (error,) = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert error["error"].startswith("--preset nope: not a model preset; one of ")
