"""The planner's price of optim.name = "muon" (planner/muon.py, muon_step.py): the matrices it counts
are the model's, its state is one fp32 moment per element, its all_to_alls and Newton-Schulz FLOPs per
rank are the arithmetic of parallel/muon.py's owners, and `fivefold plan` shows them."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from fivefold.cli import main
from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.model.presets import PRESETS
from fivefold.model.transformer import Transformer
from fivefold.parallel import muon as runtime
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.planner.layout import rank_shares
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.muon import block_matrices, ns_flops, rank_ns_flops, stage_pieces
from fivefold.planner.muon_step import ns_rate
from fivefold.validate import validate

H100 = get_hardware("h100")
# Llama 3 8B's Muon matrices, per block: wq, wo 4096 x 4096, wk, wv 1024 x 4096, gate, up, down 14336 x 4096
LLAMA_BLOCK = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096
LLAMA_MUON = 32 * LLAMA_BLOCK  # 6,979,321,856 of its 8,030,261,248 parameters
LLAMA_PARAMS = 8_030_261_248


def config(world: int, *overrides: str, optim: str = "muon"):
    cfg = load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=8192", "--train.micro_batch=1",
                             "--train.global_batch=64", f"--optim.name={optim}", *overrides])
    assert validate(cfg, world) == []
    return cfg


def both(world: int, *overrides: str, **kwargs):
    return [estimate(config(world, *overrides, optim=o), world, H100, **kwargs) for o in ("adamw", "muon")]


@pytest.mark.parametrize("preset,changes", [
    ("tiny", {}), ("tiny-moe", {}), ("tiny-mla", {"mtp_layers": 1}), ("gpt-oss-20b", {"n_layers": 2}),
    ("deepseek-v3", {"n_layers": 5, "mtp_layers": 1}), ("qwen2.5-0.5b", {"n_layers": 2}),
])
def test_the_planners_matrices_are_the_ones_muon_steps(preset, changes):
    """Shapes (as sorted sides, what NS5's cost reads) and counts of every matrix is_muon_matrix picks
    in the model built on the meta device, and the planner's list: the same multiset."""
    m = dataclasses.replace(PRESETS[preset], **{"vocab_size": PRESETS[preset].vocab_size or 1000, **changes})
    with torch.device("meta"):
        model = Transformer(m)
    built = collections.Counter()
    for name, p in model.named_parameters():
        if runtime.is_muon_matrix(name, p):
            built[tuple(sorted(p.shape[-2:]))] += p.shape[0] if p.ndim == 3 else 1
    planned = collections.Counter()
    for layer in range(m.n_layers + m.mtp_layers):
        for mm in block_matrices(m, layer):
            planned[tuple(sorted(mm.shape))] += mm.count
    planned[tuple(sorted((m.dim, 2 * m.dim)))] += m.mtp_layers  # eh_proj
    assert +planned == built


@pytest.mark.parametrize("shape", [(4096, 4096), (1024, 4096), (14336, 4096), (3, 7)])
def test_ns_flops_is_the_runtimes(shape):
    assert ns_flops(shape, 5) == runtime.ns_flops(shape, 5)


def test_optimizer_state_muon_against_adamw_zero1_dp8():
    """ZeRO's accounting (2,2,12): AdamW 12 bytes per parameter over 8 ranks; Muon's matrices 8 (fp32
    master + one moment): 12,045,391,872 -> 8,555,730,944 bytes per rank. Weights and gradients alike."""
    adamw, muon = both(8, "--parallel.dp=8", "--parallel.zero=1", b=BytesPerParam())
    assert adamw.memory["optimizer"] == 12 * LLAMA_PARAMS / 8 == 12_045_391_872
    assert muon.memory["optimizer"] == pytest.approx(12 * LLAMA_PARAMS / 8 - 4 * LLAMA_MUON / 8, abs=1)
    assert muon.memory["optimizer"] == pytest.approx(8_555_730_944, abs=1)
    for part in ("params", "grads", "activations", "buffers"):
        assert muon.memory[part] == adamw.memory[part]


def test_optimizer_state_as_fivefold_holds_it_under_ddp():
    """fivefold's own (implementation=True, what the dry run builds): AdamW's two fp32 moments, Muon's
    momentum_buffer, no master under DDP: 8 and 4 bytes per element."""
    adamw, muon = both(2, "--parallel.dp=2", "--parallel.zero=0", implementation=True)
    assert adamw.memory["optimizer"] == 8 * LLAMA_PARAMS
    assert muon.memory["optimizer"] == 8 * (LLAMA_PARAMS - LLAMA_MUON) + 4 * LLAMA_MUON


def test_all_to_all_bytes_per_rank_zero1_dp2_tp2():
    """dp2 x tp2, ZeRO-1: a rank holds half of each tp slice (LLAMA_MUON / 4 elements, bf16). The dp
    stage sends 1/2 of them in the gather and 1/2 back; the tp stage, 1/2 of the whole slices it owns
    after it (as many elements): each axis LLAMA_MUON / 4 x 2 bytes x 1/2 x 2 = 3,489,660,928 bytes."""
    adamw, muon = both(4, "--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1")
    expected = LLAMA_MUON // 4 * 2 // 2 * 2
    assert expected == 3_489_660_928
    for axis in ("dp", "tp"):
        part = muon.comm[axis].merged["muon"]
        assert part.bytes == expected and part.calls == 2 and part.op_steps == {"all_to_all": 2}
        assert muon.comm[axis].bytes == adamw.comm[axis].bytes + expected
        assert "muon" not in adamw.comm[axis].merged
    for axis in ("pp", "cp", "ep"):
        assert muon.comm[axis].bytes == adamw.comm[axis].bytes
    assert muon.comm_by_pp_rank[0]["dp"].bytes == muon.comm["dp"].bytes  # what the self-check compares


def test_newton_schulz_flops_priced_in_the_optimizer_step():
    """NS5 FLOPs of the 224 matrices, over the dp_shard x tp owners under ZeRO and over tp under DDP,
    at H100's bf16 matmul rate, plus the all_to_alls, is what Muon adds to the optimizer term; the
    model FLOPs (MFU's numerator) do not change."""
    per_block = (2 * ns_flops((4096, 4096), 5) + 2 * ns_flops((1024, 4096), 5) + 3 * ns_flops((14336, 4096), 5))
    total = 32 * per_block
    cfg = config(4, "--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1")
    d = derive(cfg, 4, unpadded_vocab(cfg))
    share = rank_shares(cfg, model_counts(cfg.model, d.vocab_size))[0]
    assert rank_ns_flops(cfg, d, share) == total / 4
    ddp = config(4, "--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=0")
    assert rank_ns_flops(ddp, derive(ddp, 4, unpadded_vocab(ddp)), share) == total / 2
    adamw, muon = both(4, "--parallel.dp=2", "--parallel.tp=2", "--parallel.zero=1")
    rate, figure = ns_rate(H100)
    assert figure == "matmul_efficiency" and rate == H100.peak_flops * H100.matmul_efficiency
    comm_s = sum(muon.comm[a].merged["muon"].time_s for a in ("dp", "tp"))
    added = muon.time_split["optimizer"] - adamw.time_split["optimizer"]
    assert added == pytest.approx(total / 4 / rate + comm_s, rel=1e-9)
    assert muon.step_time_s - adamw.step_time_s == pytest.approx(added, rel=1e-6)
    assert muon.flops == adamw.flops
    assert any(what == "optimizer, muon" for what, _, _ in muon.explain)
    assert not any("muon" in what for what, _, _ in adamw.explain)


def test_expert_stages():
    """Routed experts: with ep = 1 ZeRO keeps whole experts on each rank (no expert stage); with ep = 2
    their rows travel over expert_dp = dp x cp / ep; under DDP only tp's stage is left."""
    base = ["--model.preset=tiny-moe", "--train.micro_batch=1", "--train.global_batch=8", "--optim.name=muon"]

    def stages(*overrides):
        cfg = load_config(None, [*base, *overrides])
        assert validate(cfg, 8) == []
        d = derive(cfg, 8, unpadded_vocab(cfg))
        share = rank_shares(cfg, model_counts(cfg.model, d.vocab_size))[0]
        return [(axis, n) for axis, n, _ in stage_pieces(cfg, d, share)]

    assert stages("--parallel.dp=4", "--parallel.tp=2", "--parallel.zero=1") == [("dp", 4), ("tp", 2)]
    assert stages("--parallel.dp=4", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=1") == [
        ("dp", 4), ("dp", 2), ("tp", 2)]
    assert stages("--parallel.dp=4", "--parallel.tp=2", "--parallel.ep=2", "--parallel.zero=0") == [("tp", 2)]


def test_plan_shows_muon(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "4", "--gpu", "h100", "--seq", "8192", "--global-batch", "64",
               "--layout", "dp=2,tp=2,zero=1,micro_batch=1", "--optim.name=muon", "--explain"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "muon:" in out and "optimizer, muon" in out and "tp traffic, muon" in out
