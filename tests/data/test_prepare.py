"""Prepared datasets: `fivefold prepare`, Hugging Face tokenizers, pre-tokenized formats, mixtures,
training from them, and every bad input named before a process starts."""

import gzip
import json
import struct

import numpy as np
import pytest

from fivefold.cli import main
from fivefold.data import prepare as prepare_module
from fivefold.data.mixture import MixedBatches, MixtureDataset
from fivefold.data.prepare import encode_documents, prepare, read_manifest, token_dtype
from fivefold.data.resolve import cache_folder, ensure_prepared, open_datasets
from fivefold.data.sources import DataError, documents, input_files
from fivefold.data.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer
from fivefold.data.tokens import PackedDataset, in_memory_stream
from fivefold.validate import validate
from tests.helpers import tiny_config

TEXTS = ["the quick brown fox jumps over the lazy dog " * (i % 7 + 1) + f"document {i}\n" for i in range(60)]


def corpus(root):
    """A folder of text files, a .jsonl, a .jsonl.gz and a .parquet: the four input kinds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (root / "text").mkdir(parents=True)
    for i, t in enumerate(TEXTS[:20]):
        (root / "text" / f"{i:02d}.txt").write_text(t)
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS[20:35])))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in TEXTS[35:45])
    pq.write_table(pa.table({"text": TEXTS[45:], "n": list(range(15))}), root / "c.parquet")
    return [str(root / "text"), str(root / "a.jsonl"), str(root / "b.jsonl.gz"), str(root / "c.parquet")]


def hf_tokenizer_dir(root, post: str = "<s> $A </s>"):
    """A byte-level BPE in the layout transformers saves: tokenizer.json (its post-processor adds BOS
    and EOS) and tokenizer_config.json naming them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=post, special_tokens=[("<s>", 0), ("</s>", 1)])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))
    return root


def all_files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prepare_reads_every_input_kind_and_is_byte_identical_for_any_worker_count(tmp_path):
    inputs = corpus(tmp_path / "in")
    one = prepare(inputs, "byte", tmp_path / "w1", shard_bytes=600, val_fraction=0.2, workers=1)
    two = prepare(inputs, "byte", tmp_path / "w2", shard_bytes=600, val_fraction=0.2, workers=2)
    assert all_files(tmp_path / "w1") == all_files(tmp_path / "w2")
    assert one == two and one["dtype"] == "uint16" and len(one["splits"]["train"]["shards"]) > 3
    s = one["splits"]
    assert s["train"]["documents"] + s["val"]["documents"] == len(TEXTS) and s["val"]["documents"] > 0
    # The shards hold each document's bytes + EOD, in input order; names say where each record came from.
    docs = list(documents(input_files(inputs)))
    assert docs[20].name.endswith("a.jsonl:1") and docs[45].name.endswith("c.parquet:0")
    train, val, _ = open_datasets_of(tmp_path / "w1")
    ids = np.concatenate(encode_documents(ByteTokenizer(), [d.text for d in docs
                                                        if not prepare_module.in_validation(d.name, 0.2)]))
    assert np.array_equal(train.stream.read(0, train.stream.n_tokens), ids)
    assert [s["bytes"] for s in one["sources"]][-3:] == [(tmp_path / "in" / n).stat().st_size
                                                         for n in ("a.jsonl", "b.jsonl.gz", "c.parquet")]


def open_datasets_of(folder, seq_len=16, **data):
    cfg = tiny_config(folder.parent, f"--data.paths=['{folder}']", f"--train.seq_len={seq_len}",
                      *[f"--data.{k}={v}" for k, v in data.items()])
    return open_datasets(cfg)


class Killed(Exception):
    """The prepare process dying mid-way."""


def test_an_interrupted_prepare_continues_where_it_stopped(tmp_path, monkeypatch):
    inputs = corpus(tmp_path / "in")
    prepare(inputs, "byte", tmp_path / "whole", shard_bytes=500)
    real, calls = prepare_module.tokenize_unit, []

    def dies_at_the_fourth(*args):
        calls.append(1)
        if len(calls) == 4 and not (tmp_path / "cut" / ".died").exists():
            (tmp_path / "cut" / ".died").touch()
            raise Killed
        return real(*args)

    monkeypatch.setattr(prepare_module, "tokenize_unit", dies_at_the_fourth)
    with pytest.raises(Killed):
        prepare(inputs, "byte", tmp_path / "cut", shard_bytes=500)
    assert not (tmp_path / "cut" / "manifest.json").exists() and (tmp_path / "cut" / ".prepare.json").exists()
    calls.clear()
    prepare(inputs, "byte", tmp_path / "cut", shard_bytes=500)  # the marker stays: this one does not die
    (tmp_path / "cut" / ".died").unlink()
    n_shards = sum(len(s["shards"]) for s in read_manifest(tmp_path / "whole")["splits"].values())
    assert len(calls) == n_shards - 3  # only the missing shards were tokenized
    assert all_files(tmp_path / "cut") == all_files(tmp_path / "whole")
    with pytest.raises(DataError, match="other inputs or options"):
        prepare(inputs, "byte", tmp_path / "cut", shard_bytes=999)


def test_hugging_face_tokenizer_gives_the_ids_transformers_gives(tmp_path):
    from transformers import AutoTokenizer

    folder = hf_tokenizer_dir(tmp_path / "tok")
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    texts = ["hello fox", "the lazy dog, again: 12345!", "déjà vu → ok", ""]
    for text in texts:
        assert ours.encode(text) == theirs(text)["input_ids"]
    assert ours.encode("fox")[0] == theirs.bos_token_id and ours.eod == theirs.eos_token_id == 1
    # Packed, a document that already ends with EOS gets no second one; a BOS-only tokenizer (Llama 3's
    # kind) gets the EOS appended, so document boundaries are always in the ids.
    assert encode_documents(ours, ["fox"])[0].tolist() == theirs("fox")["input_ids"]
    bos_only = load_tokenizer(hf_tokenizer_dir(tmp_path / "bos", post="<s> $A"))
    assert encode_documents(bos_only, ["fox"])[0].tolist() == theirs("fox")["input_ids"]
    m = prepare(corpus(tmp_path / "in"), str(folder), tmp_path / "out")
    assert m["tokenizer"]["kind"] == "hf" and m["tokenizer"]["vocab_size"] == ours.vocab_size
    assert (tmp_path / "out" / "tokenizer" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    assert token_dtype(70_000) == np.uint32 and token_dtype(65_536) == np.uint16


def test_training_reads_a_prepared_dataset_and_caches_text(tmp_path):
    from fivefold.train.loop import train

    folder = hf_tokenizer_dir(tmp_path / "tok")
    prepare(corpus(tmp_path / "in"), str(folder), tmp_path / "ds", val_fraction=0.2)
    cfg = tiny_config(tmp_path, f"--data.paths=['{tmp_path / 'ds'}']", "--train.steps=2", "--train.seq_len=16")
    assert validate(cfg, 1) == []
    result = train(cfg, progress=False)
    assert len(result.losses) == 2 and np.isfinite(result.losses).all()
    assert load_tokenizer(result.run_dir / "tokenizer").encode("fox") == load_tokenizer(folder).encode("fox")
    # Text given to train is prepared once into the cache, then reused.
    text_args = (f"--data.paths=['{tmp_path / 'in' / 'a.jsonl'}']", "--train.steps=1", "--train.seq_len=16")
    text = tiny_config(tmp_path, *text_args, "--run.name=text")
    assert main(["prepare", str(tmp_path / "in" / "a.jsonl"), "--out", str(tmp_path / "manual"), "--no-progress"]) == 0
    train(text, progress=False)
    manifest = cache_folder(text) / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    train(tiny_config(tmp_path, *text_args, "--run.name=again"), progress=False)
    assert manifest.stat().st_mtime_ns == stamp


def test_nanogpt_and_megatron_token_files_are_read_in_place(tmp_path):
    ids = np.arange(1, 200, dtype=np.uint16) % 50
    ids.tofile(tmp_path / "train.bin")
    ids[:40].tofile(tmp_path / "val.bin")
    train, val, _ = open_datasets_of(tmp_path / "train.bin", seq_len=8, eod_id=0)
    assert len(train) == -(-198 // 8) and np.array_equal(train.sample(1)[0], ids[8:16])
    assert val is not None and val.stream.n_tokens == 40
    # Megatron-LM: PREFIX.idx header + lengths + pointers + document indices; PREFIX.bin the ids (int32 here).
    seqs = [np.arange(10, 20), np.arange(30, 37)]
    np.concatenate(seqs).astype(np.int32).tofile(tmp_path / "corpus_train.bin")
    with open(tmp_path / "corpus_train.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 4, 2, 3))
        f.write(np.array([10, 7], np.int32).tobytes() + np.array([0, 40], np.int64).tobytes())
        f.write(np.array([0, 1, 2], np.int64).tobytes())
    train, val, _ = open_datasets_of(tmp_path / "corpus_train", seq_len=4, eod_id=0)
    assert val is None and train.stream.n_tokens == 17 and train.sample(2)[0].tolist() == [18, 19, 30, 31]
    cfg = tiny_config(tmp_path, f"--data.paths=['{tmp_path / 'corpus_train.idx'}']", "--data.eod_id=0")
    assert any("carry no vocabulary" in e for e in validate(cfg, 1))
    assert validate(cfg.__class__(**{**cfg.__dict__, "model": cfg.model.__class__(
        **{**cfg.model.__dict__, "vocab_size": 64})}), 1) == []


def test_mixture_draws_by_weight_and_resumes_exactly(tmp_path):
    tok = ByteTokenizer()
    halves = [np.concatenate(encode_documents(tok, [t.encode() * 3 for t in TEXTS[i::2]])) for i in (0, 1)]
    sources = [PackedDataset(in_memory_stream(ids, tok.eod), 16) for ids in halves]
    mix = MixtureDataset(sources, ["a", "b"])
    a = MixedBatches(mix, [3.0, 1.0], 8, seed=0)
    batches = [a.next_indices() for _ in range(6)]
    counts = np.bincount(np.concatenate([mix.source_of(b) for b in batches]), minlength=2)
    assert counts.tolist() == [36, 12]  # 3 : 1 exactly, every batch
    assert all(np.bincount(mix.source_of(b), minlength=2).tolist() == [6, 2] for b in batches)
    b = MixedBatches(mix, [3.0, 1.0], 8, seed=0)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))  # through the checkpoint's JSON
    for _ in range(20):
        assert np.array_equal(a.next_indices(), b.next_indices())
    got = mix.tokens_by_source(batches[0])
    assert sum(got.values()) == mix.targets_in(batches[0]) and got["a"] == 6 * 16


def test_mixture_trains_and_logs_tokens_per_source(tmp_path):
    from fivefold.train.loop import train
    from fivefold.train.metrics import read_metrics

    inputs = corpus(tmp_path / "in")
    prepare(inputs[:2], "byte", tmp_path / "web")
    prepare(inputs[2:], "byte", tmp_path / "code")
    cfg = tiny_config(tmp_path, f"--data.mixture=[['{tmp_path / 'web'}', 0.75], ['{tmp_path / 'code'}', 0.25]]",
                      "--train.steps=2", "--train.seq_len=16")
    assert validate(cfg, 1) == []
    result = train(cfg, progress=False)
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert [sorted(r["source_tokens"]) for r in rows] == [["code", "web"]] * 2
    assert all(sum(r["source_tokens"].values()) == r["tokens"] for r in rows)


def test_bad_inputs_are_named_before_any_process_starts(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not a JSON object"):
        prepare([str(tmp_path / "bad.jsonl")], "byte", tmp_path / "o1")
    (tmp_path / "field.jsonl").write_text('{"body": "ok"}\n')
    with pytest.raises(DataError, match=r"field.jsonl:1: no field 'text' \(has: body\)"):
        prepare([str(tmp_path / "field.jsonl")], "byte", tmp_path / "o2")
    (tmp_path / "tok.json").write_text("{ not a tokenizer")
    with pytest.raises(TokenizerError, match="tok.json: not a tokenizer.json"):
        HFTokenizer.from_path(tmp_path / "tok.json")
    cfg = tiny_config(tmp_path, f"--data.tokenizer={tmp_path / 'tok.json'}")
    assert any("tok.json: not a tokenizer.json" in e for e in validate(cfg, 1))
    # A prepared dataset: another tokenizer than the config's, a truncated shard, a vocabulary too large.
    ds = tmp_path / "ds"
    prepare(corpus(tmp_path / "in"), "byte", ds)
    tok = hf_tokenizer_dir(tmp_path / "tok")
    errors = validate(tiny_config(tmp_path, f"--data.paths=['{ds}']", f"--data.tokenizer={tok}"), 1)
    assert any("is not the tokenizer" in e and str(ds) in e for e in errors)
    errors = validate(tiny_config(tmp_path, f"--data.paths=['{ds}']", "--model.vocab_size=128"), 1)
    assert any("model.vocab_size = 128 is smaller" in e for e in errors)
    shard = ds / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    errors = validate(tiny_config(tmp_path, f"--data.paths=['{ds}']"), 1)
    assert any(f"{shard}: missing or truncated" in e for e in errors)
    # A folder with no text fails in the launcher, before any worker starts, naming what it skipped.
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.dat").write_bytes(b"\0" * 10)
    empty = tiny_config(tmp_path, f"--data.paths=['{tmp_path / 'binary'}']")
    assert validate(empty, 1) == []
    with pytest.raises(DataError, match=r"holds no text \(1 binary files skipped\)"):
        ensure_prepared(empty)
    assert not cache_folder(empty).exists()  # no empty cache is left behind
    # The CLI turns them into one line and exit code 2.
    assert main(["prepare", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "o3"), "--no-progress"]) == 2
