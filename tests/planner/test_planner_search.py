"""Search, calibration and the self-check against a real 2-rank CPU run."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import tiny_config

from fivefold.cli import main
from fivefold.config.load import load_config, read_config, replace
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.parallel.forked_ranks import run_workers
from fivefold.planner.calibration.collectives import fit_alpha_beta
from fivefold.planner.calibration.layers import config_parts
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware, load_profile
from fivefold.planner.search import candidates, search
from fivefold.planner.selfcheck import predict_for_config
from fivefold.train.metrics import read_metrics
from fivefold.validate import validate


def _small():
    return load_config(None, ["--model.preset=tiny", "--train.seq_len=64", "--train.global_batch=16"])


def test_search_returns_only_valid_fitting_layouts_and_writes_a_trainable_toml(tmp_path, capsys):
    res = search(_small(), 4, get_hardware("h100"), keep=50)
    assert res.ranked and res.tried == len(candidates(_small(), 4, 8))
    for cfg, est in res.ranked:
        assert validate(cfg, 4) == [] and est.fits
    times = [e.step_time_s for _, e in res.ranked]
    assert times == sorted(times)
    out = tmp_path / "best.toml"
    assert main(["plan", "--model", "tiny", "--gpus", "4", "--gpu", "h100", "--seq", "64", "--global-batch", "16",
                 "--out", str(out)]) == 0
    assert "rejected" in capsys.readouterr().out
    # what `fivefold train best.toml --nproc 4` checks before it starts any process
    cfg, errors = read_config(out, [f"--run.out_dir={tmp_path}"])
    assert errors == [] and validate(cfg, 4) == []


def test_validate_ignores_recompute_as_the_search_cache_assumes():
    for cfg in candidates(_small(), 4, 8)[:60]:
        base = validate(replace(cfg, train={"recompute": "none"}), 4)
        assert all(validate(replace(cfg, train={"recompute": r}), 4) == base for r in ("selective", "full"))


def test_alpha_beta_fit_recovers_its_own_model():
    alpha, beta = 20e-6, 2e9
    rows = []
    for op in ("all_reduce", "all_gather", "send"):
        for nbytes in (4096, 65536, 1 << 20):
            steps = {"all_reduce": 2, "send": 1}.get(op, 1)
            rows.append((op, nbytes, steps * alpha + wire_bytes(op, nbytes, 2) / beta))
    a, b = fit_alpha_beta(rows, 2)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(beta, rel=1e-6)


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path):
    """`fivefold calibrate --layers` on a pp2 config: the profile times the parts both stages run."""
    path = tmp_path / "local.toml"
    assert main(["calibrate", "--quick", "--out", str(path), "--layers", "configs/tiny.toml", "--parallel.pp=2"]) == 0
    back = load_profile(path)
    assert back.sources["intra_bw"].startswith("measured") and "calibration/layers" in back.sources["layer_times"]
    assert back.peak_flops > 1e8 and back.intra_bw > 1e6 and 0 < back.compute_efficiency <= 1
    cfg = tiny_config(tmp_path, "--parallel.pp=2")
    measured = back.pricer.profile
    keys = [k for k, _, _ in measured.layer_times]
    assert sorted(keys) == sorted(p.key for p in config_parts(cfg, 2))  # 8 alike blocks, embedding, head
    assert len(keys) == 3 and all(f > 0 and b > 0 for _, f, b in measured.layer_times)
    assert len(measured.noise_curve) == 5 and all(sigma >= 0 for _, sigma in measured.noise_curve)
    assert any("5 of 5 parts timed whole" in a for _, a, _ in estimate(cfg, 2, back, act_bytes=4).explain)


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).run_dir


# The replicated-shard layouts: ZeRO shards held by an HSDP replica or by the other cp rank, whose
# gradients are all-reduced over those ranks once a step (planner/comm.py's replica_traffic); the
# HSDP ones with 2 micro-batches, each reduce-scattered, the replicas' all-reduce at the last.
# zb_v: a V schedule, whose last rank hands its turn between its two stages over in memory. pp4:
# the log's figures are rank 0's, whose stage sends half what a middle stage does.
@pytest.mark.parametrize("world, layout", [
    (2, ("--parallel.zero=0",)), (2, ("--parallel.zero=1",)), (2, ("--parallel.tp=2",)),
    (2, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_overlap=true")),
    (2, ("--parallel.zero=3", "--train.fp8=tensorwise", "--parallel.fp8_gather=true")), (2, ("--parallel.pp=2",)),
    (2, ("--parallel.cp=2",)), (2, ("--parallel.cp=2", "--parallel.zero=1")),
    (4, ("--parallel.zero=2", "--parallel.dp_replicate=2", "--train.micro_batch=1")),
    (4, ("--parallel.zero=3", "--parallel.dp_replicate=2", "--train.micro_batch=1")),
    (2, ("--parallel.pp=2", "--parallel.pp_schedule=zb_v", "--parallel.virtual_stages=2", "--train.micro_batch=1")),
    (4, ("--parallel.pp=4", "--train.micro_batch=1")),
    # an MTP depth: its block's tp regions, its embedding and the head's (1 + D) tokens, its eh_proj's gradient
    # summed over tp under sp, the loss's gathers in 3 chunks of 48 of the head's 128 tokens; and on a pipeline's
    # last stage with the embedding's copy (model state) and its gradient summed with the first stage's
    (2, ("--parallel.tp=2", "--parallel.sp=true", "--model.mtp_layers=1", "--train.loss_chunk=48")),
    (2, ("--parallel.pp=2", "--model.mtp_layers=1"))],
    ids=["dp2", "dp2-zero1", "tp2", "tp2-sp-overlap", "zero3-fp8-gather", "pp2", "cp2", "cp2-zero1", "hsdp2x2-zero2",
         "hsdp2x2-zero3", "pp2-zb_v", "pp4", "tp2-sp-mtp-chunks", "pp2-mtp"])
def test_the_logged_prediction_matches_a_real_run(tmp_path, world, layout):
    """`fivefold train` logs the planner's prediction beside what it measures: model-state bytes
    and every axis's wire bytes agree within 5% (the self-check)."""
    cfg = tiny_config(tmp_path, "--train.steps=2", "--data.max_bytes=20000", *layout)
    run_dir = run_workers(_train, world, cfg)[0]
    measured = read_metrics(run_dir / cfg.run.metrics_file)[-1]  # step 2: AdamW's state exists
    predicted = measured["predicted"]
    assert predicted == predict_for_config(cfg, world)
    for part in ("params", "grads", "optimizer", "total"):
        assert predicted["model_state_bytes"][part] == pytest.approx(measured["model_state_bytes"][part],
                                                                     rel=0.05), part
    for axis, counted in measured["comm"].items():
        if axis != "log":
            assert predicted["comm_wire_bytes"][axis] == pytest.approx(counted["wire_bytes"], rel=0.05), axis


def test_calibrate_layers_refuses_a_config_that_cannot_run_before_measuring(tmp_path, capsys):
    out = tmp_path / "local.toml"
    assert main(["calibrate", "--quick", "--out", str(out), "--layers", "configs/tiny.toml", "--parallel.tp=3"]) == 2
    err = capsys.readouterr().err
    assert "--layers configs/tiny.toml on --nproc 2:" in err and "parallel.tp" in err
    assert main(["calibrate", "--quick", "--out", str(out), "--parallel.tp=2"]) == 2  # an override with no config
    assert "overrides apply to --layers configs" in capsys.readouterr().err
    assert not out.exists()  # nothing measured, nothing written


def test_the_planner_core_does_not_import_the_calibration_package():
    """A measured profile brings its pricer along (Hardware.pricer); the core never imports it, at
    module level or inside a function (this runs an estimate and a search on a catalog GPU)."""
    code = ("import sys\n"
            "from fivefold.config.load import load_config\n"
            "from fivefold.planner.machine.datasheet import get_hardware\n"
            "from fivefold.planner.estimate import estimate\n"
            "from fivefold.planner.search import search\n"
            "from fivefold.planner.selfcheck import predict_for_config\n"
            "cfg = load_config(None, ['--model.preset=tiny', '--train.seq_len=64', '--train.global_batch=16'])\n"
            "estimate(cfg, 2, get_hardware('h100')); predict_for_config(cfg, 2)\n"
            "search(cfg, 2, get_hardware('h100'))\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('fivefold.planner.calibration'))\n"
            "assert not loaded, loaded\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
