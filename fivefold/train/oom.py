"""Out of memory, handled: the rank that ran out writes a memory snapshot, and the run ends with one line.

    record_history(cfg, device_type)     at setup, with train.memory_snapshot: the CUDA allocator
                                         keeps its last train.memory_snapshot_entries allocations and
                                         frees, each with its Python stack
    out_of_memory(cfg, device, error, step)   on torch.OutOfMemoryError, in a step or while setting
                                         up: the snapshot, then the line

The line names the rank, the step, the planner's predicted peak for this rank against the device's
capacity, the snapshot's path, and the planner's cheapest layout change that would fit:

    rank 0: out of memory at step 7: the planner predicted a peak of 71.2 GiB against the device's
    79.1 GiB; snapshot: runs/x/memory_snapshot_rank0.pickle (open it at https://pytorch.org/memory_viz);
    the cheapest layout change that fits: --parallel.zero=3 (planner: 52.0 GiB)

Python-only stacks: recording C++ frames too makes a large run's dump symbolize every frame, which
torchtitan measured at 461 s for a DeepSeek-V3 snapshot against 4 s with Python frames only
(torchtitan's memory profiler; PyTorch's `_record_memory_history(stacks="python")`).

On CUDA the snapshot is the allocator's own (`torch.cuda.memory._snapshot()`: its segments, and the
history when recorded), the file memory_viz opens, with this report added under "fivefold_oom". A
CPU process has no allocator history: its file holds the report alone, with empty segments and
traces, so the path the line names exists on every device. The file is written atomically (a
temporary name, then a rename): a rank killed mid-write leaves no half snapshot under the name.

"Cheapest" is fewest changed settings first (each is a flag to type and a decision to check), then
the fastest predicted step: among the layouts planner/search.py enumerates for the same number of
ranks, those validate() accepts whose planner peak (fivefold's own accounting, the one the metrics
log compares: planner/selfcheck.py) fits the capacity. Where this layout's prediction was under what
the step wanted (at least the capacity; on CUDA what PyTorch held plus the request that failed), the
planner under-predicts this run by that ratio, and a candidate must fit with its peak scaled alike.
Without a capacity (a CPU run without run.hardware) nothing can be judged to fit: the line names
the change of fewest settings that lowers the planner's peak most.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from fivefold.config.load import replace
from fivefold.config.schema import Config

if TYPE_CHECKING:
    from fivefold.planner.machine.datasheet import Hardware

SNAPSHOT = "memory_snapshot_rank{rank}.pickle"
VIEWER = "https://pytorch.org/memory_viz"
# The settings a layout change may touch: those search.candidates() varies. dp only where the config
# names it: at 0 it follows the others.
SETTINGS = (("parallel", "dp"), ("parallel", "tp"), ("parallel", "pp"), ("parallel", "cp"), ("parallel", "ep"),
            ("parallel", "zero"), ("parallel", "sp"), ("parallel", "pp_schedule"), ("parallel", "virtual_stages"),
            ("parallel", "tp_overlap"), ("parallel", "ep_overlap"), ("train", "micro_batch"),
            ("train", "recompute"))


class OutOfMemory(torch.OutOfMemoryError):
    """A rank ran out of device memory: one line, its snapshot written (module docstring)."""


def record_history(cfg: Config, device_type: str) -> bool:
    """With train.memory_snapshot on CUDA, turn on the allocator's history; True if turned on."""
    if not cfg.train.memory_snapshot or device_type != "cuda":
        return False  # a CPU process has no caching allocator to record
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python",
                                             max_entries=cfg.train.memory_snapshot_entries)
    return True


def out_of_memory(cfg: Config, device: torch.device, error: BaseException, step: int | None = None) -> OutOfMemory:
    """Write this rank's snapshot into the run directory and return the one-line error to raise.
    step: 1-based, the step that ran out (the metrics log's and checkpoints' numbering); None while
    setting up (the model's weights, a checkpoint being loaded)."""
    from fivefold.checkpoint.run_dir import run_dir_of

    rank, world, device_type = torch.distributed.get_rank(), torch.distributed.get_world_size(), device.type
    # The allocator's state first, as the failed step left it (its tensors are still held), then the planner.
    snapshot = torch.cuda.memory._snapshot() if device_type == "cuda" else {"segments": [], "device_traces": []}
    capacity = device_capacity(cfg, device)
    wanted = demand(error, device, capacity)
    peak = None
    try:  # the diagnosis never hides the error it explains
        hw = pricing_hardware(cfg)
        # pp is the mesh's outermost axis (parallel/mesh.py): consecutive blocks of world / pp ranks
        peak = predicted_peak(cfg, world, rank // (world // cfg.parallel.pp), device_type)
        change = cheapest_change(cfg, world, hw, device_type, capacity, peak, wanted)
    except Exception as e:  # noqa: BLE001
        change = f"the planner could not look for a layout change ({first_line(e)})"
    path = run_dir_of(cfg) / SNAPSHOT.format(rank=rank)
    report = {"rank": rank, "step": step, "error": first_line(error), "predicted_peak_bytes": peak,
              "capacity_bytes": capacity, "demand_bytes": wanted, "change": change}
    try:
        write_snapshot(path, {**snapshot, "fivefold_oom": report})
        where = f"snapshot: {path} (open it at {VIEWER})"
    except OSError as e:  # a full disk: the line still comes
        where = f"no snapshot: writing {path} failed ({e.strerror or e})"
    recorded = cfg.train.memory_snapshot and device_type == "cuda"
    return OutOfMemory(oom_line(rank, step, peak, capacity, where, change, recorded))


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]}"


def write_snapshot(path: Path, snapshot: dict) -> None:
    """Pickled, as torch.cuda.memory._dump_snapshot writes it, but atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(snapshot, f)
    os.replace(tmp, path)


def device_capacity(cfg: Config, device: torch.device) -> float | None:
    """Bytes of memory of this rank's device: the CUDA device's, else run.hardware's, else None."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    if cfg.run.hardware:
        from fivefold.planner.hardware import load_profile

        return float(load_profile(cfg.run.hardware).memory_bytes)
    return None


def demand(error: BaseException, device: torch.device, capacity: float | None) -> float | None:
    """A lower bound of the bytes the step wanted: on CUDA what PyTorch held plus the request that
    failed (torch's message: "Tried to allocate 2.00 GiB"), else the capacity it ran out of."""
    held = float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0.0
    asked = re.search(r"Tried to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)", str(error))
    if asked is not None:
        held += float(asked[1]) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(asked[2])
    return max(held, capacity) if capacity is not None else None


def pricing_hardware(cfg: Config) -> Hardware:
    """What the candidates' step times are priced on: run.hardware's profile, else the H100 of the
    catalog (as the metrics log's prediction does: only their order matters here)."""
    from fivefold.planner.hardware import get_hardware, load_profile

    return load_profile(cfg.run.hardware) if cfg.run.hardware else get_hardware("h100")


def predicted_peak(cfg: Config, world: int, pp_rank: int, device_type: str) -> float:
    """The planner's peak bytes for a rank of pipeline rank `pp_rank` (planner/selfcheck.py)."""
    from fivefold.planner.selfcheck import memory_per_pipeline_rank

    return memory_per_pipeline_rank(cfg, world, device_type)[pp_rank]["total"]


def changed_settings(cfg: Config, layout: Config) -> list[str]:
    """The overrides that turn `cfg` into `layout`: ["--parallel.zero=3", ...]."""
    out = []
    for table, key in SETTINGS:
        old, new = getattr(getattr(cfg, table), key), getattr(getattr(layout, table), key)
        if old != new and not (key == "dp" and old == 0):
            out.append(f"--{table}.{key}={str(new).lower() if isinstance(new, bool) else new}")
    return out


def cheapest_change(cfg: Config, world: int, hw: Hardware, device_type: str, capacity: float | None,
                    peak: float, wanted: float | None) -> tuple[list[str], float] | str:
    """The fewest changed settings, then the fastest, that the planner predicts fit (module
    docstring): (the overrides, its predicted peak bytes), or why there is none. Where the planner
    predicted less than the step wanted (`wanted`), its figures are scaled by that ratio: the
    candidate must fit with the same under-prediction. Without a capacity nothing can be judged to
    fit: the change of fewest settings that lowers the planner's peak most."""
    from fivefold.planner.estimate import estimate
    from fivefold.planner.machine.pricing import Memo
    from fivefold.planner.search import candidates
    from fivefold.planner.selfcheck import activation_element_bytes
    from fivefold.validate import validate

    target = peak if capacity is None else capacity * min(1.0, peak / wanted)
    by_count: dict[int, list[tuple[list[str], Config]]] = {}
    for layout in candidates(cfg, world, hw.gpus_per_node):
        changes = changed_settings(cfg, layout)
        if changes:
            by_count.setdefault(len(changes), []).append((changes, layout))
    hw = dataclasses.replace(hw, pricer=hw.pricer.for_search())  # one pricing for every candidate, as search() does
    memo, act_bytes = Memo(), activation_element_bytes(cfg, device_type)
    checked: dict[Config, bool] = {}
    tried = 0
    for count in sorted(by_count):  # the fewest changes first: a level with any fit ends the search
        fitting = []
        for changes, layout in by_count[count]:
            key = replace(layout, train={"recompute": "none"})  # recompute takes no part in validate (search.py)
            if key not in checked:
                checked[key] = not validate(layout, world)
            if not checked[key]:
                continue
            tried += 1
            est = estimate(layout, world, hw, act_bytes=act_bytes, memo=memo, implementation=True)
            if est.memory["total"] < target:
                rank_by = est.step_time_s if capacity is not None else est.memory["total"]
                fitting.append((rank_by, changes, est.memory["total"]))
        if fitting:
            _, changes, bytes_ = min(fitting, key=lambda f: f[0])
            return changes, bytes_
    return f"no layout change fits: none of the {tried} other valid layouts of {world} rank{'s' * (world > 1)} does"


def size(n: float) -> str:
    """Bytes as GiB (MiB under one GiB: a test model's)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def oom_line(rank: int, step: int | None, peak: float | None, capacity: float | None, where: str,
             change: tuple[list[str], float] | str, recorded: bool) -> str:
    """The one line the run ends with (module docstring); `where` says where the snapshot is."""
    predicted = f"a peak of {size(peak)}" if peak is not None else "no peak"
    against = f"the device's {size(capacity)}" if capacity is not None else "a capacity unknown (set run.hardware)"
    if isinstance(change, tuple):
        what = ("the cheapest layout change that fits" if capacity is not None
                else "the layout change of fewest settings that lowers the planner's peak most")
        fix = f"{what}: {' '.join(change[0])} (planner: {size(change[1])})"
    else:
        fix = change
    history = "" if recorded else "; for the allocation history rerun with --train.memory_snapshot=true"
    when = f"at step {step}" if step is not None else "while setting up"
    return f"rank {rank}: out of memory {when}: the planner predicted {predicted} against {against}; " \
           f"{where}; {fix}{history}"
