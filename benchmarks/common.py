"""What the benchmarks share: measurement helpers, the per-comparison record, the summary line.

data_parallel.py, pipeline_parallel.py and tensor_parallel.py measure the same way (two sides
alternated step by step in forked gloo workers, the slowest rank's step, peak RSS in a separate
memory run) and report the same way (one JSON line per comparison, then a summary line); the
code for that lives here so the three cannot drift apart. See data_parallel.py's docstring for
why memory is measured as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import inspect
import json
import statistics
import sys
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from fivefold.config.schema import TrainConfig
from fivefold.parallel.comm.collectives import wire_bytes
from fivefold.parallel.comm.compat import collective_name
from fivefold.train.gc_policy import collect_between_steps

LOSS_TOL = 1e-5  # first-step loss: same forward, same weights and data; only summation order could differ


def log(*parts: Any) -> None:
    """Progress and checks go to stderr, so that stdout holds only the JSON lines."""
    print(*parts, file=sys.stderr, flush=True)


# ---- statistics --------------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else float("nan")


# ---- memory ------------------------------------------------------------------------------------
def status_mb(key: str) -> float:
    """A size line of /proc/self/status (VmHWM, RssAnon, ...) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    return float("nan")


def reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # then the peak also covers what the fork inherited: the same for every configuration
        pass


def malloc_returns_memory() -> bool:
    """Make glibc give freed tensors back to the OS at once, so that RSS follows live memory.

    By default glibc raises its mmap threshold after the first large free (up to 32 MB) and then
    serves activations from the heap, which it keeps: RSS becomes "the most the heap ever held, plus
    fragmentation". With a fixed 64 KiB threshold every tensor above it is its own mapping, unmapped
    when freed, and the heap top is trimmed above 128 KiB. This costs page faults, so it is only set
    in the memory runs, never in the timed ones.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 64 * 1024)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 128 * 1024))
    except OSError:
        return False


def prewarm() -> None:
    """Pay once, here, for what torch allocates on first use (an optimizer's first construction
    adds ~26 MB of RSS), so that no forked worker counts it in its peak."""
    lin = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(lin.parameters(), foreach=True)  # as build_optimizer makes it on the CPU
    lin(torch.ones(2, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(list(lin.parameters()), 1.0)
    opt.step()


def measure_peak(run: Callable[[], Any]) -> dict:
    """In a memory worker, after its process groups exist: `run()` builds a side and steps it (and
    returns it, with its `losses`); returns the peak RSS it added above the pre-model baseline.

    The side is kept alive until the readings are taken, so that nothing is freed before them.
    """
    malloc_set = malloc_returns_memory()
    dist.barrier()
    reset_peak_rss()
    anon0 = status_mb("RssAnon")
    side = run()
    hwm = status_mb("VmHWM")
    file_backed = status_mb("RssFile") + status_mb("RssShmem")  # library pages, the same for every run
    return {"peak_mb": hwm - file_backed - anon0, "peak_rss_mb": hwm, "malloc_set": malloc_set, "losses": side.losses}


def memory_over_ranks(results: list[dict]) -> dict:
    """The ranks' `measure_peak` results as one: the maximum over ranks, and each rank's peak."""
    return {"peak_mb": max(r["peak_mb"] for r in results), "per_rank": [round(r["peak_mb"], 1) for r in results],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in results), "malloc_set": all(r["malloc_set"] for r in results)}


# ---- traffic ----------------------------------------------------------------------------------
# torch.distributed's collectives a torch peer calls (FSDP2 calls the flat all-gather and reduce-scatter
# under the names its torch has: *_single in 2.13, all_gather_into_tensor / reduce_scatter_tensor in
# 2.11 and 2.12, resolved as fivefold resolves them: parallel/comm/compat.py), per op comms.wire_bytes
# prices: the argument holding the whole ring's tensor (the same name in every supported torch).
COLLECTIVES = {"all_reduce": "tensor", "reduce_scatter": "input", "all_gather": "output_tensor"}


def torch_collective_name(op: str) -> str:
    """The torch.distributed function a torch peer calls for `op` (a key of COLLECTIVES) on this torch."""
    return op if op == "all_reduce" else collective_name(op)


@contextlib.contextmanager
def counting_collectives(record: Callable[[str, dist.ProcessGroup | None, float], None],
                         ops: Iterable[str] = tuple(COLLECTIVES)) -> Iterator[None]:
    """While the block runs, call record(op, group, wire bytes) for every call of the
    torch.distributed functions that run `ops` (keys of COLLECTIVES) on this torch, with
    comms.wire_bytes' ring formula, so that a torch peer's bytes are counted as fivefold counts its
    own; restores them after."""
    names = {torch_collective_name(op): op for op in ops}
    originals = {name: getattr(dist, name) for name in names}

    def counted(name: str):
        signature, op = inspect.signature(originals[name]), names[name]

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)  # FSDP2 passes them by keyword
            group, tensor = bound.arguments.get("group"), bound.arguments[COLLECTIVES[op]]
            record(op, group, wire_bytes(op, tensor.numel() * tensor.element_size(), dist.get_world_size(group)))
            return originals[name](*args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# ---- time --------------------------------------------------------------------------------------
def alternate(sides: Sequence[Any], batches: Sequence[tuple[torch.Tensor, torch.Tensor]], warmup: int,
              timed_step: Callable[[Any, torch.Tensor, torch.Tensor], None]) -> list[dict]:
    """Each side's warm-up, then the sides alternating step by step (A B, B A, ...), so that a load
    change on a shared machine hits both alike. Returns each side's timed steps and all its losses.
    Both sides step under the training loop's garbage-collector policy (train.gc_every, as
    torchtitan's gc_freq: collections between steps, not inside them; train/gc_policy.py)."""
    with collect_between_steps(TrainConfig().gc_every) as collector:
        for side in sides:
            for x, y in batches[:warmup]:
                timed_step(side, x, y)
        for i, (x, y) in enumerate(batches[warmup:]):
            for side in sides if i % 2 == 0 else sides[::-1]:
                timed_step(side, x, y)
            collector.after_step(i + 1)
    # cpu_times: where a side records them (the process's CPU seconds per step)
    return [{"times": s.times[warmup:], "losses": s.losses,
             **({"cpu_times": s.cpu_times[warmup:]} if hasattr(s, "cpu_times") else {})} for s in sides]


def slowest_rank(results: list[list[dict]], kinds: Sequence[str]) -> dict[str, dict]:
    """The ranks' `alternate` results ([rank][side]) per side: a step takes as long as its slowest rank."""
    out = {kind: {"times": [max(ts) for ts in zip(*(r[i]["times"] for r in results), strict=True)],
                  "losses": results[0][i]["losses"]}
           for i, kind in enumerate(kinds)}
    for i, kind in enumerate(kinds):  # CPU time is work: the ranks' sum
        if "cpu_times" in results[0][i]:
            out[kind]["cpu_times"] = [sum(ts) for ts in zip(*(r[i]["cpu_times"] for r in results), strict=True)]
    return out


def quartiles(xs: Sequence[float]) -> list[float]:
    """The first and third quartile (the interquartile range's ends)."""
    if len(xs) < 2:
        return [round(xs[0], 4)] * 2 if xs else [float("nan")] * 2
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [round(q[0], 4), round(q[2], 4)]


# ---- output ------------------------------------------------------------------------------------
def memory_fields(mem_a: dict, mem_b: dict, labels: tuple[str, str] = ("fivefold", "torch"),
                  fields: Iterable[str] = ("peak_mb", "ratio", "peak_rss_mb")) -> dict:
    """The memory part of a comparison record, in the order of `fields` (which scripts report which
    differs: per-rank peaks only where the ranks hold different things)."""
    a, b = labels
    out: dict = {}
    for field in fields:
        if field == "peak_mb":
            out.update({f"{a}_peak_mb": round(mem_a["peak_mb"], 1), f"{b}_peak_mb": round(mem_b["peak_mb"], 1)})
        elif field == "ratio":
            out["ratio_peak_memory"] = ratio(mem_a["peak_mb"], mem_b["peak_mb"])
        elif field == "per_rank":
            out.update({f"{a}_peak_mb_per_rank": mem_a["per_rank"], f"{b}_peak_mb_per_rank": mem_b["per_rank"]})
        elif field == "peak_rss_mb":
            out.update({f"{a}_peak_rss_mb": round(mem_a["peak_rss_mb"], 1),
                        f"{b}_peak_rss_mb": round(mem_b["peak_rss_mb"], 1)})
        elif field == "malloc_set":
            out["malloc_set"] = mem_a["malloc_set"] and mem_b["malloc_set"]
        else:
            raise ValueError(field)
    return out


def comparison_record(head: dict, a: list[dict], b: list[dict], memory: dict, steps: int, rounds: int,
                      labels: tuple[str, str] = ("fivefold", "torch"), ratio_key: str = "ratio_step_time") -> dict:
    """One comparison's JSON record from its two sides' rounds (`slowest_rank` results, one per
    round) and its `memory_fields`: `head`, step times and their ratio (a / b), memory, per-round
    medians (to judge the spread), then the loss checks."""
    la, lb = labels
    t_a = median([x for r in a for x in r["times"]])  # over all timed steps of all rounds
    t_b = median([x for r in b for x in r["times"]])
    first_diff = abs(a[0]["losses"][0] - b[0]["losses"][0])
    rounds_of = lambda xs: [round(median(x["times"]), 4) for x in xs]  # noqa: E731
    # The spread: each round's ratio of its two medians (the sides alternated step by step within it).
    per_round = [ratio(median(x["times"]), median(y["times"])) for x, y in zip(a, b, strict=True)]
    # And step by step: the sides' i-th steps ran back to back, so their ratio sees one load.
    paired = [ta / tb for x, y in zip(a, b, strict=True) for ta, tb in zip(x["times"], y["times"], strict=True)]
    cpu = {}
    if "cpu_times" in a[0] and "cpu_times" in b[0]:  # CPU seconds of all ranks per step: the work, not the waits
        c_a, c_b = (median([c for r in side for c in r["cpu_times"]]) for side in (a, b))
        cpu = {f"{la}_cpu_s": round(c_a, 4), f"{lb}_cpu_s": round(c_b, 4), "ratio_cpu_time": ratio(c_a, c_b)}
    return {
        **head, f"{la}_step_s": round(t_a, 4), f"{lb}_step_s": round(t_b, 4), ratio_key: ratio(t_a, t_b),
        f"{ratio_key}_per_round": per_round, f"{ratio_key}_min_max": [min(per_round), max(per_round)],
        f"{ratio_key}_paired_median": round(median(paired), 4), f"{ratio_key}_paired_iqr": quartiles(paired),
        **cpu, **memory,
        f"{la}_round_medians_s": rounds_of(a), f"{lb}_round_medians_s": rounds_of(b),
        "steps": steps, "rounds": rounds,
        "loss_first_step": [a[0]["losses"][0], b[0]["losses"][0]],
        "loss_first_step_abs_diff": first_diff,
        "loss_check": "ok" if first_diff <= LOSS_TOL else f"MISMATCH (> {LOSS_TOL})",
        # Informative only: after several AdamW steps ~1e-5 would be normal (Adam amplifies last-bit
        # gradient differences, and the sides may clip with norms summed in different precision).
        "loss_last_step_abs_diff": abs(a[0]["losses"][-1] - b[0]["losses"][-1]),
        "losses_repeat_every_round": all(r["losses"] == a[0]["losses"] for r in a)
                                     and all(r["losses"] == b[0]["losses"] for r in b),
    }


def report(name: str, record: dict, summary: dict, ratios: dict[str, str] | None = None,
           labels: tuple[str, str] = ("fivefold ", "torch ")) -> None:
    """Log a record's loss check, print the record, and copy its ratios (summary key -> record key;
    by default step time and peak memory) and loss check into the summary."""
    first = record["loss_first_step"]
    spread = next((k for k in record if k.endswith("_min_max")), None)
    if spread is not None:
        key = spread.removesuffix("_min_max")
        log(f"{name}: {key} {record[key]} (medians' ratio), per round {record[key + '_per_round']}, step by step "
            f"median {record[key + '_paired_median']} IQR {record[key + '_paired_iqr']}"
            + (f", CPU time {record['ratio_cpu_time']}" if "ratio_cpu_time" in record else ""))
    log(f"loss check {name}: first-step losses {labels[0]}{first[0]:.8f} vs {labels[1]}{first[1]:.8f}, "
        f"|diff| {record['loss_first_step_abs_diff']:.2e} -> {record['loss_check']}")
    print(json.dumps(record), flush=True)
    if ratios is None:
        ratios = {f"{name}_ratio_step_time": "ratio_step_time", f"{name}_ratio_peak_memory": "ratio_peak_memory"}
    for key, field in ratios.items():
        summary[key] = record[field]
    summary[f"{name}_loss_check"] = record["loss_check"]


def finish_summary(summary: dict, targets: dict[str, float] | None, began: float, note: str | None = None) -> None:
    """Add the targets (printed beside the measured ratios, not asserted) and the wall time, and print
    the summary as the last stdout line. `targets=None`: none applies to this run, `note` says why."""
    if targets is None:
        summary["targets"] = {}
        if note is not None:
            summary["note"] = note
    else:
        measured = {k: v for k, v in targets.items() if k in summary}  # the comparisons run (--only)
        summary["targets"] = {k.replace("_ratio", ""): f"<= {v}" for k, v in measured.items()}
        summary["within_target"] = {k.replace("_ratio", ""): summary[k] <= v for k, v in measured.items()}
    summary["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(summary), flush=True)


# ---- command line ------------------------------------------------------------------------------
def make_parser(doc: str, config: str, choices: Iterable[str], steps: int, rounds: int,
                unit: str) -> argparse.ArgumentParser:
    """The options every benchmark has; each script adds its own before `parse`."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0], allow_abbrev=False,
                                     epilog="Extra --section.key=value arguments override the config.")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps skipped at the start of every run")
    parser.add_argument("--rounds", type=int, default=rounds, help=f"alternations of each {unit}'s two sides")
    parser.add_argument("--config", default=config)
    parser.add_argument("--only", nargs="+", choices=list(choices), default=list(choices))
    parser.add_argument("--quick", action="store_true", help="1 round of 2 steps after 1 warm-up step: a smoke test")
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """The options, and the rest: `--section.key=value` config overrides."""
    args, overrides = parser.parse_known_args(argv)
    if args.quick:
        args.steps, args.warmup, args.rounds = 2, 1, 1
    return args, overrides


# ---- driver: fivefold against torch, per named comparison --------------------------------------
SIDES = ("fivefold", "torch")


def timed_rounds(names: Sequence[str], rounds: int, run: Callable[[str, tuple[str, str]], dict[str, dict]],
                 began: float, width: int) -> dict[str, dict[str, list[dict]]]:
    """`rounds` timed runs of each comparison (`run(name, kinds)`: `slowest_rank` per side), the
    side built and stepped first flipping from round to round; name -> side -> one result per round."""
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in names}
    for rnd in range(rounds):
        for name in names:
            kinds = SIDES if rnd % 2 == 0 else SIDES[::-1]  # who is built and stepped first
            for kind, res in run(name, kinds).items():
                runs[name].setdefault(kind, []).append(res)
                log(f"round {rnd + 1}/{rounds} {name:{width}s} {kind:9s} median {median(res['times']):.4f} s/step  "
                    f"first loss {res['losses'][0]:.7f}  [{time.perf_counter() - began:.0f} s]")
    return runs


def memory_runs(names: Sequence[str], run: Callable[[str, str], dict], began: float,
                width: int) -> dict[str, dict[str, dict]]:
    """One memory run (`run(name, kind)`: `memory_over_ranks`) per comparison and side."""
    mem: dict[str, dict[str, dict]] = {name: {} for name in names}
    for name in names:
        for kind in SIDES:
            mem[name][kind] = r = run(name, kind)
            log(f"memory {name:{width}s} {kind:9s} peak +{r['peak_mb']:.1f} MB, per rank {r['per_rank']} (glibc "
                f"returning freed memory: {r['malloc_set']})  [{time.perf_counter() - began:.0f} s]")
    return mem
