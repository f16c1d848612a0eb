"""Configuration: precedence, overrides, and one clear message per mistake, all at once."""

import dataclasses
import tomllib

import pytest
from helpers import ROOT, tiny_config

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.cli import main
from fivefold.config.derive import derive
from fivefold.config.load import ConfigError, load_config, parse_overrides, parse_value, read_config, replace, to_toml
from fivefold.config.moved import MOVED
from fivefold.config.schema import FIELD_TYPES, TABLES, Config, table_of
from fivefold.data.resolve import unpadded_vocab
from fivefold.launch.agent import check_writable
from fivefold.train.preflight import preflight
from fivefold.validate import validate


def errors_of(world: int, *overrides: str) -> list[str]:
    """What `fivefold train` reports: the loading's problems (unknown keys, wrong types), then validate()'s."""
    cfg, errors = read_config(ROOT / "configs" / "tiny.toml", list(overrides))
    return errors + validate(cfg, world)


def one_error(errors: list[str], *words: str) -> str:
    hits = [e for e in errors if all(w in e for w in words)]
    assert len(hits) == 1, f"expected one error with {words}, got {errors}"
    return hits[0]


def test_shipped_configs_are_valid():
    assert errors_of(1) == []
    assert validate(load_config(ROOT / "configs" / "debug.toml"), 2) == []


def test_precedence_defaults_preset_toml_cli(tmp_path):
    toml = tmp_path / "x.toml"
    toml.write_text('[model]\npreset = "mixtral-8x7b"\nn_layers = 4\n[model.moe]\ntop_k = 1\n'
                    '[train]\nsteps = 7\n[optim]\nlr = 0.5\n')
    cfg = load_config(toml, ["--optim.lr=0.25", "--model.dim", "128", "--model.rope.theta=5e5"])
    assert cfg.model.ffn_dim == 14336 and cfg.model.moe.n_experts == 8  # from the preset, nested parts too
    assert cfg.model.n_layers == 4 and cfg.model.moe.top_k == 1  # TOML over preset, in a nested table too
    assert cfg.model.rope.theta == 5e5 and cfg.model.rope.scaling == ""  # CLI over preset, the rest kept
    assert cfg.model.dim == 128 and cfg.optim.lr == 0.25  # CLI over TOML, both override forms
    assert cfg.train.steps == 7 and cfg.optim.beta1 == Config().optim.beta1  # TOML over default, default
    assert cfg.run.name == "x"  # run name defaults to the file's stem


def test_toml_round_trip(tmp_path):
    cfg = tiny_config(tmp_path, "--data.paths=['a', 'b']", "--train.dtype=fp32")
    path = tmp_path / "resolved.toml"
    path.write_text(to_toml(cfg))
    assert load_config(path) == cfg


def test_the_model_nests_by_part_and_every_moved_key_has_its_place():
    """[model] keeps its plain numbers; RoPE, attention, latent attention, norms and MoE are tables of their
    own. Every key that moved names a key that exists, and every key of a part was a flat key before."""
    assert len(FIELD_TYPES["model"]) + len([t for t in TABLES if t.startswith("model.")]) <= 20
    assert {t for t in TABLES if t.startswith("model.")} == {"model.rope", "model.attention", "model.latent",
                                                             "model.norm", "model.moe"}
    for old, new in MOVED.items():
        table, key = new.rsplit(".", 1)
        assert key in FIELD_TYPES[table], (old, new)
    parts = {f"{t}.{k}" for t in TABLES if t.startswith("model.") for k in FIELD_TYPES[t]}
    assert parts == {new for new in MOVED.values() if new.startswith("model.")}
    assert {t for t in TABLES if "." not in t} == {"model", "parallel", "train", "optim", "lora", "data", "checkpoint",
                                                  "run"}


def test_a_moved_key_is_named_with_its_new_place(tmp_path, capsys):
    """Typed on the command line or written in a new TOML file, a flat key of an earlier version is one
    line each naming where it is now; nothing else about it is guessed."""
    toml = tmp_path / "mine.toml"
    toml.write_text('[model]\npreset = "tiny"\nqk_norm = true\n[train]\nlr = 0.1\n')
    _, errors = read_config(toml, ["--model.rope_theta=1e6", "--model.moe_bias_update=0.01"])
    assert errors == ["model.qk_norm is now model.norm.qk", "train.lr is now optim.lr",  # the file's, then the CLI's
                      "model.rope_theta is now model.rope.theta", "model.moe_bias_update is now model.moe.bias_update"]
    assert main(["train", str(toml), f"--run.out_dir={tmp_path}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "model.qk_norm is now model.norm.qk" in err and "train.lr is now optim.lr" in err and "Traceback" not in err
    assert not (tmp_path / "mine").exists()
    assert read_config(None, ["--model.rope=1"])[1] == ["[model.rope] must be a table of keys, got 1"]
    assert read_config(None, ["--model.rope=1", "--model.rope.theta=2"])[1][0] == (
        "override '--model.rope.theta': model.rope was given a value; it is a table of keys")
    assert read_config(None, ["--model.rope.thta=2"])[1] == ["unknown key 'model.rope.thta': did you mean 'theta'?"]
    assert read_config(None, ["--model.ropes.theta=2"])[1] == ["unknown key 'model.ropes': did you mean 'rope'?"]


def test_replace_takes_nested_tables(tmp_path):
    cfg = replace(tiny_config(tmp_path), model={"rope": {"theta": 1e6}, "n_layers": 2}, optim={"lr": 0.5})
    assert (cfg.model.rope.theta, cfg.model.rope.scaling, cfg.model.n_layers, cfg.optim.lr) == (1e6, "", 2, 0.5)
    assert "[model.rope]\ntheta = 1000000.0\n" in to_toml(cfg)


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
    errors = errors_of(1, "--train.steps=abc", "--parallel.sp=yes", "--optim.lr_schedule=linear")
    one_error(errors, "train.steps", "must be an integer")
    one_error(errors, "parallel.sp", "true or false")
    one_error(errors, "optim.lr_schedule", "'cosine'")
    assert any("unknown key 'train.sp'" in e for e in _load_errors("--train.sp=1"))
    errors = errors_of(1, "--optim.lr=-1", "--train.global_batch=0", "--optim.beta2=1.0", "--data.val_fraction=1.5")
    one_error(errors, "optim.lr", "> 0")
    one_error(errors, "train.global_batch", "at least 1")
    one_error(errors, "optim.beta2", "[0, 1)")
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
    errors = errors_of(3, "--parallel.dp=2", "--optim.warmup_steps=99", "--data.paths=['/nonexistent']",
                       "--model.n_kv_heads=3")
    for words in (("parallel.dp",), ("warmup_steps",), ("/nonexistent",), ("n_kv_heads",)):
        assert any(all(w in e for w in words) for e in errors), (words, errors)


def test_derive():
    cfg = replace(load_config(ROOT / "configs" / "tiny.toml"), train={"global_batch": 16, "micro_batch": 2})
    d = derive(cfg, 4, unpadded_vocab(cfg))
    assert (d.dp, d.grad_accum, d.tokens_per_step, d.local_seq_len) == (4, 2, 16 * 32, 32)
    assert d.vocab_size == 320 and d.head_dim == 16  # 257 byte tokens padded to a multiple of 64
    bpe = replace(cfg, data={"tokenizer": "bpe", "bpe_vocab": 1000})
    assert derive(bpe, 1, unpadded_vocab(bpe)).vocab_size == 1024
    assert dataclasses.replace(cfg.model, vocab_size=300) and validate(replace(cfg, model={"vocab_size": 200}), 1)


def test_data_parallel_options():
    one_error(errors_of(2, "--parallel.zero=4"), "parallel.zero = 4")
    for value in ("1", "'yes'"):  # 1 == True in Python, yet not a TOML bool
        one_error(errors_of(2, f"--parallel.reshard_after_forward={value}"), "must be one of 'auto', true, false")
    assert errors_of(2, "--parallel.zero=3", "--train.compile=true", "--model.tie_embeddings=true") == []
    one_error(errors_of(2, "--parallel.zero=1", "--parallel.dp_collective=ring"), "dp_collective = 'ring'")
    one_error(errors_of(2, "--parallel.bucket_mb=0"), "parallel.bucket_mb = 0", "25")
    one_error(errors_of(2, "--parallel.buckets_in_flight=0"), "parallel.buckets_in_flight = 0", ">= 1",
              "2 is the default")
    one_error(errors_of(2, "--parallel.buckets_in_flight=1.5"), "parallel.buckets_in_flight = 1.5", "an integer")
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


def test_compile_refuses_schedules_that_split_a_later_stage_backward():
    # A compiled block's backward is one autograd node: I and W would each run all of it.
    zb = ("--parallel.pp=2", "--parallel.dp=1", "--train.compile=true")
    msg = one_error(errors_of(2, *zb, "--parallel.pp_schedule=zb_h1"), "train.compile = true", "'zb_h1'")
    assert "'1f1b'" in msg and "train.compile = false" in msg
    for name in ("zb_v", "dualpipe_v"):
        one_error(errors_of(2, *zb, f"--parallel.pp_schedule={name}", "--parallel.virtual_stages=2",
                            "--train.global_batch=16"), "train.compile = true", f"'{name}'")
    assert errors_of(2, *zb) == []  # 1f1b runs whole backwards
    # One stage: its I computes nothing and its W the whole backward, so nothing is split.
    assert errors_of(1, "--parallel.pp_schedule=zb_h1", "--train.compile=true") == []
    assert errors_of(2, *zb[:2], "--parallel.pp_schedule=zb_h1") == []  # without compile it splits


def test_latent_attention_and_expert_group_options():
    mla = "--model.preset=tiny-mla"
    assert errors_of(8, mla, "--parallel.tp=2", "--parallel.ep=2", "--parallel.cp=2") == []
    one_error(errors_of(1, mla, "--model.latent.v_head_dim=32"), "model.latent.v_head_dim = 32", "= 24")
    one_error(errors_of(1, mla, "--model.latent.qk_rope_head_dim=7"), "model.latent.qk_rope_head_dim = 7")
    one_error(errors_of(1, mla, "--model.attention.qkv_bias=true"), "set model.attention.qkv_bias = false")
    one_error(errors_of(1, mla, "--model.norm.qk=true"), "model.norm.qk = true", "set model.norm.qk = false")
    one_error(errors_of(1, mla, "--model.moe.n_groups=3"), "model.moe.n_groups = 3", "{1, 2, 4}")
    one_error(errors_of(1, mla, "--model.moe.topk_groups=5"), "model.moe.topk_groups = 5")
    one_error(errors_of(1, mla, "--model.moe.topk_groups=1", "--model.moe.top_k=3"), "model.moe.top_k = 3",
              "raise topk_groups")
    one_error(errors_of(1, mla, "--model.moe.routed_scale=0"), "model.moe.routed_scale = 0")
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


def test_a_string_field_takes_the_override_as_written(tmp_path):
    for text in ("2024", "true", "nan", "1.5", "[1, 2]", "abc"):
        cfg = load_config(ROOT / "configs" / "debug.toml", [f"--run.name={text}", f"--run.out_dir={tmp_path}"])
        assert cfg.run.name == text and validate(cfg, 2) == []
    assert load_config(None, ['--run.name="x y"']).run.name == "x y"  # a quoted TOML string: the string
    toml = tmp_path / "x.toml"
    toml.write_text("[run]\nname = 2024\n")
    with pytest.raises(ConfigError) as e:
        load_config(toml)
    assert e.value.errors == ["run.name = 2024: must be a string"]  # TOML says what it is: a number
    toml.write_text('[data]\nmixture = [["a", 1], ["b"]]\n')
    assert read_config(toml)[1] == ["data.mixture = [['a', 1], ['b']]: must be a list of [string, number] pairs"]


# A value of every kind TOML has, as written in a TOML file or after --section.key=.
KINDS = ("2024", "1.5", "true", '"abc"', "[1, 2]", "nan", "[[1, 2]]", '[["a", 1.5]]', "{ a = 1 }")


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


@pytest.mark.parametrize("table", list(TABLES))
def test_every_field_refuses_a_wrong_type_by_name_and_nothing_else_fails(tmp_path, monkeypatch, table):
    """Every field of every table, nested ones ([model.rope], ...) included, values of every kind, from a
    TOML file and from the command line: a value is either taken as given or refused in one line naming
    the field, and what `fivefold train` checks before any process starts raises nothing but ConfigError
    (it used to raise TypeError: --run.name=2024)."""
    monkeypatch.chdir(tmp_path)  # relative run directories are looked for here
    toml = tmp_path / "x.toml"
    for key, hint in FIELD_TYPES[table].items():
        name = f"{table}.{key}"
        is_string = hint is str
        for text in KINDS:
            toml.write_text(f"[{table}]\n")
            for path, overrides, given in ((toml, [], tomllib.loads(f"v = {text}")["v"]),
                                           (ROOT / "configs" / "tiny.toml", [f"--{name}={text}"], None)):
                before = getattr(table_of(read_config(path)[0], table), key)
                toml.write_text(f"[{table}]\n{key} = {text}\n")
                cfg, errors = read_config(path, overrides)
                value = getattr(table_of(cfg, table), key)
                refused = [e for e in errors if e.startswith(f"{name} = ") and ": must be " in e]
                if given is None:  # the command line: a string field's text as written, else TOML
                    given = (text.strip('"') if text == '"abc"' else text) if is_string else parse_value(text)
                if refused:
                    assert len(refused) == 1 and value == before, (name, text, errors)
                else:
                    assert repr(value) == repr(_tuples(given)), (name, text, value)  # (repr: nan != nan)
                assert not (is_string and overrides and refused), (name, text, errors)  # any text is a string
                try:
                    errors += preflight(cfg, 1) + check_writable(run_dir_of(cfg))
                except ConfigError as e:
                    errors += e.errors
                assert all("\n" not in e for e in errors), errors


@pytest.mark.parametrize("written", ["run.name = 2024", "run.name = true", "run.name = nan", "run.out_dir = 2024",
                                     "checkpoint.init_from = 2024", "model.preset = 2024", 'data.mixture = "abc"',
                                     "train.steps = 1.5", "optim.lr = true", "parallel.reshard_after_forward = 1",
                                     "data.paths = [1, 2]", "parallel.stage_layers = [[1, 2]]"])
def test_fivefold_train_refuses_a_wrong_type_in_a_toml_file_in_one_line(tmp_path, monkeypatch, capsys, written):
    monkeypatch.chdir(tmp_path)  # the default run.out_dir, "runs", is here
    key, value = written.split(" = ")
    section, name = key.rsplit(".", 1)
    (tmp_path / "x.toml").write_text(f"[{section}]\n{name} = {value}\n")
    assert main(["train", "x.toml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fivefold: invalid configuration: {key} = ") and err.count("\n") == 1, err
    assert ": must be " in err and [p.name for p in tmp_path.iterdir()] == ["x.toml"]  # nothing written


@pytest.mark.parametrize("override, line", [
    ("--train.steps=1.5", "train.steps = 1.5: must be an integer"),
    ("--optim.lr=true", "optim.lr = True: must be a number"),
    ("--parallel.reshard_after_forward=1", "parallel.reshard_after_forward = 1: must be one of 'auto', true, false"),
    ("--data.mixture=abc", "data.mixture = 'abc': must be a list of [string, number] pairs"),
    ("--data.paths=[1, 2]", "data.paths = [1, 2]: must be a list of strings"),
    ("--model.preset=2024", "model.preset = '2024' is unknown"),  # a string: the name of no preset
    ("--checkpoint.init_from=2024", "checkpoint.init_from = '2024' does not exist"),
    # Any text is a string: the run's name and folder are taken, the one error left is optim.lr's.
    *((f"--run.{key}={text}", "optim.lr = -1: must be > 0") for key, text in
      (("name", "2024"), ("name", "true"), ("name", "nan"), ("out_dir", "2024"))),
])
def test_fivefold_train_refuses_a_wrong_override_in_one_line(tmp_path, monkeypatch, capsys, override, line):
    monkeypatch.chdir(tmp_path)  # configs/tiny.toml's run.out_dir, "runs", is here
    also = ["--optim.lr=-1"] if override.startswith("--run.") else []  # else the one error is the override's
    assert main(["train", str(ROOT / "configs" / "tiny.toml"), override, *also, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fivefold: invalid configuration: {line}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # nothing written
