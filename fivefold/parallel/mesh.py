"""The device mesh: parallel degrees -> one named torch DeviceMesh, plus named views by purpose.

Axis order, outermost first: ("pp", "dp_replicate", "dp_shard", "cp", "tp"). Consecutive ranks
differ in tp first, so tensor parallel (the most traffic, every layer) stays inside a node, and
pipeline parallel (the least, one activation per micro-batch) crosses nodes. With 8 ranks,
dp_shard=2, tp=4: ranks {0,1,2,3} form one tp group and {0,4} one dp group.

Every axis exists even at size 1, so code never asks "is TP on?": a collective on a size-1 group
returns at once. Views by purpose:
- each axis by its name, and "dp" = dp_replicate x dp_shard;
- "batch": the ranks that see different samples (= dp);
- "grad": the ranks whose gradients are summed (dp x cp: context-parallel ranks hold different
  tokens of the same samples, so their gradients add up too).
- "world": every rank of the job (torch's default group), for the run's coordination (barriers,
  object gathers) and the metrics log, whose traffic is charged to "log";
- "ep": the ranks among which one MoE block's experts are split, and "expert_dp", the ranks that
  hold the same experts (their gradients are summed there; charged to "dp"). They are not axes of
  the DeviceMesh but carved out of the grad view, one grad view per (pp, tp) place: grad rank g is in
  ep group g // ep with ep rank g % ep (`expert_partitions`). Built with new_group, because
  split_group fails on gloo; at ep = 1 the ep group is this rank alone and expert_dp is the grad view.

The mesh also owns this rank's communication counters (`stats`), step timer (`timer`) and
collective counts (`arrivals`, published for naming the ranks a timed-out collective waits for:
parallel/comm/arrivals.py), which every group carries, so the code that talks and computes reports to
them without any global. With parallel.ep_overlap every group also gets a twin for the side lane of
DualPipe's overlapped pairs (`add_side_lane`, comm/lanes.py), made and warmed at setup. Nothing here
is global: the Mesh is passed to whoever needs it; `close()` (or the mesh's collection, or the
interpreter's exit) stops the arrivals' publishing thread.

Every process group the mesh makes waits `timeout_s` (parallel.collective_timeout_s) for its peers;
`timeout(seconds)` changes that for all of them at once, inside a block: train/loop.py runs the
first step under parallel.first_step_timeout_s, since that step compiles (train.compile) and NCCL
makes each group's communicator at its first collective, either of which can outlast a timeout
sized for a steady step (torchtitan: comm.init_timeout_seconds, then comm.train_timeout_seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fivefold.config.derive import Derived
from fivefold.config.schema import Config
from fivefold.parallel.comm.arrivals import Arrivals, collective_deadlines
from fivefold.parallel.comm.collectives import AxisGroup, CommStats, all_gather_object, all_reduce, world_group
from fivefold.parallel.comm.lanes import Lanes
from fivefold.parallel.comm.timing import CudaClock, StepTimer, WallClock

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# View name -> the mesh axes it spans (consecutive, so DeviceMesh can flatten them).
VIEWS = {
    "dp": ("dp_replicate", "dp_shard"),
    "batch": ("dp_replicate", "dp_shard"),
    "grad": ("dp_replicate", "dp_shard", "cp"),
}
# Which axis a view's traffic is charged to in the communication counters.
LABELS = {"dp_replicate": "dp", "dp_shard": "dp", "batch": "dp", "grad": "dp"}


def expert_partitions(grid: torch.Tensor, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """Global ranks of every ep group and every expert replica group, for a mesh grid of global
    ranks shaped (pp, dp_replicate, dp_shard, cp, tp). Pure: every rank computes the same lists."""
    pp, dpr, dps, cp, tp = grid.shape
    grad = dpr * dps * cp
    if grad % ep:
        raise ValueError(f"ep = {ep} must divide dp x cp = {grad}")
    views = grid.permute(0, 4, 1, 2, 3).reshape(pp * tp, grad)  # one grad view per (pp, tp), in grad-rank order
    ep_parts, replica_parts = [], []
    for ranks in views.tolist():
        ep_parts += [ranks[i:i + ep] for i in range(0, grad, ep)]  # consecutive grad ranks
        replica_parts += [ranks[j::ep] for j in range(ep)]  # the same ep rank in every ep group
    return ep_parts, replica_parts


class Mesh:
    """Named process groups for one layout; `group(name)` gives an AxisGroup for comm/collectives.py.

    Collective: every rank builds the same mesh at the same point (DeviceMesh and new_group are).
    """

    def __init__(self, degrees: dict[str, int], device_type: str = "cpu", timeout_s: float | None = None,
                 ep: int = 1, device: torch.device | None = None):
        missing = [a for a in AXES if a not in degrees]
        if missing:
            raise ValueError(f"Mesh needs a degree for every axis {AXES}; missing {missing}")
        self.degrees = {a: degrees[a] for a in AXES}
        self.world_size = math.prod(self.degrees.values())
        self.device_type = device_type
        self._device = device  # None: this process's device of device_type (device_for); the dry run's "meta"
        self.timeout_s = timeout_s  # None: torch's default (30 min on gloo, 10 on NCCL)
        self._pgs: list[dist.ProcessGroup] = []  # every group made here: `timeout` changes them all
        self.stats = CommStats()
        self.timer = StepTimer(CudaClock() if device_type == "cuda" else WallClock())  # step time, by part
        # The dry run's fake world has no peers to wait for, and builds a mesh per position in one process.
        self.arrivals = None
        self.lanes: Lanes | None = None  # the side lane of DualPipe's pairs (add_side_lane), with ep_overlap
        if dist.get_backend() != "fake":
            self.arrivals = Arrivals(dist.distributed_c10d._get_default_store(), dist.get_rank(),
                                     collective_deadlines(timeout_s, device_type).watch_s)
            weakref.finalize(self, self.arrivals.close)  # also at exit: the thread never outlives its mesh
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=AXES)
        self._groups: dict[str, AxisGroup] = {}
        for axis in AXES:
            self._add(axis, self.device_mesh[axis])
        for view, axes in VIEWS.items():
            # DeviceMesh caches a flattened mesh under its name; "batch" reuses the "dp" one.
            flat_name = "dp" if view == "batch" else view
            self._add(view, self.device_mesh[axes]._flatten(flat_name))
        self.ep_device_mesh = self._add_expert_views(ep)
        # Every rank of the job, for the run's coordination and the metrics log (charged to "log"):
        # torch's default group, which train's init_distributed makes with the same timeout.
        self._groups["world"] = world_group(self.stats, self.timeout_s, self.timer, self.arrivals)

    @classmethod
    def from_config(cls, cfg: Config, derived: Derived, device_type: str = "cpu",
                    device: torch.device | None = None) -> "Mesh":
        p = cfg.parallel
        mesh = cls({"pp": p.pp, "dp_replicate": p.dp_replicate, "dp_shard": derived.dp_shard, "cp": p.cp, "tp": p.tp},
                   device_type, p.collective_timeout_s, ep=p.ep, device=device)
        if p.ep_overlap and dist.get_backend() != "fake":  # the dry run runs no pair: no twins to make
            # It makes NCCL's twin communicators, as a first step makes the others: the first step's timeout
            with mesh.timeout(max(p.first_step_timeout_s, p.collective_timeout_s)):
                mesh.add_side_lane()
        return mesh

    def add_side_lane(self) -> None:
        """A twin process group for every group of the mesh but "world", for the side lane of
        DualPipe's overlapped pairs (comm/lanes.py). Collective: every rank learns every group's ranks
        (one object gather) and makes the twins in one order, sorted by their ranks; groups of the
        same ranks share a twin (one lane's calls on it are in one order whichever view makes them).

        Each twin of this rank then runs one collective of one element, in the same order: NCCL makes
        a group's communicator at its first collective (a collective of the group's ranks itself), so
        all are made here, at setup, and not inside the first pair while the other lane launches. One
        order on every rank: two ranks that share two twins warm them in the same order."""
        mine = {name: tuple(dist.get_process_group_ranks(g.pg)) for name, g in self._groups.items()
                if name != "world" and g.pg is not None and g.size > 1}
        everyone = all_gather_object(mine, self._groups["world"], "gather of the mesh's groups for the side lane")
        self.lanes = Lanes(self.device)
        twins: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for ranks in sorted({r for groups in everyone for r in groups.values()}):
            pg = dist.new_group(list(ranks))  # collective over the world: every rank makes every twin
            if dist.get_rank() in ranks:
                twins[ranks] = self._collective_timeout(pg)
        warm: dict[tuple[int, ...], AxisGroup] = {}
        for name, ranks in mine.items():
            g = self._groups[name]
            g.side = dataclasses.replace(g, pg=twins[ranks], side=None, lanes=self.lanes)
            g.lanes = self.lanes
            warm.setdefault(ranks, g.side)
        for ranks in twins:  # sorted, as made
            all_reduce(torch.zeros(1, device=self.device), warm[ranks], label="log")  # setup, not training's traffic

    def _add_expert_views(self, ep: int) -> DeviceMesh | None:
        """The "ep" and "expert_dp" views; returns the ep group as a 1-D DeviceMesh (ep > 1), on which
        checkpoints shard the experts."""
        ep_parts, replica_parts = expert_partitions(self.device_mesh.mesh, ep)
        # The ep group always gets its own process group: its all-to-alls run inside backward, and
        # must not queue behind (or between) gradient all-reduces on the grad view.
        self._groups["ep"] = self._carve(ep_parts, "ep", "ep")
        if len(replica_parts[0]) == self.size("grad"):  # ep = 1: data parallel's own group
            self._groups["expert_dp"] = dataclasses.replace(self.group("grad"), name="expert_dp")
        else:
            self._groups["expert_dp"] = self._carve(replica_parts, "expert_dp", "dp")
        if ep == 1:
            self.expert_device_mesh = None
            return None
        # Every rank is in exactly one ep group, so the groups stacked are a mesh of the whole world:
        # (place, expert_dp, ep), one (expert_dp, ep) plane per (pp, tp) place. Its "ep" dim is this
        # rank's ep group (checkpoints shard experts on it) and (expert_dp, ep) is where ZeRO's expert
        # shards live (parallel/data/zero.py).
        grid = torch.tensor(ep_parts).reshape(len(ep_parts) // len(replica_parts[0]), len(replica_parts[0]), ep)
        planes = DeviceMesh(self.device_type, grid, mesh_dim_names=("expert_place", "expert_dp", "ep"))
        for pg in planes.get_all_groups():  # checkpoints' and ZeRO's expert shards wait on them too
            self._collective_timeout(pg)
        self.expert_device_mesh = planes["expert_dp", "ep"]
        return planes["ep"]

    def _carve(self, parts: list[list[int]], name: str, label: str) -> AxisGroup:
        """This rank's group among equal-sized `parts`; a part of one needs no process group."""
        if len(parts[0]) == 1:
            return AxisGroup(name=name, label=label, pg=None, size=1, rank=0, stats=self.stats, timer=self.timer,
                             arrivals=self.arrivals)
        return dataclasses.replace(self.subgroups(parts, label), name=name)

    def _add(self, name: str, sub: DeviceMesh) -> None:
        pg = self._collective_timeout(sub.get_group())
        self._groups[name] = AxisGroup(
            name=name, label=LABELS.get(name, name), pg=pg, size=sub.size(),
            rank=sub.get_local_rank(), stats=self.stats, timeout_s=self.timeout_s, timer=self.timer,
            arrivals=self.arrivals,
        )

    def _collective_timeout(self, pg: dist.ProcessGroup) -> dist.ProcessGroup:
        """`pg` with parallel.collective_timeout_s for its collectives. The group is made with torch's
        default timeout and set after: gloo connects a new group's ranks under the timeout it is made
        with, and on a loaded machine that can take longer than a short collective timeout (seen: a
        0.5 s timeout failed `connectFullMesh`). The dry run's fake backend has no timeout."""
        if dist.get_backend(pg) != "fake":
            self._pgs.append(pg)
            if self.timeout_s is not None:
                pg.set_timeout(timedelta(seconds=self.timeout_s))
        return pg

    @contextlib.contextmanager
    def timeout(self, seconds: float) -> Iterator[None]:
        """Inside the block every group of the mesh, and the job's default group ("world"), waits
        `seconds` for its peers; after it, the mesh's own timeout again. A collective takes the
        timeout in force when it is issued (NCCL's watchdog times each one from its own): those of
        the block's last step still in flight on the device keep the block's."""
        before = self.timeout_s
        self._set_timeout(seconds)
        try:
            yield
        finally:
            self._set_timeout(before)

    def _set_timeout(self, seconds: float | None) -> None:
        """Every group, its AxisGroups (their errors say the seconds waited) and the arrivals' watch
        (half the timeout on CUDA: arrivals.collective_deadlines) to `seconds` (None: torch's default)."""
        deadlines = collective_deadlines(seconds, self.device_type)
        self.timeout_s = seconds
        default_group = [dist.group.WORLD] if dist.get_backend() != "fake" else []
        for pg in [*self._pgs, *default_group]:
            pg.set_timeout(timedelta(seconds=deadlines.process_group_s))
        for g in self._groups.values():
            for view in (g, g.side) if g.side is not None else (g,):
                view.timeout_s = seconds
        if self.arrivals is not None:
            self.arrivals.watch_s = deadlines.watch_s

    @property
    def device(self) -> torch.device:
        """This process's device: where its tensors of the model live (the meta device in a dry run)."""
        return self._device if self._device is not None else device_for(self.device_type)

    def group(self, name: str) -> AxisGroup:
        if name not in self._groups:
            raise KeyError(f"no mesh view '{name}'; views: {', '.join(self._groups)}")
        return self._groups[name]

    def size(self, name: str) -> int:
        return self._groups[name].size

    def rank(self, name: str) -> int:
        return self._groups[name].rank

    def subgroups(self, partition: list[list[int]], label: str) -> AxisGroup:
        """This rank's group among `partition` (global ranks, every rank in exactly one part).

        Every rank must call this with the same partition: new_group is collective over the world.
        """
        me = dist.get_rank()
        mine = None
        for ranks in partition:
            pg = dist.new_group(ranks)  # on the other parts' ranks: a placeholder, not a group
            if me in ranks:
                pg = self._collective_timeout(pg)
                mine = AxisGroup(name=label, label=label, pg=pg, size=len(ranks), rank=ranks.index(me),
                                 stats=self.stats, timeout_s=self.timeout_s, timer=self.timer, arrivals=self.arrivals)
        if mine is None:
            raise ValueError(f"rank {me} is in no part of {partition}")
        return mine

    def close(self) -> None:
        """Stop publishing this rank's collective counts (before the process group is destroyed)."""
        if self.arrivals is not None:
            self.arrivals.close()
        if self.lanes is not None:
            self.lanes.close()

    def __repr__(self) -> str:
        return "Mesh(" + ", ".join(f"{a}={n}" for a, n in self.degrees.items()) + ")"


def device_for(device_type: str) -> torch.device:
    """This process's device: the CUDA device of its local rank, or the CPU."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
