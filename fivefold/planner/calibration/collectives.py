"""`fivefold calibrate`, collectives: every collective the parallel code calls, timed on nproc
forked gloo ranks as training issues it, and fitted to the planner's alpha-beta model.

Each collective is issued right after a burst of compute on every rank, as in training (one called
back to back with the last finds the transport threads awake; one called after compute pays to
wake them). A sample is the mean over several such calls, as a step pays for many (sampling.py), and
the collectives take turns from sample to sample, so that a neighbour's burst of load on this
shared machine spoils one sample of each rather than every sample of one; the smallest size, where
latency dominates, gets the most samples. A send is timed as half of a ping-pong, since what
a pipeline stage waits for is the message arriving, not the sender's call returning.

The fit: beta (bytes/s) from a least-squares fit of t = steps x alpha + wire bytes / beta over
every (op, size) median, then alpha per collective from its smallest size, t - wire / beta spread
over its ring steps (comm.ring_steps): on gloo an all-reduce's two steps and a send's one do not
cost the same per step, and a profile that knows both prices tensor parallel's many small
all-reduces and the pipeline's sends each at its own cost.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.parallel.comm.compat import flat_collective
from fivefold.planner.comm import ring_steps

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _burst(x: torch.Tensor, ops: int = 100) -> None:
    """About a millisecond of small ops: the compute a training step runs between collectives."""
    for _ in range(ops):
        x = x * 1.0001


def _collectives(full: torch.Tensor, part: torch.Tensor, ping_pong: Callable[[torch.Tensor], None],
                 ) -> dict[str, Callable[[], object]]:
    """Each collective of OPS on this size's tensors (full: the whole, part: one rank's 1/world)."""
    import torch.distributed as dist

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: flat_collective("all_gather")(full, part),  # the name this torch has (compat.py)
        "reduce_scatter": lambda: flat_collective("reduce_scatter")(part, full),
        "all_to_all": lambda: dist.all_to_all_single(full.clone(), full),
        "send": lambda: ping_pong(full),
    }


def _collective_worker(rank: int, world: int, sizes: tuple[int, ...], repeats: tuple[tuple[int, int], ...],
                       threads: int = 1) -> list[tuple[str, int, float]]:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rows = []
    filler = torch.randn(64)

    def ping_pong(t: torch.Tensor) -> None:  # ranks 0 and 1; the others wait at the next barrier
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    for nbytes, (samples, calls) in zip(sizes, repeats, strict=True):  # one (samples, calls) per size
        n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by world
        ops = _collectives(torch.ones(n), torch.ones(n // world), ping_pong)
        times: dict[str, list[float]] = {op: [] for op in ops}
        for fn in ops.values():
            fn()  # warm-up
        for _ in range(samples):
            for op, fn in ops.items():
                # Raw torch calls here, barrier included, not the collective layer: calibration
                # times the backend itself, on forked ranks without a mesh, and the layer's counting
                # and timer spans around a measurement would be measured with it.
                dist.barrier()
                spent = 0.0
                for _ in range(calls):  # a sample as long as a training step's share (sampling.py)
                    _burst(filler)  # as in training: compute, then the collective
                    start = time.perf_counter()
                    fn()
                    spent += time.perf_counter() - start
                times[op].append(spent / calls)
        rows += [(op, n * 4, statistics.median(ts) / (2 if op == "send" else 1)) for op, ts in times.items()]
    return rows


def collective_timings(nproc: int = 2, sizes: tuple[int, ...] = (16_384, 262_144, 4_194_304),
                       repeats: tuple[tuple[int, int], ...] = ((9, 16), (5, 4), (3, 1)),
                       threads: int = 1) -> list[tuple[str, int, float]]:
    """(op, tensor bytes, seconds) measured on `nproc` forked gloo ranks (rank 0's view), each
    collective issued after a burst of compute; per size (samples, calls per sample): the median
    over samples of the mean over a sample's calls."""
    from fivefold.parallel.forked_ranks import run_workers

    return run_workers(_collective_worker, nproc, sizes, repeats, threads, timeout=600.0)[0]


def fit_alpha_beta(rows: list[tuple[str, int, float]], n: int) -> tuple[float, float]:
    """Least squares of t = steps x alpha + wire / beta over every (op, size) timing -> (alpha, beta)."""
    xs = [(ring_steps(op, n), wire_bytes(op, nbytes, n), t) for op, nbytes, t in rows]
    # normal equations for two unknowns a = alpha, c = 1/beta
    s11 = sum(s * s for s, _, _ in xs)
    s12 = sum(s * w for s, w, _ in xs)
    s22 = sum(w * w for _, w, _ in xs)
    r1 = sum(s * t for s, _, t in xs)
    r2 = sum(w * t for _, w, t in xs)
    det = s11 * s22 - s12 * s12
    alpha, inv_beta = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if inv_beta <= 0:  # latency-dominated sizes: bandwidth from the largest transfer alone
        _, w, t = max(xs, key=lambda x: x[1])
        inv_beta = t / w
    return max(alpha, 0.0), 1.0 / inv_beta


def alpha_per_op(rows: list[tuple[str, int, float]], n: int, beta: float) -> tuple[tuple[str, float], ...]:
    """Each collective's latency per ring step, from its smallest timed size: (t - wire / beta) / steps."""
    out = []
    for op in OPS:
        mine = [(nbytes, t) for o, nbytes, t in rows if o == op]
        if mine:
            nbytes, t = min(mine)
            out.append((op, max(t - wire_bytes(op, nbytes, n) / beta, 0.0) / ring_steps(op, n)))
    return tuple(out)
