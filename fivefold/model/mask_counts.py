"""What attention's mask keeps, by formula: the (query, key) pairs the FLOP count charges and the
128 x 128 tiles the FlexAttention kernel computes, for causality, sliding windows and documents.

The rule is model/masks.py's: query i sees key j iff 0 <= i - j < w (w: the layer's sliding window,
the query included, Hugging Face's convention; without one, every earlier key) and both lie in the
same document (data.document_mask: a document ends at its end-of-document token, and a row's first
token starts one). Counts are per row of T tokens; nothing here allocates a tensor.

Exact counts:
- causal: T (T + 1) / 2 pairs;
- a window of w <= T tokens: sum over queries of min(i + 1, w) = T w - w (w - 1) / 2;
- documents of lengths L_1 .. L_n (summing to T): sum of each document's own count, L (L + 1) / 2
  without a window, L w - w (w - 1) / 2 with one shorter than L.

Documents of a stated mean length. The planner is told a mean document length in tokens, not a
distribution, and assumes the end-of-document tokens fall independently: each token ends its
document with probability p = 1 / mean, so lengths are geometric (the discrete exponential). Why:
- of all distributions of positive lengths with a given mean, the geometric has the most entropy:
  it assumes nothing the mean does not say;
- it is what packing produces when documents arrive in random order and the row cuts them: a
  memoryless stream has no memory of where a row starts, so the cut pieces follow the same law
  (the runtime's document ids restart at each row);
- documents all of the mean length (`fixed_document_pairs`) keep the fewest pairs of any
  distribution with that mean (pairs grow with E[L^2], by Jensen's inequality), so they would price
  every real corpus low; a heavier tail than the exponential (web text, books) keeps more, up to
  the causal count when documents outgrow the row.
Under it query i keeps the key k tokens back with probability q^k, q = 1 - p (no end-of-document
token among the k tokens before it), so the expected pairs are sum over i of (1 - q^m_i) / p with
m_i = min(i + 1, w).

Tiles. FlexAttention's block mask (torch.nn.attention.flex_attention.BlockMask) cuts the
score matrix into 128 x 128 tiles, skips the ones the mask empties and computes the rest whole, the
rule applied inside (model/flex.py). Tile (a, b), b = a - d, is kept iff d = 0 (its diagonal) or
d >= 1 and its closest pair, at distance (d - 1) 128 + 1, is kept: inside the window and, with
documents, in one document (probability q^((d - 1) 128 + 1)): documents are intervals, so when the
closest pair is cut apart every pair is.
"""

from __future__ import annotations

import math

FLEX_BLOCK = 128  # model/flex.py's BLOCK (FlexAttention's default), the tile its kernel skips or computes


def window_pairs(n: int, window: int = 0) -> int:
    """Pairs a causal sequence of n tokens keeps under a window of `window` tokens (0: none):
    n w - w (w - 1) / 2 for w < n, n (n + 1) / 2 otherwise."""
    w = window if 0 < window < n else n
    return n * w - w * (w - 1) // 2


def document_pairs(lengths: list[int] | tuple[int, ...], window: int = 0) -> int:
    """Pairs a row of documents of these lengths keeps: each document's own causal count."""
    return sum(window_pairs(L, window) for L in lengths)


def fixed_document_pairs(seq_len: int, document_tokens: int, window: int = 0) -> int:
    """Pairs of a row cut into documents all of `document_tokens` (the last one shorter when they
    do not divide the row): the fewest pairs any length distribution with that mean keeps."""
    whole, rest = divmod(seq_len, document_tokens)
    return whole * window_pairs(document_tokens, window) + window_pairs(rest, window)


def _q_power(p: float, n: float) -> float:
    """(1 - p)^n, exact for small p (log1p) and for p = 1 (every token its own document)."""
    return 0.0 if p >= 1 else math.exp(n * math.log1p(-p))


def _kept_within(n: int, p: float) -> float:
    """Sum over m = 1..n of (1 - q^m) / p = sum over k = 0..n-1 of (n - k) q^k: closed,
    (n - q (1 - q^n) / p) / p, unless n p is so small that the difference loses its digits; then
    to second order in log q, n (n + 1) / 2 + log(q) (n - 1) n (n + 1) / 6 (relative error below
    (n p)^2 / 12)."""
    if n * p < 1e-4:
        return n * (n + 1) / 2 + math.log1p(-p) * (n - 1) * n * (n + 1) / 6
    q = 1.0 - p
    return (n + q * math.expm1(n * math.log1p(-p)) / p) / p if p < 1 else float(n)


def geometric_document_pairs(seq_len: int, document_tokens: float, window: int = 0) -> float:
    """Expected pairs a row of seq_len tokens keeps when each token ends its document with
    probability 1 / document_tokens (the module docstring): sum over queries of (1 - q^m) / p,
    m = min(i + 1, w), which is S(w') + (T - w') (1 - q^w') / p with w' = min(w, T) and S(n) the
    sum over m = 1..n (_kept_within)."""
    if document_tokens < 1:
        raise ValueError(f"document length {document_tokens}: a document holds at least one token")
    T, p = seq_len, 1.0 / document_tokens
    w = window if 0 < window < T else T
    each_later = 1.0 if p >= 1 else -math.expm1(w * math.log1p(-p)) / p  # (1 - q^w) / p, a query past the window
    return _kept_within(w, p) + (T - w) * each_later


def kept_pairs(seq_len: int, window: int = 0, document_tokens: float = 0) -> float:
    """Pairs one row keeps: causal with the window, and with documents of mean length
    `document_tokens` (0: no document mask) under the geometric assumption."""
    if document_tokens:
        return geometric_document_pairs(seq_len, document_tokens, window)
    return float(window_pairs(seq_len, window))


def kept_tiles(seq_len: int, window: int = 0, document_tokens: float = 0, block: int = FLEX_BLOCK) -> float:
    """Expected tiles of `block` x `block` the kernel computes for one row (the module docstring):
    per query tile a, its diagonal and the tiles d = 1 .. min(a, D) back, D the farthest a window
    reaches ((d - 1) block + 1 < w), each kept with probability q^((d - 1) block + 1) under
    documents (1 without): nb + sum over d = 1..D of (nb - d) q^((d - 1) block + 1), nb = ceil(T /
    block) (nb (nb + 1) / 2 under causality alone)."""
    nb = -(-seq_len // block)
    reach = nb - 1 if not 0 < window < seq_len else (0 if window < 2 else (window - 2) // block + 1)
    reach = min(reach, nb - 1)
    if not document_tokens:
        return float(nb + reach * (reach + 1) // 2 + (nb - 1 - reach) * reach)
    p, total = 1.0 / document_tokens, float(nb)
    for d in range(1, reach + 1):  # at most T / block terms, ending once they no longer count
        term = (nb - d) * _q_power(p, (d - 1) * block + 1)
        total += term
        if term < 1e-12 * total:
            break
    return total


def keys_per_query(seq_len: int, window: int = 0, document_tokens: float = 0) -> float:
    """The mean keys a query is charged for, the attention FLOP count's unit: T / 2 for causality
    alone (the causal half as PaLM and FlashAttention's benchmarks count it, the planner's count
    before masks existed), else the kept pairs / T. A window of the whole row or more is no window."""
    if not document_tokens and not 0 < window < seq_len:
        return seq_len / 2
    return kept_pairs(seq_len, window, document_tokens) / seq_len


def tile_ratio(seq_len: int, window: int = 0, document_tokens: float = 0) -> float:
    """The kernel's work under the mask over its work under causality alone, in computed tiles:
    what scales a causal attention kernel's measured time to the masked one's."""
    return kept_tiles(seq_len, window, document_tokens) / kept_tiles(seq_len)
