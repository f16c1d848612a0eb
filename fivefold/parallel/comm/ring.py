"""Ring reduce-scatter, all-gather and all-reduce, built from point-to-point send and recv.

(Ring *attention*, which passes K/V blocks around a ring, is context parallel: context.py.)

The library collectives (`dist.all_reduce` on NCCL or gloo) already run a ring or something
better; this module writes the ring out step by step so it can be read, replayed and checked, and
it is the algorithm `collectives.wire_bytes` charges for. Each of N ranks sends 2(N-1) chunks of S/N
bytes, 2(N-1)/N x S in all, which no all-reduce can beat (Patarasuk and Yuan 2009); the price is
2(N-1) sequential steps of latency. The derivation, the lower bound and a worked example are in
docs/ring-all-reduce.md (`parallel.dp_collective = "ring"` runs DDP's reduction through it).

Chunk convention (checked by tests/parallel/test_ring.py): chunk c is elements [c S/N, (c+1) S/N) of the
flat tensor. Rank r sends to (r+1) mod N and receives from (r-1) mod N. At reduce-scatter step s
(0-based) rank r sends chunk (r-s-1) mod N and receives chunk (r-s-2) mod N, so after its last
receive (s = N-2) rank r holds chunk r, reduced: the same layout as `dist.reduce_scatter_tensor`.
At all-gather step s rank r sends chunk (r-s) mod N (its own completed chunk first) and receives
chunk (r-s-1) mod N.

The schedules are pure data (no torch), so a web explainer can replay them; the executors below
compute each step with the same helpers, so what is drawn and what runs cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.collectives import AxisGroup


@dataclass(frozen=True)
class RingStep:
    """What one rank does in one step of a ring: send one chunk, receive one chunk."""

    rank: int  # this rank's index in the group (0 .. n-1)
    send_to: int  # group rank it sends to: (rank + 1) mod n
    recv_from: int  # group rank it receives from: (rank - 1) mod n
    send_chunk: int  # index of the chunk it sends (of n equal chunks of the flat tensor)
    recv_chunk: int  # index of the chunk it receives (reduced into, or overwritten)


def _check_n(n: int) -> None:
    if n < 1:
        raise ValueError(f"a ring needs at least 1 rank, got n={n}")


def reduce_scatter_step(n: int, rank: int, step: int) -> RingStep:
    # Sends at step s the chunk received at step s-1 (plus its own part), so partial sums flow on.
    return RingStep(rank, (rank + 1) % n, (rank - 1) % n, (rank - step - 1) % n, (rank - step - 2) % n)


def all_gather_step(n: int, rank: int, step: int) -> RingStep:
    # Step 0 sends the chunk this rank completed itself; later steps forward what just arrived.
    return RingStep(rank, (rank + 1) % n, (rank - 1) % n, (rank - step) % n, (rank - step - 1) % n)


def ring_reduce_scatter_schedule(n: int) -> list[list[RingStep]]:
    """The n-1 reduce-scatter steps, indexed [step][rank]; rank r ends with chunk r reduced."""
    _check_n(n)
    return [[reduce_scatter_step(n, r, s) for r in range(n)] for s in range(n - 1)]


def ring_all_gather_schedule(n: int) -> list[list[RingStep]]:
    """The n-1 all-gather steps, indexed [step][rank]; rank r starts with chunk r complete."""
    _check_n(n)
    return [[all_gather_step(n, r, s) for r in range(n)] for s in range(n - 1)]


def ring_all_reduce_schedule(n: int) -> list[list[RingStep]]:
    """Reduce-scatter then all-gather: 2(n-1) steps, indexed [step][rank]."""
    return ring_reduce_scatter_schedule(n) + ring_all_gather_schedule(n)


def _exchange(send: torch.Tensor, recv: torch.Tensor, step: RingStep, group: AxisGroup) -> None:
    """One ring step: post the send and the receive together (collectives.exchange), then wait for both.
    Counted as a send of one chunk, so the totals are what this rank put on the wire."""
    collectives.exchange(send, recv, step.send_to, step.recv_from, group, "ring step").wait()


def _check_divisible(numel: int, n: int, what: str) -> None:
    if numel % n:
        fix = (numel // n + 1) * n
        raise ValueError(
            f"{what}: the tensor has {numel} elements, which the group size {n} does not divide; "
            f"the ring cuts it into {n} equal chunks. Pad it to {fix} elements (the next multiple of {n})."
        )


def _reduce_scatter_chunks(chunks: tuple[torch.Tensor, ...], group: AxisGroup) -> torch.Tensor:
    """Run the reduce-scatter steps over `chunks` (read only); return this rank's reduced chunk."""
    n = group.size
    # Two scratch buffers used in turn: one carries the partial sum being sent while the other
    # receives the next one, so the caller's tensor is never written.
    bufs = (torch.empty_like(chunks[0]), torch.empty_like(chunks[0]))  # (S/n,) each
    send = chunks[reduce_scatter_step(n, group.rank, 0).send_chunk]  # (S/n,) own part only
    for s in range(n - 1):
        step = reduce_scatter_step(n, group.rank, s)
        recv = bufs[s % 2]  # (S/n,) never the buffer being sent this step
        _exchange(send, recv, step, group)
        recv.add_(chunks[step.recv_chunk])  # (S/n,) partial sum now includes this rank
        send = recv
    return send  # after step n-2 this is chunk group.rank, summed over all n ranks


def _all_gather_chunks(chunks: tuple[torch.Tensor, ...], group: AxisGroup) -> None:
    """Run the all-gather steps in place: chunks[rank] is complete on entry, all are on exit."""
    for s in range(group.size - 1):
        step = all_gather_step(group.size, group.rank, s)
        # Send and receive chunks differ at every step, so both can be views of one tensor.
        _exchange(chunks[step.send_chunk], chunks[step.recv_chunk], step, group)


def ring_reduce_scatter(tensor: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Sum `tensor` over `group` and return this rank's chunk of the sum, shape (numel/n,).

    Chunk r goes to group rank r, as with `dist.reduce_scatter_tensor`. `tensor` is not modified.
    """
    if group.size == 1:
        return tensor
    _check_divisible(tensor.numel(), group.size, "ring_reduce_scatter")
    chunks = tensor.reshape(group.size, tensor.numel() // group.size).unbind(0)  # n x (S/n,)
    return _reduce_scatter_chunks(chunks, group)


def ring_all_gather(chunk: torch.Tensor, group: AxisGroup) -> torch.Tensor:
    """Concatenate every rank's `chunk` in group-rank order: shape (n * chunk.numel(),)."""
    if group.size == 1:
        return chunk
    out = torch.empty(group.size * chunk.numel(), dtype=chunk.dtype, device=chunk.device)  # (n*C,)
    chunks = out.view(group.size, chunk.numel()).unbind(0)  # n x (C,)
    chunks[group.rank].copy_(chunk.reshape(-1))
    _all_gather_chunks(chunks, group)
    return out


def ring_all_reduce(tensor: torch.Tensor, group: AxisGroup) -> None:
    """Sum `tensor` over `group` in place: a ring reduce-scatter, then a ring all-gather."""
    if group.size == 1:
        return
    _check_divisible(tensor.numel(), group.size, "ring_all_reduce")
    # The chunks must be views of the caller's memory for the all-gather to land in place.
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = work.view(group.size, work.numel() // group.size).unbind(0)  # n x (S/n,) views of work
    mine = _reduce_scatter_chunks(chunks, group)  # (S/n,) a scratch buffer, not a view of work
    chunks[group.rank].copy_(mine)
    _all_gather_chunks(chunks, group)
    if work is not tensor:
        tensor.copy_(work)
