"""`fivefold sample` and `generate()`: decoding rules, loading a run of any layout, one-line errors."""

import re
import shutil

import pytest
import torch
from helpers import ROOT, tiny_bpe, tiny_config, train_and_gather

from fivefold.checkpoint.run_dir import latest_checkpoint
from fivefold.cli import main
from fivefold.data.tokenizer import ByteTokenizer
from fivefold.model.config import ModelConfig
from fivefold.model.transformer import Transformer
from fivefold.parallel.forked_ranks import run_workers
from fivefold.sample.generate import SampleError, complete, generate, load_model, resolve_source


# ---- generate() ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    # std 0.5, not 0.02: peaked distributions, so a wrong token choice changes the text.
    m = Transformer(ModelConfig(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=48, init_std=0.5))
    m.init_weights(0)
    return m.eval()


PROMPT = torch.tensor([[1, 5, 9], [7, 7, 2]])  # (B=2, T=3)


def test_greedy_is_deterministic_and_an_argmax_loop_over_full_forwards(model):
    out = generate(model, PROMPT, 10)
    assert out.shape == (2, 13) and torch.equal(out[:, :3], PROMPT)
    assert torch.equal(generate(model, PROMPT, 10), out)
    ids = PROMPT
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)  # (B, T + 1)
    assert torch.equal(out, ids)
    assert len(set(out[0, 3:].tolist())) > 1  # not a model stuck on one id: the check above means something


def test_top_k_1_is_greedy_at_any_temperature(model):
    assert torch.equal(generate(model, PROMPT, 10, temperature=1.7, top_k=1, seed=5), generate(model, PROMPT, 10))


def test_sampling_is_reproducible_by_seed_and_leaves_the_global_rng_alone(model):
    state = torch.random.get_rng_state()
    a = generate(model, PROMPT, 12, temperature=1.0, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.rand(5)  # the global RNG moves: the draws do not depend on it
    assert torch.equal(generate(model, PROMPT, 12, temperature=1.0, seed=3), a)
    assert not torch.equal(generate(model, PROMPT, 12, temperature=1.0, seed=4), a)
    assert not torch.equal(a, generate(model, PROMPT, 12))  # sampling, not greedy


def test_only_ids_below_the_vocabulary_limit(model):
    for kwargs in (dict(temperature=2.0, seed=0), dict(temperature=2.0, top_k=5, seed=1), {}):
        out = generate(model, PROMPT, 30, **kwargs)
        assert int(out.max()) < 48
        limited = generate(model, PROMPT, 30, vocab_limit=10, **kwargs)
        assert int(limited[:, 3:].max()) < 10  # padding ids of the vocabulary are never produced


def test_stop_id_and_context_window(model):
    greedy = generate(model, PROMPT[:1], 10)[0, 3:].tolist()
    stop = greedy[4]
    out = generate(model, PROMPT[:1], 10, stop_id=stop)[0, 3:].tolist()
    assert out == greedy[: greedy.index(stop) + 1]  # ends at the first stop id
    # A context of 3 sees the last 3 ids at positions 0..2: the same as restarting from them.
    windowed = generate(model, PROMPT[:1], 4, context=3)[0].tolist()
    ids = PROMPT[:1]
    for _ in range(4):
        ids = torch.cat([ids, generate(model, ids[:, -3:], 1)[:, -1:]], dim=1)
    assert windowed == ids[0].tolist()
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        generate(model, torch.tensor([[48]]), 1)
    with pytest.raises(SampleError, match="beyond the 48 ids"):
        complete(model, ByteTokenizer(), "def ", 4)  # bytes 100, 101, 102 on a 48-id model


# ---- fivefold sample -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run trained 2 steps under tp=2 (its checkpoint holds DTensor shards), and its final model."""
    root = tmp_path_factory.mktemp("sample")
    cfg = tiny_config(root, "--run.name=tp2", "--parallel.tp=2", "--train.steps=2", "--data.max_bytes=20000",
                      "--data.val_fraction=0")
    state = run_workers(train_and_gather, 2, cfg)[0][2]
    return root / "tp2", state


def _sample(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["sample", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_a_tp_checkpoint_loads_whole_in_one_process(run):
    run_dir, state = run
    model = load_model(resolve_source(run_dir))
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, value in state.items():
        assert torch.equal(loaded[name], value), name


def test_sample_a_run_its_checkpoint_and_a_seed(run, tmp_path, capsys):
    run_dir, _ = run
    greedy = ("--prompt", "def ", "--max-new-tokens", "8", "--temperature", "0")
    rc, from_run, err = _sample(capsys, run_dir, *greedy)
    assert rc == 0 and from_run.startswith("def ") and len(from_run) > len("def \n"), err
    rc, from_checkpoint, _ = _sample(capsys, latest_checkpoint(run_dir), *greedy)
    assert rc == 0 and from_checkpoint == from_run  # the run directory is its latest checkpoint
    rc, sampled, _ = _sample(capsys, run_dir, "--prompt", "def ", "--max-new-tokens", "8", "--seed", "1")
    assert rc == 0 and sampled.startswith("def ")
    assert main(["init", str(ROOT / "configs" / "tiny.toml"), "--out", str(tmp_path / "seed")]) == 0
    capsys.readouterr()
    rc, from_seed, err = _sample(capsys, tmp_path / "seed", *greedy)
    assert rc == 0 and from_seed.startswith("def "), err


def test_init_copies_the_tokenizer_its_config_names(tmp_path, capsys):
    bpe = tiny_bpe(tmp_path / "bpe")
    seed = tmp_path / "seed"
    # model.vocab_size: the ids the tokenizer's 300 need, padded as the tp degrees of tiny.toml divide.
    assert main(["init", str(ROOT / "configs" / "tiny.toml"), "--out", str(seed), f"--data.tokenizer={bpe}",
                 "--model.vocab_size=320", "--data.bpe_vocab=300"]) == 0
    assert (seed / "tokenizer.json").read_bytes() == (bpe / "tokenizer.json").read_bytes()
    assert (seed / "tokenizer_config.json").is_file()
    assert f'tokenizer = "{seed}"' in (seed / "fivefold.toml").read_text()
    shutil.rmtree(bpe)  # the seed directory stands alone
    capsys.readouterr()
    rc, out, err = _sample(capsys, seed, "--prompt", "def f(x):", "--max-new-tokens", "6", "--ignore-eod")
    assert rc == 0 and out.startswith("def f(x):"), err
    assert main(["init", str(ROOT / "configs" / "tiny.toml"), "--out", str(tmp_path / "plain")]) == 0
    assert not (tmp_path / "plain" / "tokenizer.json").exists()  # byte: nothing to copy


def test_bad_input_is_one_line_naming_the_path(run, tmp_path, capsys):
    run_dir, _ = run
    (tmp_path / "fresh").mkdir()
    shutil.copy(run_dir / "config.toml", tmp_path / "fresh" / "config.toml")
    # A run trained with data.tokenizer = "bpe" whose RUN_DIR/tokenizer/ is gone.
    shutil.copytree(run_dir / "checkpoints", tmp_path / "bpe" / "checkpoints")
    bpe = re.sub(r'(?m)^tokenizer = ".*"$', 'tokenizer = "bpe"', (run_dir / "config.toml").read_text())
    (tmp_path / "bpe" / "config.toml").write_text(bpe)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    wide = tiny_bpe(tmp_path / "wide", added=80)  # ids up to ~380: beyond the run's 320
    cases = {
        "does not exist": [tmp_path / "nothing"],
        "holds no complete checkpoint": [tmp_path / "fresh"],
        "is a Hugging Face directory": [tmp_path / "hf"],
        "data.tokenizer = 'bpe'": [tmp_path / "bpe"],
        "beyond the 320 ids": [run_dir, "--tokenizer", wide, "--prompt", "word79"],
        "--max-new-tokens -1": [run_dir, "--max-new-tokens", "-1"],
    }
    for expected, args in cases.items():
        rc, out, err = _sample(capsys, "--max-new-tokens", "2", *args)  # the later --max-new-tokens wins
        assert rc == 2 and out == "", (expected, err)
        assert err.startswith("fivefold: ") and err.count("\n") == 1 and "Traceback" not in err, err
        assert expected in err, err
    assert str(tmp_path / "nothing") in _sample(capsys, tmp_path / "nothing")[2]
