"""What one micro-batch dispatches: the aten ops of fivefold's own model code, counted, not guessed.

On a GPU a small model's step is bound by FLOPs (kernels queue asynchronously behind a few
microseconds of launch), but on a CPU every op is paid in full by the one thread that dispatches
it: a tiny model's step is hundreds of small ops per block, forward and backward, each costing a
fixed dispatch-and-autograd overhead that FLOPs do not see. So the planner, given a profile that
measured those costs (`fivefold calibrate`), prices a micro-batch op by op:

    time = sum over ops of (overhead + work),  work = FLOPs / matmul rate(size) for matmuls and
                                               attention, bytes / copy rate(size) for the rest;
    views (view, t, transpose, detach, ...) move no data and cost `view_overhead_s` alone.

The op list comes from running `model.Block` (and the embedding, final norm, head and loss) forward
and backward once under a `TorchDispatchMode`, on FakeTensors of the rank's true shapes (the tensor
parallel slice: heads and FFN width / tp), so nothing is allocated and the CPU kernels are the ones
selected. The same trace counts the nn.Module calls and the custom autograd Functions, which
overheads.py prices. Results are cached per shape: a search traces each shape once.

Known gap: on the 2-core test machine a block's backward costs per op what the calibration's op
chains cost, but its forward costs up to twice as much per op, even after module calls (with
autograd off the gap halves: model code records more autograd state per op than a chain does).
The forward of a tiny model is then priced low, and so its step, by up to a quarter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from fivefold.config import ModelConfig

MATMULS = {"mm", "bmm", "addmm", "baddbmm", "_scaled_mm"}
ATTENTION_FWD = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention")


@dataclass
class OpTally:
    """The ops of one forward + backward, with what each costs in work."""

    ops: int = 0  # ops with a kernel (compute or copy)
    views: int = 0  # metadata-only ops (views, detach)
    matmul_flops: list[float] = field(default_factory=list)  # one entry per matmul op: its FLOPs
    attention: list[tuple[float, float]] = field(default_factory=list)  # (FLOPs, FLOPs of one head's QK^T)
    elementwise_bytes: list[float] = field(default_factory=list)  # bytes read + written, per other op
    params: int = 0  # parameter tensors (the optimizer's per-tensor work)
    modules: int = 0  # nn.Module calls (forward)
    functions: int = 0  # custom autograd.Functions applied (forward; each runs a Python backward too)

    def scaled(self, k: int) -> "OpTally":
        return OpTally(self.ops * k, self.views * k, self.matmul_flops * k, self.attention * k,
                       self.elementwise_bytes * k, self.params * k, self.modules * k, self.functions * k)

    def __add__(self, o: "OpTally") -> "OpTally":
        return OpTally(self.ops + o.ops, self.views + o.views, self.matmul_flops + o.matmul_flops,
                       self.attention + o.attention, self.elementwise_bytes + o.elementwise_bytes,
                       self.params + o.params, self.modules + o.modules, self.functions + o.functions)

    @property
    def flops(self) -> float:
        return sum(self.matmul_flops) + sum(f for f, _ in self.attention)


def _tensor_bytes(x) -> float:
    import torch

    if isinstance(x, torch.Tensor):
        return float(x.numel() * x.element_size())
    if isinstance(x, (list, tuple)):
        return sum(_tensor_bytes(y) for y in x)
    return 0.0


def _is_view(func) -> bool:
    name = func.overloadpacket.__name__
    return bool(getattr(func, "is_view", False)) or name in ("detach", "t", "alias", "_unsafe_view", "lift_fresh")


def _record(tally: OpTally, func, args, kwargs, out) -> None:
    name = func.overloadpacket.__name__
    if _is_view(func):
        tally.views += 1
        return
    tally.ops += 1
    if name in MATMULS:
        a, b = args[-2], args[-1]  # addmm / baddbmm: (bias, a, b)
        batch = math.prod(a.shape[:-2]) if a.dim() > 2 else 1
        tally.matmul_flops.append(2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1])
    elif "scaled_dot_product" in name:
        q, k = args[0], args[1]  # (B, H, T, D) for the fused kernels, forward and backward alike
        if "backward" in name:  # grad_out first: q, k follow
            q, k = args[1], args[2]
        b, h, tq, d = q.shape
        tk = k.shape[-2]
        per_head = 2.0 * tq * tk * d  # one head's QK^T
        # forward: QK^T and PV; backward: QK^T again (recompute), dV, dP, dQ, dK
        tally.attention.append((b * h * per_head * (5 if "backward" in name else 2), per_head))
    else:
        tally.elementwise_bytes.append(_tensor_bytes(list(args)) + _tensor_bytes(list((kwargs or {}).values()))
                                       + _tensor_bytes(out))


def trace(fn) -> OpTally:
    """Run fn() (forward and backward) and tally every aten op it dispatches and module it calls."""
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    tally = OpTally()

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace != "prim":  # prim.device: FakeTensor's own queries, no kernel
                _record(tally, func, args, kwargs, out)
            return out

    def count_module(module, args):
        tally.modules += 1

    handle = register_module_forward_pre_hook(count_module)
    try:
        with _Count():
            fn()
    finally:
        handle.remove()
    return tally


def python_functions(out) -> int:
    """Custom autograd.Functions in the graph that produced `out` (each node once)."""
    import torch

    seen, todo, count = set(), [out.grad_fn], 0
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        count += isinstance(node, torch.autograd.function.BackwardCFunction)
        todo += [n for n, _ in node.next_functions]
    return count


def _rank_model(m: ModelConfig, tp: int) -> ModelConfig:
    """The shapes one tensor-parallel rank computes: heads and dense FFN width / tp (experts whole)."""
    hd = m.head_dim or m.dim // m.n_heads
    return dataclasses.replace(m, n_heads=max(1, m.n_heads // tp), n_kv_heads=max(1, m.n_kv_heads // tp),
                               ffn_dim=max(1, m.ffn_dim // tp), head_dim=hd, n_layers=1)


def _fwd_bwd(forward) -> tuple[OpTally, OpTally]:
    """Tallies of forward() (returning a tensor) and of its backward, separately."""
    import torch

    box = []
    fwd = trace(lambda: box.append(forward()))
    out = box[0]
    fwd.functions = python_functions(out)
    bwd = trace(lambda: out.backward(torch.ones_like(out)))
    return fwd, bwd


@functools.lru_cache(maxsize=256)
def block_tally(m: ModelConfig, layer: int, tp: int, batch: int, seq: int) -> tuple[OpTally, OpTally]:
    """Forward and backward of `model.Block` number `layer` on one rank: (batch, seq, dim) in and out.

    FakeTensors: no memory, CPU kernels. A block whose ops depend on values (MoE routing reads
    its expert counts) cannot run on FakeTensors: it runs on real tensors when small enough,
    else the caller falls back to FLOPs (raises ValueError).
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fivefold.model import Block, rope_cos_sin

    rm = dataclasses.replace(_rank_model(m, tp), first_dense_layers=m.first_dense_layers)

    def run():
        block = Block(rm, layer, rm.head_dim)
        x = torch.randn(batch, seq, m.dim, requires_grad=True)
        cos, sin = rope_cos_sin(torch.arange(seq), rm.head_dim, m.rope_theta)
        fwd, bwd = _fwd_bwd(lambda: block(x, cos, sin))
        fwd.params = len(list(block.parameters()))
        return fwd, bwd

    try:
        with FakeTensorMode():
            return run()
    except Exception:  # data-dependent ops (MoE): real tensors, if they fit in a few hundred MB
        moe = m.n_experts * 3 * m.dim * (m.moe_ffn_dim or m.ffn_dim)
        if batch * seq * max(m.dim, m.ffn_dim) * 32 + moe * 4 > 4e8:
            raise ValueError("this block's ops depend on its values and it is too large to run for real")
        return run()


@functools.lru_cache(maxsize=256)
def ends_tally(m: ModelConfig, vocab: int, tp: int, batch: int, seq: int, first: bool,
               last: bool) -> tuple[OpTally, OpTally]:
    """The embedding (first stage) and final norm + head + loss (last stage): forward, backward.

    The code training runs: under tp the vocabulary-parallel embedding, and at every tp the
    vocabulary-parallel loss, divided by the step's tokens and scaled (pipeline.py); traced over a
    group of one, so their collectives (priced as tp traffic) drop out and their ops stay.
    """
    import torch
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fivefold.model import RMSNorm
    from fivefold.parallel.comms import AxisGroup, CommStats
    from fivefold.parallel.tensor import VocabParallelEmbedding, vocab_parallel_cross_entropy

    fwd, bwd = OpTally(), OpTally()
    v = max(1, vocab // tp)  # the vocabulary is split over tp
    alone = AxisGroup("tp", "tp", None, 1, 0, CommStats())
    with FakeTensorMode():
        if first:
            emb = nn.Embedding(v, m.dim)
            emb = VocabParallelEmbedding(emb, alone, False) if tp > 1 else emb
            tokens = torch.randint(0, v, (batch, seq))
            f, b = _fwd_bwd(lambda: emb(tokens))
            fwd, bwd = fwd + f, bwd + b
            fwd.params += 1
        if last:
            norm, head = RMSNorm(m.dim, m.norm_eps), nn.Linear(m.dim, v, bias=False)
            x = torch.randn(batch, seq, m.dim, requires_grad=True)
            targets = torch.randint(0, v, (batch, seq))
            f, b = _fwd_bwd(lambda: vocab_parallel_cross_entropy(head(norm(x)), targets, alone) / (batch * seq) * 1.0)
            fwd, bwd = fwd + f, bwd + b
            fwd.params += 1 if m.tie_embeddings and first else 2
    return fwd, bwd


def _interp(points: tuple[tuple[float, float], ...], x: float) -> float:
    """y at x, linear in log x between measured points, held flat beyond them."""
    if not points:
        return 0.0
    pts = sorted(points)
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return pts[-1][1]


def matmul_rate(hw, flops: float) -> float:
    """Achieved FLOP/s of one matmul of `flops` FLOPs: the profile's measured curve, else peak x efficiency."""
    if hw.matmul_curve:
        return _interp(hw.matmul_curve, flops)
    return hw.peak_flops * hw.compute_efficiency


def elementwise_rate(hw, nbytes: float) -> float:
    """Bytes/s one elementwise op moves at this size: the measured curve, else the copy bandwidth."""
    if hw.elementwise_curve:
        return _interp(hw.elementwise_curve, nbytes)
    return hw.hbm_bw


def tally_time(t: OpTally, hw) -> dict[str, float]:
    """Seconds of the tally on `hw`: {"overhead", "matmul", "attention", "elementwise", "total"}."""
    overhead = t.ops * hw.op_overhead_s + t.views * hw.view_overhead_s
    matmul = sum(f / matmul_rate(hw, f) for f in t.matmul_flops)
    attention = sum(f / matmul_rate(hw, per_head) for f, per_head in t.attention)
    elementwise = sum(b / elementwise_rate(hw, b) for b in t.elementwise_bytes)
    return {"overhead": overhead, "matmul": matmul, "attention": attention, "elementwise": elementwise,
            "total": overhead + matmul + attention + elementwise}
