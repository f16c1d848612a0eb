"""One training step of one rank position on the meta device, counting the step's host reads.

Used by test_fake_device_step.py (and runnable by hand for the numbers: `python tests/train/fake_device.py
WORLD --section.key=value ...`).

The device. The model is built as the dry run builds it (train/dry_run.py): on the meta device, in
torch's fake process group (torch.testing._internal.distributed.fake_pg), as rank r of a world of N
whose collectives return at once. Here it also trains a step there: forward, backward, data
parallel's reductions, the optimizer. Meta tensors have shapes, dtypes and no values; an op mixing
one with a CPU tensor raises ("Tensor on device cpu is not on the expected device meta"; 0-dim CPU
tensors excepted, as on CUDA; torch 2.13's meta matmul does not check), and so does any op whose
result needs values (.item(), bincount, nonzero, masks): what would make a GPU wait.

Why not FakeTensorMode on "cuda", as issue 29 proposed (measured on torch 2.13, CPU build): fake CUDA
tensors run forward (matmuls, SDPA, bf16 autocast), but autograd aborts the process at the first
parameter that needs a gradient ("PyTorch is not linked with support for cuda devices", from
AccumulateGrad's stream lookup); with a device guard put in CUDA's slot (ctypes) the engine still
needs at::getAccelerator(), which a CPU build answers from CUDA hooks it does not have. Fake tensors
on meta do train, but each op costs ~0.4 ms in FakeTensorMode's Python layer: 34k ops, 14 s, for one
ZeRO-2 position of the tiny model, against ~5 s on plain meta tensors (both on this loaded machine).
What meta cannot show: CUDA's autocast (the step computes in fp32), fused AdamW (it refuses meta: the
step takes the foreach path, whose verdict on a non-finite norm is a host read; on CUDA the fused one
decides on the device) and the experts' grouped matmul (bf16 only; the loop reads the split sizes).

The reads. A host read is a Python-level .item(), .tolist(), float(), int(), bool(), index, .cpu(),
.numpy() or .to("cpu") of a meta tensor (each call counts once, a tolist of E numbers too), booked
to the fivefold function that made it. Having no values, a read returns stand-ins: 1.0 for floats
(a finite norm: the step is applied), True, ones for copies, and for MoE's split sizes a balanced
routing consistent with the copies counted by the latest histogram (`Reads._routing`).
"""

from __future__ import annotations

import collections
import contextlib
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "to")


def _caller() -> str:
    """The innermost fivefold function on the stack: where a read is booked."""
    import fivefold

    package = str(Path(fivefold.__file__).parent)
    for frame in reversed(traceback.extract_stack()[:-2]):
        if frame.filename.startswith(package):
            return f"{Path(frame.filename).stem}.{frame.name}"
    return "?"


@dataclass
class Reads:
    """Host reads by the fivefold function that made them; histograms seen (for the stand-in splits)."""

    sites: collections.Counter = field(default_factory=collections.Counter)
    histogram: tuple[int, int] = (0, 1)  # (copies counted, bins) of the latest integer index_add_ / bincount
    depth: int = 0  # inside a patched read: its own element reads are not counted again

    def book(self, t: torch.Tensor | None) -> None:
        if self.depth == 0 and (t is None or t.device.type != "cpu"):
            self.sites[_caller()] += 1

    def _routing(self, n: int) -> list[int]:
        """Stand-in values for n split sizes read from the device: every expert gets q copies from
        every rank (E | copies: every layout's tokens per rank x top_k is a multiple of E), none dropped.
        (dropped, E counts): (1 + E) numbers; with what the other ranks send too: 1 + 2E; sums over
        ranks or experts (E / n apart) take the matching multiple."""
        copies, bins = self.histogram
        experts = bins - 1
        q = copies // max(experts, 1)
        if n in (bins, 2 * experts + 1):
            return [copies - q * experts] + [q] * (n - 1)
        return [q * experts // n] * n

    def stand_in(self, t: torch.Tensor, method: str):
        if method in ("cpu", "to", "numpy"):  # a copy to the host
            copy = torch.ones(t.shape, dtype=t.dtype)
            return copy.numpy() if method == "numpy" else copy
        if method == "tolist":
            if t.dim() == 0:
                return 1.0 if t.dtype.is_floating_point else 0
            flat = [1.0] * t.numel() if t.dtype.is_floating_point else self._routing(t.numel())
            return _nested(flat, list(t.shape))
        if t.dtype.is_floating_point:
            return 1.0
        return True if t.dtype == torch.bool or method == "__bool__" else 0


def _nested(flat: list, shape: list[int]) -> list:
    """flat values as the nested lists of `shape` (what tolist returns)."""
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0]
    return [_nested(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]


def _to_cpu(*args, **kwargs) -> bool:
    """Whether Tensor.to(*args, **kwargs) names the CPU as its device."""
    device = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    return device is not None and torch.device(device).type == "cpu"


@contextlib.contextmanager
def counting_reads():
    """Patch the Python-level reads of torch.Tensor to book and answer them; yields the Reads."""
    reads = Reads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def patched(name, original):
        def read(self, *args, **kwargs):
            if not self.is_meta or (name == "to" and not _to_cpu(*args, **kwargs)):
                return original(self, *args, **kwargs)
            reads.book(self)
            return reads.stand_in(self, name)
        return read

    index_add_, bincount, repeat_interleave = torch.Tensor.index_add_, torch.bincount, torch.Tensor.repeat_interleave

    def counted_histogram(self, dim, index, source, *args, **kwargs):
        if self.is_meta and self.dtype == torch.long:  # an integer histogram: what split sizes count
            reads.histogram = (source.numel(), self.numel())
        return index_add_(self, dim, index, source, *args, **kwargs)

    def valued_bincount(values, weights=None, minlength=0):  # its size is max(values) + 1: a read
        if not values.is_meta:
            return bincount(values, weights, minlength)
        reads.book(values)
        reads.histogram = (values.numel(), minlength)
        return torch.zeros(minlength, dtype=torch.long, device=values.device)

    def sized_repeat(self, repeats, dim=None, *, output_size=None):  # without output_size: a read
        if isinstance(repeats, torch.Tensor) and repeats.is_meta and output_size is None:
            reads.book(repeats)
            output_size = reads._routing(repeats.numel())[-1] * repeats.numel()
        return repeat_interleave(self, repeats, dim, output_size=output_size)

    patches = [(torch.Tensor, name, patched(name, original)) for name, original in originals.items()]
    patches += [(torch.Tensor, "index_add_", counted_histogram), (torch, "bincount", valued_bincount),
                (torch.Tensor, "repeat_interleave", sized_repeat)]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        yield reads
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)  # TensorBase's, found again through the class
            else:
                setattr(owner, name, original)


@dataclass
class PositionResult:
    layout: str
    rank: int
    position: str
    reads: dict[str, int]  # fivefold function -> host reads in the step
    logging_reads: dict[str, int]  # what a printed logging step adds (the breakdown's gather)
    moe_forwards: int  # MoE blocks' forward calls in the step (one read of split sizes each at most)


def fake_step(name: str, cfg, world: int, rank: int, data) -> PositionResult:
    """One training step (forward, backward, data parallel's reductions, optimizer) of global rank
    `rank` of `cfg`'s layout on `world` ranks, on fake tensors; `data`: (train set, val set, loader)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.parallel.expert import moe_blocks
    from fivefold.parallel.mesh import Mesh
    from fivefold.train.breakdown import COLUMNS, BreakdownWindow
    from fivefold.train.dry_run import positions
    from fivefold.train.loop import parallel_model
    from fivefold.train.moe_balance import MoEBalancing
    from fivefold.train.precision import LossScaler
    from fivefold.train.step import Run, train_step

    derived = derive(cfg, world, unpadded_vocab(cfg))
    where = next(p.name for p in positions(cfg, derived, every=True) if p.rank == rank)
    # The fake backend serves meta tensors too: the pipeline's sends look up a backend by device.
    devices = dist.Backend.backend_capability["fake"]
    dist.Backend.backend_capability["fake"] = [*devices, "meta"]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = Mesh.from_config(cfg, derived, "cpu", device=torch.device("meta"))  # groups: real tensors
        par, _ = parallel_model(cfg, derived, mesh)
        run = Run(cfg, derived, mesh, par, *data, LossScaler(cfg.train), MoEBalancing(par.model, mesh, cfg),
                  mesh.device)
        forwards = [0]
        for moe in moe_blocks(par.model).values():
            moe.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        with counting_reads() as reads:
            record = train_step(run, 0)
        with counting_reads() as logging:
            window = BreakdownWindow()
            window.add(1, record.wall_s, {k: 0.0 for k in COLUMNS[:-1]})
            window.gather(mesh.group("world"), mesh.device)
        mesh.close()
        return PositionResult(name, rank, where, dict(reads.sites), dict(logging.sites), forwards[0])
    finally:
        dist.destroy_process_group()
        dist.Backend.backend_capability["fake"] = devices


if __name__ == "__main__":  # one layout's numbers: python tests/train/fake_device.py WORLD --section.key=value ...
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import tempfile

    from helpers import tiny_config

    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.train.dry_run import positions
    from fivefold.train.loop import build_datasets

    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(Path(tmp), *sys.argv[2:])
        data = build_datasets(cfg, Path(tmp))
        for pos in positions(cfg, derive(cfg, int(sys.argv[1]), unpadded_vocab(cfg)), every=True):
            print(fake_step("cli", cfg, int(sys.argv[1]), pos.rank, data))
