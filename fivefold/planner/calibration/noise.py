"""`fivefold calibrate`: how long a collective waits for the slowest rank (system noise).

Two ranks that start the same compute together do not finish together: the scheduler, interrupts
and caches slow each a little differently. Every collective then waits for the slowest rank, so a
step that synchronises k times pays, on top of the collectives themselves, k times the expected
lead of the slowest of n ranks over the average one (Petrini et al. 2003, "The case of the missing
supercomputer performance"; Hoefler et al. 2010, "Characterizing the influence of system noise on
large-scale applications by simulation"). On the 2-core test machine this is what a DDP step
exposes beyond its all-reduce (the breakdown's exposed_dp: 10-30 ms against 4-6 ms of traffic).

Measured here on every rank at once: each sample starts all ranks at a barrier, runs the same
compute for about d seconds (a chain of small linear layers and tanh, forward and backward), and
gathers the times; the wait is the slowest time less the mean. The profile keeps, per d, the wait
divided by the expected maximum of n standard normals at the measured n (a noise scale sigma); the
planner multiplies it back for its own group sizes (expected_max_normal), which assumes each
rank's noise is independent and about normal.
"""

from __future__ import annotations

import math
import statistics
import time


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for one rank; 1/sqrt(pi) for two). A few
    milliseconds: the pricer keeps each n's value in the caller's Memo."""
    if n <= 1:
        return 0.0
    # E[max] = integral of x n phi(x) Phi(x)^(n-1) dx, by the trapezoid rule on [-10, 10]
    steps, lo, hi = 4000, -10.0, 10.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += (0.5 if i in (0, steps) else 1.0) * x * n * phi * cdf ** (n - 1)
    return total * h


def _work(width: int = 64, links: int = 2):
    """A unit of compute like a training step's: small linear layers and tanh, forward and backward."""
    import torch

    ws = [torch.randn(width, width, requires_grad=True) for _ in range(links)]
    x0 = torch.randn(width, width)

    def run():
        x = x0
        for w in ws:
            x = torch.tanh(x @ w)
        x.sum().backward()
        for w in ws:
            w.grad = None
    return run


def noise_curve(durations: tuple[float, ...] = (1e-3, 4e-3, 1.6e-2, 6.4e-2, 2.56e-1),
                budget_s: float = 2.0) -> dict[float, float]:
    """{d: sigma(d)} on the ranks of the default group: per d, the trimmed mean (the largest tenth of
    the samples dropped: a neighbour's burst) of the slowest rank's lead over the mean, over
    expected_max_normal(ranks). Every rank calls it; each d gets about budget_s / len(durations) and
    is run as a whole number of compute units of about 0.1 ms (rank 0's count, on every rank)."""
    import torch
    import torch.distributed as dist

    from fivefold.parallel.comm.compat import flat_collective

    world = dist.get_world_size()
    scale = expected_max_normal(world)
    if scale == 0:
        return {}
    run = _work()
    run()
    start = time.perf_counter()
    for _ in range(5):
        run()
    per_run = (time.perf_counter() - start) / 5
    out = {}
    for d in durations:
        reps = max(1, round(d / per_run))
        counts = torch.tensor([reps, max(8, min(60, int(budget_s / len(durations) / (reps * per_run))))])
        dist.broadcast(counts, 0)  # the same counts on every rank (rank 0's), or the collectives below hang
        reps, samples = (int(c) for c in counts)
        waits = []
        for _ in range(samples):
            # Raw torch calls, not the collective layer: a sample times the ranks' spread from a
            # common start, on forked ranks without a mesh; the layer's bookkeeping would add to it.
            dist.barrier()
            began = time.perf_counter()
            for _ in range(reps):
                run()
            took = torch.tensor([time.perf_counter() - began], dtype=torch.float64)
            every = torch.empty(world, dtype=torch.float64)
            flat_collective("all_gather")(every, took)  # the name this torch has (compat.py)
            waits.append(float(every.max() - every.mean()))
        waits.sort()
        kept = waits[: max(1, len(waits) - len(waits) // 10)]
        out[d] = statistics.mean(kept) / scale
    return out

