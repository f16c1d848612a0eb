"""The seeded initialisation: every parameter's values a pure function of (seed, name, row block).

A rank of a large layout holds slices (a tp column block, an ep group's experts, a ZeRO row range)
and must never build the whole tensor to initialise its part; one process must get exactly the
values every layout starts from. So a parameter is defined block by block:

- view it as rows of its last dim: shape (d0, ..., dk) is N = d0 x ... x d(k-1) rows of length dk
  (an expert tensor (E, dim, hidden) is E x dim rows of length hidden);
- cut the rows into blocks of `block_rows(shape)` rows, about BLOCK_ELEMENTS numbers each;
- block b is drawn from its own generator, seeded by a hash of (train.seed, parameter name, b),
  from Normal(0, std) with the std of `init_std` (GPT-2's: residual output projections scaled by
  1/sqrt(2 L)); 1-D parameters (norm weights) are ones.

`init_box` gives the values of any box (a slice per dim) by drawing only the blocks that hold its
rows, one at a time, so its peak memory is the box plus one block. `init_tensor` fills a whole
tensor the same way (one process), and `SeededInit` offers the definition as a weight source
(train/weights.py), so starting a run from the seed and from a checkpoint are one code path.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from fivefold.model_config import ModelConfig

BLOCK_ELEMENTS = 1 << 20  # numbers drawn at once: 4 MB of fp32, whatever the layout


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


def _draw(seed: int, name: str, block: int, rows: int, length: int, std: float) -> torch.Tensor:
    """Block `block` of parameter `name`: (rows, length) fp32 on the CPU, its own generator."""
    generator = torch.Generator().manual_seed(block_seed(seed, name, block))
    return torch.empty(rows, length).normal_(0.0, std, generator=generator)


@torch.no_grad()
def init_box(name: str, shape: tuple[int, ...], box: tuple[slice, ...], cfg: ModelConfig, seed: int,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """The initial values of `box` of parameter `name` (whole shape `shape`): written into `out` (of
    the box's shape, any device or dtype) block by block when given, else into a new fp32 CPU tensor."""
    local = tuple(s.stop - s.start for s in box)
    if out is None:
        out = torch.empty(local)
    if len(shape) < 2:
        return out.fill_(1.0)
    if not out.is_contiguous():  # a ZeRO shard split along dim 1 is a strided view: fill a copy
        out.copy_(init_box(name, shape, box, cfg, seed))
        return out
    lead, length = shape[:-1], shape[-1]
    # The box's rows of the flattened (N, length) view, in the box's own row-major order.
    index = torch.zeros((), dtype=torch.long)
    for n, s in zip(lead, box[:-1], strict=True):
        index = index.unsqueeze(-1) * n + torch.arange(s.start, s.stop)
    rows = index.reshape(-1)  # ascending: row-major order of the box is row-major order of the whole
    flat = out.view(rows.numel(), local[-1])  # (box rows, box columns)
    per_block, std, n_rows = block_rows(shape), init_std(name, cfg), math.prod(lead)
    # The box's rows are ascending, so those of one block are a contiguous run of `rows`; blocks that
    # hold none of them (a slice of an inner dim skips some) are never drawn.
    # A block the box holds whole (all its rows, every column) is drawn straight into place when the
    # box is fp32 on the CPU: the same numbers as a fresh tensor's (contiguous), and no copy at all.
    in_place = box[-1] == slice(0, length) and out.dtype == torch.float32 and out.device.type == "cpu"
    for b in torch.unique_consecutive(rows // per_block).tolist():
        lo, hi = b * per_block, min((b + 1) * per_block, n_rows)
        start, end = torch.searchsorted(rows, torch.tensor([lo, hi])).tolist()
        if in_place and end - start == hi - lo:  # sorted and distinct: the rows are exactly lo..hi-1
            generator = torch.Generator().manual_seed(block_seed(seed, name, b))
            flat[start:end].normal_(0.0, std, generator=generator)
            continue
        values = _draw(seed, name, b, hi - lo, length, std)  # (block rows, length)
        flat[start:end] = values[rows[start:end] - lo][:, box[-1]]
    return out


@torch.no_grad()
def init_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, seed: int) -> None:
    """Fill the whole tensor `t` (parameter `name`) with its initial values."""
    t.copy_(init_box(name, tuple(t.shape), tuple(slice(0, n) for n in t.shape), cfg, seed))


class SeededInit:
    """The seeded initialisation of a model config as a weight source: `read(name, box)` draws the
    box's values (train/weights.py's WeightSource protocol)."""

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
