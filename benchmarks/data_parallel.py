"""Data-parallel step time and peak memory: fivefold against torch, and bucket overlap on/off.

Run: `.venv/bin/python benchmarks/data_parallel.py [--steps N] [--rounds R] [--quick]`
(extra `--section.key=value` arguments override the config, e.g. `--model.n_layers=8`).

What is compared, each on the same number of ranks (2 by default, gloo, CPU, fp32):
1. `ddp`:   torch `DistributedDataParallel`          vs fivefold DDP (`parallel.zero = 0`);
2. `zero1`: torch `ZeroRedundancyOptimizer` (AdamW,   vs fivefold ZeRO-1 (`parallel.zero = 1`);
            same groups) over a `DistributedDataParallel` model
3. `zero3`: torch FSDP2 `fully_shard` (every block,   vs fivefold ZeRO-3 (`parallel.zero = 3`);
            then the root; reshard_after_forward=True)
4. `overlap`: fivefold DDP with `wrapper.overlap = True` vs `False` (bucket collectives started
   during backward, or all of them after it).
Every run builds the same model with the same initial weights (`build_model`, seeded) and trains
it on the same batches (random token ids from a generator seeded per step; rank r takes rows
[r B, (r+1) B) of each global batch), with AdamW from `build_optimizer` on both sides and
gradient clipping at `optim.grad_clip`. ZeroRedundancyOptimizer takes `build_optimizer`'s two
parameter groups and hyper-parameters; it shards whole parameters over the ranks (fivefold ZeRO-1
shards every parameter's rows), steps its shard and broadcasts the updated parameters (fivefold:
one all-gather per bucket). Its gradients are DDP's all-reduced ones, clipped on every rank with
torch's `clip_grad_norm_` before its step. Bucket caps are matched: fivefold `parallel.bucket_mb`
(10^6 bytes) and torch DDP `bucket_cap_mb` (MiB) are set to the same number of bytes.

Loss scaling: fivefold sums gradients over ranks and divides each rank's summed token loss by the
global token count; torch DDP and FSDP2 average gradients over ranks, so their loss is divided by
the rank's own token count. Both then follow the gradient of the mean over every token, and the
first-step losses must agree (checked and printed: `loss_check`, tolerance 1e-5 absolute; they
are the same forward on the same weights and data, so only summation order can differ).

How time is measured: a step is forward + backward (with the gradient reduction) + clip +
optimizer step, timed with perf_counter on every rank; a step's time is the slowest rank's. The
launcher is `fivefold.parallel.forked_ranks.run_workers`: each round of a comparison gets a fresh pair of forked
gloo workers (fork, so the imports done once here are not paid again; 1 thread and
OMP_NUM_THREADS=1 in each). Both sides of the comparison live in those workers, each with its own
model, wrapper and optimizer, and they alternate step by step (A B, B A, A B, ...), so that a load
change on this shared machine hits both alike; which side is built and stepped first flips from
round to round. Each side first runs `--warmup` untimed steps (FSDP2's lazy init, torch DDP's
bucket rebuild at its second step, allocator warm-up). The reported step time is the median over
all timed steps of all rounds; each side's per-round medians are listed too, to judge the spread.

How memory is measured: peak RSS of processes that run one configuration alone: one extra untimed
"memory run" per configuration (3 steps, fresh workers) after the timed rounds. In it:
- glibc is told (mallopt) to give freed memory back at once: a fixed 64 KiB mmap threshold, so
  each tensor above it is its own mapping, unmapped when freed, and heap trimming above 128 KiB.
  By default glibc raises its threshold after the first large free and then serves activations
  from a heap it keeps, so RSS would show "the most the heap ever held, plus fragmentation"
  (~45 MB more here, and noisy), not what the configuration holds. It costs page faults, hence
  it is never set in the timed runs;
- after the process groups exist and right before the model is built, the worker resets its peak
  RSS to its current RSS (writing 5 to /proc/self/clear_refs, Linux >= 4.0) and reads its
  anonymous RSS (RssAnon) as the baseline;
- after the last step it reads the peak (VmHWM, which is what getrusage's ru_maxrss reports) and
  subtracts the file-backed and shared RSS (RssFile + RssShmem: library code a forked worker maps
  in as it first runs it, ~30-50 MB and the same for every configuration) and the baseline.
So `*_peak_mb` is the peak, from building the model to the last step, of the memory the run added:
parameters (the full model too, before ZeRO-3 / FSDP2 shard it), gradients, optimizer state,
activations, communication buffers; the maximum over ranks. One-off allocations torch makes on
first use (~26 MB of RSS when the first optimizer is built) are paid in this parent before forking
(`common.prewarm`), so they count for no configuration. `*_peak_rss_mb` is the absolute peak RSS of the
same run, mostly the Python and torch every configuration shares. At this model size activations
dominate (parameters, gradients and AdamW state together are ~15 MB), so ZeRO-3 saves little.

Reading the numbers: absolute times on a shared 2-core machine are noise (another process's test
run moves them by tens of percent); the ratios between alternated runs are what to read, and even
they move by a few percent from one invocation to the next. Output: human-readable progress and
checks on stderr; on stdout one JSON object per comparison, then the overlap line, and last a
summary object whose measured ratios have "ratio" in their keys (targets from the issue are
printed beside them, not asserted).
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
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import fivefold.parallel.data.fsdp  # noqa: E402,F401  imported here so forked workers do not pay for it
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
    parse,
    prewarm,
    report,
    slowest_rank,
)
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config, replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import unpadded_vocab  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.data import apply_data_parallel  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer, clip_grad_norm  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402

torch.set_num_threads(1)

# name -> (fivefold side, torch side); "overlap" compares two fivefold runs.
COMPARISONS = {
    "ddp": ("fivefold_ddp", "torch_ddp"),
    "zero1": ("fivefold_zero1", "torch_ddp_zero1"),
    "zero3": ("fivefold_zero3", "torch_fsdp2"),
    "overlap": ("fivefold_ddp_overlap", "fivefold_ddp_no_overlap"),
}
# fivefold / torch, from the issue; none for zero1
TARGETS = {"ddp_ratio_step_time": 1.10, "zero3_ratio_step_time": 1.15}
ZERO = {"fivefold_zero1": 1, "fivefold_zero3": 3}  # fivefold side -> parallel.zero (others: 0)


def clip_fivefold(dp, max_norm: float) -> torch.Tensor:
    """The wrapper's global-norm clipping, as Parallelized.optimizer_step does it."""
    return clip_grad_norm(dp.gradients(), max_norm, dp.norm_groups)  # groups the gradients are split over


# ---- one configuration on one rank ---------------------------------------------------------------
def _batches(cfg: Config, world: int, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (inputs, targets) pairs of this rank's rows of the global batch; the same in every run."""
    t = cfg.train
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(t.seed * 100_003 + step)
        tokens = torch.randint(0, 256, (t.micro_batch * world, t.seq_len + 1), generator=g)  # (B_global, T+1)
        mine = tokens[rank * t.micro_batch : (rank + 1) * t.micro_batch]  # (B, T+1)
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


class Side:
    """One configuration on this rank: its own model (the same initial weights), wrapper, optimizer."""

    def __init__(self, kind: str, cfg: Config, world: int, meshes: dict):
        self.kind, self.times, self.cpu_times, self.losses = kind, [], [], []
        t = cfg.train
        o = self.optim = cfg.optim  # step() clips with it
        self.local_tokens = t.micro_batch * t.seq_len
        self.global_tokens = self.local_tokens * world
        derived = derive(cfg, world, unpadded_vocab(cfg))
        self.model = build_model(cfg, derived.vocab_size)
        if kind.startswith("fivefold"):
            cfg = replace(cfg, parallel={"zero": ZERO.get(kind, 0)})
            self.dp = apply_data_parallel(self.model, meshes["fivefold"], cfg, derived)
            self.dp.overlap = kind != "fivefold_ddp_no_overlap"
            self.opt = build_optimizer(self.dp.optimizer_params(), o)  # as parallelize() builds it
            self.loss_weight = 1.0  # the global loss is the sum of the ranks' losses
            return
        if kind in ("torch_ddp", "torch_ddp_zero1"):
            cap_mib = cfg.parallel.bucket_mb * 1e6 / 2**20  # the same bytes as fivefold's bucket_mb
            self.net = DistributedDataParallel(self.model, bucket_cap_mb=cap_mib)
        elif kind == "torch_fsdp2":
            for block in self.model.layers.values():
                fully_shard(block, mesh=meshes["torch"], reshard_after_forward=True)
            self.net = fully_shard(self.model, mesh=meshes["torch"], reshard_after_forward=True)
        else:
            raise ValueError(kind)
        self.opt = build_optimizer(self.model, o)  # after fully_shard: it steps the DTensor shards
        if kind == "torch_ddp_zero1":  # build_optimizer's groups and hyper-parameters, the state sharded
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in self.opt.param_groups]
            self.opt = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, lr=o.lr,
                                               betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)  # as build_optimizer
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.loss_weight = 1.0 / world  # the global loss is the mean of the ranks' losses

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.optim
        if self.kind.startswith("fivefold"):
            loss = cross_entropy_sum(self.model(x), y) / self.global_tokens  # the wrapper sums over ranks
            self.dp.backward(loss, last_micro_batch=True)
            clip_fivefold(self.dp, o.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.dp.after_step()  # ZeRO-3: nothing to gather, the next forward gathers
        else:
            loss = cross_entropy_sum(self.net(x), y) / self.local_tokens  # torch averages over ranks
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, o.grad_clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        return loss

    def timed_step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        cpu, began = time.process_time(), time.perf_counter()
        loss = self.step(x, y)
        self.times.append(time.perf_counter() - began)
        self.cpu_times.append(time.process_time() - cpu)  # the process's CPU seconds: work, not waits
        total = loss.detach().double() * self.loss_weight  # outside the timed region
        dist.all_reduce(total)
        self.losses.append(float(total))


def _setup(rank: int, world: int, cfg: Config) -> dict:
    torch.set_num_threads(1)
    # FSDP2 calls all_gather_into_tensor / reduce_scatter_tensor, deprecated in favour of *_single.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    return {"fivefold": Mesh.from_config(cfg, derive(cfg, world, unpadded_vocab(cfg))),
            "torch": init_device_mesh("cpu", (world,))}


def _timed_worker(rank: int, world: int, kinds: tuple[str, str], cfg: Config, warmup: int, steps: int) -> list[dict]:
    """Both sides in these processes, alternating step by step (A B, B A, ...) after their warm-up."""
    meshes = _setup(rank, world, cfg)
    sides = [Side(kind, cfg, world, meshes) for kind in kinds]
    return alternate(sides, _batches(cfg, world, rank, warmup + steps), warmup, Side.timed_step)


def _memory_worker(rank: int, world: int, kind: str, cfg: Config, steps: int) -> dict:
    """One side alone, glibc returning freed memory: its peak RSS above the pre-model baseline."""
    meshes = _setup(rank, world, cfg)  # process groups exist before the baseline

    def run() -> Side:
        side = Side(kind, cfg, world, meshes)
        for x, y in _batches(cfg, world, rank, steps):
            side.timed_step(x, y)
        return side

    return measure_peak(run)


# ---- driver ----------------------------------------------------------------------------------------
def run_timed(kinds: tuple[str, str], cfg: Config, world: int, warmup: int, steps: int) -> dict[str, dict]:
    results = run_workers(_timed_worker, world, kinds, cfg, warmup, steps, timeout=300.0)  # [rank][side]
    return slowest_rank(results, kinds)


def run_memory(kind: str, cfg: Config, world: int, steps: int) -> dict:
    return memory_over_ranks(run_workers(_memory_worker, world, kind, cfg, steps, timeout=300.0))


def summarize(name: str, runs: dict[str, list[dict]], mem: dict[str, dict], kinds: tuple[str, str],
              steps: int, rounds: int) -> dict:
    a, b = (runs[k] for k in kinds)
    m_a, m_b = (mem[k] for k in kinds)
    if name == "overlap":  # two fivefold runs: named by the overlap setting, no torch
        labels = ("overlap_on", "overlap_off")
        return comparison_record({"name": name}, a, b, memory_fields(m_a, m_b, labels, ("peak_mb",)), steps, rounds,
                                 labels, ratio_key="ratio_overlap_on_off")
    return comparison_record({"name": name, "fivefold": kinds[0], "torch": kinds[1]}, a, b,
                             memory_fields(m_a, m_b), steps, rounds)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "debug.toml"), COMPARISONS, steps=6, rounds=4,
                         unit="comparison")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (forked worker processes)")
    parser.add_argument("--bucket-mb", type=float, default=1.0,
                        help="gradient bucket cap of both frameworks' DDP, in 10^6 bytes")
    args, overrides = parse(parser, argv)
    world = args.nproc
    cfg = load_config(args.config, [
        "--train.micro_batch=8", "--train.seq_len=128", "--train.dtype=fp32",
        f"--train.global_batch={8 * world}", f"--parallel.bucket_mb={args.bucket_mb}", *overrides])
    cfg = replace(cfg, train={"global_batch": cfg.train.micro_batch * world})  # one micro-batch per rank
    m, t = cfg.model, cfg.train
    n_params = sum(p.numel() for p in build_model(cfg, derive(cfg, world, unpadded_vocab(cfg)).vocab_size).parameters())
    prewarm()
    log(f"model dim {m.dim}, {m.n_layers} layers, {n_params / 1e6:.2f}M params; {world} ranks x micro-batch "
        f"{t.micro_batch} x seq {t.seq_len}, fp32; bucket {cfg.parallel.bucket_mb} MB; "
        f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps per run, then a memory run each")

    began = time.perf_counter()
    runs: dict[str, list[dict]] = {}
    for rnd in range(args.rounds):
        for name in args.only:
            kinds = COMPARISONS[name] if rnd % 2 == 0 else COMPARISONS[name][::-1]  # who is built and stepped first
            for kind, res in run_timed(kinds, cfg, world, args.warmup, args.steps).items():
                runs.setdefault(kind, []).append(res)
                log(f"round {rnd + 1}/{args.rounds} {kind:24s} median {median(res['times']):.4f} s/step  "
                    f"first loss {res['losses'][0]:.7f}  [{time.perf_counter() - began:.0f} s]")
    mem: dict[str, dict] = {}
    for name in args.only:
        for kind in COMPARISONS[name]:
            if kind not in mem:  # 3 steps: the optimizer state exists from the first step on
                mem[kind] = run_memory(kind, cfg, world, 3)
                log(f"memory {kind:24s} peak +{mem[kind]['peak_mb']:.1f} MB (glibc returning freed memory: "
                    f"{mem[kind]['malloc_set']})  [{time.perf_counter() - began:.0f} s]")

    summary: dict = {"summary": True}
    for name in args.only:
        out = summarize(name, runs, mem, COMPARISONS[name], args.steps, args.rounds)
        report(name, out, summary, {"overlap_ratio": "ratio_overlap_on_off"} if name == "overlap" else None,
               labels=("", ""))
    finish_summary(summary, TARGETS, began)


if __name__ == "__main__":
    main()
