"""What attention's mask keeps, by formula (model/mask_counts.py): sliding windows, documents of one
length and of geometric lengths, and both, in pairs (the FLOP count) and in FlexAttention's
128 x 128 tiles (the kernel's work), each pinned by hand arithmetic or by enumerating every
placement of the end-of-document tokens; and the model FLOPs and parameters that follow."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fivefold.model.config import AttentionConfig, ModelConfig
from fivefold.model.counts import flops_per_token, model_counts
from fivefold.model.mask_counts import (
    document_pairs,
    fixed_document_pairs,
    geometric_document_pairs,
    kept_pairs,
    kept_tiles,
    keys_per_query,
    tile_ratio,
    window_pairs,
)


def _keep(i: int, j: int, window: int, ends: tuple[int, ...]) -> bool:
    """model/masks.py's rule: causal, inside the window, no end-of-document token in j .. i - 1."""
    return 0 <= i - j and (not window or i - j < window) and not any(ends[j:i])


def _enumerated(T: int, mean: float, window: int, block: int) -> tuple[float, float]:
    """(pairs, tiles) expected over every placement of end-of-document tokens, each token one with
    probability 1 / mean: the brute force the closed forms must equal."""
    p = 1 / mean
    pairs = tiles = 0.0
    nb = -(-T // block)
    for ends in itertools.product((0, 1), repeat=T):
        chance = p ** sum(ends) * (1 - p) ** (T - sum(ends))
        kept = [[_keep(i, j, window, ends) for j in range(T)] for i in range(T)]
        pairs += chance * sum(map(sum, kept))
        tiles += chance * sum(any(kept[i][j] for i in range(a * block, min(T, a * block + block))
                                  for j in range(b * block, min(T, b * block + block)))
                              for a in range(nb) for b in range(nb))
    return pairs, tiles


def test_a_window_keeps_t_w_minus_w_w_minus_1_over_2_pairs():
    # T = 8, w = 3: queries keep 1, 2, 3, 3, 3, 3, 3, 3 = 21 = 8 x 3 - 3 x 2 / 2
    assert window_pairs(8, 3) == 21 == sum(min(i + 1, 3) for i in range(8))
    assert window_pairs(4096, 1024) == 4096 * 1024 - 1024 * 1023 // 2
    assert window_pairs(8, 0) == window_pairs(8, 8) == window_pairs(8, 100) == 36  # no window: T (T + 1) / 2


def test_documents_of_one_length_keep_t_over_l_times_l_l_plus_1_over_2():
    assert fixed_document_pairs(8192, 1024) == 8 * 1024 * 1025 // 2
    assert fixed_document_pairs(12, 4, window=2) == 3 * (4 * 2 - 1)  # window inside documents: 7 each
    assert fixed_document_pairs(10, 4) == 10 + 10 + 3  # 4, 4 and a last 2
    assert document_pairs([5, 3]) == 15 + 6 and document_pairs([5, 3], window=2) == 9 + 5


def test_geometric_documents_by_hand_and_against_every_placement_of_their_ends():
    # mean 2 (each token ends its document with probability 1/2), T = 4: query i keeps the key k back
    # with probability 2^-k: 1, 1.5, 1.75, 1.875 = 6.125; with a window of 2: 1, 1.5, 1.5, 1.5 = 5.5
    assert geometric_document_pairs(4, 2) == pytest.approx(6.125, rel=1e-12)
    assert geometric_document_pairs(4, 2, window=2) == pytest.approx(5.5, rel=1e-12)
    assert geometric_document_pairs(4, 1) == pytest.approx(4)  # every token its own document
    assert geometric_document_pairs(4, 2) > fixed_document_pairs(4, 2) == 6  # one length keeps the fewest
    for T, mean, window, block in ((7, 2.0, 0, 2), (7, 3.5, 3, 2), (8, 1.5, 5, 3), (6, 4.0, 0, 4)):
        pairs, tiles = _enumerated(T, mean, window, block)
        assert kept_pairs(T, window, mean) == pytest.approx(pairs, rel=1e-12)
        assert kept_tiles(T, window, mean, block=block) == pytest.approx(tiles, rel=1e-12)


def test_the_kernels_tiles_under_causality_windows_and_long_documents():
    # 1024 tokens, 8 tiles a side: causality keeps 8 x 9 / 2 = 36; a window of 128 its diagonal and
    # the tile before (1 + 7 x 2 = 15), one of 129 no more (the closest pair one tile back is 129 apart)
    assert kept_tiles(1024) == 36 and kept_tiles(1024, 128) == 15 == kept_tiles(1024, 129)
    assert kept_tiles(1024, 130) == 1 + 2 + 6 * 3 and kept_tiles(1024, 1) == 8
    assert tile_ratio(1024, 128) == pytest.approx(15 / 36)
    assert kept_tiles(1024, 0, 1e12) == pytest.approx(36)  # documents far longer than the row: causal
    assert keys_per_query(8192) == 4096  # causality alone: T / 2, the count before masks
    assert keys_per_query(8192, 1024) == window_pairs(8192, 1024) / 8192
    assert keys_per_query(8192, 8192) == 4096  # a window of the whole row is none


def test_flops_per_token_count_each_layers_window_and_the_documents():
    """2 layers, 4 heads of 16: attention per token is 6 x H x (Dqk + Dv) = 768 x the keys per query
    of each layer, doubled under causal="full". T = 8, w = 3: 21 pairs, 21 / 8 keys; causal 4."""
    m = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=320, attention=AttentionConfig(window=3))
    assert flops_per_token(m, 8, causal="half")["attention"] == 768 * 2 * 21 / 8
    assert flops_per_token(m, 8, causal="full")["attention"] == 2 * 768 * 2 * 21 / 8
    alternating = dataclasses.replace(m, attention=AttentionConfig(window=3, window_pattern=("sliding", "full")))
    assert flops_per_token(alternating, 8, causal="half")["attention"] == 768 * (21 / 8 + 4)
    plain = dataclasses.replace(m, attention=AttentionConfig())
    assert flops_per_token(plain, 8, causal="half")["attention"] == 768 * 2 * 4  # unchanged: 6 L s H (Dqk+Dv) / 2
    assert flops_per_token(plain, 8, causal="half", document_tokens=2)["attention"] == pytest.approx(
        768 * 2 * geometric_document_pairs(8, 2) / 8)


def test_attention_sinks_add_one_parameter_per_query_head_and_layer():
    m = ModelConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=320)
    sinks = dataclasses.replace(m, attention=AttentionConfig(sinks=True))
    assert model_counts(sinks).total == model_counts(m).total + 3 * 4
