"""What one micro-batch dispatches: the aten ops of fivefold's own model code, counted, not guessed.

On a CPU every op is paid in full by the one thread that dispatches it, so a measured profile
prices a micro-batch op by op (profile.tally_time, pricer.py); this module counts the ops. The op
list comes from running `model.Block` (and the embedding, final norm, head and loss) forward and
backward once under a `TorchDispatchMode`, on FakeTensors of the rank's true shapes (the tensor
parallel slice: heads and FFN width / tp), so nothing is allocated and the CPU kernels are the
ones selected. The same trace counts the nn.Module calls and the custom autograd Functions, which
overheads.py prices. Nothing here is cached: the pricer keeps each part's tally in the caller's
Memo, so a search traces each shape once.

Known gap: on the 2-core test machine, a tiny block (64 tokens of width 64) runs 1.4-1.5x its
op price: its matmuls cost 1.7x what the same calls cost replayed alone, its reductions 2-5x. Blocks
small enough to be all fixed cost, and the debug model's, come within 15%. What an op costs depends
on the ops around it (caches, the allocator), which no generic chain reproduces; a profile can time
the parts themselves instead (`Part`, layers.py), and the pricer then uses those times.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from fivefold.model.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where it runs: loading a profile should not import it
    import torch

MATMULS = {"mm", "bmm", "addmm", "addmm_", "baddbmm", "_scaled_mm"}  # addmm_: the chunked loss's weight gradient
GROUPED_MATMUL = "_grouped_mm"  # the routed experts' in bf16 (model/moe.py): (a, b, offs)
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


def _grouped_flops(a, b) -> float:
    """FLOPs of torch._grouped_mm(a, b, offs), whose offs split one dim into groups: a (M, K) by b (G,
    K, N) splits the rows (forward, dx); a (K, M) by b (M, N) the contraction (dW, out (G, K, N)); a (G,
    M, K) by b (K, N) the columns: 2 M K N each, however the groups fall. Both 3-D: G batched matmuls."""
    batch = a.shape[0] if a.dim() == 3 and b.dim() == 3 else 1
    return 2.0 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


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
    elif name == GROUPED_MATMUL:
        tally.matmul_flops.append(_grouped_flops(args[0], args[1]))
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


def trace(fn: Callable[[], object]) -> OpTally:
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


def python_functions(out: torch.Tensor) -> int:
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


@dataclass(frozen=True)
class Part:
    """A piece of one rank's micro-batch that is priced as a whole, op by op, or timed as a whole by
    `fivefold calibrate --layers` (layers.py): a block, the embedding, or the final norm,
    head and loss, at the shapes one rank computes (heads, FFN width and vocabulary / tp)."""

    kind: str  # "block", "embedding" or "head"
    model: ModelConfig
    layer: int  # blocks: dense or MoE follows from it
    vocab: int
    tp: int
    batch: int
    seq: int
    loss_chunk: int = 0  # the head's: tokens whose logits exist at once (train.loss_chunk; 0 = all)

    @property
    def key(self) -> str:
        """What the part's time depends on, readable: a profile's layer_times are keyed by it."""
        m, tail = self.model, f"batch={self.batch} seq={self.seq}"
        if self.kind != "block":
            chunk = f" loss_chunk={self.loss_chunk}" if self.kind == "head" and self.loss_chunk else ""
            return f"{self.kind} vocab={max(1, self.vocab // self.tp)} dim={m.dim} tp={self.tp} {tail}{chunk}"
        rm = _rank_model(m, self.tp)
        moe = m.moe
        if moe.n_experts and self.layer >= moe.first_dense_layers:
            ffn = (f"experts={moe.n_experts}x{moe.ffn_dim or m.ffn_dim} top_k={moe.top_k} "
                   f"shared={moe.n_shared_experts} score={moe.router_score} aux={moe.aux_loss:g} "
                   f"cf={moe.capacity_factor:g}")
        else:
            ffn = f"ffn={rm.ffn_dim}"
            if moe.n_groups > 1:
                ffn += f" groups={moe.topk_groups}/{moe.n_groups}"
        qk = " qk_norm" if m.norm.qk else ""
        mla = m.latent
        if mla.kv_lora_rank:  # latent attention: its widths instead of head_dim (n_kv_heads is unused)
            return (f"block dim={m.dim} heads={rm.n_heads} mla={mla.q_lora_rank}/{mla.kv_lora_rank} "
                    f"qk={mla.qk_nope_head_dim}+{mla.qk_rope_head_dim} v={mla.v_head_dim} {ffn} {tail}")
        return f"block dim={m.dim} heads={rm.n_heads}/{rm.n_kv_heads} head_dim={rm.head_dim} {ffn}{qk} {tail}"

    def build(self) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(forward, parameters, inputs): a closure running the part's forward on fresh inputs and
        initialised weights (real tensors, or FakeTensors under FakeTensorMode), returning the
        tensor to run backward from. The code training runs: under tp the vocabulary-parallel
        embedding and loss (at tp = 1 the loss is torch's fused kernel), divided by the step's
        tokens and scaled (pipeline/executor.py), over a group of one, so their collectives (priced as tp
        traffic) drop out and their ops stay."""
        import torch
        from torch import nn

        from fivefold.model.attention import RMSNorm
        from fivefold.model.head import OutputHead
        from fivefold.model.rope import layer_is_local, rope_cos_sin
        from fivefold.model.seeded_init import init_tensor
        from fivefold.model.transformer import Block
        from fivefold.parallel.comm.collectives import AxisGroup, CommStats
        from fivefold.parallel.tensor import VocabParallelEmbedding, VocabParallelHead

        m, b, s = self.model, self.batch, self.seq
        if self.kind == "block":
            rm = _rank_model(m, self.tp)
            block = Block(rm, self.layer, rm.head_dim)
            for name, p in block.named_parameters():
                init_tensor(name, p, rm, seed=0)  # the block's own seeded init: routing, hence ops, are fixed
            x = torch.randn(b, s, m.dim, requires_grad=True)
            # MLA ropes a part of each head
            rope_dim = rm.latent.qk_rope_head_dim if rm.latent.kv_lora_rank else rm.head_dim
            local = layer_is_local(m.rope, m.attention.layer_window(self.layer))
            cos, sin = rope_cos_sin(torch.arange(s), rope_dim, m.rope, local)
            return (lambda: block(x, cos, sin)), list(block.parameters()), [x]
        v = max(1, self.vocab // self.tp)  # the vocabulary is split over tp
        alone = AxisGroup("tp", "tp", None, 1, 0, CommStats())
        if self.kind == "embedding":
            emb = nn.Embedding(v, m.dim)
            emb = VocabParallelEmbedding(emb, alone, False) if self.tp > 1 else emb
            tokens = torch.randint(0, v, (b, s))
            return (lambda: emb(tokens)), list(emb.parameters()), []
        norm, head = RMSNorm(m.dim, m.norm.eps), OutputHead(m.dim, v)
        head = VocabParallelHead(head, alone, False, v) if self.tp > 1 else head  # its gather over one rank
        x = torch.randn(b, s, m.dim, requires_grad=True)
        targets = torch.randint(0, v, (b, s))
        loss = lambda: head(norm(x), targets, self.loss_chunk).sum() / (b * s) * 1.0  # noqa: E731
        return loss, [norm.weight, head.weight], [x]


def _fwd_bwd(forward) -> tuple[OpTally, OpTally]:
    """Tallies of forward() (returning a tensor) and of its backward, separately."""
    import torch

    box = []
    fwd = trace(lambda: box.append(forward()))
    out = box[0]
    fwd.functions = python_functions(out)
    bwd = trace(lambda: out.backward(torch.ones_like(out)))
    return fwd, bwd


def part_tally(part: Part, autocast: bool = False) -> tuple[OpTally, OpTally]:
    """Forward and backward tallies of one part, on FakeTensors: no memory, CPU kernels; under
    `autocast` as training runs it in bf16 (fp32 weights and inputs, bf16 autocast).

    A block whose ops depend on values (MoE routing reads its expert counts) cannot run on
    FakeTensors: it runs on real tensors when small enough, else the caller falls back to FLOPs
    (raises ValueError)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def run():
        forward, params, _ = part.build()
        with torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            fwd, bwd = _fwd_bwd(forward)
        fwd.params = len(params)
        return fwd, bwd

    try:
        with FakeTensorMode():
            return run()
    except Exception as err:  # data-dependent ops (MoE): real tensors, if they fit in a few hundred MB
        m = part.model
        moe = m.moe.n_experts * 3 * m.dim * (m.moe.ffn_dim or m.ffn_dim)
        if part.kind != "block" or part.batch * part.seq * max(m.dim, m.ffn_dim) * 32 + moe * 4 > 4e8:
            raise ValueError("this block's ops depend on its values and it is too large to run for real") from err
        return run()


def block_tally(m: ModelConfig, layer: int, tp: int, batch: int, seq: int,
                autocast: bool = False) -> tuple[OpTally, OpTally]:
    """Forward and backward of `model.Block` number `layer` on one rank: (batch, seq, dim) in and out."""
    return part_tally(Part("block", m, layer, 0, tp, batch, seq), autocast)


def end_parts(m: ModelConfig, vocab: int, tp: int, batch: int, seq: int, first: bool, last: bool,
              loss_chunk: int = 0) -> list[Part]:
    """The embedding (first stage) and the final norm + head + loss (last stage) of a rank, its loss
    in chunks of `loss_chunk` tokens (train.loss_chunk). With model.mtp_layers D the head runs once
    on (1 + D) micro-batches of rows (pipeline/stages.py StageChunk.losses); the depths' blocks are
    the rank's blocks, their norms and eh_proj are not parts (a few dim x dim FLOPs)."""
    head_batch = batch * (1 + m.mtp_layers)
    return ([Part("embedding", m, 0, vocab, tp, batch, seq)] if first else []) + \
        ([Part("head", m, 0, vocab, tp, head_batch, seq, loss_chunk)] if last else [])


def ends_tally(m: ModelConfig, vocab: int, tp: int, batch: int, seq: int, first: bool,
               last: bool, loss_chunk: int = 0) -> tuple[OpTally, OpTally]:
    """Forward and backward tallies of a rank's ends (end_parts); a tied head on the embedding's
    rank adds no parameter tensor of its own."""
    fwd, bwd = OpTally(), OpTally()
    for part in end_parts(m, vocab, tp, batch, seq, first, last, loss_chunk):
        f, b = part_tally(part)
        fwd, bwd = fwd + f, bwd + b
    if first and last and m.tie_embeddings:
        fwd.params -= 1
    return fwd, bwd
