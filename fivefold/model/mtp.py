"""Multi-token prediction's inputs and targets (DeepSeek-V3 sec. 2.2, Gloeckle et al. 2024).

Depth k (1-based) of MTP at position i takes the embedding of token i + k and predicts token
i + k + 1: the main model predicts one token ahead, depth k one further per depth. Both come from
the micro-batch's whole rows, shifted by k:

    tokens_k[i]  = x[i + k]                   (0 past the row: its prediction is never trained)
    targets_k[i] = y[i + k] = x[i + k + 1]    if i + k < T and, under data.document_mask,
                                              token i + k is in token i's document; else IGNORE

so a loss mask (an IGNORE in y) and padding carry over to the depths, a prediction never reaches
into the next document (the main model's last target of a document is what y says it is), and a
row's end is never crossed. They are built before context parallel splits the rows, as the targets
are: a rank's token then keeps its true k-ahead token even where that token lies on another rank.
"""

from __future__ import annotations

import torch

from fivefold.model.head import IGNORE


def shift_ahead(x: torch.Tensor, y: torch.Tensor, depths: int,
                doc: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole rows' token ids and targets (B, T), and their document ids (B, T) under document masks,
    -> (tokens_k, targets_k), each (B, T), for depths k = 1..`depths`."""
    T = x.shape[1]
    out = []
    for k in range(1, depths + 1):
        tokens = torch.zeros_like(x)  # (B, T)
        targets = torch.full_like(y, IGNORE)  # (B, T)
        tokens[:, : T - k] = x[:, k:]
        targets[:, : T - k] = y[:, k:]
        if doc is not None:
            crosses = doc[:, k:] != doc[:, : T - k]  # (B, T - k): token i + k lies in another document
            targets[:, : T - k] = targets[:, : T - k].masked_fill(crosses, IGNORE)
        out.append((tokens, targets))
    return out
