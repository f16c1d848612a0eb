"""QLoRA (lora.base_dtype = "nf4", model/lora.py NF4Base): the base quantised as torchao quantises it,
frozen through training and resume, trained alike on a data-parallel layout, read dequantised by
conversion (the layouts that cannot hold it are refused by name: tests/test_bad_input.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import EQUIVALENCE, QLORA, Layout, assert_layout_reproduces, one_process, tiny_config

from fivefold.model.lora import NF4
from fivefold.parallel.forked_ranks import run_workers

PARTS = ("codes", "scales", "scale_factor", "scale_mean")


@pytest.fixture(scope="module")
def qlora_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ref-qlora")


@pytest.fixture(scope="module")
def qlora_reference(qlora_dir):
    """One process, each global batch in one micro-batch (the rows below reproduce it)."""
    return one_process(qlora_dir, *EQUIVALENCE, *QLORA)


def _initial_base(rank: int, world: int, cfg):
    """The dense weights as the run loads them, then the NF4 buffers the run quantises them into."""
    from helpers import parallelized

    from fivefold.train.loop import quantise_lora_base

    par = parallelized(cfg, world)
    dense = {k: v.clone() for k, v in par.model.state_dict().items() if k.endswith(".weight")}
    quantise_lora_base(par, cfg)
    nf4 = {k: v.clone() for k, v in par.model.state_dict().items() if NF4 in k}
    return dense, nf4


def test_base_is_torchaos_nf4_and_stays_frozen(tmp_path, qlora_reference):
    """(a) each adapted layer's buffers are torchao's to_nf4 of the loaded weight, its dequantised base
    bit for bit the reference's; (c) training leaves them untouched and trains the adapters."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    from fivefold.model.lora import nf4_tensor

    cfg = tiny_config(tmp_path, *EQUIVALENCE, *QLORA, "--train.micro_batch=8")
    dense, nf4 = run_workers(_initial_base, 1, cfg)[0]
    layers = sorted({k[:k.index(NF4)] for k in nf4})
    assert len(layers) == 2 * 7  # every default target of both layers
    for layer in layers:
        ref = to_nf4(dense[layer + ".weight"])
        parts = [nf4[layer + NF4 + p] for p in PARTS]
        assert torch.equal(nf4_tensor(*parts).get_original_weight(), ref.get_original_weight()), layer
        assert torch.equal(parts[0].flatten(), ref.quantized_data), layer
    state = qlora_reference[2]
    assert not any(k.endswith(".weight") and k.rsplit(".", 1)[0] in layers for k in state)  # no dense base kept
    for k, v in nf4.items():
        assert torch.equal(state[k], v), k  # 5 steps later, the same NF4 base
    assert all(state[k].abs().max() > 0 for k in state if k.endswith(".lora.b"))  # B started at zero


def test_ddp_dp2_trains_the_adapters_as_one_process(tmp_path, request, qlora_reference):
    """(b) data parallel over the NF4 base: the adapters within the fp32 bound, the base bit for bit."""
    layout = Layout(2, ("--train.micro_batch=4",), reference="qlora_reference", exact=tuple(NF4 + p for p in PARTS))
    assert_layout_reproduces(request, tiny_config(tmp_path, *EQUIVALENCE, *QLORA, *layout.overrides), layout)


def test_conversion_reads_the_base_dequantised(qlora_dir, qlora_reference):
    """convert, sample and checkpoint.init_from read a QLoRA checkpoint's base as its dequantised weight
    (checkpoint/convert.py DCPSource), never its NF4 parts."""
    from fivefold.checkpoint.convert import DCPSource
    from fivefold.checkpoint.run_dir import latest_checkpoint
    from fivefold.model.lora import nf4_tensor

    source, state = DCPSource(latest_checkpoint(qlora_dir / "tiny")), qlora_reference[2]
    name = "layers.0.attn.wq.weight"
    assert name in source.names() and not any(NF4 in n for n in source.names())
    assert source.shape(name) == (128, 128) and source.dtype(name) == torch.float32
    base = nf4_tensor(*(state["layers.0.attn.wq" + NF4 + p] for p in PARTS)).get_original_weight()
    assert torch.equal(source.read(name), base)
    assert torch.equal(source.read("layers.0.attn.wq.lora.b"), state["layers.0.attn.wq.lora.b"])


def test_resume_continues_with_the_same_base(tmp_path, qlora_reference):
    """(d) stopped after 2 steps and resumed: steps 3-5 as the uninterrupted run's, bit for bit (the
    checkpoint holds the NF4 parts themselves; quantising their dequantised weight again would move
    the scales)."""
    from helpers import train_and_gather

    args = (*EQUIVALENCE, *QLORA, "--train.micro_batch=8")
    first = run_workers(train_and_gather, 1, tiny_config(tmp_path, *args, "--train.stop_after=2"))[0]
    resumed = run_workers(train_and_gather, 1, tiny_config(tmp_path, *args, "--checkpoint.resume=true"))[0]
    losses, _, state = qlora_reference
    assert first[0] + resumed[0] == losses
    for k, v in state.items():
        assert torch.equal(resumed[2][k], v), k
