"""The speed stage: a Llama 3.2 1B shape (dim 2048, 16 layers, 32/8 heads, ffn 8192, vocabulary 128256,
tied: 1.236B parameters; seq 2048, micro-batch 4) in bf16 on one GPU.

- training: fivefold's step (training.py) eager and compiled, each beside a plain PyTorch loop on
  the same model: tokens/s (timed steps' tokens over their wall time, the device synchronized around
  each step), MFU (the step record's `utilization` when the runtime reports it, else
  `flops_per_token`, causal attention counted in full as PaLM, Megatron-LM and torchtitan count it,
  x tokens/s over the catalog's peak dense bf16 FLOP/s for this GPU), peak
  `torch.cuda.max_memory_allocated()` against the planner's `predict_for_config`, fivefold / plain.
- fp8: FP8 tensorwise and rowwise tokens/s over bf16's (training's eager figure when it ran).
- loss_chunk: the same model's head and loss alone (benchmarks/loss_chunk.py) at 4096 tokens in bf16:
  train.loss_chunk's default against PyTorch's eager `F.cross_entropy` over the full logits, peak
  `max_memory_allocated()` above the inputs (issue 51: at most half) and the forward + backward's
  time (at most 1.10x), the two sides' summed losses beside each other.
- roofline: benchmarks/roofline_check.py, each op timed against what the planner prices it at.
- calibrate: `python3 -m fivefold calibrate` into the out folder's profile.toml, its measured fields.
On the CPU (--tiny: configs/tiny.toml in fp32, 1 + 2 steps) the bounds are GPU bounds: every value
is recorded, none judged; compiled cases are skipped there (the correct stage compiles on the CPU).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from benchmarks.gpucheck.records import Outcome, PartLog, at_least, at_most, read_part, recorded, within
from benchmarks.gpucheck.training import ROOT, fivefold_case, free_device, make_config, plain_case

PROFILE = "profile.toml"


class Context:
    def __init__(self, device: str, tiny: bool, out: Path, peak_tflops: float, warmup: int, steps: int):
        self.device, self.tiny, self.cuda, self.out = device, tiny, device == "cuda", out
        self.model = "tiny" if tiny else "llama-1b"
        self.dtype = "fp32" if tiny else "bf16"
        self.warmup, self.steps = warmup or (1 if tiny else 3), steps or (2 if tiny else 10)
        self.dir = Path(tempfile.mkdtemp(prefix="ff-gpu-check-"))
        self.peak = ((peak_tflops * 1e12, "--peak-tflops") if peak_tflops else catalog_peak() if self.cuda
                     else (None, "no peak for a CPU: give --peak-tflops"))  # (FLOP/s or None, where from)

    def judged(self, outcome: Outcome) -> Outcome:
        """A GPU's bound, judged on a GPU only: on the CPU the value is recorded."""
        value, bound, passed, detail = outcome
        return outcome if self.cuda else recorded(value, {"bound on a GPU": bound, "detail": detail})


def catalog_peak() -> tuple[float | None, str]:
    """Peak dense bf16 FLOP/s of this GPU, as the step record's MFU takes it (train/utilization.py)."""
    from fivefold.train.utilization import catalog_peak as of_device

    peak = of_device(torch.device("cuda"))
    return (peak.flops, peak.source) if peak.flops else (None, "a GPU the planner's catalog lacks: give --peak-tflops")


def measure(ctx: Context, runtime: str, compile_: bool, extra: tuple[str, ...] = ()) -> dict:
    """One case: tokens/s, MFU, peak memory beside the planner's prediction, losses."""
    from fivefold.config.derive import derive
    from fivefold.data.resolve import unpadded_vocab
    from fivefold.model.counts import flops_per_token
    from fivefold.planner.selfcheck import predict_for_config

    steps = ctx.warmup + ctx.steps
    cfg = make_config(ctx.model, ctx.device, ctx.dtype, steps, ctx.dir, ("--train.compile=" + str(compile_).lower(),
                                                                         *extra))
    vocab = derive(cfg, 1, unpadded_vocab(cfg)).vocab_size
    free_device(ctx.device)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    res = (fivefold_case(cfg, ctx.device, steps) if runtime == "fivefold"
           else plain_case(cfg, vocab, ctx.device, steps, compile_))
    peak_bytes = torch.cuda.max_memory_allocated() - base if ctx.cuda else None
    timed = slice(ctx.warmup, None)
    tokens_per_s = sum(res["tokens"][timed]) / sum(res["times"][timed])
    fpt = flops_per_token(cfg.model, cfg.train.seq_len, vocab, causal="full")["total"]
    pred = predict_for_config(cfg, 1, device_type=ctx.device)
    predicted = pred["peak_bytes"]
    last = res["metrics"][-1] if res["metrics"] else {}
    if (utilization := last.get("utilization")) and utilization.get("mfu") is not None:
        mfu, mfu_from = utilization["mfu"], f"the step record's utilization ({utilization.get('peak_from')})"
    else:
        mfu = fpt * tokens_per_s / ctx.peak[0] if ctx.peak[0] else None
        mfu_from = f"{fpt:.4g} FLOPs/token (causal in full) x tokens/s / {ctx.peak[0]} ({ctx.peak[1]})"
    return {"tokens_per_s": tokens_per_s, "mfu": mfu, "mfu_from": mfu_from, "peak_bytes": peak_bytes,
            "predicted_bytes": predicted, "setup_s": round(res["setup_s"], 2),
            "first_step_s": round(res["times"][0], 3),
            "step_s_median": round(statistics.median(res["times"][timed]), 4), "loss_first": res["losses"][0],
            "loss_last": res["losses"][-1], "step_record_memory": last.get("memory")}


def training(part: PartLog, ctx: Context) -> None:
    cost = {False: 25, True: 70}  # seconds a 1B case takes on an H100, guessed (compiled: its cold compile)
    for compile_ in (False, True):
        mode = "compiled" if compile_ else "eager"
        if compile_ and not ctx.cuda:
            part.skip(f"{ctx.model} {mode}: fivefold / plain tokens/s", "no compiled cases on the CPU (the correct "
                      "stage compiles with aot_eager)")
            continue
        done = {}
        for runtime in ("fivefold", "plain"):
            name = f"{ctx.model} {runtime} {mode}"
            part.run(f"{name}: tokens/s", lambda r=runtime, c=compile_, d=done: _case(ctx, d, r, c), cost[compile_])
            if runtime not in done:
                continue
            m = done[runtime]
            part.record(f"{name}: MFU", recorded(m["mfu"], m["mfu_from"]))
            if m["peak_bytes"] is not None:
                part.record(f"{name}: peak memory / planner", ctx.judged(within(
                    m["peak_bytes"] / m["predicted_bytes"], 0.7, 1.3,
                    {"peak_gb": m["peak_bytes"] / 1e9, "predicted_gb": m["predicted_bytes"] / 1e9})))
            else:
                part.record(f"{name}: peak memory / planner", recorded(
                    None, {"predicted_gb": m["predicted_bytes"] / 1e9, "why": "no allocator counter"}))
        if len(done) == 2:
            ratio = done["fivefold"]["tokens_per_s"] / done["plain"]["tokens_per_s"]
            part.record(f"{ctx.model} {mode}: fivefold / plain tokens/s", ctx.judged(at_least(ratio, 0.9)))


def _case(ctx: Context, done: dict, runtime: str, compile_: bool) -> Outcome:
    try:
        done[runtime] = measure(ctx, runtime, compile_)
    finally:
        free_device(ctx.device)
    m = done[runtime]
    return recorded(m["tokens_per_s"], {k: v for k, v in m.items() if k not in ("tokens_per_s", "mfu_from")})


def fp8(part: PartLog, ctx: Context) -> None:
    base = [c["value"] for c in read_part(ctx.out / "training.jsonl")[0]
            if c["check"] == f"{ctx.model} fivefold eager: tokens/s" and c["value"]]
    bf16 = {"tokens_per_s": base[0]} if base else None
    for recipe in ("tensorwise", "rowwise"):
        def ratio(r=recipe) -> Outcome:
            nonlocal bf16
            bf16 = bf16 or measure(ctx, "fivefold", False)
            extra = (f"--train.fp8={r}", *(["--train.dtype=bf16"] if ctx.tiny else []))
            fp8_ = measure(ctx, "fivefold", False, extra)
            return ctx.judged(at_least(fp8_["tokens_per_s"] / bf16["tokens_per_s"], 1.0, {
                "fp8_tokens_per_s": fp8_["tokens_per_s"], f"{ctx.dtype}_tokens_per_s": bf16["tokens_per_s"]}))
        part.run(f"{ctx.model} fp8 {recipe} / bf16 tokens/s", ratio, 20)


LOSS_CHUNK_SHAPE = {"gpu": (4096, 2048, 128256, 10), "tiny": (64, 32, 512, 1)}  # tokens, dim, vocab, timed calls
TINY_LOSS_CHUNK = 16  # --tiny: 4 chunks of its 64 tokens (the default chunk would hold them all)
LOSS_GAP = 1e-3  # summed loss, chunked against eager: the same logits' per-token reductions, summed in another order


def loss_chunk(part: PartLog, ctx: Context) -> None:
    """The head and its loss at the speed model's shape: train.loss_chunk's default (fivefold's
    OutputHead, chunked) against eager F.cross_entropy over the full logits; the unchunked path beside."""
    from benchmarks.loss_chunk import head_inputs, head_sides, measure, side_name
    from fivefold.config.schema import TrainConfig

    tokens, dim, vocab, repeats = LOSS_CHUNK_SHAPE["tiny" if ctx.tiny else "gpu"]
    chunk = TINY_LOSS_CHUNK if ctx.tiny else TrainConfig().loss_chunk
    done = {}

    def run() -> dict:
        free_device(ctx.device)
        dtype = torch.bfloat16 if ctx.dtype == "bf16" else torch.float32  # autocast's, as train.dtype runs it
        head, h, targets = head_inputs(tokens, dim, vocab, ctx.device)
        res = measure(head_sides(head, h, targets, [chunk, 0], dtype), [h, head.weight], repeats, ctx.device)
        del head, h, targets
        free_device(ctx.device)
        done.update(res)
        return res

    def compared(key: str, bound: float) -> Outcome:
        res = done or run()
        mine, peer = res[side_name(chunk)], res[side_name(None)]
        detail = {"chunk": chunk, "tokens": tokens, "dim": dim, "vocab": vocab, "dtype": ctx.dtype,
                  **{f"{n}_{k}": r[k] for n, r in res.items() for k in ("ms", "peak_mb")}}
        value = mine[key] / peer[key] if peer[key] else None
        return ctx.judged(at_most(value, bound, detail)) if value is not None else recorded(None, detail)

    def losses_agree() -> Outcome:
        res = done or run()
        mine, peer = res[side_name(chunk)]["loss"], res[side_name(None)]["loss"]
        return at_most(abs(mine - peer) / abs(peer), LOSS_GAP, {"chunked": mine, "eager": peer,
                                                                "unchunked": res["chunk0"]["loss"]})

    name = "head + loss, train.loss_chunk / eager cross-entropy"
    part.run(f"{name}: peak memory", lambda: compared("peak_bytes", 0.5), 15 if ctx.cuda else 5)
    part.run(f"{name}: time", lambda: compared("ms", 1.10))
    part.run(f"{name}: summed loss gap", losses_agree)


class _Lines(io.TextIOBase):
    """Our stdout for roofline_check.py: its lines pass through, and each JSON line is handed to
    `on_line` as it is printed, so a part stopped midway keeps the ops already timed."""

    def __init__(self, out, on_line):
        self.out, self.on_line, self.pending = out, on_line, ""

    def write(self, s: str) -> int:
        self.out.write(s)
        self.out.flush()
        self.pending += s
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith("{"):
                self.on_line(json.loads(line))
        return len(s)


def roofline(part: PartLog, ctx: Context) -> None:
    spec = importlib.util.spec_from_file_location("roofline_check", ROOT / "benchmarks" / "roofline_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    last = []

    def on_line(x: dict) -> None:
        last[:] = [x]
        if "ratio" not in x:
            return
        what = next(f"{k} {x[k]}" for k in ("matmul", "attention", "block") if k in x)
        side = f" {x['part']}" if "part" in x else ""  # a block's line names forward or backward alone
        part.record(f"roofline {what}{side}: measured / planner ms", ctx.judged(within(
            x["ratio"], 0.5, 2.0, {"measured_ms": x["measured_ms"], "planner_ms": x["planner_ms"]})))

    with contextlib.redirect_stdout(_Lines(sys.stdout, on_line)):
        rc = check.main(["--device", ctx.device, *(["--tiny"] if ctx.tiny else [])])
    if rc:
        part.record("roofline: the script", (rc, "exit status 0", False, last or None))


def calibrate(part: PartLog, ctx: Context) -> None:
    profile = ctx.out / PROFILE
    command = [sys.executable, "-m", "fivefold", "calibrate", "--device", ctx.device, "--out", str(profile),
               *(["--quick"] if ctx.tiny else [])]

    def run() -> Outcome:
        began = time.monotonic()
        rc = subprocess.run(command, cwd=ROOT, stdout=sys.stderr).returncode  # its progress goes to the log
        return rc, "exit status 0", rc == 0, {"wall_s": round(time.monotonic() - began, 1), "profile": str(profile)}

    # its cost: 15 s of a sustained matmul burn among its timings (planner/calibration/gpu.py)
    if part.run("calibrate: the command", run, 40 if ctx.cuda else 20)["status"] != "pass":
        return
    data = tomllib.loads(profile.read_text())
    measured = [k for k, v in data.get("sources", {}).items() if "measured" in v]
    for key in measured:
        value = data.get("hardware", {}).get(key)
        if key.endswith("efficiency") and isinstance(value, float):
            part.record(f"calibrate {key}", ctx.judged(within(value, 0.05, 1.0)))
        else:
            part.record(f"calibrate {key}", recorded(value))


PARTS = {"training": training, "fp8": fp8, "loss_chunk": loss_chunk, "roofline": roofline, "calibrate": calibrate}
