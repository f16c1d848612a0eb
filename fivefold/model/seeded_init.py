"""The seeded initialisation: every parameter's values a pure function of (seed, name, row block).

A rank of a large layout holds slices (a tp column block, an ep group's experts, a ZeRO row range)
and must never build the whole tensor to initialise its part; one process must get exactly the
values every layout starts from. So a parameter is defined block by block:

- view it as rows of its last dim: shape (d0, ..., dk) is N = d0 x ... x d(k-1) rows of length dk
  (an expert tensor (E, dim, hidden) is E x dim rows of length hidden);
- cut the rows into blocks of `block_rows(shape)` rows, about BLOCK_ELEMENTS numbers each;
- block b is drawn from its own generator, seeded by a hash of (train.seed, parameter name, b),
  from Normal(0, std) with the std of `init_std` (GPT-2's: residual output projections scaled by
  1/sqrt(2 L)); biases (attention's, the router's, the experts') and attention sinks are zeros, other
  1-D parameters (norm weights) a scale of one (1 - model.norm.offset); a LoRA adapter's A uniform
  (PEFT's Kaiming-uniform), its B zeros (model/lora.py).

`init_box` gives the values of any box (a slice per dim) by drawing only the blocks that hold its
rows, one at a time, straight into the box where it holds a block whole: its peak memory is the
box plus one block (256 KB). `init_tensor` fills a whole tensor the same way (one process), and
`SeededInit` offers the definition as a weight source (checkpoint/weights.py), so starting a run from
the seed and from a checkpoint are one code path.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Iterator

import torch
from torch import nn

from fivefold.model.config import ModelConfig
from fivefold.model.lora import LORA_A, LORA_B

BLOCK_ELEMENTS = 1 << 16  # numbers per block: 256 KB of fp32, whatever the layout
# Biases start at zero: attention's (attention.qkv_bias, out_bias: wq/wk/wv/wo.bias) and the MoE's
# (moe.linear_bias: the router's (E,), the experts' (E, hidden) / (E, dim)).
BIASES = (".bias", "experts.gate_bias", "experts.up_bias", "experts.down_bias")


def init_std(name: str, cfg: ModelConfig) -> float:
    """The normal's std for matrix `name`: init_std, and for the residual output projections
    (attention's wo, the MLP's and the experts' down) init_std / sqrt(2 n_layers) (GPT-2)."""
    residual_out = name.endswith(("wo.weight", "down.weight", ".experts.down"))
    return cfg.init_std / math.sqrt(2 * cfg.n_layers) if residual_out else cfg.init_std


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows (of the last dim) per block: a function of the whole shape only, never of a layout."""
    return max(1, BLOCK_ELEMENTS // max(shape[-1], 1))


def block_seed(seed: int, name: str, block: int) -> int:
    """A 63-bit seed for block `block` of parameter `name`: independent streams for every block."""
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def draw_block(into: torch.Tensor, seed: int, name: str, block: int, std: float) -> torch.Tensor:
    """Block `block` of parameter `name`, drawn into `into` ((block rows, length), contiguous fp32 on
    the CPU): the same numbers as into a fresh tensor, from the block's own generator. A LoRA adapter's
    A is uniform on (-std, std) (PEFT's Kaiming-uniform), everything else normal."""
    generator = torch.Generator().manual_seed(block_seed(seed, name, block))
    if name.endswith(LORA_A):
        return into.uniform_(-std, std, generator=generator)
    return into.normal_(0.0, std, generator=generator)


def row_runs(lead: tuple[int, ...], box: tuple[slice, ...]) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """The rows that `box` (a slice of each lead dim: all but the last) holds of the flattened
    (N, length) view, as runs in row-major order (the order of the box's own rows): one run per index
    of the dims before the innermost dim the box cuts, given as (that index within the box, first
    row, count). A tp slice of a matrix or a ZeRO row range is one run; the experts' (E, dim, hidden)
    cut along dim is one run per expert. Computed, never listed: no tensor of row indices is made."""
    cut = max((d for d, (n, s) in enumerate(zip(lead, box, strict=True)) if (s.start, s.stop) != (0, n)),
              default=0)
    inner = math.prod(lead[cut + 1:])
    strides = [math.prod(lead[d + 1:]) for d in range(cut)]
    for outer in itertools.product(*(range(s.stop - s.start) for s in box[:cut])):
        first = sum((box[d].start + i) * stride for d, (i, stride) in enumerate(zip(outer, strides, strict=True)))
        yield outer, (first + box[cut].start) * inner, (box[cut].stop - box[cut].start) * inner


def _fill_rows(dest: torch.Tensor, first: int, shape: tuple[int, ...], columns: slice, name: str, std: float,
               seed: int, scratch: list[torch.Tensor]) -> None:
    """Rows first .. first + len(dest) of parameter `name`'s (N, length) view, columns `columns`,
    into `dest` ((rows, columns), any strides, dtype or device), block by block. A block `dest` holds
    whole (all its rows, every column, contiguous fp32 on the CPU) is drawn straight into place; any
    other is drawn into the one scratch block (made at the first need, kept in `scratch`) and its
    part copied out."""
    per_block, length, n_rows = block_rows(shape), shape[-1], math.prod(shape[:-1])
    drawn_in_place = columns == slice(0, length) and dest.dtype == torch.float32 and dest.device.type == "cpu"
    row, at = first, 0
    while at < len(dest):
        b = row // per_block
        lo, hi = b * per_block, min((b + 1) * per_block, n_rows)  # the block's rows
        end = min(hi, first + len(dest))
        part = dest[at:at + end - row]
        if drawn_in_place and row == lo and end == hi and part.is_contiguous():
            draw_block(part, seed, name, b, std)
        else:
            if not scratch:
                scratch.append(torch.empty(per_block, length))
            values = draw_block(scratch[0][: hi - lo], seed, name, b, std)  # (block rows, length)
            part.copy_(values[row - lo:end - lo, columns])
        at += end - row
        row = end


@torch.no_grad()
def init_box(name: str, shape: tuple[int, ...], box: tuple[slice, ...], cfg: ModelConfig, seed: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The initial values of `box` of parameter `name` (whole shape `shape`): written into `out` (of
    the box's shape, any device, dtype or strides) when given, else into a new fp32 CPU tensor.
    Beside `out`, at most one block (BLOCK_ELEMENTS numbers) is ever held."""
    if out is None:
        out = torch.empty(tuple(s.stop - s.start for s in box))
    if name.endswith((*BIASES, LORA_B)):  # a LoRA adapter's B starts at zero: the frozen model's function
        return out.zero_()
    if len(shape) < 2:  # attention sinks 0 (a sink starts as one more key of logit 0); norm weights a scale
        # of 1: 1 - norm.offset, as they scale by (norm.offset + weight)
        return out.fill_(0.0 if name.endswith("attn.sinks") else 1.0 - cfg.norm.offset)
    # LoRA's A: Kaiming-uniform with a = sqrt(5) (PEFT's, nn.Linear's), bound 1 / sqrt(fan_in)
    std = 1 / math.sqrt(shape[-1]) if name.endswith(LORA_A) else init_std(name, cfg)
    scratch, at = [], 0
    flat = out.view(-1, out.shape[-1]) if out.is_contiguous() else None  # (box rows, box columns)
    for outer, first, count in row_runs(shape[:-1], box[:-1]):
        if flat is not None:
            dest, at = flat[at:at + count], at + count
        else:  # a strided box (ZeRO's cut of an expert tensor along dim 1): each run's rows as one view
            dest = out[outer]
            if dest.dim() > 2:
                try:
                    dest = dest.view(count, out.shape[-1])
                except RuntimeError:  # rows no view can merge (never made by fivefold): a copy of one run
                    run = torch.empty(count, out.shape[-1])
                    _fill_rows(run, first, shape, box[-1], name, std, seed, scratch)
                    dest.copy_(run.view(dest.shape))
                    continue
        _fill_rows(dest, first, shape, box[-1], name, std, seed, scratch)
    return out


@torch.no_grad()
def init_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    """Fill the whole tensor `t` (parameter `name`) with its initial values, in place."""
    init_box(name, tuple(t.shape), tuple(slice(0, n) for n in t.shape), cfg, seed, out=t)


class SeededInit:
    """The seeded initialisation of a model config as a weight source: `read(name, box)` draws the
    box's values (checkpoint/weights.py's WeightSource protocol)."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, seed: int):
        """`model`: the full model, on the meta device (its names and shapes; a tied matrix once)."""
        self.cfg, self.seed = cfg, seed
        self._shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}

    def names(self) -> frozenset[str]:
        return frozenset(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        shape = self._shapes[name]
        return init_box(name, shape, index or tuple(slice(0, n) for n in shape), self.cfg, self.seed)

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        """Draw the box straight into `out`: no copy of the slice is ever made."""
        init_box(name, self._shapes[name], index, self.cfg, self.seed, out)
