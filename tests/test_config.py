"""Configuration: precedence, overrides, and one clear message per mistake, all at once."""

import dataclasses

import pytest
from helpers import ROOT, tiny_config

from fivefold.config import Config, ConfigError, load_config, parse_overrides, replace, to_toml
from fivefold.parallel.derive import derive
from fivefold.validate import validate


def errors_of(world: int, *overrides: str) -> list[str]:
    return validate(load_config(ROOT / "configs" / "tiny.toml", list(overrides)), world)


def one_error(errors: list[str], *words: str) -> str:
    hits = [e for e in errors if all(w in e for w in words)]
    assert len(hits) == 1, f"expected one error with {words}, got {errors}"
    return hits[0]


def test_shipped_configs_are_valid():
    assert errors_of(1) == []
    assert validate(load_config(ROOT / "configs" / "debug.toml"), 2) == []


def test_precedence_defaults_preset_toml_cli(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[model]\npreset = "tiny"\nn_layers = 4\n[train]\nsteps = 7\nlr = 0.5\n')
    cfg = load_config(toml, ["--train.lr=0.25", "--model.dim", "128"])
    assert cfg.model.ffn_dim == 128  # from the preset
    assert cfg.model.n_layers == 4  # TOML over preset
    assert cfg.model.dim == 128 and cfg.train.lr == 0.25  # CLI over TOML, both override forms
    assert cfg.train.steps == 7 and cfg.train.beta1 == Config().train.beta1  # TOML over default, default
    assert cfg.run.name == "x"  # run name defaults to the file's stem


def test_toml_round_trip(tmp_path):
    cfg = tiny_config(tmp_path, "--data.paths=['a', 'b']", "--train.dtype=fp32")
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_override_values_are_typed():
    values, errors = parse_overrides(["--a.i=3", "--a.f=1e-3", "--a.b=true", "--a.s=cosine", "--a.l=[1, 2]"])
    assert errors == [] and values == {"a": {"i": 3, "f": 1e-3, "b": True, "s": "cosine", "l": [1, 2]}}
    assert parse_overrides(["steps=3"])[1] and parse_overrides(["--train.steps"])[1]


def test_unknown_keys_suggest_the_right_one():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs" / "tiny.toml", ["--train.stpes=3", "--trian.lr=1", "--model.preset=lama3-8b"])
    one_error(e.value.errors, "train.stpes", "did you mean 'steps'")
    one_error(e.value.errors, "[trian]", "did you mean 'train'")
    one_error(e.value.errors, "lama3-8b", "did you mean 'llama3-8b'")


def test_wrong_types_and_ranges():
    errors = errors_of(1, "--train.steps=abc", "--parallel.sp=yes", "--train.lr_schedule=linear")
    one_error(errors, "train.steps", "must be an integer")
    one_error(errors, "parallel.sp", "true or false")
    one_error(errors, "train.lr_schedule", "'cosine'")
    assert any("unknown key 'train.sp'" in e for e in _load_errors("--train.sp=1"))
    errors = errors_of(1, "--train.lr=-1", "--train.global_batch=0", "--train.beta2=1.0", "--data.val_fraction=1.5")
    one_error(errors, "train.lr", "> 0")
    one_error(errors, "train.global_batch", "at least 1")
    one_error(errors, "train.beta2", "[0, 1)")
    one_error(errors, "data.val_fraction")


def _load_errors(*overrides: str) -> list[str]:
    try:
        load_config(ROOT / "configs" / "tiny.toml", list(overrides))
    except ConfigError as e:
        return e.errors
    return []


def test_degrees_must_multiply_to_the_world():
    msg = one_error(errors_of(4, "--parallel.dp=2"), "parallel.dp x pp x cp x tp")
    assert "= 2" in msg and "4 processes" in msg and "parallel.dp = 0" in msg
    assert errors_of(4) == []  # dp = 0 fills the world


def test_shape_divisibility_messages_name_field_and_fix():
    errors = errors_of(3, "--parallel.tp=3", "--parallel.dp=1")
    msg = one_error(errors, "model.n_heads = 4", "parallel.tp = 3")
    assert "use tp in {1, 2, 4}" in msg
    one_error(errors, "model.n_kv_heads = 4", "parallel.tp = 3")
    one_error(errors, "model.ffn_dim = 128", "parallel.tp = 3")
    assert errors_of(3, "--parallel.pp=3", "--parallel.dp=1") == []  # 8 layers in 3 stages: balanced by cost
    msg = one_error(errors_of(3, "--parallel.pp=3", "--parallel.dp=1", "--model.n_layers=2"), "model.n_layers = 2")
    assert "fewer than parallel.pp x virtual_stages = 3 stages" in msg and "lower pp or virtual_stages" in msg


def test_batch_and_sequence_arithmetic():
    msg = one_error(errors_of(2, "--train.global_batch=6", "--train.micro_batch=2"), "train.global_batch = 6")
    assert "dp x train.micro_batch = 2 x 2 = 4" in msg and "global_batch = 4 or 8" in msg
    msg = one_error(errors_of(2, "--parallel.cp=2", "--parallel.dp=1", "--train.seq_len=30"), "train.seq_len = 30")
    assert "divisible by 4" in msg and "seq_len = 28 or 32" in msg
    msg = one_error(errors_of(4, "--parallel.cp=4", "--parallel.dp=1", "--parallel.cp_method=ulysses",
                              "--model.n_kv_heads=2"), "cp_method = 'ulysses'")
    assert "4 query and 2 key/value heads" in msg and "cp in {1, 2}" in msg
    msg = one_error(errors_of(2, "--parallel.tp=2", "--parallel.sp=true", "--parallel.dp=1", "--train.seq_len=33"),
                    "seq_len = 33")
    assert "divisible by 2" in msg
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.dp=1", "--train.global_batch=2", "--train.micro_batch=2"),
              "micro-batches per step is fewer than parallel.pp = 2")


def test_every_error_at_once():
    errors = errors_of(3, "--parallel.dp=2", "--train.warmup_steps=99", "--data.paths=['/nonexistent']",
                       "--model.n_kv_heads=3")
    for words in (("parallel.dp",), ("warmup_steps",), ("/nonexistent",), ("n_kv_heads",)):
        assert any(all(w in e for w in words) for e in errors), (words, errors)


def test_derive():
    cfg = replace(load_config(ROOT / "configs" / "tiny.toml"), train={"global_batch": 16, "micro_batch": 2})
    d = derive(cfg, 4)
    assert (d.dp, d.grad_accum, d.tokens_per_step, d.local_seq_len) == (4, 2, 16 * 32, 32)
    assert d.vocab_size == 320 and d.head_dim == 16  # 257 byte tokens padded to a multiple of 64
    bpe = replace(cfg, data={"tokenizer": "bpe", "bpe_vocab": 1000})
    assert derive(bpe, 1).vocab_size == 1024
    assert dataclasses.replace(cfg.model, vocab_size=300) and validate(replace(cfg, model={"vocab_size": 200}), 1)


def test_data_parallel_options():
    one_error(errors_of(2, "--parallel.zero=4"), "parallel.zero = 4")
    for value in ("1", "'yes'"):  # 1 == True in Python, yet not a TOML bool
        one_error(errors_of(2, f"--parallel.reshard_after_forward={value}"), "must be one of 'auto', true, false")
    assert errors_of(2, "--parallel.zero=3", "--train.compile=true", "--model.tie_embeddings=true") == []
    one_error(errors_of(2, "--parallel.zero=1", "--parallel.dp_collective=ring"), "dp_collective = 'ring'")
    one_error(errors_of(2, "--parallel.bucket_mb=0"), "parallel.bucket_mb = 0", "25")
    msg = one_error(errors_of(6, "--parallel.dp_replicate=4", "--parallel.zero=1"),
                    "parallel.dp_replicate = 4 does not divide dp = 6")
    assert "1, 2, 3, 6" in msg
    assert errors_of(4, "--parallel.dp_replicate=2", "--parallel.zero=2") == []
    # The one pair refused rather than built: DDP has nothing to shard, so replica groups would mean nothing.
    one_error(errors_of(4, "--parallel.dp_replicate=2"), "dp_replicate = 2 with parallel.zero = 0", "zero = 1")


def test_pipeline_options():
    msg = one_error(errors_of(2, "--parallel.pp=2", "--parallel.dp=1", "--parallel.pp_schedule=1f1f"),
                    "parallel.pp_schedule = '1f1f'")
    assert "'1f1b'" in msg and "'interleaved_1f1b'" in msg and "'dualpipe_v'" in msg  # the valid names
    msg = one_error(errors_of(4, "--parallel.pp=4", "--parallel.dp=1", "--parallel.pp_schedule=interleaved_1f1b",
                              "--parallel.virtual_stages=2", "--train.global_batch=12", "--train.micro_batch=2"),
                    "interleaved_1f1b")
    assert "6 micro-batches" in msg and "m % p == 0" in msg
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.dp=1", "--parallel.pp_schedule=dualpipe_v"),
              "virtual_stages = 2")
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.dp=1", "--parallel.pp_schedule=dualpipe_v",
                        "--parallel.virtual_stages=2", "--train.micro_batch=4"),
              "dualpipe_v needs microbatches >= 2*pp")
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.dp=1", "--parallel.virtual_stages=2"), "1f1b")
    assert all(errors_of(4, "--parallel.pp=2", f"--parallel.zero={zero}") == [] for zero in (1, 2, 3))
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.stage_layers=[4, 3]"), "adding up to model.n_layers = 8")
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.stage_layers=[8]"), "needs pp x virtual_stages = 2 entries")
    one_error(errors_of(2, "--parallel.pp=2", "--parallel.stage_layers=['a', 'b']"), "must be a list of ints")
    assert errors_of(3, "--parallel.pp=3", "--parallel.stage_layers=[3, 3, 2]", "--train.global_batch=6",
                     "--train.micro_batch=2") == []  # explicit counts, where 8 layers do not divide by 3


def test_latent_attention_and_expert_group_options():
    mla = "--model.preset=tiny-mla"
    assert errors_of(8, mla, "--parallel.tp=2", "--parallel.ep=2", "--parallel.cp=2") == []
    one_error(errors_of(1, mla, "--model.v_head_dim=32"), "model.v_head_dim = 32", "= 24")
    one_error(errors_of(1, mla, "--model.qk_rope_head_dim=7"), "model.qk_rope_head_dim = 7")
    one_error(errors_of(1, mla, "--model.n_expert_groups=3"), "model.n_expert_groups = 3", "{1, 2, 4}")
    one_error(errors_of(1, mla, "--model.topk_groups=5"), "model.topk_groups = 5")
    one_error(errors_of(1, mla, "--model.topk_groups=1", "--model.top_k=3"), "model.top_k = 3", "raise topk_groups")
    one_error(errors_of(1, mla, "--model.moe_routed_scale=0"), "model.moe_routed_scale = 0")
    assert errors_of(1, mla, "--model.n_kv_heads=3") == []  # unused by latent attention


def test_tensor_parallel_options():
    one_error(errors_of(2, "--parallel.sp=true"), "parallel.sp = true needs parallel.tp > 1")
    assert errors_of(2, "--parallel.tp=2", "--model.preset=tiny-moe") == []  # experts replicated over tp
    assert errors_of(2, "--parallel.tp=2", "--parallel.sp=true", "--model.preset=tiny-moe") == []  # tokens split
    assert all(errors_of(4, "--parallel.ep=2", f"--parallel.zero={z}", "--model.preset=tiny-moe") == []
               for z in (1, 2, 3))
    assert errors_of(2, "--parallel.tp=2", "--model.tie_embeddings=true") == []  # one vocabulary slice per rank
    msg = one_error(errors_of(2, "--parallel.tp=2", "--data.vocab_multiple=7"), "vocabulary 259")
    assert "vocab_multiple to a multiple of 2" in msg
    assert errors_of(8, "--parallel.tp=2", "--parallel.sp=true", "--parallel.pp=2") == []
