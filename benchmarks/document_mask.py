"""Documents and ring attention on kernels: step time and peak memory of packed documents against
the plain causal path, the CPU exact path against dense-mask SDPA, and ring attention before and
after it ran on kernels (issue 30).

Run: `.venv/bin/python benchmarks/document_mask.py [--steps N] [--rounds R] [--quick] [--seq-len T]
[--only single dp2 cp2 core ring]` (extra `--section.key=value` arguments override the config,
configs/debug.toml by default).

Parts (`--only`):
- `single`, `dp2`, `cp2`: the `configs/debug.toml` model (dim 128, 4 layers, 4 heads of 32, fp32)
  at seq `--seq-len` (2048), micro-batch 1, global batch 2, trained with the real loop
  (`fivefold.train.loop.train`) on forked gloo ranks: one process, dp = 2, cp = 2 (ring, zig-zag).
  Sides: `off` (no option: SDPA `is_causal=True`, or the ring's causal blocks), `mask`
  (data.document_mask: the blockwise path, model/blockwise.py; under cp the ring's chunk pairs
  the mask keeps), `mask_reset` (and data.reset_positions). cp2 adds `off_ring_before`: `off` with
  the ring attention core as it was before item 4 (benchmarks/ring_before.py, dense fp32 einsum
  tiles and a hand-written backward, swapped into `fivefold.parallel.context` in the forked
  workers only): whole training steps before and after, same weights and data, so their first
  losses are checked to agree within 1e-4. The data: this Python's standard-library sources cut
  into documents of a seeded uniform 1/16..3/16 of the sequence in bytes (the byte tokenizer: mean
  length T/8 tokens with the eod; `--doc-bytes` to change), each its own file. The sides alternate
  over rounds (A B C, C B A, ...); a step's time is rank 0's `step_time_s` from the metrics log, the
  median over the timed steps of every round. Each side's losses are checked to repeat from round
  to round. Peak memory: after the timed rounds, one more run per side of warm-up + 1 steps under
  `LiveBytes` (below): the most bytes of tensor storages alive at once that `train` created (model,
  gradients, optimizer state, activations, attention's temporaries), the larger rank's. The sides
  share everything but attention, so their difference is what the mask costs. (Peak RSS was tried
  first: file-backed pages mapped during the run and glibc's heap moved it by more than that.)
- `core`: the attention core alone in this process, forward + backward, B 1, H 4, D 64, at T = 2k
  and 8k (2k only with --quick), documents of mean length T/8: `blockwise` (`attend` with an
  AttentionMask of the documents: the CPU exact path the model takes), `dense_sdpa`
  (`F.scaled_dot_product_attention` with a boolean (B, 1, T, T) mask built here: PyTorch's native
  way, and fivefold's before issue 30) and `causal_sdpa` (`is_causal=True`, no documents: the
  plain path). Alternating, median. Peak memory: the most bytes of tensor storages created during
  forward + backward and alive at once (a TorchDispatchMode registers each new storage an
  operation returns and a finalizer that subtracts it when freed; q, k, v and the dense mask exist
  before and are not counted, their gradients are). Exact for what PyTorch allocates as tensors;
  kernels' internal scratch buffers are not seen.
- `ring`: ring attention's core alone on 2 forked gloo ranks (cp = 2, zig-zag), plain causal,
  forward + backward, B 1, H 4, D 64, T = 2k and 8k: today's (`parallel.context.ring_attention`:
  the CPU flash kernel per chunk pair) against the one before item 4 (benchmarks/ring_before.py),
  alternating, the slower rank's time per call, median; their outputs and gradients are compared.

Output: progress on stderr; one JSON line per part on stdout, then a summary line whose ratio keys
contain "ratio" (masked / unmasked, blockwise / dense SDPA, after / before). No targets: the issue
asks for the figures. Absolute times on a shared machine are noise; read the ratios.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import sys
import sysconfig
import tempfile
import time
import weakref
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fivefold.train.loop  # noqa: E402,F401  (imported once here: the forked workers inherit it)
from benchmarks import ring_before  # noqa: E402
from benchmarks.common import finish_summary, log, make_parser, median, parse, ratio  # noqa: E402
from fivefold.config.load import load_config  # noqa: E402
from fivefold.model.attention import attend  # noqa: E402
from fivefold.model.masks import AttentionMask, Documents, document_ids  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402

STEP_PARTS = {"single": (1, ()), "dp2": (2, ()),  # name: (ranks, layout overrides); dp takes the ranks left
              "cp2": (2, ("--parallel.cp=2", "--parallel.dp=1", "--parallel.cp_method=ring"))}
PARTS = [*STEP_PARTS, "core", "ring"]
SIDES = {"off": (), "mask": ("--data.document_mask=true",),
         "mask_reset": ("--data.document_mask=true", "--data.reset_positions=true"),
         "off_ring_before": ()}  # cp2 only: `off` with the old ring core
HEADS, HEAD_DIM = 4, 64  # the kernel parts' shapes, batch 1
LOSS_TOL = 1e-4  # old and new ring: the same attention, summed in another order and kernel


# ---- the data: documents of mean length T/8 --------------------------------------------------


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


def document_bytes(seq_len: int) -> tuple[int, int]:
    """Uniform document lengths in bytes whose mean, with the eod token, is seq_len / 8 tokens."""
    return max(1, seq_len // 16), max(1, 3 * seq_len // 16 - 2)


def packed_documents(batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """(B, T) document ids of rows packed with documents of the same lengths as the corpus's."""
    rng, lo, hi = random.Random(seed), *document_bytes(seq_len)
    tokens = torch.ones(batch, seq_len, dtype=torch.long)
    for row in range(batch):
        end = rng.randint(lo, hi)
        while end < seq_len:
            tokens[row, end] = 0  # an eod closes each document
            end += 1 + rng.randint(lo, hi)
    return document_ids(tokens, 0)


# ---- peak memory: live tensor bytes ----------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """While active: the most bytes of tensor storages created by operations and alive at once.

    A storage counts from the operation that returned it (not one of the operation's inputs: a view
    or an in-place result) until it is freed, which a finalizer on it sees (PyTorch keeps one Python
    object per storage, so the finalizer runs when the storage itself goes)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.held.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self.held:
                continue
            self.held.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        return out


# ---- whole training steps --------------------------------------------------------------------


def _old_ring(q, k, v, group, layout="zigzag", mask=None, counts=None):
    """parallel/context.py's ring_attention signature, served by the core before item 4 (causal only)."""
    if mask is not None:
        raise ValueError("the ring core before issue 30 did causal attention only")
    return ring_before.ring_attention(q, k, v, group, layout)


def _step_worker(rank: int, world: int, cfg, old_ring: bool, memory: bool) -> dict:
    import fivefold.parallel.context as context
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    if old_ring:
        context.ring_attention = _old_ring  # this forked worker only: ContextParallel.core looks it up per call
    live = LiveBytes() if memory else contextlib.nullcontext()
    with contextlib.redirect_stdout(sys.stderr), live:  # stdout holds only this script's JSON lines
        result = train(cfg, progress=False)
    return {"metrics": read_metrics(result.run_dir / cfg.run.metrics_file) if rank == 0 else [],
            "peak_mb": live.peak / 2**20 if memory else 0.0}


def _step_run(name: str, side: str, args, overrides: list[str], out: Path, steps: int, memory: bool) -> dict:
    nproc, layout = STEP_PARTS[name]
    cfg = load_config(Path(args.config), [
        *SIDES[side], *layout, f"--train.seq_len={args.seq_len}", "--train.micro_batch=1", "--train.global_batch=2",
        f"--train.steps={steps}", "--optim.warmup_steps=1", "--train.dtype=fp32", "--train.device=cpu",
        f'--data.paths=["{out / "docs"}"]', "--data.max_bytes=0", "--data.val_fraction=0", "--train.eval_every=0",
        "--checkpoint.every=0", f"--run.out_dir={out}", f"--run.name={name}-{side}-{time.monotonic_ns()}",
        "--train.log_every=1000", *overrides])
    results = run_workers(_step_worker, nproc, cfg, side == "off_ring_before", memory, timeout=900)
    return {"metrics": results[0]["metrics"], "peak_mb": max(r["peak_mb"] for r in results)}


def step_part(name: str, args, overrides: list[str], out: Path, summary: dict) -> dict:
    sides = ["off", "mask", "mask_reset"] + (["off_ring_before"] if name == "cp2" else [])
    steps: dict[str, list[dict]] = {s: [] for s in sides}
    losses: dict[str, list[list[float]]] = {s: [] for s in sides}
    for rnd in range(args.rounds):
        for side in sides if rnd % 2 == 0 else sides[::-1]:
            log(f"{name}: round {rnd + 1}/{args.rounds}, {side}")
            metrics = _step_run(name, side, args, overrides, out, args.warmup + args.steps, False)["metrics"]
            losses[side].append([m["loss"] for m in metrics])
            steps[side] += metrics[args.warmup:]
    peak = {}
    for side in sides:
        log(f"{name}: memory run, {side}")
        peak[side] = _step_run(name, side, args, overrides, out, args.warmup + 1, True)["peak_mb"]
    t = {s: median([m["step_time_s"] for m in steps[s]]) for s in sides}
    record = {"name": name, "nproc": STEP_PARTS[name][0], "seq_len": args.seq_len, "micro_batch": 1, "sides": sides,
              "step_time_s": {s: round(t[s], 4) for s in sides},
              "tokens_per_s": {s: round(median([m["tokens_per_s"] for m in steps[s]]), 1) for s in sides},
              "peak_mb": {s: round(peak[s], 1) for s in sides},
              "ratio_step_time_mask_over_off": ratio(t["mask"], t["off"]),
              "ratio_step_time_mask_reset_over_off": ratio(t["mask_reset"], t["off"]),
              "ratio_peak_mask_over_off": ratio(peak["mask"], peak["off"]),
              "loss_first_step": {s: losses[s][0][0] for s in sides},
              "loss_last_step": {s: losses[s][0][-1] for s in sides},  # the options change the run
              "losses_repeat_every_round": all(r == losses[s][0] for s in sides for r in losses[s])}
    if "attention_blocks" in steps["mask"][-1]:  # ring: chunk pairs of rank 0 per step, the mask's and causal's
        record["attention_blocks"] = {s: steps[s][-1].get("attention_blocks") for s in ("off", "mask")}
    summary[f"{name}_ratio_mask_over_off"] = record["ratio_step_time_mask_over_off"]
    summary[f"{name}_ratio_mask_reset_over_off"] = record["ratio_step_time_mask_reset_over_off"]
    summary[f"{name}_ratio_peak_mask_over_off"] = record["ratio_peak_mask_over_off"]
    if name == "cp2":
        record["ratio_step_time_ring_after_over_before"] = ratio(t["off"], t["off_ring_before"])
        gap = abs(losses["off"][0][0] - losses["off_ring_before"][0][0])
        record["first_loss_ring_before_agrees"] = gap <= LOSS_TOL
        summary["cp2_ratio_step_ring_after_over_before"] = record["ratio_step_time_ring_after_over_before"]
    log(f"{name}: {json.dumps(record['step_time_s'])}, mask / off {record['ratio_step_time_mask_over_off']}")
    return record


# ---- the attention core alone ----------------------------------------------------------------


def _core_sides(seq_len: int) -> tuple[dict, list[torch.Tensor], int]:
    """The three cores at seq_len on the same q, k, v (B, T, H, D) and documents; the dense mask's bytes."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, HEADS, HEAD_DIM, generator=g, requires_grad=True) for _ in range(3))
    doc = packed_documents(1, seq_len)  # (1, T)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()  # (T, T)
    dense = (doc[:, None, :, None] == doc[:, None, None, :]) & causal  # (B, 1, T, T): built once per micro-batch
    del causal

    def sdpa_dense():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=dense)
        return out.transpose(1, 2)  # (B, T, H, D)

    sides = {"blockwise": lambda: attend(q, k, v, AttentionMask(doc)), "dense_sdpa": sdpa_dense,
             "causal_sdpa": lambda: attend(q, k, v, None)}
    return sides, [q, k, v], dense.numel() * dense.element_size()


def _fwd_bwd(fn, leaves: list[torch.Tensor]) -> None:
    for x in leaves:
        x.grad = None
    fn().sum().backward()


def core_part(seq_len: int, repeats: int) -> dict:
    sides, leaves, mask_bytes = _core_sides(seq_len)
    names = list(sides)
    outs = {s: sides[s]() for s in ("blockwise", "dense_sdpa")}
    agree = (outs["blockwise"] - outs["dense_sdpa"]).abs().max().item()
    del outs
    times: dict[str, list[float]] = {s: [] for s in names}
    for rep in range(repeats + 1):  # the first, alternated too, warms up
        for s in names if rep % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            _fwd_bwd(sides[s], leaves)
            if rep:
                times[s].append(time.perf_counter() - t0)
    peak = {}
    for s in names:
        with LiveBytes() as live:
            _fwd_bwd(sides[s], leaves)
        peak[s] = live.peak
    t = {s: median(times[s]) for s in names}
    return {"name": f"core_{seq_len}", "shape_bthd": [1, seq_len, HEADS, HEAD_DIM],
            "documents": int(packed_documents(1, seq_len).max()) + 1, "ms": {s: round(t[s] * 1e3, 2) for s in names},
            "peak_mb": {s: round(peak[s] / 2**20, 2) for s in names}, "dense_mask_mb": round(mask_bytes / 2**20, 2),
            "max_abs_diff_blockwise_dense": agree,
            "ratio_blockwise_over_dense_sdpa": ratio(t["blockwise"], t["dense_sdpa"]),
            "ratio_blockwise_over_causal_sdpa": ratio(t["blockwise"], t["causal_sdpa"]),
            "ratio_peak_blockwise_over_dense_sdpa": ratio(peak["blockwise"], peak["dense_sdpa"])}


# ---- ring attention before and after item 4 --------------------------------------------------


def _ring_worker(rank: int, world: int, sizes: list[int], repeats: int, rounds: int) -> dict:
    from fivefold.parallel.context import ring_attention, shard_sequence
    from fivefold.parallel.mesh import AXES, Mesh

    group = Mesh({axis: world if axis == "cp" else 1 for axis in AXES}).group("cp")
    result = {}
    for T in sizes:
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, T, HEADS, HEAD_DIM, generator=g) for _ in range(3)]
        q, k, v = (shard_sequence(x, world, rank, "zigzag").requires_grad_() for x in full)  # (1, T/cp, H, D)
        sides = {"after": functools.partial(ring_attention, q, k, v, group, "zigzag"),
                 "before": functools.partial(ring_before.ring_attention, q, k, v, group, "zigzag")}
        grads = {}
        for s, fn in sides.items():  # once each, also the warm-up: what they compute
            _fwd_bwd(fn, [q, k, v])
            grads[s] = [fn().detach()] + [x.grad.clone() for x in (q, k, v)]
        diff = max((a - b).abs().max().item() for a, b in zip(grads["after"], grads["before"], strict=True))
        times: dict[str, list[float]] = {s: [] for s in sides}
        for rnd in range(rounds):
            for s in list(sides) if rnd % 2 == 0 else list(sides)[::-1]:
                for _ in range(repeats):
                    dist.barrier()  # both ranks start together: a call waits for its peer's blocks
                    t0 = time.perf_counter()
                    _fwd_bwd(sides[s], [q, k, v])
                    times[s].append(time.perf_counter() - t0)
        result[T] = {"times": times, "max_abs_diff": diff}
    return result


def ring_part(sizes: list[int], repeats: int, rounds: int) -> list[dict]:
    ranks = run_workers(_ring_worker, 2, sizes, repeats, rounds, timeout=1200)
    records = []
    for T in sizes:
        per_call = {s: [max(r[T]["times"][s][i] for r in ranks) for i in range(len(ranks[0][T]["times"][s]))]
                    for s in ("after", "before")}  # the slower rank's time of each call
        t = {s: median(x) for s, x in per_call.items()}
        records.append({"name": f"ring_{T}", "cp": 2, "shape_bthd": [1, T, HEADS, HEAD_DIM], "causal": True,
                        "ms": {s: round(t[s] * 1e3, 2) for s in t}, "calls": len(per_call["after"]),
                        "max_abs_diff_out_and_grads": max(r[T]["max_abs_diff"] for r in ranks),
                        "ratio_after_over_before": ratio(t["after"], t["before"])})
    return records


def mask_build_seconds(batch: int, seq_len: int, repeats: int = 50) -> float:
    """Median time to build one micro-batch's document ids and positions from its token ids."""
    tokens = torch.randint(1, 256, (batch, seq_len))
    tokens[:, ::seq_len // 8] = 0
    docs = Documents(0, mask=True, reset_positions=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        docs.inputs(tokens, torch.arange(seq_len))
        times.append(time.perf_counter() - t0)
    return median(times)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "debug.toml"), PARTS, steps=6, rounds=2, unit="part")
    parser.add_argument("--seq-len", type=int, default=2048, help="the step parts' sequence (512 with --quick)")
    parser.add_argument("--doc-bytes", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                        help="document lengths in bytes, drawn uniformly (default: mean T/8 tokens)")
    parser.add_argument("--data-bytes", type=int, default=300_000, help="bytes of the corpus")
    args, overrides = parse(parser, argv)
    given = argv if argv is not None else sys.argv[1:]
    if args.quick:  # a smoke test: shorter rows, and dp2 (nothing of attention that single lacks) left out
        args.seq_len = args.seq_len if "--seq-len" in given else 512
        args.only = args.only if "--only" in given else [p for p in PARTS if p != "dp2"]
    core_sizes, core_repeats = ([2048], 2) if args.quick else ([2048, 8192], 4)
    began, summary = time.perf_counter(), {"summary": True}
    summary["mask_build_ms_per_micro_batch"] = round(mask_build_seconds(1, args.seq_len) * 1e3, 3)
    if "core" in args.only:
        for T in core_sizes:
            log(f"core: T = {T}")
            record = core_part(T, core_repeats)
            print(json.dumps(record), flush=True)
            for key in ("ratio_blockwise_over_dense_sdpa", "ratio_blockwise_over_causal_sdpa",
                        "ratio_peak_blockwise_over_dense_sdpa"):
                summary[f"core_{T}_{key}"] = record[key]
    if "ring" in args.only:
        log(f"ring: T = {core_sizes}, cp = 2")
        for record in ring_part(core_sizes, 2 if args.quick else 4, args.rounds):
            print(json.dumps(record), flush=True)
            summary[f"{record['name']}_ratio_after_over_before"] = record["ratio_after_over_before"]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "docs").mkdir()
        lo_hi = args.doc_bytes or document_bytes(args.seq_len)
        summary["mean_document_tokens"] = round(short_documents(Path(tmp) / "docs", args.data_bytes, *lo_hi), 1)
        summary["seq_len"] = args.seq_len
        for name in (n for n in args.only if n in STEP_PARTS):
            print(json.dumps(step_part(name, args, overrides, Path(tmp), summary)), flush=True)
    finish_summary(summary, None, began, note="no target: the issue asks for the figures")


if __name__ == "__main__":
    main()
