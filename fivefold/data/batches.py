"""Deterministic global batches over a packed dataset; each rank takes its slice by index.

The data itself (documents, tokenizers, prepared shards read by memory map) is fivefold/data/.
Batches: a global batch is `global_batch` samples taken in order from a seeded permutation of the
training samples (one permutation per epoch, built once into the data cache and memory-mapped,
as Megatron-LM does with its shuffle index). The position is (epoch, cursor): it is saved in
checkpoints, so a resumed run sees exactly the samples it would have seen, and it does not depend
on the number of ranks. The last batch of an epoch holds what is left (fewer samples); its empty
slots are padding rows that carry no tokens. No sample is dropped or repeated within an epoch.

Rank r of dp takes rows [r G/dp, (r+1) G/dp) of the global batch and cuts them into micro-batches.
Every rank knows the whole step's token count without communication, because the batch is a pure
function of the position: that count is the loss denominator (see train/loop.py).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fivefold.data.tokens import IGNORE, PackedDataset

__all__ = ["IGNORE", "GlobalBatches", "LoaderState", "PackedDataset", "RankBatch", "rank_slice", "epoch_order"]


class DataCacheError(OSError):
    """A file of the data cache could not be written; the message names it and the fix."""


def epoch_order(n: int, seed: int, epoch: int, folder: Path | None, name: str = "order") -> np.ndarray:
    """The seeded permutation of n samples for `epoch`, numpy's `default_rng([seed, epoch]).permutation(n)`:
    held in memory without a folder; with one, built once in a file (shuffled in place there, 4 bytes
    per sample and no copy in memory) and memory-mapped by every run that needs it (the name says n,
    seed and epoch; every rank may build it: the same bytes land under one name by an atomic rename)."""
    dtype = np.uint32 if n < 2**32 else np.int64  # half the bytes of int64 for any real corpus
    if folder is None:
        return np.random.default_rng([seed, epoch]).permutation(n).astype(dtype)
    path = folder / f"{name}-n{n}-seed{seed}-epoch{epoch}.npy"
    if not path.is_file():
        tmp = folder / f".{path.name}.{os.getpid()}.tmp"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            order = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(n,))
            # Its blocks taken now: a full disk is an error here, not a SIGBUS when a page of the map is
            # first written (the file is sparse).
            with tmp.open("r+b") as f:
                os.posix_fallocate(f.fileno(), 0, tmp.stat().st_size)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            full = e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
            raise DataCacheError(f"{tmp}: {'no space left' if full else e.strerror} writing epoch {epoch}'s sample "
                                 f"order ({n * np.dtype(dtype).itemsize:,} bytes); free space there or set "
                                 f"data.cache_dir to a disk with room, then --resume") from None
        chunk = 1 << 22
        for start in range(0, n, chunk):
            order[start : start + chunk] = np.arange(start, min(n, start + chunk), dtype=dtype)
        # What permutation(n) does to its arange; on a plain ndarray view of the map (numpy takes a slow,
        # element-wise path for ndarray subclasses: 100x here).
        np.random.default_rng([seed, epoch]).shuffle(order.view(np.ndarray))
        order.flush()
        del order
        os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


@dataclass
class LoaderState:
    epoch: int = 0
    cursor: int = 0  # samples of this epoch's permutation already consumed


class GlobalBatches:
    """Deterministic global batches over a dataset: the same sequence for any number of ranks."""

    def __init__(self, dataset: PackedDataset, global_batch: int, seed: int, shuffle: bool = True,
                 order_dir: Path | None = None, name: str = "order"):
        if len(dataset) == 0:
            raise ValueError("the dataset holds no samples: give more text (data.paths, data.max_bytes)")
        self.dataset, self.global_batch, self.seed, self.shuffle = dataset, global_batch, seed, shuffle
        self.order_dir, self.name = order_dir, name
        self.state = LoaderState()
        self._orders: dict[int, np.ndarray] = {}  # this epoch's only

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(n, self.seed, epoch, self.order_dir, self.name)}
        return self._orders[epoch]

    def next_indices(self) -> np.ndarray:
        """The sample indices of the next global batch (fewer at an epoch's end); advances."""
        s = self.state
        batch = np.asarray(self._order(s.epoch)[s.cursor : s.cursor + self.global_batch], dtype=np.int64)
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
    global_tokens: int  # targets that count (trained ones, under a loss mask) in the whole global batch, all ranks
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
    return RankBatch(micro, dataset.targets_in(indices), mine)
