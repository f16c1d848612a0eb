"""Packed documents kept apart: the attention mask and RoPE positions of one micro-batch.

A training sample is a packed token stream: documents one after another, each ended by an
end-of-document (eod) token, which belongs to the document it ends. A token's document within its
row is the number of eod tokens strictly before it. Two data options use that:
- `data.document_mask`: a token attends only to earlier tokens of its own document (Llama 3
  masks so; Megatron-LM's reset_attention_mask): a boolean (B, 1, T, T) mask for SDPA;
- `data.reset_positions`: RoPE positions restart at 0 at each document (Megatron-LM's
  reset_position_ids): positions become per row, (B, T) instead of (T,).

Both are derived from the token ids each rank already holds for the micro-batch (every pipeline
stage has them, not only the first), so nothing is communicated. With both off there is no
`Documents` at all and the model runs its plain causal path (`is_causal=True`, (T,) positions).
This module is parallel-free, like model/transformer.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class DocumentOptions(Protocol):
    """The two switches of the config's [data] section this module reads."""

    document_mask: bool
    reset_positions: bool


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """tokens (B, T) -> each token's document index in its row (B, T): eod tokens strictly before it."""
    ends = (tokens == eod).long()  # (B, T)
    return ends.cumsum(1) - ends  # (B, T): the eod itself stays in the document it ends


def document_mask(doc: torch.Tensor) -> torch.Tensor:
    """doc (B, T) -> boolean (B, 1, T, T): query i may attend key j iff j <= i and same document.

    The diagonal is always True, so no query row is fully masked (SDPA would give NaN there).
    """
    T = doc.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=doc.device).tril()  # (T, T)
    same = doc[:, :, None] == doc[:, None, :]  # (B, T, T)
    return (same & causal)[:, None]  # (B, 1, T, T): broadcast over heads (H/tp of them under tp)


def document_positions(doc: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """doc (B, T), the row's positions (T,) -> positions restarting at each document (B, T)."""
    T = doc.shape[1]
    index = torch.arange(T, device=doc.device).expand_as(doc)  # (B, T)
    starts = torch.ones_like(doc, dtype=torch.bool)  # (B, T): token i opens a document
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    # Documents are contiguous, so the running maximum of the opening indices is each token's first.
    first = torch.where(starts, index, 0).cummax(1).values  # (B, T)
    return positions[index] - positions[first]  # (B, T)


@dataclass(frozen=True)
class Documents:
    """How a run keeps packed documents apart; built only when one of the options is on."""

    eod: int  # the dataset's end-of-document id (also the id of a short tail sample's padding)
    mask: bool  # data.document_mask
    reset_positions: bool  # data.reset_positions

    @classmethod
    def from_config(cls, data: DocumentOptions, eod: int) -> Documents | None:
        """The run's Documents, or None when both options are off (the plain causal path)."""
        if not (data.document_mask or data.reset_positions):
            return None
        return cls(eod, data.document_mask, data.reset_positions)

    def inputs(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A micro-batch's token ids (B, T) and row positions (T,) -> the RoPE positions ((B, T)
        with reset_positions, else `positions`) and the attention mask ((B, 1, T, T) or None)."""
        doc = document_ids(tokens, self.eod)  # (B, T)
        if self.reset_positions:
            positions = document_positions(doc, positions)  # (B, T)
        return positions, document_mask(doc) if self.mask else None
