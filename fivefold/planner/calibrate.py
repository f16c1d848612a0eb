"""`fivefold calibrate`: measure this machine and write a hardware profile the planner reads.

What is measured, and what it becomes in the profile (every value's [sources] entry says so):
- a matmul sweep (square n x n, the compute dtype) -> peak_flops is the best rate seen, and
  compute_efficiency the median rate over the sweep divided by it (small matmuls run slower);
- a large copy -> hbm_bw (bytes read + written per second);
- every collective the parallel code uses (all-reduce, all-gather, reduce-scatter, all-to-all,
  send/recv) at several sizes on `nproc` local gloo ranks -> a least-squares fit of the
  alpha-beta model t = steps x alpha + wire bytes / beta (the planner's comm.py model), giving
  intra_latency = alpha and intra_bw = beta with bw_efficiency = 1 (beta is already achieved);
  local ranks share one "node", so the inter-node figures are set to the same values.
Nothing is fitted to a training run: the planner's step time on this machine is then a
prediction, and the self-check compares it with what `fivefold train` measures.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from fivefold.parallel.comms import wire_bytes
from fivefold.planner.hardware import Hardware

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_sweep(sizes: tuple[int, ...] = (128, 256, 512, 1024), dtype: torch.dtype = torch.float32,
                 repeats: int = 3) -> dict[int, float]:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) for each n, best of `repeats`."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[n] = 2 * n**3 / _best_time(lambda: a @ b, repeats)
    return out


def copy_bandwidth(nbytes: int = 64_000_000, repeats: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


def _collective_worker(rank: int, world: int, sizes: tuple[int, ...], repeats: int) -> list[tuple[str, int, float]]:
    import torch.distributed as dist

    rows = []
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by world
        full, part = torch.ones(n), torch.ones(n // world)
        ops = {
            "all_reduce": lambda: dist.all_reduce(full),
            "all_gather": lambda: dist.all_gather_into_tensor(full, part),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, full),
            "all_to_all": lambda: dist.all_to_all_single(full.clone(), full),
            "send": lambda: (dist.send(full, 1) if rank == 0 else dist.recv(full, 0)) if rank < 2 else None,
        }
        for op, fn in ops.items():
            dist.barrier()
            rows.append((op, n * 4, _best_time(fn, repeats)))
    return rows


def collective_timings(nproc: int = 2, sizes: tuple[int, ...] = (16_384, 262_144, 4_194_304),
                       repeats: int = 3) -> list[tuple[str, int, float]]:
    """(op, tensor bytes, seconds) measured on `nproc` forked gloo ranks (rank 0's view)."""
    from fivefold.testing import run_workers

    return run_workers(_collective_worker, nproc, sizes, repeats)[0]


def fit_alpha_beta(rows: list[tuple[str, int, float]], n: int) -> tuple[float, float]:
    """Least squares of t = steps x alpha + wire / beta over every (op, size) timing -> (alpha, beta)."""
    xs = []
    for op, nbytes, t in rows:
        steps = {"all_reduce": 2 * (n - 1), "send": 1}.get(op, n - 1)
        xs.append((steps, wire_bytes(op, nbytes, n), t))
    # normal equations for two unknowns a = alpha, c = 1/beta
    s11 = sum(s * s for s, _, _ in xs); s12 = sum(s * w for s, w, _ in xs); s22 = sum(w * w for _, w, _ in xs)
    r1 = sum(s * t for s, _, t in xs); r2 = sum(w * t for _, w, t in xs)
    det = s11 * s22 - s12 * s12
    alpha, inv_beta = (r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det
    if inv_beta <= 0:  # latency-dominated sizes: bandwidth from the largest transfer alone
        _, w, t = max(xs, key=lambda x: x[1])
        inv_beta = t / w
    return max(alpha, 0.0), 1.0 / inv_beta


def calibrate(nproc: int = 2, quick: bool = False, name: str = "local") -> Hardware:
    """Measure this machine: matmuls, copy bandwidth and collectives on nproc gloo ranks."""
    sizes = (64, 128, 256) if quick else (128, 256, 512, 1024)
    rates = matmul_sweep(sizes, repeats=2 if quick else 3)
    peak = max(rates.values())
    hbm = copy_bandwidth(8_000_000 if quick else 64_000_000)
    rows = collective_timings(nproc, (4_096, 65_536, 1_048_576) if quick else (16_384, 262_144, 4_194_304),
                              repeats=2 if quick else 3)
    alpha, beta = fit_alpha_beta(rows, nproc)
    host = f"measured by fivefold calibrate on {os.uname().nodename} ({os.cpu_count()} cores, torch {torch.__version__})"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sweep = ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items())
    coll = "; ".join(f"{op} {nb}B {t * 1e6:.0f}us" for op, nb, t in rows)
    sources = {
        "peak_flops": f"{host}: best fp32 matmul rate of the sweep (GFLOP/s by n: {sweep})",
        "compute_efficiency": f"{host}: median / best rate of the same sweep",
        "hbm_bw": f"{host}: tensor copy, bytes read + written per second",
        "memory_bytes": f"{host}: physical memory (os.sysconf)",
        "intra_bw": f"{host}: alpha-beta least-squares fit over {nproc} gloo ranks ({coll})",
        "intra_latency": f"{host}: same fit, alpha per ring step",
        "bw_efficiency": "1.0: the fitted bandwidth is already the achieved one",
        "inter_bw": "local ranks share one node: same as intra_bw",
        "inter_latency": "local ranks share one node: same as intra_latency",
        "pcie_bw": "not measured: set to the copy bandwidth",
        "gpus_per_node": f"{host}: CPU cores (local ranks all sit in this node)",
    }
    return Hardware(name=name, peak_flops=peak, memory_bytes=float(mem), hbm_bw=hbm, intra_bw=beta, inter_bw=beta,
                    pcie_bw=hbm, gpus_per_node=os.cpu_count() or 1,
                    compute_efficiency=statistics.median(rates.values()) / peak, bw_efficiency=1.0,
                    intra_latency=alpha, inter_latency=alpha, sources=sources)
