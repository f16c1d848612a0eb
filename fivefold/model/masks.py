"""What a query may see, as data: causality plus documents, a sliding window and attention sinks.

A training sample is a packed token stream: documents one after another, each ended by an
end-of-document (eod) token, which belongs to the document it ends. A token's document within its
row is the number of eod tokens strictly before it. Query i may attend key j when
  j <= i                                  (causal)
  and doc[j] == doc[i]                    (data.document_mask: Llama 3; Megatron-LM's reset_attention_mask)
  and i - j < w                           (model.attention.window w on this layer: Mistral, Gemma, gpt-oss),
and with attention sinks (gpt-oss) one learned logit per head joins the softmax's denominator as a
key that is always visible and carries a zero value: the weights over real keys sum to less than 1.

Nothing here is a (T, T) tensor on a training path (`dense_keep` and `dense_attention` are the
references tests and benchmarks/attention_check.py compare the kernels with). A micro-batch's
masking is the document id of every token of the whole row, (B, T), derived from the token ids
each rank already holds (before context parallel splits the row, every pipeline stage has them),
so nothing is communicated. Each layer adds its window and sinks (`AttentionMask`), and each
kernel turns that into what it needs: `is_causal` alone (SDPA), a block mask (FlexAttention,
model/flex.py), or per-tile decisions and small bias tiles (the exact blockwise path,
model/blockwise.py, which ring attention shares). `keep` is the
one definition of the rule; the kernels evaluate it on what they need, a tile or a block at a time.
`data.reset_positions` restarts RoPE positions at each document (Megatron-LM's reset_position_ids):
positions become per row, (B, T) instead of (T,). With both options off and no window or sinks,
the model runs its plain causal path (`is_causal=True`). This module is parallel-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


class DocumentOptions(Protocol):
    """The two switches of the config's [data] section this module reads."""

    document_mask: bool
    reset_positions: bool


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """tokens (B, T) -> each token's document index in its row (B, T): eod tokens strictly before it."""
    ends = (tokens == eod).long()  # (B, T)
    return ends.cumsum(1) - ends  # (B, T): the eod itself stays in the document it ends


def document_positions(doc: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """doc (B, T), the row's positions (T,) -> positions restarting at each document (B, T)."""
    T = doc.shape[1]
    index = torch.arange(T, device=doc.device).expand_as(doc)  # (B, T)
    starts = torch.ones_like(doc, dtype=torch.bool)  # (B, T): token i opens a document
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    # Documents are contiguous, so the running maximum of the opening indices is each token's first.
    first = torch.where(starts, index, 0).cummax(1).values  # (B, T)
    return positions[index] - positions[first]  # (B, T)


def keep(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int = 0,
         q_doc: torch.Tensor | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """The rule, on any broadcastable shapes: True where a query at q_pos may attend a key at k_pos.

    Positions are places in the packed row (not RoPE positions); docs, when given, their documents.
    """
    allowed = k_pos <= q_pos
    if window:
        allowed = allowed & (q_pos - k_pos < window)
    if q_doc is not None:
        allowed = allowed & (q_doc == k_doc)
    return allowed


class DocumentIds(NamedTuple):
    """A micro-batch's document ids of whole rows, (B, T), twice: on the compute device (bias tiles and
    FlexAttention's mask read them there) and on the host, where they were computed from the loader's
    token ids (the blockwise path plans its tiles from them there: no read from the device).
    `block_masks`: FlexAttention's block mask of these ids per window, built by the first layer
    that needs it and shared by the micro-batch's other layers (model/flex.py); None: no sharing."""

    ids: torch.Tensor
    host: torch.Tensor
    block_masks: dict[int, BlockMask] | None = None


@dataclass(frozen=True)
class AttentionMask:
    """What one layer's queries may see in one micro-batch, beyond causality.

    doc: (B, T) document ids of the whole row (all T tokens, also where a rank holds T/cp of them),
    or None; doc_host: the same on the CPU when they live on another device (else the plan reads
    `doc`). window: the layer's sliding window (0: none). sinks: the layer's (H,) sink logits (the
    heads this rank holds), or None. block_masks: the micro-batch's DocumentIds.block_masks, or None.
    """

    doc: torch.Tensor | None = None
    window: int = 0
    sinks: torch.Tensor | None = None
    doc_host: torch.Tensor | None = None
    block_masks: dict[int, BlockMask] | None = field(default=None, compare=False, repr=False)
    # optim.qk_clip: the layer's (H,) largest pre-softmax logit of each head so far this step, fp32, which
    # the blockwise path's tiles raise (model/logit_max.py); None: not recorded
    logit_max: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, doc: DocumentIds | torch.Tensor | None, window: int = 0,
           sinks: torch.Tensor | None = None, logit_max: torch.Tensor | None = None) -> AttentionMask:
        """A layer's mask from the micro-batch's document ids (with their host copy, or a tensor alone)."""
        if isinstance(doc, DocumentIds):
            return cls(doc.ids, window, sinks, doc.host, doc.block_masks, logit_max)
        return cls(doc, window, sinks, logit_max=logit_max)

    @property
    def plain(self) -> bool:
        """Causality alone, nothing recorded: what SDPA's `is_causal=True` does."""
        return self.doc is None and not self.window and self.sinks is None and self.logit_max is None

    def head_slice(self, start: int, stop: int) -> AttentionMask:
        """The same mask for heads start..stop-1 (Ulysses holds a part of the heads)."""
        sinks = None if self.sinks is None else self.sinks[start:stop]
        logit_max = None if self.logit_max is None else self.logit_max[start:stop]  # a view: written through
        return AttentionMask(self.doc, self.window, sinks, self.doc_host, self.block_masks, logit_max)


def dense_keep(mask: AttentionMask, seq_len: int, device: torch.device | None = None) -> torch.Tensor:
    """The rule as a dense boolean (B or 1, 1, T, T), for tests and small references only."""
    pos = torch.arange(seq_len, device=device)
    doc = mask.doc
    q_doc = None if doc is None else doc[:, None, :, None]  # (B, 1, T, 1)
    k_doc = None if doc is None else doc[:, None, None, :]  # (B, 1, 1, T)
    return keep(pos[:, None], pos[None, :], mask.window, q_doc, k_doc).expand(
        doc.shape[0] if doc is not None else 1, 1, seq_len, seq_len)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: AttentionMask | None = None, scale: float | None = None) -> torch.Tensor:
    """The rule written out densely, in q's dtype: q (B, T, H, D), k and v (B, T, K, D) -> (B, T, H, D).
    Sinks join the softmax as one more column of logit s_h whose value is zero. A reference for
    tests and checks at small T only: it holds (B, H, T, T) scores. `scale`: the softmax scale (None: 1/sqrt(D))."""
    mask = mask or AttentionMask()
    B, T, H, D = q.shape
    k, v = (x.repeat_interleave(H // x.shape[2], dim=2) for x in (k, v))
    scores = torch.einsum("bqhd,bthd->bhqt", q, k) * (D ** -0.5 if scale is None else scale)  # (B, H, T, T)
    scores = scores.masked_fill(~dense_keep(mask, T, q.device), float("-inf"))
    if mask.sinks is not None:
        sink = mask.sinks.to(scores.dtype)[None, :, None, None].expand(B, H, T, 1)
        weights = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :T]
    else:
        weights = scores.softmax(-1)
    return torch.einsum("bhqt,bthd->bqhd", weights, v)


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
        """Whole rows' token ids (B, T) and positions (T,) -> the RoPE positions ((B, T) with
        reset_positions, else `positions`) and the document ids ((B, T) with document_mask, else None).
        Both are of the whole row: context parallel takes each rank's part of the positions after."""
        doc = document_ids(tokens, self.eod)  # (B, T)
        if self.reset_positions:
            positions = document_positions(doc, positions)  # (B, T)
        return positions, doc if self.mask else None

    def on_device(self, tokens: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, DocumentIds | None]:
        """`inputs` of host token ids (B, T), computed on the host and copied to `device`: the RoPE
        positions there, and the document ids there and here (DocumentIds, with an empty store for
        the block masks its layers share)."""
        positions, doc = self.inputs(tokens, torch.arange(tokens.shape[1], device=tokens.device))
        ids = None if doc is None else DocumentIds(doc.to(device, non_blocking=True), doc, {})
        return positions.to(device, non_blocking=True), ids
