"""--expert-imbalance from a run's logged routing (planner/routing.py) against hand arithmetic."""

from __future__ import annotations

import json

import pytest

from fivefold.cli import main
from fivefold.planner.routing import busiest_rank_share, imbalance_by_ep, read_expert_loads

# Two logged steps of a 4-expert model with two MoE blocks, as train/metrics.py writes them
# (an event record and a cut last line too, which the reader skips).
RECORDS = [{"step": 0, "event": "start"},
           {"step": 1, "loss": 2.0, "expert_load": {"layers.0.ffn": [6, 2, 1, 1], "layers.1.ffn": [1, 1, 1, 1]}},
           {"step": 2, "loss": 1.9, "expert_load": {"layers.0.ffn": [0, 0, 3, 1], "layers.1.ffn": [2, 2, 2, 2]}}]


def _run(tmp_path, records=RECORDS):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + '\n{"step": 3, "expert_lo')
    return run


def test_busiest_rank_share_by_hand(tmp_path):
    """ep 2 holds experts {0, 1} and {2, 3}: [6, 2, 1, 1] puts 8 of 10 copies on rank 0, 8 / 5 = 1.6;
    [1, 1, 1, 1] and [2, 2, 2, 2] are balanced, 1; [0, 0, 3, 1] 4 / 2 = 2: the mean 1.4. At ep 4,
    6 / 2.5 = 2.4, 1, 3 / 1 = 3, 1: the mean 1.85."""
    loads = read_expert_loads(_run(tmp_path))
    assert loads == ((6, 2, 1, 1), (1, 1, 1, 1), (0, 0, 3, 1), (2, 2, 2, 2))
    assert busiest_rank_share(loads, 2) == pytest.approx(1.4)
    assert busiest_rank_share(loads, 4) == pytest.approx(1.85)
    assert busiest_rank_share(loads, 1) == 1.0
    assert imbalance_by_ep(loads) == ((1, 1.0), (2, busiest_rank_share(loads, 2)), (4, busiest_rank_share(loads, 4)))


def test_a_run_directory_prices_as_its_measured_number(tmp_path, capsys):
    argv = ["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "64", "--global-batch", "8",
            "--layout", "dp=4,ep=2,micro_batch=2", "--json"]
    assert main([*argv, "--expert-imbalance", str(_run(tmp_path))]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert main([*argv, "--expert-imbalance", "1.4"]) == 0
    assert json.loads(capsys.readouterr().out) == measured
    assert main([*argv, "--expert-imbalance", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["comm_bytes_per_step"]["ep"] < measured["comm_bytes_per_step"]["ep"]


def test_bad_run_directories_get_one_line(tmp_path, capsys):
    argv = ["plan", "--model", "tiny-moe", "--gpus", "4", "--seq", "64", "--layout", "dp=4,ep=2", "--json"]
    assert main([*argv, "--expert-imbalance", str(tmp_path / "nowhere")]) != 0
    assert "cannot read" in capsys.readouterr().err
    dense = _run(tmp_path, [{"step": 1, "loss": 2.0}])
    assert main([*argv, "--expert-imbalance", str(dense)]) != 0
    assert "no expert_load records" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text(json.dumps({"step": 1, "expert_load": {"b": [1] * 8}}) + "\n")
    assert main([*argv, "--expert-imbalance", str(other)]) != 0
    assert "routed to 8 experts, this model has 4" in capsys.readouterr().err
