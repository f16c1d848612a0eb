"""`fivefold calibrate` on a CUDA GPU: the roofline's constants (roofline.py) measured on this GPU.

The catalog prices a GPU's ops from published kernel measurements (datasheet.py). On the GPU
itself, calibrate times the same kernels with CUDA events and writes a profile that starts from
the catalog entry of this GPU and replaces those constants with what it measured:

- matmul_efficiency: a bf16 n x n x n torch.matmul's FLOP/s over (peak x its own tile and wave
  quantisation), so the roofline gives back the measured time at that shape, timed after SUSTAIN_S
  seconds of back-to-back matmuls: a training step runs at the clocks a GPU holds under
  sustained load, which power and heat set below a cold GPU's (the published tables differ so on
  the H100: the Maximum Achievable Matmul FLOPS table's best of 100 iterations gives 794.5 bf16
  TFLOP/s, huggingface/gpu-fryer's minute-long burns about 730). The cold figure is kept in the
  field's source, beside the sustained one;
- fp8_matmul_efficiency: the same with torch._scaled_mm on float8_e4m3fn operands, where the GPU
  has FP8 and this torch offers it (else the catalog's figure stays, and its source says so);
- attention_fwd_curve, attention_bwd_curve: torch's SDPA, causal, bf16, head dim 128, 16 heads,
  batch x sequence = 16k tokens (the FlashAttention papers' set-up), forward and backward at
  each sequence length, FLOPs counted as roofline.py counts them: the kernel SDPA picks (cuDNN's
  on Hopper and Blackwell from torch 2.11, its name in the source), fivefold's causal attention;
- fa2_fwd_curve, fa2_bwd_curve: the same with SDPA held to its flash backend, FlashAttention-2
  (PlanOptions.attention_kernel = "fa2", and what fivefold's FlexAttention is priced at), where
  this torch has it;
- hbm_efficiency: a large copy's bytes read + written per second over hbm_bw.

Collectives, host overheads and the optimizer are not measured here: the catalog's link figures
and the data-sheet pricing stand. Not run by the tests (no GPU there); `gpu_constants` turns
timings into the fields and is tested on made-up timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Callable

from fivefold.planner.machine.datasheet import Hardware, get_hardware
from fivefold.planner.machine.roofline import FA2_BACKWARD_FLOPS, quantisation

HEADS, HEAD_DIM, TOKENS = 16, 128, 16384  # the FlashAttention papers' benchmark shapes
SUSTAIN_S = 15.0  # seconds of back-to-back matmuls before the sustained timing (module docstring); --quick: 1


def keep_busy(fn: Callable[[], object], seconds: float, sync: Callable[[], object],
              clock: Callable[[], float] = time.perf_counter, batch: int = 16) -> int:
    """Run fn() back to back for at least `seconds`, `batch` calls between synchronisations (so the
    queue stays short and the clock reads the device's progress); the calls made."""
    calls, start = 0, clock()
    while clock() - start < seconds:
        for _ in range(batch):
            fn()
        sync()
        calls += batch
    return calls


def catalog_key(device_name: str) -> str:
    """The catalog entry of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "h100"); ValueError if none."""
    n = device_name.lower()
    if ("nvl" in n or "pcie" in n) and ("h100" in n or "h200" in n):
        key = ""  # other clocks and peaks than the catalog's SXM entries
    else:
        key = next((k for k in ("h200", "h100", "b200", "mi300x") if k in n), "")
        if not key and "a100" in n:
            key = "a100-40gb" if "40g" in n else "a100-80gb"
    if not key:
        raise ValueError(f"calibrate: '{device_name}' is not in the planner's catalog (datasheet.py), whose data "
                         "sheet gives the peaks the measured fractions are of; run `fivefold calibrate --device cpu`")
    return key


AttentionTimes = dict[int, tuple[float, float]]  # sequence length -> (forward, backward) seconds


def curves_from_times(hw: Hardware, times: AttentionTimes) -> tuple[tuple[tuple[float, float], ...], ...]:
    """(forward, backward) curves from a kernel's seconds by sequence length (HEADS heads of
    HEAD_DIM, TOKENS tokens in all), FLOPs counted as roofline.py counts them."""
    fwd, bwd = [], []
    for seq, (f_s, b_s) in sorted(times.items()):
        flops = TOKENS * seq * HEADS * 2 * HEAD_DIM  # causal: half of QK^T and PV (roofline.py's count)
        fwd.append((float(seq), flops / f_s / hw.peak_flops))
        bwd.append((float(seq), FA2_BACKWARD_FLOPS * flops / b_s / hw.peak_flops))
    return tuple(fwd), tuple(bwd)


def gpu_constants(hw: Hardware, n: int, gemm_s: float, fp8_s: float | None, attention: AttentionTimes,
                  copy_bytes: float, copy_s: float, fa2: AttentionTimes | None = None) -> dict[str, object]:
    """The roofline fields from timings: an n^3 bf16 (and FP8) matmul, SDPA's kernel forward and
    backward by sequence length (and FlashAttention-2's, `fa2`, where timed), a copy."""
    q, _ = quantisation(n, n, hw.matmul_tiles, hw.sm_count)
    out: dict[str, object] = {"matmul_efficiency": 2.0 * n**3 / gemm_s / (hw.peak_flops * q)}
    if fp8_s and hw.fp8_peak_flops:
        out["fp8_matmul_efficiency"] = 2.0 * n**3 / fp8_s / (hw.fp8_peak_flops * q)
    out["attention_fwd_curve"], out["attention_bwd_curve"] = curves_from_times(hw, attention)
    if fa2:
        out["fa2_fwd_curve"], out["fa2_bwd_curve"] = curves_from_times(hw, fa2)
    out["hbm_efficiency"] = copy_bytes / copy_s / hw.hbm_bw
    return out


def _cuda_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of fn() on the current CUDA stream, after a warm-up (CUDA events)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _fp8_seconds(n: int, repeats: int) -> float | None:
    import torch

    try:
        a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device="cuda")
        return _cuda_seconds(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), repeats)
    except (RuntimeError, TypeError, AttributeError):  # no FP8 on this GPU, or another _scaled_mm signature
        return None


def _attention_seconds(seqs: tuple[int, ...], repeats: int, flash_only: bool) -> tuple[AttentionTimes, str]:
    """SDPA's causal forward and backward seconds by sequence length, and the backend it ran: the one
    it picks, or its flash backend alone (FlashAttention-2). RuntimeError if that backend cannot run."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    times, backend = {}, "flash_attention"
    for seq in seqs:
        q, k, v = (torch.randn(TOKENS // seq, HEADS, seq, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        if not flash_only:  # which kernel SDPA picks for this call (a private query; its name, or the number)
            choice = getattr(torch, "_fused_sdp_choice", None)
            backend = str(SDPBackend(choice(q, k, v, is_causal=True)).name) if choice else "not reported"

        def sdpa(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash_only else contextlib.nullcontext():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = sdpa()
        grad = torch.randn_like(out)
        times[seq] = (_cuda_seconds(sdpa, repeats),
                      _cuda_seconds(lambda out=out, grad=grad: out.backward(grad, retain_graph=True), repeats))
    return times, backend.lower()


def calibrate_gpu(quick: bool = False, name: str = "local") -> Hardware:
    """Measure this CUDA GPU's roofline constants (module docstring) into its catalog entry."""
    import torch

    device = torch.cuda.get_device_name()
    key = catalog_key(device)
    hw = get_hardware(key)
    n, repeats = (4096, 5) if quick else (8192, 20)
    seqs = (1024, 4096) if quick else (512, 1024, 2048, 4096, 8192, 16384)
    x, w = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cold_s = _cuda_seconds(lambda: x @ w, repeats)
    sustain_s = 1.0 if quick else SUSTAIN_S
    keep_busy(lambda: x @ w, sustain_s, torch.cuda.synchronize)
    gemm_s = _cuda_seconds(lambda: x @ w, repeats)
    fp8_s = _fp8_seconds(n, repeats) if hw.fp8_peak_flops else None
    attention, picked = _attention_seconds(seqs, repeats, flash_only=False)
    try:
        fa2, _ = _attention_seconds(seqs, repeats, flash_only=True)
    except RuntimeError:  # no flash backend in this build or on this GPU: the catalog's FA2 curves stay
        fa2 = None
    src = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)  # 256 MiB: far beyond L2
    dst = torch.empty_like(src)
    copy_s = _cuda_seconds(lambda: dst.copy_(src), repeats)
    fields = gpu_constants(hw, n, gemm_s, fp8_s, attention, 2.0 * src.numel(), copy_s, fa2)
    where = f"measured by fivefold calibrate on {device} (torch {torch.__version__})"
    tflops = 2.0 * n**3 / 1e12
    sources = {"matmul_efficiency": f"{where}: bf16 {n}^3 torch.matmul, median of {repeats} after {sustain_s:g} s "
                                    f"of back-to-back matmuls ({tflops / gemm_s:.1f} TFLOP/s; cold "
                                    f"{tflops / cold_s:.1f}), over peak x its tile/wave quantisation",
               "attention_fwd_curve": f"{where}: SDPA causal bf16 ({picked}), {HEADS} heads of {HEAD_DIM}, "
                                      f"{TOKENS} tokens, sequences {', '.join(map(str, seqs))}",
               "attention_bwd_curve": f"{where}: the same, backward (2.5 x the forward's FLOPs)",
               "hbm_efficiency": f"{where}: a 256 MiB copy, bytes read + written per second over hbm_bw"}
    if fa2:
        sources["fa2_fwd_curve"] = sources["fa2_bwd_curve"] = f"{where}: the same, SDPA held to flash_attention"
    if "fp8_matmul_efficiency" in fields:
        sources["fp8_matmul_efficiency"] = f"{where}: float8_e4m3fn {n}^3 torch._scaled_mm, as bf16's"
    return dataclasses.replace(hw, name=name, sources={**hw.sources, **sources}, **fields)
