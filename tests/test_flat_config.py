"""A run directory made before the configuration nested by part still resumes, samples and converts.

tests/fixtures/flat_run was written by fivefold's flat schema (58 [model] keys, the optimizer's in
[train]): `fivefold train configs/tiny.toml --run.name=run --model.dim=16 --model.n_layers=2
--model.ffn_dim=32 --model.rope_theta=500000.0 --model.qk_norm=true --model.norm_eps=1e-6
--train.steps=3 --train.stop_after=2 --train.lr=2e-3 --train.beta2=0.99 --data.max_bytes=20000`,
then `fivefold init run/config.toml --out seed`. Its RoPE base, q/k norms, eps, lr and beta2 all
differ from the defaults, so a key read into the wrong place changes the numbers below, which the
flat fivefold printed for the same commands.
"""

import json
import shutil

import pytest
from helpers import ROOT

from fivefold.cli import main
from fivefold.config.load import load_config, read_config
from fivefold.config.moved import MOVED
from fivefold.train.metrics import read_events, read_metrics

FIXTURE = ROOT / "tests" / "fixtures" / "flat_run"
STEP3_LOSS = 5.504408597946167  # the flat fivefold's step 3 of the same run, uninterrupted
NOTE = f"was saved by an earlier fivefold: its {len(MOVED)} keys that have moved since are read in their new places"
# `fivefold sample DIR --prompt "def " --max-new-tokens 16 --seed 3` of the flat fivefold, byte for byte
SAMPLED = {"run": "def  \ufffd\ufffdMta\ufffd\ufffdRWA\ufffd<^\ufffd\ufffd\n".encode(),
           "seed": "def  \ufffd\ufffdMt\x18\ufffd\ufffdRWA\ufffd$\ufffdJ\ufffd\n".encode()}


@pytest.fixture
def flat(tmp_path):
    shutil.copytree(FIXTURE, tmp_path / "flat")
    return tmp_path / "flat"


def test_the_flat_keys_of_a_saved_config_are_read_in_their_new_places(flat, capsys):
    cfg, errors = read_config(flat / "run" / "config.toml")
    m = cfg.model
    assert errors == [] and (m.rope.theta, m.norm.qk, m.norm.eps, m.dim) == (500000.0, True, 1e-6, 16)
    assert (cfg.optim.lr, cfg.optim.beta2, cfg.train.stop_after) == (2e-3, 0.99, 2)
    assert capsys.readouterr().err.count(NOTE) == 1  # one line, naming the file
    assert read_config(flat / "seed" / "fivefold.toml")[0].model == m
    copy = flat / "elsewhere.toml"  # the same keys in a file of the user's own: each named with its new place
    copy.write_text((flat / "run" / "config.toml").read_text())
    assert "model.rope_theta is now model.rope.theta" in read_config(copy)[1]


def test_a_flat_run_directory_resumes_where_it_stopped(flat, capsys):
    run = flat / "run"
    assert main(["train", str(run / "config.toml"), "--resume", f"--run.out_dir={flat}", "--train.stop_after=0",
                 "--no-progress"]) == 0
    assert NOTE in capsys.readouterr().err
    (resumed,) = [e for e in read_events(run / "metrics.jsonl") if e["event"] == "resume"]
    assert resumed["step"] == 2
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["step"] == 3 and last["loss"] == pytest.approx(STEP3_LOSS, rel=1e-6)
    assert "[model.rope]\ntheta = 500000.0" in (run / "config.toml").read_text()  # saved again, nested
    assert load_config(run / "config.toml").model.norm.qk


@pytest.mark.parametrize("folder", ["run", "seed"])
def test_a_flat_run_or_seed_directory_samples_the_same_text(flat, capsysbinary, folder):
    assert main(["sample", str(flat / folder), "--prompt", "def ", "--max-new-tokens", "16", "--seed", "3"]) == 0
    assert capsysbinary.readouterr().out == SAMPLED[folder]


def test_a_flat_checkpoint_converts_to_hugging_face(flat):
    out = flat / "hf"
    assert main(["convert", str(flat / "run" / "checkpoints" / "step_00000002"), str(out), "--to", "hf"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]  # q/k norms: Qwen3's block
    assert (config["rope_parameters"]["rope_theta"], config["rms_norm_eps"]) == (500000.0, 1e-6)
