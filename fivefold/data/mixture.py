"""Mixtures: global batches drawn from several prepared datasets by weight, deterministically.

Sample n of the mixed stream (n = 0, 1, ...) comes from the source whose share so far lags its
weight most: the k maximising w_k (n + 1) - c_k, where c_k counts the samples source k has given
(ties to the lower k). The shares then stay within one sample of the weights at every n (the
greedy blending of Megatron-LM's BlendedDataset). Each source walks its own seeded per-epoch
permutation (GlobalBatches), so a source smaller than its share repeats, in a new order, while a
larger one is not exhausted.

The position is the number of samples drawn plus each source's (epoch, cursor): saved in
checkpoints, the same under any layout, so a resumed run continues exactly.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fivefold.data.batches import GlobalBatches, LoaderState
from fivefold.data.tokens import PackedDataset


class MixtureDataset:
    """Several packed datasets behind one index space: sample id = offset of its source + its index."""

    def __init__(self, sources: list[PackedDataset], names: list[str]):
        if len({s.seq_len for s in sources}) != 1 or len({s.eod for s in sources}) != 1:
            raise ValueError("mixture sources must share seq_len and the end-of-document id")
        self.sources, self.names = sources, names
        self.offsets = np.cumsum([0] + [len(s) for s in sources]).astype(np.int64)
        self.seq_len, self.eod = sources[0].seq_len, sources[0].eod
        self.pad_id = self.eod

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _split(self, i: int) -> tuple[int, int]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return k, i - int(self.offsets[k])

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        k, j = self._split(i)
        return self.sources[k].sample(j)

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, np.asarray(indices), side="right") - 1

    def targets_in(self, indices: np.ndarray) -> int:
        which = self.source_of(indices)
        return sum(s.targets_in(np.asarray(indices)[which == k] - self.offsets[k]) for k, s in enumerate(self.sources))

    def tokens_by_source(self, indices: np.ndarray) -> dict[str, int]:
        """Targets per source name in these samples (the metrics' per-source token counts)."""
        which = self.source_of(indices)
        return {name: s.targets_in(np.asarray(indices)[which == k] - self.offsets[k])
                for k, (name, s) in enumerate(zip(self.names, self.sources, strict=True))}


class MixedBatches:
    """Global batches of a MixtureDataset; the interface of GlobalBatches (the epoch stays 0: the
    mixed stream does not end, each source has its own epochs)."""

    def __init__(self, dataset: MixtureDataset, weights: list[float], global_batch: int, seed: int,
                 order_dir: Path | None = None):
        total = float(sum(weights))
        self.dataset, self.global_batch = dataset, global_batch
        self.weights = np.array([w / total for w in weights])
        self.walks = [GlobalBatches(s, 1, seed + 1000003 * (k + 1), order_dir=order_dir, name=f"mixture{k}")
                      for k, s in enumerate(dataset.sources)]  # each source its own seeded order
        self.counts = np.zeros(len(weights), dtype=np.int64)
        self.state = LoaderState()  # cursor: samples of the mixed stream drawn

    def next_indices(self) -> np.ndarray:
        out = np.empty(self.global_batch, dtype=np.int64)
        for slot in range(self.global_batch):
            n = self.state.cursor + slot
            k = int(np.argmax(self.weights * (n + 1) - self.counts))  # the source lagging its share most
            self.counts[k] += 1
            out[slot] = self.dataset.offsets[k] + int(self.walks[k].next_indices()[0])
        self.state.cursor += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"epoch": 0, "cursor": self.state.cursor, "counts": self.counts.tolist(),
                "sources": [w.state_dict() for w in self.walks]}

    def load_state_dict(self, state: dict) -> None:
        self.state = LoaderState(epoch=0, cursor=int(state["cursor"]))
        self.counts = np.array(state["counts"], dtype=np.int64)
        for walk, s in zip(self.walks, state["sources"], strict=True):
            walk.load_state_dict(s)
