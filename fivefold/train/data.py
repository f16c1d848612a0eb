"""Text in, deterministic global batches out; each rank takes its slice by index.

Corpus: the files the user names, or by default this Python's own standard-library sources (real
text every Python install has, so the default run needs no download). Documents are tokenized,
each followed by an end-of-document token, concatenated, and cut into samples of seq_len + 1
tokens that overlap by one (inputs = tokens[:-1], targets = tokens[1:]). The tail that does not
fill a sample becomes one padded sample whose missing targets are -100, so no text is dropped.

Batches: a global batch is `global_batch` samples taken in order from a seeded permutation of the
training samples (one permutation per epoch). The position is (epoch, cursor): it is saved in
checkpoints, so a resumed run sees exactly the samples it would have seen, and it does not depend
on the number of ranks. The last batch of an epoch holds what is left (fewer samples); its empty
slots are padding rows that carry no tokens. No sample is dropped or repeated within an epoch.

Rank r of dp takes rows [r G/dp, (r+1) G/dp) of the global batch and cuts them into micro-batches.
Every rank knows the whole step's token count without communication, because the batch is a pure
function of the position: that count is the loss denominator (see train/loop.py).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.config import DataConfig

IGNORE = -100  # target value that counts no loss


def stdlib_sources() -> list[Path]:
    """This Python's standard-library .py files, without site-packages and test suites."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # prune: site-packages alone holds ~90% of the files
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _text_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return [p for p in sorted(path.rglob("*")) if p.is_file() and not any(s.startswith(".") for s in p.parts)]


def read_documents(cfg: DataConfig) -> list[tuple[str, bytes]]:
    """(name, content) of each document, in a fixed order, up to cfg.max_bytes in total."""
    files = [f for p in cfg.paths for f in _text_files(Path(p))] if cfg.paths else stdlib_sources()
    if not files:
        raise FileNotFoundError(f"data.paths = {list(cfg.paths)} holds no files")
    docs, total = [], 0
    for f in files:
        content = f.read_bytes()
        if b"\0" in content[:8192]:  # binary file inside a text folder
            continue
        if cfg.max_bytes and total + len(content) > cfg.max_bytes:
            content = content[: cfg.max_bytes - total]
        docs.append((str(f), content))
        total += len(content)
        if cfg.max_bytes and total >= cfg.max_bytes:
            break
    return docs


def split_documents(docs: list[tuple[str, bytes]], val_fraction: float) -> tuple[list, list]:
    """Hold out documents by a hash of their name: stable when the corpus grows or shrinks."""
    train, val = [], []
    for name, content in docs:
        (val if zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000 else train).append((name, content))
    if not train:  # a corpus of one document still trains
        train, val = val, []
    return train, val


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 ends a document."""

    vocab_size = 257
    eod = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int32)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class BPETokenizer:
    """A byte-level BPE trained here with the `tokenizers` package; token 0 ends a document."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eod = tokenizer.token_to_id("<|eod|>")

    @classmethod
    def train(cls, docs: list[tuple[str, bytes]], vocab_size: int) -> "BPETokenizer":
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|eod|>"], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator((c.decode("utf-8", errors="replace") for _, c in docs), trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: Path) -> "BPETokenizer":
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: Path) -> None:
        self.tok.save(str(path))

    def encode(self, data: bytes) -> np.ndarray:
        return np.asarray(self.tok.encode(data.decode("utf-8", errors="replace")).ids, dtype=np.int32)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


class PackedDataset:
    """Documents packed into samples of seq_len + 1 tokens; sample i starts at token i * seq_len."""

    def __init__(self, docs: list[tuple[str, bytes]], tokenizer, seq_len: int):
        parts = []
        for _, content in docs:
            parts += [tokenizer.encode(content), np.array([tokenizer.eod], dtype=np.int32)]
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.seq_len = seq_len
        self.pad_id = tokenizer.eod
        n = len(self.tokens) - 1  # number of (input, target) pairs
        self.n_samples = max(0, -(-n // seq_len))
        # Targets in each sample: seq_len for all but a short tail sample.
        self.n_targets = np.full(self.n_samples, seq_len, dtype=np.int64)
        if self.n_samples:
            self.n_targets[-1] = n - (self.n_samples - 1) * seq_len

    def __len__(self) -> int:
        return self.n_samples

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), each of seq_len tokens; a short tail is padded (targets -100)."""
        T = self.seq_len
        chunk = self.tokens[i * T : i * T + T + 1]
        inputs = np.full(T, self.pad_id, dtype=np.int64)
        targets = np.full(T, IGNORE, dtype=np.int64)
        inputs[: len(chunk) - 1] = chunk[:-1]
        targets[: len(chunk) - 1] = chunk[1:]
        return inputs, targets


@dataclass
class LoaderState:
    epoch: int = 0
    cursor: int = 0  # samples of this epoch's permutation already consumed


class GlobalBatches:
    """Deterministic global batches over a dataset: the same sequence for any number of ranks."""

    def __init__(self, dataset: PackedDataset, global_batch: int, seed: int, shuffle: bool = True):
        if len(dataset) == 0:
            raise ValueError("the dataset holds no samples: give more text (data.paths, data.max_bytes)")
        self.dataset, self.global_batch, self.seed, self.shuffle = dataset, global_batch, seed, shuffle
        self.state = LoaderState()

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_indices(self) -> np.ndarray:
        """The sample indices of the next global batch (fewer at an epoch's end); advances."""
        s = self.state
        batch = self._order(s.epoch)[s.cursor : s.cursor + self.global_batch]
        s.cursor += len(batch)
        if s.cursor >= len(self.dataset):
            s.epoch, s.cursor = s.epoch + 1, 0
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.state.epoch, "cursor": self.state.cursor}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = LoaderState(epoch=int(state["epoch"]), cursor=int(state["cursor"]))


@dataclass
class RankBatch:
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]]  # (inputs, targets), each (micro_batch, T)
    global_tokens: int  # targets that count in the whole global batch, over all ranks
    indices: np.ndarray  # this rank's sample indices (for tests and logs)


def rank_slice(dataset: PackedDataset, indices: np.ndarray, global_batch: int, dp: int, dp_rank: int,
               micro_batch: int) -> RankBatch:
    """This rank's micro-batches of a global batch; missing rows (an epoch's last batch) are padding."""
    per_rank = global_batch // dp
    T = dataset.seq_len
    inputs = np.full((per_rank, T), dataset.pad_id, dtype=np.int64)  # (G/dp, T)
    targets = np.full((per_rank, T), IGNORE, dtype=np.int64)  # (G/dp, T)
    mine = indices[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    for row, i in enumerate(mine):
        inputs[row], targets[row] = dataset.sample(int(i))
    x, y = torch.from_numpy(inputs), torch.from_numpy(targets)
    micro = [(x[j : j + micro_batch], y[j : j + micro_batch]) for j in range(0, per_rank, micro_batch)]
    return RankBatch(micro, int(dataset.n_targets[indices].sum()), mine)
