"""Startup memory and time to the first step: fivefold's meta build, the full build it replaced, and torch.

Run: `.venv/bin/python benchmarks/startup_memory.py [--quick] [--only zero3 tp2] [--first-step auto|yes|no]`
(extra `--section.key=value` arguments override the config, e.g. `--model.vocab_size=32768`).

The model: the Llama 3 8B preset cut to 2 blocks (`--model.preset=llama3-8b --model.n_layers=2`:
dim 4096, 32 heads, 8 KV heads, ffn 14336, vocabulary 128256, untied), 1.49B parameters, 5.95 GB
in fp32; one sequence of 128 tokens per rank and step (the point is model memory, not activations),
fp32, on 2 forked gloo ranks of the CPU (`fivefold.parallel.forked_ranks.run_workers`, one thread each), in two
layouts: `zero3` (dp 2, `parallel.zero = 3`) and `tp2` (tp 2, dp 1). `--quick`: the debug model
(0.9M parameters), for a smoke test.

Three sides, each measured in a fresh pair of forked workers (peak RSS is monotonic per process):
- `fivefold`: what `fivefold train` runs up to and including its first step, minus the metrics log,
  the planner's prediction and the checkpoint at the end: `train/loop.py` `setup()` (run directory,
  `Mesh.from_config`, `parallel_model()`: the model built on the meta device and parallelized there,
  so a rank allocates only what it holds; the data (the default corpus, `data.max_bytes` = 200 kB,
  prepared in the parent before the workers start, as `fivefold train`'s launcher does);
  `fill_weights()` with the seeded initialisation, each rank drawing only the row blocks of its
  slices), then `train/step.py` `train_step(run, 0)`: data, forward, backward with the dp / tp
  collectives, clipping, AdamW (whose state is made here, at its first step).
- `fivefold_full_build`: fivefold before the meta build (the runtime up to the commit "Train real
  sizes, part 1" built the whole model in every rank's memory, then parallelized it). The same
  `setup()` and `train_step()`, with `parallel_model` replaced in the worker by
  `parallelize(build_model(...))` (every rank draws the whole seeded model, 4 bytes per parameter,
  then ZeRO-3 / tensor parallel keeps its part: materialize leaves real tensors as they are) and
  `fill_weights` skipped (the values are already there). Two differences from the old code remain:
  it drew its initial values with one generator (faster than the per-block seeded draws used here)
  and it made AdamW's state at startup (2x the shards more at setup end); so this side's setup-end
  memory is a lower bound of the old runtime's, and its time is not the old time exactly.
- `torch`: PyTorch's own way, on the same model code (fivefold's `Transformer` built on the meta
  device): `zero3`: FSDP2 `fully_shard` on every block, then on the root (the embedding, final norm
  and head are the root's unit; `--torch-units torchtitan` shards the embedding and norm + head as
  units of their own, as torchtitan does); `tp2`: DTensor `parallelize_module` with the
  Colwise/Rowwise plan of benchmarks/tensor_parallel.py (vocabulary-parallel embedding and head,
  the loss under `loss_parallel`). Then `to_empty(device="cpu")` and per-module initialisation as
  PyTorch users write it: `reset_parameters()` where a module has one (nn.Linear, nn.Embedding,
  on the DTensor parameters), `nn.init.ones_` for fivefold's RMSNorm weights; AdamW from
  `build_optimizer`; a step is forward, `cross_entropy_sum` / tokens, backward, gradient clipping
  to optim.grad_clip (benchmarks/tensor_parallel.py `clip_torch`), AdamW, zero_grad. Its batch
  comes from the same corpus through fivefold's data pipeline (`loop.build_datasets`, `rank_slice`:
  the prepared shards memory-mapped, the seeded sample order), as a PyTorch user reading that corpus
  would, so both sides pay for their data alike; its initial values differ from fivefold's (the
  first losses are printed, not compared).

What is measured, per rank, in each worker: peak RSS (`getrusage(RUSAGE_SELF).ru_maxrss`, which is
/proc VmHWM: monotonic over the process's life since the fork) at the end of setup (the model
allocated and initialised, the optimizer built) and at the end of the first step; the RSS when the
worker's function starts (after its process group exists: mostly the Python, torch and fivefold
pages the fork shares, the same for every side), and the peak minus that start (`added`); the time
from the parent's launch of the workers (fork and process-group setup included, the same for every
side) to the end of setup and to the end of the first step. glibc's allocator runs with its
defaults (what `fivefold train` and torchrun get: it may keep freed medium-sized blocks in its heap,
tens of MB here); `--malloc-trim` makes the workers return freed memory at once
(`common.malloc_returns_memory`, as the other benchmarks' memory runs do), so RSS follows live
memory. `common.prewarm()` pays torch's first-use allocations in the parent before forking.
Records give every rank's figure and the maximum.

Whether the first step fits: 2 ranks x (the planner's per-rank prediction for the step, model state
+ activations + buffers, `selfcheck.predict_for_config`, + 0.5 GB of process) must stay under 90%
of the machine's MemAvailable at that moment (`--first-step auto`, the default); otherwise that layout
measures setup only, and says so in its records (`first_step: false`, `first_step_skipped`). At the
full size the step needs ~12 GB per rank (AdamW's fp32 moments, the fp32 gradient and master
shards: 16 bytes per parameter / 2), more than 2 ranks of a 24 GB machine hold: there the records
are setup only; `--model.vocab_size=32768` keeps the 8B blocks and fits the step. A setup that
does not fit either (the full build holds 4 + 2 bytes per parameter at its peak) is skipped.

Output: progress on stderr; on stdout one JSON line per layout and side, then a summary line with,
per layout, `<layout>_ratio_peak_rss_<phase>` (fivefold / torch; the issue's target is <= 1.0,
printed beside it, not asserted), `..._added_` the same on the memory added above the start, and
`<layout>_ratio_full_build_*` (fivefold / fivefold_full_build), at `setup` and, when run, `step`.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

import fivefold.parallel.data.fsdp  # noqa: E402,F401  imported here so forked workers do not pay for it
import fivefold.train.loop as loop  # noqa: E402
from benchmarks.common import log, malloc_returns_memory, prewarm, ratio, status_mb  # noqa: E402
from benchmarks.tensor_parallel import clip_torch, torch_tp_plan  # noqa: E402
from fivefold.checkpoint.run_dir import run_dir_of  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import ConfigError, load_config  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.batches import IGNORE, rank_slice  # noqa: E402
from fivefold.data.resolve import ensure_prepared, unpadded_vocab  # noqa: E402
from fivefold.model.attention import RMSNorm  # noqa: E402
from fivefold.model.counts import model_counts  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.planner.selfcheck import predict_for_config  # noqa: E402
from fivefold.train.step import train_step  # noqa: E402
from fivefold.validate import validate  # noqa: E402

torch.set_num_threads(1)
# FSDP2 calls all_gather_into_tensor / reduce_scatter_tensor (deprecated in favour of *_single), and
# DTensor's random ops on a CPU mesh warn that they are not offset-tracked: both expected here.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*DTensor random operators may not have complete support.*")

WORLD = 2
SIDES = ("fivefold", "fivefold_full_build", "torch")
LAYOUTS = {"zero3": ["--parallel.dp=2", "--parallel.zero=3"], "tp2": ["--parallel.tp=2", "--parallel.dp=1"]}
TARGET = 1.0  # fivefold / torch peak RSS per rank, from the issue ("at most 1.0")
MB = 2**20
PROCESS_BYTES = 0.5e9  # a worker's Python, torch and fivefold (~250 MB measured), beside the planner's figures
HEADROOM = 0.9  # of MemAvailable: what a measurement may plan to use


# ---- what a worker reads --------------------------------------------------------------------------
def max_rss_mb() -> float:
    """This process's peak RSS since it was forked (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reading(began: float) -> dict:
    return {"peak_rss_mb": max_rss_mb(), "vm_hwm_mb": status_mb("VmHWM"), "rss_mb": status_mb("VmRSS"),
            "t": time.perf_counter() - began}


# ---- the sides ----------------------------------------------------------------------------------------
def full_build_parallel_model(cfg: Config, derived, mesh):
    """fivefold before the meta build: the whole seeded model in this rank's memory, then parallelized."""
    return parallelize(loop.build_model(cfg, derived.vocab_size), mesh, cfg, derived), None


class FivefoldSide:
    """`setup()` and `train_step()` of train/loop.py; the full build swaps in the old model builder."""

    def __init__(self, kind: str, cfg: Config, world: int):
        if kind == "fivefold_full_build":  # this forked worker only: setup() reads both as module globals
            loop.parallel_model = full_build_parallel_model
            loop.fill_weights = lambda *args, **kwargs: None  # build_model drew the seeded values already
        self.run, _, _ = loop.setup(cfg, derive(cfg, world, unpadded_vocab(cfg)), "cpu")

    def step(self) -> dict:
        m = train_step(self.run, 0).metrics
        return {"loss": m["loss"], "model_state_mb": round(m["model_state_bytes"]["total"] / MB, 1)}


def init_like_torch_users(model: nn.Module) -> None:
    """After to_empty: each module's own reset_parameters() (nn.Linear: Kaiming-uniform, nn.Embedding:
    normal), and ones for fivefold's RMSNorm, which has none; on the DTensor parameters themselves."""
    torch.manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)


class TorchSide:
    """FSDP2 (zero3) or DTensor tensor parallel (tp2) on the meta model, to_empty, init, AdamW."""

    def __init__(self, layout: str, cfg: Config, world: int, units: str):
        self.cfg, self.layout = cfg, layout
        vocab = derive(cfg, world, unpadded_vocab(cfg)).vocab_size
        model = loop.meta_model(cfg, vocab)  # fivefold's Transformer on the meta device
        mesh = init_device_mesh("cpu", (world,))
        if layout == "zero3":
            if units == "torchtitan":
                fully_shard(model.tok_embeddings, mesh=mesh)
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
            if units == "torchtitan":
                fully_shard([model.norm, model.output], mesh=mesh, reshard_after_forward=False)
            fully_shard(model, mesh=mesh)
        else:
            torch_tp_plan(model, mesh, sp=False)
        model.to_empty(device="cpu")
        init_like_torch_users(model)
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = build_optimizer(model, cfg.optim)  # after sharding: it steps the DTensor shards
        # The data as a PyTorch user of the same corpus reads it: fivefold's pipeline (the prepared
        # shards memory-mapped, the seeded sample order), this rank's rows (dp) or the whole batch (tp).
        t = cfg.train
        train_set, _, loader = loop.build_datasets(cfg, run_dir_of(cfg))
        dp, dp_rank = (world, dist.get_rank()) if layout == "zero3" else (1, 0)
        batch = rank_slice(train_set, loader.next_indices(), t.global_batch, dp, dp_rank, t.micro_batch)
        self.x, self.y = batch.micro_batches[0]  # (micro_batch, T) each
        self.tokens = int((self.y != IGNORE).sum())  # this rank's targets: FSDP2 averages over ranks

    def step(self) -> dict:
        if self.layout == "zero3":  # FSDP2 averages gradients over ranks: the rank's own token mean
            loss = cross_entropy_sum(self.model(self.x), self.y) / self.tokens
            loss.backward()
        else:
            with loss_parallel():
                loss = cross_entropy_sum(self.model(self.x), self.y) / self.tokens  # a Replicate DTensor
                loss.backward()
        clip_torch(self.params, self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        total = loss.double()
        if self.layout == "zero3":
            dist.all_reduce(total)
            total /= dist.get_world_size()
        return {"loss": float(total)}


def _worker(rank: int, world: int, layout: str, kind: str, cfg: Config, launched: float, first_step: bool,
            units: str, malloc_trim: bool) -> dict:
    if malloc_trim:
        malloc_returns_memory()
    began = time.perf_counter()
    out = {"start": {"rss_mb": status_mb("VmRSS"), "peak_rss_mb": max_rss_mb(), "t": began - launched}}
    side = TorchSide(layout, cfg, world, units) if kind == "torch" else FivefoldSide(kind, cfg, world)
    out["setup"] = reading(launched)
    if first_step:
        out.update(side.step())
        out["step"] = reading(launched)
    return out


# ---- driver ----------------------------------------------------------------------------------------------
def mem_available_bytes() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return float("nan")


def predicted_peaks(cfg: Config, params: int) -> dict[str, dict[str, float]]:
    """Per-rank bytes each side is expected to hold at its peak, at setup end and in the first step."""
    pred = predict_for_config(cfg, WORLD)
    step = pred["model_state_bytes"]["total"] + pred["activation_bytes"] + pred["buffer_bytes"]
    part = 4.0 * params / WORLD  # fp32 shards (zero3) or slices (tp2): what a rank holds at setup end
    return {"fivefold": {"setup": part, "step": step}, "torch": {"setup": part, "step": step},
            "fivefold_full_build": {"setup": 4.0 * params + part, "step": max(step, 4.0 * params + part)},
            "planner": pred}


def fits(need_per_rank: float) -> tuple[bool, str]:
    avail = mem_available_bytes()
    need = WORLD * (need_per_rank + PROCESS_BYTES)
    why = f"{WORLD} ranks x ({need_per_rank / 1e9:.2f} GB predicted + {PROCESS_BYTES / 1e9:.1f} GB process) = " \
          f"{need / 1e9:.1f} GB against {HEADROOM:.0%} of MemAvailable {avail / 1e9:.1f} GB"
    return need <= HEADROOM * avail, why


def record(layout: str, kind: str, res: list[dict], first_step: bool, skipped: str | None, params: int,
           cfg: Config, units: str) -> dict:
    what = {"fivefold": "meta build, parallelize, seeded fill of this rank's slices (setup()), train_step()",
            "fivefold_full_build": "build_model (whole seeded model per rank), parallelize, train_step()",
            "torch": ("FSDP2 fully_shard per block + root" + (" (embedding, norm+head own units)"
                                                              if units == "torchtitan" else "")
                      if layout == "zero3" else "DTensor parallelize_module Colwise/Rowwise, loss_parallel")
                     + " on the meta model, to_empty, reset_parameters per module, AdamW step"}[kind]
    t = cfg.train
    out = {"layout": layout, "side": kind, "what": what, "params": params, "ranks": WORLD,
           "micro_batch": t.micro_batch, "seq_len": t.seq_len, "first_step": first_step}
    if skipped:
        out["first_step_skipped"] = skipped
    rnd = lambda xs: [round(x, 1) for x in xs]  # noqa: E731
    out["rss_at_start_mb"] = rnd([r["start"]["rss_mb"] for r in res])
    for phase in ("setup", "step") if first_step else ("setup",):
        peaks = [r[phase]["peak_rss_mb"] for r in res]
        added = [r[phase]["peak_rss_mb"] - r["start"]["rss_mb"] for r in res]
        out[f"peak_rss_{phase}_mb"] = round(max(peaks), 1)
        out[f"peak_rss_{phase}_mb_per_rank"] = rnd(peaks)
        out[f"added_{phase}_mb"] = round(max(added), 1)
        out[f"added_{phase}_mb_per_rank"] = rnd(added)
        out[f"s_to_{phase}_end"] = round(max(r[phase]["t"] for r in res), 2)
        out[f"vm_hwm_equals_ru_maxrss_{phase}"] = all(abs(r[phase]["vm_hwm_mb"] - r[phase]["peak_rss_mb"]) < 1
                                                      for r in res)
    out["s_to_worker_start"] = round(max(r["start"]["t"] for r in res), 2)
    if first_step:
        out["first_step_s"] = round(max(r["step"]["t"] - r["setup"]["t"] for r in res), 2)
        out["loss"] = round(res[0]["loss"], 5)
        if "model_state_mb" in res[0]:
            out["fivefold_meter_model_state_mb_per_rank"] = [r["model_state_mb"] for r in res]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Extra --section.key=value arguments override the config.")
    parser.add_argument("--quick", action="store_true", help="the debug model: a smoke test")
    parser.add_argument("--only", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--sides", nargs="+", choices=list(SIDES), default=list(SIDES))
    parser.add_argument("--first-step", choices=["auto", "yes", "no"], default="auto",
                        help="run the first step: auto = when the planner's prediction fits MemAvailable")
    parser.add_argument("--torch-units", choices=["blocks_root", "torchtitan"], default="blocks_root",
                        help="FSDP2 units of the zero3 peer: every block + the root, or also the embedding and "
                             "norm + head on their own")
    parser.add_argument("--malloc-trim", action="store_true",
                        help="workers make glibc return freed memory at once (common.malloc_returns_memory): RSS "
                             "follows live memory, without the allocator's retained heap")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per measurement")
    args, overrides = parser.parse_known_args(argv)
    model = ["--model.preset=debug"] if args.quick else ["--model.preset=llama3-8b", "--model.n_layers=2"]
    out_dir = Path(tempfile.mkdtemp(prefix="ff-startup-"))
    base = [*model, "--train.seq_len=128", "--train.micro_batch=1", "--train.dtype=fp32", "--train.device=cpu",
            "--train.steps=1", "--optim.warmup_steps=1", "--data.max_bytes=200000", f"--run.out_dir={out_dir}",
            "--run.name=startup"]
    prewarm()
    began = time.perf_counter()
    summary: dict = {"summary": True, "ranks": WORLD, "malloc_trim": args.malloc_trim}
    try:
        for layout in args.only:
            micro = ["--train.global_batch=2"] if layout == "zero3" else ["--train.global_batch=1"]
            cfg = load_config(None, [*base, *LAYOUTS[layout], *micro, *overrides])
            errors = validate(cfg, WORLD)
            if errors:
                raise ConfigError(errors)
            params = model_counts(cfg.model, derive(cfg, WORLD, unpadded_vocab(cfg)).vocab_size).total
            peaks = predicted_peaks(cfg, params)
            pred = peaks.pop("planner")
            worst_step = max(peaks[k]["step"] for k in args.sides)
            first_step, why = {"yes": (True, "forced"), "no": (False, "--first-step no")}.get(
                args.first_step, fits(worst_step))
            skipped = None if first_step else why
            m = cfg.model
            vocab = derive(cfg, WORLD, unpadded_vocab(cfg)).vocab_size
            log(f"{layout}: dim {m.dim}, {m.n_layers} layers, vocab {vocab}, "
                f"{params / 1e9:.3f}B params ({4 * params / 1e9:.2f} GB fp32); planner per rank at the step: "
                f"model state {pred['model_state_bytes']['total'] / 1e9:.2f} GB + activations "
                f"{pred['activation_bytes'] / 1e9:.2f} GB + buffers {pred['buffer_bytes'] / 1e9:.2f} GB; "
                f"first step {'yes' if first_step else 'no'} ({why})")
            records = {}
            for kind in args.sides:
                if not first_step:
                    ok, why_setup = fits(peaks[kind]["setup"])
                    if not ok:
                        rec = {"layout": layout, "side": kind, "params": params, "skipped": why_setup}
                        print(json.dumps(rec), flush=True)
                        log(f"  {kind}: skipped, setup does not fit: {why_setup}")
                        continue
                shutil.rmtree(out_dir / "startup", ignore_errors=True)
                ensure_prepared(cfg)  # as `fivefold train` does in its launcher, before any rank starts
                run_dir_of(cfg).mkdir(parents=True, exist_ok=True)
                launched = time.perf_counter()
                res = run_workers(_worker, WORLD, layout, kind, cfg, launched, first_step, args.torch_units,
                                  args.malloc_trim, timeout=args.timeout)
                records[kind] = rec = record(layout, kind, res, first_step, skipped, params, cfg, args.torch_units)
                rec["planner_step_model_state_mb_per_rank"] = round(pred["model_state_bytes"]["total"] / MB, 1)
                print(json.dumps(rec), flush=True)
                phase = "step" if first_step else "setup"
                log(f"  {kind:20s} peak RSS {rec[f'peak_rss_{phase}_mb']:.0f} MB per rank at {phase} end "
                    f"(+{rec[f'added_{phase}_mb']:.0f} MB), {rec[f's_to_{phase}_end']:.1f} s  "
                    f"[{time.perf_counter() - began:.0f} s]")
            phases = ("setup", "step") if first_step else ("setup",)
            summary[f"{layout}_first_step"] = first_step
            for phase in phases:
                ff, torch_, full = (records.get(k) for k in ("fivefold", "torch", "fivefold_full_build"))
                if ff and torch_:
                    summary[f"{layout}_ratio_peak_rss_{phase}"] = ratio(ff[f"peak_rss_{phase}_mb"],
                                                                        torch_[f"peak_rss_{phase}_mb"])
                    summary[f"{layout}_ratio_added_{phase}"] = ratio(ff[f"added_{phase}_mb"],
                                                                     torch_[f"added_{phase}_mb"])
                    summary[f"{layout}_ratio_time_to_{phase}_end"] = ratio(ff[f"s_to_{phase}_end"],
                                                                           torch_[f"s_to_{phase}_end"])
                if ff and full:
                    summary[f"{layout}_ratio_full_build_peak_rss_{phase}"] = ratio(
                        ff[f"peak_rss_{phase}_mb"], full[f"peak_rss_{phase}_mb"])
                    summary[f"{layout}_ratio_full_build_added_{phase}"] = ratio(ff[f"added_{phase}_mb"],
                                                                                full[f"added_{phase}_mb"])
                    summary[f"{layout}_ratio_full_build_time_to_{phase}_end"] = ratio(
                        ff[f"s_to_{phase}_end"], full[f"s_to_{phase}_end"])
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    memory_ratios = [k for k in summary if "_ratio_" in k and "full_build" not in k and "time" not in k]
    summary["targets"] = {k.replace("_ratio", ""): f"<= {TARGET}" for k in memory_ratios}
    summary["within_target"] = {k.replace("_ratio", ""): summary[k] <= TARGET for k in memory_ratios}
    summary["wall_s"] = round(time.perf_counter() - began, 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
