"""Out of memory, handled (train/oom.py): an injected torch.OutOfMemoryError on CPU writes the
rank's snapshot and ends the run with one line; the last checkpoint stays as it was."""

import os
import pickle
import subprocess
import sys

import torch
from helpers import ROOT, tiny_config

from fivefold.checkpoint.run_dir import checkpoint_dir, complete_checkpoints
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train import oom
from fivefold.train.oom import pricing_hardware
from fivefold.validate import validate

OOM_AT = 2  # 0-based: the third step runs out, after the checkpoint of step 2 (checkpoint.every = 2)
ARGS = ("--data.max_bytes=20000", "--train.steps=5", "--checkpoint.every=2", "--data.val_fraction=0.0")
# The planner's peak for the tiny model on one rank is 8.08 MiB (micro_batch 2, no recompute);
# micro_batch 1 needs 6.85, full recompute 5.92: each alone fits in 7 MiB, and the planner prices
# full recompute faster (one more forward, against twice the micro-batches' per-pass host time).
CAPACITY = 7 * 2**20


def _profile(folder):
    path = folder / "small.toml"
    path.write_text(f'[hardware]\nbase = "h100"\nmemory_bytes = {CAPACITY}\n')
    return path


def _inject(at: int = OOM_AT) -> None:
    """In this (forked) worker: the loop's step `at` raises what the CUDA allocator raises."""
    from fivefold.train import loop

    real = loop.train_step

    def step(run, index, trace=False):
        if index == at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(run, index, trace=trace)

    loop.train_step = step


def _line_of_oom(cfg) -> str | None:
    """Train `cfg` in this worker: the one line it ended with (None: it did not run out)."""
    from fivefold.train.loop import train

    try:
        train(cfg, progress=False)
    except oom.OutOfMemory as e:
        return str(e)
    return None


def _train_until_oom(rank, world, cfg):
    _inject()
    return _line_of_oom(cfg)


def test_injected_oom_writes_its_snapshot_and_one_line(tmp_path):
    cfg = tiny_config(tmp_path, *ARGS, f"--run.hardware={_profile(tmp_path)}")
    [line] = run_workers(_train_until_oom, 1, cfg)
    run_dir = tmp_path / "tiny"
    snapshot = run_dir / "memory_snapshot_rank0.pickle"
    assert line == (f"rank 0: out of memory at step 3: the planner predicted a peak of 8.1 MiB against the "
                    f"device's 7.0 MiB; snapshot: {snapshot} (open it at https://pytorch.org/memory_viz); "
                    f"the cheapest layout change that fits: --train.recompute=full (planner: 5.9 MiB); "
                    f"for the allocation history rerun with --train.memory_snapshot=true")
    report = pickle.loads(snapshot.read_bytes())  # the file memory_viz opens: empty on a CPU
    assert report["segments"] == [] and report["device_traces"] == []
    facts = report["fivefold_oom"]
    assert (facts["rank"], facts["step"], facts["capacity_bytes"]) == (0, 3, CAPACITY)
    assert facts["demand_bytes"] == CAPACITY  # on a CPU no held bytes are known: at least what it ran out of
    assert round(facts["predicted_peak_bytes"] / 2**20, 2) == 8.08
    assert facts["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 MiB"
    assert not [p for p in run_dir.iterdir() if p.name.startswith(".")]  # no temporary file left
    # The checkpoint of step 2 is complete and the only one: nothing of step 3 was written.
    assert complete_checkpoints(run_dir) == [checkpoint_dir(run_dir) / "step_00000002"]
    assert sorted(p.name for p in checkpoint_dir(run_dir).iterdir()) == ["step_00000002"]
    # ... and loads: the run resumes from it and finishes.
    resumed = tiny_config(tmp_path, *ARGS, "--checkpoint.resume=true", "--train.steps=3")
    [start] = run_workers(_resume, 1, resumed)
    assert start == 2


def _resume(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).start_step


def test_every_rank_that_runs_out_writes_its_own_snapshot(tmp_path):
    """Two ranks run out at the same step (a layout too large runs out everywhere): each names
    itself and its snapshot; without a capacity, the one setting that saves the most (ZeRO-3 over dp 2)."""
    lines = run_workers(_train_until_oom, 2, tiny_config(tmp_path, *ARGS, "--parallel.dp=2"))
    for rank, line in enumerate(lines):
        snapshot = tmp_path / "tiny" / f"memory_snapshot_rank{rank}.pickle"
        assert "\n" not in line
        assert line.startswith(f"rank {rank}: out of memory at step 3: the planner predicted a peak of ")
        assert f"against a capacity unknown (set run.hardware); snapshot: {snapshot} (open it" in line
        assert line.endswith("; the layout change of fewest settings that lowers the planner's peak most: "
                             "--parallel.zero=3 (planner: 5.4 MiB); for the allocation history rerun with "
                             "--train.memory_snapshot=true")
        assert pickle.loads(snapshot.read_bytes())["fivefold_oom"]["rank"] == rank
    assert complete_checkpoints(tmp_path / "tiny") == [checkpoint_dir(tmp_path / "tiny") / "step_00000002"]


def _setup_oom(rank, world, cfg):
    from fivefold.train import loop

    def fill(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")

    loop.fill_weights = fill  # the seeded initialisation runs out, before any step
    return _line_of_oom(cfg)


def test_running_out_while_setting_up_is_said_too(tmp_path):
    cfg = tiny_config(tmp_path, *ARGS, f"--run.hardware={_profile(tmp_path)}")
    [line] = run_workers(_setup_oom, 1, cfg)
    assert line.startswith("rank 0: out of memory while setting up: the planner predicted a peak of 8.1 MiB against "
                           "the device's 7.0 MiB; snapshot: ")
    snapshot = pickle.loads((tmp_path / "tiny" / "memory_snapshot_rank0.pickle").read_bytes())
    assert snapshot["fivefold_oom"]["step"] is None


def test_the_command_ends_with_the_line_and_no_traceback(tmp_path):
    """`fivefold train` as one process: its last words are the line (stderr), exit status 1."""
    inject = ("import sys; sys.path.insert(0, 'tests'); from train.test_oom import _inject; _inject(); "
              "from fivefold.cli import main; sys.exit(main(sys.argv[1:]))")
    out = subprocess.run([sys.executable, "-c", inject, "train", "configs/tiny.toml", f"--run.out_dir={tmp_path}",
                          *ARGS, "--no-progress"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("fivefold: rank 0: out of memory at step 3: the planner predicted a peak of 8.1 MiB "
                           "against a capacity unknown"), last
    assert (tmp_path / "tiny" / "memory_snapshot_rank0.pickle").is_file()


def test_a_planner_that_under_predicted_scales_its_figures(tmp_path):
    """The tiny model's 8.08 MiB on a 9 MiB device that ran out: what the step wanted (here 9.5 MiB:
    PyTorch's held bytes plus the failed request, on CUDA) says the planner under-predicts by 9.5 / 8.08,
    so a change must fit with its peak scaled alike: full recompute (5.92), not selective (8.05),
    which the bare prediction would take (it predicts less than 8.08 and is faster)."""
    cfg, hw, mib = tiny_config(tmp_path), pricing_hardware(tiny_config(tmp_path)), 2**20
    peak = oom.predicted_peak(cfg, 1, 0, "cpu")
    assert oom.cheapest_change(cfg, 1, hw, "cpu", 9 * mib, peak, 9 * mib)[0] == ["--train.recompute=selective"]
    assert oom.cheapest_change(cfg, 1, hw, "cpu", 9 * mib, peak, 9.5 * mib)[0] == ["--train.recompute=full"]
    assert oom.cheapest_change(cfg, 1, hw, "cpu", 5 * mib, peak, 5 * mib) == (
        "no layout change fits: none of the 8 other valid layouts of 1 rank does")
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity")
    assert oom.demand(error, torch.device("cpu"), 1 * 2**30) == 1.5 * 2**30  # the request alone: more than the device
    assert oom.demand(error, torch.device("cpu"), None) is None


def test_memory_snapshot_records_python_stacks_bounded(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k)))
    on = tiny_config(tmp_path, "--train.memory_snapshot=true", "--train.memory_snapshot_entries=5000")
    assert not oom.record_history(tiny_config(tmp_path), "cuda")  # off by default
    assert not oom.record_history(on, "cpu")  # no caching allocator to record
    assert calls == []
    assert oom.record_history(on, "cuda")
    assert calls == [((), {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 5000})]


def test_memory_snapshot_entries_must_be_positive(tmp_path):
    errors = validate(tiny_config(tmp_path, "--train.memory_snapshot_entries=0"), 1)
    assert "train.memory_snapshot_entries = 0: must be at least 1" in errors
