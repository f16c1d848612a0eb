"""DeepSpeed JSON -> fivefold overrides: the batch rule, each mapped section, and the refusals.

Pure Python: no process group, no tensors. Every produced override list must parse cleanly with
read_config(), since the CLI layers it between the TOML file and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fivefold.config.deepspeed import DeepSpeedMapping, format_mapping, load_deepspeed, map_deepspeed
from fivefold.config.derive import derive
from fivefold.config.load import ConfigError, read_config
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.validate import validate

DATA = Path(__file__).resolve().parent / "fixtures"
# Each data file with the world size it is meant for (the seed files: see the tests below).
FILES = {"ds_zero2_bf16.json": 8, "ds_seed_002.json": 64, "ds_seed_004.json": 64}


def parsed(m: DeepSpeedMapping, refused: bool = False) -> Config:
    """The overrides read back; a mapping must also be free of refusals unless the test expects some."""
    assert refused or m.errors == [], m.errors
    cfg, errors = read_config(None, m.overrides)
    assert errors == [], errors
    return cfg


def one_error(m: DeepSpeedMapping, *words: str) -> str:
    hits = [e for e in m.errors if all(w in e for w in words)]
    assert len(hits) == 1, f"expected one error with {words}, got {m.errors}"
    return hits[0]


def lines(m: DeepSpeedMapping) -> dict[str, str]:
    """DeepSpeed key path -> its mapping line (the last one, when a key maps twice)."""
    return dict(m.mapping)


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_data_file_gives_parsable_overrides(name):
    m = load_deepspeed(DATA / name, FILES[name])
    parsed(m, refused=name == "ds_seed_004.json")
    assert all(o.startswith("--") and "=" in o for o in m.overrides)


def test_zero2_bf16_config():
    m = load_deepspeed(DATA / "ds_zero2_bf16.json", 8)
    assert m.errors == []
    assert m.overrides == [
        "--train.global_batch=64", "--train.micro_batch=4", '--train.dtype="bf16"', "--optim.grad_clip=1.0",
        "--parallel.zero=2", "--parallel.overlap_comm=true", "--parallel.bucket_mb=200.0",
        "--optim.lr=0.0003", "--optim.eps=1e-08", "--optim.weight_decay=0.1", "--optim.beta1=0.9",
        "--optim.beta2=0.95", '--optim.lr_schedule="cosine"', "--train.steps=1000", "--optim.warmup_steps=100",
        "--optim.min_lr_ratio=0.1",
    ]
    cfg = parsed(m)
    t, o, p = cfg.train, cfg.optim, cfg.parallel
    assert (t.global_batch, t.micro_batch, t.dtype, o.grad_clip) == (64, 4, "bf16", 1.0)
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == (3e-4, 0.9, 0.95, 1e-8, 0.1)
    assert (o.lr_schedule, t.steps, o.warmup_steps, o.min_lr_ratio) == ("cosine", 1000, 100, 0.1)
    assert (p.zero, p.overlap_comm, p.bucket_mb) == (2, True, 200.0)
    assert derive(cfg, 8, unpadded_vocab(cfg)).grad_accum == 2  # fivefold's own derivation agrees with the JSON's 2
    assert validate(cfg, 8) == []
    assert m.ignored == [
        "zero_optimization.contiguous_gradients", "zero_optimization.allgather_bucket_size",
        "zero_optimization.offload_optimizer", "steps_per_print", "wall_clock_breakdown",
    ]
    text = format_mapping(m)
    assert "train_batch_size" in text and "-> train.global_batch = 64" in text
    assert "ignored (no fivefold meaning): zero_optimization.contiguous_gradients" in text


# (DeepSpeed batch keys, world size, expected global_batch, micro_batch, grad_accum)
DERIVATIONS = [
    ({"train_batch_size": 32}, 8, 32, 4, 1),  # only the global batch: grad_accum 1
    ({"train_micro_batch_size_per_gpu": 2}, 8, 16, 2, 1),  # only micro: grad_accum 1
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4}, 8, 64, 4, 2),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 2}, 8, 64, 4, 2),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8, 64, 4, 2),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8, 64, 4, 2),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 8, 64, 4, 2),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"},
     8, 64, 8, 1),
    # tp x pp take ranks away from dp: dp = 16 / (2 x 2) = 4, so grad_accum = 32 / (2 x 4) = 4.
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 2},
      "pipeline_parallel": {"pp_size": 2}}, 16, 32, 2, 4),
]


@pytest.mark.parametrize("ds,world,global_batch,micro,accum", DERIVATIONS)
def test_batch_derivation(ds: dict[str, Any], world, global_batch, micro, accum):
    m = map_deepspeed(ds, world)
    assert m.errors == []
    cfg = parsed(m)
    assert (cfg.train.global_batch, cfg.train.micro_batch) == (global_batch, micro)
    assert derive(cfg, world, unpadded_vocab(cfg)).grad_accum == accum
    assert f"= {accum}" in lines(m)["gradient_accumulation_steps"]


def test_no_batch_keys_leave_the_toml_batch_alone():
    m = map_deepspeed({"steps_per_print": 5}, 8)
    assert (m.errors, m.overrides, m.ignored) == ([], [], ["steps_per_print"])


@pytest.mark.parametrize("ds,words", [
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"},
     ("train_batch_size = 'auto'", "train_micro_batch_size_per_gpu = 'auto'")),
    ({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
     ("train_micro_batch_size_per_gpu = 'auto'", "nothing to derive")),
    ({"gradient_accumulation_steps": 4}, ("gradient_accumulation_steps = 4 alone",)),
])
def test_batch_with_nothing_to_derive_from(ds, words):
    m = map_deepspeed(ds, 8)
    one_error(m, *words)
    assert m.overrides == []


def test_batch_refused_when_the_three_do_not_multiply_out():
    m = map_deepspeed({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 2}, 8)
    e = one_error(m, "train_batch_size = 100", "= 4 x 2 x 8 = 64", "DeepSpeed refuses")
    assert "train_batch_size = 64" in e  # a fix
    assert m.overrides == []
    # Derived with DeepSpeed's floor division: 100 // 4 // 8 = 3 steps, 4 x 3 x 8 = 96 != 100.
    m = map_deepspeed({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}, 8)
    one_error(m, "train_batch_size = 100", "4 x 3 (derived) x 8 = 96")


def test_seed_004_is_refused():
    # tests/fixtures/ds_seed_004.json: a DeepSpeed config a tutorial gives for 3D parallelism (TP=2, PP=4,
    # DP=8), i.e. 2 x 4 x 8 = 64 GPUs: dp = 64 / (2 x 4) = 8 and 4 x 8 x 8 = 256, not 1024.
    m = load_deepspeed(DATA / "ds_seed_004.json", 64)
    one_error(m, "train_batch_size = 1024", "4 x 8 x 8 = 256", "tp 2 x pp 4", "gradient_accumulation_steps = 32")
    assert not any("global_batch" in o or "micro_batch" in o for o in m.overrides)
    p = parsed(m, refused=True).parallel
    assert (p.tp, p.pp) == (2, 4)
    assert m.ignored == ["zero_optimization.allgather_partitions", "zero_optimization.reduce_scatter"]


def test_seed_002_multiplies_out_on_its_64_gpus():
    # tests/fixtures/ds_seed_002.json, from a practitioner's blog post (quotes restored: the page lost them),
    # runs on 64 H100s with `deepspeed --num_gpus 64`. With its tp_size 8 x pp_size 8, dp = 1, and
    # the two given keys derive micro = 128 // 1 // 16 = 8: this JSON alone is consistent.
    m = load_deepspeed(DATA / "ds_seed_002.json", 64)
    assert m.errors == []
    cfg = parsed(m)
    t, p = cfg.train, cfg.parallel
    assert (t.global_batch, t.micro_batch, p.tp, p.pp) == (128, 8, 8, 8)
    assert (t.dtype, t.loss_scale, t.loss_scale_window, t.min_loss_scale) == ("fp16", 0.0, 1000, 1.0)
    assert (p.zero, p.overlap_comm, p.bucket_mb) == (3, True, 2000.0)
    # Its context_parallel.cp_size = 4 is not a DeepSpeed key and not mapped; the page's own
    # "64 = tp 8 x pp 8 x cp 4 x dp 1" does not hold (that product is 256).
    assert {"context_parallel", "pipeline_parallel.p2p_cache_size", "fp16.hysteresis"} <= set(m.ignored)


def test_seed_002_refused_with_its_launch_command_or_without_the_extensions():
    ds = json.loads((DATA / "ds_seed_002.json").read_text())
    # Its launch line passes --per_device_train_batch_size 1 (HF writes that into micro): 1 x 16 x 1.
    m = map_deepspeed({**ds, "train_micro_batch_size_per_gpu": 1}, 64)
    one_error(m, "train_batch_size = 128", "= 1 x 16 x 1 = 16")
    # DeepSpeed itself reads neither tensor_parallel.tp_size nor pipeline_parallel: dp = 64, micro = 0.
    plain = {k: v for k, v in ds.items() if k not in ("tensor_parallel", "pipeline_parallel")}
    one_error(map_deepspeed(plain, 64), "train_batch_size = 128", "0 (derived) x 16 x 64 = 0")


def test_fp16_keys():
    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
            "hysteresis": 2, "min_loss_scale": 0.5}
    m = map_deepspeed({"fp16": fp16}, 1)
    t = parsed(m).train
    assert (t.dtype, t.loss_scale, t.initial_scale_power, t.loss_scale_window, t.min_loss_scale) == \
        ("fp16", 0.0, 12, 500, 0.5)
    assert m.ignored == ["fp16.hysteresis"]
    # A disabled section's knobs do nothing in DeepSpeed either; both off means fp32.
    m = map_deepspeed({"fp16": {**fp16, "enabled": False}, "bf16": {"enabled": False}}, 1)
    assert m.overrides == ['--train.dtype="fp32"'] and "fp16.loss_scale" in m.ignored


def test_fp16_and_bf16_both_enabled_is_refused():
    m = map_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, 1)
    one_error(m, "fp16.enabled and bf16.enabled are both true")
    assert not any("dtype" in o for o in m.overrides)
    assert parsed(map_deepspeed({"bfloat16": {"enabled": True}}, 1)).train.dtype == "bf16"  # older spelling


def test_optimizer():
    m = map_deepspeed({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, 1)
    one_error(m, "optimizer.type = 'Lamb'", "Adam, AdamW")
    assert m.overrides == []
    m = map_deepspeed({"optimizer": {"type": "adam", "params": {"weight_decay": 0.01, "adam_w_mode": False,
                                                                "torch_adam": True}}}, 1)
    assert m.errors == [] and parsed(m).optim.weight_decay == 0.01
    assert "L2" in lines(m)["optimizer.params.weight_decay"] and m.ignored == ["optimizer.params.torch_adam"]
    m = map_deepspeed({"optimizer": {"type": "Adam", "params": {"weight_decay": 0.01}}}, 1)
    # adam_w_mode defaults to true
    assert m.errors == [] and "decoupled, as DeepSpeed" in lines(m)["optimizer.params.weight_decay"]
    one_error(map_deepspeed({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}}, 1), "betas")


def test_schedulers():
    m = map_deepspeed({"scheduler": {"type": "OneCycle", "params": {}}}, 1)
    one_error(m, "scheduler.type = 'OneCycle'", "WarmupLR, WarmupDecayLR, WarmupCosineLR")
    one_error(map_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": {}}}, 1), "total_num_steps is missing")
    # WarmupLR: DeepSpeed's defaults fill what the file leaves out, and its max lr beats the optimizer's.
    m = map_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 0.5}},
                       "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}}}, 1)
    o = parsed(m).optim
    assert (o.lr_schedule, o.warmup_steps, o.lr) == ("constant", 50, 0.001)
    assert "scheduler.params.warmup_max_lr (DeepSpeed default)" in lines(m)
    # WarmupDecayLR: the linear tail of wsd, starting right after warmup and ending at warmup_min_lr.
    m = map_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 400, "warmup_num_steps": 100, "warmup_max_lr": 2e-3, "warmup_min_lr": 5e-4,
        "last_batch_iteration": -1}}}, 1)
    t, o = parsed(m).train, parsed(m).optim
    assert (o.lr_schedule, t.steps, o.warmup_steps, o.lr) == ("wsd", 400, 100, 2e-3)
    assert (o.decay_fraction, o.min_lr_ratio) == (0.75, 0.25)
    assert "linear tail" in lines(m)["scheduler.type"] and m.ignored == ["scheduler.params.last_batch_iteration"]
    one_error(map_deepspeed({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 100}}}, 1), "would never decay")


def test_reduce_bucket_size_elements_become_megabytes():
    m = map_deepspeed({"zero_optimization": {"reduce_bucket_size": 5e7}}, 1)
    assert parsed(m).parallel.bucket_mb == 200.0  # 5e7 elements x 4 bytes = 2e8 bytes
    assert "4 bytes" in lines(m)["zero_optimization.reduce_bucket_size"]
    one_error(map_deepspeed({"zero_optimization": {"reduce_bucket_size": 2.5}}, 1), "must be an integer")


def test_tensor_and_pipeline_parallel_extensions():
    m = map_deepspeed({"tensor_parallel": {"tp_size": 4}, "pipeline_parallel": {"pp_size": 2}}, 8)
    p = parsed(m).parallel
    assert (p.tp, p.pp) == (4, 2)
    assert "fivefold extension" in lines(m)["tensor_parallel.tp_size"]
    assert "fivefold extension" in lines(m)["pipeline_parallel.pp_size"]
    m = map_deepspeed({"tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}, 8)
    assert parsed(m).parallel.tp == 2 and "AutoTP" in lines(m)["tensor_parallel.autotp_size"]
    assert m.ignored == ["tensor_parallel.tp_overlap_comm"]
    one_error(map_deepspeed({"tensor_parallel": {"tp_size": 4, "autotp_size": 2}}, 8), "disagree")
    one_error(map_deepspeed({"train_batch_size": 8, "tensor_parallel": {"tp_size": 3}}, 8),
              "tp x pp = 3 x 1 = 3 does not divide the world size 8")


def test_wrong_types_name_the_key():
    m = map_deepspeed({"train_batch_size": "64", "zero_optimization": {"stage": True, "overlap_comm": 1},
                       "gradient_clipping": -1}, 8)
    one_error(m, "train_batch_size = '64'", "integer >= 1")
    one_error(m, "zero_optimization.stage = True")
    one_error(m, "zero_optimization.overlap_comm = 1", "true or false")
    one_error(m, "gradient_clipping = -1")


def test_load_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_deepspeed(tmp_path / "nope.json", 8)
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "train_batch_size": 8, // eight\n}\n')
    with pytest.raises(ConfigError, match=r"not valid JSON: .* line 2, column 26 .*no comments"):
        load_deepspeed(bad, 8)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_deepspeed(bad, 8)
