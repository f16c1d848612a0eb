"""Activation recomputation changes memory, never the numbers."""

import pytest
import torch
from helpers import tiny_config
from torch.nn.attention import SDPBackend, sdpa_kernel

from fivefold.config.derive import derive
from fivefold.config.load import replace
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.transformer import cross_entropy_sum
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.recompute import apply_recompute
from fivefold.train.loop import build_model, train

ARGS = ("--train.steps=3", "--data.max_bytes=20000", "--data.val_fraction=0.0")


def _train(rank, world, cfg):
    return train(cfg, progress=False, return_state=True)


@pytest.mark.parametrize("extra", [(), ("--parallel.tp=2", "--parallel.sp=true"), ("--train.dtype=bf16",)],
                         ids=["tp1", "tp2-sp", "tp1-bf16"])
def test_recompute_modes_give_identical_training(tmp_path, extra):
    """In bf16 too: the recomputed forward runs under the autocast the first ran under."""
    world = 2 if "--parallel.tp=2" in extra else 1
    runs = {mode: run_workers(_train, world,
                              tiny_config(tmp_path / mode, *ARGS, *extra, f"--train.recompute={mode}"))[0]
            for mode in ("none", "selective", "full")}
    for mode in ("selective", "full"):  # the same operations again: bit for bit on CPU
        assert runs[mode].losses == runs["none"].losses, mode
        assert runs[mode].grad_norms == runs["none"].grad_norms, mode
        for name, ref in runs["none"].state.items():
            assert torch.equal(runs[mode].state[name], ref), (mode, name)


def saved_bytes(model, x) -> int:
    """Bytes autograd keeps for backward during one forward (storages counted once, parameters not)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_sum(model(x), x)
    loss.backward()
    return sum(seen.values())


def _saved_bytes_by_mode(rank, world, cfg):
    B, T = 2, 64
    x = torch.randint(0, 320, (B, T), generator=torch.Generator().manual_seed(0))
    derived = derive(cfg, world, unpadded_vocab(cfg))
    mesh = Mesh.from_config(cfg, derived)
    sizes = {}
    with sdpa_kernel(SDPBackend.MATH):  # the CPU flash kernel keeps no score matrix to begin with
        for mode in ("none", "selective", "full"):
            model = build_model(cfg, 320)
            apply_recompute(model, mesh, replace(cfg, train={"recompute": mode}), derived)
            sizes[mode] = saved_bytes(model, x)
    return sizes


def test_selective_recompute_drops_the_score_matrix(tmp_path):
    B, T, L, H = 2, 64, 8, 4
    sizes = run_workers(_saved_bytes_by_mode, 1, tiny_config(tmp_path))[0]
    scores = B * H * T * T * 4  # one fp32 (B, H, T, T) matrix per layer
    assert sizes["none"] - sizes["selective"] >= L * scores  # at least the scores of every layer
    assert sizes["full"] < sizes["selective"] < sizes["none"]
