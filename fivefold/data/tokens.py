"""Token streams read by memory map, and the packed samples cut from them.

A stream is the concatenation of a dataset's token files, read by memory map: opening one costs a
stat and an mmap per file, whatever the corpus size, and a rank pages in only the samples of its own
rows. Three on-disk formats:
- fivefold's prepared shards (prepare.py), named by the manifest;
- nanoGPT's flat `.bin` of token ids (dtype `data.bin_dtype`; `train.bin` beside `val.bin`);
- Megatron-LM's indexed datasets: `PREFIX.bin` (the ids, sequences back to back) and `PREFIX.idx`
  (header `MMIDIDX\\0\\0`, version 1, dtype code, sequence and document counts, then the sequence
  lengths (int32), byte offsets (int64) and document indices (int64); megatron/core/datasets/
  indexed_dataset.py). The ids are read as one stream; its end-of-document id is `data.eod_id`.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fivefold.config.schema import DataConfig
from fivefold.data.sources import DataError, path_kind

IGNORE = -100  # target value that counts no loss
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
                   8: np.uint16}


class TokenStream:
    """Arrays of token ids (memory maps of token files, or arrays in memory) read as one sequence;
    `eod` ends each document. `masks` (a loss mask per part, 1 = trained, None for a part whose every
    token is trained; prepare.py's .mask files), or None when no part has one."""

    def __init__(self, parts: list[np.ndarray], eod: int, masks: list[np.ndarray | None] | None = None):
        kept = [i for i, p in enumerate(parts) if len(p)]
        self.maps = [parts[i] for i in kept]
        self.masks = [masks[i] for i in kept] if masks is not None and any(m is not None for m in masks) else None
        self.starts = np.concatenate([[0], np.cumsum([len(m) for m in self.maps])]).astype(np.int64)
        self.n_tokens, self.eod = int(self.starts[-1]), eod

    @classmethod
    def of_files(cls, files: list[tuple[Path, int]], dtype: np.dtype, eod: int,
                 masks: list[Path | None] | None = None) -> TokenStream:
        """(file, token count) pairs, each mapped (and its mask file, if any), nothing read."""
        maps = [np.memmap(f, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype) for f, n in files]
        mask_maps = None if masks is None else [
            np.memmap(m, dtype=np.uint8, mode="r", shape=(n,)) if m is not None and n else None
            for m, (_, n) in zip(masks, files, strict=True)]
        return cls(maps, eod, mask_maps)

    def _read(self, arrays: list, start: int, stop: int, dtype, fill: int) -> np.ndarray:
        stop = min(stop, self.n_tokens)
        parts, i = [], int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            m, base = arrays[i], int(self.starts[i])
            take = min(stop, base + len(self.maps[i])) - start
            parts.append(np.full(take, fill, dtype) if m is None else np.asarray(m[start - base : start - base + take],
                                                                                 dtype=dtype))
            start, i = start + take, i + 1
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64, across file boundaries."""
        return self._read(self.maps, start, stop, np.int64, 0)

    def read_mask(self, start: int, stop: int) -> np.ndarray:
        """The loss mask of tokens [start, stop) as bool (all True without masks)."""
        if self.masks is None:
            return np.ones(max(0, min(stop, self.n_tokens) - start), dtype=bool)
        return self._read(self.masks, start, stop, np.bool_, 1)


def _sized(path: Path, itemsize: int) -> int:
    size = path.stat().st_size
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {itemsize}-byte token ids (truncated, or "
                        f"another dtype: data.bin_dtype)")
    return size // itemsize


def prepared_stream(folder: Path, manifest: dict, split: str) -> TokenStream:
    shards = manifest["splits"][split]["shards"]
    files = [(folder / s["file"], s["tokens"]) for s in shards]
    masks = [folder / s["file"].replace(".bin", ".mask") if "trained" in s else None for s in shards]
    return TokenStream.of_files(files, np.dtype(manifest["dtype"]), manifest["tokenizer"]["eod"], masks)


def read_megatron_index(path: Path) -> tuple[np.dtype, int, int]:
    """(dtype, sequences, documents) from a Megatron-LM .idx header."""
    with open(path, "rb") as f:
        head = f.read(len(MEGATRON_MAGIC) + 8 + 1 + 8 + 8)
    if len(head) < 34 or not head.startswith(MEGATRON_MAGIC):
        raise DataError(f"{path}: not a Megatron-LM index (no MMIDIDX header)")
    version, code, sequences, docs = struct.unpack("<QBQQ", head[len(MEGATRON_MAGIC):])
    if version != 1 or code not in MEGATRON_DTYPES or MEGATRON_DTYPES[code] in (np.float32, np.float64):
        raise DataError(f"{path}: Megatron-LM index version {version}, dtype code {code}: not token ids fivefold reads")
    return np.dtype(MEGATRON_DTYPES[code]), sequences, docs


def open_token_files(d: DataConfig, split: str) -> TokenStream | None:
    """The stream of nanoGPT / Megatron-LM files in data.paths (`split` "val": their val siblings, or None)."""
    if d.eod_id < 0:
        raise DataError("data.eod_id is not set: pre-tokenized .bin files need the end-of-document id their "
                        "tokenizer used (e.g. 50256 for GPT-2)")
    files: list[tuple[Path, int]] = []
    dtype = np.dtype(d.bin_dtype)
    for raw in d.paths:
        p = Path(raw)
        if path_kind(raw) == "megatron":
            prefix = p.with_suffix("") if p.suffix in (".bin", ".idx") else p
            if split == "val":
                prefix = prefix.with_name(prefix.name.replace("train", "val"))
                if prefix.name == p.with_suffix("").name or not prefix.with_suffix(".idx").is_file():
                    return None
            dtype, _, _ = read_megatron_index(prefix.with_suffix(".idx"))
            files.append((prefix.with_suffix(".bin"), _sized(prefix.with_suffix(".bin"), dtype.itemsize)))
        else:
            if split == "val":
                p = p.with_name("val.bin") if p.name == "train.bin" else None
                if p is None or not p.is_file():
                    return None
            files.append((p, _sized(p, dtype.itemsize)))
    return TokenStream.of_files(files, dtype, d.eod_id)


class PackedDataset:
    """A stream cut into samples of seq_len + 1 tokens that overlap by one (inputs = tokens[:-1],
    targets = tokens[1:]); sample i starts at token i * seq_len. The tail that does not fill a sample
    becomes one padded sample whose missing targets are -100, so no token is dropped. With a loss mask
    (fine-tuning records), a target that is not trained is -100 too: the loss and the step's token
    count (the denominator, targets_in) skip it alike, in every layout."""

    def __init__(self, stream: TokenStream, seq_len: int):
        self.stream, self.seq_len = stream, seq_len
        self.eod = self.pad_id = stream.eod  # ends every document; pads a short tail sample
        n = stream.n_tokens - 1  # (input, target) pairs
        self.n_samples = max(0, -(-n // seq_len))
        self.tail_targets = n - (self.n_samples - 1) * seq_len if self.n_samples else 0

    def __len__(self) -> int:
        return self.n_samples

    def targets_in(self, indices: np.ndarray) -> int:
        """Targets that count in these samples: seq_len each, the tail sample fewer; with a loss mask, the
        trained ones (read from the mask: every rank counts the whole global batch alike)."""
        if self.stream.masks is not None:
            T = self.seq_len
            return sum(int(self.stream.read_mask(int(i) * T + 1, int(i) * T + T + 1).sum()) for i in indices)
        short = int(np.count_nonzero(np.asarray(indices) == self.n_samples - 1))
        return len(indices) * self.seq_len - short * (self.seq_len - self.tail_targets)

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each of seq_len tokens; a short tail is padded (targets -100)."""
        T = self.seq_len
        chunk = self.stream.read(i * T, i * T + T + 1)
        inputs = np.full(T, self.pad_id, dtype=np.int64)
        targets = np.full(T, IGNORE, dtype=np.int64)
        inputs[: len(chunk) - 1] = chunk[:-1]
        targets[: len(chunk) - 1] = chunk[1:]
        if self.stream.masks is not None:  # targets of untrained tokens count nothing
            trained = self.stream.read_mask(i * T + 1, i * T + T + 1)  # (len(chunk) - 1,)
            targets[: len(trained)][~trained] = IGNORE
        return inputs, targets


def in_memory_stream(ids: np.ndarray, eod: int, mask: np.ndarray | None = None) -> TokenStream:
    """A stream over ids (and maybe their loss mask) already in memory (tests, and tiny corpora)."""
    return TokenStream([np.asarray(ids)], eod, None if mask is None else [np.asarray(mask)])
