"""A catalog GPU's compute time: a roofline of each op of the chunk (ops.py lists them).

Each op takes the longer of its compute and its memory traffic:

- a matmul (M, N, K): max(2 M N K / (peak x matmul_efficiency x quantisation), bytes / bandwidth),
  bytes = (M K + K N + M N) elements in the compute dtype. Quantisation is NVIDIA's ("Matrix
  Multiplication Background User's Guide", Deep Learning Performance docs, sec. 3.1 tile
  quantization, 3.2 wave quantization): the output is cut into tiles of tm x tn, M and N rounded
  up to whole tiles; the tiles run in waves of one per SM, the last wave rounded up to a whole
  one. quantisation = M N / (waves x SMs x tm x tn), for the tile shape (of the catalog's, the
  ones cuBLAS picks among, sec. 2.3) that wastes least. matmul_efficiency is a published large-GEMM
  measurement (datasheet.py cites it per GPU); FP8 (PlanOptions.fp8) runs the matmuls at the FP8
  dense peak and its own measured fraction, operands one byte each, but for those it leaves in
  bf16 (ops.kept_bf16: the head, the router, and the routed experts unless fp8_experts).
- backward: two matmuls per forward one, priced at their own shapes: the input gradient
  dY W^T is (M, K, N), the weight gradient X^T dY is (K, N, M): its reduction runs over the tokens.
- the attention core: FLOPs / (peak x the kernel's measured fraction at its sequence length):
  by default the kernel torch's SDPA runs on that GPU (cuDNN's on Hopper and Blackwell), under
  PlanOptions.attention_kernel = "fa2" FlashAttention-2's (datasheet.py: both from the curves of
  Shah et al. 2024, FlashAttention-3, figs. 5-6); backward 2.5 x the forward's FLOPs (five matmuls
  of the forward's two: QK^T again, dV, dP, dQ, dK; Dao 2023, FlashAttention-2, sec. 3.1.2) at the
  backward curve. It stays bf16 under FP8. Under sliding windows, documents and sinks fivefold
  runs FlexAttention (ops.runs_flex), priced at FlashAttention-2's curves (no FlexAttention
  measurement is in the catalog; its authors put it at 85-90% of FA2's, PyTorch blog "FlexAttention",
  2024), its time scaled by the 128 x 128 tiles the block mask keeps over the tiles causality keeps
  (ops.py, model/mask_counts.py): a partly masked tile costs a whole one.
- elementwise kernels: memory-bound, bytes / (HBM bandwidth x hbm_efficiency).

Recompute as the FLOP model had it: full runs the forward again, selective the attention core's
forward (Korthikanti et al. 2022), or under PlanOptions.selective_ac = "per_op" torchtitan's op-level
policy (torchtitan/distributed/activation_checkpoint.py, op SAC): of each block's matmuls, in
forward order, the outputs of the first, third, ... are saved and the second, fourth, ... rerun
(Llama's wk, wo and up), the attention kernel's output is saved, and every elementwise kernel
(norms, RoPE, SiLU, FP8 casts) reruns. Under DeepSeek-V3's activation layout (PlanOptions.activations =
"deepseek", planner/activations.py) without train.recompute, the backward first runs again, at
their forward price, what that layout does not keep: each block's norms (the block's and MLA's
latent norms: their elementwise bytes), the MLA up-projections (wq_b and wkv_b; wq without a query
latent) and the SwiGLUs' silu and product (dense, routed and shared). Left out: the final norm,
whose tensors no layout counts, and RoPE and MLA's joins, which rebuild the kernel's q and k with
the up-projections (taken as fused with them). Hardware without an SM count (a calibrated CPU, a
hand-written profile) keeps the flat FLOPs / (peak x compute_efficiency) of
datasheet.DatasheetPricer, which adds no recompute for the deepseek layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from fivefold.planner.activations import layout_applies
from fivefold.planner.machine.ops import (
    FP32,
    PER_OP_RERUN,
    Ops,
    RankShapes,
    block_ops,
    end_ops,
    loss_recompute_matmul,
)
from fivefold.planner.machine.pricing import ChunkPrice, ChunkWork, Memo, Row
from fivefold.planner.memory import expert_imbalance
from fivefold.planner.options import AttentionKernel

Curve = tuple[tuple[float, float], ...]  # (sequence length, fraction of peak) points (interpolate)
# the curves an attention core is priced at, as --explain names them
ATTENTION_KERNELS = {"sdpa": "SDPA's kernel", "fa2": "FlashAttention-2"}


class Hardware(Protocol):
    """The figures of datasheet.Hardware a roofline reads (declared here, so that the catalog can
    price with this module without the two importing each other)."""

    name: str
    peak_flops: float
    fp8_peak_flops: float
    compute_efficiency: float
    matmul_efficiency: float
    fp8_matmul_efficiency: float
    matmul_tiles: tuple[tuple[int, int], ...]
    sm_count: int
    hbm_bw: float
    hbm_efficiency: float
    attention_fwd_curve: tuple[tuple[float, float], ...]
    attention_bwd_curve: tuple[tuple[float, float], ...]
    fa2_fwd_curve: tuple[tuple[float, float], ...]
    fa2_bwd_curve: tuple[tuple[float, float], ...]
    sources: dict[str, str]

FA2_BACKWARD_FLOPS = 2.5  # FA2's backward runs 5 matmuls to the forward's 2 (Dao 2023, sec. 3.1.2)
GUIDE = "NVIDIA Matrix Multiplication Background User's Guide (Deep Learning Performance docs), sec. 3.1-3.2"


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x, linear in log x between the points, held flat beyond them (0 with no points)."""
    if not points:
        return 0.0
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):  # neighbours: one pair fewer than points
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def quantisation(m: int, n: int, tiles: tuple[tuple[int, int], ...], units: int) -> tuple[float, tuple[int, int]]:
    """(useful fraction of the tile work, tile): M N over whole tiles in whole waves of `units` SMs,
    for the tile that wastes least (NVIDIA's guide, sec. 3.1-3.2)."""
    best = (0.0, tiles[0])
    for tm, tn in tiles:
        count = math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(count / units)
        q = m * n / (waves * units * tm * tn)
        if q > best[0]:
            best = (q, (tm, tn))
    return best


def matmul_seconds(m: int, n: int, k: int, hw: Hardware, act_bytes: int, fp8: bool, batch: int = 1) -> float:
    """One matmul, or `batch` independent ones in one batched call (attention's scores and P V):
    max(compute at peak x efficiency x quantisation, operands and results at HBM speed); a batch's
    tiles run in waves over the SMs together, each matmul reads its own operands."""
    peak, efficiency, operand = ((hw.fp8_peak_flops, hw.fp8_matmul_efficiency, 1) if fp8
                                 else (hw.peak_flops, hw.matmul_efficiency, act_bytes))
    q, _ = quantisation(batch * m, n, hw.matmul_tiles, hw.sm_count)
    compute = 2.0 * m * n * k * batch / (peak * efficiency * q)
    memory = batch * ((m * k + k * n) * operand + m * n * act_bytes) / (hw.hbm_bw * hw.hbm_efficiency)
    return max(compute, memory)


CLASSES = ("matmul", "attention", "elementwise")


@dataclass
class OpsPrice:
    """Seconds of one part's forward and backward by class of op, and the FLOPs they run."""

    forward: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    backward: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))
    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0.0))  # forward + backward
    bytes: list[float] = field(default_factory=lambda: [0.0, 0.0])  # elementwise forward, backward
    matmul_fractions: dict[str, float] = field(default_factory=dict)  # name -> forward fraction of peak
    parts: dict[str, float] = field(default_factory=dict)  # elementwise forward bytes by op
    matmul_forward: dict[str, float] = field(default_factory=dict)  # name -> forward seconds (all its counts)
    matmul_flops: dict[str, float] = field(default_factory=dict)  # name -> forward FLOPs (all its counts)
    attention_work: float = 0.0  # forward: the attention kernel's tiles in causal FLOPs (ops.Ops.attention_work)
    attention_curves: set[str] = field(default_factory=set)  # the kernels whose curves priced it ("sdpa", "fa2")

    @property
    def attention_forward_flops(self) -> float:
        """The attention core's forward FLOPs (flops["attention"] counts forward and backward)."""
        return self.flops["attention"] / (1 + FA2_BACKWARD_FLOPS)

    def add(self, o: OpsPrice, times: float = 1.0) -> None:
        self.attention_work += o.attention_work * times
        self.attention_curves |= o.attention_curves
        for mine, theirs in ((self.forward, o.forward), (self.backward, o.backward), (self.flops, o.flops)):
            for k, v in theirs.items():
                mine[k] += v * times
        self.bytes = [a + b * times for a, b in zip(self.bytes, o.bytes, strict=True)]
        self.matmul_fractions.update(o.matmul_fractions)
        for k, v in o.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v * times
        for k, v in o.matmul_forward.items():
            self.matmul_forward[k] = self.matmul_forward.get(k, 0.0) + v * times
        for k, v in o.matmul_flops.items():
            self.matmul_flops[k] = self.matmul_flops.get(k, 0.0) + v * times



def attention_curves(hw: Hardware, kernel: AttentionKernel) -> tuple[Curve, Curve, str]:
    """The forward and backward curves `kernel` runs at on `hw`, and the sources key that cites them:
    FlashAttention-2's where asked for and `hw` has them apart, else those of the kernel SDPA runs."""
    if kernel == "fa2" and hw.fa2_fwd_curve:
        return hw.fa2_fwd_curve, hw.fa2_bwd_curve, "fa2_fwd_curve"
    return hw.attention_fwd_curve, hw.attention_bwd_curve, "attention_fwd_curve"


def price_ops(ops: Ops, hw: Hardware, act_bytes: int, fp8: bool, kernel: AttentionKernel = "sdpa") -> OpsPrice:
    """Every op of `ops` at its roofline (module docstring), the attention core as `kernel` runs it:
    fivefold's FlexAttention (ops.Ops.attention_flex) at FlashAttention-2's rate."""
    out = OpsPrice()
    for mm in ops.matmuls:
        flops, mm_fp8 = mm.flops, fp8 and mm.name not in ops.bf16_matmuls
        peak = hw.fp8_peak_flops if mm_fp8 else hw.peak_flops
        fwd = matmul_seconds(mm.m, mm.n, mm.k, hw, act_bytes, mm_fp8) * mm.count
        bwd = (matmul_seconds(mm.m, mm.k, mm.n, hw, act_bytes, mm_fp8)  # input gradient
               + matmul_seconds(mm.k, mm.n, mm.m, hw, act_bytes, mm_fp8)) * mm.count  # weight gradient
        out.forward["matmul"] += fwd
        out.backward["matmul"] += bwd
        out.flops["matmul"] += 3 * flops
        out.matmul_fractions[mm.name] = flops / fwd / peak
        out.matmul_forward[mm.name] = out.matmul_forward.get(mm.name, 0.0) + fwd
        out.matmul_flops[mm.name] = out.matmul_flops.get(mm.name, 0.0) + flops
    if ops.attention_flops:
        curve = "fa2" if ops.attention_flex or kernel == "fa2" else "sdpa"
        out.attention_curves.add(curve)
        fwd_curve, bwd_curve, _ = attention_curves(hw, curve)
        f_eff, b_eff = interpolate(fwd_curve, ops.attention_seq), interpolate(bwd_curve, ops.attention_seq)
        work = ops.attention_work or ops.attention_flops  # the tiles the kernel computes, in causal FLOPs
        out.attention_work = work
        out.forward["attention"] = work / (hw.peak_flops * f_eff)
        out.backward["attention"] = FA2_BACKWARD_FLOPS * work / (hw.peak_flops * b_eff)
        out.flops["attention"] = (1 + FA2_BACKWARD_FLOPS) * ops.attention_flops
    bw = hw.hbm_bw * hw.hbm_efficiency
    for mm in ops.attention_matmuls:  # a materialized attention (ops.materialized_attention), never FP8
        out.forward["attention"] += matmul_seconds(mm.m, mm.n, mm.k, hw, act_bytes, False, mm.count)
        out.backward["attention"] += (matmul_seconds(mm.m, mm.k, mm.n, hw, act_bytes, False, mm.count)  # dA
                                      + matmul_seconds(mm.k, mm.n, mm.m, hw, act_bytes, False, mm.count))  # dB
        out.flops["attention"] += 3 * mm.flops
    out.forward["attention"] += ops.softmax_bytes[0] / bw
    out.backward["attention"] += ops.softmax_bytes[1] / bw
    out.forward["elementwise"] = ops.elementwise_bytes / bw
    out.backward["elementwise"] = ops.backward_elementwise_bytes / bw
    out.bytes = [ops.elementwise_bytes, ops.backward_elementwise_bytes]
    out.parts = dict(ops.parts)
    return out


def rank_shapes(work: ChunkWork) -> RankShapes:
    """The sizes the busiest rank computes at (ops.RankShapes)."""
    cfg = work.cfg
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tokens = t.micro_batch * work.local_seq
    kernel_seq = work.local_seq if p.cp_method == "ring" else t.seq_len
    return RankShapes(tokens=tokens, sp_tokens=tokens // p.tp if p.sp else tokens, seq_len=t.seq_len,
                      kernel_seq=kernel_seq, tp=p.tp, ep=p.ep if m.moe.n_experts else 1, act_bytes=work.act_bytes,
                      weight_bytes=work.weight_bytes, fused=work.options.kernels == "fused",
                      residual_bytes=FP32 if work.weight_bytes >= FP32 else work.act_bytes,
                      attention=work.options.attention_kernel, imbalance=expert_imbalance(cfg, work.options),
                      fp8=work.options.fp8, fp8_experts=work.options.fp8_experts,
                      document_mask=cfg.data.document_mask,
                      document_tokens=work.options.document_tokens if cfg.data.document_mask else 0.0)


def _check_fp8(work: ChunkWork, hw: Hardware) -> bool:
    fp8 = work.options.fp8 != "none"
    if fp8 and not hw.fp8_peak_flops:
        raise ValueError(f"--layout fp8={work.options.fp8}: {hw.name} has no FP8 tensor cores "
                         "(no fp8_peak_flops); use fp8=none or a GPU that has them (h100, h200, b200, mi300x)")
    return fp8


def block_prices(work: ChunkWork, hw: Hardware, memo: Memo) -> list[tuple[OpsPrice, int]]:
    """The busiest rank's blocks as (price of one, how many), one per kind of block (MoE or not,
    window), each kind priced once (memo)."""
    m, shapes, fp8 = work.cfg.model, rank_shapes(work), _check_fp8(work, hw)
    kinds: dict[tuple[bool, int], tuple[int, int]] = {}  # (MoE or not, window) -> (a layer of that kind, how many)
    for blk in work.share.blocks:
        kind = (bool(m.moe.n_experts) and blk >= m.moe.first_dense_layers, m.attention.layer_window(blk))
        layer, n = kinds.get(kind, (blk, 0))
        kinds[kind] = (layer, n + 1)
    return [(memo.get(("roofline block", m, kind, shapes, hw, fp8),
                      lambda layer=layer: price_ops(block_ops(m, layer, shapes), hw, shapes.act_bytes, fp8,
                                                    shapes.attention)), n)
            for kind, (layer, n) in sorted(kinds.items())]


def rank_price(work: ChunkWork, hw: Hardware, memo: Memo) -> OpsPrice:
    """The busiest rank's micro-batch over all its chunks, each distinct part priced once (memo)."""
    cfg, share = work.cfg, work.share
    m = cfg.model
    shapes, fp8 = rank_shapes(work), _check_fp8(work, hw)
    total = OpsPrice()
    for price, n in block_prices(work, hw, memo):
        total.add(price, n)
    if share.first or share.last:
        chunk = cfg.train.loss_chunk
        ends = memo.get(("roofline ends", m, work.vocab, shapes, share.first, share.last, chunk, hw, fp8),
                        lambda: price_ops(end_ops(m, work.vocab, shapes, share.first, share.last, chunk), hw,
                                          shapes.act_bytes, fp8))
        total.add(ends)
    return total


def attention_forward_seconds(work: ChunkWork, hw: Hardware, memo: Memo) -> float:
    """The attention core's forward of one micro-batch through one chunk (ring attention's K/V hops
    overlap it: terms.critical_path)."""
    if not hw.sm_count:
        return work.attention_forward_flops / work.chunks / (hw.peak_flops * hw.compute_efficiency)
    return rank_price(work, hw, memo).forward["attention"] / work.chunks


# what the deepseek activation layout rebuilds in backward (module docstring): elementwise parts, matmuls
DEEPSEEK_REBUILT_PARTS = ("norms", "latent norms", "swiglu", "expert swiglu", "shared swiglu")
DEEPSEEK_REBUILT_MATMULS = ("wq_b", "wkv_b", "wq")  # "wq": an MLA block's without a query latent


def rebuilt_forward_seconds(price: OpsPrice, hw: Hardware) -> float:
    """Forward seconds, in blocks' `price`, of what the deepseek layout rebuilds in backward."""
    return (sum(price.parts.get(k, 0.0) for k in DEEPSEEK_REBUILT_PARTS) / (hw.hbm_bw * hw.hbm_efficiency)
            + sum(price.matmul_forward.get(k, 0.0) for k in DEEPSEEK_REBUILT_MATMULS))


def _deepseek_recompute(work: ChunkWork, hw: Hardware, memo: Memo) -> float:
    """rebuilt_forward_seconds over the busiest rank's blocks, per chunk."""
    return sum(n * rebuilt_forward_seconds(price, hw) for price, n in block_prices(work, hw, memo)) / work.chunks


def per_op_recompute_seconds(price: OpsPrice) -> float:
    """What torchtitan's op-level selective recompute reruns of one block (module docstring): every
    other matmul in forward order, from the second, and all the elementwise kernels."""
    return sum(list(price.matmul_forward.values())[PER_OP_RERUN]) + price.forward["elementwise"]


def _selective_recompute(work: ChunkWork, price: OpsPrice, hw: Hardware, memo: Memo) -> tuple[float, float]:
    """(seconds, FLOPs) selective recompute runs again per chunk: the attention core's forward, or
    torchtitan's per-op policy's matmuls and elementwise kernels."""
    c = work.chunks
    if work.options.selective_ac == "per_op":
        blocks = block_prices(work, hw, memo)
        return (sum(n * per_op_recompute_seconds(p) for p, n in blocks) / c,
                sum(n * sum(list(p.matmul_flops.values())[PER_OP_RERUN]) for p, n in blocks) / c)
    return price.forward["attention"] / c, price.attention_forward_flops / c


def chunk_price(work: ChunkWork, hw: Hardware, memo: Memo) -> ChunkPrice:
    """Forward and backward seconds of one micro-batch through one chunk, with the rows that explain them."""
    price, chunks, recompute_mode = rank_price(work, hw, memo), work.chunks, work.cfg.train.recompute
    forward = sum(price.forward.values()) / chunks
    recompute, rerun_flops = 0.0, 0.0  # seconds and FLOPs run again per chunk
    if recompute_mode == "full":
        rerun_flops = (price.flops["matmul"] / 3 + price.attention_forward_flops) / chunks
        recompute = forward
    elif recompute_mode == "selective":
        recompute, rerun_flops = _selective_recompute(work, price, hw, memo)
    elif work.options.activations == "deepseek" and layout_applies(work.cfg.model, "deepseek"):
        recompute = _deepseek_recompute(work, hw, memo)
    if work.share.last:  # the loss's backward makes the logits again (model/head.py), whatever train.recompute
        shapes = rank_shapes(work)
        head = memo.get(("roofline loss recompute", work.cfg.model, work.vocab, shapes, hw),
                        lambda: price_ops(Ops(matmuls=(loss_recompute_matmul(work.cfg.model, work.vocab, shapes),)),
                                          hw, shapes.act_bytes, False))
        recompute += head.forward["matmul"] / chunks
        rerun_flops += head.flops["matmul"] / 3 / chunks
    backward = sum(price.backward.values()) / chunks + recompute
    return ChunkPrice(forward, backward, _rows(price, hw, work, forward, backward, recompute, rerun_flops), price)


def _masked_note(price: OpsPrice, chunks: int) -> str:
    """What a sliding window or documents leave the kernel (nothing for causality alone)."""
    kept = price.attention_forward_flops
    if abs(price.attention_work - kept) <= 1e-9 * kept:
        return ""
    return (f"; masked: {kept / chunks:.3e} FLOP kept forward, the kernel's 128 x 128 tiles "
            f"{price.attention_work / chunks:.3e} (model/mask_counts.py), at the kernel's causal rate")


def _rows(price: OpsPrice, hw: Hardware, work: ChunkWork, forward: float, backward: float,
          recompute: float, rerun_flops: float) -> list[Row]:
    c, fp8 = work.chunks, work.options.fp8 != "none"
    ms = lambda s: f"{s / c * 1e3:.2f}"  # noqa: E731  (per chunk, ms)
    peak = hw.fp8_peak_flops if fp8 else hw.peak_flops
    mm_s = price.forward["matmul"] + price.backward["matmul"]
    lowest = sorted(price.matmul_fractions.items(), key=lambda kv: kv[1])[:3]
    eff_key = "fp8_matmul_efficiency" if fp8 else "matmul_efficiency"
    rows: list[Row] = [
        ("compute: matmuls", f"forward {ms(price.forward['matmul'])} + backward (input and weight gradients) "
         f"{ms(price.backward['matmul'])} ms per chunk: {price.flops['matmul'] / mm_s / peak:.1%} of the "
         f"{'FP8' if fp8 else 'bf16'} peak on average, at most {getattr(hw, eff_key):.1%} x tile/wave quantisation "
         f"({' or '.join(f'{a}x{b}' for a, b in hw.matmul_tiles)} tiles on {hw.sm_count} SMs); lowest: "
         + ", ".join(f"{k} {v:.0%}" for k, v in lowest),
         f"{hw.sources.get(eff_key, 'profile')}; quantisation: {GUIDE}")]
    if work.options.attention_kernel == "materialized":
        rows.append(("compute: attention core", f"materialized: forward {ms(price.forward['attention'])} ms, backward "
                     f"{ms(price.backward['attention'])} ms: Q K^T and P V as batched matmuls over the whole score "
                     "matrix, a fused softmax and a dropout reading and writing it",
                     "ops.materialized_attention (Megatron-LM 2021, Narayanan et al. 2021); the matmuls at the "
                     "large-GEMM fraction"))
    elif price.flops["attention"]:
        seq = rank_shapes(work).kernel_seq
        curves = [(k, *attention_curves(hw, k)) for k in sorted(price.attention_curves, reverse=True)]
        rates = " and ".join(f"{ATTENTION_KERNELS[k]} at {interpolate(f, seq):.1%} forward, {interpolate(b, seq):.1%} "
                             "backward" for k, f, b, _ in curves)
        rows.append(("compute: attention core", f"forward {ms(price.forward['attention'])} ms, backward (2.5x the "
                     f"FLOPs) {ms(price.backward['attention'])} ms: {rates} of peak (kernel sequence {seq})"
                     + _masked_note(price, c), "; ".join(hw.sources.get(key, "profile") for *_, key in curves)))
    largest = sorted(price.parts.items(), key=lambda kv: -kv[1])[:3]
    rows.append(("compute: elementwise", f"{price.bytes[0] / c / 1e9:.2f} GB forward + {price.bytes[1] / c / 1e9:.2f} "
                 f"GB backward at {hw.hbm_efficiency:.0%} of {hw.hbm_bw / 1e12:.2f} TB/s: "
                 f"{ms(price.forward['elementwise'])} + {ms(price.backward['elementwise'])} ms; largest: "
                 + ", ".join(f"{k} {v / c / 1e9:.2f} GB" for k, v in largest),
                 f"{hw.sources.get('hbm_efficiency', 'profile')}; bytes: planner/machine/ops.py, "
                 + ("kernels fused (--kernels fused: each chain reads its inputs once, writes its output once)"
                    if work.options.kernels == "fused" else "kernels eager (fivefold's model code op by op)")))
    flops = sum(price.flops.values()) / c + rerun_flops
    rows.append(("forward per chunk", f"{forward * 1e3:.3f} ms, backward {backward * 1e3:.3f} ms (recompute "
                 f"{recompute * 1e3:.3f} ms): {flops:.3e} FLOP at {flops / (forward + backward) / hw.peak_flops:.1%} "
                 "of the bf16 peak", "roofline.py: each op at max(FLOPs / achievable FLOP/s, bytes / bandwidth); "
                 "recompute: Korthikanti 2022"))
    return rows
