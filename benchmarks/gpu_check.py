"""One-GPU check: fivefold's training step beside a plain PyTorch loop, tokens/s, MFU and peak memory.

Run on the GPU machine, from the source tree, with whatever CUDA build of torch it has (no install):

    python3 benchmarks/gpu_check.py                       # debug + llama-1b, compile off and on (meant: < 5 min)
    python3 benchmarks/gpu_check.py --models llama-1b --compile off --peak-tflops 989
    python3 benchmarks/gpu_check.py --device cpu --quick  # the tiny model, fp32, 1 + 2 steps each way: a smoke test

What runs, on one device (world size 1: a process group of one), per model and per compile setting
(`train.compile` false, then true), each case in this process one after the other:
- `fivefold`: the runtime's own path, `train/loop.py` `setup()` (mesh, the model built on the meta
  device and parallelized, the default corpus read and tokenized with the byte tokenizer up to a
  small `data.max_bytes`, the seeded initialisation) then `train/step.py` `train_step()` for every
  step: data -> pipeline executor (one stage) -> forward / backward under autocast -> clip ->
  AdamW. Not run: the metrics log, the planner's prediction and the checkpoint `train()` writes at
  its end (GBs for the 1B model), so `train()` itself is not called; `train_step()` is what its
  loop runs per step.
- `plain`: the same model code (`fivefold.model.transformer.Transformer`, built on the device, each matrix
  normal(0, model.init_std), norms ones) trained by a bare loop: random token ids of the same
  (micro_batch, seq_len), `torch.autocast(bf16)` around the forward, `cross_entropy_sum` / tokens,
  backward, `clip_grad_norm_` to train.grad_clip, AdamW from `fivefold.parallel.optimizer.build_optimizer`
  (foreach=False, as fivefold steps it), `loss.item()` each step (fivefold reads its loss and
  gradient norm every step too). With compile, each block is `.compile()`d as fivefold does.

Models: `debug` (configs/debug.toml: dim 128, 4 layers, byte vocabulary 320; seq 128, micro-batch
8) and `llama-1b`, the Llama 3.2 1B shape (dim 2048, 16 layers, 32 heads, 8 KV heads, ffn 8192,
vocabulary 128256, tied embeddings, RoPE theta 5e5: 1.236B parameters by
`fivefold.model.counts`), seq 2048, micro-batch 4 (8192 tokens per step; the planner predicts
~40 GB: model state 19.8 GB, activations 20.3 GB). Both in bf16 (fp32 weights, autocast). Each
case runs `--warmup` untimed steps (compile happens in the first) and `--steps` timed ones; the
device is synchronized around every step. `--budget-s` (280) starts no new case after that many
seconds, so a slow compile cannot push the whole run far past 5 minutes. Not yet run on a GPU.

Printed per case (one JSON line each, with each figure's source):
- tokens/s: the timed steps' tokens over their summed wall time (perf_counter, synchronized);
  fivefold's own `tokens_per_s` metric (its step timer) beside it;
- MFU: model FLOPs per token (`fivefold.model.counts.flops_per_token`: 6 x matmul parameters +
  attention, the causal mask counted in full as PaLM, Megatron-LM and torchtitan count it, so the
  figure compares with theirs) x tokens/s / the GPU's peak dense bf16 FLOP/s from the planner's catalog
  (`fivefold.planner.machine.datasheet`, matched from `torch.cuda.get_device_name()`; `--peak-tflops`
  for a GPU it does not list, e.g. PCIe and NVL parts, whose peaks differ from the SXM entries);
- peak memory: `torch.cuda.max_memory_allocated()` over the case (reset before the model is
  built), beside the planner's prediction for the layout (`selfcheck.predict_for_config`,
  fivefold's own accounting: fp32 weights and gradients, AdamW moments, activations, buffers),
  and their ratio. On a CPU there is no such counter: null.
Then one line per model and compile setting with the ratios fivefold / plain (tokens/s, peak
memory), and a summary line. A case that raises prints its exception and the others go on; the
exit status is 0 whatever the figures are (1 only when the device asked for is not there).

Requirements: Python >= 3.11 (fivefold's config reads TOML with tomllib); a torch recent enough for
fivefold's runtime (torch.distributed.tensor and DeviceMesh._flatten; the plain loop needs less);
numpy (fivefold's data pipeline, data/batches.py, holds tokens in numpy arrays). `rich` (the
progress display, train/step_log.py) and `safetensors` (checkpoint/safetensors_io.py, for init_from
weights) are imported at module level by train/loop.py but never called on this path: when one
is missing, a stub stands in for it at import (listed under `stubbed` in the environment line),
and would raise if anything called it. `tokenizers`, TensorBoard, W&B are not imported (byte
tokenizer, JSONL-only sinks).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

STUBBABLE = ("rich", "safetensors")  # imported by train/loop.py's modules, never called by setup() / train_step()
REQUIRED = ("numpy",)

MODELS = {
    "debug": {"config": "configs/debug.toml", "overrides": [], "seq_len": 128, "micro_batch": 8},
    "llama-1b": {"config": None, "overrides": [
        "--model.dim=2048", "--model.n_layers=16", "--model.n_heads=32", "--model.n_kv_heads=8",
        "--model.ffn_dim=8192", "--model.vocab_size=128256", "--model.rope_theta=500000.0",
        "--model.norm_eps=1e-5", "--model.tie_embeddings=true"], "seq_len": 2048, "micro_batch": 4},
    "tiny": {"config": "configs/tiny.toml", "overrides": [], "seq_len": 32, "micro_batch": 2},  # --quick
}


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


# ---- environment ----------------------------------------------------------------------------------------
class _Stub(types.ModuleType):
    """A missing package at import time: any name imported from it is a class that refuses to be used."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        package = self.__name__

        def refuse(*args, **kwargs):
            raise RuntimeError(f"{package}.{name} was called, but {package.split('.')[0]} is not installed "
                               f"(benchmarks/gpu_check.py stubs it for import only)")

        stub = type(name, (), {"__init__": refuse, "__call__": refuse})
        setattr(self, name, stub)
        return stub


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def environment(device: str) -> dict:
    present = {m: importlib.util.find_spec(m) is not None for m in (*REQUIRED, *STUBBABLE, "tokenizers")}
    stubbed = [m for m in STUBBABLE if not present[m]]
    if stubbed:
        sys.meta_path.append(_StubFinder(set(stubbed)))  # after the real finders: only what is not installed
    env = {"environment": True, "python": sys.version.split()[0], "torch": torch.__version__,
           "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": device,
           "modules_present": present, "stubbed": stubbed}
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
        env["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    problems = []
    if sys.version_info < (3, 11):
        problems.append("Python < 3.11: fivefold's config needs tomllib")
    problems += [f"{m} missing: fivefold's data pipeline (data/batches.py) imports it, the fivefold cases will fail"
                 for m in REQUIRED if not present[m]]
    env["problems"] = problems
    return env


def catalog_peak(device_name: str) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s of this GPU from the planner's catalog, and where it comes from."""
    from fivefold.planner.machine.datasheet import get_hardware

    n = device_name.lower()
    key = None
    if ("nvl" in n or "pcie" in n) and ("h100" in n or "h200" in n):
        key = None  # other clocks and peaks than the SXM entries of the catalog
    elif "h200" in n:
        key = "h200"
    elif "h100" in n:
        key = "h100"
    elif "a100" in n:
        key = "a100-40gb" if "40g" in n else "a100-80gb"  # the same 312 TFLOPS bf16 for both
    elif "b200" in n:
        key = "b200"
    elif "mi300x" in n:
        key = "mi300x"
    if key is None:
        return None, f"'{device_name}' is not in the planner's catalog: give --peak-tflops"
    hw = get_hardware(key)
    return hw.peak_flops, f"fivefold.planner.machine.datasheet '{key}': {hw.sources.get('peak_flops', '')}"


# ---- configuration ----------------------------------------------------------------------------------------
def make_config(model: str, device: str, dtype: str, compile_: bool, warmup: int, steps: int, micro_batch: int,
                seq_len: int, out_dir: Path):
    from fivefold.config import ConfigError, load_config
    from fivefold.validate import validate

    spec = MODELS[model]
    tokens = (warmup + steps) * micro_batch * (seq_len + 1)
    max_bytes = max(200_000, int(tokens * 1.5 / 0.95))  # one epoch covers every step (val_fraction 0.05 held out)
    cfg = load_config(ROOT / spec["config"] if spec["config"] else None, [
        *spec["overrides"], f"--train.seq_len={seq_len}", f"--train.micro_batch={micro_batch}",
        f"--train.global_batch={micro_batch}", f"--train.dtype={dtype}", f"--train.device={device}",
        f"--train.compile={'true' if compile_ else 'false'}", "--parallel.dp=1", f"--train.steps={warmup + steps}",
        "--train.warmup_steps=1", "--train.eval_every=0", "--data.tokenizer=byte", f"--data.max_bytes={max_bytes}",
        f"--run.out_dir={out_dir}", f"--run.name={model}"])
    errors = validate(cfg, 1)
    if errors:
        raise ConfigError(errors)
    return cfg


# ---- the two ways to train ---------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:  # only after a compiled case (importing it costs seconds)
        sys.modules["torch._dynamo"].reset()  # compiled graphs hold the blocks they were traced from
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def fivefold_case(cfg, device: str, warmup: int, steps: int) -> dict:
    from fivefold.parallel.derive import derive
    from fivefold.train.loop import init_distributed, setup
    from fivefold.train.step import train_step

    init_distributed(device)  # a process group of one, kept for the later cases
    began = time.perf_counter()
    run, _, _ = setup(cfg, derive(cfg, 1), device)
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": [], "reported": []}
    for step in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        m = train_step(run, step).metrics  # reads the loss and the gradient norm: synchronizes itself
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(m["tokens"])
        out["losses"].append(m["loss"])
        out["reported"].append(m["tokens_per_s"])
    del run
    return out


def _build_optimizer(model, train_cfg):
    """fivefold.parallel.optimizer.build_optimizer, or (only if that module cannot be imported) the same
    AdamW written out here: decay on matrices, none on 1-D tensors, foreach=False."""
    try:
        from fivefold.parallel.optimizer import build_optimizer

        return build_optimizer(model, train_cfg), "fivefold.parallel.optimizer.build_optimizer"
    except ImportError as e:
        tensors = [p for p in model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in tensors if p.ndim >= 2], "weight_decay": train_cfg.weight_decay},
                  {"params": [p for p in tensors if p.ndim < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(train_cfg.beta1, train_cfg.beta2), eps=train_cfg.eps,
                                foreach=False)
        return opt, f"torch.optim.AdamW as build_optimizer makes it (import failed: {e})"


def plain_case(cfg, vocab: int, device: str, warmup: int, steps: int) -> dict:
    from fivefold.model.transformer import Transformer, cross_entropy_sum

    t = cfg.train
    began = time.perf_counter()
    torch.manual_seed(t.seed)
    with torch.device(device):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=vocab))
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, cfg.model.init_std)
            else:
                p.fill_(1.0)
    if t.compile:
        for name, block in list(model.layers.items()):
            if hasattr(block, "compile"):  # nn.Module.compile (torch >= 2.2) keeps the parameter names
                block.compile()
            else:
                model.layers[name] = torch.compile(block)
    opt, opt_source = _build_optimizer(model, t)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.dtype)
    autocast = (lambda: torch.autocast(device_type=device, dtype=dtype)) if dtype else contextlib.nullcontext
    g = torch.Generator().manual_seed(t.seed)
    B, T = t.micro_batch, t.seq_len
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": [], "optimizer": opt_source}
    for _ in range(warmup + steps):
        tokens = torch.randint(0, min(vocab, 257), (B, T + 1), generator=g)  # ids the byte tokenizer makes
        sync(device)
        t0 = time.perf_counter()
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
        with autocast():
            logits = model(x)
        loss = cross_entropy_sum(logits, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(B * T)
    del model, opt, params
    return out


# ---- one case: run, measure, print ---------------------------------------------------------------------------
def measure(runtime: str, model: str, compile_: bool, args, out_dir: Path, peak: tuple[float | None, str]) -> dict:
    from fivefold.model.counts import flops_per_token, model_counts
    from fivefold.parallel.derive import derive
    from fivefold.planner.selfcheck import predict_for_config

    cfg = make_config(model, args.device, args.dtype, compile_, args.warmup, args.steps,
                      args.micro_batch or MODELS[model]["micro_batch"], args.seq_len or MODELS[model]["seq_len"],
                      out_dir)
    vocab = derive(cfg, 1).vocab_size
    free_device(args.device)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    res = (fivefold_case(cfg, args.device, args.warmup, args.steps) if runtime == "fivefold"
           else plain_case(cfg, vocab, args.device, args.warmup, args.steps))
    peak_bytes = torch.cuda.max_memory_allocated() - base if args.device == "cuda" else None
    timed = slice(args.warmup, None)
    tokens_per_s = sum(res["tokens"][timed]) / sum(res["times"][timed])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len, vocab, causal="full")["total"]
    pred = predict_for_config(cfg, 1, device_type=args.device)
    predicted = pred["model_state_bytes"]["total"] + pred["activation_bytes"] + pred["buffer_bytes"]
    mfu = fpt * tokens_per_s / peak[0] if peak[0] else None
    rec = {
        "model": model, "runtime": runtime, "compile": compile_, "device": args.device, "dtype": cfg.train.dtype,
        "params": model_counts(cfg.model, vocab).total, "micro_batch": cfg.train.micro_batch,
        "seq_len": cfg.train.seq_len, "warmup_steps": args.warmup, "timed_steps": args.steps,
        "setup_s": round(res["setup_s"], 2), "first_step_s": round(res["times"][0], 3),
        "step_s_median": round(statistics.median(res["times"][timed]), 4),
        "tokens_per_s": round(tokens_per_s, 1),
        "model_flops_per_token": fpt, "peak_flops": peak[0], "mfu": round(mfu, 4) if mfu is not None else None,
        "peak_memory_gb": round(peak_bytes / 1e9, 3) if peak_bytes is not None else None,
        "predicted_memory_gb": round(predicted / 1e9, 3),
        "predicted_parts_gb": {"model_state": round(pred["model_state_bytes"]["total"] / 1e9, 3),
                               "activations": round(pred["activation_bytes"] / 1e9, 3),
                               "buffers": round(pred["buffer_bytes"] / 1e9, 3)},
        "memory_measured_over_predicted": round(peak_bytes / predicted, 3) if peak_bytes is not None else None,
        "loss_first": round(res["losses"][0], 5), "loss_last": round(res["losses"][-1], 5),
    }
    if runtime == "fivefold":
        rec["fivefold_reported_tokens_per_s_median"] = round(statistics.median(res["reported"][timed]), 1)
    rec["sources"] = {
        "tokens_per_s": "timed steps' tokens / their wall time (perf_counter, device synchronized around each step)",
        "mfu": f"fivefold.model.counts.flops_per_token (causal attention in full) x tokens/s / peak ({peak[1]})",
        "peak_memory_gb": ("torch.cuda.max_memory_allocated() minus the allocation before the model was built"
                           if args.device == "cuda" else "none on a CPU"),
        "predicted_memory_gb": "fivefold.planner.selfcheck.predict_for_config(cfg, 1): model state + activations "
                               "+ buffers (implementation accounting)",
        "data": ("the default corpus (this Python's standard library), byte tokenizer, data.max_bytes "
                 f"{cfg.data.max_bytes}" if runtime == "fivefold" else "random token ids in [0, 257)"),
    }
    if runtime == "plain":
        rec["sources"]["optimizer"] = res["optimizer"]
    return rec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="the tiny model, fp32, 1 warm-up + 2 timed steps, no compile")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=None,
                    help="default: debug llama-1b (--quick: tiny)")
    ap.add_argument("--compile", choices=["both", "off", "on"], default=None, help="default: both (--quick: off)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 (--quick: fp32)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --quick 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --quick 2)")
    ap.add_argument("--micro-batch", type=int, default=0, help="override every model's micro-batch")
    ap.add_argument("--seq-len", type=int, default=0, help="override every model's sequence length")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense TFLOP/s, for a GPU not in the catalog")
    ap.add_argument("--budget-s", type=float, default=280.0, help="start no new case after this many seconds")
    args = ap.parse_args(argv)
    args.models = args.models or (["tiny"] if args.quick else ["debug", "llama-1b"])
    args.compile = args.compile or ("off" if args.quick else "both")
    args.dtype = args.dtype or ("fp32" if args.quick else "bf16")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    began = time.perf_counter()
    if args.device == "cpu":
        # One thread: on a small shared CPU, OpenMP's threads waiting on a busy core make a step 100x slower.
        torch.set_num_threads(1)

    env = environment(args.device)
    emit(env)
    if args.device == "cuda" and not torch.cuda.is_available():
        log("gpu_check: --device cuda but torch.cuda.is_available() is False (use --device cpu --quick here)")
        return 1
    if args.peak_tflops:
        peak = (args.peak_tflops * 1e12, "--peak-tflops")
    elif args.device == "cuda":
        try:
            peak = catalog_peak(env["device_name"])
        except Exception as e:  # noqa: BLE001 - the planner itself failed to import: MFU is then unknown
            peak = (None, f"catalog unavailable: {e!r}")
    else:
        peak = (None, "no peak for a CPU: give --peak-tflops")

    compiles = {"both": [False, True], "off": [False], "on": [True]}[args.compile]
    out_dir = Path(tempfile.mkdtemp(prefix="ff-gpu-check-"))
    results: dict[tuple[str, str, bool], dict] = {}
    errors: list[dict] = []
    try:
        for compile_ in compiles:
            for model in args.models:
                for runtime in ("fivefold", "plain"):
                    case = {"model": model, "runtime": runtime, "compile": compile_}
                    elapsed = time.perf_counter() - began
                    if elapsed > args.budget_s:
                        emit({**case, "skipped": f"time budget: {elapsed:.0f} s > --budget-s {args.budget_s:.0f}"})
                        continue
                    log(f"[{elapsed:5.0f} s] {model} {runtime} compile={compile_} ...")
                    try:
                        rec = measure(runtime, model, compile_, args, out_dir, peak)
                        results[(model, runtime, compile_)] = rec
                        emit(rec)
                        log(f"        {rec['tokens_per_s']:.0f} tokens/s, step {rec['step_s_median'] * 1e3:.1f} ms, "
                            f"MFU {rec['mfu']}, peak {rec['peak_memory_gb']} GB (predicted "
                            f"{rec['predicted_memory_gb']} GB)")
                    except Exception as e:  # noqa: BLE001 - print it and go on with the other cases
                        tb = traceback.format_exc()
                        errors.append({**case, "error": repr(e)})
                        emit({**case, "error": repr(e), "traceback": tb.splitlines()[-12:]})
                        log(tb)
                    finally:
                        free_device(args.device)
                ff, plain = results.get((model, "fivefold", compile_)), results.get((model, "plain", compile_))
                if ff and plain:
                    cmp = {"compare": True, "model": model, "compile": compile_,
                           "tokens_per_s_ratio_fivefold_over_plain": round(ff["tokens_per_s"] / plain["tokens_per_s"],
                                                                           4)}
                    if ff["peak_memory_gb"] and plain["peak_memory_gb"]:
                        cmp["peak_memory_ratio_fivefold_over_plain"] = round(
                            ff["peak_memory_gb"] / plain["peak_memory_gb"], 4)
                    emit(cmp)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    summary = {"summary": True, "cases_run": len(results), "cases_failed": len(errors), "errors": errors,
               "tokens_per_s": {f"{m}/{r}/compile={c}": v["tokens_per_s"] for (m, r, c), v in results.items()},
               "mfu": {f"{m}/{r}/compile={c}": v["mfu"] for (m, r, c), v in results.items()},
               "peak_memory_over_predicted": {f"{m}/{r}/compile={c}": v["memory_measured_over_predicted"]
                                              for (m, r, c), v in results.items()},
               "wall_s": round(time.perf_counter() - began, 1)}
    emit(summary)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
