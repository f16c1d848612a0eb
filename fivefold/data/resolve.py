"""What the config's [data] section trains on, checked before any process starts.

`data.paths` (or `data.mixture`) entries are of one of these kinds:
- `prepared`: a directory with a manifest.json (`fivefold prepare`); it names its own tokenizer;
- `megatron`: a Megatron-LM indexed dataset, `PREFIX.bin` + `PREFIX.idx` (either file, or the prefix);
- `nanogpt`: a flat `.bin` of token ids (`data.bin_dtype`; its `val.bin` sibling is the validation set);
- `text`: anything else (text files and folders, .jsonl / .jsonl.gz, .parquet), prepared once into
  `data.cache_dir` by the launcher (or by rank 0 when the job was started without it) and reused.
Kinds are not mixed in one run, except that a mixture is of prepared datasets only.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import shutil
from pathlib import Path

from fivefold.config.derive import padded_vocab
from fivefold.config.schema import Config, DataConfig
from fivefold.data.prepare import read_manifest, shard_done
from fivefold.data.sources import DataError, input_files, path_kind
from fivefold.data.tokenizer import TokenizerError, files_hash, load_tokenizer
from fivefold.data.tokens import open_token_files
from fivefold.model.config import ModelConfig


def data_paths(d: DataConfig) -> list[str]:
    return [str(path) for path, _ in d.mixture] if d.mixture else list(d.paths)


def data_kind(d: DataConfig) -> str:
    kinds = {path_kind(p) for p in data_paths(d)} or {"text"}
    if len(kinds) > 1:
        raise DataError(f"data.paths mixes {' and '.join(sorted(kinds))} inputs; give one kind (prepare text with "
                        f"`fivefold prepare` to train on it beside prepared datasets, or use data.mixture)")
    return kinds.pop()


def text_request(d: DataConfig) -> dict:
    """What identifies the cache of text given to train directly (prepare.py's request, without mtimes
    hashed separately): the same inputs and options reuse one prepared copy."""
    return {"paths": [str(Path(p).resolve()) for p in d.paths], "tokenizer": d.tokenizer or "byte",
            "text_field": d.text_field, "val_fraction": d.val_fraction, "max_bytes": d.max_bytes,
            "bpe_vocab": d.bpe_vocab}


def cache_folder(cfg: Config) -> Path:
    """Where text given to train is prepared: one folder per inputs + options + file sizes and times."""
    d = cfg.data
    h = hashlib.sha256(json.dumps(text_request(d), sort_keys=True).encode())
    for f in input_files(d.paths):
        st = f.stat()
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return order_folder(cfg).parent / h.hexdigest()[:16]


def order_folder(cfg: Config) -> Path:
    """Where the per-epoch sample orders are kept (data/batches.py epoch_order), shared by runs."""
    return (Path(cfg.data.cache_dir) if cfg.data.cache_dir else Path(cfg.run.out_dir) / ".prepared") / "orders"


def ensure_prepared(cfg: Config, workers: int = 1, progress: bool = False) -> Path:
    """The prepared copy of the text the config names (prepared now unless it is there already)."""
    from fivefold.data.prepare import prepare

    d = cfg.data
    folder = cache_folder(cfg)
    m = prepare(list(d.paths), d.tokenizer or "byte", folder, text_field=d.text_field, val_fraction=d.val_fraction,
                max_bytes=d.max_bytes, bpe_vocab=d.bpe_vocab, workers=workers, progress=progress)
    if not any(split["documents"] for split in m["splits"].values()):
        shutil.rmtree(folder, ignore_errors=True)  # a cache of nothing would stay behind, found by no run
        skipped = f" ({len(m['skipped_binary'])} binary files skipped)" if m["skipped_binary"] else ""
        raise DataError(f"data.paths = {list(d.paths)} holds no text{skipped}; give text files or folders, .jsonl "
                        f"or .parquet, or a prepared dataset")
    return folder


@functools.lru_cache(maxsize=16)
def _tokenizer_facts(spec: str, mtime_ns: int) -> tuple[int, str]:
    """(vocab size, hash) of a tokenizer file or directory (cached per modification time)."""
    tok = load_tokenizer(spec)
    return tok.vocab_size, files_hash(tok.files())


def tokenizer_facts(spec: str) -> tuple[int, str]:
    path = Path(spec) / "tokenizer.json" if Path(spec).is_dir() else Path(spec)
    if Path(spec).is_dir() and not path.exists():
        path = Path(spec) / "tokenizer.model"  # a SentencePiece model, converted (tokenizer.py)
    return _tokenizer_facts(spec, path.stat().st_mtime_ns if path.exists() else 0)


def check_prepared(folder: Path) -> dict:
    """The manifest of a prepared dataset whose shards are all there and whole."""
    manifest = read_manifest(folder)
    itemsize = 2 if manifest["dtype"] == "uint16" else 4
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            name = shard["file"].removesuffix(".bin")
            if shard_done(folder, name, itemsize) != (shard["tokens"], shard["documents"], shard.get("trained")):
                raise DataError(f"{folder / shard['file']}: missing or truncated (the manifest says {shard['tokens']} "
                                f"tokens); prepare the dataset again")
    return manifest


def data_vocab(cfg: Config) -> int | None:
    """The tokenizer's vocabulary before padding; None for pre-tokenized files without a tokenizer."""
    d = cfg.data
    kind = data_kind(d)
    if kind == "prepared":
        return read_manifest(Path(data_paths(d)[0]))["tokenizer"]["vocab_size"]
    if d.tokenizer in ("", "byte"):
        return 257 if kind == "text" or d.tokenizer == "byte" else None
    if d.tokenizer == "bpe":
        return d.bpe_vocab
    return tokenizer_facts(d.tokenizer)[0]


def tokenizer_vocab(cfg: Config) -> int:
    """The data's tokenizer's vocabulary (bytes + end-of-document, the BPE's, a Hugging Face tokenizer's
    or a prepared dataset's); pre-tokenized files without a tokenizer: model.vocab_size, else 257."""
    try:
        vocab = data_vocab(cfg)
    except (DataError, TokenizerError, OSError):  # reported by validate(); derive() needs a number
        vocab = None
    return vocab or cfg.model.vocab_size or 257


def unpadded_vocab(cfg: Config) -> int:
    """The vocabulary the model holds before padding: model.vocab_size when set (no file is read),
    else the tokenizer's. What config/derive.py's `derive` and `padded_vocab` are handed."""
    return cfg.model.vocab_size or tokenizer_vocab(cfg)


def resolved_model(cfg: Config) -> ModelConfig:
    """cfg.model with its vocabulary resolved: model.vocab_size, or the tokenizer's padded to a multiple
    of data.vocab_multiple, as every layout builds it."""
    return dataclasses.replace(cfg.model, vocab_size=padded_vocab(cfg, unpadded_vocab(cfg)))


def data_errors(cfg: Config) -> list[str]:
    """Every problem of the [data] section a run would meet, found from file headers only."""
    d, errors = cfg.data, []
    try:
        kind = data_kind(d)
        if d.tokenizer not in ("", "byte", "bpe"):
            tokenizer_facts(d.tokenizer)
        if d.mixture and kind != "prepared":
            errors.append("data.mixture: every entry must be a prepared dataset (`fivefold prepare`)")
        for path, weight in d.mixture:  # ([path, weight] pairs: their types are config.py's to check)
            if not 0 < weight < math.inf:  # (nan too)
                errors.append(f"data.mixture entry {[path, weight]}: write [path, weight] with a finite weight > 0")
        if d.mixture and d.paths:
            errors.append("data.mixture and data.paths are both set; give the datasets in one of them")
        if kind == "prepared":
            errors += _prepared_errors(cfg)
        elif kind in ("nanogpt", "megatron"):
            open_token_files(d, "train")
            if not cfg.model.vocab_size and d.tokenizer in ("", "bpe"):
                errors.append(f"data.paths: {kind} token files carry no vocabulary; set model.vocab_size, or "
                              f"data.tokenizer to the tokenizer that made them")
        # Text: validate() has checked that each path exists; what the files hold is found when they are
        # prepared (before any worker starts). No directory walk here: the planner validates many layouts.
    except (DataError, TokenizerError) as e:
        errors.append(str(e))
    return errors


def _prepared_errors(cfg: Config) -> list[str]:
    d, errors = cfg.data, []
    hashes = {}
    for path in data_paths(d):
        manifest = check_prepared(Path(path))
        hashes[path] = manifest["tokenizer"]["hash"]
    if len(set(hashes.values())) > 1:
        errors.append(f"data: the prepared datasets {', '.join(hashes)} were made with different tokenizers; "
                      f"prepare them with one")
    given = d.tokenizer
    if given and given != "bpe":
        want = files_hash(load_tokenizer("byte").files()) if given == "byte" else tokenizer_facts(given)[1]
        for path, have in hashes.items():
            if have != want:
                errors.append(f"data.tokenizer = '{given}' is not the tokenizer {path} was prepared with (hashes "
                              f"differ); leave data.tokenizer empty to use the dataset's own, or prepare it again")
    return errors


def open_datasets(cfg: Config, run_dir: Path | None = None):
    """(train set, validation set or None, folder of the tokenizer files or None) for the config; text
    inputs must have been prepared (ensure_prepared). The shards are memory-mapped, nothing is read."""
    from fivefold.data.mixture import MixtureDataset
    from fivefold.data.tokens import PackedDataset, prepared_stream

    d, T = cfg.data, cfg.train.seq_len
    kind = data_kind(d)
    if kind in ("nanogpt", "megatron"):
        val = open_token_files(d, "val")
        tok = Path(d.tokenizer) if d.tokenizer not in ("", "byte", "bpe") else None
        return PackedDataset(open_token_files(d, "train"), T), (PackedDataset(val, T) if val else None), tok
    folders = [Path(p) for p in data_paths(d)] if kind == "prepared" else [cache_folder(cfg)]
    sets = []
    for folder in folders:
        manifest = read_manifest(folder)
        train, val = (manifest["splits"][s]["tokens"] for s in ("train", "val"))
        if not train:  # a corpus of one document still trains
            sets.append((PackedDataset(prepared_stream(folder, manifest, "val"), T), None))
        else:
            sets.append((PackedDataset(prepared_stream(folder, manifest, "train"), T),
                         PackedDataset(prepared_stream(folder, manifest, "val"), T) if val else None))
    tokenizer = folders[0] / "tokenizer"
    if not d.mixture:
        return sets[0][0], sets[0][1], tokenizer
    names = [Path(p).name for p in data_paths(d)]
    vals = [v for _, v in sets if v is not None]
    val_names = [n for n, (_, v) in zip(names, sets, strict=True) if v is not None]
    return (MixtureDataset([t for t, _ in sets], names), MixtureDataset(vals, val_names) if vals else None,
            tokenizer)
