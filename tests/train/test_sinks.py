"""Metric sinks (train/sinks.py): records and events written through each sink, then read back with
that sink's own reader: read_metrics/read_events, TensorBoard's EventAccumulator, W&B's offline
transaction log. Every scenario is two jobs: a fresh one that logs steps 1-4 and "crashes", and one
that resumes from the checkpoint of step 2 and logs steps 3-5 again with other values."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT

from fivefold.config.load import replace
from fivefold.config.schema import Config
from fivefold.train.metrics import read_events, read_metrics
from fivefold.train.sinks import flatten, open_sinks, preflight
from fivefold.validate import validate

CHECKPOINT = 2  # the step the second job resumes from
LOSSES = {1: 9.0, 2: 8.0, 3: 103.0, 4: 104.0, 5: 105.0}  # steps 3 and 4 as the resumed job logged them


def record(step: int, loss: float) -> dict:
    """A step record shaped like the training loop's (train/metrics.py)."""
    return {
        "step": step, "epoch": 0, "loss": loss, "lr": 1e-3, "grad_norm": math.inf if step == 5 else 0.5,
        "tokens": 512, "samples": [8 * (step - 1), 8 * step], "step_time_s": 0.25, "tokens_per_s": 2048.0,
        "comm": {"dp": {"calls": 1, "bytes": 4096, "wire_bytes": 6000 + step}},
        "model_state_bytes": {"params": 100, "grads": 100, "optimizer": 200, "total": 400 + step},
        "predicted": None, "skipped": False, "step_breakdown": {"compute": 0.2, "unattributed": 0.05},
        "expert_load": {"layers.1.ffn": [3, 5]}, "expert_max_over_mean": {"layers.1.ffn": 1.0 + step / 10},
        "pipeline_timeline": [[[0.0, 0.1, "F0s0"]]],
    }


def two_jobs(cfg: Config, run_dir: Path, after_crash: Callable[[], None] = lambda: None) -> None:
    with pytest.raises(RuntimeError, match="dies"), open_sinks(cfg, run_dir, None) as sinks:
        sinks.event(0, "start")
        sinks.event(0, "layout", world_size=2, dp=2, tp=1, pp=1, cp=1, ep=1)
        for step in range(1, 5):
            sinks.write(record(step, 10.0 - step))
        raise RuntimeError("the job dies after step 4")  # the sinks close on the way out, marked failed
    after_crash()
    with open_sinks(cfg, run_dir, CHECKPOINT) as sinks:
        sinks.event(CHECKPOINT, "resume", checkpoint="checkpoints/step_00000002")
        for step in range(CHECKPOINT + 1, 6):
            sinks.write(record(step, 100.0 + step))


def with_sinks(*sinks: str, **run: object) -> Config:
    return replace(Config(), run={"sinks": ("jsonl", *sinks), **run})


EXPECTED_EVENTS = [("start", 0), ("layout", 0), ("resume", CHECKPOINT)]


def test_jsonl_keeps_steps_and_events_in_one_file_and_drops_what_followed_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"

    def cut_a_line() -> None:
        with path.open("a") as f:
            f.write('{"step": 5, "lo')  # the crash cut this line mid-write
        assert [r["step"] for r in read_metrics(path)] == [1, 2, 3, 4]  # a reader skips it

    cfg = with_sinks()
    two_jobs(cfg, tmp_path, cut_a_line)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert all("step" in r for r in lines)  # every line carries step
    steps = read_metrics(path)
    assert {r["step"]: r["loss"] for r in steps} == LOSSES and [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert math.isinf(steps[-1]["grad_norm"])
    assert [(e["event"], e["step"]) for e in read_events(path)] == EXPECTED_EVENTS
    assert read_events(path)[1] == {"step": 0, "event": "layout", "world_size": 2, "dp": 2, "tp": 1, "pp": 1,
                                    "cp": 1, "ep": 1}
    with open_sinks(cfg, tmp_path, None):  # a fresh run in the same folder starts an empty file
        pass
    assert path.read_text() == ""


def test_records_and_events_are_checked():
    assert flatten(record(3, 1.5)) == {
        "epoch": 0, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens": 512, "step_time_s": 0.25,
        "tokens_per_s": 2048.0, "comm/dp/calls": 1, "comm/dp/bytes": 4096, "comm/dp/wire_bytes": 6003,
        "model_state_bytes/params": 100, "model_state_bytes/grads": 100, "model_state_bytes/optimizer": 200,
        "model_state_bytes/total": 403, "skipped": 0, "step_breakdown/compute": 0.2,
        "step_breakdown/unattributed": 0.05, "expert_max_over_mean/layers.1.ffn": 1.3,
    }  # samples, expert_load, pipeline_timeline (lists) and predicted (null) are no scalars


def test_a_wrong_record_or_event_kind_raises(tmp_path):
    with open_sinks(with_sinks(), tmp_path, None) as sinks:
        with pytest.raises(ValueError, match="kinds are start, resume, restart, layout"):
            sinks.event(1, "checkpointed")
        with pytest.raises(ValueError, match="needs 'step' and no 'event'"):
            sinks.write({"step": 1, "event": "start"})


def test_validate_names_unknown_sinks_a_missing_jsonl_and_missing_packages(monkeypatch):
    cfg = with_sinks("tensorboard", "wandb", "tensorbord")
    assert validate(cfg, 1) == ["run.sinks: unknown sink 'tensorbord'; choose among 'jsonl', 'tensorboard', 'wandb'"]
    assert validate(with_sinks("wandb", wandb_project="me/proj"), 1) == [
        "run.wandb_project = 'me/proj': W&B project names are 1 to 128 characters without / \\ # ? % :"]
    assert "leaves out 'jsonl'" in validate(replace(Config(), run={"sinks": ("tensorboard",)}), 1)[0]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert validate(with_sinks("tensorboard", "wandb"), 1) == [
        "run.sinks includes 'wandb' but the wandb package is not installed: pip install 'fivefold[wandb]' "
        "(make install does), or remove it from run.sinks"]


def test_the_default_sink_imports_neither_torch_nor_tensorboard_nor_wandb(tmp_path):
    code = ("import sys; from pathlib import Path; from fivefold.config.schema import Config; "
            "from fivefold.train.sinks import open_sinks; from fivefold.validate import validate; "
            f"assert validate(Config(), 1) == []; open_sinks(Config(), Path({str(tmp_path)!r}), None).close(); "
            "print(sorted(m for m in ('torch', 'tensorboard', 'wandb') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_tensorboard_scalars_by_path_events_as_text_and_the_resume_purges_later_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"")  # an earlier attempt's file
    two_jobs(with_sinks("tensorboard"), tmp_path)
    assert not (tmp_path / "tensorboard" / "events.out.tfevents.1.old").exists()  # a fresh run cleared it
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss", "comm/dp/wire_bytes", "step_breakdown/compute", "model_state_bytes/total",
            "expert_max_over_mean/layers.1.ffn", "skipped"} <= tags
    assert not tags & {"step", "samples", "predicted", "expert_load/layers.1.ffn", "pipeline_timeline"}
    # The purge marker of the resumed job hid the first job's steps 3 and 4: each step once, the new values.
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == list(LOSSES.items())
    assert [(e.step, e.value) for e in acc.Scalars("comm/dp/wire_bytes")] == [(s, 6000 + s) for s in LOSSES]
    assert [e.value for e in acc.Scalars("expert_max_over_mean/layers.1.ffn")] == pytest.approx(
        [1.0 + s / 10 for s in LOSSES])
    assert math.isinf(acc.Scalars("grad_norm")[-1].value)
    events = [json.loads(e.tensor_proto.string_val[0]) for e in acc.Tensors("events/text_summary")]
    assert [(e["event"], e["step"]) for e in events] == EXPECTED_EVENTS
    assert events[2]["checkpoint"] == "checkpoints/step_00000002"


# W&B's offline run: RUN_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb, a LevelDB-style log
# (github.com/google/leveldb/blob/main/doc/log_format.md) of wandb_internal_pb2.Record protobufs after a
# 7-byte header (":W&B", magic 0xBEE1, version 0). wandb 0.31 has no Python reader of it (wandb-core,
# in Go, reads it for `wandb sync`), so the test reads it: 32 KiB blocks of chunks, each with a CRC-32
# (seeded with the chunk type), a length and a type (1 full, 2 first, 3 middle, 4 last).
def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zeros: the end of what was written
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at byte {pos}"
        pending, pos = pending + chunk, pos + 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def wandb_runs(run_dir: Path) -> list[dict]:
    """Per offline job, in start order: its run id, config and {step: {key: value}} history."""
    runs = []
    for path in (run_dir / "wandb").glob("offline-run-*/run-*.wandb"):
        history, config, run, exit_code = {}, {}, None, None
        for r in wandb_records(path):
            kind = r.WhichOneof("record_type")
            if kind in ("run", "config"):  # the run record carries the config given to wandb.init
                run = r.run if kind == "run" else run
                items = r.run.config.update if kind == "run" else r.config.update
                config.update({item.key: json.loads(item.value_json) for item in items})
            elif kind == "exit":
                exit_code = r.exit.exit_code
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                history[r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        runs.append({"id": run.run_id, "start": run.start_time.ToNanoseconds(), "config": config,
                     "history": history, "exit_code": exit_code})
    return sorted(runs, key=lambda r: r["start"])


def child_processes() -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # it ended while we looked
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            found.append(stat.split(")", 1)[0] + ")")
    return found


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """W&B's settings, cache and credentials in tmp_path (child processes inherit them); the name
    lookups of this process recorded."""
    if importlib.util.find_spec("wandb") is None:  # not imported here: the offline test runs it in a child
        pytest.skip("wandb is not installed: pip install 'fivefold[wandb]'")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    for name, sub in (("HOME", "home"), ("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"),
                      ("WANDB_DATA_DIR", "data"), ("NETRC", "home/netrc")):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / sub))
    lookups = []
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: (lookups.append(host), real(host, *a, **k))[1])
    yield lookups
    if "wandb" in sys.modules:  # wandb's process-wide state read this test's settings: forget them
        sys.modules["wandb"].teardown()


# In a process of its own, to watch it to the end: wandb's exit hooks are where its telemetry would
# reach out, and where a left-over service process would show.
WANDB_JOBS = """
import atexit, socket, sys
from pathlib import Path
lookups, real = [], socket.getaddrinfo
socket.getaddrinfo = lambda host, *a, **k: (lookups.append(host), real(host, *a, **k))[1]
atexit.register(lambda: print("lookups", lookups, flush=True))  # first registered, so it runs last
sys.path[:0] = ["tests", "tests/train"]  # helpers, and this file
from test_sinks import child_processes, two_jobs, with_sinks
two_jobs(with_sinks("wandb", name="tiny"), Path(sys.argv[1]))
print("children", child_processes(), flush=True)
"""


def test_wandb_offline_run_logs_each_step_and_continues_the_same_run_on_resume(tmp_path, wandb_home):
    run_dir = tmp_path / "run"
    out = subprocess.run([sys.executable, "-c", WANDB_JOBS, str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    # wandb-core, the service process each run starts, is gone after close; offline, no host was looked
    # up (wandb's own telemetry included), to the end of the process.
    assert out.stdout.splitlines() == ["children []", "lookups []"], out.stdout
    first, second = wandb_runs(run_dir)
    assert first["id"] == second["id"]  # one W&B run per run directory
    assert (first["exit_code"], second["exit_code"]) == (1, 0)  # the first job died
    assert first["config"]["run"]["sinks"] == ["jsonl", "wandb"] and first["config"]["train"]["steps"] == 100
    assert sorted(first["history"]) == [0, 1, 2, 3, 4] and sorted(second["history"]) == [2, 3, 4, 5]
    # Each job's steps with their values; `wandb sync` keeps the first job's 3 and 4 (see WandbSink).
    assert {s: h["loss"] for s, h in first["history"].items() if s} == {1: 9.0, 2: 8.0, 3: 7.0, 4: 6.0}
    assert {s: h["loss"] for s, h in second["history"].items() if s > CHECKPOINT} == {3: 103.0, 4: 104.0, 5: 105.0}
    step = second["history"][5]
    assert step["comm/dp/wire_bytes"] == 6005 and step["model_state_bytes/total"] == 405
    assert step["expert_max_over_mean/layers.1.ffn"] == 1.5 and math.isinf(step["grad_norm"])
    assert "samples" not in step and "predicted" not in step
    texts = [first["history"][0]["events"], second["history"][CHECKPOINT]["events"]]
    events = [json.loads(line) for text in texts for line in text.splitlines()]
    assert [(e["event"], e["step"]) for e in events] == EXPECTED_EVENTS  # two events at step 0, both kept


def test_wandb_online_without_credentials_fails_at_once_without_a_prompt(tmp_path, wandb_home):
    cfg = with_sinks("wandb", wandb_mode="online")
    assert "no W&B API key is configured: run `wandb login`" in preflight(cfg)[0]
    with pytest.raises(RuntimeError, match="set run.wandb_mode = 'offline'"):
        open_sinks(cfg, tmp_path, None)
    assert not [c for c in child_processes() if "wandb" in c] and wandb_home == []  # nothing started


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def test_a_training_run_writes_its_steps_and_events_to_every_sink(tmp_path):
    """The training loop's own records through JSONL and TensorBoard: the same losses in both, the
    start and layout events first, and the resumed job's resume event (its steps replace those after
    the checkpoint)."""
    pytest.importorskip("tensorboard")
    from helpers import tiny_config
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from fivefold.parallel.forked_ranks import run_workers

    args = ("--run.sinks=['jsonl', 'tensorboard']", "--train.steps=4", "--checkpoint.every=2",
            "--data.max_bytes=4000", "--data.val_fraction=0", "--parallel.tp=2")
    losses = run_workers(_train, 2, tiny_config(tmp_path, *args))[0]
    resumed = run_workers(_train, 2, tiny_config(tmp_path, *args, "--checkpoint.resume=true"))[0]
    assert resumed == []  # the run had ended at step 4: nothing left to do, and nothing is lost
    run_dir = tmp_path / "tiny"
    steps = read_metrics(run_dir / "metrics.jsonl")
    assert [r["loss"] for r in steps] == losses and [r["step"] for r in steps] == [1, 2, 3, 4]
    events = read_events(run_dir / "metrics.jsonl")
    assert [(e["event"], e["step"]) for e in events] == [("start", 0), ("layout", 0), ("resume", 4), ("layout", 4)]
    assert {k: events[1][k] for k in ("world_size", "tp", "dp_shard", "pp")} == {"world_size": 2, "tp": 2,
                                                                                 "dp_shard": 1, "pp": 1}
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Scalars("loss")
    assert [e.step for e in scalars] == [1, 2, 3, 4]
    assert [e.value for e in scalars] == pytest.approx(losses, rel=1e-6)  # TensorBoard keeps float32
    assert {"comm/tp/wire_bytes", "step_breakdown/compute", "model_state_bytes/total"} <= set(acc.Tags()["scalars"])
