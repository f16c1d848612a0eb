"""`fivefold calibrate`: measure this machine and write a hardware profile the planner reads.

Everything is measured the way training runs: on `nproc` forked ranks at once, each with the
thread count a training worker uses (`threads`: the cores shared out over the ranks, 1 when the
ranks outnumber the cores), so the ranks contend for cores, caches and memory as they will; the
ranks start each measurement together. Every timing is a median over samples about as long as a
training step (sampling.py: short ones would miss the preemptions a step pays for on a shared
machine). The compute measurements run in rounds, every one of them once a round, and each figure
is the median over the rounds and then over the ranks: a neighbour's burst of load spoils one round
of each figure, not every round of one.
What is measured, and what it becomes in the profile (every value's [sources] entry says so):

- the fixed cost of one op: a chain of tiny elementwise ops of fifteen kinds (multiply, tanh, silu,
  exp, rsqrt, ...) run forward and backward with autograd, divided by the aten ops it dispatches
  (counted, opcount.trace) -> op_overhead_s; the same with a chain of views -> view_overhead_s;
- the same chain at larger sizes -> elementwise_curve: bytes read + written per op, and the rate
  at which the time beyond the overhead grows with them (caches first, then memory);
- a matmul sweep (square n x n, n = 16 .. 1024, the compute dtype), run as a step runs them: a
  chain of linear layers forward and backward -> matmul_curve (FLOPs of one matmul, FLOP/s
  achieved); peak_flops is its best rate and compute_efficiency its median / best (what the
  FLOPs-only estimate, and MFU, use);
- fivefold's own optimizer step (parallel/optimizer.py: AdamW foreach (fused on CUDA), gradient clipping,
  zero_grad) on many small and on a few large tensors -> optimizer_s_per_tensor and
  optimizer_s_per_element (two equations, two unknowns);
- Python's fixed costs beyond the ops (host.py): an nn.Module call, a custom autograd
  Function, a gradient hook, the loop's model-state sampling per parameter, a helper thread ->
  module_call_s, function_s, hook_s, tensor_query_s, thread_s;
- with `--layers CONFIG`, the model's own blocks, embedding and head + loss, each built alone at
  the shapes the config's ranks compute, forward and backward (layers.py) -> layer_times;
- the same compute started together on every rank, timed at lengths of 1 to 256 ms: how long the
  slowest rank keeps a collective waiting (noise.py) -> noise_curve;
- a large copy -> hbm_bw (bytes read + written per second);
- every collective the parallel code uses (collectives.py), each after a burst of compute as
  training issues it -> intra_bw (beta of the alpha-beta fit, bw_efficiency = 1 since beta is
  already achieved), intra_latency (its alpha) and collective_alpha (alpha per collective); local
  ranks share one "node", so the inter-node figures are set to the same values.
Nothing is fitted to a training run: the planner's step time on this machine is then a
prediction from these primitives (pricer.py prices the model's own ops with them, overheads.py
the Python around them), and the self-check compares it with what `fivefold train` measures.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from fivefold.planner.calibration.collectives import alpha_per_op, collective_timings, fit_alpha_beta
from fivefold.planner.calibration.host import host_costs
from fivefold.planner.calibration.layers import time_parts
from fivefold.planner.calibration.noise import noise_curve
from fivefold.planner.calibration.opcount import trace
from fivefold.planner.calibration.pricer import MeasuredPricer
from fivefold.planner.calibration.profile import MeasuredProfile
from fivefold.planner.calibration.sampling import SAMPLE_S, sample_time
from fivefold.planner.machine.datasheet import Hardware
from fivefold.progress import progress_bar

HOST = ("module_call_s", "function_s", "hook_s", "tensor_query_s", "thread_s")


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def threads_per_rank(nproc: int) -> int:
    """The compute threads one training worker gets when nproc ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, nproc))


def matmul_sweep(sizes: tuple[int, ...] = (128, 256, 512, 1024), dtype: torch.dtype = torch.float32,
                 repeats: int = 3, min_s: float = SAMPLE_S, op_s: float = 0.0, view_s: float = 0.0) -> dict[int, float]:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) for each n, as a training step runs its matmuls:
    a chain of n x n linear layers (n tokens) forward and backward, three matmuls per layer (output,
    input gradient, weight gradient), each writing a fresh tensor that autograd keeps or frees as it
    goes; the same matmul repeated on two warm operands runs faster than any step does.

    The rate is that of the time beyond the chain's fixed costs (its ops and views, counted by
    opcount.trace, at op_s and view_s), which profile.tally_time adds back per op; sizes whose
    time is all fixed cost get no point."""
    out = {}
    for n in sizes:
        layers = max(1, min(8, int(3e7 // (2 * n**3))))
        chain = _linear_chain(torch.randn(n, n, dtype=dtype, requires_grad=True),
                              [torch.randn(n, n, dtype=dtype, requires_grad=True) for _ in range(layers)])
        tally = trace(chain)
        work = sample_time(chain, repeats, min_s) - tally.ops * op_s - tally.views * view_s
        if work > 0:
            out[n] = 2 * n**3 * 3 * layers / work
    return out


def _linear_chain(x0: torch.Tensor, weights: list[torch.Tensor]) -> Callable[[], None]:
    """x0 through linear layers of `weights`, forward and backward, gradients dropped after."""

    def chain() -> None:
        x = x0
        for w in weights:
            x = torch.nn.functional.linear(x, w)
        x.backward(torch.ones_like(x))
        for t in (x0, *weights):
            t.grad = None

    return chain


def copy_bandwidth(nbytes: int = 64_000_000, repeats: int = 3) -> float:
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src), repeats)


# The elementwise ops a transformer's code is made of, taken in turn: a chain repeating one op keeps
# that one kernel's code and data hot, and with the other rank busy on the second core it ran at
# half to two thirds of the per-op cost of the model's blocks here; a chain of many kinds came close.
_MIX = (lambda x: x * 1.0001, torch.tanh, torch.nn.functional.silu, lambda x: x.pow(2), torch.sigmoid,
        torch.neg, lambda x: x / 1.5, torch.exp, lambda x: x + 0.5, torch.rsqrt, torch.nn.functional.gelu,
        torch.sin, lambda x: x.clamp(-1.0, 1.0), torch.abs, lambda x: x - 0.25)


def op_costs(sizes: tuple[int, ...] = (4_096, 65_536, 1_048_576), links: int = 120,
             repeats: int = 9, min_s: float = SAMPLE_S) -> dict:
    """Seconds per aten op of a forward + backward chain of elementwise ops of many kinds (_MIX:
    64 elements, then `sizes`), and of a chain of views; ops counted as dispatched (opcount.trace).

    Returns {"op_overhead_s", "view_overhead_s", "elementwise_curve": ((bytes per op, bytes/s), ...)}:
    the curve's rate is that of the time beyond the tiny chain's (the fixed cost).
    """
    def per_op(numel: int) -> float:
        w = torch.randn(numel, requires_grad=True)
        length = links if numel <= 65_536 else len(_MIX) * 2  # a long chain of MB-sized ops takes seconds

        def chain():
            x = w
            for i in range(length):
                x = _MIX[i % len(_MIX)](x)
            x.sum().backward()

        tally = trace(chain)
        return sample_time(chain, repeats, min_s) / (tally.ops + tally.views)

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
    view_time = sample_time(views, repeats, min_s) - vt.ops * overhead
    curve = []
    for n in sizes:
        extra = per_op(n) - overhead
        nbytes = 2 * 4 * n  # read one fp32 tensor, write one
        if extra > 0:
            curve.append((float(nbytes), nbytes / extra))
    return {"op_overhead_s": overhead, "view_overhead_s": max(view_time / max(vt.views, 1), 0.0),
            "elementwise_curve": tuple(curve)}


def optimizer_costs(repeats: int = 5, min_s: float = SAMPLE_S) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of fivefold's optimizer step as the
    training loop runs it: clip_grad_norm, AdamW (parallel/optimizer.py), zero_grad; from many small
    and a few large tensors."""
    from torch import nn

    from fivefold.config.schema import OptimConfig
    from fivefold.parallel.optimizer import build_optimizer, clip_grad_norm

    def per_step(count: int, numel: int) -> float:
        params = nn.ParameterList([nn.Parameter(torch.randn(numel // 64, 64)) for _ in range(count)])
        grads = [torch.randn_like(p) * 1e-3 for p in params]
        opt = build_optimizer(params, OptimConfig())

        def step():
            for p, g in zip(params, grads, strict=True):  # one gradient per parameter
                p.grad = g.clone()
            clip_grad_norm([p.grad for p in params], 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        clone = sample_time(lambda: [g.clone() for g in grads], repeats, min_s)  # not the optimizer's
        return sample_time(step, repeats, min_s) - clone

    (t1, n1, e1), (t2, n2, e2) = [(per_step(c, e), c, c * e) for c, e in ((96, 64), (4, 262_144))]
    # t = n a + e b for both sets
    det = n1 * e2 - n2 * e1
    a, b = (t1 * e2 - t2 * e1) / det, (n1 * t2 - n2 * t1) / det
    return max(a, 0.0), max(b, 0.0)


def _median_of(values: list):
    """Median of like-shaped measurements: numbers; tuples element by element (over the shortest);
    dicts key by key (a key over the measurements that have it: a curve may lack a point)."""
    first = values[0]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _median_of([v[k] for v in values if k in v]) for k in sorted(keys)}
    if isinstance(first, (tuple, list)):
        return tuple(_median_of([v[i] for v in values]) for i in range(min(len(v) for v in values)))
    return statistics.median(values)


def _compute_worker(rank: int, world: int, threads: int, quick: bool, parts: tuple = ()) -> dict:
    """Every compute measurement, on each of `world` ranks at once (each with `threads` threads);
    `parts` (opcount.Part): the model's own parts to time whole (layers.py)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    sizes = (16, 32, 64, 128, 256) if quick else (16, 32, 64, 128, 256, 512, 1024)
    rounds, samples, min_s = (1, 3, SAMPLE_S / 5) if quick else (3, 5, SAMPLE_S)
    ops, opt, host, mm, layers, noise = [], [], [], [], [], []
    for _ in range(rounds):
        for take, into in ((lambda: op_costs(repeats=samples, min_s=min_s), ops),
                           (lambda: optimizer_costs(samples, min_s), opt),
                           (lambda: host_costs(samples, min_s), host),
                           (lambda: matmul_sweep(sizes, repeats=3, min_s=min_s, op_s=ops[-1]["op_overhead_s"],
                                                 view_s=ops[-1]["view_overhead_s"]), mm),
                           (lambda: time_parts(list(parts), samples, min_s), layers),
                           (lambda: noise_curve(budget_s=0.5 if quick else 2.0), noise)):
            # Every rank starts each measurement together, as training's ranks run. A raw barrier, not
            # the collective layer's: calibration's forked ranks have no mesh, and it times the backend.
            dist.barrier()
            into.append(take())
    for o in ops:  # by size, so that sessions, ranks and rounds merge point by point
        o["elementwise_curve"] = dict(o["elementwise_curve"])
    return {**_median_of(ops), **_median_of(host), "optimizer": _median_of(opt), "matmul": _median_of(mm),
            "layers": _median_of(layers), "noise": _median_of(noise),
            "copy": copy_bandwidth(8_000_000 if quick else 64_000_000)}


def measure(nproc: int = 2, quick: bool = False, threads: int | None = None, progress: bool = False,
            parts: tuple = ()) -> dict:
    """One session of every measurement on nproc forked ranks (each figure the median over the
    ranks): {"compute": {...}, "collectives": {(op, tensor bytes): seconds}}. calibrate() makes a
    profile of one session; profile() of several, taken at different times (medians of each).
    parts: opcount.Part to time whole (layers.config_parts of the configs to plan)."""
    from fivefold.parallel.forked_ranks import run_workers

    threads = threads or threads_per_rank(nproc)
    # Two phases of about the same length: the bar's ETA after the first is a fair guess.
    with progress_bar("calibrating: compute, then collectives", 2, progress) as advance:
        compute = _median_of(run_workers(_compute_worker, nproc, threads, quick, tuple(parts), timeout=600.0))
        advance()
        rows = collective_timings(nproc, (4_096, 65_536, 1_048_576) if quick else (16_384, 262_144, 4_194_304),
                                  repeats=((3, 4), (3, 2), (2, 1)) if quick else ((9, 16), (5, 4), (3, 1)),
                                  threads=threads)
        advance()
    return {"compute": compute, "collectives": {(op, nbytes): t for op, nbytes, t in rows}}


def calibrate(nproc: int = 2, quick: bool = False, name: str = "local", threads: int | None = None,
              progress: bool = True, parts: tuple = ()) -> Hardware:
    """Measure this machine as `nproc` training ranks use it: op costs, matmuls, the optimizer,
    Python's fixed costs, copy bandwidth and the model's `parts` (on every rank at once) and
    collectives on nproc gloo ranks."""
    threads = threads or threads_per_rank(nproc)
    return profile([measure(nproc, quick, threads, progress, parts)], nproc, threads, name)


def profile(sessions: list[dict], nproc: int, threads: int, name: str = "local") -> Hardware:
    """The hardware profile from measure() sessions: each figure the median over them."""
    c = _median_of([s["compute"] for s in sessions])
    timed = _median_of([s["collectives"] for s in sessions])
    rows = [(op, nbytes, t) for (op, nbytes), t in timed.items()]
    rates = c["matmul"]
    peak = max(rates.values())
    alpha, beta = fit_alpha_beta(rows, nproc)
    per_op = alpha_per_op(rows, nproc, beta)
    host = (f"measured by fivefold calibrate on {os.uname().nodename} ({os.cpu_count()} cores, "
            f"{nproc} ranks x {threads} threads, torch {torch.__version__}, median of {len(sessions)} session(s))")
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    sweep = ", ".join(f"{n}: {r / 1e9:.1f}" for n, r in rates.items())
    coll = "; ".join(f"{op} {nb}B {t * 1e6:.0f}us" for op, nb, t in rows)
    per_tensor, per_element = c["optimizer"]
    sources = {
        "peak_flops": f"{host}: best fp32 matmul rate of the sweep, n x n linear layers forward + backward "
                      f"(GFLOP/s by n: {sweep})",
        "compute_efficiency": f"{host}: median / best rate of the same sweep",
        "matmul_curve": f"{host}: the same sweep, (2 n^3 FLOPs, FLOP/s) per n",
        "hbm_bw": f"{host}: tensor copy, bytes read + written per second",
        "memory_bytes": f"{host}: physical memory (os.sysconf)",
        "intra_bw": f"{host}: alpha-beta least-squares fit over {nproc} gloo ranks, each collective after "
                    f"a burst of compute, median ({coll})",
        "intra_latency": f"{host}: same fit, alpha per ring step",
        "collective_alpha": f"{host}: per collective, its smallest size's median less wire bytes / intra_bw, "
                            "per ring step (a send: half a ping-pong)",
        "bw_efficiency": "1.0: the fitted bandwidth is already the achieved one",
        "inter_bw": "local ranks share one node: same as intra_bw",
        "inter_latency": "local ranks share one node: same as intra_latency",
        "pcie_bw": "not measured: set to the copy bandwidth",
        "gpus_per_node": f"{host}: CPU cores (local ranks all sit in this node)",
        "threads": f"{host}: torch threads per rank during every measurement (cores / ranks, at least 1)",
        "op_overhead_s": f"{host}: forward + backward of a chain of 64-element elementwise ops of 15 kinds / aten "
                         "ops dispatched",
        "view_overhead_s": f"{host}: the same for a chain of views (its few kernels priced at op_overhead_s)",
        "elementwise_curve": f"{host}: the same chain at larger sizes, (bytes read + written per op, "
                             "bytes/s of the time beyond op_overhead_s)",
        "optimizer_s_per_tensor": f"{host}: clip_grad_norm, build_optimizer's AdamW, zero_grad (parallel/optimizer.py)"
                                  " on 96 x 64 and 4 x 262144 elements, solved for per tensor and per element",
        "optimizer_s_per_element": f"{host}: same measurement",
        "module_call_s": f"{host}: 100 multiplies each in an nn.Module's forward, less the bare chain, forward + "
                         "backward, per module",
        "function_s": f"{host}: the same multiplies as a custom autograd.Function, less the bare chain, per Function",
        "hook_s": f"{host}: a sum of 100 leaves each with a post-accumulate-grad hook, less none, per hook",
        "tensor_query_s": f"{host}: state_memory.model_state_bytes on 100 parameters (gradient and AdamW state "
                          "each), per parameter",
        "thread_s": f"{host}: a thread draining a queue, started and joined (pipeline_p2p.Sends' pattern)",
    }
    sources["noise_curve"] = (f"{host}: the same compute (0.1 ms units of small linear layers and tanh, forward "
                              "and backward) started at a barrier on every rank, per length d: the slowest rank's "
                              "lead over the mean, trimmed mean, over E[max of the ranks' standard normals] "
                              "(calibration/noise.py)")
    layers = c.get("layers") or {}
    if layers:
        sources["layer_times"] = (f"{host}: fivefold's own blocks, embedding and head + loss, each built alone at a "
                                  "rank's shapes and run forward and backward on real tensors (calibration/layers.py)")
    measured = MeasuredProfile(
        threads=threads, op_overhead_s=c["op_overhead_s"], view_overhead_s=c["view_overhead_s"],
        matmul_curve=tuple((2.0 * n**3, r) for n, r in rates.items()),
        elementwise_curve=tuple(c["elementwise_curve"].items()), optimizer_s_per_tensor=per_tensor,
        optimizer_s_per_element=per_element, layer_times=tuple((k, f, b) for k, (f, b) in sorted(layers.items())),
        noise_curve=tuple(sorted(c.get("noise", {}).items())), **{k: c[k] for k in HOST})
    return Hardware(name=name, peak_flops=peak, memory_bytes=float(mem), hbm_bw=c["copy"], intra_bw=beta,
                    inter_bw=beta, pcie_bw=c["copy"], gpus_per_node=os.cpu_count() or 1,
                    compute_efficiency=statistics.median(rates.values()) / peak, bw_efficiency=1.0,
                    intra_latency=alpha, inter_latency=alpha, collective_alpha=per_op, sources=sources,
                    pricer=MeasuredPricer(measured))
