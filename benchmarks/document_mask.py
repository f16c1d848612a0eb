"""Document masking: step time with data.document_mask on against off, same model, data and weights.

Run: `.venv/bin/python benchmarks/document_mask.py [--steps N] [--rounds R] [--quick] [--only single dp2]`
(extra `--section.key=value` arguments override the config, configs/debug.toml by default).

The `configs/debug.toml` model (dim 128, 4 layers, seq 128, micro-batch 8, fp32) is trained with
the real loop (`fivefold.train.loop.train`) on forked gloo ranks: `single` on one process, `dp2`
on two data-parallel ranks. Three sides:
- `off`: both options off, SDPA with `is_causal=True` (the default path);
- `mask`: data.document_mask, SDPA with a boolean (B, 1, T, T) mask built from the token ids;
- `mask_reset`: the mask and data.reset_positions ((B, T) RoPE positions).
The data: this Python's standard-library sources cut into documents of `--doc-bytes` (a seeded
uniform draw, 32-256 bytes by default: about one document boundary per row of 128), each its own
file; the standard library as it is (whole files of ~10 kB) puts an eod in ~1% of the rows, and
the options would change almost nothing. The masked kernel does the same work however many
documents a row holds (the mask is dense), so the time does not depend on this choice; the loss does.
The sides alternate over rounds (A B C, C B A, ...), so a load change on the shared machine hits
them alike; a step's time is rank 0's `step_time_s` from the metrics log, the median over the
timed steps of every round. The sides compute different things, so their losses are not compared
with each other (the last step's are printed: they differ); each side's losses are checked to repeat
from round to round.
Also reported, in this process: the time to build one micro-batch's mask and positions
(model/masks.py), and the attention core alone (forward + backward of `causal_attention` on the
config's shapes) with the mask against `is_causal=True`, which the step-time noise of a shared
machine does not blur.

Output: progress on stderr; one JSON line per comparison on stdout, then a summary line whose
ratio keys contain "ratio" (masked / unmasked step time). No targets: the issue asks for the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import fivefold.train.loop  # noqa: E402,F401  (imported once here: the forked workers inherit it)
from benchmarks.common import finish_summary, log, make_parser, median, parse, ratio  # noqa: E402
from fivefold.config import load_config  # noqa: E402
from fivefold.model.attention import causal_attention  # noqa: E402
from fivefold.model.masks import Documents  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402

COMPARISONS = {"single": 1, "dp2": 2}  # name: ranks (data parallel)
SIDES = {"off": (), "mask": ("--data.document_mask=true",),
         "mask_reset": ("--data.document_mask=true", "--data.reset_positions=true")}


def _worker(rank: int, world: int, cfg) -> list[dict]:
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    with contextlib.redirect_stdout(sys.stderr):  # stdout holds only this script's JSON lines
        result = train(cfg, progress=False)
    return read_metrics(result.run_dir / cfg.run.metrics_file) if rank == 0 else []


def short_documents(folder: Path, total_bytes: int, lo: int, hi: int, seed: int = 0) -> float:
    """Write the standard library's first `total_bytes` (files in sorted order) into `folder` as
    documents of lo..hi bytes, one file each; returns their mean length in tokens (bytes + eod)."""
    text = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text += path.read_bytes()
        if len(text) >= total_bytes:
            break
    rng, start, n = random.Random(seed), 0, 0
    while start < min(len(text), total_bytes):
        size = rng.randint(lo, hi)
        (folder / f"doc{n:06d}.txt").write_bytes(bytes(text[start:start + size]))
        start, n = start + size, n + 1
    return min(len(text), total_bytes) / n + 1


def _run(name: str, side: str, args, overrides: list[str], out: Path) -> list[dict]:
    nproc = COMPARISONS[name]
    cfg = load_config(Path(args.config), [
        *SIDES[side], f"--train.steps={args.warmup + args.steps}", "--train.warmup_steps=1", "--train.dtype=fp32",
        "--train.device=cpu", f'--data.paths=["{out / "docs"}"]', "--data.max_bytes=0", "--data.val_fraction=0",
        "--train.eval_every=0", "--checkpoint.every=0", f"--run.out_dir={out}",
        f"--run.name={name}-{side}-{time.monotonic_ns()}", "--train.log_every=1000", *overrides])
    return run_workers(_worker, nproc, cfg, timeout=900)[0]


def mask_build_seconds(batch: int, seq_len: int, repeats: int = 50) -> float:
    """Median time to build one micro-batch's mask and positions from its token ids (stdlib-like
    rows: an eod every ~100 tokens)."""
    tokens = torch.randint(0, 256, (batch, seq_len))
    tokens[:, ::97] = 256
    docs = Documents(256, mask=True, reset_positions=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        docs.inputs(tokens, torch.arange(seq_len))
        times.append(time.perf_counter() - t0)
    return median(times)


def core_seconds(batch: int, seq_len: int, heads: int, head_dim: int, masked: bool, repeats: int = 30) -> float:
    """Median forward + backward time of the local attention core, causal or with a document mask."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch, seq_len, heads, head_dim, generator=g).requires_grad_() for _ in range(3))
    tokens = torch.randint(0, 256, (batch, seq_len), generator=g)
    tokens[:, ::97] = 256
    mask = Documents(256, mask=True, reset_positions=False).inputs(tokens, torch.arange(seq_len))[1] if masked else None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        causal_attention(q, k, v, mask).sum().backward()
        times.append(time.perf_counter() - t0)
    return median(times)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "debug.toml"), COMPARISONS, steps=6, rounds=2,
                         unit="comparison")
    parser.add_argument("--doc-bytes", type=int, nargs=2, default=(32, 256), metavar=("LO", "HI"),
                        help="document lengths in bytes, drawn uniformly")
    parser.add_argument("--data-bytes", type=int, default=300_000, help="bytes of the corpus")
    args, overrides = parse(parser, argv)
    began, summary = time.perf_counter(), {"summary": True}
    cfg = load_config(Path(args.config), overrides)
    build_s = mask_build_seconds(cfg.train.micro_batch, cfg.train.seq_len)
    summary["mask_build_ms_per_micro_batch"] = round(build_s * 1e3, 3)
    m = cfg.model
    shape = (cfg.train.micro_batch, cfg.train.seq_len, m.n_heads, m.head_dim or m.dim // m.n_heads)
    core = {side: core_seconds(*shape, masked=side == "mask") for side in ("causal", "mask")}
    summary["core_ms"] = {side: round(t * 1e3, 3) for side, t in core.items()}
    summary["core_ratio_mask_over_causal"] = ratio(core["mask"], core["causal"])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "docs").mkdir()
        mean_tokens = short_documents(Path(tmp) / "docs", args.data_bytes, *args.doc_bytes)
        summary["mean_document_tokens"] = round(mean_tokens, 1)
        for name in args.only:
            sides = list(SIDES)
            steps: dict[str, list[dict]] = {s: [] for s in sides}
            losses: dict[str, list[list[float]]] = {s: [] for s in sides}
            for rnd in range(args.rounds):
                for side in sides if rnd % 2 == 0 else sides[::-1]:
                    log(f"{name}: round {rnd + 1}/{args.rounds}, {side}")
                    metrics = _run(name, side, args, overrides, Path(tmp))
                    losses[side].append([m["loss"] for m in metrics])
                    steps[side] += metrics[args.warmup:]
            t = {s: median([m["step_time_s"] for m in steps[s]]) for s in sides}
            record = {"name": name, "nproc": COMPARISONS[name], "seq_len": cfg.train.seq_len,
                      "micro_batch": cfg.train.micro_batch, "sides": sides,
                      "step_time_s": {s: round(t[s], 4) for s in sides},
                      "tokens_per_s": {s: round(median([m["tokens_per_s"] for m in steps[s]]), 1) for s in sides},
                      "ratio_step_time_mask_over_off": ratio(t["mask"], t["off"]),
                      "ratio_step_time_mask_reset_over_off": ratio(t["mask_reset"], t["off"]),
                      "loss_first_step": {s: losses[s][0][0] for s in sides},
                      "loss_last_step": {s: losses[s][0][-1] for s in sides},  # the options change the run
                      "losses_repeat_every_round": all(r == losses[s][0] for s in sides for r in losses[s])}
            summary[f"{name}_ratio_mask_over_off"] = record["ratio_step_time_mask_over_off"]
            summary[f"{name}_ratio_mask_reset_over_off"] = record["ratio_step_time_mask_reset_over_off"]
            log(f"{name}: {json.dumps(record['step_time_s'])}, mask / off {record['ratio_step_time_mask_over_off']}")
            print(json.dumps(record), flush=True)
    finish_summary(summary, None, began, note="no target: the issue asks for the figures")


if __name__ == "__main__":
    main()
