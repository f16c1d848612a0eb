"""Quantized Hugging Face weights read as the unquantized ones (DeepSeek-V3 / Kimi K2 fp8, gpt-oss MXFP4).

A released checkpoint may store some weights quantized (config.json `quantization_config`); fivefold
trains in bf16/fp32, so they are dequantized on import, one tensor (or one box of it) at a time, and
`DequantizedFiles` shows the directory under the names and layouts an unquantized save_pretrained
writes: each family's mapping reads it as it reads any other checkpoint.

- fp8 with block scales (quant_method "fp8", weight_block_size [128, 128]; DeepSeek-V3 technical
  report, arXiv 2412.19437, sec. 3.3.2 "fine-grained quantization"): a float8 e4m3 weight W (R, C) comes
  with `<name>_scale_inv` (ceil(R / 128), ceil(C / 128)) in fp32, and the weight is W * scale of its
  128 x 128 block; blocks at the right and bottom edges are partial (R or C not a multiple of 128). The
  product is taken in fp32 and rounded once to the dtype asked for, as DeepSeek's own fp8-to-bf16 cast
  does (its inference/kernel.py `weight_dequant`); transformers multiplies in the target dtype, which
  rounds the scale first (tests/checkpoint/test_dequant.py compares in fp32, where both are exact).
- MXFP4 (quant_method "mxfp4"; OCP Microscaling Formats (MX) Specification v1.0, sec. 5 and 6.3): blocks
  of 32 FP4 E2M1 values sharing an E8M0 scale 2^(s - 127). gpt-oss stores each expert tensor
  `<name>` (E, in, out) as `<name>_blocks` (E, out, in / 32, 16) uint8, two values a byte (the low
  nibble is the earlier value), and `<name>_scales` (E, out, in / 32) uint8, i.e. transposed; the
  layout is read off transformers 5.23's integrations/mxfp4.py (`convert_moe_packed_tensors`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

SCALE_SUFFIX = "_scale_inv"  # fp8: `x.weight` is scaled by `x.weight_scale_inv`
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # MXFP4: `x` is stored as `x_blocks` and `x_scales`
MX_BLOCK = 32  # values sharing one scale (OCP MX v1.0, Table 1: k = 32 for every concrete format)
E8M0_BIAS = 127  # OCP MX v1.0 sec. 5.4.1: E8M0 is an exponent with bias 127; 0xFF is NaN
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
METHODS = ("fp8", "mxfp4")


class QuantizationError(ValueError):
    """A quantized checkpoint fivefold cannot dequantize; the message names the tensor or key."""


def fp4_e2m1_values() -> torch.Tensor:
    """The 16 FP4 E2M1 values by code (OCP MX v1.0 sec. 5.3.3): sign, 2 exponent bits of bias 1, 1
    mantissa bit; exponent 0 is subnormal (0 or 0.5). Gives 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives."""
    codes = torch.arange(16)
    sign = 1 - 2 * (codes >> 3)
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    normal = torch.exp2(exponent - 1.0) * (1 + mantissa / 2)
    return sign * torch.where(exponent == 0, mantissa * 0.5, normal)  # (16,)


def fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """weight (R, C) fp8 times the scale of its block, in `dtype`. scale_inv (Rb, Cb): the scales of the
    blocks the box covers; `offset`: where the box starts inside its first block (a box read off a
    larger weight), so the first block row/column may be partial as well as the last."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)  # (Rb*br, Cb*bc)
    scale = scale[offset[0]:offset[0] + rows, offset[1]:offset[1] + cols]  # (R, C): edge blocks cut
    return (weight.float() * scale).to(dtype)  # one rounding, from the exact fp32 product


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks (..., G, 16) uint8 and scales (..., G) uint8 -> (..., G * 32) values in `dtype`:
    value 2j of a block is byte j's low nibble, value 2j + 1 its high one."""
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # (..., G, 16, 2)
    values = fp4_e2m1_values()[codes].flatten(-2)  # (..., G, 32)
    power = torch.exp2(scales.float() - E8M0_BIAS)  # (..., G); exact: 2^-127 .. 2^127 are fp32 numbers
    power = torch.where(scales == 0xFF, torch.nan, power)
    return (values * power[..., None]).flatten(-2).to(dtype)  # (..., G * 32); FP4 x 2^k is exact in fp32


class Files(Protocol):
    """What is read: SafetensorsDir's interface (checkpoint/safetensors_io.py)."""

    def names(self) -> frozenset[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor: ...


def quantization(hf: dict, where: str = "config.json") -> tuple[str, tuple[int, int]] | None:
    """(method, fp8 block) from config.json's quantization_config; None when unquantized."""
    q = hf.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method not in METHODS:
        raise QuantizationError(f"{where}: quantization_config.quant_method {method!r}: fivefold dequantizes "
                                f"'fp8' (block scales, DeepSeek-V3 / Kimi K2) and 'mxfp4' (gpt-oss) only; use an "
                                f"unquantized checkpoint")
    block = q.get("weight_block_size") or [128, 128]
    if method == "fp8" and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise QuantizationError(f"{where}: quantization_config.weight_block_size {block!r}: give two positive "
                                f"integers (DeepSeek-V3: [128, 128])")
    return method, (block[0], block[1])


class DequantizedFiles:
    """A directory's tensors with every quantized one shown as the unquantized tensor it stands for
    (name, shape, `dtype`), dequantized box by box on read; the scale tensors are not shown."""

    def __init__(self, files: Files, method: str, block: tuple[int, int], dtype: torch.dtype):
        self.files, self.method, self.block, self.to = files, method, block, dtype
        have = files.names()
        self.fp8: frozenset[str] = frozenset()
        self.mx: frozenset[str] = frozenset()
        if method == "fp8":
            self.fp8 = frozenset(n for n in have if files.dtype(n) in FP8_DTYPES)
            lost = sorted(n for n in self.fp8 if n + SCALE_SUFFIX not in have)
            if lost:
                raise QuantizationError(f"{lost[0]} is fp8 without its block scales {lost[0]}{SCALE_SUFFIX}"
                                        + (f" ({len(lost) - 1} more such tensors)" if len(lost) > 1 else "")
                                        + ": the download is incomplete, or give the unquantized checkpoint")
            hidden = {n + SCALE_SUFFIX for n in self.fp8}
            for name in self.fp8:
                self._check_fp8(name)
        else:
            self.mx = frozenset(n[:-len(MX_BLOCKS)] for n in have if n.endswith(MX_BLOCKS))
            lost = sorted(n for n in self.mx if n + MX_SCALES not in have)
            if lost:
                raise QuantizationError(f"{lost[0]}{MX_BLOCKS} is MXFP4 without its scales {lost[0]}{MX_SCALES}: "
                                        f"the download is incomplete, or give the unquantized checkpoint")
            hidden = {n + s for n in self.mx for s in (MX_BLOCKS, MX_SCALES)}
            for name in self.mx:
                self._check_mx(name)
        self._names = frozenset(have - hidden) | self.mx

    def _check_fp8(self, name: str) -> None:
        shape, scale = self.files.shape(name), self.files.shape(name + SCALE_SUFFIX)
        grid = tuple(math.ceil(n / b) for n, b in zip(shape, self.block, strict=False))
        if len(shape) != 2 or tuple(scale) != grid:
            raise QuantizationError(f"{name + SCALE_SUFFIX}: shape {tuple(scale)}, but {name} {tuple(shape)} in "
                                    f"{self.block[0]} x {self.block[1]} blocks needs {grid}")

    def _check_mx(self, name: str) -> None:
        blocks, scales = self.files.shape(name + MX_BLOCKS), self.files.shape(name + MX_SCALES)
        if len(blocks) != 4 or blocks[-1] != MX_BLOCK // 2 or tuple(blocks[:-1]) != tuple(scales):
            raise QuantizationError(f"{name}{MX_BLOCKS} {tuple(blocks)} / {name}{MX_SCALES} {tuple(scales)}: "
                                    f"expected (E, out, in / 32, 16) and (E, out, in / 32) (gpt-oss's layout)")

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mx:
            experts, out, groups, _ = self.files.shape(name + MX_BLOCKS)
            return (experts, groups * MX_BLOCK, out)
        return self.files.shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self.to if name in self.fp8 or name in self.mx else self.files.dtype(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or its box `index` (one slice per dim), dequantized when it is stored quantized."""
        if name not in self.fp8 and name not in self.mx:
            return self.files.read(name, index)
        box = index or tuple(slice(0, n) for n in self.shape(name))
        if any(s.stop <= s.start for s in box):  # an empty shard
            return torch.empty([max(0, s.stop - s.start) for s in box], dtype=self.to)
        if name in self.fp8:
            rows, cols = box
            (br, bc), first = self.block, (rows.start // self.block[0], cols.start // self.block[1])
            grid = (slice(first[0], (rows.stop - 1) // br + 1), slice(first[1], (cols.stop - 1) // bc + 1))
            return fp8_dequantize(self.files.read(name, box), self.files.read(name + SCALE_SUFFIX, grid), self.block,
                                  self.to, (rows.start - first[0] * br, cols.start - first[1] * bc))
        experts, ins, outs = box  # the blocks are stored (E, out, in / 32, 16): whole groups along `in`
        groups = slice(ins.start // MX_BLOCK, (ins.stop - 1) // MX_BLOCK + 1)
        packed = self.files.read(name + MX_BLOCKS, (experts, outs, groups, slice(0, MX_BLOCK // 2)))  # (E', O', G', 16)
        scales = self.files.read(name + MX_SCALES, (experts, outs, groups))  # (E', O', G')
        values = mxfp4_dequantize(packed, scales, self.to)  # (E', O', G' * 32)
        skip = ins.start - groups.start * MX_BLOCK
        return values[..., skip:skip + ins.stop - ins.start].transpose(1, 2).contiguous()  # (E', I', O')


def dequantizing(files: Files, hf: dict, dtype: torch.dtype, where: str = "config.json") -> Files:
    """`files` as the unquantized checkpoint they stand for (DequantizedFiles), or unchanged when
    config.json `hf` declares no quantization (then an fp8 tensor, scaled by what nobody says, is refused)."""
    found = quantization(hf, where)
    if found is None:
        fp8 = sorted(n for n in files.names() if files.dtype(n) in FP8_DTYPES)
        if fp8:
            raise QuantizationError(f"{fp8[0]} is fp8 but {where} has no quantization_config: give the checkpoint's "
                                    f"own config.json (DeepSeek-V3's declares quant_method 'fp8')")
        return files
    return DequantizedFiles(files, found[0], found[1], dtype)
