"""The worked path of docs/fine-tuning.md, end to end through the CLI: a Qwen3 model saved by transformers
with its tokenizer and chat template is converted, fine-tuned on chats at tp2 x dp2 (with sp), exported,
and loaded back by transformers, whose logits are those of the run's last checkpoint."""

import json
import os
import subprocess
import sys

import torch
from helpers import ROOT

from fivefold.checkpoint.convert import DCPSource
from fivefold.checkpoint.weights import source_name
from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.train.metrics import read_metrics

# Qwen/Qwen3-0.6B's structural keys (per-head q/k norms, head_dim 128 apart from 1024 / 16 heads, grouped
# kv heads, tied embeddings, rope_theta 1e6) at toy width; std 0.2, so that logits are of order 1 and a
# wrong mapping shows.
QWEN3 = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=24, vocab_size=384, tie_word_embeddings=True, rope_theta=1e6, initializer_range=0.2)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's: document end, turn start, turn end
# ChatML as Qwen3 writes it (written here, not copied): the answers after the last user turn carry an
# empty reasoning block, so an earlier turn renders otherwise once later ones exist: single-turn records.
TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
QUESTIONS = ["What is two plus two?", "Name a primary colour.", "Which is larger, ten or three?",
             "What comes after Monday?", "Is ice cold?", "How many legs has a cat?"]
ANSWERS = ["Four.", "Red.", "Ten is larger.", "Tuesday.", "Yes, ice is cold.", "A cat has four legs."]
CHATS = [[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": q},
          {"role": "assistant", "content": a}] for q, a in zip(QUESTIONS, ANSWERS, strict=True)]
STEPS, SEQ, BATCH = 3, 32, 4


def save_qwen3(hf):
    """A Qwen3ForCausalLM with random weights and a BPE tokenizer with the chat template, both saved by
    transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=340, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([json.dumps(CHATS)] * 10, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(hf)
    assert (hf / "chat_template.jinja").is_file()  # transformers 5's place for it
    torch.manual_seed(0)
    config = Qwen3Config(**QWEN3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # transformers starts norms at 1: random ones, so that a swapped q/k norm shows
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.normal_(1.0, 0.2)
    model.save_pretrained(hf)
    return tok, model


def fivefold_logits(checkpoint, run_config, x):
    """The run checkpoint's model in this process, read tensor by tensor, on x (B, T) -> (B, T, V)."""
    from fivefold.model.transformer import Transformer

    cfg = load_config(run_config)
    model = Transformer(cfg.model)
    source = DCPSource(checkpoint)
    state = {name: source.read(source_name(name, source, cfg.model.tie_embeddings))
             for name in model.state_dict()}
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(x)


def test_qwen3_converted_fine_tuned_at_tp2_dp2_exported_and_loaded_by_transformers(tmp_path, monkeypatch):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    monkeypatch.chdir(tmp_path)  # the docs' relative paths: seeds/, data/, runs/
    tok, original = save_qwen3(tmp_path / "Qwen3-toy")
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))

    assert main(["convert", "Qwen3-toy", "seeds/qwen3", "--to", "fivefold"]) == 0
    assert (tmp_path / "seeds/qwen3/chat_template.jinja").read_text() == TEMPLATE
    assert main(["prepare", "chats.jsonl", "--tokenizer", "seeds/qwen3", "--out", "data/chats",
                 "--val-fraction", "0", "--no-progress"]) == 0
    manifest = json.loads((tmp_path / "data/chats/manifest.json").read_text())["splits"]["train"]
    assert 0 < manifest["trained"] < manifest["tokens"]  # the answers (measured 163 of 330 tokens): prompts untrained

    cmd = [sys.executable, "-m", "fivefold", "train", "seeds/qwen3/fivefold.toml", "--nproc", "4",
           "--parallel.tp=2", "--parallel.dp=2", "--parallel.sp=true", '--data.paths=["data/chats"]',
           "--data.document_mask=true", f"--train.steps={STEPS}", f"--train.global_batch={BATCH}",
           "--train.micro_batch=1", f"--train.seq_len={SEQ}", "--optim.lr=1e-2", "--optim.warmup_steps=1",
           "--run.name=qwen3-chats", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = tmp_path / "runs/qwen3-chats"
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:  # the loss counts trained tokens only: fewer than the batch holds
        assert 0 < r["tokens"] < BATCH * SEQ
    assert records[-1]["loss"] < records[0]["loss"]  # measured 7.16, 5.71, 3.62
    checkpoint = run / f"checkpoints/step_{STEPS:08d}"

    assert main(["convert", str(checkpoint), "hf/qwen3-chats", "--to", "hf"]) == 0
    out = tmp_path / "hf/qwen3-chats"
    theirs = AutoTokenizer.from_pretrained(out)  # the tokenizer and its template came back beside the weights
    chat = CHATS[0][:-1]
    assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids = [theirs.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in CHATS[:2]]
    x = torch.tensor([i[:min(map(len, ids))] for i in ids])  # (2, T)
    exported = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = exported(x).logits  # (2, T, V)
        before = original.eval()(x).logits
    ours = fivefold_logits(checkpoint, run / "config.toml", x)
    # One process, fp32, the same weights: measured bit-equal; a wrong q/k norm or RoPE moves them by O(1).
    torch.testing.assert_close(logits, ours, rtol=0, atol=2e-5)
    assert (logits - before).abs().max() > 1e-2  # the exported weights are the trained ones, not the seed's

    # Exported from elsewhere, where the config's relative data.tokenizer names nothing: the run's own copy.
    monkeypatch.chdir(tmp_path / "runs")
    assert main(["convert", str(checkpoint), str(tmp_path / "elsewhere"), "--to", "hf"]) == 0
    again = AutoTokenizer.from_pretrained(tmp_path / "elsewhere")
    assert [again.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in CHATS[:2]] == ids
