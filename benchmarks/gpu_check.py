"""One-GPU check: fivefold's training step beside a plain PyTorch loop, the planner's roofline op by op, then
`fivefold calibrate`.

Run on the GPU machine from the source tree, with the torch it has (2.11 or newer; nothing to install):

    python3 benchmarks/gpu_check.py                        # compile off, compile on, calibrate: under 8 min
    python3 benchmarks/gpu_check.py --parts off --models llama-1b --peak-tflops 989
    python3 benchmarks/gpu_check.py --device cpu --tiny    # the smoke test the suite runs (tests/test_gpu_check.py)

Five parts, one after the other, each in its own process with its own time budget (`--budget
PART=SECONDS`; defaults off=110, attention=45, roofline=40, on=210, calibrate=65) inside one deadline
(`--deadline-s`, 470):
a part that fails or runs past its budget is stopped and printed as one line, and the next part
runs. Each part prints its lines as it goes (one JSON object per line on stdout, flushed; progress
on stderr):

- `off` and `on` (`train.compile` false, then true), per model: `fivefold`, the runtime's own path
  (train/loop.py `setup()`: mesh, model built on the meta device and parallelized, the default corpus
  with the byte tokenizer, the seeded initialisation; then train/step.py `train_step()` per step; no
  metrics log, no final checkpoint), and `plain`: the same `Transformer` trained by a bare loop
  (random token ids, autocast, `cross_entropy_sum` / tokens, backward, `clip_grad_norm_`, the
  optimizer `build_optimizer` makes, the loss read each step; with compile each block `.compile()`d
  as fivefold does). Per case: tokens/s (timed steps' tokens over their wall time, the device
  synchronized around each step), MFU (`flops_per_token`, causal attention counted in full as
  PaLM, Megatron-LM and torchtitan count it, x tokens/s over the peak dense bf16 FLOP/s of the
  planner's catalog entry for `torch.cuda.get_device_name()`: 989 TFLOP/s for an H200), peak
  `torch.cuda.max_memory_allocated()` beside the planner's `predict_for_config` (model state +
  activations + buffers) and their ratio; then the ratios fivefold / plain per model. A case that
  raises is one line and the next runs; a case starts only if it would end within the part's budget
  (guessed from the model's previous case; a model's first case within 60% of it).
- `attention`: benchmarks/attention_check.py: the masked attention kernels (blockwise, FlexAttention)
  against the rule written out, and their time beside SDPA (its docstring).
- `roofline`: benchmarks/roofline_check.py: Llama 3 8B's block at 2 x 8192 tokens, each matmul, the
  attention kernel (SDPA's and FlashAttention-2) and the whole block timed beside what the planner
  prices it at (its docstring): which op the planner's Hopper optimism lives in.
- `calibrate`: `python3 -m fivefold calibrate --device cuda --out PROFILE` (planner/calibration/gpu.py:
  GEMM, FP8 GEMM, SDPA and HBM fractions of this GPU), its line, then the profile's measured fields.

Models, in this order: `llama-1b`, the Llama 3.2 1B shape (dim 2048, 16 layers, 32/8 heads, ffn 8192,
vocabulary 128256, tied: 1.236B parameters; seq 2048, micro-batch 4), then `debug` (configs/debug.toml;
seq 128, micro-batch 8), bf16, 3 warm-up steps (compile happens in the first) and 10 timed ones. `--tiny`:
configs/tiny.toml in fp32, 1 + 2 steps, parts off and calibrate (`--quick`; the suite runs
attention_check.py's `--tiny` itself). Needs fivefold's runtime dependencies (pyproject.toml; the
environment line lists any missing). Exit status 0 whatever the figures; 1 only when `--device
cuda` finds no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

MODELS = {
    "debug": {"config": "configs/debug.toml", "overrides": [], "seq_len": 128, "micro_batch": 8},
    "llama-1b": {"config": None, "overrides": [
        "--model.dim=2048", "--model.n_layers=16", "--model.n_heads=32", "--model.n_kv_heads=8",
        "--model.ffn_dim=8192", "--model.vocab_size=128256", "--model.rope.theta=500000.0",
        "--model.norm.eps=1e-5", "--model.tie_embeddings=true"], "seq_len": 2048, "micro_batch": 4},
    "tiny": {"config": "configs/tiny.toml", "overrides": [], "seq_len": 32, "micro_batch": 2},  # --tiny
}
PARTS = ("off", "attention", "roofline", "on", "calibrate")
# on: a first compile per model; calibrate: 15 s of them a sustained matmul burn (calibration/gpu.py)
BUDGETS_S = {"off": 110.0, "attention": 45.0, "roofline": 40.0, "on": 210.0, "calibrate": 65.0}
DEADLINE_S = 470.0  # the whole check, under the 8 minutes a GPU session gives it
NEW_CASE_FRACTION = 0.6  # a model's first case starts only within this share of the part's budget


def log(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def environment(device: str) -> dict:
    """Python, torch, the device, and which of fivefold's runtime dependencies this Python lacks."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = [re.split(r"[=<>;\[ ]", d)[0] for d in deps]  # each is imported under its distribution's name
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    env = {"environment": True, "python": sys.version.split()[0], "torch": torch.__version__,
           "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available(), "device": device,
           "missing_dependencies": missing}
    if device == "cuda" and torch.cuda.is_available():
        env["device_name"] = torch.cuda.get_device_name()
        env["device_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
    return env


def catalog_peak(device_name: str) -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s of this GPU from the planner's catalog, and where it comes from."""
    from fivefold.planner.calibration.gpu import catalog_key
    from fivefold.planner.machine.datasheet import get_hardware

    try:
        hw = get_hardware(catalog_key(device_name))
    except ValueError as e:
        return None, f"{e}: give --peak-tflops"
    return hw.peak_flops, f"fivefold.planner.machine.datasheet '{hw.name}': {hw.sources.get('peak_flops', '')}"


# ---- one case: the two ways to train ------------------------------------------------------------------
def make_config(model: str, args, compile_: bool, out_dir: Path):
    from fivefold.config.load import ConfigError, load_config
    from fivefold.validate import validate

    spec = MODELS[model]
    mb, seq = args.micro_batch or spec["micro_batch"], args.seq_len or spec["seq_len"]
    steps = args.warmup + args.steps
    max_bytes = max(200_000, int(steps * mb * (seq + 1) * 1.5 / 0.95))  # an epoch covers all (val_fraction 0.05)
    cfg = load_config(ROOT / spec["config"] if spec["config"] else None, [
        *spec["overrides"], f"--train.seq_len={seq}", f"--train.micro_batch={mb}", f"--train.global_batch={mb}",
        f"--train.dtype={args.dtype}", f"--train.device={args.device}", f"--train.compile={str(compile_).lower()}",
        "--parallel.dp=1", f"--train.steps={steps}", "--optim.warmup_steps=1", "--train.eval_every=0",
        "--data.tokenizer=byte", f"--data.max_bytes={max_bytes}", f"--run.out_dir={out_dir}", f"--run.name={model}"])
    if errors := validate(cfg, 1):
        raise ConfigError(errors)
    return cfg


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device(device: str) -> None:
    gc.collect()
    if "torch._dynamo" in sys.modules:  # compiled graphs hold the blocks they were traced from
        sys.modules["torch._dynamo"].reset()
        gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def fivefold_case(cfg, device: str, steps: int) -> dict:
    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.train.loop import init_distributed, setup
    from fivefold.train.step import train_step

    init_distributed(device)  # a process group of one, kept for the part's later cases
    began = time.perf_counter()
    run, _, _ = setup(cfg, derive(cfg, 1, unpadded_vocab(cfg)), device)
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": [], "reported": []}
    for step in range(steps):
        sync(device)
        t0 = time.perf_counter()
        m = train_step(run, step).metrics  # reads the loss and the gradient norm
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(m["tokens"])
        out["losses"].append(m["loss"])
        out["reported"].append(m["tokens_per_s"])
    return out


def plain_case(cfg, vocab: int, device: str, steps: int) -> dict:
    from fivefold.model.transformer import Transformer, cross_entropy_sum
    from fivefold.parallel.optimizer import build_optimizer

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
        for block in model.layers.values():
            block.compile()  # as fivefold compiles: each block, its parameter names kept
    opt = build_optimizer(model, cfg.optim)
    params = [p for p in model.parameters() if p.requires_grad]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.dtype)
    autocast = (lambda: torch.autocast(device_type=device, dtype=dtype)) if dtype else contextlib.nullcontext
    g = torch.Generator().manual_seed(t.seed)
    B, T = t.micro_batch, t.seq_len
    sync(device)
    out = {"setup_s": time.perf_counter() - began, "times": [], "tokens": [], "losses": []}
    for _ in range(steps):
        tokens = torch.randint(0, min(vocab, 257), (B, T + 1), generator=g)  # ids the byte tokenizer makes
        sync(device)
        t0 = time.perf_counter()
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T) each
        with autocast():
            logits = model(x)  # (B, T, vocab)
        loss = cross_entropy_sum(logits, y) / y.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        sync(device)
        out["times"].append(time.perf_counter() - t0)
        out["tokens"].append(B * T)
    return out


def measure(runtime: str, model: str, compile_: bool, args, out_dir: Path, peak: tuple[float | None, str]) -> dict:
    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.model.counts import flops_per_token, model_counts
    from fivefold.planner.selfcheck import predict_for_config

    cfg = make_config(model, args, compile_, out_dir)
    vocab = derive(cfg, 1, unpadded_vocab(cfg)).vocab_size
    free_device(args.device)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    steps = args.warmup + args.steps
    res = (fivefold_case(cfg, args.device, steps) if runtime == "fivefold"
           else plain_case(cfg, vocab, args.device, steps))
    peak_bytes = torch.cuda.max_memory_allocated() - base if cuda else None
    timed = slice(args.warmup, None)
    tokens_per_s = sum(res["tokens"][timed]) / sum(res["times"][timed])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len, vocab, causal="full")["total"]
    pred = predict_for_config(cfg, 1, device_type=args.device)
    predicted = pred["model_state_bytes"]["total"] + pred["activation_bytes"] + pred["buffer_bytes"]
    mfu = fpt * tokens_per_s / peak[0] if peak[0] else None
    rec = {"model": model, "runtime": runtime, "compile": compile_, "device": args.device, "dtype": cfg.train.dtype,
           "params": model_counts(cfg.model, vocab).total, "micro_batch": cfg.train.micro_batch,
           "seq_len": cfg.train.seq_len, "timed_steps": args.steps, "setup_s": round(res["setup_s"], 2),
           "first_step_s": round(res["times"][0], 3), "step_s_median": round(statistics.median(res["times"][timed]), 4),
           "tokens_per_s": round(tokens_per_s, 1), "mfu": round(mfu, 4) if mfu is not None else None,
           "peak_memory_gb": round(peak_bytes / 1e9, 3) if peak_bytes is not None else None,
           "predicted_memory_gb": round(predicted / 1e9, 3),
           "memory_measured_over_predicted": round(peak_bytes / predicted, 3) if peak_bytes is not None else None,
           "loss_first": round(res["losses"][0], 5), "loss_last": round(res["losses"][-1], 5)}
    if runtime == "fivefold":
        rec["reported_tokens_per_s_median"] = round(statistics.median(res["reported"][timed]), 1)
    parts_gb = [pred["model_state_bytes"]["total"] / 1e9, pred["activation_bytes"] / 1e9, pred["buffer_bytes"] / 1e9]
    rec["sources"] = {"mfu": f"{fpt:.4g} FLOPs/token (causal in full) x tokens/s / {peak[0]} ({peak[1]})",
                      "predicted_memory_gb": "planner.selfcheck.predict_for_config: model state {:.3f} + activations "
                                             "{:.3f} + buffers {:.3f} GB".format(*parts_gb)}
    return rec


def run_training_part(compile_: bool, args, budget_s: float) -> int:
    """One compile setting: every model's two cases, in this process, printed as they finish."""
    began = time.monotonic()
    if args.device == "cpu":
        torch.set_num_threads(1)  # on a small shared CPU, OpenMP's threads waiting on a busy core slow a step 100x
    peak = ((args.peak_tflops * 1e12, "--peak-tflops") if args.peak_tflops
            else catalog_peak(torch.cuda.get_device_name()) if args.device == "cuda"
            else (None, "no peak for a CPU: give --peak-tflops"))
    out_dir = Path(tempfile.mkdtemp(prefix="ff-gpu-check-"))
    try:
        for model in args.models:
            done, took = {}, None  # took: the model's previous case's seconds, what its next one is guessed at
            for runtime in ("fivefold", "plain"):
                case = {"part": "on" if compile_ else "off", "model": model, "runtime": runtime, "compile": compile_}
                elapsed = time.monotonic() - began
                if elapsed + took > budget_s if took is not None else elapsed > NEW_CASE_FRACTION * budget_s:
                    emit({**case, "skipped": f"{elapsed:.0f} s of the part's {budget_s:.0f} s gone"})
                    continue
                log(f"[{elapsed:5.0f} s] {model} {runtime} compile={compile_} ...")
                try:
                    done[runtime] = measure(runtime, model, compile_, args, out_dir, peak)
                    emit({**case, **done[runtime]})
                except Exception as e:  # noqa: BLE001 - one line, and the next case runs
                    emit({**case, "error": repr(e)[:500]})
                    log(traceback.format_exc())
                finally:
                    free_device(args.device)
                    took = time.monotonic() - began - elapsed
            if len(done) == 2:
                ff, plain = done["fivefold"], done["plain"]
                cmp = {"compare": True, "model": model, "compile": compile_,
                       "tokens_per_s_fivefold_over_plain": round(ff["tokens_per_s"] / plain["tokens_per_s"], 4)}
                if ff["peak_memory_gb"] and plain["peak_memory_gb"]:
                    cmp["peak_memory_fivefold_over_plain"] = round(ff["peak_memory_gb"] / plain["peak_memory_gb"], 4)
                emit(cmp)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


# ---- the parts, each in its own process under its own budget ----------------------------------------------
def run_part(name: str, command: list[str], budget_s: float) -> dict:
    """Run `command` (its output goes straight to ours), stopping it and its children at `budget_s`;
    one line's record of how it ended."""
    sys.stdout.flush()
    began = time.monotonic()
    # its own session: a stop reaches the compile workers it started too
    proc = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"part": name, "status": f"stopped at its budget of {budget_s:g} s", "wall_s": round(budget_s, 1)}
    return {"part": name, "status": "ok" if rc == 0 else f"failed with exit status {rc}",
            "wall_s": round(time.monotonic() - began, 1)}


def part_command(part: str, args, argv: list[str], budget_s: float) -> list[str]:
    """A part's process: calibrate, or this script on one compile setting (stops starting cases by `budget_s`)."""
    if part == "calibrate":
        return [sys.executable, "-m", "fivefold", "calibrate", "--device", args.device, "--out", str(args.profile),
                *(["--quick"] if args.tiny else [])]
    if part in ("attention", "roofline"):
        return [sys.executable, str(Path(__file__).resolve().parent / f"{part}_check.py"), "--device", args.device,
                *(["--tiny"] if args.tiny else [])]
    return [sys.executable, str(Path(__file__).resolve()), *argv, "--run-part", part, "--budget", f"{part}={budget_s}"]


def profile_fields(path: Path) -> dict:
    """The measured fields of a profile calibrate wrote (those its [sources] say it measured)."""
    profile = tomllib.loads(path.read_text())
    measured = [k for k, v in profile.get("sources", {}).items() if "measured" in v]
    return {k: profile["hardware"][k] for k in measured if k in profile.get("hardware", {})}


def parse_budgets(pairs: list[str]) -> dict[str, float]:
    budgets = dict(BUDGETS_S)
    for pair in pairs:
        part, _, seconds = pair.partition("=")
        if part not in PARTS or not seconds:
            raise SystemExit(f"gpu_check: --budget {pair!r}: give PART=SECONDS with PART one of {', '.join(PARTS)}")
        budgets[part] = float(seconds)
    return budgets


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.toml, fp32, 1 + 2 steps, parts off and "
                    "calibrate (--quick): the suite's smoke test")
    ap.add_argument("--parts", default=None, help="comma-separated, of off,attention,roofline,on,calibrate "
                    "(default: all; --tiny: off,calibrate)")
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=None, help="default: llama-1b debug")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 (--tiny: fp32)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    ap.add_argument("--micro-batch", type=int, default=0, help="override every model's micro-batch")
    ap.add_argument("--seq-len", type=int, default=0, help="override every model's sequence length")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="peak dense TFLOP/s, for a GPU not in the catalog")
    ap.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                    help=f"a part's time budget (defaults {', '.join(f'{k}={v:.0f}' for k, v in BUDGETS_S.items())})")
    ap.add_argument("--deadline-s", type=float, default=DEADLINE_S, help="no part runs past this, from the start")
    ap.add_argument("--profile", type=Path, default=ROOT / "runs" / "gpu_check_profile.toml",
                    help="where calibrate writes the profile")
    ap.add_argument("--run-part", choices=["off", "on"], default=None, help=argparse.SUPPRESS)  # a part's process
    args = ap.parse_args(argv)
    args.models = args.models or (["tiny"] if args.tiny else ["llama-1b", "debug"])
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    budgets = parse_budgets(args.budget)
    if args.run_part:
        return run_training_part(args.run_part == "on", args, budgets[args.run_part])

    began = time.monotonic()
    emit(environment(args.device))
    if args.device == "cuda" and not torch.cuda.is_available():
        log("gpu_check: --device cuda but torch.cuda.is_available() is False (here: --device cpu --tiny)")
        return 1
    parts = (args.parts or ("off,calibrate" if args.tiny else ",".join(PARTS))).split(",")
    if set(parts) - set(PARTS):
        raise SystemExit(f"gpu_check: --parts {args.parts}: of {', '.join(PARTS)}")
    args.profile.parent.mkdir(parents=True, exist_ok=True)
    for part in parts:
        left = args.deadline_s - (time.monotonic() - began)
        budget = min(budgets[part], left)
        if budget < 1:
            emit({"part": part, "status": f"not run: the deadline of {args.deadline_s:.0f} s has passed"})
            continue
        log(f"[{time.monotonic() - began:5.0f} s] part {part}, budget {budget:.0f} s")
        result = run_part(part, part_command(part, args, argv, budget), budget)
        if part == "calibrate" and result["status"] == "ok":
            try:
                result["profile"], result["measured"] = str(args.profile), profile_fields(args.profile)
            except (OSError, ValueError) as e:  # ValueError: tomllib's TOMLDecodeError
                result["status"] = f"ok, but its profile cannot be read: {e!r}"
        emit(result)
    emit({"summary": True, "parts": parts, "wall_s": round(time.monotonic() - began, 1)})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
