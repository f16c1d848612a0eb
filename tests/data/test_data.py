"""Corpus, tokenizers, packing and deterministic global batches."""

import numpy as np
import pytest

from fivefold.data.batches import IGNORE, GlobalBatches, PackedDataset, epoch_order, rank_slice
from fivefold.data.prepare import encode_documents, in_validation
from fivefold.data.sources import Skipped, documents, input_files, stdlib_sources
from fivefold.data.tokenizer import ByteTokenizer, train_bpe
from fivefold.data.tokens import in_memory_stream


def packed(texts: list[bytes], seq_len: int) -> PackedDataset:
    """Documents packed as prepare.py packs them, in memory."""
    tok = ByteTokenizer()
    return PackedDataset(in_memory_stream(np.concatenate(encode_documents(tok, texts)), tok.eod), seq_len)


def test_default_corpus_is_the_standard_library():
    files = stdlib_sources()
    assert len(files) > 300 and any(f.name == "argparse.py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    docs = list(documents(input_files([]), max_bytes=50_000))
    assert sum(len(d.text) for d in docs) == 50_000  # capped exactly, in sorted file order


def test_user_folder_skips_binary_files_and_names_them(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "b.dat").write_bytes(b"\0\1\2")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("world")
    skipped = Skipped()
    docs = list(documents(input_files([str(tmp_path)]), skipped=skipped))
    assert [d.text for d in docs] == [b"hello", b"world"]
    assert skipped.files == [str(tmp_path / "b.dat")] and "b.dat" in skipped.warning()


def test_validation_split_is_by_document_and_stable():
    names = [f"file{i}.py" for i in range(1000)]
    val = [n for n in names if in_validation(n, 0.1)]
    assert 60 < len(val) < 140
    assert [n for n in names[::-1] if in_validation(n, 0.1)] == val[::-1]  # membership depends on the name only


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "déjà vu → ok"
    assert tok.decode(tok.encode(text.encode())) == tok.decode(tok.encode(text)) == text


def test_bpe_tokenizer_trains_here_and_round_trips():
    tok = train_bpe(["def function(argument):\n    return argument + 1\n"] * 50, 300)
    text = "def function(x):\n    return x\n"
    ids = tok.encode(text)
    assert tok.decode(list(ids)) == text
    assert len(ids) < len(text)  # merges were learned
    assert tok.vocab_size <= 300 and tok.eod == 0


def test_packing_keeps_every_token_and_pads_the_tail():
    ds = packed([b"abcdef", b"ghij"], seq_len=4)
    # tokens: a b c d e f EOD g h i j EOD = 12 tokens -> 11 (input, target) pairs -> samples of 4, 4, 3
    assert len(ds) == 3 and [ds.targets_in([i]) for i in range(3)] == [4, 4, 3]
    x, y = ds.sample(0)
    assert bytes(x.tolist()) == b"abcd" and bytes(y.tolist()) == b"bcde"
    x, y = ds.sample(2)
    assert list(y) == [ord("i"), ord("j"), 256, IGNORE]
    targets = np.concatenate([ds.sample(i)[1] for i in range(3)])
    assert (targets != IGNORE).sum() == ds.targets_in([0, 1, 2]) == 11


def make_dataset(n_tokens: int, seq_len: int = 8) -> PackedDataset:
    return packed([bytes(range(65, 91)) * (n_tokens // 26)], seq_len)


def test_epoch_sees_every_sample_once_including_the_uneven_last_batch():
    ds = make_dataset(300)
    loader = GlobalBatches(ds, global_batch=8, seed=3)
    n = len(ds)
    assert n % 8, "the test needs an uneven last batch"
    seen = []
    while loader.state.epoch == 0:
        seen.append(loader.next_indices())
    assert [len(b) for b in seen] == [8] * (n // 8) + [n % 8]
    assert sorted(np.concatenate(seen).tolist()) == list(range(n))
    second = np.concatenate([loader.next_indices() for _ in range(len(seen))])
    assert sorted(second.tolist()) == list(range(n)) and not np.array_equal(second, np.concatenate(seen))


def test_loader_position_resumes_exactly():
    ds = make_dataset(300)
    a = GlobalBatches(ds, 8, seed=1)
    for _ in range(7):
        a.next_indices()
    b = GlobalBatches(ds, 8, seed=1)
    b.load_state_dict(a.state_dict())
    for _ in range(10):
        assert np.array_equal(a.next_indices(), b.next_indices())


@pytest.mark.parametrize("dp,micro", [(1, 8), (2, 2), (4, 1)])
def test_rank_slices_partition_the_global_batch(dp, micro):
    ds = make_dataset(300)
    indices = np.array([5, 9, 1, len(ds) - 1, 7])  # an uneven batch: 5 of 8 slots, with the padded tail sample
    parts = [rank_slice(ds, indices, 8, dp, r, micro) for r in range(dp)]
    assert sorted(np.concatenate([p.indices for p in parts]).tolist()) == sorted(indices.tolist())
    assert all(len(p.micro_batches) == 8 // dp // micro for p in parts)
    tokens = sum(int((y != IGNORE).sum()) for p in parts for _, y in p.micro_batches)
    assert all(p.global_tokens == tokens == ds.targets_in(indices) for p in parts)


def test_epoch_order_is_built_once_and_memory_mapped(tmp_path):
    order = epoch_order(1000, seed=4, epoch=2, folder=tmp_path)
    assert isinstance(order, np.memmap) and order.dtype == np.uint32
    assert np.array_equal(order, np.random.default_rng([4, 2]).permutation(1000))  # the in-memory order, unchanged
    assert [p.name for p in tmp_path.iterdir()] == ["order-n1000-seed4-epoch2.npy"]
    assert np.array_equal(epoch_order(1000, 4, 2, tmp_path), order)  # read back, not rebuilt
