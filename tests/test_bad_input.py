"""Damaged files and values validate() used to accept: each named in one line before a worker starts."""

import os
import pickle
import shutil

import pytest
import torch
from helpers import EQUIVALENCE, QLORA, tiny_config

from fivefold.checkpoint.files import checkpoint_errors
from fivefold.checkpoint.run_state import latest_checkpoint
from fivefold.cli import main
from fivefold.config.load import ConfigError, load_config
from fivefold.train.loop import train
from fivefold.train.preflight import preflight
from fivefold.validate import validate


class Gadget:  # not a tensor: weights_only refuses to build it, and nothing in it runs
    pass


def test_each_damaged_checkpoint_file_is_named_before_the_resume(tmp_path):
    train(tiny_config(tmp_path, *EQUIVALENCE, "--train.steps=1"), progress=False)
    good = latest_checkpoint(tmp_path / "tiny")
    assert checkpoint_errors(good) == []
    resume = tiny_config(tmp_path, *EQUIVALENCE, "--train.steps=2", "--checkpoint.resume=true")

    def damaged(how) -> list[str]:
        shutil.copytree(good, tmp_path / "good", dirs_exist_ok=True)
        how(good)
        errors = preflight(resume, 1)
        shutil.rmtree(good)
        shutil.copytree(tmp_path / "good", good)
        return errors

    errors = damaged(lambda c: (c / "state.json").write_text("{ step: 1"))
    assert len(errors) == 1 and errors[0].startswith(f"{good / 'state.json'}: not the state fivefold wrote")
    assert f"delete {good}" in errors[0]

    errors = damaged(lambda c: (c / "rng" / "rank0.pt").write_bytes(pickle.dumps(Gadget())))
    assert len(errors) == 1 and errors[0].startswith(f"{good / 'rng' / 'rank0.pt'}: not an RNG state")
    assert "weights_only" not in errors[0]  # torch's advice to load it unsafely is not passed on
    errors = damaged(lambda c: torch.save({"a": 1}, c / "rng" / "rank0.pt"))
    assert len(errors) == 1 and "holds dict, not a uint8 RNG state" in errors[0]
    data = next(good.glob("*.distcp"))
    errors = damaged(lambda c: data.write_bytes(data.read_bytes()[:100]))
    assert len(errors) == 1 and errors[0].startswith(f"{data}: 100 bytes where its index needs")
    # Through the command line: one line, exit code 2, nothing trained.
    (good / "state.json").write_text("garbage")
    code = main(["train", "configs/tiny.toml", *EQUIVALENCE, f"--run.out_dir={tmp_path}", "--train.steps=2",
                 "--resume", "--no-progress"])
    assert code == 2 and latest_checkpoint(tmp_path / "tiny") == good


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused(tmp_path, value):
    errors = validate(tiny_config(tmp_path, f"--optim.lr={value}"), 1)
    assert errors == [f"optim.lr = {float(value)!r}: must be a finite number"]


def test_only_hints_that_can_fix_it(tmp_path):
    cfg = tiny_config(tmp_path, "--train.global_batch=16", "--train.micro_batch=1")
    (error,) = [e for e in validate(cfg, 9) if "global_batch" in e]
    assert "a micro_batch" not in error and "a dp (processes / (pp x cp x tp)) in {1, 2, 4, 8, 16}" in error
    (error,) = [e for e in validate(tiny_config(tmp_path, "--train.global_batch=12", "--train.micro_batch=4"), 2)
                if "global_batch" in e]
    assert "a micro_batch in {1, 2, 3, 6}" in error


def test_a_bad_size_is_reported_once(tmp_path):
    assert validate(tiny_config(tmp_path, "--train.steps=-5"), 1) == ["train.steps = -5: must be at least 1"]


def test_a_binary_config_and_nproc_zero_are_one_line(tmp_path, capsys):
    config = tmp_path / "x.toml"
    config.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(ConfigError, match=r"x.toml: not a text file \(not UTF-8\)"):
        load_config(config)
    assert main(["train", str(config)]) == 2
    assert main(["train", "configs/tiny.toml", "--nproc", "0", f"--run.out_dir={tmp_path}"]) == 2
    assert "--nproc = 0: must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "tiny").exists()


def test_more_processes_than_cores_warns(tmp_path, capsys, monkeypatch):
    import fivefold.train.cli as cli

    monkeypatch.setattr(cli.os, "cpu_count", lambda: 1)
    cli._warn_oversubscribed(tiny_config(tmp_path, "--train.device=cpu"), 2)
    assert "2 processes on 1 CPU cores" in capsys.readouterr().err
    cli._warn_oversubscribed(tiny_config(tmp_path, "--train.device=cpu"), 1)
    assert capsys.readouterr().err == ""


def test_a_full_disk_leaves_no_half_line_in_the_metrics_log(tmp_path, monkeypatch):
    import errno
    import os

    from fivefold.train import sinks

    sink = sinks.JsonlSink(tmp_path / "metrics.jsonl", None)
    sink.write({"step": 1, "loss": 1.0})
    real = os.write

    def half_then_full(fd, data):  # the kernel takes part of the line, then the disk is full
        if len(data) > 8:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sinks.os, "write", half_then_full)
    with pytest.raises(sinks.MetricsWriteError, match=r"metrics.jsonl: no space left writing the step record"):
        sink.write({"step": 2, "loss": 0.5})
    monkeypatch.setattr(sinks.os, "write", real)
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_torch_zip_writer_error_on_a_full_disk_reads_as_no_space(tmp_path, monkeypatch):
    import errno
    import shutil as shutil_module

    from fivefold.checkpoint import run_state

    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4480 vs 4374")
    assert run_state._os_error(error, tmp_path / "gone") is None  # plenty of space here: not a full disk
    usage = shutil_module.disk_usage(tmp_path)._replace(free=4096)
    monkeypatch.setattr(run_state.shutil, "disk_usage", lambda path: usage)
    cause = run_state._os_error(error, tmp_path / "gone")
    assert cause.errno == errno.ENOSPC and cause.filename == str(tmp_path) and "4,096 bytes free" in cause.strerror


@pytest.mark.parametrize("damage", ["garbage", "huge_length", "bad_offsets", "truncated"])
def test_a_damaged_safetensors_header_is_named_before_any_process(tmp_path, damage):
    import struct

    from fivefold.checkpoint.weights import check_init_from

    seed = tmp_path / "seed"
    assert main(["init", "configs/tiny.toml", "--out", str(seed)]) == 0
    file = seed / "model.safetensors"
    data = file.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + n]
    shifted = header.replace(b'"data_offsets":[0,', b'"data_offsets":[9,')  # offsets past the data
    file.write_bytes({"garbage": b"\x13\x37" * 100,
                      "huge_length": struct.pack("<Q", 1 << 60) + data[8:],
                      "bad_offsets": data[:8] + shifted + data[8 + n:],
                      "truncated": data[: len(data) // 2]}[damage])
    (error,) = check_init_from(tiny_config(tmp_path, f"--checkpoint.init_from={seed}"))
    assert f"{file}: not a readable safetensors file" in error and "\n" not in error


def test_a_failed_convert_leaves_no_partial_output(tmp_path, monkeypatch):
    from fivefold.checkpoint import convert

    seed = tmp_path / "seed"
    assert main(["init", "configs/tiny.toml", "--out", str(seed)]) == 0

    called = []

    def dies(src, out, *args):  # a file half written, then the disk is full
        called.append(out)
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "fivefold_to_hf", dies)
    out = tmp_path / "hf"
    assert main(["convert", "--to", "hf", str(seed), str(out)]) == 2
    assert called, "the conversion never ran"
    assert not out.exists() and not any(p.name.startswith(".hf") for p in tmp_path.iterdir())


def test_convert_names_a_damaged_checkpoint_file_and_writes_nothing(tmp_path, capsys):
    train(tiny_config(tmp_path, *EQUIVALENCE, "--train.steps=1"), progress=False)
    checkpoint = latest_checkpoint(tmp_path / "tiny")
    data = next(checkpoint.glob("*.distcp"))
    whole = data.read_bytes()
    out = tmp_path / "hf"
    data.write_bytes(whole[:1000])  # cut short: found from its size, before any tensor is read
    capsys.readouterr()  # (what training printed)
    assert main(["convert", "--to", "hf", str(checkpoint), str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fivefold: {data}: 1,000 bytes where its index needs ") and err.count("\n") == 1
    assert "convert another one of the run" in err and not out.exists()
    data.write_bytes(b"\xff" * 1000 + whole[1000:])  # garbage within its size: found when it is read
    assert main(["convert", "--to", "hf", str(checkpoint), str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"fivefold: {checkpoint}: reading ") and "not data torch.save wrote" in err
    assert "weights_only" not in err and not out.exists()
    assert not any(p.name.startswith(".hf") for p in tmp_path.iterdir())


def test_a_stale_or_dead_lock_is_taken_over_and_a_live_one_refuses(tmp_path, capsys):
    import json
    import socket
    import subprocess
    import sys
    import time

    from fivefold.launch.run_lock import STALE_S, RunLock

    run_dir = tmp_path / "tiny"
    run_dir.mkdir()
    lock = run_dir / ".lock"
    args = ["train", "configs/tiny.toml", *EQUIVALENCE, f"--run.out_dir={tmp_path}", "--train.steps=1",
            "--no-progress"]
    here = socket.gethostname()
    lock.write_text(json.dumps({"host": here, "pid": os.getppid(), "heartbeat": time.time()}))  # alive
    assert main(args) == 2 and f"in use by the job of pid {os.getppid()} on host {here}" in capsys.readouterr().err
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    lock.write_text(json.dumps({"host": here, "pid": int(gone.stdout), "heartbeat": time.time()}))
    assert main(args) == 0
    assert "took over the stale lock" in capsys.readouterr().err and not lock.exists()  # released at the end
    old = time.time() - STALE_S - 1  # another host: only the heartbeat tells
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "heartbeat": old}))
    held = RunLock(run_dir)
    held.acquire()
    assert "no heartbeat for" in held.took_over and json.loads(lock.read_text())["pid"] == os.getpid()
    held.release()
    assert not lock.exists()


def test_a_partial_checkpoint_folder_of_a_dead_job_is_removed_at_the_next_start(tmp_path):
    train(tiny_config(tmp_path, *EQUIVALENCE, "--train.steps=1"), progress=False)
    partial = tmp_path / "tiny" / "checkpoints" / ".tmp_step_00000007"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    train(tiny_config(tmp_path, *EQUIVALENCE, "--train.steps=2", "--checkpoint.resume=true"), progress=False)
    assert not partial.exists() and latest_checkpoint(tmp_path / "tiny").name == "step_00000002"


# What attention may see (fivefold/validate/attention.py): one line each, naming the field.
ATTENTION_ERRORS = {
    "negative window": (("--model.attention.window=-2",),
                        "model.attention.window = -2: a sliding window needs a window of at least 1 token"),
    "pattern without a window": (("--model.attention.window_pattern=['sliding', 'full']",),
                                 "model.attention.window = 0: sliding layers in model.attention.window_pattern need "
                                 "a window"),
    "window of the whole sequence": (("--model.attention.window=32",),
                                     "model.attention.window = 32 is not shorter than train.seq_len = 32"),
    "unknown layer kind": (("--model.attention.window=4", "--model.attention.window_pattern=['local']"),
                           "model.attention.window_pattern holds ['local']: each entry is 'sliding' or 'full'"),
    "pattern of 3 over 8 layers": (("--model.attention.window=4",
                                    "--model.attention.window_pattern=['sliding', 'full', 'full']"),
                                   "model.attention.window_pattern has 3 entries, which do not divide "
                                   "model.n_layers = 8"),
    "sinks with sdpa": (("--model.attention.sinks=true", "--model.attention.backend=sdpa"),
                        "model.attention.backend = 'sdpa' does causal attention only, not model.attention.sinks"),
    "flex on a CPU": (("--model.attention.backend=flex", "--train.device=cpu"),
                      "model.attention.backend = 'flex' trains on CUDA only"),
}


@pytest.mark.parametrize("name", ATTENTION_ERRORS)
def test_attention_options_are_refused_by_name(tmp_path, name):
    args, message = ATTENTION_ERRORS[name]
    errors = validate(tiny_config(tmp_path, *args), 1)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_documents_need_an_end_of_document_token(tmp_path, capsys):
    """A tokenizer with no eos_token and none of the usual names: named before anything starts."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x): return x"] * 4, trainer=trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    code = main(["train", "configs/tiny.toml", f"--run.out_dir={tmp_path}", "--data.document_mask=true",
                 f"--data.tokenizer={tmp_path / 'tokenizer.json'}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "no end-of-document token" in err and str(tmp_path / "tokenizer.json") in err
    assert "Traceback" not in err


SPEED_ERRORS = {  # validate/speed.py: each switch against what it needs, or named as not built yet
    "tp_overlap without sp": (("--parallel.tp=2", "--parallel.tp_overlap=true"), 2,
                              "parallel.tp_overlap = true needs sequence parallel"),
    "tp_overlap with fp8": (("--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_overlap=true",
                             "--train.fp8=tensorwise"), 2,
                            "parallel.tp_overlap = true is not built yet with train.fp8 = 'tensorwise'"),
    "tp_overlap with a split backward": (("--parallel.tp=2", "--parallel.sp=true", "--parallel.tp_overlap=true",
                                          "--parallel.pp=2", "--parallel.pp_schedule=zb_h1"), 4,
                                         "parallel.tp_overlap = true is not built yet with "
                                         "parallel.pp_schedule = 'zb_h1'"),
    "ep_overlap without dualpipe_v": (("--parallel.ep_overlap=true",), 1,
                                      "parallel.ep_overlap = true pairs DualPipe's forward and backward chunks, "
                                      "but parallel.pp_schedule = '1f1b'"),
    "ep_overlap with ZeRO-3 resharding": (("--parallel.pp=2", "--parallel.pp_schedule=dualpipe_v",
                                           "--parallel.virtual_stages=2", "--parallel.dp=2", "--parallel.zero=3",
                                           "--parallel.reshard_after_forward=true", "--parallel.ep_overlap=true",
                                           "--train.micro_batch=1"), 4,
                                          "parallel.ep_overlap = true is not built yet with ZeRO-3's "
                                          "reshard_after_forward = true"),
    "offload params without ZeRO-3": (("--parallel.dp=2", "--parallel.zero=1", "--parallel.offload=params"), 2,
                                      "parallel.offload = 'params' moves ZeRO-3's parameter shards to the host"),
    "offload optimizer without ZeRO": (("--parallel.offload=optimizer",), 1,
                                       "parallel.offload = 'optimizer' moves the optimizer's shards to the host"),
    "fp8_gather without ZeRO-3": (("--train.fp8=tensorwise", "--parallel.fp8_gather=true"), 1,
                                  "parallel.fp8_gather = true gathers ZeRO-3's weights in FP8"),
}




OPTIMIZER_AND_LORA_ERRORS = {  # validate/__init__.py's optimizer checks (Muon, QK-clip) and validate/lora.py
    "muon's numbers": (("--optim.name=muon", "--optim.muon.momentum=1.0"), 1, "optim.muon: lr = 0.0"),
    "muon with offload": (("--optim.name=muon", "--parallel.dp=2", "--parallel.zero=1",
                           "--parallel.offload=optimizer"), 2,
                          "optim.name = 'muon' is not built yet with parallel.offload"),
    "qk_clip with sdpa": (("--optim.qk_clip=100", "--model.attention.backend=sdpa"), 1,
                          "optim.qk_clip reads each head's largest logit from the blockwise path's tiles"),
    "qk_clip with a q/k norm": (("--optim.qk_clip=100", "--model.norm.qk=true"), 1,
                                "optim.qk_clip scales W_q and W_k, which model.norm.qk normalises away"),
    "lora targets": (("--lora.rank=4", "--lora.targets=['q_proj', 'qkv']"), 1, "lora.targets = ['q_proj', 'qkv']"),
    "lora targets absent from the model": (("--lora.rank=4", "--lora.targets=['q_a_proj']"), 1,
                                           "lora.targets = ['q_a_proj'] select no layer of this model"),
    "lora with params offload": (("--lora.rank=4", "--parallel.dp=2", "--parallel.zero=3",
                                  "--parallel.offload=params"), 2,
                                 "lora.rank > 0 is not built yet with parallel.offload = \"params\""),
    "lora dropout with tp_overlap": (("--lora.rank=4", "--lora.dropout=0.1", "--parallel.tp=2", "--parallel.sp=true",
                                      "--parallel.tp_overlap=true"), 2,
                                     "lora.dropout = 0.1 is not built yet with parallel.tp_overlap"),
    "lora with qk_clip": (("--lora.rank=4", "--optim.qk_clip=100"), 1,
                          "lora.rank > 0 is not built yet with optim.qk_clip"),
    # QLoRA's NF4 base (tests/model/test_qlora.py): the layouts that cannot hold it yet
    "nf4 with zero3": ((*QLORA, "--parallel.dp=2", "--parallel.zero=3"), 2,
                       'lora.base_dtype = "nf4" is not built yet with parallel.zero = 3'),
    "nf4 with tp": ((*QLORA, "--parallel.tp=2"), 2, 'lora.base_dtype = "nf4" is not built yet with parallel.tp = 2'),
    "nf4 with fp8": ((*QLORA, "--train.fp8=tensorwise"), 1, 'lora.base_dtype = "nf4" with train.fp8 = "tensorwise"'),
    "nf4 of partial groups": ((*QLORA, "--model.dim=64"), 1,
                              'lora.base_dtype = "nf4": 14 adapted weights are not whole groups of 16384'),
}


REFUSED = {**SPEED_ERRORS, **OPTIMIZER_AND_LORA_ERRORS}


@pytest.mark.parametrize("name", REFUSED)
def test_switches_are_refused_by_name(tmp_path, name):
    args, world, message = REFUSED[name]
    errors = validate(tiny_config(tmp_path, *args), world)
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_parameter_offload_with_zero3_is_accepted(tmp_path):
    """Built (parallel/data/offload.py): only its ZeRO stage is checked, for the device and the host."""
    assert validate(tiny_config(tmp_path, "--parallel.dp=2", "--parallel.zero=3", "--parallel.offload=params"), 2) == []


def test_fp8_on_a_gpu_without_fp8_tensor_cores_names_the_device(tmp_path, monkeypatch):
    """An A100 (compute capability 8.0) has no FP8 matmul: one line naming it; an H100 (9.0) passes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    cfg = tiny_config(tmp_path, "--train.fp8=rowwise", "--train.device=cuda")
    assert [e for e in validate(cfg, 1) if "fp8" in e] == [
        "train.fp8 = 'rowwise' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell), "
        "but NVIDIA A100-SXM4-80GB is 8.0: set train.fp8 = 'none'"]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert not [e for e in validate(cfg, 1) if "fp8" in e]
