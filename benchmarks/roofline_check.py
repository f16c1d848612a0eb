"""The planner's roofline beside this GPU, op by op: one block's matmuls, its attention kernel and
the whole block, each timed and set beside what the planner prices it at.

Run on the GPU machine from the source tree (gpu_check.py runs it as its `roofline` part):

    python3 benchmarks/roofline_check.py                       # CUDA: Llama 3 8B's block, 2 x 8192 tokens
    python3 benchmarks/roofline_check.py --device cpu --tiny   # the suite's smoke test (tests/test_gpu_check.py)

The planner prices a catalog GPU from published kernel measurements (planner/machine/datasheet.py),
and the published runs it is set beside ran slower than it predicts on Hopper, by about a sixth
(benchmarks/planner_vs_published.py's summary by GPU). This says which op is off, on the GPU it
runs on. After `--burn-s` seconds of back-to-back matmuls (a training step runs at the clocks a GPU
holds under load: calibration/gpu.py keep_busy), one JSON line per op, at the block's shapes
(planner/machine/ops.py block_ops):

- `matmul`: each of the block's (wq, wk, wv, wo, gate, up, down), bf16, its forward and its
  backward's two (input and weight gradients), beside roofline.matmul_seconds;
- `attention`: torch's SDPA as fivefold calls it (model/attention.py causal_attention), and held to
  its flash backend (FlashAttention-2), forward and backward, beside the planner's two curves;
- `block`: fivefold's model.transformer.Block as the runtime runs it (fp32 weights, bf16 autocast,
  the fp32 residual stream the embedding starts), forward and backward, beside roofline.price_ops
  of the same block with eager kernels.

Each line: the measured milliseconds (median of `--repeats`, CUDA events), the planner's, and their
ratio measured / planner (above 1: the planner is fast). On a CPU the planner prices the catalog's
H100 (a CPU has no catalog entry): that run checks the code path and its ratios mean nothing.
Exit status 0 whatever the figures; 1, with one line saying why, when `--device cuda` finds no GPU or
one the catalog lacks, or `--preset` names no preset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fivefold.config.load import load_config  # noqa: E402
from fivefold.model.attention import causal_attention  # noqa: E402
from fivefold.model.counts import head_dim  # noqa: E402
from fivefold.model.presets import PRESETS  # noqa: E402
from fivefold.model.rope import rope_cos_sin  # noqa: E402
from fivefold.model.transformer import Block  # noqa: E402
from fivefold.planner.calibration.gpu import catalog_key, keep_busy  # noqa: E402
from fivefold.planner.hardware import get_hardware  # noqa: E402
from fivefold.planner.machine import roofline  # noqa: E402
from fivefold.planner.machine.ops import RankShapes, block_ops  # noqa: E402


def _emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def milliseconds(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Median milliseconds of fn() after one warm-up call: CUDA events on a GPU, the wall clock on a CPU."""
    fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def _line(kind: str, name: str, measured: float, planner_s: float, **extra: object) -> dict:
    planner = planner_s * 1e3
    return {kind: name, **extra, "measured_ms": float(f"{measured:.4g}"), "planner_ms": float(f"{planner:.4g}"),
            "ratio": float(f"{measured / planner:.4g}") if planner else None}


def check_matmuls(ops, hw, device: str, repeats: int) -> list[dict]:
    """Each matmul (m, n, k) of the block: forward X W, then dY W^T and X^T dY, beside the planner."""
    lines = []
    for mm in ops.matmuls:
        shapes = {"forward": (mm.m, mm.n, mm.k), "input_grad": (mm.m, mm.k, mm.n), "weight_grad": (mm.k, mm.n, mm.m)}
        for part, (m, n, k) in shapes.items():
            a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            measured = milliseconds(lambda a=a, b=b: a @ b, repeats, device) * mm.count
            lines.append(_line("matmul", mm.name, measured, roofline.matmul_seconds(m, n, k, hw, 2, False) * mm.count,
                               part=part, shape=[m, n, k]))
    return lines


def check_attention(cfg, ops, hw, batch: int, seq: int, device: str, repeats: int) -> list[dict]:
    """The causal core at the block's heads: SDPA's kernel, then its flash backend alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    hd = head_dim(cfg)
    q = torch.randn(batch, seq, cfg.n_heads, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(batch, seq, cfg.n_kv_heads, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    lines = []
    for kernel, pinned in (("sdpa", None), ("fa2", SDPBackend.FLASH_ATTENTION)):
        price = roofline.price_ops(ops, hw, 2, False, kernel)

        def forward(pinned=pinned):
            with sdpa_kernel(pinned) if pinned else contextlib.nullcontext():
                return causal_attention(q, k, v)

        try:
            out = forward()
        except RuntimeError as e:  # this backend cannot run these inputs here
            lines.append({"attention": kernel, "error": str(e).splitlines()[0]})
            continue
        grad = torch.randn_like(out)
        lines.append(_line("attention", kernel, milliseconds(forward, repeats, device), price.forward["attention"],
                           part="forward"))
        backward = milliseconds(lambda out=out, grad=grad: out.backward(grad, retain_graph=True), repeats, device)
        lines.append(_line("attention", kernel, backward, price.backward["attention"], part="backward"))
    return lines


def check_block(cfg, ops, hw, batch: int, seq: int, device: str, repeats: int) -> list[dict]:
    """fivefold's Block, forward then backward, beside the planner's eager block."""
    block = Block(cfg, 0, head_dim(cfg)).to(device)
    x = torch.randn(batch, seq, cfg.dim, device=device, requires_grad=True)  # fp32: the embedding's output
    cos, sin = rope_cos_sin(torch.arange(seq, device=device), head_dim(cfg), cfg.rope)
    autocast = torch.autocast(device, dtype=torch.bfloat16)

    def forward():
        with autocast:
            return block(x, cos, sin)

    out = forward()
    grad = torch.randn_like(out)
    price = roofline.price_ops(ops, hw, 2, False)
    return [_line("block", "forward", milliseconds(forward, repeats, device), sum(price.forward.values())),
            _line("block", "backward", milliseconds(lambda: out.backward(grad, retain_graph=True), repeats, device),
                  sum(price.backward.values()))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="configs/tiny.toml's block, 2 x 64 tokens, no burn")
    ap.add_argument("--preset", default="llama3-8b", help="the model whose first block is checked")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--burn-s", type=float, default=10.0, help="seconds of back-to-back matmuls before timing")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        _emit({"error": "--device cuda: no CUDA device here"})
        return 1
    if not args.tiny and args.preset not in PRESETS:
        _emit({"error": f"--preset {args.preset}: not a model preset; one of {', '.join(sorted(PRESETS))}"})
        return 1
    cfg = load_config(ROOT / "configs/tiny.toml" if args.tiny else None,
                      [] if args.tiny else [f"--model.preset={args.preset}"]).model
    batch, seq, repeats = (2, 64, 2) if args.tiny else (args.batch, args.seq, args.repeats)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    try:
        hw = get_hardware(catalog_key(name) if args.device == "cuda" else "h100")
    except ValueError as e:  # a GPU the catalog lacks: its peaks, hence the planner's prices, are unknown
        _emit({"error": str(e)})
        return 1
    _emit({"device": name, "priced_as": hw.name, "torch": torch.__version__, "model": "tiny" if args.tiny
           else args.preset, "batch": batch, "seq": seq})
    if args.device == "cuda" and not args.tiny:
        x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        keep_busy(lambda: x @ x, args.burn_s, torch.cuda.synchronize)
    shapes = RankShapes(tokens=batch * seq, sp_tokens=batch * seq, seq_len=seq, kernel_seq=seq)
    ops = block_ops(cfg, 0, shapes)
    for line in (*check_matmuls(ops, hw, args.device, repeats),
                 *check_attention(cfg, ops, hw, batch, seq, args.device, repeats),
                 *check_block(cfg, ops, hw, batch, seq, args.device, repeats)):
        _emit(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
