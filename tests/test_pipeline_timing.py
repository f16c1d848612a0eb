"""The executor runs what the simulator plans: measured idle time matches simulate().

Stage compute is replaced by sleeps of known length (forward F, backward B), so the timing is
deterministic enough to compare with simulate() under the same costs.
"""

import time

import pytest
import torch
import torch.distributed as dist

from fivefold.mesh import Mesh
from fivefold.parallel.pipeline import PipelineExecutor
from fivefold.parallel.schedules import Costs, build_schedule, simulate
from fivefold.testing import run_workers

F, B = 0.04, 0.08  # seconds


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(F)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(B)
        return grad


class _SleepChunk:
    """A stage whose forward takes F seconds and whose backward takes B."""

    def __init__(self, first: bool, last: bool):
        self.first, self.last = first, last
        self.w = torch.nn.Parameter(torch.ones(()))

    def __call__(self, x, positions):
        h = x.float().unsqueeze(-1).expand(*x.shape, 8) if self.first else x  # (B, T, 8)
        return _Sleep.apply(h * self.w)


class _PlainBackward:
    def backward(self, out, grad=None, *, last_micro_batch, inputs=None):
        torch.autograd.backward(out, grad, inputs=inputs)


def _measure(rank, world, name, m, v):
    schedule = build_schedule(name, world, m, v)
    mesh = Mesh({"pp": world, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1})
    last = schedule.num_stages - 1
    chunks = {s: _SleepChunk(s == 0, s == last) for s in range(last + 1) if schedule.stage_to_rank(s) == rank}
    executor = PipelineExecutor(schedule, chunks, mesh.group("pp"), _PlainBackward(), torch.device("cpu"))
    executor._params = lambda c: [c.w]
    micro = [(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long)) for _ in range(m)]
    dist.barrier()
    stats = executor.run(micro, global_tokens=8 * m, dim=8, clock=time.time)
    return stats.timeline


# Split-backward schedules are left out: the executor's "W" walks the graph a second time, so
# with a sleeping backward I and W would each cost B, which no uniform Costs describes.
@pytest.mark.parametrize("name,m,v", [("gpipe", 4, 1), ("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved_1f1b", 4, 2)])
def test_measured_idle_time_matches_the_simulator(name, m, v):
    timelines = run_workers(_measure, 2, name, m, v)
    start = min(t[0][0] for t in timelines)
    makespan = max(t[-1][1] for t in timelines) - start
    sim = simulate(build_schedule(name, 2, m, v), Costs(f=F, b=B))
    for rank, timeline in enumerate(timelines):
        busy = sum(end - began for began, end, _ in timeline)
        measured = (makespan - busy) / makespan  # idle share of this rank
        planned = sim.idle[rank] / sim.makespan
        assert abs(measured - planned) < 0.05, (rank, measured, planned)
    assert makespan == pytest.approx(sim.makespan, rel=0.15)
