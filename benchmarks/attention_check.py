"""Masked attention on one device: the kernels against the rule, then their time beside SDPA.

Run on the GPU machine from the source tree (gpu_check.py runs it as its `attention` part):

    python3 benchmarks/attention_check.py                 # CUDA: checks at T = 1024, times at T = 8192
    python3 benchmarks/attention_check.py --device cpu --tiny   # the suite's smoke test (tests/test_gpu_check.py)

One JSON line per result on stdout (progress on stderr):
- `check`: each kernel under documents + a sliding window + sinks (model/masks.py) against the rule
  written out densely in fp32 (its scores (B, H, T, T): a reference for small T only), forward and
  the q/k/v/sinks gradients, as the largest error over the largest reference value. `blockwise`
  (model/blockwise.py: on CUDA the memory-efficient kernel per tile, on CPU the flash op) in fp32 and
  in bf16, and `flex` (model/flex.py: compiled on CUDA; on CPU eager and forward only: there is no
  FlexAttention backward on CPU).
- `time`: forward + backward milliseconds (median of `--repeats`, the device synchronised) at T with
  documents of mean length T/8, and each over the native peer's: SDPA with `is_causal` (what runs
  without a mask), SDPA with the dense (B, 1, T, T) boolean mask (what fivefold ran before
  model/blockwise.py), the blockwise path, FlexAttention.
Exit status 0 whatever the figures; 1 only when `--device cuda` finds no GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from fivefold.model.blockwise import blockwise_attention  # noqa: E402
from fivefold.model.flex import flex_attention_core  # noqa: E402
from fivefold.model.masks import AttentionMask, dense_attention, dense_keep, document_ids  # noqa: E402


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def inputs(T: int, H: int, K: int, D: int, dtype: torch.dtype, device: str, seed: int = 0):
    """q, k, v (1, T, H|K, D) needing gradients, and a mask of documents of mean T/8, a window of T/16
    and sinks."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, T, h, D, generator=g).to(device, dtype).requires_grad_() for h in (H, K, K))
    tokens = torch.ones(1, T, dtype=torch.long)
    tokens[0, torch.randint(0, T, (7,), generator=g)] = 0  # 8 documents
    sinks = torch.randn(H, generator=g).to(device).requires_grad_()
    return q, k, v, AttentionMask(document_ids(tokens, 0).to(device), T // 16, sinks)


def dense(q, k, v, mask: AttentionMask) -> torch.Tensor:
    """The rule written out, in fp32."""
    return dense_attention(q.float(), k.float(), v.float(), mask)


def outputs_and_grads(fn, q, k, v, mask, backward: bool) -> list[torch.Tensor]:
    for x in (q, k, v, mask.sinks):
        x.grad = None
    if not backward:  # (FlexAttention on CPU refuses inputs that need gradients)
        frozen = AttentionMask(mask.doc, mask.window, mask.sinks.detach())
        return [fn(q.detach(), k.detach(), v.detach(), frozen).float()]
    out = fn(q, k, v, mask)
    out.float().pow(2).sum().backward()
    return [out.detach().float()] + [x.grad.float() for x in (q, k, v, mask.sinks)]


def check(name: str, fn, dtype: torch.dtype, device: str, T: int, backward: bool) -> dict:
    q, k, v, mask = inputs(T, 8, 2, 64, dtype, device)
    ours = outputs_and_grads(fn, q, k, v, mask, backward)
    ref = outputs_and_grads(dense, q, k, v, mask, backward)
    errors = {what: float((a - b).abs().max() / b.abs().max())
              for what, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], ours, ref, strict=False)}
    return {"check": name, "dtype": str(dtype).removeprefix("torch."), "T": T, "relative_max_error": errors}


def sdpa(q, k, v, mask, dense_mask: torch.Tensor | None = None):
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask, is_causal=dense_mask is None,
                                          enable_gqa=True).transpose(1, 2)


def milliseconds(fn, q, k, v, mask, device: str, repeats: int) -> float:
    times = []
    for i in range(repeats + 1):  # the first runs untimed: compilation, kernel selection
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        fn(q, k, v, mask).float().sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes, few repeats: the suite's smoke test")
    ap.add_argument("--repeats", type=int, default=0, help="timed repeats (default 10; --tiny 2)")
    args = ap.parse_args(argv)
    device, cuda = args.device, args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("attention_check: --device cuda but no GPU (here: --device cpu --tiny)", file=sys.stderr)
        return 1
    T_check, T_time = (64, 256) if args.tiny else (1024, 8192 if cuda else 2048)
    repeats = args.repeats or (2 if args.tiny else 10)
    emit({"environment": True, "torch": torch.__version__, "device": device,
          "name": torch.cuda.get_device_name() if cuda else "cpu"})
    cases = [("blockwise", lambda *a: blockwise_attention(*a), torch.float32, True),
             ("blockwise", lambda *a: blockwise_attention(*a), torch.bfloat16, True),
             ("flex", lambda *a: flex_attention_core(*a, compiled=cuda), torch.bfloat16 if cuda else torch.float32,
              cuda)]
    for name, fn, dtype, backward in cases:
        try:
            emit(check(name, fn, dtype, device, T_check, backward))
        except Exception as e:  # one line, and the next check runs
            emit({"check": name, "dtype": str(dtype).removeprefix("torch."), "error": repr(e)[:500]})
    dtype = torch.bfloat16 if cuda else torch.float32
    H, K, D = (32, 8, 128) if cuda else (4, 2, 64)
    q, k, v, mask = inputs(T_time, H, K, D, dtype, device)
    mask = AttentionMask(mask.doc, 0, None)  # documents alone, the common case
    keep = dense_keep(mask, T_time, device)
    sides = {"sdpa_causal": lambda q, k, v, m: sdpa(q, k, v, m),
             "sdpa_dense_mask": lambda q, k, v, m: sdpa(q, k, v, m, keep),
             "blockwise": lambda q, k, v, m: blockwise_attention(q, k, v, m),
             "flex": lambda q, k, v, m: flex_attention_core(q, k, v, m, compiled=cuda)}
    if not cuda:
        del sides["flex"]  # no backward on CPU
    times = {}
    for side, fn in sides.items():
        try:
            times[side] = milliseconds(fn, q, k, v, mask, device, repeats)
        except Exception as e:
            emit({"time": side, "error": repr(e)[:500]})
    emit({"time": True, "T": T_time, "heads": [H, K, D], "dtype": str(dtype).removeprefix("torch."),
          "documents_mean_tokens": T_time // 8, "ms": {s: round(t, 3) for s, t in times.items()},
          "ratio_over_sdpa_causal": {s: round(t / times["sdpa_causal"], 3) for s, t in times.items()
                                     if "sdpa_causal" in times}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
