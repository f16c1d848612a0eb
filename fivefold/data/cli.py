"""`fivefold prepare INPUT... --tokenizer byte|bpe|PATH --out DIR`: a prepared dataset (prepare.py).

    fivefold prepare corpus/ more.jsonl.gz rows.parquet --tokenizer meta-llama/tokenizer.json --out data/web
    fivefold train configs/tiny.toml --data.paths='["data/web"]'
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_prepare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text, .jsonl(.gz) (text, prompt/completion or chat messages) or "
                                       ".parquet into a prepared dataset",
                       description=__doc__.split("\n")[0])
    p.add_argument("inputs", nargs="*", help="text files or folders, .jsonl / .jsonl.gz, .parquet (none: the "
                                             "Python standard library's sources)")
    p.add_argument("--tokenizer", default="byte", help="byte, bpe (trained here), or a Hugging Face tokenizer.json "
                                                       "or a model's directory (tokenizer.json or a SentencePiece "
                                                       "tokenizer.model; its chat template for chats) (default: byte)")
    p.add_argument("--out", required=True, help="the dataset directory to write (or to finish, if interrupted)")
    p.add_argument("--text-field", default="text", help="the text field of .jsonl records / .parquet columns")
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of documents held out (by name)")
    p.add_argument("--max-bytes", type=int, default=0, help="read at most this much text (0: all)")
    p.add_argument("--bpe-vocab", type=int, default=4096, help="--tokenizer bpe: the vocabulary size")
    p.add_argument("--shard-mb", type=float, default=16.0, help="text per shard (and per unit of work), MB")
    p.add_argument("--workers", type=int, default=0, help="tokenizing processes (0: one per core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run_prepare)


def run_prepare(args: argparse.Namespace) -> int:
    from fivefold.data.prepare import prepare
    from fivefold.data.sources import DataError, Skipped
    from fivefold.data.tokenizer import TokenizerError

    if not 0 <= args.val_fraction < 1 or args.shard_mb <= 0 or args.workers < 0 or args.max_bytes < 0:
        print("fivefold: --val-fraction must be in [0, 1), --shard-mb > 0, --workers and --max-bytes >= 0",
              file=sys.stderr)
        return 2
    workers = args.workers or os.cpu_count() or 1
    try:
        m = prepare(args.inputs, args.tokenizer, Path(args.out), text_field=args.text_field,
                    val_fraction=args.val_fraction, max_bytes=args.max_bytes, bpe_vocab=args.bpe_vocab,
                    shard_bytes=int(args.shard_mb * 2**20), workers=workers, progress=not args.no_progress)
    except (DataError, TokenizerError) as e:
        print(f"fivefold: {e}", file=sys.stderr)
        return 2
    warning = Skipped(m["skipped_binary"]).warning()
    if warning:
        print(f"fivefold: warning: {warning}", file=sys.stderr)
    s = m["splits"]
    trained = f" ({s['train']['trained']:,} of them trained: completions and assistant turns)" \
        if "trained" in s["train"] else ""
    print(f"{args.out}: {s['train']['tokens']:,} training tokens{trained} in {s['train']['documents']:,} documents "
          f"({len(s['train']['shards'])} shards), {s['val']['tokens']:,} held out in {s['val']['documents']:,}; "
          f"{m['tokenizer']['kind']} tokenizer, vocabulary {m['tokenizer']['vocab_size']:,}, {m['dtype']}")
    return 0
