"""Fine-tuning data: prompt/completion and chat records, their loss masks, chat templates rendered as
transformers renders them, SentencePiece tokenizer.model converted as transformers converts it, and
the bad inputs, each named in one line."""

import json
import re
import sys

import numpy as np
import pytest
from helpers import sentencepiece_model

from fivefold.cli import main
from fivefold.data.batches import IGNORE
from fivefold.data.prepare import prepare, read_manifest
from fivefold.data.sources import DataError
from fivefold.data.tokenizer import TokenizerError, load_tokenizer
from fivefold.data.tokens import PackedDataset, prepared_stream

# A ChatML template as Qwen2.5 writes it (system default, <|im_start|>role\n...<|im_end|>\n) and a Llama 3
# one (BOS written by the template, header ids, <|eot_id|>), both written here in their published shape.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}"
          "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
          "+ '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
CHATS = [
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "Green, or red."}],
    [{"role": "user", "content": "déjà vu → ok"}, {"role": "assistant", "content": "  spaced  "}],
]
WORDS = "the quick brown fox jumps over the lazy dog what is two plus four name a colour blue green red".split()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def chat_tokenizer_dir(root, template: str, specials: list[str], bos: str, eos: str, post_bos: bool = False,
                       jinja_file: bool = False):
    """A byte-level BPE with the template's special tokens, saved as transformers saves a model's tokenizer;
    the template in tokenizer_config.json or chat_template.jinja."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20 + [json.dumps(CHATS)], trainer=trainer)
    if post_bos:  # Llama 3's tokenizer.json adds BOS itself; a chat's BOS comes from the template alone
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 0)])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    config = {"bos_token": bos, "eos_token": eos, "tokenizer_class": "PreTrainedTokenizerFast"}
    if jinja_file:
        (root / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return root


def chatml_dir(root):
    return chat_tokenizer_dir(root, CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>",
                              "<|im_end|>")


def llama3_dir(root):
    return chat_tokenizer_dir(root, LLAMA3, ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                             "<|end_header_id|>", "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>",
                              post_bos=True, jinja_file=True)


def documents_of(folder, split="train"):
    """Each prepared document's (ids, mask) from the shards as written."""
    m = read_manifest(folder)
    out = []
    for shard in m["splits"][split]["shards"]:
        ids = np.fromfile(folder / shard["file"], dtype=m["dtype"]).astype(np.int64)
        mask = np.fromfile(folder / shard["file"].replace(".bin", ".mask"), dtype=np.uint8)
        ends = np.load(folder / shard["file"].replace(".bin", ".idx"))
        starts = np.concatenate([[0], ends[:-1]])
        out += [(ids[a:b], mask[a:b]) for a, b in zip(starts, ends, strict=True)]
    return out


def test_prompt_completion_trains_the_completion_and_its_end(tmp_path):
    records = [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}, {"prompt": "Say hi.", "completion": "hi!"},
               {"text": "plain text trains every token"}]
    m = prepare([write_jsonl(tmp_path / "pc.jsonl", records)], "byte", tmp_path / "out", val_fraction=0.0)
    docs = documents_of(tmp_path / "out")
    for (ids, mask), r in zip(docs, records, strict=True):
        if "text" in r:
            assert ids.tolist() == list(r["text"].encode()) + [256] and mask.tolist() == [1] * len(ids)
            continue
        prompt, completion = r["prompt"].encode(), r["completion"].encode()
        assert ids.tolist() == list(prompt + completion) + [256]
        assert mask.tolist() == [0] * len(prompt) + [1] * len(completion) + [1]  # by hand: the end is trained
    trained = sum(len(r["completion"].encode()) + 1 for r in records[:2]) + len(records[2]["text"]) + 1
    assert m["splits"]["train"]["trained"] == trained and m["version"] == 2
    # Packed into samples: a target that is not trained is -100, and the step's count is the trained ones.
    data = PackedDataset(prepared_stream(tmp_path / "out", m, "train"), 8)
    all_targets = np.concatenate([data.sample(i)[1] for i in range(len(data))])
    assert int((all_targets != IGNORE).sum()) == data.targets_in(np.arange(len(data))) == trained - docs[0][1][0]
    assert [data.targets_in(np.array([i])) for i in range(len(data))] == \
        [int((data.sample(i)[1] != IGNORE).sum()) for i in range(len(data))]


def test_prompt_completion_with_a_hugging_face_tokenizer(tmp_path):
    folder = chatml_dir(tmp_path / "tok")
    tok = load_tokenizer(folder)
    records = [{"prompt": "what is two plus two\n", "completion": "four"}]
    prepare([write_jsonl(tmp_path / "pc.jsonl", records)], str(folder), tmp_path / "out", val_fraction=0.0)
    (ids, mask), = documents_of(tmp_path / "out")
    assert ids.tolist() == tok.encode("what is two plus two\nfour") + [tok.eod]  # the whole text, encoded once
    assert ids[mask == 1].tolist() == tok.encode("four") + [tok.eod]  # by hand: the completion's tokens, the end


@pytest.mark.parametrize("make", [chatml_dir, llama3_dir])
def test_chats_render_as_transformers_and_train_the_assistant_turns(tmp_path, make):
    from transformers import AutoTokenizer

    folder = make(tmp_path / "tok")
    theirs, tok = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    prepare([write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])], str(folder), tmp_path / "out",
            val_fraction=0.0)
    for (ids, mask), chat in zip(documents_of(tmp_path / "out"), CHATS, strict=True):
        expected = theirs.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        end = [] if expected[-1] == tok.eod else [tok.eod]
        assert ids.tolist() == expected + end  # one BOS (Llama 3's post-processor would add a second)
        # By hand: each assistant turn's content and the end of its turn, as the template closes it.
        close = "<|im_end|>\n" if make is chatml_dir else "<|eot_id|>"
        turns = [m["content"].strip() if make is llama3_dir else m["content"] for m in chat if m["role"] == "assistant"]
        want = [i for t in turns for i in tok.tok.encode(t + close, add_special_tokens=False).ids] + end
        assert ids[mask == 1].tolist() == want
        assert mask.sum() < len(mask) / 2  # the prompts are most of it, untrained
    # The template comes along with the tokenizer: the prepared copy renders alike.
    from fivefold.data.chat import ChatTemplate

    saved = ChatTemplate(tmp_path / "out" / "tokenizer")
    for chat in CHATS:
        for gen in (False, True):
            assert saved.render(chat[:-1] if gen else chat, "x", gen) == \
                theirs.apply_chat_template(chat[:-1] if gen else chat, tokenize=False, add_generation_prompt=gen)


# Qwen3's way: only the last turn shows its (empty) reasoning, so a turn renders otherwise once later turns
# exist. Marked with {% generation %}, its turns are found as transformers marks them; unmarked, refused.
REWRITES = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
            "{% generation %}{% if loop.last %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
            "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
            "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
            "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_template_marking_its_turns_is_masked_as_transformers_marks_them(tmp_path, capsys):
    from transformers import AutoTokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    folder = chat_tokenizer_dir(tmp_path / "tok", REWRITES, specials, "<|endoftext|>", "<|im_end|>")
    theirs, tok = AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)
    prepare([write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])], str(folder), tmp_path / "out",
            val_fraction=0.0)
    for (ids, mask), chat in zip(documents_of(tmp_path / "out"), CHATS, strict=True):
        out = theirs.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert ids.tolist() == out["input_ids"] + [tok.eod] and mask.tolist() == out["assistant_masks"] + [0]
        turns = [m["content"] for m in chat if m["role"] == "assistant"]  # by hand: the marked text
        marked = "".join(("<think>\n\n</think>\n\n" if i == len(turns) - 1 else "") + t + "<|im_end|>"
                         for i, t in enumerate(turns))
        assert tok.tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == marked
    # Unmarked, the multi-turn chat is refused by name: its first turn renders otherwise later on.
    unmarked = chat_tokenizer_dir(tmp_path / "plain", REWRITES.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""), specials, "<|endoftext|>", "<|im_end|>")
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    err = _cli_error(capsys, ["prepare", path, "--tokenizer", str(unmarked), "--out", str(tmp_path / "out2"),
                              "--no-progress", "--val-fraction", "0", "--workers", "1"])
    assert "chats.jsonl:2: the chat template renders messages[:2] as other than the start of the whole chat" in err


def _cli_error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


@pytest.mark.parametrize("record, words", [
    ({"prompt": "only a prompt"}, ["pc.jsonl:2", "no field 'completion'", "needs both"]),
    ({"prompt": "p", "completion": 3}, ["pc.jsonl:2", "'completion' is int"]),
    ({"messages": "hello"}, ["pc.jsonl:2", "'messages' is not a non-empty list"]),
    ({"messages": [{"role": "user", "content": "hi"}]}, ["pc.jsonl:2", "no message with role 'assistant'"]),
    ({"messages": [{"content": "hi"}]}, ["pc.jsonl:2", "messages[0] has no 'role'"]),
    ({"title": "x"}, ["pc.jsonl:2", "no field 'text'", "prompt and completion, or messages"]),
])
def test_bad_records_are_named_in_one_line(tmp_path, capsys, record, words):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, record])
    err = _cli_error(capsys, ["prepare", path, "--out", str(tmp_path / "out"), "--no-progress"])
    assert all(w in err for w in words), err
    assert not (tmp_path / "out").exists()  # nothing left behind


def test_a_template_that_raises_names_the_record(tmp_path, capsys):
    folder = chat_tokenizer_dir(tmp_path / "tok", "{% if messages[0]['role'] == 'system' %}{{ raise_exception("
                                "'System role not supported') }}{% endif %}" + CHATML,
                                ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|endoftext|>", "<|im_end|>")
    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": c} for c in CHATS])
    err = _cli_error(capsys, ["prepare", path, "--tokenizer", str(folder), "--out", str(tmp_path / "out"),
                              "--no-progress", "--val-fraction", "0", "--workers", "1"])
    assert "chats.jsonl:2" in err and "System role not supported" in err and "chat template failed" in err, err
    assert not (tmp_path / "out").exists()
    # A chat with no template (a byte tokenizer, or a tokenizer.json alone) says where the template comes from.
    err = _cli_error(capsys, ["prepare", path, "--out", str(tmp_path / "out"), "--no-progress"])
    assert re.search(r"chats\.jsonl:\d: a chat record needs the model's tokenizer", err), err
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes())
    err = _cli_error(capsys, ["prepare", path, "--tokenizer", str(tmp_path / "bare" / "tokenizer.json"), "--out",
                              str(tmp_path / "out"), "--no-progress", "--workers", "1"])
    assert re.search(r"chats\.jsonl:\d: a chat record needs the model's chat template, and the tokenizer has none",
                     err), err


@pytest.mark.parametrize("tokenizer_class", ["LlamaTokenizer", "GemmaTokenizer", None])
def test_sentencepiece_model_converts_to_transformers_ids(tmp_path, tokenizer_class):
    from transformers import AutoTokenizer

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(sentencepiece_model(WORDS, 300))
    if tokenizer_class:
        (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class}))
    ours, theirs = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
    texts = ["the quick brown fox", "  two  spaces, déjà vu → ok 42\nnew line", "zebra ünïcödé 漢字", ""]
    for text in texts:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert ours.encode("the lazy dog") != ours.encode("the lazy cat")  # (the model's pieces, not bytes alone)
    # Prepared with it: the converted tokenizer.json is kept, and reading it back gives the same ids.
    prepare([write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])], str(folder), tmp_path / "out")
    saved = tmp_path / "out" / "tokenizer"
    assert (saved / "tokenizer.json").is_file() and not (saved / "tokenizer.model").exists()
    assert [load_tokenizer(saved).encode(t) for t in texts] == [theirs(t)["input_ids"] for t in texts]


def test_sentencepiece_model_without_the_extras_says_which_to_install(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(b"not read: the packages are checked first")
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # an import of it raises ImportError
    with pytest.raises(TokenizerError, match=r"needs sentencepiece; pip install 'fivefold\[hf\]'"):
        load_tokenizer(folder)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "x"}])
    err = _cli_error(capsys, ["prepare", path, "--tokenizer", str(folder), "--out", str(tmp_path / "out"),
                              "--no-progress"])
    assert "tokenizer.model" in err and "sentencepiece" in err and not (tmp_path / "out").exists()


def test_datasets_prepared_before_masks_still_load(tmp_path):
    """A version-1 manifest (no mask files, no `trained`) trains every token, as it always did."""
    prepare([write_jsonl(tmp_path / "t.jsonl", [{"text": "hello there"}] * 3)], "byte", tmp_path / "out")
    m = read_manifest(tmp_path / "out")
    assert m["version"] == 1 and not list((tmp_path / "out").glob("*.mask"))
    data = PackedDataset(prepared_stream(tmp_path / "out", m, "train"), 8)
    assert data.stream.masks is None and data.targets_in(np.arange(len(data))) == m["splits"]["train"]["tokens"] - 1
    with pytest.raises(DataError, match="newer than this fivefold reads"):
        (tmp_path / "out" / "manifest.json").write_text(json.dumps({**m, "version": 3}))
        read_manifest(tmp_path / "out")
