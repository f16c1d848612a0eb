"""The correct stage: each feature at world 1 against its fp32 or one-path reference, on the device.

- precision: a bf16 step's losses against fp32's; FP8 tensorwise and rowwise against bf16; and
  whether `validate` refuses FP8 layers whose dims `torch._scaled_mm` cannot take (multiples of 16).
- moe: GroupedExperts' grouped matmul (bf16) against its expert-by-expert loop (fp32), forward and
  backward, with ragged and zero counts.
- sharding: ZeRO-3 gathering in bf16 (parallel.param_dtype) against the unsharded bf16 step; the
  optimizer offload (ZeRO-1) and the parameter offload (ZeRO-3) against the same layout without,
  and the pinned bytes their step records report.
- attention: FlexAttention under documents, a window and sinks against the rule in fp32 (forward
  and the q/k/v/sinks gradients), its peak memory at T = 32k, and the memory-efficient tiles of the
  blockwise path at T = 1000 and 2000 (lengths no tile divides).
- compile: the blocks compiled (inductor on CUDA; aot_eager on the CPU, which needs no C++ compiler)
  against eager, without and with full recompute; the chunked loss (train.loss_chunk, issue 51)
  against the whole micro-batch's, eager.
- optimizer: Muon (optim.name = "muon", issue 52) on one process against torch.optim.Muon and
  torch.optim.AdamW on the same split, from the same random gradients, on the device (bf16
  Newton-Schulz on its matmuls); a bf16 Muon step's losses against fp32's; QK-clip (optim.qk_clip)
  clipping heads from the blockwise tiles' largest logits.
Losses are compared as the largest relative gap over `STEPS` steps from the same seeded start.
On the CPU (--tiny) every check runs its code path at small sizes.
"""

from __future__ import annotations

import importlib.util
import math
import tempfile
from pathlib import Path

import torch

from benchmarks.gpucheck.records import PartLog, at_least, at_most, recorded
from benchmarks.gpucheck.training import ROOT, losses, make_config, relative_gap

STEPS = 3
LAYERS = 2  # of configs/tiny.toml's model: each feature acts per block, and two show a block's seams
# (bound) the largest relative loss gap: bf16 and FP8 round; bf16 weights (param_dtype) run every op
# in bf16, norms and the loss too, where autocast keeps those in fp32; the others reorder sums at most
BF16_GAP, FP8_GAP, BF16_WEIGHTS_GAP, SAME_GAP = 0.02, 0.05, 0.05, 1e-3


class Context:
    """What the checks share: the device, the sizes, a run directory, and losses already measured."""

    def __init__(self, device: str, tiny: bool):
        self.device, self.tiny, self.cuda = device, tiny, device == "cuda"
        self.dir = Path(tempfile.mkdtemp(prefix="ff-gpu-check-"))
        self._losses: dict[tuple, tuple[list[float], dict]] = {}

    def run(self, dtype: str, *extra: str, compile_options: dict | None = None) -> tuple[list[float], dict]:
        """The losses and last step record of the tiny model (`LAYERS` blocks) trained `STEPS` steps with
        `extra` overrides."""
        key = (dtype, extra, tuple(sorted((compile_options or {}).items())))
        if key not in self._losses:
            cfg = make_config("tiny", self.device, dtype, STEPS, self.dir, (f"--model.n_layers={LAYERS}", *extra))
            self._losses[key] = losses(cfg, self.device, STEPS, compile_options)
        return self._losses[key]


# ---- precision -------------------------------------------------------------------------------------
def precision(part: PartLog, ctx: Context) -> None:
    def bf16_step():
        gap = relative_gap(ctx.run("bf16")[0], ctx.run("fp32")[0])
        return at_most(gap, BF16_GAP, "largest relative loss gap, bf16 against fp32")

    def fp8(recipe: str):
        gap = relative_gap(ctx.run("bf16", f"--train.fp8={recipe}")[0], ctx.run("bf16")[0])
        return at_most(gap, FP8_GAP, f"largest relative loss gap, fp8 {recipe} against bf16")

    part.run("bf16 dense step vs fp32", bf16_step, 20)
    part.run("fp8 tensorwise vs bf16", lambda: fp8("tensorwise"), 10)
    part.run("fp8 rowwise vs bf16", lambda: fp8("rowwise"), 10)
    part.run("fp8 shape rule in validate (dims multiples of 16)", fp8_shape_rule, 1)


def fp8_shape_rule():
    """torch._scaled_mm takes operands whose dims are multiples of 16: a model of dim 40 under FP8
    on CUDA must be refused by validate, before any process group starts."""
    from fivefold.config.load import load_config
    from fivefold.validate import validate

    cfg = load_config(ROOT / "configs" / "tiny.toml", ["--model.dim=40", "--train.fp8=tensorwise",
                                                       "--train.dtype=bf16", "--train.device=cuda"])
    errors = [e for e in validate(cfg, 1) if "fp8" in e.lower() and "16" in e]
    return (errors[0] if errors else "no error", "an error naming fp8 and 16", bool(errors),
            "validate(model.dim = 40, train.fp8 = 'tensorwise', device cuda)")


# ---- moe -------------------------------------------------------------------------------------------
def moe(part: PartLog, ctx: Context) -> None:
    for counts in ([5, 0, 13, 1], [0, 0, 0, 7, 0, 33, 2, 0]):
        part.run(f"moe grouped vs loop, counts {counts}", lambda c=counts: grouped_vs_loop(ctx, c), 5)


def grouped_vs_loop(ctx: Context, counts: list[int]):
    """The grouped matmul (bf16, under autocast) against the loop in fp32 on the same weights and rows:
    the output and the gradients of the rows and of the three weight stacks."""
    from fivefold.model.moe import GroupedExperts

    dim, hidden = (256, 512) if ctx.cuda else (32, 64)
    g = torch.Generator().manual_seed(0)
    experts = GroupedExperts(len(counts), dim, hidden)
    with torch.no_grad():
        for w in (experts.gate, experts.up, experts.down):
            w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1]))
    experts.to(ctx.device)
    x0 = torch.randn(sum(counts), dim, generator=g).to(ctx.device)  # (N, dim), sorted by expert
    n = torch.tensor(counts, device=ctx.device)

    def side(autocast: bool) -> tuple[list[torch.Tensor], bool]:
        experts.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        with torch.autocast(ctx.device, dtype=torch.bfloat16, enabled=autocast):
            grouped = experts.grouped(x)
            y = experts(x, n)  # (N, dim)
        y.float().pow(2).sum().backward()
        return [y.detach().float(), x.grad.float(), *(w.grad.float() for w in (experts.gate, experts.up,
                                                                              experts.down))], grouped

    ours, grouped = side(True)
    ref, looped = side(False)
    errors = {name: float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))
              for name, a, b in zip(["out", "dx", "dgate", "dup", "ddown"], ours, ref, strict=True)}
    if not grouped or looped:
        return max(errors.values()), "grouped ran, then the loop", False, {"grouped": grouped, "looped": not looped}
    return at_most(max(errors.values()), 0.03, {"relative_max_error": errors})


# ---- sharding --------------------------------------------------------------------------------------
def sharding(part: PartLog, ctx: Context) -> None:
    def zero3_bf16():
        gap = relative_gap(ctx.run("bf16", "--parallel.zero=3", "--parallel.param_dtype=bf16")[0], ctx.run("bf16")[0])
        return at_most(gap, BF16_WEIGHTS_GAP, "ZeRO-3 gathering bf16 against the unsharded bf16 step")

    def offload(mode: str, zero: int):
        got, record = ctx.run("bf16", f"--parallel.zero={zero}", f"--parallel.offload={mode}")
        gap = relative_gap(got, ctx.run("bf16", f"--parallel.zero={zero}")[0])
        return at_most(gap, SAME_GAP, {"against": f"zero {zero} without offload", "offload": record.get("offload")})

    def pinned(mode: str, zero: int):
        stats = ctx.run("bf16", f"--parallel.zero={zero}", f"--parallel.offload={mode}")[1].get("offload", {})
        if not ctx.cuda:
            return recorded(stats.get("pinned_bytes"), "on the CPU host and device are one memory: judged on CUDA")
        return at_least(stats.get("pinned_bytes", 0), 1, stats)

    part.run("zero3 param_dtype bf16 vs unsharded bf16", zero3_bf16, 20)
    for mode, zero in (("optimizer", 1), ("params", 3)):
        part.run(f"offload {mode} (zero {zero}) vs without", lambda m=mode, z=zero: offload(m, z), 20)
        part.run(f"offload {mode}: pinned host bytes", lambda m=mode, z=zero: pinned(m, z), 1)


# ---- attention -------------------------------------------------------------------------------------
def _attention_check():
    spec = importlib.util.spec_from_file_location("attention_check", ROOT / "benchmarks" / "attention_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def attention(part: PartLog, ctx: Context) -> None:
    from fivefold.model.blockwise import blockwise_attention
    from fivefold.model.flex import flex_attention_core

    check = _attention_check()
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    bound = 0.05 if ctx.cuda else 1e-4  # bf16: its 2^-8 over sums; fp32: rounding

    heads = (8, 2, 64) if ctx.cuda else (2, 1, 16)  # (H, K, D): grouped queries either way

    def against_rule(fn, T: int, backward: bool):
        q, k, v, mask = check.inputs(T, *heads, dtype, ctx.device)
        ours = check.outputs_and_grads(fn, q, k, v, mask, backward)
        ref = check.outputs_and_grads(check.dense, q, k, v, mask, backward)
        errors = {what: float((a - b).abs().max() / b.abs().max())
                  for what, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], ours, ref, strict=False)}
        return at_most(max(errors.values()), bound, {"T": T, "heads": heads, "dtype": str(dtype),
                                                     "relative_max_error": errors, "backward": backward})

    for T in (1000, 2000):  # first: no compile, so a slow FlexAttention compile cannot crowd them out
        part.run(f"memory-efficient tiles vs fp32 rule, T={T}",
                 lambda t=T: against_rule(lambda *a: blockwise_attention(*a), t, True), 5)
    flex = lambda *a: flex_attention_core(*a, compiled=ctx.cuda)  # noqa: E731 - eager on the CPU
    T = 2048 if ctx.cuda else 128
    part.run(f"flex (documents, window, sinks) vs fp32 rule, T={T}", lambda: against_rule(flex, T, ctx.cuda), 45)
    part.run("flex at T=32768: peak memory (GB)", lambda: flex_memory(ctx, check, flex), 40)


def flex_memory(ctx: Context, check, flex):
    """Forward and backward at T = 32k (CPU: forward at 256): the peak above the inputs, against one
    head's dense fp32 score matrix, which a kernel that materialised the scores would exceed H times."""
    T, H, K, D = (32768, 16, 4, 128) if ctx.cuda else (256, 2, 1, 16)
    q, k, v, mask = check.inputs(T, H, K, D, torch.bfloat16 if ctx.cuda else torch.float32, ctx.device)
    if not ctx.cuda:  # no FlexAttention backward on the CPU, and no allocator counter
        out = check.outputs_and_grads(flex, q, k, v, mask, backward=False)[0]
        return recorded(None, f"CPU: forward at T={T} ran, finite {bool(out.isfinite().all())}; no memory counter")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    check.outputs_and_grads(flex, q, k, v, mask, backward=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return at_most(peak / 1e9, T * T * 4 / 1e9, {"T": T, "heads": [H, K, D], "bound": "one head's fp32 scores"})


# ---- compile ---------------------------------------------------------------------------------------
def compile_(part: PartLog, ctx: Context) -> None:
    backend = "inductor" if ctx.cuda else "aot_eager"  # aot_eager: the same capture, no C++ compiler
    dtype, bound = ("bf16", BF16_GAP / 2) if ctx.cuda else ("fp32", 1e-4)

    def compiled(recompute: str):
        extra = (f"--train.recompute={recompute}",)
        gap = relative_gap(ctx.run(dtype, *extra, compile_options={"backend": backend})[0], ctx.run(dtype, *extra)[0])
        return at_most(gap, bound, f"compile_blocks(backend={backend}) against eager, recompute {recompute}")

    part.run(f"compile ({backend}) vs eager, no recompute", lambda: compiled("none"), 35)
    part.run(f"compile ({backend}) vs eager, full recompute", lambda: compiled("full"), 35)
    def chunked_loss():  # eager: train.compile compiles the blocks, never the head and its loss
        gap = relative_gap(ctx.run(dtype, "--train.loss_chunk=16")[0], ctx.run(dtype, "--train.loss_chunk=0")[0])
        return at_most(gap, SAME_GAP, "train.loss_chunk 16 (4 chunks of the 64 tokens) against 0 (all at once)")

    part.run("chunked loss vs the whole loss", chunked_loss, 10)


# ---- optimizer -------------------------------------------------------------------------------------
def optimizer(part: PartLog, ctx: Context) -> None:
    def bf16_muon():
        gap = relative_gap(ctx.run("bf16", "--optim.name=muon")[0], ctx.run("fp32", "--optim.name=muon")[0])
        return at_most(gap, BF16_GAP, "largest relative loss gap, Muon in bf16 against fp32")

    def qk_clip():
        """The last step's largest logit: 0.103 unclipped on the CPU (tau 1e9 records it and clips
        nothing), held to about tau = 0.05 by the clip (the step after a clip may pass it by a step's
        growth: 10% allowed, which the unclipped logit must exceed for the check to mean anything)."""
        tau = 0.05
        free = ctx.run("bf16", "--optim.name=muon", "--optim.qk_clip=1e9")[1].get("qk_clip", {})
        got, record = ctx.run("bf16", "--optim.name=muon", f"--optim.qk_clip={tau}")
        clipped = record.get("qk_clip", {}).get("max_logit", math.nan)
        detail = {"unclipped": free, "clipped": record.get("qk_clip"), "losses": got}
        if not free.get("max_logit", 0.0) > 1.1 * tau:  # the bound would not tell clipped from not
            return free.get("max_logit"), f"> {1.1 * tau:g} unclipped", False, detail
        return at_most(clipped if math.isfinite(clipped) else math.inf, 1.1 * tau, detail)

    part.run("muon vs torch.optim.Muon + AdamW, one process", lambda: muon_vs_torch(ctx), 5)
    part.run("muon bf16 step vs fp32", bf16_muon, 10)
    part.run("qk_clip holds the largest logit at tau (bf16)", qk_clip, 10)


def muon_vs_torch(ctx: Context):
    """Three steps of seeded random gradients on the tiny MoE model (each expert its own matrix):
    fivefold's Muon against torch.optim.Muon on the same matrices (an expert as its (out, in) Linear)
    and AdamW on the rest; the largest parameter difference relative to the parameters' largest."""
    import dataclasses

    from fivefold.config.load import load_config
    from fivefold.model.transformer import Transformer
    from fivefold.parallel.comm.collectives import AxisGroup, CommStats
    from fivefold.parallel.muon import build_muon, is_muon_matrix
    from fivefold.parallel.optimizer import build_optimizer

    class OneRank:  # DDP's view on one process: the optimizer steps the parameters themselves
        def __init__(self, model):
            self.model, self.params = model, list(model.parameters())

        def optimizer_params(self):
            return self.params

        def group(self, name):
            return AxisGroup(name=name, label=name, pg=None, size=1, rank=0, stats=CommStats())

    cfg = load_config(ROOT / "configs" / "tiny.toml", ["--model.preset=tiny-moe", "--optim.name=muon"])
    with torch.device(ctx.device):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=64))
    model.init_weights()
    ours = build_muon(OneRank(model), OneRank(model), cfg.optim, build_optimizer)
    leaves = {}
    for n, p in model.named_parameters():
        pieces = {f"{n}[{e}]": p[e].T for e in range(p.shape[0])} if p.ndim == 3 and is_muon_matrix(n, p) else {n: p}
        leaves |= {k: v.detach().clone().contiguous().requires_grad_() for k, v in pieces.items()}
    muon = [t for k, t in leaves.items() if is_muon_matrix(k.split("[")[0], t)]
    reference = [torch.optim.Muon(muon, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay,
                                  adjust_lr_fn=cfg.optim.muon.adjust_lr),
                 build_optimizer([t for t in leaves.values() if all(t is not m for m in muon)], cfg.optim)]
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for n, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=g).to(ctx.device)
            for k, t in leaves.items():
                if k == n or k.startswith(n + "["):
                    t.grad = p.grad[int(k[len(n) + 1:-1])].T.contiguous() if k != n else p.grad.clone()
        ours.step()
        for opt in reference:
            opt.step()
    gaps = []
    for n, p in model.named_parameters():
        mine = [p[e].T for e in range(p.shape[0])] if p.ndim == 3 and is_muon_matrix(n, p) else [p]
        theirs = [t for k, t in leaves.items() if k == n or k.startswith(n + "[")]
        gaps += [float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-12))
                 for a, b in zip(mine, theirs, strict=True)]
    return at_most(max(gaps), 1e-6, "largest relative parameter difference (0 on the CPU: bit for bit)")


PARTS = {"precision": precision, "moe": moe, "sharding": sharding, "attention": attention, "compile": compile_,
         "optimizer": optimizer}
