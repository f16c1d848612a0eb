"""`fivefold prepare`: documents in, a prepared dataset out: token shards, document index, manifest.

A prepared dataset directory holds:
- `tokenizer/`: the files that reproduce the tokenizer (fivefold/data/tokenizer.py), its hash in the manifest;
- `train-00000.bin`, ...: token ids, uint16 when the vocabulary fits in 16 bits, else uint32, one
  document after another, each ending with the tokenizer's end-of-document id;
- `train-00000.idx`: the shard's document ends (int64 offsets into the shard, `numpy.save`);
- `train-00000.mask`, only for a shard holding fine-tuning records (records.py): one byte per token,
  1 where the token is trained; its manifest entry then counts them (`trained`). A shard without one
  trains every token (as every dataset prepared before masks existed);
- `val-00000.bin` / `.idx`: the held-out documents, chosen here by a hash of each document's name
  (sources.py), so the split is stable when the corpus grows or shrinks;
- `manifest.json`: sources and their sizes, the request that made it, tokenizer, dtype, and per split
  its shards with token and document counts. Written last: a directory without it is unfinished.

Documents are cut into units of about `shard_bytes` of text per split, in input order; each unit
becomes one shard. What a unit holds depends only on the inputs and the options, never on the
number of workers, and each shard is written by one worker, whole, under a temporary name and then
renamed: so the output is byte-identical for any `workers`, and an interrupted prepare (its
`.prepare.json` holds the request) continues by re-reading the inputs and tokenizing only the
units whose shard is missing.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from fivefold.data.sources import DataError, Document, Skipped, documents, input_files
from fivefold.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer, save_tokenizer, train_bpe

FORMAT = "fivefold.prepared"
VERSION, MASKED_VERSION = 1, 2  # 2: some shards carry a loss mask (older fivefold would train every token)
MANIFEST, STATE = "manifest.json", ".prepare.json"
SPLITS = ("train", "val")


def in_validation(name: str, val_fraction: float) -> bool:
    """The held-out split, by a hash of the document's name (not its position)."""
    return zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}"


@dataclass
class Unit:
    split: str
    index: int
    docs: list[Document] = field(default_factory=list)
    nbytes: int = 0


def units(docs: Iterator[Document], val_fraction: float, shard_bytes: int) -> Iterator[Unit]:
    """Documents grouped, per split and in order, into units of at least shard_bytes of text (the last
    of each split smaller)."""
    open_units = {s: Unit(s, 0) for s in SPLITS}
    for doc in docs:
        unit = open_units["val" if in_validation(doc.name, val_fraction) else "train"]
        unit.docs.append(doc)
        unit.nbytes += len(doc)
        if unit.nbytes >= shard_bytes:
            yield unit
            open_units[unit.split] = Unit(unit.split, unit.index + 1)
    yield from (u for u in open_units.values() if u.docs)


@functools.lru_cache(maxsize=2)
def _tokenizer_of(folder: str, stamp: tuple) -> Tokenizer:
    return load_tokenizer(folder)


def _tokenizer_at(folder: str) -> Tokenizer:
    """One load per worker process (each task names the folder, not the tokenizer's bytes); the files'
    sizes and times are in the key, so a folder written again (a new prepare into the same --out in
    this process) is loaded again."""
    stamp = tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(Path(folder).iterdir()))
    return _tokenizer_of(folder, stamp)


def encode_documents(tokenizer: Tokenizer, texts: list[str | bytes]) -> list[np.ndarray]:
    """Each document's ids, ending with the end-of-document id (appended unless the tokenizer's own
    post-processor already ended it with that id)."""
    if hasattr(tokenizer, "encode_array"):  # bytes: no Python list per token
        encoded = [tokenizer.encode_array(t) for t in texts]
    else:
        encoded = [np.asarray(ids) for ids in tokenizer.encode_batch(
            [t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts])]
    eod = np.array([tokenizer.eod])
    return [ids if len(ids) and ids[-1] == tokenizer.eod else np.concatenate([ids, eod]) for ids in encoded]


def write_shard(out: Path, name: str, ids: list[np.ndarray], dtype: np.dtype,
                masks: list[np.ndarray] | None = None) -> tuple[int, int, int | None]:
    """`name`.bin, `name`.idx and (given masks) `name`.mask, each under a temporary name first; the
    .bin's rename commits the shard. Returns (tokens, documents, trained tokens or None)."""
    tokens = np.concatenate(ids).astype(dtype) if ids else np.zeros(0, dtype)
    ends = np.cumsum([len(i) for i in ids], dtype=np.int64)
    trained = None
    if masks is not None:
        mask = np.concatenate(masks).astype(np.uint8)  # (tokens,)
        mask.tofile(out / f".{name}.mask.tmp")
        os.replace(out / f".{name}.mask.tmp", out / f"{name}.mask")
        trained = int(mask.sum())
    with open(out / f".{name}.idx.tmp", "wb") as f:
        np.save(f, ends)
    os.replace(out / f".{name}.idx.tmp", out / f"{name}.idx")
    tokens.tofile(out / f".{name}.bin.tmp")
    os.replace(out / f".{name}.bin.tmp", out / f"{name}.bin")
    return len(tokens), len(ids), trained


def tokenize_unit(out: str, dtype: str, unit: Unit) -> tuple[str, int, tuple[int, int, int | None], int]:
    """Worker: tokenize one unit and write its shard. Returns (split, index, (tokens, documents, trained),
    text bytes)."""
    from fivefold.data.chat import ChatTemplate
    from fivefold.data.records import encode_record

    folder = Path(out) / "tokenizer"
    tokenizer = _tokenizer_at(str(folder))
    name = shard_name(unit.split, unit.index)
    if all(d.kind == "text" for d in unit.docs):  # no mask: every token trained
        counts = write_shard(Path(out), name, encode_documents(tokenizer, [d.text for d in unit.docs]), np.dtype(dtype))
    else:
        chat = ChatTemplate(folder)  # transformers' tokenizer, loaded at the unit's first chat
        ids, masks = zip(*(encode_record(tokenizer, d, chat) for d in unit.docs), strict=True)
        counts = write_shard(Path(out), name, list(ids), np.dtype(dtype), list(masks))
    return unit.split, unit.index, counts, unit.nbytes


def shard_done(out: Path, name: str, itemsize: int) -> tuple[int, int, int | None] | None:
    """(tokens, documents, trained tokens: None without a mask) of a complete shard, or None when it is
    missing or cut short."""
    bin_, idx, mask = out / f"{name}.bin", out / f"{name}.idx", out / f"{name}.mask"
    if not (bin_.is_file() and idx.is_file()):
        return None
    ends = np.load(idx, mmap_mode="r")  # only its last entry is read
    tokens = int(ends[-1]) if len(ends) else 0
    if bin_.stat().st_size != tokens * itemsize or (mask.is_file() and mask.stat().st_size != tokens):
        return None
    trained = int(np.fromfile(mask, dtype=np.uint8).sum()) if mask.is_file() else None
    return tokens, len(ends), trained


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not a readable manifest ({e}); prepare the dataset again") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: not a fivefold prepared dataset (format {manifest.get('format')!r})")
    if manifest.get("version", VERSION) > MASKED_VERSION:
        raise DataError(f"{path}: prepared dataset version {manifest['version']}, newer than this fivefold reads "
                        f"({MASKED_VERSION}); update fivefold or prepare it again")
    return manifest


def _start(out: Path, request: dict) -> dict | None:
    """The finished manifest when `out` already holds this request's dataset; else mark `out` as
    being prepared for it (refusing a folder that holds something else)."""
    if (out / MANIFEST).is_file():
        manifest = read_manifest(out)
        if manifest["request"] == request:
            return manifest
        raise DataError(f"{out} holds a prepared dataset of other inputs or options; remove it or give another --out")
    if (out / STATE).is_file():
        if json.loads((out / STATE).read_text()) != request:
            raise DataError(f"{out} holds an unfinished prepare of other inputs or options; remove it or give "
                            f"another --out")
    elif out.exists() and any(out.iterdir()):
        raise DataError(f"{out} exists and is not empty; give a new folder for --out")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / STATE, request)
    return None


def _tokenizer(out: Path, spec: str, files: list[Path], request: dict) -> Tokenizer:
    folder = out / "tokenizer"
    if folder.is_dir():  # resumed: the tokenizer of the interrupted run (a trained BPE is not retrained)
        return load_tokenizer(folder)
    if spec == "bpe":
        texts = (d.text for d in documents(files, request["text_field"], request["max_bytes"])
                 if not in_validation(d.name, request["val_fraction"]))
        tokenizer = train_bpe(texts, request["bpe_vocab"])
    else:
        tokenizer = load_tokenizer(spec)
    save_tokenizer(tokenizer, folder)
    return load_tokenizer(folder)  # the saved copy: what the workers and training read


def prepare(inputs: list[str] | tuple[str, ...], tokenizer: str, out: Path, *, text_field: str = "text",
            val_fraction: float = 0.05, max_bytes: int = 0, bpe_vocab: int = 4096, shard_bytes: int = 16 << 20,
            workers: int = 1, progress: bool = False) -> dict:
    """Prepare (or finish preparing) `out` from `inputs`; returns its manifest."""
    files = input_files(inputs)
    sources = [{"path": str(f), "bytes": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]
    request = {"sources": sources, "tokenizer": tokenizer if tokenizer in ("byte", "bpe") else str(Path(tokenizer)),
               "text_field": text_field, "val_fraction": val_fraction, "max_bytes": max_bytes, "bpe_vocab": bpe_vocab,
               "shard_bytes": shard_bytes}
    fresh = not out.exists() or not any(out.iterdir())
    done = _start(out, request)
    if done is not None:
        return done
    try:
        return _prepare(out, tokenizer, files, request, workers, progress)
    except (DataError, TokenizerError):
        if fresh:  # bad input: a new folder is not left behind half made (an interrupted one stays resumable)
            shutil.rmtree(out, ignore_errors=True)
        raise


def _prepare(out: Path, tokenizer: str, files: list[Path], request: dict, workers: int, progress: bool) -> dict:
    from fivefold.progress import TokenProgress

    text_field, val_fraction, max_bytes = request["text_field"], request["val_fraction"], request["max_bytes"]
    shard_bytes, sources = request["shard_bytes"], request["sources"]
    tok = _tokenizer(out, tokenizer, files, request)
    dtype = token_dtype(tok.vocab_size)
    skipped = Skipped()
    counts: dict[tuple[str, int], tuple[int, int, int | None]] = {}
    total = min(sum(s["bytes"] for s in sources), max_bytes) if max_bytes else sum(s["bytes"] for s in sources)
    with TokenProgress("prepare", total, enabled=progress) as bar:
        def todo() -> Iterator[Unit]:
            for unit in units(documents(files, text_field, max_bytes, skipped), val_fraction, shard_bytes):
                finished = shard_done(out, shard_name(unit.split, unit.index), dtype.itemsize)
                if finished is None:
                    yield unit
                else:
                    counts[(unit.split, unit.index)] = finished
                    bar.advance(unit.nbytes, 0)

        work = functools.partial(tokenize_unit, str(out), dtype.str)
        if workers <= 1:
            results = map(work, todo())
            _collect(results, counts, bar)
        else:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per worker process
            with multiprocessing.get_context("fork").Pool(workers) as pool:
                _collect(pool.imap_unordered(work, todo()), counts, bar)
    manifest = build_manifest(request, tok, dtype, counts, skipped)
    _write_json(out / MANIFEST, manifest)
    (out / STATE).unlink()
    return manifest


def _collect(results, counts: dict, bar) -> None:
    for split, index, shard, nbytes in results:
        counts[(split, index)] = shard
        bar.advance(nbytes, shard[0])


def build_manifest(request: dict, tok: Tokenizer, dtype: np.dtype, counts: dict, skipped: Skipped) -> dict:
    """The manifest of a dataset whose shards are written: counts maps (split, index) to (tokens,
    documents, trained tokens or None); a split with masked shards counts its trained tokens."""
    from fivefold.data.tokenizer import files_hash

    splits = {}
    for split in SPLITS:
        shards = [{"file": shard_name(s, i) + ".bin", "tokens": t, "documents": d,
                   **({} if trained is None else {"trained": trained})}
                  for (s, i), (t, d, trained) in sorted(counts.items()) if s == split]
        splits[split] = {"shards": shards, "tokens": sum(s["tokens"] for s in shards),
                         "documents": sum(s["documents"] for s in shards)}
        if any("trained" in s for s in shards):
            splits[split]["trained"] = sum(s.get("trained", s["tokens"]) for s in shards)
    masked = any("trained" in s for split in splits.values() for s in split["shards"])
    return {"format": FORMAT, "version": MASKED_VERSION if masked else VERSION, "dtype": dtype.name,
            "tokenizer": {"kind": tok.kind, "hash": files_hash(tok.files()), "vocab_size": tok.vocab_size,
                          "eod": tok.eod, "dir": "tokenizer"},
            "splits": splits, "sources": [{"path": s["path"], "bytes": s["bytes"]} for s in request["sources"]],
            "skipped_binary": skipped.files, "request": request}
