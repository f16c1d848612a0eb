"""Whole matrices from their pieces: each matrix gathered to one owner rank and its result sent back.

Muon (parallel/muon.py) orthogonalises every hidden matrix as a whole, but a layout cuts matrices:
tensor parallel splits a weight along `tp_dim` over tp, ZeRO splits each rank's slice into rows
over dp_shard (experts: over expert_dp). A matrix's pieces are therefore spread over a grid of
ranks, and one of them, its owner, does the work: the pieces travel to it, stage by stage from the
innermost split out (ZeRO's rows, then tp's slices), it computes, and the result travels back the
same way, each rank receiving exactly its piece. Owners are spread over the grid by size
(`assign_owners`), so each rank orthogonalises about 1/N of the matrices, once each.

Ranks that hold the same piece (DDP's dp replicas, cp, HSDP's dp_replicate; tp for a matrix tp
does not split) are replicas: each does the same work, as each replica steps AdamW itself.

A stage is one `all_to_all` over its group: every rank sends each owner its pieces of the matrices
that owner owns, concatenated, and receives the pieces of the matrices it owns. Every rank of the
group lists the same matrices in the same order with the same piece sizes, so the split sizes are
known everywhere without a word exchanged.

Pieces here are 2-D and in the matrix's own orientation: a split along `dim` cuts that dim into N
pieces of `rows` (the last padded with zeros past `total`, as ZeRO pads its shards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup


@dataclass(frozen=True)
class Split:
    """One cut of a matrix across the ranks of `group`: along `dim` (0 or 1 of the 2-D matrix), each
    rank `rows` of the `total` (the last ranks' pieces padded with zeros past it)."""

    group: AxisGroup
    dim: int
    rows: int
    total: int


@dataclass
class Matrix:
    """One matrix as this rank sees it: its name (an expert's: "layers.1.ffn.experts.gate[3]"), its
    whole shape, the cuts that made this rank's piece, outermost first, and its owner's index in
    each cut's group (`assign_owners`)."""

    name: str
    shape: tuple[int, int]
    splits: tuple[Split, ...]
    owners: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def held_after(self, k: int) -> bool:
        """Whether this rank holds the matrix as it is before cut k once the stages of the cuts
        inside it have run: it owns it in every one of them."""
        return all(s.group.rank == o for s, o in zip(self.splits[k + 1:], self.owners[k + 1:], strict=True))

    def owned(self) -> bool:
        """Whether this rank computes this matrix: it owns it in every cut (replicas all do)."""
        return self.held_after(-1)


def assign_owners(matrices: list[Matrix]) -> None:
    """Each matrix's owner in each of its cuts, largest matrices first onto the least loaded cell of
    the grid of its cuts' groups (ties to the lowest index). Pure: every rank holding a piece of a
    matrix computes the same owners, from names and sizes alone. Matrices with different cuts (a
    tp-split weight, a weight tp leaves whole, an expert cut over expert_dp) share no grid; each
    kind is balanced on its own."""
    loads: dict[tuple, dict[tuple[int, ...], int]] = {}
    for m in sorted(matrices, key=lambda m: (-m.numel, m.name)):
        sizes = tuple(s.group.size for s in m.splits)
        grid = loads.setdefault(tuple((s.group.name, s.group.size) for s in m.splits), {})
        cells = [()]
        for n in sizes:
            cells = [(*c, i) for c in cells for i in range(n)]
        cell = min(cells, key=lambda c: (grid.get(c, 0), c))
        grid[cell] = grid.get(cell, 0) + m.numel
        m.owners = cell


def gather_to_owners(pieces: dict[str, torch.Tensor], cuts: list[tuple[Matrix, int]]) -> dict[str, torch.Tensor]:
    """One stage of the gather: each (matrix, k) of `cuts` (every rank of cut k's group, one group
    for all, lists the same, in the same order) goes whole along cut k to its owner there.
    `pieces`: this rank's piece of each, 2-D. Returns the assembled matrices this rank owns there.
    One all_to_all; a group of one moves nothing."""
    if not cuts:
        return {}
    group = cuts[0][0].splits[cuts[0][1]].group
    if group.size == 1:
        return {m.name: pieces[m.name] for m, _ in cuts}
    mine = [(m, k) for m, k in cuts if m.owners[k] == group.rank]
    none = pieces[cuts[0][0].name].new_empty(0)  # what a rank sends an owner of none of them
    send = [torch.cat([pieces[m.name].reshape(-1) for m, k in cuts if m.owners[k] == j] or [none])
            for j in range(group.size)]
    received = _exchange(send, [sum(pieces[m.name].numel() for m, _ in mine)] * group.size, group)
    out = {}
    for m, k in mine:
        s, shape = m.splits[k], pieces[m.name].shape
        parts = [r[:shape.numel()].view(shape) for r in received]
        received = [r[shape.numel():] for r in received]
        out[m.name] = torch.cat(parts, dim=s.dim).narrow(s.dim, 0, s.total)
    return out


def scatter_from_owners(wholes: dict[str, torch.Tensor], cuts: list[tuple[Matrix, int]],
                        piece_shapes: dict[str, torch.Size], like: torch.Tensor) -> dict[str, torch.Tensor]:
    """One stage of the return, the gather's inverse: each owner cuts its results (`wholes`, the
    matrices it owns there) along cut k and sends each rank of the group its piece, of shape
    `piece_shapes`. Returns this rank's piece of each matrix of `cuts`; `like`: a tensor of the
    results' dtype and device (a rank may own none)."""
    if not cuts:
        return {}
    group = cuts[0][0].splits[cuts[0][1]].group
    if group.size == 1:
        return {m.name: wholes[m.name] for m, _ in cuts}
    send = []
    for j in range(group.size):
        parts = [_cut(wholes[m.name], m.splits[k], j) for m, k in cuts if m.owners[k] == group.rank]
        send.append(torch.cat([p.reshape(-1) for p in parts] or [like.new_empty(0)]))
    sizes = [sum(piece_shapes[m.name].numel() for m, k in cuts if m.owners[k] == i) for i in range(group.size)]
    received = _exchange(send, sizes, group)
    out = {}
    for m, k in cuts:
        r, shape = received[m.owners[k]], piece_shapes[m.name]
        out[m.name] = r[:shape.numel()].view(shape)
        received[m.owners[k]] = r[shape.numel():]
    return out


def _cut(whole: torch.Tensor, s: Split, j: int) -> torch.Tensor:
    """Rank j's piece of `whole` along cut s: rows [j c, (j+1) c) of its dim, zero past the end."""
    pad = s.rows * s.group.size - s.total
    if pad:
        whole = F.pad(whole, (0, pad) if s.dim == 1 else (0, 0, 0, pad))
    return whole.narrow(s.dim, j * s.rows, s.rows)


def _exchange(send: list[torch.Tensor], receive: list[int], group: AxisGroup) -> list[torch.Tensor]:
    """One all_to_all: send[j] to rank j, receive[i] elements from rank i; the received parts."""
    flat = torch.cat(send)
    out = flat.new_empty(sum(receive))
    collectives.all_to_all(out, flat, group, output_splits=receive, input_splits=[s.numel() for s in send])
    return list(out.split(receive))
