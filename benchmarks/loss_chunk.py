"""The head and the loss at a 128k vocabulary: fivefold's chunked cross-entropy (train.loss_chunk)
against its unchunked path and PyTorch's eager cross-entropy over the full logits (issue 51).

    .venv/bin/python benchmarks/loss_chunk.py                     # ~3 min on 2 idle cores: chunk 1024, 0, peer
    .venv/bin/python benchmarks/loss_chunk.py --quick             # smoke test, ~1 min (dim 256, one timed call)
    .venv/bin/python benchmarks/loss_chunk.py --sweep --only head step   # chunks 256..4096 and a whole step
    .venv/bin/python benchmarks/loss_chunk.py --device cuda --dtype bf16 --dim 2048 --sweep --repeats 10

One process; 4096 tokens per micro-batch (micro-batch 1 x seq 4096, `--tokens`), vocabulary 128256
(Llama 3's), hidden states of width `--dim`. Two parts (`--only`):

- `head`: `OutputHead` (fivefold/model/head.py) forward with targets, `.sum()`, backward, from
  hidden states (N, dim) that require a gradient, at each `--chunks` size (train.loss_chunk; 0: the
  whole micro-batch at once, fivefold's unchunked path), against the peer: eager
  `F.cross_entropy(F.linear(h, W).float(), targets, reduction="sum")`, PyTorch's native way, which
  holds the (N, V) logits, their fp32 copy, the log-softmax and the logits' gradient.
- `step`: one whole training step (forward, backward, AdamW) of a 2-block model of width `dim` with
  the same head, train.loss_chunk = `--step-chunk` against 0 and against the peer's loss on the
  same model's full logits.

Time: the median of `--repeats` calls after one untimed call, the sides alternated call by call
(reversed on every other repeat) so a neighbour's load falls on all of them; wall time, and this
process's CPU time beside it (`cpu_ms`, less moved by the neighbours on a shared machine). Peak
memory: the most bytes of tensor storages created during the call and alive at once, above the
inputs (h, W, targets; for a step the model, its Adam state and the batch): on a GPU the
allocator's `max_memory_allocated()` minus what was allocated before; on the CPU
document_mask.py's `LiveBytes` (a TorchDispatchMode that counts each storage an operation returns
until a finalizer sees it freed), exact and the same at every run. Not the resident set: it counts
pages, not tensors (glibc keeps freed small blocks, buffers above its mmap threshold come and go
whole, the interpreter and libraries sit under everything). The untimed first call is the memory call.

Why dim 1024: the chunked path recomputes the logits in backward, one head matmul more (2 N dim V
FLOPs, a third of the head's), while its elementwise passes over (c, V) stay smaller; the first
grows with dim, the second does not, so a small dim flatters chunking. 1024 is half the smallest
Llama 3 head (3.2 1B: 2048), so that the default run takes minutes on a CPU; `--dim 2048` is that
model's head (the GPU check's shape), at about twice the matmul time. Memory at other widths: the
chunked side also holds weight-sized (V, dim) buffers (the fp32 weight-gradient sum and, per chunk,
the product added to it), which grow with dim where the peer's logits do not.

Output: progress on stderr; on stdout one JSON line per part, then a summary line whose keys with
`ratio` are chunked / peer (and chunked / unchunked): below 1 means smaller or faster. Targets
from the issue, printed, not asserted: at the default chunk (1024), peak memory <= 0.5 of the
peer's, step time <= 1.10 of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import finish_summary, log, median, ratio  # noqa: E402
from fivefold.model.head import OutputHead  # noqa: E402

VOCAB = 128256  # Llama 3's
DEFAULT_CHUNK = 1024  # train.loss_chunk's default, which the targets judge
SWEEP = [256, 512, 1024, 2048, 4096, 0]  # --sweep: the chunk sizes a default is chosen from
TARGETS = {"peak": 0.5, "time": 1.10}  # issue 51: at least 2x less peak memory, step time within 10%
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

Side = Callable[[], torch.Tensor]  # one call's scalar loss, ready for backward


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def side_name(chunk: int | None) -> str:
    return "peer" if chunk is None else f"chunk{chunk}"


def peer_loss(head: OutputHead, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """PyTorch's eager way: the whole micro-batch's logits (N, V) in the compute dtype, upcast, reduced."""
    logits = F.linear(h, head.weight)  # (N, V)
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def head_inputs(tokens: int, dim: int, vocab: int, device: str,
                seed: int = 0) -> tuple[OutputHead, torch.Tensor, torch.Tensor]:
    """The head (V, dim), hidden states (N, dim) that require a gradient, targets (N,); fp32, as
    train.dtype = bf16 keeps them too (fp32 weights, matmuls under autocast: train/precision.py)."""
    g = torch.Generator().manual_seed(seed)
    with torch.device(device):  # a GPU's head is made there, not on the host and copied
        head = OutputHead(dim, vocab)
    h = torch.randn(tokens, dim, generator=g).to(device).requires_grad_()  # (N, dim)
    targets = torch.randint(0, vocab, (tokens,), generator=g).to(device)  # (N,)
    return head, h, targets


def head_sides(head: OutputHead, h: torch.Tensor, targets: torch.Tensor, chunks: list[int],
               dtype: torch.dtype = torch.float32) -> dict[str, Side]:
    """Each chunk size's loss (fivefold's OutputHead with targets) and the peer's, on the same inputs;
    a `dtype` other than fp32: the forwards under autocast to it, as fivefold's step runs them."""
    sides = {side_name(c): (lambda c=c: head(h, targets, c).sum()) for c in chunks}
    sides[side_name(None)] = lambda: peer_loss(head, h, targets)
    return {name: under_autocast(side, h.device.type, dtype) for name, side in sides.items()}


def under_autocast(loss: Side, device_type: str, dtype: torch.dtype) -> Side:
    """`loss` as fivefold's step runs it in `dtype`: fp32 as it is, else its forward under autocast."""
    def run() -> torch.Tensor:
        with torch.autocast(device_type, dtype=dtype):
            return loss()

    return loss if dtype == torch.float32 else run


def peak_bytes(call: Callable[[], None], device: str) -> int:
    """The most bytes allocated at once during `call`, above what was allocated before it."""
    if device == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        sync(device)
        return torch.cuda.max_memory_allocated() - base
    from benchmarks.document_mask import LiveBytes  # the CPU has no allocator counter

    with LiveBytes() as live:
        call()
    return live.peak


def measure(sides: dict[str, Side], leaves: list[torch.Tensor], repeats: int, device: str,
            after: Callable[[], None] = lambda: None) -> dict[str, dict]:
    """Each side: its loss, peak bytes (the first, untimed call) and the median of `repeats` timed
    calls of loss + backward (`after`: the rest of a step, timed with it), sides alternated."""
    def call(side: Side) -> float:
        for x in leaves:
            x.grad = None
        loss = side()
        loss.backward()
        after()
        return loss.item()

    out = {name: {"times": [], "cpu_times": []} for name in sides}
    began = time.perf_counter()
    for name, side in sides.items():  # the memory call, also each side's warm-up
        out[name]["peak_bytes"] = peak_bytes(lambda s=side, n=name: out[n].update(loss=call(s)), device)
        log(f"  {name:10s} memory call: peak {out[name]['peak_bytes'] / 2**20:9.1f} MB  "
            f"[{time.perf_counter() - began:.0f} s]")
    names = list(sides)
    for rep in range(repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            call(sides[name])
            sync(device)
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["cpu_times"].append(time.process_time() - c0)
            log(f"  {name:10s} call {rep + 1}/{repeats}: {out[name]['times'][-1]:.3f} s  "
                f"[{time.perf_counter() - began:.0f} s]")
    for name in names:
        out[name]["ms"] = round(median(out[name]["times"]) * 1e3, 3)
        out[name]["cpu_ms"] = round(median(out[name]["cpu_times"]) * 1e3, 3)  # this process alone: less noise
        out[name]["times"] = [round(t, 6) for t in out[name]["times"]]
        out[name]["cpu_times"] = [round(t, 6) for t in out[name]["cpu_times"]]
        out[name]["peak_mb"] = round(out[name]["peak_bytes"] / 2**20, 1)
    return out


def ratios(res: dict[str, dict], prefix: str) -> dict[str, float]:
    """Each chunked side over the peer (and over fivefold's unchunked path): peak memory and time."""
    out = {}
    for name in res:
        if name == "peer":
            continue
        for against in ("peer", "chunk0"):
            if against in res and name != against:
                out[f"{prefix}_ratio_peak_{name}_over_{against}"] = ratio(res[name]["peak_bytes"],
                                                                          res[against]["peak_bytes"])
                out[f"{prefix}_ratio_time_{name}_over_{against}"] = ratio(res[name]["ms"], res[against]["ms"])
                out[f"{prefix}_ratio_cpu_time_{name}_over_{against}"] = ratio(res[name]["cpu_ms"],
                                                                              res[against]["cpu_ms"])
    return out


def head_part(args, dtype: torch.dtype) -> dict:
    head, h, targets = head_inputs(args.tokens, args.dim, args.vocab, args.device)
    res = measure(head_sides(head, h, targets, args.chunks, dtype), [h, head.weight], args.repeats, args.device)
    losses = {n: r["loss"] for n, r in res.items()}
    spread = max(losses.values()) - min(losses.values())
    return {"part": "head", "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "dtype": args.dtype,
            "fp32_logits_mb": round(args.tokens * args.vocab * 4 / 2**20, 1),
            "sides": {n: {k: v for k, v in r.items() if k != "peak_bytes"} for n, r in res.items()},
            "loss_max_abs_diff": spread, **ratios(res, "head")}


def step_part(args, dtype: torch.dtype) -> dict:
    """One training step of a 2-block model of width dim with the 128k head, each loss beside the others."""
    from fivefold.model.config import ModelConfig
    from fivefold.model.transformer import Transformer

    heads = max(1, args.dim // 128)
    cfg = ModelConfig(dim=args.dim, n_layers=2, n_heads=heads, n_kv_heads=heads, ffn_dim=4 * args.dim,
                      vocab_size=args.vocab)
    torch.manual_seed(0)
    model = Transformer(cfg).to(args.device)  # fp32 weights; bf16: autocast, as train.dtype runs it
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, foreach=True)  # all the work, the same weights
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (1, args.tokens + 1), generator=g).to(args.device)  # (1, T + 1)
    x, y = tokens[:, :-1], tokens[:, 1:]  # (1, T)

    def fivefold(c: int) -> torch.Tensor:
        h = model(x, logits=False)  # (1, T, dim), after the final norm
        return model.output(h, y, c).sum() / y.numel()

    def peer() -> torch.Tensor:
        return peer_loss(model.output, model(x, logits=False).flatten(0, 1), y.flatten()) / y.numel()

    sides = {side_name(c): (lambda c=c: fivefold(c)) for c in (args.step_chunk, 0)}
    sides["peer"] = peer
    sides = {name: under_autocast(side, args.device, dtype) for name, side in sides.items()}
    fivefold(0).backward()  # the Adam state exists before any side is measured: a step's inputs
    opt.step()
    opt.zero_grad(set_to_none=True)

    def after() -> None:  # the rest of the step; lr 0 leaves the weights, so the sides' losses compare
        opt.step()
        opt.zero_grad(set_to_none=True)

    res = measure(sides, [], args.repeats, args.device, after)
    return {"part": "step", "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab, "dtype": args.dtype,
            "model": {"n_layers": 2, "n_heads": heads, "ffn_dim": 4 * args.dim},
            "sides": {n: {k: v for k, v in r.items() if k != "peak_bytes"} for n, r in res.items()},
            **ratios(res, "step")}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--only", nargs="+", choices=["head", "step"], default=["head"],
                    help="head (default), step: a whole training step too (~4 min more at dim 1024)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per micro-batch (default 4096: 1 x seq 4096)")
    ap.add_argument("--dim", type=int, default=1024, help="hidden width (default 1024; see the docstring)")
    ap.add_argument("--vocab", type=int, default=VOCAB, help=f"vocabulary (default {VOCAB}, Llama 3's)")
    ap.add_argument("--chunks", type=int, nargs="+", default=[DEFAULT_CHUNK, 0],
                    help=f"train.loss_chunk sizes for the head part (0: unchunked; default {DEFAULT_CHUNK} 0)")
    ap.add_argument("--sweep", action="store_true", help=f"--chunks {' '.join(map(str, SWEEP))}: ~7 min at dim 1024")
    ap.add_argument("--step-chunk", type=int, default=DEFAULT_CHUNK, help="train.loss_chunk for the step part")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls per side after the untimed memory call")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="bf16: autocast over fp32 weights")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on the CPU (default: torch's)")
    ap.add_argument("--quick", action="store_true", help="chunks 1024 and 0, dim 256, one timed call: a smoke test")
    args = ap.parse_args(argv)
    if args.sweep:
        args.chunks = SWEEP
    if args.quick:
        args.chunks, args.dim, args.repeats = [DEFAULT_CHUNK, 0], 256, 1
    if args.tokens <= 0 or args.dim <= 0 or args.repeats <= 0 or min(args.chunks) < 0:
        ap.error("--tokens, --dim and --repeats take positive numbers, --chunks zero or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    summary = {"summary": True, "device": args.device, "threads": torch.get_num_threads(), "dtype": args.dtype,
               "tokens": args.tokens, "dim": args.dim, "vocab": args.vocab}
    for part in args.only:
        log(f"loss_chunk: {part} part, {args.tokens} tokens x dim {args.dim} x vocab {args.vocab}, {args.dtype} "
            f"[{time.perf_counter() - began:.0f} s]")
        record = head_part(args, dtype) if part == "head" else step_part(args, dtype)
        for name, r in record["sides"].items():
            log(f"  {part} {name:10s} {r['ms']:10.1f} ms (CPU {r['cpu_ms']:10.1f})  peak {r['peak_mb']:9.1f} MB  "
                f"loss {r['loss']:.6g}")
        print(json.dumps(record), flush=True)
        summary.update({k: v for k, v in record.items() if "_ratio_" in k})
    chunk = side_name(DEFAULT_CHUNK)
    targets = {f"{p}_ratio_{m}_{chunk}_over_peer": TARGETS[m] for p in args.only for m in TARGETS}
    finish_summary(summary, targets, began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
