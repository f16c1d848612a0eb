"""`fivefold calibrate`: measure this machine and write a hardware profile the planner reads.

Everything is measured the way training runs: on `nproc` forked ranks at once, each with the
thread count a training worker uses (`threads`: the cores shared out over the ranks, 1 when the
ranks outnumber the cores), so the ranks contend for cores, caches and memory as they will.
What is measured, and what it becomes in the profile (every value's [sources] entry says so):

- the fixed cost of one op: a chain of tiny elementwise multiplies run forward and backward with
  autograd, divided by the aten ops it dispatches (counted, opcount.trace) -> op_overhead_s; the
  same with a chain of views -> view_overhead_s;
- the same chain at larger sizes -> elementwise_curve: bytes read + written per op, and the rate
  at which the time beyond the overhead grows with them (caches first, then memory);
- a matmul sweep (square n x n, n = 16 .. 1024, the compute dtype) -> matmul_curve (FLOPs of one
  matmul, FLOP/s achieved); peak_flops is its best rate and compute_efficiency its median / best
  (what the FLOPs-only estimate, and MFU, use);
- fivefold's own optimizer step (train/optim.py: AdamW foreach=False, gradient clipping,
  zero_grad) on many small and on a few large tensors -> optimizer_s_per_tensor and
  optimizer_s_per_element (two equations, two unknowns);
- a large copy -> hbm_bw (bytes read + written per second);
- every collective the parallel code uses (all-reduce, all-gather, reduce-scatter, all-to-all,
  send/recv) at several sizes, each issued right after a burst of compute on every rank, as
  training issues them (a collective called back to back with the last one finds the transport
  threads awake; one called after compute, as in training, pays to wake them), median of the
  repeats -> a least-squares fit of the alpha-beta model t = steps x alpha + wire bytes / beta
  (the planner's comm.py model), giving intra_latency = alpha and intra_bw = beta with
  bw_efficiency = 1 (beta is already achieved); local ranks share one "node", so the inter-node
  figures are set to the same values.
Nothing is fitted to a training run: the planner's step time on this machine is then a
prediction from these primitives (opcount.py prices the model's own ops with them), and the
self-check compares it with what `fivefold train` measures.
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


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def threads_per_rank(nproc: int) -> int:
    """The compute threads one training worker gets when nproc ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def matmul_sweep(sizes: tuple[int, ...] = (128, 256, 512, 1024), dtype: torch.dtype = torch.float32,
                 repeats: int = 3) -> dict[int, float]:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) for each n, median of `repeats` timings of enough
    calls to take about 10 ms (a tiny matmul takes microseconds)."""
    out = {}
    for n in sizes:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        calls = max(1, int(2e7 // (2 * n**3)))

        def run():
            for _ in range(calls):
                torch.mm(a, b)

        out[n] = 2 * n**3 * calls / _median_time(run, repeats)
    return out


def copy_bandwidth(nbytes: int = 64_000_000, repeats: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


def op_costs(sizes: tuple[int, ...] = (4_096, 65_536, 1_048_576), links: int = 100,
             repeats: int = 9) -> dict:
    """Seconds per aten op of a forward + backward chain of elementwise multiplies (64 elements,
    then `sizes`), and of a chain of views; ops counted as dispatched (opcount.trace).

    Returns {"op_overhead_s", "view_overhead_s", "elementwise_curve": ((bytes per op, bytes/s), ...)}:
    the curve's rate is that of the time beyond the tiny chain's (the fixed cost).
    """
    from fivefold.planner.opcount import trace

    def per_op(numel: int) -> float:
        w = torch.randn(numel, requires_grad=True)

        def chain():
            x = w
            for _ in range(links):
                x = x * 1.0001
            x.sum().backward()

        tally = trace(chain)
        return _median_time(chain, repeats) / (tally.ops + tally.views)

    w = torch.randn(64, requires_grad=True)

    def views():
        x = w
        for _ in range(links):
            x = x.view(8, 8).t().reshape(64)
        x.sum().backward()

    vt = trace(views)
    # the view chain also runs a clone per reshape of a transposed view and a few kernels: price
    # those at the elementwise overhead and leave the rest to the views
    overhead = per_op(64)
    view_time = _median_time(views, repeats) - vt.ops * overhead
    curve = []
    for n in sizes:
        extra = per_op(n) - overhead
        nbytes = 2 * 4 * n  # read one fp32 tensor, write one
        if extra > 0:
            curve.append((float(nbytes), nbytes / extra))
    return {"op_overhead_s": overhead, "view_overhead_s": max(view_time / max(vt.views, 1), 0.0),
            "elementwise_curve": tuple(curve)}


def optimizer_costs(repeats: int = 5) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of fivefold's optimizer step as the
    training loop runs it: clip_grad_norm, AdamW (train/optim.py), zero_grad; from many small
    and a few large tensors."""
    from torch import nn

    from fivefold.config import TrainConfig
    from fivefold.train.optim import build_optimizer, clip_grad_norm

    def per_step(count: int, numel: int) -> float:
        params = nn.ParameterList([nn.Parameter(torch.randn(numel // 64, 64)) for _ in range(count)])
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        opt = build_optimizer(params, TrainConfig())

        def step():
            for p, g in zip(params, grads):
                p.grad = g.clone()
            clip_grad_norm([p.grad for p in params], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        clone = _median_time(lambda: [g.clone() for g in grads], repeats)  # not the optimizer's
        return _median_time(step, repeats) - clone

    (t1, n1, e1), (t2, n2, e2) = [(per_step(c, e), c, c * e) for c, e in ((96, 64), (4, 262_144))]
    # t = n a + e b for both sets
    det = n1 * e2 - n2 * e1
    a, b = (t1 * e2 - t2 * e1) / det, (n1 * t2 - n2 * t1) / det
    return max(a, 0.0), max(b, 0.0)


def _compute_worker(rank: int, world: int, threads: int, quick: bool) -> dict:
    """Every compute measurement, on each of `world` ranks at once (each with `threads` threads)."""
    torch.set_num_threads(threads)
    sizes = (16, 32, 64, 128, 256) if quick else (16, 32, 64, 128, 256, 512, 1024)
    # rounds spread over the run, medians taken: a neighbour's burst of load spoils one round, not all
    rounds = 1 if quick else 3
    ops, opt = [], []
    out = {}
    for r in range(rounds):
        ops.append(op_costs(repeats=5 if quick else 9))
        opt.append(optimizer_costs(3 if quick else 5))
        if r == 0:
            out["matmul"] = matmul_sweep(sizes, repeats=3 if quick else 5)
            out["copy"] = copy_bandwidth(8_000_000 if quick else 64_000_000)
    med = statistics.median
    out["op_overhead_s"] = med(o["op_overhead_s"] for o in ops)
    out["view_overhead_s"] = med(o["view_overhead_s"] for o in ops)
    n = min(len(o["elementwise_curve"]) for o in ops)
    out["elementwise_curve"] = tuple((ops[0]["elementwise_curve"][i][0], med(o["elementwise_curve"][i][1] for o in ops))
                                     for i in range(n))
    out["optimizer"] = (med(o[0] for o in opt), med(o[1] for o in opt))
    return out


def compute_timings(nproc: int, threads: int, quick: bool = False) -> dict:
    """The compute measurements on nproc forked ranks; each figure is the median over the ranks."""
    from fivefold.testing import run_workers

    rows = run_workers(_compute_worker, nproc, threads, quick, timeout=600.0)
    med = statistics.median
    return {
        "matmul": {n: med(r["matmul"][n] for r in rows) for n in rows[0]["matmul"]},
        "op_overhead_s": med(r["op_overhead_s"] for r in rows),
        "view_overhead_s": med(r["view_overhead_s"] for r in rows),
        "elementwise_curve": tuple(
            (x, med(r["elementwise_curve"][i][1] for r in rows if len(r["elementwise_curve"]) > i))
            for i, (x, _) in enumerate(min((r["elementwise_curve"] for r in rows), key=len))),
        "optimizer": (med(r["optimizer"][0] for r in rows), med(r["optimizer"][1] for r in rows)),
        "copy": med(r["copy"] for r in rows),
    }


def _burst(x: torch.Tensor, ops: int = 100) -> None:
    """About a millisecond of small ops: the compute a training step runs between collectives."""
    for _ in range(ops):
        x = x * 1.0001


def _collective_worker(rank: int, world: int, sizes: tuple[int, ...], repeats: int,
                       threads: int = 1) -> list[tuple[str, int, float]]:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    rows = []
    filler = torch.randn(64)
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
            fn()  # warm-up
            times = []
            for _ in range(repeats):
                _burst(filler)  # as in training: compute, then the collective
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            rows.append((op, n * 4, statistics.median(times)))
    return rows


def collective_timings(nproc: int = 2, sizes: tuple[int, ...] = (16_384, 262_144, 4_194_304),
                       repeats: int = 7, threads: int = 1) -> list[tuple[str, int, float]]:
    """(op, tensor bytes, seconds) measured on `nproc` forked gloo ranks (rank 0's view), each
    collective issued after a burst of compute, median of `repeats`."""
    from fivefold.testing import run_workers

    return run_workers(_collective_worker, nproc, sizes, repeats, threads)[0]


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


def calibrate(nproc: int = 2, quick: bool = False, name: str = "local", threads: int | None = None) -> Hardware:
    """Measure this machine as `nproc` training ranks use it: op costs, matmuls, the optimizer,
    copy bandwidth (on every rank at once) and collectives on nproc gloo ranks."""
    threads = threads or threads_per_rank(nproc)
    c = compute_timings(nproc, threads, quick)
    rates = c["matmul"]
    peak = max(rates.values())
    rows = collective_timings(nproc, (4_096, 65_536, 1_048_576) if quick else (16_384, 262_144, 4_194_304),
                              repeats=3 if quick else 7, threads=threads)
    alpha, beta = fit_alpha_beta(rows, nproc)
    host = (f"measured by fivefold calibrate on {os.uname().nodename} ({os.cpu_count()} cores, "
            f"{nproc} ranks x {threads} threads, torch {torch.__version__})")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sweep = ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items())
    coll = "; ".join(f"{op} {nb}B {t * 1e6:.0f}us" for op, nb, t in rows)
    per_tensor, per_element = c["optimizer"]
    sources = {
        "peak_flops": f"{host}: best fp32 matmul rate of the sweep (GFLOP/s by n: {sweep})",
        "compute_efficiency": f"{host}: median / best rate of the same sweep",
        "matmul_curve": f"{host}: the same sweep, (2 n^3 FLOPs, FLOP/s) per n",
        "hbm_bw": f"{host}: tensor copy, bytes read + written per second",
        "memory_bytes": f"{host}: physical memory (os.sysconf)",
        "intra_bw": f"{host}: alpha-beta least-squares fit over {nproc} gloo ranks, each collective after "
                    f"a burst of compute, median ({coll})",
        "intra_latency": f"{host}: same fit, alpha per ring step",
        "bw_efficiency": "1.0: the fitted bandwidth is already the achieved one",
        "inter_bw": "local ranks share one node: same as intra_bw",
        "inter_latency": "local ranks share one node: same as intra_latency",
        "pcie_bw": "not measured: set to the copy bandwidth",
        "gpus_per_node": f"{host}: CPU cores (local ranks all sit in this node)",
        "threads": f"{host}: torch threads per rank during every measurement (cores / ranks, at least 1)",
        "op_overhead_s": f"{host}: forward + backward of a chain of 64-element multiplies / aten ops dispatched",
        "view_overhead_s": f"{host}: the same for a chain of views (its few kernels priced at op_overhead_s)",
        "elementwise_curve": f"{host}: the multiply chain at larger sizes, (bytes read + written per op, "
                             "bytes/s of the time beyond op_overhead_s)",
        "optimizer_s_per_tensor": f"{host}: clip_grad_norm + AdamW(foreach=False) + zero_grad of train/optim.py "
                                  "on 96 x 64 and 4 x 262144 elements, solved for per tensor and per element",
        "optimizer_s_per_element": f"{host}: same measurement",
    }
    return Hardware(name=name, peak_flops=peak, memory_bytes=float(mem), hbm_bw=c["copy"], intra_bw=beta,
                    inter_bw=beta, pcie_bw=c["copy"], gpus_per_node=os.cpu_count() or 1,
                    compute_efficiency=statistics.median(rates.values()) / peak, bw_efficiency=1.0,
                    intra_latency=alpha, inter_latency=alpha, threads=threads,
                    op_overhead_s=c["op_overhead_s"], view_overhead_s=c["view_overhead_s"],
                    matmul_curve=tuple((2.0 * n**3, r) for n, r in rates.items()),
                    elementwise_curve=c["elementwise_curve"], optimizer_s_per_tensor=per_tensor,
                    optimizer_s_per_element=per_element, sources=sources)
