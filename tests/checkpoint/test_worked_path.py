"""The worked paths of docs/fine-tuning.md, end to end through the CLI: a Qwen3 model saved by transformers
with its tokenizer and chat template is converted and its chats prepared (once, for both); then fine-tuned at
tp2 x dp2 (with sp), exported and loaded back by transformers, or given LoRA adapters at the same layout,
exported in PEFT's format and loaded by PeftModel over the saved model itself; either way the logits are those
of the run's last checkpoint."""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT

from fivefold.checkpoint.convert import DCPSource
from fivefold.checkpoint.weights import source_name
from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.model.lora import apply_lora
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
LORA_STEPS = 2  # enough for B (zero at the start) to have trained, and for one loss to follow another
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # [lora]'s default


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
    """The run checkpoint's model (with its adapters, for a LoRA run) in this process, read tensor by tensor,
    on x (B, T) -> (B, T, V)."""
    from fivefold.model.transformer import Transformer

    cfg = load_config(run_config)
    model = Transformer(cfg.model)
    if cfg.lora.rank:
        apply_lora(model, cfg.lora)
    source = DCPSource(checkpoint)
    state = {name: source.read(source_name(name, source, cfg.model.tie_embeddings))
             for name in model.state_dict()}
    model.load_state_dict(state)
    with torch.no_grad():
        return model.eval()(x)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The docs' first commands, once for both paths, in a folder the tests run in (the docs' relative
    paths): the toy Qwen3 saved by transformers as a downloaded model would be, converted, its chats prepared."""
    root = tmp_path_factory.mktemp("worked")
    tok, original = save_qwen3(root / "Qwen3-toy")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        assert main(["convert", "Qwen3-toy", "seeds/qwen3", "--to", "fivefold"]) == 0
        assert main(["prepare", "chats.jsonl", "--tokenizer", "seeds/qwen3", "--out", "data/chats",
                     "--val-fraction", "0", "--no-progress"]) == 0
    return dict(root=root, tok=tok, original=original)


def train(root, name, steps, *flags):
    """The docs' `fivefold train` at tp2 x dp2 with sp, at toy size, in its own processes: the run's folder and
    its metrics."""
    cmd = [sys.executable, "-m", "fivefold", "train", "seeds/qwen3/fivefold.toml", "--nproc", "4",
           "--parallel.tp=2", "--parallel.dp=2", "--parallel.sp=true", '--data.paths=["data/chats"]',
           "--data.document_mask=true", f"--train.steps={steps}", f"--train.global_batch={BATCH}",
           "--train.micro_batch=1", f"--train.seq_len={SEQ}", "--optim.lr=1e-2", "--optim.warmup_steps=1",
           *flags, f"--run.name={name}", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = root / "runs" / name
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:  # the loss counts trained tokens only: fewer than the batch holds
        assert 0 < r["tokens"] < BATCH * SEQ
    return run, records


def chat_batch(tok):
    """The first two chats' ids by the tokenizer's template, and as a batch cut to the shorter: (2, T)."""
    ids = [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in CHATS[:2]]
    return ids, torch.tensor([i[:min(map(len, ids))] for i in ids])


def test_qwen3_converted_fine_tuned_at_tp2_dp2_exported_and_loaded_by_transformers(hub, monkeypatch):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    tmp_path, tok, original = hub["root"], hub["tok"], hub["original"]
    monkeypatch.chdir(tmp_path)  # the docs' relative paths: seeds/, data/, runs/
    assert (tmp_path / "seeds/qwen3/chat_template.jinja").read_text() == TEMPLATE
    manifest = json.loads((tmp_path / "data/chats/manifest.json").read_text())["splits"]["train"]
    assert 0 < manifest["trained"] < manifest["tokens"]  # the answers (measured 163 of 330 tokens): prompts untrained

    run, records = train(tmp_path, "qwen3-chats", STEPS)
    assert records[-1]["loss"] < records[0]["loss"]  # measured 7.16, 5.71, 3.62
    checkpoint = run / f"checkpoints/step_{STEPS:08d}"

    assert main(["convert", str(checkpoint), "hf/qwen3-chats", "--to", "hf"]) == 0
    out = tmp_path / "hf/qwen3-chats"
    theirs = AutoTokenizer.from_pretrained(out)  # the tokenizer and its template came back beside the weights
    chat = CHATS[0][:-1]
    assert theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    ids, x = chat_batch(theirs)  # x: (2, T)
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
    assert chat_batch(again)[0] == ids


def test_qwen3_lora_at_tp2_dp2_loaded_by_peft_over_the_downloaded_model(hub, monkeypatch):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    root = hub["root"]
    monkeypatch.chdir(root)
    run, records = train(root, "qwen3-chats-lora", LORA_STEPS, "--lora.rank=16", "--lora.alpha=32")
    assert records[-1]["loss"] < records[0]["loss"]  # measured 7.16 (the base's: B is zero), 6.55
    checkpoint = run / f"checkpoints/step_{LORA_STEPS:08d}"
    assert main(["convert", str(checkpoint), "peft/qwen3-chats-lora", "--to", "peft"]) == 0
    config = json.loads((root / "peft/qwen3-chats-lora/adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (16, 32.0, sorted(TARGETS))
    adapters = load_file(root / "peft/qwen3-chats-lora/adapter_model.safetensors")
    bs = {k: v for k, v in adapters.items() if k.endswith("lora_B.weight")}
    assert len(bs) == len(TARGETS) * QWEN3["num_hidden_layers"]
    # every B started at zero; each one moved as Adam moves a weight at lr 1e-2 (measured 0.020 at least)
    assert all(b.abs().max() > 1e-3 for b in bs.values())

    # The base stays frozen, so the downloaded directory is PEFT's base: the run's base, exported, is its
    # weights bit for bit (the docs load the adapter over Qwen3-0.6B/ itself).
    assert main(["convert", str(checkpoint), "hf/qwen3-chats-lora-base", "--to", "hf"]) == 0
    downloaded = load_file(root / "Qwen3-toy/model.safetensors")
    exported = {k: v for f in sorted((root / "hf/qwen3-chats-lora-base").glob("*.safetensors"))
                for k, v in load_file(f).items()}
    assert sorted(exported) == sorted(downloaded)
    assert all(torch.equal(exported[k], v) for k, v in downloaded.items())

    # The docs' python: PeftModel over the downloaded model, and a chat's answer generated
    tok = AutoTokenizer.from_pretrained("Qwen3-toy")
    base = Qwen3ForCausalLM.from_pretrained("Qwen3-toy", dtype=torch.float32).eval()
    _, x = chat_batch(tok)  # (2, T)
    with torch.no_grad():
        plain = base(x).logits  # (2, T, V), before PeftModel wraps base's layers
        model = PeftModel.from_pretrained(base, "peft/qwen3-chats-lora").eval()
        theirs = model(x).logits
    ours = fivefold_logits(checkpoint, run / "config.toml", x)
    # One process, fp32, the same weights, x W^T + s (x A^T) B^T both ways: measured bit-equal (test_peft.py's
    # bound); alpha 16 in adapter_config.json in place of 32 moved them by 3.3, on logits up to 6.7.
    torch.testing.assert_close(theirs, ours, rtol=0, atol=2e-5)
    assert (theirs - plain).abs().max() > 1e-2  # the adapters move the logits (measured 6.4)
    chat = tok.apply_chat_template(CHATS[0][:-1], add_generation_prompt=True, enable_thinking=False,
                                   return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=4, do_sample=False)  # (1, T + up to 4)
    assert chat["input_ids"].shape[1] < out.shape[1] <= chat["input_ids"].shape[1] + 4
