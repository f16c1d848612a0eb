"""Hardware as the planner's core sees it: data-sheet figures, published kernel measurements, stated
efficiencies, and a compute pricer.

A `Hardware` holds three kinds of numbers, and keeps them apart on purpose:

- vendor figures (peak dense bf16 and FP8 FLOP/s, memory, link bandwidths, SMs, GPUs per node),
  each with the data sheet it comes from;
- published kernel measurements the roofline prices a catalog GPU's ops with (roofline.py): the
  large-GEMM fraction of peak a matmul reaches (bf16 and FP8), the attention kernel's fraction by
  sequence length (the kernel torch's SDPA runs there, and FlashAttention-2's where that is another),
  each with the measurement it comes from;
- efficiency factors (the achievable fraction of HBM and of link bandwidth, the latency of one
  collective step, optionally per collective; the flat fraction of peak FLOP/s for hardware
  without a roofline), each with where it comes from: either a stated assumption of the catalog or
  a measurement by `fivefold calibrate`.

Its `pricer` turns the work of a step into seconds (ComputePricer). The default prices a GPU with
an SM count by the roofline of each op (roofline.py: tile and wave quantised matmuls, the
attention kernel's measured fraction, memory-bound elementwise ops), other hardware at FLOPs /
(peak x compute_efficiency); the optimizer step memory-bound, no host overhead and no noise. A
profile measured by `fivefold calibrate` on a CPU carries a pricer of its own
(calibration/pricer.py), built from what it measured.

Factors are never fitted to published training runs: a planner tuned to reproduce Llama 3's MFU
would only tell us what we told it. Bandwidths are per GPU and per direction (what one rank can
send while it also receives), in bytes/s; GB means 10^9 bytes everywhere in the planner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from fivefold.planner.machine import roofline
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, HostPrice, HostWork, Memo, Priced
from fivefold.planner.memory import BytesPerParam

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
    """Prices from data-sheet figures and published kernel measurements: a GPU with an SM count by the
    roofline of each op (roofline.py), other hardware at FLOPs / (peak x compute_efficiency); the
    optimizer at HBM speed."""

    def chunk(self, work: ChunkWork, hw: Hardware, memo: Memo) -> ChunkPrice:
        """The roofline's price (roofline.chunk_price) where the hardware has one, else flat: backward
        = 2 x forward (two matmuls per forward one: input and weight gradients); full recompute runs
        the forward again, selective only the attention core's (Korthikanti et al. 2022)."""
        if hw.sm_count:
            return roofline.chunk_price(work, hw, memo)
        eff_flops = hw.peak_flops * hw.compute_efficiency
        chunks, recompute_mode = work.chunks, work.cfg.train.recompute
        forward = work.forward_flops / chunks / eff_flops
        recompute = {"none": 0.0, "full": forward,
                     "selective": work.attention_forward_flops / chunks / eff_flops}[recompute_mode]
        recompute += work.loss_recompute_flops / chunks / eff_flops  # the loss's backward makes the logits again
        row = ("forward per chunk", f"{work.forward_flops / chunks:.3e} FLOP / ({hw.peak_flops:.3e} x "
               f"{hw.compute_efficiency}) = {forward * 1e3:.3f} ms; backward 2x + recompute {recompute * 1e3:.3f} ms",
               "6N + the attention the mask keeps (Kaplan 2020; PaLM App. B halved for the causal mask; windows "
               "and documents: model/mask_counts.py); recompute: Korthikanti 2022")
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
    compute_efficiency: float = 0.6  # flat fraction of peak_flops on every FLOP, where there is no roofline
    bw_efficiency: float = 0.8  # achievable fraction of a link's bandwidth for a large collective
    intra_latency: float = 5e-6  # seconds per collective step inside a node (alpha of alpha-beta)
    inter_latency: float = 10e-6  # seconds per collective step across nodes
    # (op, latency per ring step) where measured per collective (on gloo the fixed costs per step of
    # an all-reduce and a send differ by a factor of two or more); empty: one alpha per link serves all
    collective_alpha: tuple[tuple[str, float], ...] = ()
    # The roofline (roofline.py), for a GPU with sm_count > 0; hardware without one is priced flat:
    sm_count: int = 0  # streaming multiprocessors (compute units): one matmul tile each per wave
    matmul_tiles: tuple[tuple[int, int], ...] = ((128, 128), (128, 256), (256, 128))  # output tiles cuBLAS picks among
    matmul_efficiency: float = 0.0  # fraction of peak_flops a large bf16 GEMM reaches (measured)
    fp8_peak_flops: float = 0.0  # dense FP8 FLOP/s (0: no FP8 tensor cores)
    fp8_matmul_efficiency: float = 0.0  # fraction of fp8_peak_flops a large FP8 GEMM reaches (measured)
    # (sequence length, fraction of peak): the causal forward of the kernel torch's SDPA runs here (fivefold's)
    attention_fwd_curve: tuple[tuple[float, float], ...] = ()
    attention_bwd_curve: tuple[tuple[float, float], ...] = ()  # the same for its backward
    # FlashAttention-2's, where SDPA runs another kernel (a published run's: PlanOptions.attention_kernel = "fa2");
    # empty: SDPA's kernel is FA2 here, the attention curves serve
    fa2_fwd_curve: tuple[tuple[float, float], ...] = ()
    fa2_bwd_curve: tuple[tuple[float, float], ...] = ()
    hbm_efficiency: float = 0.0  # achievable fraction of hbm_bw for a streaming kernel
    comm_sms: int = 0  # SMs a collective takes from the compute it runs beside (overlap.contention; 0: none)
    # the host, for offload (offload.py): this GPU's share of its node's DRAM bandwidth (bytes/s; the
    # CPU optimizer step is bound by it) and the node's host memory (bytes); 0: unknown
    host_bw: float = 0.0
    host_memory_bytes: float = 0.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)  # field -> where it comes from
    pricer: ComputePricer = DATASHEET  # how compute is priced (a measured profile's own, if any)


# The catalog's efficiency factors that are not measurements: round numbers stated as
# assumptions, to be replaced by a profile from `fivefold calibrate` on the real machine.
ASSUMED = {
    "compute_efficiency": "not used for a catalog GPU (the roofline prices its ops, roofline.py); the flat "
                          "fraction prices hardware without an SM count",
    "bw_efficiency": "assumption (round figure, not a measurement); run `fivefold calibrate`",
    "intra_latency": "assumption (order of a small-message NVLink step); run `fivefold calibrate`",
    "inter_latency": "assumption (order of a small-message InfiniBand step); run `fivefold calibrate`",
    "hbm_efficiency": "assumption: 90% of the data-sheet bandwidth for a streaming kernel, the fraction STREAM-like "
                      "copy and triad kernels (McCalpin 1995) reach on HBM GPUs; round figure, not a measurement",
    "matmul_tiles": "NVIDIA Matrix Multiplication Background User's Guide, sec. 2.3: cuBLAS's larger tiles "
                    "(256x128, 128x256, 128x128) are its most efficient",
}

# Large-GEMM fractions of peak: the Maximum Achievable Matmul FLOPS table (torch.matmul, the best shape
# of a sweep, mean of 100 iterations after 50 warm-up; bf16 and float8_e4m3fn, no sparsity).
MAMF = ("measured: stas00/ml-engineering, compute/accelerator/README.md, 'Maximum Achievable Matmul FLOPS "
        "comparison table'")
# Attention kernels on H100 SXM5, bf16, head dim 128, TFLOP/s by sequence length (batch x seq = 16k
# tokens): Shah et al. 2024, "FlashAttention-3", fig. 5 (forward, causal mask) and fig. 6 (backward),
# counted as roofline.py counts them (the causal mask halves the FLOPs; backward 2.5 x the forward's).
# torch's SDPA runs cuDNN's kernel on sm90 and sm100 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp,
# check_prefer_cudnn_attention: cuDNN first once the bundled cuDNN is past 9.15, torch 2.11 on), as
# Transformer Engine does on Hopper (get_attention_backend: "Disabling FlashAttention to give FusedAttention
# preference on Hopper+"); FlashAttention-2 is SDPA's flash backend, what torch ran there before.
_FA2_H100_FWD = ((512, 191), (1024, 260), (2048, 298), (4096, 319), (8192, 333), (16384, 335))
_FA2_H100_BWD = ((512, 214), (1024, 260), (2048, 291), (4096, 310), (8192, 318), (16384, 322))
_CUDNN_H100_FWD = ((512, 315), (1024, 410), (2048, 484), (4096, 518), (8192, 529), (16384, 539))
_CUDNN_H100_BWD = ((512, 305), (1024, 408), (2048, 465), (4096, 499), (8192, 518), (16384, 516))
FA3_PAPER = ("measured: Shah et al. 2024, FlashAttention-3, figs. 5-6: H100 SXM5, bf16, head dim 128, of 989 "
             "TFLOP/s, sequences 512-16k")
FA2_SOURCE = (f"{FA3_PAPER}: FlashAttention-2, forward with causal mask 191-335 and backward 214-322 TFLOP/s "
              "(SDPA's flash backend)")
CUDNN_SOURCE = (f"{FA3_PAPER}: cuDNN, forward with causal mask 315-539 and backward 305-518 TFLOP/s (the kernel "
                "torch's SDPA prefers on sm90/sm100 from torch 2.11, sdp_utils.cpp check_prefer_cudnn_attention)")


def _curve(points: tuple[tuple[int, int], ...], peak_tflops: float = 989.0) -> tuple[tuple[float, float], ...]:
    return tuple((float(s), t / peak_tflops) for s, t in points)


H100_FA2 = {"fa2_fwd_curve": _curve(_FA2_H100_FWD), "fa2_bwd_curve": _curve(_FA2_H100_BWD)}
H100_CUDNN = {"attention_fwd_curve": _curve(_CUDNN_H100_FWD), "attention_bwd_curve": _curve(_CUDNN_H100_BWD)}


def _hw(name: str, sheet: str, network: str, measured: dict[str, str], **numbers) -> Hardware:
    sources = {k: sheet for k in ("peak_flops", "memory_bytes", "hbm_bw", "intra_bw", "pcie_bw", "gpus_per_node",
                                  "sm_count", "fp8_peak_flops")}
    sources["inter_bw"] = network
    return Hardware(name=name, sources={**sources, **ASSUMED, **measured}, **numbers)


# SMs a collective runs on beside the compute it is hidden under (overlap.contention)
COMM_SMS = ("DeepSeek-AI 2024, DeepSeek-V3 report, sec. 3.2.2 (\"only 20 SMs are sufficient to fully utilize the "
            "bandwidths of IB and NVLink\") and 3.5.1 (20 of the H800's 132 SMs, which \"limits computational "
            "throughput\")")
COMM_SMS_ASSUMED = "assumption: the 20 SMs of the H800 (Hopper), not measured on this GPU; " + COMM_SMS
_A100_MEASURED = {
    "matmul_efficiency": f"{MAMF}: A100 SXM 271.2 of 312 TFLOPS bf16 (86.9%)",
    "fp8_matmul_efficiency": "none: the A100 has no FP8 tensor cores",
    "attention_fwd_curve": "Dao 2023, FlashAttention-2, abstract: FA2's forward reaches 50-73% of the A100's peak; "
                           "the low end, flat (no curve by sequence length in the text); backward assumed alike",
    "attention_bwd_curve": "as attention_fwd_curve (assumption: the paper states no separate backward range)",
    "comm_sms": COMM_SMS_ASSUMED,
}
_A100 = dict(sm_count=108, matmul_efficiency=271.2 / 312, attention_fwd_curve=((1.0, 0.5),),
             attention_bwd_curve=((1.0, 0.5),), hbm_efficiency=0.9, comm_sms=20)
_HOPPER = dict(sm_count=132, matmul_efficiency=794.5 / 989, fp8_peak_flops=1979 * TERA, hbm_efficiency=0.9,
               comm_sms=20, **H100_CUDNN, **H100_FA2)
_OTHER_FA2 = ("assumption: the H100's FlashAttention-2 fractions of peak (no published FA2 curve on this GPU); "
              + FA2_SOURCE)
_OTHER_CUDNN = ("assumption: the H100's cuDNN fractions of peak (no published curve on this GPU; SDPA prefers cuDNN "
                "on sm100 too); " + CUDNN_SOURCE)
_HOPPER_ATTENTION = {"attention_fwd_curve": CUDNN_SOURCE, "attention_bwd_curve": CUDNN_SOURCE,
                     "fa2_fwd_curve": FA2_SOURCE, "fa2_bwd_curve": FA2_SOURCE}

# Link figures: vendors quote NVLink as bidirectional totals (A100: 600 GB/s, H100/H200: 900 GB/s,
# B200: 1.8 TB/s); one direction is half. NIC figures are line rates in Gb/s: 200 Gb/s HDR = 25 GB/s,
# 400 Gb/s NDR = 50 GB/s per GPU (one NIC per GPU in the reference DGX/HGX nodes).
_DEVICES: dict[str, Hardware] = {
    "a100-40gb": _hw(
        "a100-40gb", "NVIDIA A100 Tensor Core GPU data sheet (SXM4 40GB): 312 TFLOPS bf16, 1,555 GB/s HBM2, "
        "NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions), no FP8; A100 architecture whitepaper: 108 SMs",
        "NVIDIA DGX A100 data sheet: 8x 200 Gb/s HDR InfiniBand, one per GPU", _A100_MEASURED,
        peak_flops=312 * TERA, memory_bytes=40 * GB, hbm_bw=1555 * GB, intra_bw=300 * GB, inter_bw=25 * GB,
        pcie_bw=32 * GB, gpus_per_node=8, **_A100),
    "a100-80gb": _hw(
        "a100-80gb", "NVIDIA A100 Tensor Core GPU data sheet (SXM4 80GB): 312 TFLOPS bf16, 2,039 GB/s HBM2e, "
        "NVLink 600 GB/s, PCIe Gen4 64 GB/s (both directions), no FP8; A100 architecture whitepaper: 108 SMs",
        "NVIDIA DGX A100 data sheet: 8x 200 Gb/s HDR InfiniBand, one per GPU", _A100_MEASURED,
        peak_flops=312 * TERA, memory_bytes=80 * GB, hbm_bw=2039 * GB, intra_bw=300 * GB, inter_bw=25 * GB,
        pcie_bw=32 * GB, gpus_per_node=8, **_A100),
    "h100": _hw(
        "h100", "NVIDIA H100 Tensor Core GPU data sheet (SXM5): 989 TFLOPS bf16 dense (1,979 with sparsity), FP8 "
        "1,979 dense (3,958 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both "
        "directions); H100 architecture whitepaper: 132 SMs (SXM5)",
        "NVIDIA DGX H100 data sheet: 8x 400 Gb/s ConnectX-7 (NDR), one per GPU",
        {"matmul_efficiency": f"{MAMF}: H100 SXM 794.5 of 989 TFLOPS bf16 (80.3%)",
         "fp8_matmul_efficiency": f"{MAMF}: H100 SXM 1402.6 of 1979 TFLOPS FP8 (70.9%)",
         **_HOPPER_ATTENTION, "comm_sms": COMM_SMS},
        peak_flops=989 * TERA, memory_bytes=80 * GB, hbm_bw=3350 * GB, intra_bw=450 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8, fp8_matmul_efficiency=1402.6 / 1979, **_HOPPER),
    "h200": _hw(
        "h200", "NVIDIA H200 Tensor Core GPU data sheet (SXM): 989 TFLOPS bf16 dense, FP8 1,979 dense (3,958 with "
        "sparsity), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s (both directions); the H100's "
        "GH100 die: 132 SMs",
        "NVIDIA DGX H200 data sheet: 8x 400 Gb/s ConnectX-7 (NDR), one per GPU",
        {"matmul_efficiency": f"{MAMF}: H100 SXM 794.5 of 989 TFLOPS bf16 (80.3%; 'H200 is the same')",
         "fp8_matmul_efficiency": f"{MAMF}: H200 SXM 1453.4 of 1979 TFLOPS FP8 (73.4%)",
         **{k: "the H100's (same die and clocks): " + v for k, v in _HOPPER_ATTENTION.items()},
         "comm_sms": COMM_SMS},
        peak_flops=989 * TERA, memory_bytes=141 * GB, hbm_bw=4800 * GB, intra_bw=450 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8, fp8_matmul_efficiency=1453.4 / 1979, **_HOPPER),
    "b200": _hw(
        "b200", "NVIDIA DGX B200 data sheet: 72 PFLOPS FP8 training for 8 GPUs with sparsity, i.e. 4.5 PFLOPS FP8 "
        "and 2.25 PFLOPS bf16 dense per GPU, 1,440 GB HBM3e (180 GB per GPU) at 64 TB/s (8 TB/s per GPU), "
        "NVLink 5 1.8 TB/s; Blackwell architecture: 148 SMs",
        "NVIDIA DGX B200 data sheet: 8x 400 Gb/s ConnectX-7, one per GPU",
        {"matmul_efficiency": f"{MAMF}: B200 SXM 1745.0 of 2250 TFLOPS bf16 (77.6%)",
         "fp8_matmul_efficiency": f"{MAMF}: B200 SXM 3432.5 of 4500 TFLOPS FP8 (76.3%)",
         "attention_fwd_curve": _OTHER_CUDNN, "attention_bwd_curve": _OTHER_CUDNN, "fa2_fwd_curve": _OTHER_FA2,
         "fa2_bwd_curve": _OTHER_FA2, "comm_sms": COMM_SMS_ASSUMED},
        peak_flops=2250 * TERA, memory_bytes=180 * GB, hbm_bw=8000 * GB, intra_bw=900 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8, sm_count=148, matmul_efficiency=1745.0 / 2250,
        fp8_peak_flops=4500 * TERA, fp8_matmul_efficiency=3432.5 / 4500, hbm_efficiency=0.9, comm_sms=20,
        **H100_CUDNN, **H100_FA2),
    "mi300x": _hw(
        "mi300x", "AMD Instinct MI300X data sheet: 1,307.4 TFLOPS bf16 dense, FP8 2,614.9 dense, 192 GB HBM3 at "
        "5.3 TB/s, 7 Infinity Fabric links of 64 GB/s per direction to the 7 peers of an 8-GPU platform "
        "(448 GB/s), PCIe Gen5 x16; AMD CDNA 3 white paper: 304 compute units",
        "AMD Instinct MI300X platform: one 400 Gb/s NIC per GPU in the reference 8-GPU nodes",
        {"matmul_efficiency": f"{MAMF}: MI300X 668.4 TFLOPS bf16 (ROCm 6.3, TunableOp), of 1,307.4",
         "fp8_matmul_efficiency": "assumption: the bf16 fraction (the table has no MI300X FP8 measurement)",
         "attention_fwd_curve": _OTHER_FA2, "attention_bwd_curve": _OTHER_FA2,
         "matmul_tiles": "assumption: the tiles of NVIDIA's guide, sec. 2.3 (hipBLASLt's are of the same sizes)",
         "comm_sms": "assumption: 20 compute units, the SM count of the H800's (not measured on MI300X); "
                     + COMM_SMS},
        peak_flops=1307.4 * TERA, memory_bytes=192 * GB, hbm_bw=5300 * GB, intra_bw=448 * GB, inter_bw=50 * GB,
        pcie_bw=64 * GB, gpus_per_node=8, sm_count=304, matmul_efficiency=668.4 / 1307.4,
        fp8_peak_flops=2614.9 * TERA, fp8_matmul_efficiency=668.4 / 1307.4, hbm_efficiency=0.9, comm_sms=20,
        attention_fwd_curve=H100_FA2["fa2_fwd_curve"], attention_bwd_curve=H100_FA2["fa2_bwd_curve"]),
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
