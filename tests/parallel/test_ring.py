"""Ring collectives from send/recv: the schedule replayed symbolically, then run on gloo ranks.

The symbolic replay proves the chunk convention for every n from 2 to 8 without any process; the
multi-process runs check that the executors give bit-for-bit what torch's collectives give, on
integer-valued fp32 inputs (sums of small integers are exact in any order), and that the counters
charge exactly the 2(N-1)/N x S the planner predicts.
"""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from helpers import mesh_of

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm import ring as ring
from fivefold.parallel.comm.collectives import AxisGroup, CommStats
from fivefold.parallel.comm.ring import (
    RingStep,
    ring_all_gather,
    ring_all_gather_schedule,
    ring_all_reduce,
    ring_all_reduce_schedule,
    ring_reduce_scatter,
    ring_reduce_scatter_schedule,
)
from fivefold.parallel.forked_ranks import run_workers


def _check_step_shape(steps: list[list[RingStep]], n: int) -> None:
    """Every rank sends one chunk to r+1 and receives one from r-1; sender and receiver agree."""
    for s, row in enumerate(steps):
        assert [st.rank for st in row] == list(range(n))
        assert sorted(st.send_to for st in row) == list(range(n))  # each rank receives exactly once
        for st in row:
            assert st.send_to == (st.rank + 1) % n and st.recv_from == (st.rank - 1) % n
            peer = row[st.send_to]
            assert peer.recv_from == st.rank, (n, s, st)
            assert peer.recv_chunk == st.send_chunk, (n, s, st)  # what r sends is what r+1 expects


def _replay(steps: list[list[RingStep]], held: list[list[Counter]], reduce: bool) -> None:
    """Apply the steps to `held[rank][chunk]` (a multiset of contributing ranks), all ranks at once."""
    for row in steps:
        # Messages are taken from the state before the step: the sends of one step are simultaneous.
        msgs = [(st.send_to, st.send_chunk, Counter(held[st.rank][st.send_chunk])) for st in row]
        for to, chunk, contrib in msgs:
            held[to][chunk] = held[to][chunk] + contrib if reduce else contrib


@pytest.mark.parametrize("n", range(2, 9))
def test_schedule_reduces_then_gathers_every_chunk(n):
    rs, ag = ring_reduce_scatter_schedule(n), ring_all_gather_schedule(n)
    assert len(rs) == len(ag) == n - 1
    assert ring_all_reduce_schedule(n) == rs + ag  # 2(n-1) steps
    _check_step_shape(rs, n)
    _check_step_shape(ag, n)
    everyone = Counter(range(n))  # each rank's contribution exactly once: no loss, no double count
    held = [[Counter([r]) for _ in range(n)] for r in range(n)]
    _replay(rs, held, reduce=True)
    for r in range(n):
        assert held[r][r] == everyone, f"after reduce-scatter rank {r} should hold chunk {r} complete"
    # All-gather only ever forwards complete chunks.
    for row in ag:
        for st in row:
            assert held[st.rank][st.send_chunk] == everyone, (n, st)
        _replay([row], held, reduce=False)
    assert all(held[r][c] == everyone for r in range(n) for c in range(n))


def test_schedule_edge_sizes():
    assert ring_all_reduce_schedule(1) == []  # one rank: nothing to exchange
    with pytest.raises(ValueError, match="at least 1 rank"):
        ring_reduce_scatter_schedule(0)
    step = ring_reduce_scatter_schedule(4)[0][0]
    with pytest.raises(AttributeError):  # frozen: a replayed schedule cannot be edited by accident
        step.rank = 3  # type: ignore[misc]


def _fake_group(size: int) -> AxisGroup:
    # The size check runs before any communication, so no process group is needed.
    return AxisGroup(name="dp", label="dp", pg=None, size=size, rank=0, stats=CommStats())


def test_indivisible_numel_names_sizes_and_fix():
    group = _fake_group(4)
    with pytest.raises(ValueError, match=r"10 elements.*group size 4.*Pad it to 12"):
        ring_all_reduce(torch.zeros(10), group)
    with pytest.raises(ValueError, match=r"ring_reduce_scatter: .*10 elements"):
        ring_reduce_scatter(torch.zeros(10), group)
    assert group.stats.snapshot() == {}


def _rank_input(rank: int, numel: int) -> torch.Tensor:
    # Distinct integers per rank, far below 2**24, so every fp32 sum is exact in any order.
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 1000 * rank  # (S,)


def _ring_vs_torch(rank, world):
    mesh = mesh_of(dp_shard=world)
    group = mesh.group("dp")
    numel = 6 * world
    out = {}

    # Record every exchange this rank makes, to compare with the pure schedule afterwards.
    exchange, log = ring._exchange, []
    ring._exchange = lambda send, recv, step, g: (log.append(step), exchange(send, recv, step, g))
    x = _rank_input(rank, numel).view(world * 3, 2)  # (S/2, 2) any shape works
    ring_all_reduce(x, group)
    ring._exchange = exchange
    out["steps"] = log
    out["all_reduce"] = x.clone()
    out["all_reduce_stats"] = mesh.stats.snapshot()
    # A non-contiguous tensor is still reduced in place, through a contiguous copy.
    y = _rank_input(rank, numel).view(2, world * 3).t()  # (S/2, 2) transposed view
    ring_all_reduce(y, group)
    out["all_reduce_t"] = y.clone()

    mesh.stats.reset()
    src = _rank_input(rank, numel)  # (S,)
    mine = ring_reduce_scatter(src, group)  # (S/n,)
    ref = torch.empty(numel // world)  # (S/n,)
    dist.reduce_scatter_tensor(ref, src.clone(), group=group.pg)
    out["reduce_scatter"] = (mine, ref, torch.equal(src, _rank_input(rank, numel)))
    out["reduce_scatter_stats"] = mesh.stats.snapshot()

    mesh.stats.reset()
    chunk = _rank_input(rank, 5)  # (C,)
    gathered = ring_all_gather(chunk, group)  # (n*C,)
    ref = torch.empty(world * 5)  # (n*C,)
    dist.all_gather_into_tensor(ref, chunk, group=group.pg)
    out["all_gather"] = (gathered, ref)
    out["all_gather_stats"] = mesh.stats.snapshot()

    # tp has size 1 here: every executor returns at once and counts nothing.
    mesh.stats.reset()
    tp = mesh.group("tp")
    z = _rank_input(rank, 7)  # (7,) no divisibility needed at size 1
    ring_all_reduce(z, tp)
    out["size1"] = (
        torch.equal(z, _rank_input(rank, 7)),
        ring_reduce_scatter(z, tp) is z,
        ring_all_gather(z, tp) is z,
        mesh.stats.snapshot(),
    )
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ring_matches_torch_bit_for_bit_and_counts_ring_bytes(world):
    results = run_workers(_ring_vs_torch, world)
    numel = 6 * world
    direct = sum(_rank_input(r, numel) for r in range(world))  # (S,)
    nbytes = numel * 4
    schedule = ring_all_reduce_schedule(world)
    for rank, out in enumerate(results):
        assert out["steps"] == [row[rank] for row in schedule]  # the executor follows the schedule
        assert torch.equal(out["all_reduce"], direct.view(world * 3, 2))
        assert torch.equal(out["all_reduce_t"], direct.view(2, world * 3).t())
        mine, ref, untouched = out["reduce_scatter"]
        assert torch.equal(mine, ref) and torch.equal(mine, direct.chunk(world)[rank])
        assert untouched, "ring_reduce_scatter must not write its input"
        gathered, ref = out["all_gather"]
        assert torch.equal(gathered, ref)
        assert out["size1"] == (True, True, True, {})

        # One counted send of S/n bytes per step: 2(N-1)/N x S for all-reduce, as planned.
        ar = out["all_reduce_stats"]["dp"]
        assert ar["calls"] == 2 * (world - 1)
        assert ar["bytes"] == ar["wire_bytes"] == 2 * (world - 1) * nbytes // world
        assert ar["wire_bytes"] == collectives.wire_bytes("all_reduce", nbytes, world)
        rs = out["reduce_scatter_stats"]["dp"]
        assert rs["calls"] == world - 1
        assert rs["wire_bytes"] == collectives.wire_bytes("reduce_scatter", nbytes, world)
        ag = out["all_gather_stats"]["dp"]
        assert ag["calls"] == world - 1
        assert ag["wire_bytes"] == collectives.wire_bytes("all_gather", world * 5 * 4, world)

