"""LoRA on every dimension (model/lora.py, parallel/tensor.py's split adapters): each layout trains the
adapters as one process does, the base stays frozen bit for bit, and nothing but the adapters is
reduced or stepped."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BF16,
    EQUIVALENCE,
    LORA,
    LORA_MLA_TARGETS,
    MLA_ARGS,
    MOE_ARGS,
    Layout,
    assert_layout_reproduces,
    one_process,
    tiny_config,
)

from fivefold.model.lora import is_adapter
from fivefold.parallel.forked_ranks import run_workers

# helpers.LORA: rank 4 on the seven PEFT targets; AdamW at EQUIVALENCE's lr. B starts at zero, so the first step moves
# B alone and the later ones both factors. Bounds: the shared ones (helpers.assert_reproduces).
ROW = dict(reference="lora_reference", exact=(".weight",))  # the frozen base: bit for bit after training
LAYOUTS = {
    "ddp-dp2": Layout(2, ("--train.micro_batch=4",), **ROW),
    "zero2-dp2": Layout(2, ("--train.micro_batch=4", "--parallel.zero=2"), **ROW),
    "tp2": Layout(2, ("--parallel.tp=2", "--train.micro_batch=8"), **ROW),
    "dp2-tp2-sp-zero1": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
                                   "--train.micro_batch=2"), **ROW),
    "pp2-zb_h1": Layout(2, ("--parallel.pp=2", "--parallel.pp_schedule=zb_h1", "--train.micro_batch=2"), **ROW),
    "ring-cp2": Layout(2, ("--parallel.cp=2",), **ROW),
    "moe-tp2-ep2": Layout(4, ("--parallel.tp=2", "--parallel.ep=2", *MOE_ARGS),
                          reference="lora_moe_reference", param_atol=2e-4, exact=(".weight", ".experts.gate")),
    # latent attention's down-projections and the shared experts run on each rank's own tokens under sp:
    # their adapters' gradients are summed over tp as their weights' are
    "mla-tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4", *MLA_ARGS,
                             LORA_MLA_TARGETS), reference="lora_mla_reference", param_atol=2e-4,
                         exact=(".weight", ".experts.gate")),
    # bf16 autocast (helpers.BF16): the split adapters' products in bf16, tp's partial sums and sp
    "dp2-tp2-sp-zero1-bf16": Layout(4, ("--parallel.tp=2", "--parallel.sp=true", "--parallel.zero=1",
                                        "--train.micro_batch=2", *BF16), reference="lora_reference"),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_layouts_train_the_adapters_as_one_process(tmp_path, request, name):
    layout = LAYOUTS[name]
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *LORA, *layout.overrides), layout)


def _trainable_and_reduced(rank: int, world: int, cfg):
    from helpers import parallelized

    par = parallelized(cfg, world)
    return ([n for n, p in par.model.named_parameters() if p.requires_grad],
            sum(p.numel() for p in par.dp.params), sum(t.numel() for t in par.dp.optimizer_params()))


def test_only_the_adapters_are_reduced_and_stepped(tmp_path, lora_reference):
    """Data parallel reduces and the optimizer steps the adapters alone: at dp2 ZeRO-1 the buckets hold
    their elements, each rank's optimizer half of them; the frozen base trained no step (its weights
    equal the seeded start: the reference's `exact` rows above hold them to it bit for bit)."""
    cfg = tiny_config(tmp_path, *EQUIVALENCE, *LORA, "--parallel.zero=1", "--train.micro_batch=4")
    names, reduced, stepped = run_workers(_trainable_and_reduced, 2, cfg)[0]
    assert names and all(is_adapter(n) for n in names)
    adapters = 8 * 7 * 2  # 8 layers x 7 targets x (A, B)
    assert len(names) == adapters
    # per layer: q, k, v, o (64 x 64 each) and gate, up (128 x 64), down (64 x 128), rank 4: r (in + out)
    per_layer = 4 * 4 * (64 + 64) + 3 * 4 * (64 + 128)
    assert reduced == 8 * per_layer and stepped == reduced // 2
    start = run_workers(_seeded_base, 1, tiny_config(tmp_path / "start", *EQUIVALENCE, *LORA))[0]
    trained = lora_reference[2]
    for name, value in start.items():
        assert torch.equal(trained[name], value), name


def _seeded_base(rank: int, world: int, cfg):
    from helpers import parallelized

    par = parallelized(cfg, world)
    return {n: v for n, v in par.full_state_dict().items() if not is_adapter(n) and n.endswith(".weight")}


def test_a_lora_runs_checkpoint_samples_with_its_adapters(tmp_path, lora_reference):
    """`fivefold sample` (sample/generate.py load_model) builds the run's adapters and reads them with
    the base: the loaded model holds the trained state, B's included (trained away from zero)."""
    from fivefold.sample.generate import load_model, resolve_source

    run = lora_reference_dir(tmp_path)
    model = load_model(resolve_source(run))
    trained = lora_reference[2]
    loaded = dict(model.named_parameters())
    assert {n for n in loaded if is_adapter(n)} == {n for n in trained if is_adapter(n)}
    assert any(n.endswith(".lora.b") and trained[n].abs().max() > 0 for n in trained)
    for name, value in trained.items():
        if name in loaded:
            assert torch.equal(loaded[name].detach(), value), name


def lora_reference_dir(tmp_path):
    """A one-process LoRA run like the reference's, its directory (the reference keeps none of its own)."""
    one_process(tmp_path, *EQUIVALENCE, *LORA)
    return tmp_path / "tiny"
