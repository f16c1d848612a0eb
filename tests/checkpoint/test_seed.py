"""Seed checkpoints: written by one process tensor by tensor, loaded identically under any layout."""

import pytest
import torch
from helpers import EQUIVALENCE, parallelized, tiny_config

from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.checkpoint.seed import write_seed_checkpoint
from fivefold.checkpoint.weights import check_init_from, load_weights
from fivefold.cli import main
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.loop import build_model
from fivefold.validate import validate

# MoE with the routing-bias buffer (absent from seed files: it keeps its zeros); TIED: the head
# saved once as tok_embeddings.weight (the last pipeline stage reads its copy from there).
MOE = ("--model.preset=tiny-moe", "--model.n_layers=4", "--model.moe.bias_update=0.001")
TIED = "--model.tie_embeddings=true"


@pytest.mark.parametrize("model", ["dense", "moe-tied"])
def test_seed_is_bit_identical_to_the_in_memory_init(tmp_path, model):
    cfg = tiny_config(tmp_path, "--train.seed=7", *((*MOE, TIED) if model == "moe-tied" else ()))
    seed = SafetensorsDir(write_seed_checkpoint(cfg, tmp_path / "seed").parent)
    reference = dict(build_model(cfg, 320).named_parameters())
    assert seed.names() == reference.keys()
    for name, p in reference.items():
        assert torch.equal(seed.read(name), p), name


def _load_and_gather(rank, world, cfg, seed_dir):
    """Build with other random weights, load the seed, take an optimizer step without gradients
    (it must change nothing: ZeRO-1/2 write their fp32 masters back), gather the full model."""
    par = parallelized(cfg, world)
    load_weights(seed_dir, par)
    par.optimizer.step()
    par.dp.after_step()
    return par.full_state_dict()


LAYOUTS = {  # world, overrides; tied embeddings where validate() allows them (not with ZeRO-3)
    "single-tied": (1, (TIED,)),
    "tp2": (2, ("--parallel.tp=2",)),
    "pp2-tied": (2, ("--parallel.pp=2", TIED)),
    "dp2-zero1-tied": (2, ("--parallel.zero=1", TIED)),
    "dp2-zero3": (2, ("--parallel.zero=3",)),
    "dp2-ep2": (2, ("--parallel.ep=2",)),
    "dp2-tp2-zero3": (4, ("--parallel.tp=2", "--parallel.zero=3")),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_loads_the_identical_weights(tmp_path, layout):
    world, extra = LAYOUTS[layout]
    tied = TIED in extra
    write_seed_checkpoint(tiny_config(tmp_path, "--train.seed=3", *MOE, *extra), tmp_path / "seed")
    seed = SafetensorsDir(tmp_path / "seed")
    cfg = tiny_config(tmp_path, *MOE, "--train.micro_batch=1", *extra)  # train.seed 0: other initial weights
    assert validate(cfg, world) == []
    for state in run_workers(_load_and_gather, world, cfg, tmp_path / "seed"):
        assert state.keys() == (seed.names() | {f"layers.{i}.ffn.expert_bias" for i in range(4)}
                                | ({"output.weight"} if tied else set()))
        for name in seed.names():
            assert torch.equal(state[name], seed.read(name)), name  # copied, never computed: exact
        if tied:
            assert torch.equal(state["output.weight"], seed.read("tok_embeddings.weight"))
        assert not state["layers.0.ffn.expert_bias"].any()


def _initial_state(rank, world, cfg):
    return parallelized(cfg, world).full_state_dict()


INIT_LAYOUTS = {  # world, overrides: every way a rank's slice of a tensor is cut
    "tp2-sp": (2, ("--parallel.tp=2", "--parallel.sp=true")),
    "pp2-tied": (2, ("--parallel.pp=2", TIED)),
    "dp2-zero3": (2, ("--parallel.zero=3",)),
    "dp2-ep2-moe": (2, (*MOE, "--parallel.ep=2")),
    "dp2-tp2-zero3": (4, ("--parallel.tp=2", "--parallel.zero=3")),
    "dp2-tp2-zero1": (4, ("--parallel.tp=2", "--parallel.zero=1")),
}


@pytest.mark.parametrize("layout", INIT_LAYOUTS)
def test_every_layout_starts_from_the_weights_one_process_has(tmp_path, layout):
    """Built on the meta device, each rank draws only the row blocks of its own slices: gathered,
    they are the one-process model's seeded init, bit for bit (no arithmetic, only copies)."""
    world, extra = INIT_LAYOUTS[layout]
    cfg = tiny_config(tmp_path, "--train.seed=5", "--train.micro_batch=1", *extra)
    reference = build_model(cfg, 320).state_dict()
    for state in run_workers(_initial_state, world, cfg):
        assert state.keys() == reference.keys()
        for name, value in reference.items():
            assert torch.equal(state[name], value), name


def _first_loss(rank, world, cfg):
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses[0]


def test_train_starts_from_init_from(tmp_path):
    # Weights drawn with init_std 0.05: training from them must see the loss of a run whose own
    # init used 0.05 (same data, same weights), and not that of the default 0.02.
    write_seed_checkpoint(tiny_config(tmp_path, "--model.init_std=0.05"), tmp_path / "seed")
    args = (*EQUIVALENCE, "--train.steps=1", "--train.micro_batch=8")
    seeded = run_workers(_first_loss, 1, tiny_config(tmp_path, *args, f"--checkpoint.init_from={tmp_path / 'seed'}",
                                                        "--run.name=seeded"))[0]
    wide = run_workers(_first_loss, 1, tiny_config(tmp_path, *args, "--model.init_std=0.05", "--run.name=wide"))[0]
    default = run_workers(_first_loss, 1, tiny_config(tmp_path, *args, "--run.name=default"))[0]
    assert seeded == wide != default


def test_init_from_is_checked_before_any_process_starts(tmp_path, capsys):
    missing = tiny_config(tmp_path, f"--checkpoint.init_from={tmp_path / 'nothing'}")
    assert "checkpoint.init_from" in check_init_from(missing)[0] and "does not exist" in check_init_from(missing)[0]
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "pytorch_model.bin").write_bytes(b"")
    pickled = check_init_from(tiny_config(tmp_path, f"--checkpoint.init_from={tmp_path / 'torch'}"))[0]
    assert "pytorch_model.bin" in pickled and "safetensors" in pickled
    write_seed_checkpoint(tiny_config(tmp_path), tmp_path / "seed")
    wrong = check_init_from(tiny_config(tmp_path, f"--checkpoint.init_from={tmp_path / 'seed'}", "--model.dim=32",
                                        "--model.rope.theta=500000"))[0]
    assert "tok_embeddings.weight: weights (320, 64), this model (320, 32)" in wrong and "model.rope.theta" in wrong
    code = main(["train", "configs/tiny.toml", f"--run.out_dir={tmp_path}",
                 f"--checkpoint.init_from={tmp_path / 'nothing'}"])
    assert code == 2 and "checkpoint.init_from" in capsys.readouterr().err


def test_fivefold_init_writes_a_config_that_trains_from_it(tmp_path, capsys):
    assert main(["init", "configs/tiny.toml", "--out", str(tmp_path / "s"), "--model.n_layers=2"]) == 0
    assert "fivefold train" in capsys.readouterr().out
    from fivefold.config.load import load_config

    cfg = load_config(tmp_path / "s" / "fivefold.toml")
    assert cfg.checkpoint.init_from == str(tmp_path / "s") and cfg.model.n_layers == 2
    assert check_init_from(cfg) == []
    assert main(["init", "configs/tiny.toml", "--out", str(tmp_path / "s")]) == 2  # never overwrites
