"""Hardware the planner reasons about: a catalog of accelerators and TOML profiles.

A `Hardware` holds two kinds of numbers, and keeps them apart on purpose:

- vendor figures (peak dense bf16 FLOP/s, memory, link bandwidths, GPUs per node), each with the
  data sheet it comes from;
- efficiency factors (the achievable fraction of peak FLOP/s and of link bandwidth, and the
  latency of one collective step), each with where it comes from: either a stated assumption of
  the catalog or a measurement written by `fivefold calibrate` on the machine it ran on;
- on a CPU, what `fivefold calibrate` measured beyond those: the fixed cost of an op, of a view, of
  Python's module calls, autograd Functions, hooks and bookkeeping, the optimizer step, matmul and
  elementwise rate curves and a latency per collective (zero or empty on the catalog's GPUs), and
  optionally the model's own layers timed whole at the shapes of given configs (layer_times).

Factors are never fitted to published training runs: a planner tuned to reproduce Llama 3's MFU
would only tell us what we told it. Bandwidths are per GPU and per direction (what one rank can
send while it also receives), in bytes/s; GB means 10^9 bytes everywhere in the planner.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

GB = 1e9  # the planner's GB is 10^9 bytes, as in the course texts (003_*: "GB = 10^9 bytes")
TERA = 1e12


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the node it sits in."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s of one GPU (no structured sparsity)
    memory_bytes: float  # device memory of one GPU
    hbm_bw: float  # device memory bandwidth, bytes/s (the optimizer step is bound by it)
    intra_bw: float  # per GPU, per direction, inside a node (NVLink / Infinity Fabric), bytes/s
    inter_bw: float  # per GPU, per direction, across nodes (InfiniBand / RoCE NIC), bytes/s
    pcie_bw: float  # per GPU, per direction, host link, bytes/s (reported, not used for collectives)
    gpus_per_node: int
    compute_efficiency: float = 0.6  # achievable fraction of peak_flops on the model's matmuls
    bw_efficiency: float = 0.8  # achievable fraction of a link's bandwidth for a large collective
    intra_latency: float = 5e-6  # seconds per collective step inside a node (alpha of alpha-beta)
    inter_latency: float = 10e-6  # seconds per collective step across nodes
    # Measured by `fivefold calibrate` on a CPU (0 / empty on the catalog's GPUs, where kernels queue
    # asynchronously behind the launch and a step is priced by FLOPs and bytes alone):
    threads: int = 0  # compute threads per rank the measurements ran with (training workers' count)
    op_overhead_s: float = 0.0  # fixed cost of one dispatched aten op, forward or backward (autograd included)
    view_overhead_s: float = 0.0  # the same for a view (view, t, transpose, detach: no data moved)
    matmul_curve: tuple[tuple[float, float], ...] = ()  # (FLOPs of one matmul, FLOP/s achieved), by size
    elementwise_curve: tuple[tuple[float, float], ...] = ()  # (bytes an op reads + writes, bytes/s beyond the overhead)
    optimizer_s_per_tensor: float = 0.0  # AdamW + gradient clipping + zero_grad, per parameter tensor
    optimizer_s_per_element: float = 0.0  # the same, per parameter element
    # Python's share of a step, measured the same way (priced by overheads.py from counts of the layout):
    module_call_s: float = 0.0  # one nn.Module call (forward), beyond the ops it runs
    function_s: float = 0.0  # one custom autograd.Function (its Python forward and backward), beyond its ops
    hook_s: float = 0.0  # one Python hook on a gradient (data parallel's, per parameter and backward)
    tensor_query_s: float = 0.0  # the loop's model-state sampling, per parameter (gradient, optimizer state)
    thread_s: float = 0.0  # one helper thread started and joined (the pipeline's send thread, once a step)
    collective_alpha: tuple[tuple[str, float], ...] = ()  # (op, latency per ring step) when measured per op
    # `fivefold calibrate --layers`: the model's own parts timed whole at the shapes a config's ranks
    # run (opcount.Part.key, forward s, backward s); the planner uses them instead of their op prices
    layer_times: tuple[tuple[str, float, float], ...] = ()
    # (seconds of compute since the ranks last synchronised, noise scale sigma): a collective after
    # d seconds waits expected_max_normal(n) x sigma(d) for the slowest of its n ranks (calibrate_sync.py)
    noise_curve: tuple[tuple[float, float], ...] = ()
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # field -> where it comes from

    def layer_time(self, key: str) -> tuple[float, float] | None:
        """(forward s, backward s) of the part named `key` (opcount.Part.key), if it was timed."""
        return next(((f, b) for k, f, b in self.layer_times if k == key), None)


# The catalog's efficiency factors are not measurements: they are round numbers stated as
# assumptions, to be replaced by a profile from `fivefold calibrate` on the real machine.
_ASSUMED = {
    "compute_efficiency": "assumption (round figure, not a measurement); run `fivefold calibrate`",
    "bw_efficiency": "assumption (round figure, not a measurement); run `fivefold calibrate`",
    "intra_latency": "assumption (order of a small-message NVLink step); run `fivefold calibrate`",
    "inter_latency": "assumption (order of a small-message InfiniBand step); run `fivefold calibrate`",
}


def _hw(name: str, sheet: str, network: str, **numbers: float) -> Hardware:
    sources = {k: sheet for k in ("peak_flops", "memory_bytes", "hbm_bw", "intra_bw", "pcie_bw", "gpus_per_node")}
    sources["inter_bw"] = network
    return Hardware(name=name, sources={**sources, **_ASSUMED}, **numbers)  # type: ignore[arg-type]


# Link figures: vendors quote NVLink as bidirectional totals (A100: 600 GB/s, H100/H200: 900 GB/s,
# B200: 1.8 TB/s); one direction is half. NIC figures are line rates in Gb/s: 200 Gb/s HDR = 25 GB/s,
# 400 Gb/s NDR = 50 GB/s per GPU (one NIC per GPU in the reference DGX/HGX nodes).
CATALOG: dict[str, Hardware] = {
    "a100-40gb": _hw(
        "a100-40gb", "NVIDIA A100 Tensor Core GPU data sheet (SXM4 40GB): 312 TFLOPS bf16, 1,555 GB/s HBM2, "
        "NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions)",
        "NVIDIA DGX A100 data sheet: 8x 200 Gb/s HDR InfiniBand, one per GPU",
        peak_flops=312 * TERA, memory_bytes=40 * GB, hbm_bw=1555 * GB, intra_bw=300 * GB, inter_bw=25 * GB,
        pcie_bw=32 * GB, gpus_per_node=8),
    "a100-80gb": _hw(
        "a100-80gb", "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): 312 TFLOPS bf16, 2,039 GB/s HBM2e, "
        "NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions)",
        "NVIDIA DGX A100 data sheet: 8x 200 Gb/s HDR InfiniBand, one per GPU",
        peak_flops=312 * TERA, memory_bytes=80 * GB, hbm_bw=2039 * GB, intra_bw=300 * GB, inter_bw=25 * GB,
        pcie_bw=32 * GB, gpus_per_node=8),
    "h100": _hw(
        "h100", "NVIDIA H100 Tensor Core GPU data sheet (SXM5): 989 TFLOPS bf16 dense (1,979 with sparsity), "
        "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)",
        "NVIDIA DGX H100 data sheet: 8x 400 Gb/s ConnectX-7 (NDR), one per GPU",
        peak_flops=989 * TERA, memory_bytes=80 * GB, hbm_bw=3350 * GB, intra_bw=450 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8),
    "h200": _hw(
        "h200", "NVIDIA H200 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16 dense, 141 GB HBM3e at 4.8 TB/s, "
        "NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions)",
        "NVIDIA DGX H200 data sheet: 8x 400 Gb/s ConnectX-7 (NDR), one per GPU",
        peak_flops=989 * TERA, memory_bytes=141 * GB, hbm_bw=4800 * GB, intra_bw=450 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8),
    "b200": _hw(
        "b200", "NVIDIA DGX B200 data sheet: 72 PFLOPS FP8 training for 8 GPUs, i.e. 2.25 PFLOPS bf16 dense per "
        "GPU (half of FP8), 1,440 GB HBM3e (180 GB per GPU) at 64 TB/s (8 TB/s per GPU), NVLink 5 1.8 TB/s",
        "NVIDIA DGX B200 data sheet: 8x 400 Gb/s ConnectX-7, one per GPU",
        peak_flops=2250 * TERA, memory_bytes=180 * GB, hbm_bw=8000 * GB, intra_bw=900 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8),
    "mi300x": _hw(
        "mi300x", "AMD Instinct MI300X data sheet: 1,307.4 TFLOPS bf16 dense, 192 GB HBM3 at 5.3 TB/s, "
        "7 Infinity Fabric links of 64 GB/s per direction to the 7 peers of an 8-GPU platform (448 GB/s), "
        "PCIe Gen5 x16",
        "AMD Instinct MI300X platform: one 400 Gb/s NIC per GPU in the reference 8-GPU nodes",
        peak_flops=1307.4 * TERA, memory_bytes=192 * GB, hbm_bw=5300 * GB, intra_bw=448 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8),
}
ALIASES = {"a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100-sxm": "h100",
           "h200-sxm": "h200"}


def get_hardware(name: str) -> Hardware:
    """A catalog entry by name ("h100", "a100-80gb", ...)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG:
        raise ValueError(f"unknown GPU '{name}'; the catalog has {', '.join(CATALOG)} (or give --hardware FILE.toml)")
    return CATALOG[key]


# ---- profiles: the same fields in TOML, with a [sources] table -------------------------------------
_FIELDS = [f.name for f in dataclasses.fields(Hardware) if f.name not in ("name", "sources")]
_MEASURED_ONLY = {"threads", "op_overhead_s", "view_overhead_s", "matmul_curve", "elementwise_curve",
                  "optimizer_s_per_tensor", "optimizer_s_per_element", "module_call_s", "function_s", "hook_s",
                  "tensor_query_s", "thread_s", "collective_alpha", "layer_times",
                  "noise_curve"}  # optional: absent on a GPU profile
_CURVES = ("matmul_curve", "elementwise_curve", "noise_curve")
_BY_OP = ("collective_alpha",)  # [[op, value], ...]


def load_profile(path: str | Path) -> Hardware:
    """A hardware profile written by `fivefold calibrate` (or by hand): [hardware] + [sources]."""
    data = tomllib.loads(Path(path).read_text())
    hw = dict(data.get("hardware", {}))
    base = hw.pop("base", "")  # a profile may start from a catalog entry and override some fields
    unknown = sorted(set(hw) - set(_FIELDS) - {"name"})
    if unknown:
        raise ValueError(f"{path}: unknown hardware keys {unknown}; valid: {_FIELDS}")
    sources = dict(data.get("sources", {}))
    for k in _CURVES:
        if k in hw:
            hw[k] = tuple((float(x), float(y)) for x, y in hw[k])
    for k in _BY_OP:
        if k in hw:
            hw[k] = tuple((str(op), float(y)) for op, y in hw[k])
    if "layer_times" in hw:
        hw["layer_times"] = tuple((str(k), float(f), float(b)) for k, f, b in hw["layer_times"])
    if base:
        start = get_hardware(base)
        return dataclasses.replace(start, **hw, sources={**start.sources, **sources})
    missing = [f for f in _FIELDS if f not in hw and f not in _ASSUMED and f not in _MEASURED_ONLY]
    if missing:
        raise ValueError(f"{path}: missing hardware keys {missing} (or set base = 'h100' to start from the catalog)")
    return Hardware(**{"name": Path(path).stem, **hw, "sources": sources})


def profile_toml(hw: Hardware) -> str:
    """`hw` as a profile TOML that load_profile() reads back unchanged."""
    lines = ["[hardware]", f'name = "{hw.name}"']
    for f in _FIELDS:
        value = getattr(hw, f)
        if f in _CURVES:
            lines.append(f"{f} = [{', '.join(f'[{float(x)!r}, {float(y)!r}]' for x, y in value)}]")
        elif f in _BY_OP:
            pairs = ", ".join(f'["{op}", {float(y)!r}]' for op, y in value)
            lines.append(f"{f} = [{pairs}]")
        elif f == "layer_times":  # one part a line: the keys are long
            rows = "".join(f'\n  ["{k}", {float(fw)!r}, {float(bw)!r}],' for k, fw, bw in value)
            lines.append(f"{f} = [{rows}\n]" if value else f"{f} = []")
        else:
            lines.append(f"{f} = {int(value) if f in ('gpus_per_node', 'threads') else float(value)!r}")
    lines += ["", "[sources]"]
    for k, v in sorted(hw.sources.items()):
        lines.append(f'{k} = "{v.replace(chr(34), chr(39))}"')
    return "\n".join(lines) + "\n"
