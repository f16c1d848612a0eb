"""Prepare throughput beside a plain `tokenizers` script, and training start-up against corpus size.

Run: `.venv/bin/python benchmarks/data.py [--quick] [--text-mb 24] [--big-gb 1.0]`

1. Throughput. A generated .jsonl corpus (`--text-mb` of English-like words) and a byte-level BPE
   (8,192 tokens) trained on its first MB, saved as a Hugging Face tokenizer.json. `fivefold
   prepare` (fivefold/data/prepare.py: its worker processes, one per core, each encoding a unit with
   `encode_batch` on one thread, and writing its shard) against the peer: one Python process that
   reads the same records, calls the same tokenizer's `encode_batch` with the `tokenizers` package's
   own threads (one per core) on batches of 1,000 documents, and appends the ids as uint16 to one
   file: what a user writes without fivefold. Each side runs twice, the faster kept; the ratio is
   fivefold's tokens/s over the peer's (the issue's target: at least 0.9).
2. Start-up. Two prepared datasets of the byte tokenizer: 10 MB and `--big-gb` of token shards on disk
   (written by this script straight into prepare.py's layout: shards of random ids with an
   end-of-document every ~2 kB, then the manifest; what prepare would write for such a corpus, without
   generating a gigabyte of text first). Then `fivefold train configs/tiny.toml` on each, in a fresh
   process, for one step (no checkpoint): the time from the process start to the end of training
   and its peak RSS (VmHWM); twice: the first run of a corpus builds its first epoch's sample order
   (data/batches.py epoch_order: a permutation of every sample, shuffled in place in a file of 4 bytes per
   sample, as Megatron-LM builds its shuffle index), the second maps the cached one. Ratios big / small
   for each (the issue's target: at most 1.1 each).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks.common import log, ratio  # noqa: E402
from fivefold.data.prepare import MANIFEST, build_manifest, shard_name, write_shard  # noqa: E402
from fivefold.data.sources import Skipped  # noqa: E402
from fivefold.data.tokenizer import ByteTokenizer, save_tokenizer, train_bpe  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which this be are or had not but "
         "model data train layer token gradient shard pipeline tensor expert attention memory").split()


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> None:
    rng, size = random.Random(seed), 0
    with open(path, "w") as f:
        while size < megabytes * 1e6:
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 600))) + "."
            line = json.dumps({"text": text}) + "\n"
            f.write(line)
            size += len(line)


def peer_tokenize(corpus: Path, tokenizer_json: Path, out: Path) -> int:
    """The plain script: read records, encode_batch with the library's threads, write uint16 ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    eod = tok.token_to_id("<|eod|>")
    total = 0
    with open(corpus) as f, open(out, "wb") as sink:
        batch: list[str] = []
        for line in f:
            batch.append(json.loads(line)["text"])
            if len(batch) == 1000:
                total += _write(tok.encode_batch(batch), eod, sink)
                batch = []
        if batch:
            total += _write(tok.encode_batch(batch), eod, sink)
    return total


def _write(encodings, eod: int, sink) -> int:
    ids = np.concatenate([np.append(np.asarray(e.ids, dtype=np.uint16), eod) for e in encodings])
    ids.tofile(sink)
    return len(ids)


def throughput(work: Path, text_mb: float) -> dict:
    corpus = work / "corpus.jsonl"
    make_corpus(corpus, text_mb)
    with open(corpus) as f:
        sample = [json.loads(next(f))["text"] for _ in range(400)]
    tokdir = work / "tokenizer"
    save_tokenizer(train_bpe(sample, 8192), tokdir)
    cores = os.cpu_count() or 1
    best = {"fivefold": float("inf"), "peer": float("inf")}
    tokens = {}
    for attempt in range(2):
        out = work / f"prepared{attempt}"
        began = time.perf_counter()
        subprocess.run([sys.executable, "-m", "fivefold", "prepare", str(corpus), "--tokenizer", str(tokdir),
                        "--out", str(out), "--val-fraction", "0", "--workers", str(cores), "--no-progress"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        best["fivefold"] = min(best["fivefold"], time.perf_counter() - began)
        tokens["fivefold"] = json.loads((out / MANIFEST).read_text())["splits"]["train"]["tokens"]
        shutil.rmtree(out)
        env = {**os.environ, "RAYON_NUM_THREADS": str(cores), "TOKENIZERS_PARALLELISM": "true"}
        began = time.perf_counter()
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.data import peer_tokenize; "
                f"print(peer_tokenize(*map(__import__('pathlib').Path, sys.argv[1:])))")
        done = subprocess.run([sys.executable, "-c", code, str(corpus), str(tokdir / "tokenizer.json"),
                               str(work / "peer.bin")], check=True, env=env, capture_output=True, text=True)
        best["peer"] = min(best["peer"], time.perf_counter() - began)
        tokens["peer"] = int(done.stdout.strip())
    rates = {k: tokens[k] / best[k] for k in best}
    log(f"throughput: {text_mb:g} MB of jsonl, {tokens['fivefold']:,} tokens; fivefold {rates['fivefold'] / 1e6:.2f}M "
        f"tok/s, peer {rates['peer'] / 1e6:.2f}M tok/s ({cores} cores)")
    return {"what": "prepare throughput", "text_mb": text_mb, "cores": cores, "tokens": tokens,
            "seconds": {k: round(v, 2) for k, v in best.items()},
            "tokens_per_s": {k: round(v) for k, v in rates.items()},
            "ratio_fivefold_over_peer": ratio(rates["fivefold"], rates["peer"])}


def synthetic_prepared(folder: Path, nbytes: float, shard_tokens: int = 64 << 20) -> None:
    """A prepared byte-tokenizer dataset of `nbytes` of shards, in prepare.py's layout."""
    folder.mkdir(parents=True)
    tok = ByteTokenizer()
    save_tokenizer(tok, folder / "tokenizer")
    rng, left, counts, index = np.random.default_rng(0), int(nbytes // 2), {}, 0
    while left > 0:
        n = min(left, shard_tokens)
        ids = rng.integers(0, 256, n, dtype=np.uint16)
        ends = np.arange(2048, n, 2048)
        docs = np.split(ids, ends)
        for d in docs:
            d[-1] = tok.eod
        counts[("train", index)] = write_shard(folder, shard_name("train", index), docs, np.dtype(np.uint16))
        left, index = left - n, index + 1
    request = {"sources": [], "tokenizer": "byte", "synthetic": True}
    (folder / MANIFEST).write_text(json.dumps(build_manifest(request, tok, np.dtype(np.uint16), counts, Skipped())))


def startup(folder: Path, out_dir: Path) -> dict:
    # VmHWM, not ru_maxrss: the latter survives execve and starts from the parent's RSS at the fork.
    code = ("import sys, time; t = time.perf_counter(); from fivefold.cli import main; "
            "rc = main(sys.argv[1:]); "
            "hwm = [x.split()[1] for x in open('/proc/self/status') if x.startswith('VmHWM')]; "
            "print('RESULT', time.perf_counter() - t, int(hwm[0]) / 1024, rc)")
    args = ["train", "configs/tiny.toml", f"--data.paths=['{folder}']", "--train.steps=1", "--train.eval_batches=1",
            f"--run.out_dir={out_dir}", f"--run.name=s{time.time_ns()}", "--no-progress"]
    runs = []
    for _ in range(2):  # the second finds the epoch's sample order in the cache, as any later run of that corpus
        done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
        if not line:
            raise RuntimeError(done.stderr[-2000:])
        _, seconds, rss, _ = line[0].split()
        args[-2] = f"--run.name=s{time.time_ns()}"
        runs.append({"seconds": float(seconds), "peak_rss_mb": float(rss)})
    return {"first": runs[0], "cached": runs[1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 MB of text and a 100 MB corpus: a smoke test")
    parser.add_argument("--text-mb", type=float, default=24.0)
    parser.add_argument("--big-gb", type=float, default=1.0)
    args = parser.parse_args()
    text_mb, big = (2.0, 0.1) if args.quick else (args.text_mb, args.big_gb)
    work = Path(tempfile.mkdtemp(prefix="ff-data-"))
    try:
        tp = throughput(work, text_mb)
        print(json.dumps(tp), flush=True)
        sizes = {"10MB": 10e6, f"{big:g}GB": big * 1e9}
        runs = {}
        for name, nbytes in sizes.items():
            synthetic_prepared(work / name, nbytes)
            runs[name] = startup(work / name, work / "runs")
            for kind, r in runs[name].items():
                log(f"start-up on {name} ({kind}): {r['seconds']:.2f} s, peak RSS {r['peak_rss_mb']:.0f} MB")
            print(json.dumps({"what": "training start-up", "corpus": name, **runs[name]}), flush=True)
            shutil.rmtree(work / name)
        small, large = runs["10MB"], runs[f"{big:g}GB"]
        summary = {"summary": True, "prepare_ratio_fivefold_over_peer": tp["ratio_fivefold_over_peer"]}
        for kind in ("first", "cached"):
            summary[f"startup_{kind}_time_ratio_big_over_small"] = ratio(large[kind]["seconds"], small[kind]["seconds"])
            summary[f"startup_{kind}_rss_ratio_big_over_small"] = ratio(large[kind]["peak_rss_mb"],
                                                                       small[kind]["peak_rss_mb"])
        summary["targets"] = {"prepare": ">= 0.9", "startup_time": "<= 1.1", "startup_rss": "<= 1.1"}
        print(json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
