"""The multi-process test harness, the mesh's groups, and the communication counters."""

import threading

import pytest
import torch
import torch.distributed as dist
from helpers import mesh_of

from fivefold.parallel.comm import collectives
from fivefold.parallel.comm.errors import group_name
from fivefold.parallel.forked_ranks import WorkerError, run_workers
from fivefold.parallel.mesh import AXES, Mesh


def _sum_of_ranks(rank, world):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return float(x)


def test_workers_run_a_real_collective():
    assert run_workers(_sum_of_ranks, 4) == [6.0] * 4


def _fails_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("broken on purpose")
    threading.Event().wait()  # waits for rank 1 for ever: only a kill ends it


def test_a_child_traceback_is_reraised_and_the_others_are_killed_not_awaited():
    """Rank 0 never ends on its own: had the harness waited for it, the call would end at its own
    deadline with "no result within" instead (a speed-independent outcome, not a time bound)."""
    with pytest.raises(WorkerError, match=r"(?s)rank 1 raised:.*ValueError: broken on purpose.*"
                                          r"rank 0: killed 2 s after the failure above") as failed:
        run_workers(_fails_on_rank_1, 2)
    assert "no result within" not in str(failed.value)


def _hangs(rank, world):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins


def test_a_hung_worker_fails_the_test():
    with pytest.raises(WorkerError, match="no result within 3 s"):
        run_workers(_hangs, 2, timeout=3)


def _mesh_groups(rank, world):
    mesh = mesh_of(pp=2, dp_shard=2, tp=2)
    out = {name: (mesh.size(name), dist.get_process_group_ranks(mesh.group(name).pg))
           for name in [*AXES, "dp", "batch", "grad"]}
    # Traffic is charged to the view's axis; size-1 groups count nothing.
    x = torch.ones(1000)
    collectives.all_reduce(x, mesh.group("grad"))
    collectives.all_reduce(x, mesh.group("tp"))
    collectives.all_reduce(x, mesh.group("cp"))
    out["stats"] = mesh.stats.snapshot()
    part = [[0, 1, 2, 3], [4, 5, 6, 7]]
    sub = mesh.subgroups(part, "ep")
    y = torch.tensor([1.0])
    collectives.all_reduce(y, sub)
    out["sub"] = (float(y), sub.size, sub.rank)
    return out


def test_mesh_axes_views_and_counters_on_8_ranks():
    results = run_workers(_mesh_groups, 8)
    r0, r5 = results[0], results[5]
    # tp innermost: consecutive ranks; pp outermost: ranks 4 apart.
    assert r0["tp"] == (2, [0, 1]) and r5["tp"] == (2, [4, 5])
    assert r0["dp_shard"] == (2, [0, 2]) and r0["pp"] == (2, [0, 4])
    assert r0["cp"] == (1, [0]) and r0["dp_replicate"] == (1, [0])
    assert r0["dp"] == r0["batch"] == r0["grad"] == (2, [0, 2])
    assert r5["grad"] == (2, [5, 7])
    stats = r0["stats"]
    assert set(stats) == {"dp", "tp"}  # the size-1 cp group counted nothing
    assert stats["dp"] == {"calls": 1, "bytes": 4000, "wire_bytes": 4000.0}  # ring: 2 (N-1)/N x S at N = 2
    assert r0["sub"] == (4.0, 4, 0) and results[6]["sub"] == (4.0, 4, 2)


def test_wire_bytes_ring_accounting():
    assert collectives.wire_bytes("all_reduce", 800, 8) == 1400
    assert collectives.wire_bytes("all_gather", 800, 8) == collectives.wire_bytes("reduce_scatter", 800, 8) == 700
    assert collectives.wire_bytes("all_reduce", 800, 1) == 0


def test_mesh_needs_every_axis():
    with pytest.raises(ValueError, match="missing"):
        Mesh({"dp_shard": 2})


class _OnAnotherDevice(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1, as a GPU rank's tensor would (a CPU build has no
    real one): `.cpu()` and every other op run on the values it wraps."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device="cuda:1")

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        unwrap = lambda t: t.inner if isinstance(t, _OnAnotherDevice) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_object_gathers_send_cpu_copies_of_tensors():
    """What all_gather_object pickles holds every tensor as a plain CPU tensor (a GPU tensor pickled
    as it is names its device, and each receiver would unpickle it onto the sender's GPU index)."""
    import pickle

    obj = {"norms": [_OnAnotherDevice(torch.arange(3.0)), torch.ones(2)], "step": 7,
           "meta": torch.empty(2, device="meta")}
    payload = collectives._pickled_on_cpu(obj)
    assert b"cuda" not in payload and b"_OnAnotherDevice" not in payload
    assert b"cuda" in pickle.dumps(obj)  # what pickling it as it is would send
    got = pickle.loads(payload)
    assert [(type(t), t.device.type) for t in got["norms"]] == [(torch.Tensor, "cpu")] * 2
    assert torch.equal(got["norms"][0], torch.arange(3.0)) and got["step"] == 7
    assert got["meta"].device.type == "meta"  # no values to copy: as it is


def _gather_objects(rank, world):
    mesh = Mesh({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1})
    got = collectives.all_gather_object({"rank": rank, "t": torch.tensor([rank])}, mesh.group("pp"))
    collectives.barrier(mesh.group("world"))
    alone = collectives.all_gather_object("mine", mesh.group("cp"))  # a group of one: itself, uncounted
    # The collectives' numbers on each group (arrivals.py): the next one's, so one was counted there.
    numbers = {name: mesh.arrivals.issue(group_name(mesh.group(name))) for name in ("pp", "world", "dp_shard")}
    return got, alone, mesh.stats.snapshot(), numbers


def test_object_gathers_and_barriers_are_counted_on_their_group_as_coordination():
    results = run_workers(_gather_objects, 4)
    got, alone, stats, numbers = results[1]
    assert [g["rank"] for g in got] == [1, 3] and [int(g["t"]) for g in got] == [1, 3]  # pp ranks 1 and 3
    assert alone == ["mine"]
    # Charged to "log", calls only (pickled sizes differ by rank); no byte on any training axis.
    assert stats == {"log": {"calls": 2, "bytes": 0, "wire_bytes": 0.0}}
    assert numbers == {"pp": 2, "world": 2, "dp_shard": 1}  # each counted once on its own group
