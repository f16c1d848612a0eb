"""Muon (parallel/muon.py): one process bit for bit torch.optim.Muon + torch.optim.AdamW on the same
split, the owners' gathers and returns (matrix_owners.py) exact at every cut, and the split itself."""

from __future__ import annotations

import dataclasses
import shutil
import zlib

import pytest
import torch
from helpers import EQUIVALENCE, LORA, MOE_ARGS, MUON, OneRank, parallelized, tiny_config

from fivefold.config.schema import OptimConfig
from fivefold.model.transformer import Transformer
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.muon import ADAMW_MATRICES, build_muon, is_muon_matrix
from fivefold.parallel.optimizer import build_optimizer, init_optimizer_state, set_lr
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware


def _model(tmp_path, *overrides: str) -> Transformer:
    cfg = tiny_config(tmp_path, *overrides)
    torch.manual_seed(0)
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=64))
    model.init_weights()
    return model


def test_split_by_name(tmp_path):
    """Latent attention, the MoE's experts and shared expert, MTP's projection take Muon; the
    embedding, head, routers, norms, sinks and expert biases keep AdamW."""
    model = _model(tmp_path, "--model.preset=tiny-mla", "--model.mtp_layers=1", "--model.attention.sinks=true",
                   "--model.moe.linear_bias=true")
    muon = {n for n, p in model.named_parameters() if is_muon_matrix(n, p)}
    assert {"layers.1.attn.wq_a.weight", "layers.1.attn.wkv_b.weight", "layers.1.attn.wo.weight",
            "layers.1.ffn.experts.gate", "layers.1.ffn.experts.down", "layers.1.ffn.shared.up.weight",
            "mtp.0.eh_proj.weight"} <= muon
    assert not muon & {"tok_embeddings.weight", "output.weight", "layers.1.ffn.router.weight", "norm.weight",
                       "layers.1.attn.sinks", "layers.1.ffn.experts.gate_bias", "layers.1.attn.q_a_norm.weight"}
    assert all(not n.endswith(ADAMW_MATRICES) and p.ndim >= 2 for n, p in model.named_parameters() if n in muon)


@pytest.mark.parametrize("rule", ["match_rms_adamw", "original"])
def test_one_process_is_torch_muon_bit_for_bit(tmp_path, rule):
    """Three steps of random gradients: every parameter equals torch.optim.Muon on the Muon matrices
    (each expert its own (out, in) matrix) and torch.optim.AdamW on the rest, bit for bit; the state
    init_optimizer_state makes is the one the first step would."""
    model = _model(tmp_path, "--model.preset=tiny-moe")
    cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, muon=dataclasses.replace(OptimConfig().muon,
                                                                                        adjust_lr=rule))
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}
    ours = build_muon(OneRank(model), OneRank(model), cfg, build_optimizer)
    init_optimizer_state(ours)
    assert all(set(ours.state[p]) == ({"momentum_buffer"} if is_muon_matrix(n, p) else
                                      {"step", "exp_avg", "exp_avg_sq"}) for n, p in model.named_parameters())

    # the reference: each expert's matrix a leaf of its own, as the (out, in) weight of its Linear
    leaves: dict[str, torch.Tensor] = {}
    for n, p in ref.items():
        if is_muon_matrix(n, p) and p.ndim == 3:
            leaves |= {f"{n}[{e}]": p[e].T.contiguous().requires_grad_() for e in range(p.shape[0])}
        else:
            leaves[n] = p.requires_grad_()
    muon_ref = torch.optim.Muon([t for n, t in leaves.items() if is_muon_matrix(n.split("[")[0], t)], lr=cfg.lr,
                                weight_decay=cfg.weight_decay, adjust_lr_fn=rule)
    adamw_ref = build_optimizer([t for n, t in leaves.items() if not is_muon_matrix(n.split("[")[0], t)], cfg)

    for step in range(3):
        set_lr(ours, cfg.lr * (step + 1) / 3)
        for opt in (muon_ref, adamw_ref):
            set_lr(opt, cfg.lr * (step + 1) / 3)
        for n, p in model.named_parameters():
            p.grad = torch.randn_like(p)
            if is_muon_matrix(n, p) and p.ndim == 3:
                for e in range(p.shape[0]):
                    leaves[f"{n}[{e}]"].grad = p.grad[e].T.contiguous()
            else:
                leaves[n].grad = p.grad.clone()
        ours.step()
        muon_ref.step()
        adamw_ref.step()
    for n, p in model.named_parameters():
        if is_muon_matrix(n, p) and p.ndim == 3:
            for e in range(p.shape[0]):
                assert torch.equal(p.detach()[e], leaves[f"{n}[{e}]"].detach().T), f"{n}[{e}]"
        else:
            assert torch.equal(p.detach(), leaves[n].detach()), n


# ---- one step from the same gradient at every layout -------------------------------------------------
# Training runs differ from one process by fp32 summation order, which bf16's Newton-Schulz rounds into
# differences as large as the update itself (measured: one process with 4 micro-batches against 1,
# 2.1e-3 after 5 steps at lr 1e-2), so they cannot show an exchange that moved a piece a little wrong.
# Here every layout steps from the same gradient, laid out as a checkpoint reshards (the momentum's
# DTensor placements), so the result must be one process's bit for bit, and the Newton-Schulz work
# counts how often each matrix was orthogonalised.
STEP_LAYOUTS = {
    "dp2-ddp": (2, ("--train.micro_batch=4",), 2),  # DDP's replicas each orthogonalise everything
    "dp2-zero1": (2, ("--parallel.zero=1", "--train.micro_batch=4"), 1),
    "tp2-ddp": (2, ("--parallel.tp=2", "--train.micro_batch=8"), 1),
    "dp2-tp2-sp-zero3": (4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=3",
                             "--train.micro_batch=4"), 1),
    "pp2-dp2-zero2": (4, ("--parallel.pp=2", "--parallel.zero=2", "--train.micro_batch=2"), 1),
    "cp2-dp2-zero1": (4, ("--parallel.cp=2", "--parallel.zero=1", "--train.micro_batch=4"), 2),  # cp: replicas
    "hsdp2x2-zero2": (4, ("--parallel.dp_replicate=2", "--parallel.zero=2", "--train.micro_batch=2"), 2),
    # the fp32 masters are what Muon steps, whatever the weights compute in
    "dp2-zero3-param-bf16-fp8": (2, ("--parallel.zero=3", "--parallel.param_dtype=bf16", "--train.fp8=tensorwise",
                                     "--train.micro_batch=4"), 1),
    "moe-dp4-ep2-zero1": (4, ("--parallel.ep=2", "--parallel.zero=1", "--train.micro_batch=2", *MOE_ARGS), 1),
    # ep = 1: ZeRO splits each stack along its experts, so every rank holds whole experts of its own
    "moe-dp2-zero2": (2, ("--parallel.zero=2", "--train.micro_batch=4", *MOE_ARGS), 1),
    "moe-tp2-ep2-zero3": (4, ("--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=3", "--train.micro_batch=4",
                              *MOE_ARGS), None),  # experts: tp's ranks are replicas, dense matrices are not
    # LoRA: the adapters are the matrices, B's tp slices (column layers) and A's (row layers) gathered to
    # an owner, the whole factors' rows over dp_shard; tp's ranks are replicas of the whole ones
    "lora-dp2-tp2-zero3": (4, ("--parallel.tp=2", "--parallel.zero=3", "--train.micro_batch=4", *LORA), None),
}


def _gradient(name: str, shape: torch.Size) -> torch.Tensor:
    """The same full-shape gradient for a parameter at every layout, seeded by its name."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _one_step(rank: int, world: int, cfg):
    """Worker: the layout's Muon, its momentum zero and its gradients cut from `_gradient` (loaded as
    the momentum's checkpoint would be, then moved into .grad), one step; the gathered parameters and
    this rank's Newton-Schulz FLOPs."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    par = parallelized(cfg, world)
    init_optimizer_state(par.optimizer)
    state = par.optim_state_dict()
    for key, value in state.items():
        if key.endswith(".momentum_buffer"):
            full = _gradient(key.removeprefix("state.").removesuffix(".momentum_buffer"), value.shape)
            state[key] = distribute_tensor(full, value.device_mesh, value.placements) if isinstance(
                value, DTensor) else full
    par.load_optim_state_dict(state)
    for t in par.optimizer.pieces:
        buf = par.optimizer.state[t]["momentum_buffer"]
        t.grad, _ = buf.clone(), buf.zero_()
    set_lr(par.optimizer, 0.02)
    par.optimizer.step()
    par.dp.after_step()
    return par.full_state_dict(), par.optimizer.flops, par.optimizer.exchanged_bytes


def _muon_config(tmp_path, *overrides: str):
    return tiny_config(tmp_path, *EQUIVALENCE, "--optim.name=muon", *overrides)


@pytest.fixture(scope="module")
def one_step_references(tmp_path_factory):
    """One process's step, dense and MoE."""
    out = {}
    for kind, args in (("dense", ()), ("moe", MOE_ARGS), ("lora", LORA)):
        cfg = _muon_config(tmp_path_factory.mktemp(kind), "--train.micro_batch=8", *args)
        out[kind] = run_workers(_one_step, 1, cfg)[0]
    return out


@pytest.mark.parametrize("name", list(STEP_LAYOUTS))
def test_one_step_equals_one_process(tmp_path, one_step_references, name):
    """Every layout's step equals one process's from the same gradient, the Newton-Schulz work over
    the ranks is one process's times the replicas (ZeRO and tp: each matrix once), and each rank's
    exchange sends the bytes the planner prices."""
    ranks, overrides, replicas = STEP_LAYOUTS[name]
    results = run_workers(_one_step, ranks, _muon_config(tmp_path, *overrides))
    ref_state, ref_flops, _ = one_step_references[name.split("-")[0] if name.startswith(("moe", "lora")) else "dense"]
    for state, _, _ in results:
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), key
    if replicas is not None:
        assert sum(flops for _, flops, _ in results) == replicas * ref_flops
    if "pp" not in name:  # every rank sends what the planner prices (its all_to_alls, gather and return)
        cfg = _muon_config(tmp_path, *overrides)
        planned = estimate(cfg, ranks, get_hardware("h100")).comm
        assert [sent for _, _, sent in results] == [sum(
            planned[axis].merged["muon"].bytes for axis in ("dp", "tp") if "muon" in planned[axis].merged)] * ranks


# ---- resumed at another layout (the failure Megatron-LM#6920 reported: a resume silently wrong) ----------
def _train_losses(rank: int, world: int, cfg) -> list[float]:
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def _momenta(checkpoint) -> dict[str, torch.Tensor]:
    """Every Muon momentum a checkpoint holds, whole (the shards of every rank put together)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.parent / "whole.pt")
    optim = torch.load(checkpoint.parent / "whole.pt", weights_only=False)["optim"]
    return {k: v for k, v in optim.items() if k.endswith("momentum_buffer")}


@pytest.mark.parametrize("before,after", [
    ((2, "--parallel.zero=3"), (2, "--parallel.tp=2")),
    ((2, "--parallel.tp=2"), (2, "--parallel.zero=3")),
], ids=["zero3-dp2-to-tp2", "tp2-to-zero3-dp2"])
def test_resume_at_another_layout_continues_the_momentum(tmp_path, before, after):
    """A run saved at one layout resumes at the other and continues as the uninterrupted run did:
    the losses of the steps after the resume, and every momentum at the end (saved as DTensors of
    the whole matrices, each layout writing and reading its own pieces). A resume that lost or
    misplaced a momentum moves it by its own size (up to 7e-3 here), one that kept it by summation
    order (measured: 1.5e-7). The first version of this test found one: DDP's load replaced the
    optimizer's state dict, and AdamW went on stepping the old one (Muon.__setstate__)."""
    from fivefold.checkpoint.run_dir import complete_checkpoints

    args = (*EQUIVALENCE, *MUON, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=2")
    losses = run_workers(_train_losses, before[0], tiny_config(tmp_path, *args, *before[1:]))[0]
    last = complete_checkpoints(tmp_path / "tiny")[-1]
    uninterrupted = _momenta(last)
    shutil.rmtree(last)
    resumed = run_workers(_train_losses, after[0],
                          tiny_config(tmp_path, *args, *after[1:], "--checkpoint.resume=true"))[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    continued = _momenta(complete_checkpoints(tmp_path / "tiny")[-1])
    assert continued.keys() == uninterrupted.keys() and len(continued) == 56
    for key, value in uninterrupted.items():
        torch.testing.assert_close(continued[key], value, rtol=0, atol=1e-6, msg=key)
