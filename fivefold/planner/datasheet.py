"""Hardware as the planner's core sees it: data-sheet figures, stated efficiencies, and a compute pricer.

A `Hardware` holds two kinds of numbers, and keeps them apart on purpose:

- vendor figures (peak dense bf16 FLOP/s, memory, link bandwidths, GPUs per node), each with the
  data sheet it comes from;
- efficiency factors (the achievable fraction of peak FLOP/s and of link bandwidth, and the
  latency of one collective step, optionally per collective), each with where it comes from:
  either a stated assumption of the catalog or a measurement by `fivefold calibrate`.

Its `pricer` turns the work of a step into seconds (ComputePricer). The default prices from the
figures above, the textbook way: compute at FLOPs / (peak x efficiency), the optimizer step
memory-bound, no host overhead and no noise. A profile measured by `fivefold calibrate` on a CPU
carries a pricer of its own (calibration/pricer.py), built from what it measured.

Factors are never fitted to published training runs: a planner tuned to reproduce Llama 3's MFU
would only tell us what we told it. Bandwidths are per GPU and per direction (what one rank can
send while it also receives), in bytes/s; GB means 10^9 bytes everywhere in the planner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from fivefold.planner.memory import BytesPerParam
from fivefold.planner.pricing import ChunkPrice, ChunkWork, HostPrice, HostWork, Memo, Priced

GB = 1e9  # the planner's GB is 10^9 bytes (decimal, as vendors quote memory and bandwidth)
TERA = 1e12


class ComputePricer(Protocol):
    """How a hardware prices the work the estimate counts (pricing.py has the work and price types)."""

    def chunk(self, work: ChunkWork, hw: Hardware, memo: Memo) -> ChunkPrice:
        """Forward and backward seconds of one micro-batch through one chunk of the busiest rank."""
        ...

    def host(self, work: HostWork, chunk: ChunkPrice, hw: Hardware) -> HostPrice:
        """Python's seconds around the kernels; `chunk` is what chunk() returned for this step."""
        ...

    def optimizer(self, shard_params: float, b: BytesPerParam, chunk: ChunkPrice, hw: Hardware) -> Priced:
        """One optimizer step over `shard_params` parameters (this rank's ZeRO shard)."""
        ...

    def noise_wait(self, n: int, compute_s: float, memo: Memo) -> float:
        """Seconds one collective of n ranks waits for the slowest after compute_s of compute."""
        ...

    def for_search(self) -> ComputePricer:
        """This pricer as a search uses it: one pricing that holds alike for every candidate layout."""
        ...


@dataclass(frozen=True)
class DatasheetPricer:
    """Prices from data-sheet figures: FLOPs at peak x compute_efficiency, the optimizer at HBM speed."""

    def chunk(self, work: ChunkWork, hw: Hardware, memo: Memo) -> ChunkPrice:
        """Backward = 2 x forward (two matmuls per forward one: input and weight gradients); full
        recompute runs the forward again, selective only the attention core's (Korthikanti et al. 2022)."""
        eff_flops = hw.peak_flops * hw.compute_efficiency
        chunks, recompute_mode = work.chunks, work.cfg.train.recompute
        forward = work.forward_flops / chunks / eff_flops
        recompute = {"none": 0.0, "full": forward,
                     "selective": work.attention_forward_flops / chunks / eff_flops}[recompute_mode]
        row = ("forward per chunk", f"{work.forward_flops / chunks:.3e} FLOP / ({hw.peak_flops:.3e} x "
               f"{hw.compute_efficiency}) = {forward * 1e3:.3f} ms; backward 2x + recompute {recompute * 1e3:.3f} ms",
               "6N + causal attention (Kaplan 2020; PaLM App. B halved for the mask); recompute: Korthikanti 2022")
        return ChunkPrice(forward, 2 * forward + recompute, [row])

    def host(self, work: HostWork, chunk: ChunkPrice, hw: Hardware) -> HostPrice:
        """Nothing: on a GPU kernels queue asynchronously behind the Python that launches them."""
        return HostPrice()

    def optimizer(self, shard_params: float, b: BytesPerParam, chunk: ChunkPrice, hw: Hardware) -> Priced:
        """Memory-bound: AdamW reads and writes about b_p + b_g + 2 b_o bytes per parameter of its shard."""
        return Priced(shard_params * (b.param + b.grad + 2 * b.optimizer) / hw.hbm_bw)

    def noise_wait(self, n: int, compute_s: float, memo: Memo) -> float:
        """None assumed: a data sheet says nothing about a machine's noise."""
        return 0.0

    def for_search(self) -> DatasheetPricer:
        return self


DATASHEET = DatasheetPricer()  # stateless: one instance serves every Hardware


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the node it sits in."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s of one GPU (no structured sparsity)
    memory_bytes: float  # device memory of one GPU
    hbm_bw: float  # device memory bandwidth, bytes/s (the optimizer step is bound by it)
    intra_bw: float  # per GPU, per direction, inside a node (NVLink / Infinity Fabric), bytes/s
    inter_bw: float  # per GPU, per direction, across nodes (InfiniBand / RoCE NIC), bytes/s
    pcie_bw: float  # per GPU, per direction, host link, bytes/s (offload's copies; no collective uses it)
    gpus_per_node: int
    compute_efficiency: float = 0.6  # achievable fraction of peak_flops on the model's matmuls
    bw_efficiency: float = 0.8  # achievable fraction of a link's bandwidth for a large collective
    intra_latency: float = 5e-6  # seconds per collective step inside a node (alpha of alpha-beta)
    inter_latency: float = 10e-6  # seconds per collective step across nodes
    # (op, latency per ring step) where measured per collective (on gloo the fixed costs per step of
    # an all-reduce and a send differ by a factor of two or more); empty: one alpha per link serves all
    collective_alpha: tuple[tuple[str, float], ...] = ()
    # the host, for offload (offload.py): this GPU's share of its node's DRAM bandwidth (bytes/s; the
    # CPU optimizer step is bound by it) and the node's host memory (bytes); 0: unknown
    host_bw: float = 0.0
    host_memory_bytes: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # field -> where it comes from
    pricer: ComputePricer = DATASHEET  # how compute is priced (a measured profile's own, if any)


# The catalog's efficiency factors are not measurements: they are round numbers stated as
# assumptions, to be replaced by a profile from `fivefold calibrate` on the real machine.
ASSUMED = {
    "compute_efficiency": "assumption (round figure, not a measurement); run `fivefold calibrate`",
    "bw_efficiency": "assumption (round figure, not a measurement); run `fivefold calibrate`",
    "intra_latency": "assumption (order of a small-message NVLink step); run `fivefold calibrate`",
    "inter_latency": "assumption (order of a small-message InfiniBand step); run `fivefold calibrate`",
}


def _hw(name: str, sheet: str, network: str, **numbers: float) -> Hardware:
    sources = {k: sheet for k in ("peak_flops", "memory_bytes", "hbm_bw", "intra_bw", "pcie_bw", "gpus_per_node")}
    sources["inter_bw"] = network
    return Hardware(name=name, sources={**sources, **ASSUMED}, **numbers)  # type: ignore[arg-type]


# Link figures: vendors quote NVLink as bidirectional totals (A100: 600 GB/s, H100/H200: 900 GB/s,
# B200: 1.8 TB/s); one direction is half. NIC figures are line rates in Gb/s: 200 Gb/s HDR = 25 GB/s,
# 400 Gb/s NDR = 50 GB/s per GPU (one NIC per GPU in the reference DGX/HGX nodes).
_DEVICES: dict[str, Hardware] = {
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
# The host side of the same reference nodes (DRAM peak = channels x MT/s x 8 bytes per socket, x 2
# sockets, shared by the node's 8 GPUs): (host_bw per GPU, host memory per node, source).
_HOSTS = {
    "a100-40gb": (51.2 * GB, 1000 * GB, "NVIDIA DGX A100 data sheet (320GB system): 2x AMD EPYC 7742, 1 TB; AMD "
                  "EPYC 7742: 8 channels DDR4-3200 = 204.8 GB/s per socket; 409.6 GB/s / 8 GPUs"),
    "a100-80gb": (51.2 * GB, 2000 * GB, "NVIDIA DGX A100 data sheet (640GB system): 2x AMD EPYC 7742, 2 TB; AMD "
                  "EPYC 7742: 8 channels DDR4-3200 = 204.8 GB/s per socket; 409.6 GB/s / 8 GPUs"),
    "h100": (76.8 * GB, 2000 * GB, "NVIDIA DGX H100 data sheet: 2x Intel Xeon Platinum 8480C, 2 TB; Intel Xeon "
             "Platinum 8480+: 8 channels DDR5-4800 = 307.2 GB/s per socket; 614.4 GB/s / 8 GPUs"),
    "h200": (76.8 * GB, 2000 * GB, "NVIDIA DGX H200 data sheet: 2x Intel Xeon Platinum 8480C, 2 TB; Intel Xeon "
             "Platinum 8480+: 8 channels DDR5-4800 = 307.2 GB/s per socket; 614.4 GB/s / 8 GPUs"),
    "b200": (89.6 * GB, 2000 * GB, "NVIDIA DGX B200 data sheet: 2x Intel Xeon Platinum 8570, 2 TB (up to 4 TB); "
             "Intel Xeon Platinum 8570: 8 channels DDR5-5600 = 358.4 GB/s per socket; 716.8 GB/s / 8 GPUs"),
    "mi300x": (115.2 * GB, 2000 * GB, "assumption: a 2-socket AMD EPYC 9004 host with 2 TB, as AMD's MI300X "
               "platform partners ship (12 channels DDR5-4800 = 460.8 GB/s per socket; 921.6 GB/s / 8 GPUs)"),
}
CATALOG: dict[str, Hardware] = {
    name: dataclasses.replace(hw, host_bw=_HOSTS[name][0], host_memory_bytes=_HOSTS[name][1],
                              sources={**hw.sources, "host_bw": _HOSTS[name][2], "host_memory_bytes": _HOSTS[name][2]})
    for name, hw in _DEVICES.items()}
ALIASES = {"a100": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "h100-sxm": "h100",
           "h200-sxm": "h200"}


def get_hardware(name: str) -> Hardware:
    """A catalog entry by name ("h100", "a100-80gb", ...)."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in CATALOG:
        raise ValueError(f"unknown GPU '{name}'; the catalog has {', '.join(CATALOG)} (or give --hardware FILE.toml)")
    return CATALOG[key]
