"""Quantized checkpoints dequantized on import (checkpoint/dequant.py) as transformers 5.23 dequantizes them."""

import pytest
import torch
from safetensors.torch import save_file

from fivefold.checkpoint.dequant import (
    DequantizedFiles,
    QuantizationError,
    dequantizing,
    fp4_e2m1_values,
    fp8_dequantize,
    mxfp4_dequantize,
)
from fivefold.checkpoint.safetensors_io import SafetensorsDir

FP8 = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}}
MXFP4 = {"quantization_config": {"quant_method": "mxfp4"}}


def _fp8(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 weight (every finite e4m3 code but the largest) and fp32 scales of 128 x 128 blocks."""
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(rows, cols, generator=g) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-rows // 128), -(-cols // 128), generator=g) * 1e-3 + 1e-5  # (Rb, Cb)
    return weight, scale


def _mx(experts: int, out: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks (E, out, G, 16) (every nibble) and E8M0 scales (E, out, G) around 2^0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 10, (experts, out, groups), generator=g, dtype=torch.uint8)
    return blocks, scales


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (100, 50)])  # whole blocks; partial edges; one block
def test_fp8_blocks_as_transformers(shape):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    weight, scale = _fp8(*shape, seed=0)
    theirs = _dequantize_fp8_weight(weight, scale, [128, 128], torch.float32)
    assert torch.equal(fp8_dequantize(weight, scale, (128, 128), torch.float32), theirs)
    # bf16: one rounding of the fp32 product (DeepSeek's cast); transformers' bf16 path rounds the scale first
    assert torch.equal(fp8_dequantize(weight, scale, (128, 128), torch.bfloat16), theirs.bfloat16())


def test_mxfp4_as_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    assert fp4_e2m1_values().tolist() == FP4_VALUES
    blocks, scales = _mx(3, 10, 4, seed=1)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # (E, in, out)
    ours = mxfp4_dequantize(blocks, scales, torch.float32)  # (E, out, in)
    assert torch.equal(ours.transpose(1, 2), theirs)
    assert torch.isnan(mxfp4_dequantize(blocks[:1, :1, :1], torch.full((1, 1, 1), 255, dtype=torch.uint8),
                                        torch.float32)).all()  # E8M0 0xFF is NaN (OCP MX v1.0 sec. 5.4.1)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A directory holding an fp8 weight with partial edge blocks, a bf16 one, and MXFP4 experts."""
    root = tmp_path_factory.mktemp("quantized")
    weight, scale = _fp8(200, 300, seed=2)
    blocks, scales = _mx(3, 10, 4, seed=3)
    tensors = {"a.weight": weight, "a.weight_scale_inv": scale, "norm.weight": torch.randn(7).bfloat16(),
               "experts.gate_up_proj_blocks": blocks, "experts.gate_up_proj_scales": scales}
    save_file(tensors, str(root / "model.safetensors"))
    return root, tensors


def test_fp8_directory_reads_dequantized_boxes(quantized):
    root, t = quantized
    files = dequantizing(SafetensorsDir(root), FP8, torch.float32)
    assert files.names() == {"a.weight", "norm.weight", "experts.gate_up_proj_blocks", "experts.gate_up_proj_scales"}
    assert files.shape("a.weight") == (200, 300) and files.dtype("a.weight") == torch.float32
    whole = fp8_dequantize(t["a.weight"], t["a.weight_scale_inv"], (128, 128), torch.float32)
    assert torch.equal(files.read("a.weight"), whole)
    for box in [(slice(100, 199), slice(5, 290)), (slice(130, 131), slice(256, 300)), (slice(0, 200), slice(3, 3))]:
        assert torch.equal(files.read("a.weight", box), whole[box])  # boxes starting and ending inside blocks
    assert torch.equal(files.read("norm.weight"), t["norm.weight"])  # unquantized tensors as stored
    assert dequantizing(SafetensorsDir(root), FP8, torch.bfloat16).read("a.weight").dtype == torch.bfloat16


def test_mxfp4_directory_reads_dequantized_boxes(quantized):
    root, t = quantized
    files = dequantizing(SafetensorsDir(root), MXFP4, torch.float32)
    name = "experts.gate_up_proj"
    assert name in files.names() and name + "_blocks" not in files.names()
    assert files.shape(name) == (3, 128, 10) and files.dtype(name) == torch.float32  # (E, in, out), as HF's param
    whole = mxfp4_dequantize(t[name + "_blocks"], t[name + "_scales"], torch.float32).transpose(1, 2)
    assert torch.equal(files.read(name), whole)
    for box in [(slice(1, 2), slice(0, 128), slice(0, 10)), (slice(0, 3), slice(33, 95), slice(4, 7))]:
        assert torch.equal(files.read(name, box), whole[box])


def test_bad_quantized_inputs_one_line_each(tmp_path, quantized):
    root, t = quantized
    cases = [
        ({"a.weight": t["a.weight"]}, FP8, "a.weight is fp8 without its block scales a.weight_scale_inv"),
        ({"a.weight": t["a.weight"], "a.weight_scale_inv": t["a.weight_scale_inv"][:1]}, FP8,
         "a.weight_scale_inv: shape (1, 3), but a.weight (200, 300) in 128 x 128 blocks needs (2, 3)"),
        ({"a.weight": t["a.weight"]}, {}, "a.weight is fp8 but config.json has no quantization_config"),
        ({"x_blocks": t["experts.gate_up_proj_blocks"]}, MXFP4, "x_blocks is MXFP4 without its scales x_scales"),
        ({"n": t["norm.weight"]}, {"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq'"),
        ({"n": t["norm.weight"]}, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}},
         "weight_block_size [128]"),
    ]
    for i, (tensors, hf, message) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        save_file(tensors, str(tmp_path / str(i) / "model.safetensors"))
        with pytest.raises(QuantizationError, match="^[^\n]*$") as e:
            dequantizing(SafetensorsDir(tmp_path / str(i)), hf, torch.bfloat16)
        assert message in str(e.value)
    assert isinstance(dequantizing(SafetensorsDir(root), FP8, torch.bfloat16), DequantizedFiles)
