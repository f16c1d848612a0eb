"""Tensor-parallel step time and peak memory: fivefold against torch DTensor tensor parallel.

Run: `.venv/bin/python benchmarks/tensor_parallel.py [--steps N] [--rounds R] [--quick] [--profile]`
(extra `--section.key=value` arguments override the config, e.g. `--model.n_layers=8`).

What is compared, on 2 ranks (tp = 2, dp = 1, pp = 1, gloo, CPU, fp32), the same model, initial
weights and batches:
1. `tp`:    fivefold `--parallel.tp=2`                    vs torch `parallelize_module` without
                                                             sequence parallel;
2. `tp_sp`: fivefold `--parallel.tp=2 --parallel.sp=true` vs the same with `SequenceParallel`;
3. `tp_sp_overlap`: fivefold with `--parallel.tp_overlap=true` too (comm/collective_matmul.py) vs
   the same torch side. torch's own overlap (async TP: `enable_symm_mem_for_group` and the
   micro-pipelined TP passes of torch.compile) runs on CUDA with symmetric memory only, so the
   native peer here is blocking DTensor sp. fivefold's side also reports its exposed tp time per
   step (the step timer's `exposed_tp`: the time its thread is blocked in tp communication), and
   the summary sets the overlapped variant beside the blocking `tp_sp`: `tp_overlap_ratio_step_time`
   and `tp_overlap_ratio_exposed_tp` (overlapped / blocking, from the two variants' runs).
The model is fivefold's Transformer (`build_model`, seeded) from configs/tiny.toml with dim 256,
8 heads (4 per rank), ffn 768, 4 layers, seq 128, one micro-batch of 8 sequences per step (both
ranks see the same batch, as tp ranks do), byte vocabulary padded to 320.

Both sides shard the same things, as Megatron-LM and PyTorch's Llama tutorial / torchtitan do:
attention by heads and SwiGLU by hidden units, *and* the embedding and the output head along the
vocabulary, with the loss computed from vocabulary-sharded logits (no rank forms (B, T, V)).
- fivefold: `parallelize(model, mesh, cfg, derived)` (`apply_tensor_parallel`: Column/RowParallelLinear,
  VocabParallelEmbedding, `vocab_parallel_cross_entropy`), stepped as train/loop.py steps it:
  `pipeline.run([(x, y)], tokens)` (one stage, one micro-batch), then `optimizer_step()`: the
  global-norm clip over the groups gradients are split across and AdamW (dp = 1: no reduction).
- torch: `parallelize_module` on a 1-D `init_device_mesh("cpu", (2,))`, per block
  ColwiseParallel for attn.wq/wk/wv and ffn.gate/up, RowwiseParallel for attn.wo and ffn.down,
  and a `PrepareModuleInput` on attn and on ffn that makes their input Replicate once for all of
  their column-parallel layers (as the tutorial does; fivefold also enters each region once, and
  without it torch would all-reduce the input gradient once per Colwise layer, i.e. 3 times for
  q, k, v). Model level: RowwiseParallel(input_layouts=Replicate()) for tok_embeddings (a
  vocabulary-sharded embedding) and ColwiseParallel(output_layouts=Shard(-1),
  use_local_output=False) for output, the loss under `loss_parallel()`. With sp: SequenceParallel
  on attn_norm, ffn_norm and norm, Rowwise with output_layouts=Shard(1) (wo, down, embedding: a
  reduce-scatter), the regions' inputs and the head's input_layouts=Shard(1) (an all-gather). The
  forward gets `positions=arange(T)` (under sp the embedding's output holds T/2 tokens). Attention
  reads its local head count from shapes, so `use_local_output=True` (the Colwise/Rowwise default)
  runs the unchanged model code. Clipping: torch's `get_total_norm` + `clip_grads_with_norm_`
  (`clip_torch`: without sp the norms stay plain tensors, and torch's foreach norm refuses a mix
  of DTensors and tensors, so each kind is normed apart and the two combined). Under sp the norm
  weights' gradients are Partial DTensors that DTensor all-reduces wherever they are read (in the
  clipping norm, then again in each AdamW use: ~36 all-reduces of 1 KB per step, a few ms; fivefold
  all-reduces each once, from a hook, in backward). That is torch's behaviour, left as it is.
  Both optimizers come from `build_optimizer` (AdamW: foreach on the CPU, fused on CUDA).

Loss: the sum of token losses / the token count (the mean over every token) on both: torch runs
fivefold's `cross_entropy_sum` on its vocabulary-sharded DTensor logits under `loss_parallel()`,
fivefold's executor runs `vocab_parallel_cross_entropy` (the same sum, from its shards). Both
take the softmax over the tokenizer's 257 ids only: fivefold masks the vocabulary's padding ids
(257..319, padded so tp divides it) out of the loss, and torch adds -inf to their logits (a bias
sharded as the logits are, so nothing is communicated for it). Every
rank computes the whole loss; the first step's must agree within 1e-5 absolute (`loss_check`):
the same forward on the same weights and data, only the summation order can differ.

How time is measured: a step is forward + backward (with every tp collective) + gradient-norm
clipping + the AdamW step, i.e. the optimizer is inside the timed region on both sides;
perf_counter on every rank, and a step's time is the slowest rank's. As in data_parallel.py and
pipeline_parallel.py (the shared helpers are in common.py): each round of a variant gets a fresh
pair of workers forked by `fivefold.parallel.forked_ranks.run_workers` (one thread each, OMP_NUM_THREADS=1), holding
both sides (each with its own model, process groups and optimizer), which alternate step by step
(A B, B A, ...) with an untimed loss all-reduce between steps that lines the ranks up; which side
is built and stepped first flips from round to round. Each side first runs `--warmup` untimed
steps. The reported step time is the median over all timed steps of all rounds; per-round
medians are listed too.

How memory is measured: as data_parallel.py does, with the same helpers: one extra untimed run per
side and variant (3 steps, fresh workers, that side alone, glibc returning freed memory at once):
peak RSS (VmHWM, reset right before the model is built) minus file-backed and shared RSS and
minus the anonymous RSS at the reset; the maximum over ranks. It includes the full model both
sides build before sharding it (~14 MB here, the same on both).

`--profile` adds, per variant, one run of both sides under torch.profiler (after the warm-up,
untimed otherwise) and prints each side's top operators by self CPU time on rank 0: where the
time goes when the ratio is off.

Reading the numbers: absolute times on a shared 2-core machine are noise; the ratios
fivefold / torch between alternated runs are what to read (below 1: fivefold faster or smaller),
and even they move by a few percent between invocations. Output: progress and checks on stderr;
on stdout one JSON object per variant, and last a summary object whose measured ratios have
"ratio" in their keys (the issue's target, step-time ratio <= 1.10, printed beside them, not
asserted).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from benchmarks.common import (  # noqa: E402
    alternate,
    comparison_record,
    finish_summary,
    log,
    make_parser,
    measure_peak,
    median,
    memory_fields,
    memory_over_ranks,
    memory_runs,
    parse,
    prewarm,
    ratio,
    report,
    slowest_rank,
    timed_rounds,
)
from benchmarks.pipeline_sides import global_batches  # noqa: E402  (the same on every rank)
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config, replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import tokenizer_vocab, unpadded_vocab  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402

torch.set_num_threads(1)
# DTensor's sequence-parallel redistributions call all_gather_into_tensor / reduce_scatter_tensor,
# deprecated in favour of *_single; the forked workers inherit this filter.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

VARIANTS = {"tp": (False, False), "tp_sp": (True, False), "tp_sp_overlap": (True, True)}  # name -> (sp, tp_overlap)
TARGETS = {f"{name}_ratio_step_time": 1.10 for name in VARIANTS}  # fivefold / torch at tp = 2, from the issue


def variant_cfg(cfg: Config, name: str) -> Config:
    sp, overlap = VARIANTS[name]
    return replace(cfg, parallel={"sp": sp, "tp_overlap": overlap})


# ---- the two sides ----------------------------------------------------------------------------------
class FivefoldSide:
    """fivefold's tensor parallel on this rank, stepped as train/loop.py steps it."""

    kind = "fivefold"

    def __init__(self, cfg: Config, world: int, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        derived = derive(cfg, world, unpadded_vocab(cfg))
        self.par = parallelize(build_model(cfg, derived.vocab_size), mesh, cfg, derived)
        self.scaler = LossScaler(cfg.train)  # fp32: a scale of 1 that never skips
        self.times: list[float] = []
        self.losses: list[float] = []
        self.exposed_tp: list[float] = []  # seconds per step this thread was blocked in tp communication

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        o, par = self.cfg.optim, self.par
        self.mesh.timer.begin_step()
        stats = par.pipeline.run([(x, y)], x.numel())  # one stage, one micro-batch
        par.optimizer_step(o.lr, self.scaler, o.grad_clip)
        self.exposed_tp.append(self.mesh.timer.end_step()[1]["exposed_tp"])
        return float(stats.loss)  # the whole loss (/ tokens), the same on every tp rank


def torch_tp_plan(model: torch.nn.Module, mesh, sp: bool) -> None:
    """PyTorch's Llama tensor-parallel plan (the TP tutorial's, torchtitan's) on fivefold's module names."""
    seq = Shard(1) if sp else Replicate()  # layout of activations outside the matmuls
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),  # vocabulary-sharded
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),  # loss_parallel
    }
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers.values():
        plan = {
            # The region's input becomes Replicate once (an all-gather under sp), for all its Colwise layers.
            "attn": PrepareModuleInput(input_layouts=(seq, None, None, None),  # x, cos, sin, document mask
                                       desired_input_layouts=(Replicate(), None, None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=seq),
            "ffn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "ffn.gate": ColwiseParallel(), "ffn.up": ColwiseParallel(),
            "ffn.down": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            plan["attn_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, mesh, plan)


class TorchSide:
    """torch DTensor tensor parallel with the same model, loss, clipping and AdamW."""

    kind = "torch"

    def __init__(self, cfg: Config, world: int):
        self.cfg = cfg
        vocab = derive(cfg, world, unpadded_vocab(cfg)).vocab_size
        self.model = build_model(cfg, vocab)
        mesh = init_device_mesh("cpu", (world,))
        torch_tp_plan(self.model, mesh, cfg.parallel.sp)
        # fivefold masks the vocabulary's padding ids (257..V-1 of a byte vocabulary padded to divide
        # by tp) out of the softmax; so does this side: -inf added to their logits, a (V,) bias
        # sharded like the logits' last dim, so the vocabulary-parallel loss stays local.
        real = cfg.model.vocab_size or tokenizer_vocab(cfg)
        bias = torch.where(torch.arange(vocab) < real, 0.0, float("-inf"))
        self.vocab_bias = distribute_tensor(bias, mesh, [Shard(0)]) if real < vocab else None
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.model, cfg.optim)
        self.positions = torch.arange(cfg.train.seq_len)  # every token's true position (sp: the embedding keeps T/2)
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        with loss_parallel():
            logits = self.model(x, self.positions)  # (B, T, V) DTensor, Shard(-1)
            if self.vocab_bias is not None:
                logits = logits + self.vocab_bias
            loss = cross_entropy_sum(logits, y) / y.numel()  # a Replicate DTensor
            loss.backward()
        clip_torch(self.params, self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        return float(loss.to_local() if isinstance(loss, DTensor) else loss)


def clip_torch(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ over DTensor and plain gradients together (without sp the norms stay
    plain tensors, and torch's foreach norm refuses a mix): the total norm of each kind with
    `get_total_norm` (a DTensor norm made whole with full_tensor(), as torchtitan does), then
    `clip_grads_with_norm_` on each kind with the combined norm."""
    kinds = [[p for p in params if p.grad is not None and isinstance(p.grad, DTensor) == is_dt]
             for is_dt in (True, False)]
    norms = []
    for ps in kinds:
        if ps:
            norm = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    for ps in kinds:
        if ps:
            torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def _make_side(kind: str, cfg: Config, world: int, mesh: Mesh):
    return FivefoldSide(cfg, world, mesh) if kind == "fivefold" else TorchSide(cfg, world)


def _timed_step(side, x: torch.Tensor, y: torch.Tensor) -> None:
    began = time.perf_counter()
    loss = side.step(x, y)
    side.times.append(time.perf_counter() - began)
    total = torch.tensor(loss, dtype=torch.float64)  # outside the timed region; lines the ranks up
    dist.all_reduce(total)
    side.losses.append(float(total) / dist.get_world_size())  # every tp rank holds the whole loss


# ---- workers -------------------------------------------------------------------------------------------
def _timed_worker(rank: int, world: int, name: str, kinds: tuple[str, str], cfg: Config, warmup: int,
                  steps: int) -> list[dict]:
    """Both sides in these processes, alternating step by step (A B, B A, ...) after their warm-up."""
    cfg = variant_cfg(cfg, name)
    mesh = Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg)))
    sides = [_make_side(kind, cfg, world, mesh) for kind in kinds]
    results = alternate(sides, global_batches(cfg, warmup + steps), warmup, _timed_step)
    for side, result in zip(sides, results, strict=True):
        if isinstance(side, FivefoldSide):
            result["exposed_tp"] = side.exposed_tp[warmup:]
    return results


def _memory_worker(rank: int, world: int, name: str, kind: str, cfg: Config, steps: int) -> dict:
    """One side alone, glibc returning freed memory: its peak RSS above the pre-model baseline."""
    cfg = variant_cfg(cfg, name)
    # process groups exist before the baseline (torch's 1-D mesh over the whole world is the default group:
    # nothing new)
    mesh = Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg)))

    def run() -> FivefoldSide | TorchSide:
        side = _make_side(kind, cfg, world, mesh)
        for x, y in global_batches(cfg, steps):
            _timed_step(side, x, y)
        return side

    return measure_peak(run)


def _profile_worker(rank: int, world: int, name: str, cfg: Config, warmup: int, steps: int, top: int) -> dict:
    """Both sides, each profiled alone over `steps` steps after its warm-up: top ops by self CPU time."""
    cfg = variant_cfg(cfg, name)
    mesh, out = Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg))), {}
    for kind in ("fivefold", "torch"):
        side = _make_side(kind, cfg, world, mesh)
        batches = global_batches(cfg, warmup + steps)
        for x, y in batches[:warmup]:
            _timed_step(side, x, y)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for x, y in batches[warmup:]:
                _timed_step(side, x, y)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events)
        out[kind] = {"step_s": round(median(side.times[warmup:]), 4),
                     "self_cpu_s_per_step": round(total / 1e6 / steps, 4),
                     "top": [(e.key, round(e.self_cpu_time_total / 1e6 / steps, 4), e.count // steps)
                             for e in events[:top]]}
    return out


# ---- driver ----------------------------------------------------------------------------------------------
def run_timed(name: str, kinds: tuple[str, str], cfg: Config, world: int, warmup: int, steps: int) -> dict:
    results = run_workers(_timed_worker, world, name, kinds, cfg, warmup, steps, timeout=300.0)  # [rank][side]
    out = slowest_rank(results, kinds)
    side = kinds.index("fivefold")  # exposed tp: the most any rank was blocked, step by step
    out["fivefold"]["exposed_tp"] = [max(ts) for ts in zip(*(r[side]["exposed_tp"] for r in results), strict=True)]
    return out


def run_memory(name: str, kind: str, cfg: Config, world: int, steps: int) -> dict:
    return memory_over_ranks(run_workers(_memory_worker, world, name, kind, cfg, steps, timeout=300.0))


def summarize(name: str, runs: dict[str, list[dict]], mem: dict[str, dict], steps: int, rounds: int) -> dict:
    sp, overlap = VARIANTS[name]
    head = {"name": name, "fivefold": f"fivefold tp=2 sp={str(sp).lower()}" + (" tp_overlap=true" if overlap else ""),
            "torch": "parallelize_module Colwise/Rowwise" + (" + SequenceParallel" if sp else "")
                     + ", vocab-parallel embedding/head, loss_parallel"}
    memory = (memory_fields(mem["fivefold"], mem["torch"], fields=("peak_mb", "ratio", "per_rank", "peak_rss_mb",
                                                                   "malloc_set"))
              if mem else {"ratio_peak_memory": None})  # --no-memory
    record = comparison_record(head, runs["fivefold"], runs["torch"], memory, steps, rounds)
    record["fivefold_exposed_tp_s"] = round(median([x for r in runs["fivefold"] for x in r["exposed_tp"]]), 4)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), VARIANTS, steps=8, rounds=2, unit="variant")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory runs")
    parser.add_argument("--profile", action="store_true",
                        help="also profile both sides (torch.profiler, rank 0) per variant: top ops by self CPU time")
    args, overrides = parse(parser, argv)
    world = 2  # tp = 2, dp = 1: the target applies there, and 2 ranks fill the 2 cores
    cfg = load_config(args.config, [
        "--model.dim=256", "--model.n_heads=8", "--model.n_kv_heads=8", "--model.ffn_dim=768", "--model.n_layers=4",
        "--train.seq_len=128", "--train.micro_batch=8", "--train.global_batch=8", "--train.dtype=fp32",
        "--train.device=cpu", f"--parallel.tp={world}", "--parallel.dp=1", "--parallel.pp=1", *overrides])
    m, t = cfg.model, cfg.train
    vocab = derive(cfg, world, unpadded_vocab(cfg)).vocab_size
    n_params = sum(p.numel() for p in build_model(cfg, vocab).parameters())
    prewarm()
    log(f"model dim {m.dim}, {m.n_heads} heads, ffn {m.ffn_dim}, {m.n_layers} layers, vocab "
        f"{vocab}, {n_params / 1e6:.2f}M params; tp {world}, batch {t.micro_batch} x seq "
        f"{t.seq_len}, fp32; {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps per run"
        f"{'' if args.no_memory else ', then a memory run each'}; a step is forward + backward + clip + AdamW")

    began = time.perf_counter()
    runs = timed_rounds(args.only, args.rounds,
                        lambda name, kinds: run_timed(name, kinds, cfg, world, args.warmup, args.steps), began, 6)
    # 3 steps: the optimizer state exists from the first step on
    mem = {} if args.no_memory else memory_runs(args.only, lambda name, kind: run_memory(name, kind, cfg, world, 3),
                                                began, 6)
    profiles = {}
    if args.profile:
        for name in args.only:
            profiles[name] = run_workers(_profile_worker, world, name, cfg, args.warmup, args.steps, 12,
                                         timeout=300.0)[0]
            for kind, p in profiles[name].items():
                log(f"profile {name} {kind} (rank 0): {p['step_s']:.4f} s/step, self CPU {p['self_cpu_s_per_step']:.4f}"
                    f" s/step; top ops (self s/step, calls/step):\n" + "\n".join(
                        f"    {key[:60]:60s} {s:.4f} {n:5d}" for key, s, n in p["top"]))

    summary: dict = {"summary": True, "tp": world}
    for name in args.only:
        out = summarize(name, runs[name], mem.get(name, {}), args.steps, args.rounds)  # {}: --no-memory
        if name in profiles:
            out["profile_rank0"] = profiles[name]
        report(name, out, summary)
    if {"tp_sp", "tp_sp_overlap"} <= set(args.only):  # the overlap against fivefold's own blocking path
        def of(key: str) -> tuple[float, float]:
            return tuple(median([x for r in runs[n]["fivefold"] for x in r[key]]) for n in ("tp_sp", "tp_sp_overlap"))

        (steps_b, steps_o), (tp_b, tp_o) = of("times"), of("exposed_tp")
        summary["tp_overlap_ratio_step_time"] = ratio(steps_o, steps_b)
        summary["tp_overlap_ratio_exposed_tp"] = ratio(tp_o, tp_b)
        log(f"tp_overlap against blocking sp: step {steps_o:.4f} / {steps_b:.4f} s, "
            f"exposed tp {tp_o:.4f} / {tp_b:.4f} s")
    finish_summary(summary, TARGETS, began)


if __name__ == "__main__":
    main()
