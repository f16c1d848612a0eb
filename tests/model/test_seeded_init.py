"""The seeded initialisation: its definition, any box of it, and what drawing a box holds beside it."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fivefold.config.load import load_config
from fivefold.model import seeded_init
from fivefold.model.seeded_init import block_seed, init_box, init_std

CFG = load_config(None, ["--model.preset=debug"]).model


def whole(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return init_box(name, shape, tuple(slice(0, n) for n in shape), CFG, 3)


def test_a_parameter_is_its_blocks_each_from_its_own_generator(monkeypatch):
    """The definition spelled out: rows of the last dim, cut into blocks of BLOCK_ELEMENTS // length
    rows, block b drawn whole from a generator seeded by (seed, name, b)."""
    monkeypatch.setattr(seeded_init, "BLOCK_ELEMENTS", 40)  # 10 rows of 4 a block: 7 blocks, the last short
    shape, name = (3, 22, 4), "layers.0.ffn.experts.down"
    rows, std = 66, init_std(name, CFG)
    expected = torch.cat([torch.empty(min(10, rows - 10 * b), 4).normal_(
        0.0, std, generator=torch.Generator().manual_seed(block_seed(3, name, b))) for b in range(7)])
    assert torch.equal(whole(name, shape), expected.view(shape))
    assert torch.equal(whole("norm.weight", (8,)), torch.ones(8))


BOXES = [  # (shape, box): ZeRO row ranges across blocks, tp column slices, expert boxes cut inside
    ((50, 12), (slice(7, 43), slice(0, 12))),
    ((50, 12), (slice(0, 50), slice(5, 9))),
    ((50, 12), (slice(13, 14), slice(3, 12))),
    ((6, 9, 8), (slice(2, 5), slice(0, 9), slice(0, 8))),
    ((6, 9, 8), (slice(0, 6), slice(4, 9), slice(0, 8))),
    ((6, 9, 8), (slice(1, 4), slice(2, 7), slice(3, 5))),
    ((4, 3, 5, 8), (slice(1, 3), slice(0, 3), slice(1, 4), slice(0, 8))),
]


@pytest.mark.parametrize("shape,box", BOXES)
def test_any_box_is_that_slice_of_the_whole(monkeypatch, shape, box):
    """Into a new tensor, into a strided view of a larger one (as ZeRO's dim-1 cut of an expert
    tensor is), into a view no (rows, columns) view can address, and into bf16."""
    monkeypatch.setattr(seeded_init, "BLOCK_ELEMENTS", 32)  # blocks of 4 rows (8 for shape (..., 8)): many
    name = "layers.1.attention.wq.weight"
    expected = whole(name, shape)[box]
    assert torch.equal(init_box(name, shape, box, CFG, 3), expected)
    local = tuple(s.stop - s.start for s in box)
    padded = torch.zeros(*local[:-1], local[-1] + 3)[..., 1:-2]  # rows strided, each row contiguous
    if len(local) > 2:
        padded = torch.zeros(local[0], local[1] + 2, local[2])[:, 1:-1] if len(local) == 3 else padded
    init_box(name, shape, box, CFG, 3, out=padded)
    assert torch.equal(padded, expected)
    transposed = torch.zeros(tuple(reversed(local))).permute(*reversed(range(len(local))))
    init_box(name, shape, box, CFG, 3, out=transposed)
    assert torch.equal(transposed, expected)
    half = init_box(name, shape, box, CFG, 3, out=torch.empty(local, dtype=torch.bfloat16))
    assert torch.equal(half, expected.bfloat16())


class NewStorages(TorchDispatchMode):
    """The bytes of every storage an op makes that is not `out`'s (a view shares its base's)."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out, self.made = out.untyped_storage().data_ptr(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.out:
                self.made[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return result


@pytest.mark.parametrize("box", [(slice(100, 900), slice(0, 1024)), (slice(0, 1024), slice(256, 512)),
                                 (slice(5, 1000), slice(1, 1000))])
def test_a_box_is_drawn_with_one_block_beside_it(box):
    """A 1024 x 1024 parameter (16 blocks) drawn as a ZeRO row range (blocks whole in place, the two
    cut ones through the scratch block), a tp column slice and both: one block made, in all."""
    local = tuple(s.stop - s.start for s in box)
    out = torch.empty(local)
    with NewStorages(out) as made:
        init_box("output.weight", (1024, 1024), box, CFG, 3, out=out)
    assert sum(made.made.values()) <= 4 * seeded_init.BLOCK_ELEMENTS, made.made
    assert torch.equal(out, whole("output.weight", (1024, 1024))[box])
