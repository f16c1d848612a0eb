"""A model's tokenizer through `fivefold convert` both ways: a SentencePiece-only tokenizer.model and
every chat template (chat_template.jinja, additional_chat_templates/) reach the seed directory and come
back beside the exported weights, where transformers reads them as it read the original."""

import json

import torch
from helpers import sentencepiece_model

from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.data.tokenizer import load_tokenizer

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}</s>{% endfor %}"
TOOL_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}"
WORDS = "the quick brown fox jumps over a lazy dog while seven zebras sing".split()  # the SentencePiece corpus
TEXTS = ["the quick brown fox", "a lazy dog, déjà vu 42", ""]


def test_sentencepiece_model_and_chat_templates_come_along_both_ways(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    monkeypatch.chdir(tmp_path)
    hf = tmp_path / "Llama-2-toy"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=320)).save_pretrained(hf)
    (hf / "tokenizer.model").write_bytes(sentencepiece_model(WORDS, 320))  # no tokenizer.json: converted when read
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (hf / "chat_template.jinja").write_text(TEMPLATE)
    (hf / "additional_chat_templates").mkdir()
    (hf / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    files = ["tokenizer.model", "tokenizer_config.json", "chat_template.jinja",
             "additional_chat_templates/tool_use.jinja"]
    original = AutoTokenizer.from_pretrained(hf)

    assert main(["convert", "Llama-2-toy", "seed", "--to", "fivefold"]) == 0
    for name in files:
        assert (tmp_path / "seed" / name).read_bytes() == (hf / name).read_bytes(), name
    cfg = load_config(tmp_path / "seed" / "fivefold.toml")
    assert cfg.data.tokenizer == "seed"  # training on it feeds the model transformers' ids
    assert [load_tokenizer(cfg.data.tokenizer).encode(t) for t in TEXTS] == [original(t)["input_ids"] for t in TEXTS]

    assert main(["convert", "seed", "out", "--to", "hf"]) == 0
    for name in files:
        assert (tmp_path / "out" / name).read_bytes() == (hf / name).read_bytes(), name
    back = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert [back(t)["input_ids"] for t in TEXTS] == [original(t)["input_ids"] for t in TEXTS]
    chat = [{"role": "user", "content": "hi"}]
    for name in (None, "tool_use"):
        assert back.apply_chat_template(chat, chat_template=back.get_chat_template(name), tokenize=False) == \
            original.apply_chat_template(chat, chat_template=original.get_chat_template(name), tokenize=False)
    assert LlamaForCausalLM.from_pretrained(tmp_path / "out") is not None
