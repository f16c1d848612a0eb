"""A model's tokenizer files carried through `fivefold convert`, both ways.

`--to fivefold` copies an HF directory's tokenizer into the seed directory (`data.tokenizer` then names
it, so fine-tuning feeds the model its own ids and renders chats with its own template). `--to hf` writes
the tokenizer the run trained with back beside the weights, so that `AutoTokenizer.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` both load the exported directory.

A tokenizer is a `tokenizer.json`, or without one a SentencePiece `tokenizer.model` (Llama 2, Mistral,
Gemma: data/tokenizer.py converts it through transformers when data is prepared, so it is copied as it
is). Its companions are copied when present: transformers 5 saves a chat template as
`chat_template.jinja` and further named ones in `additional_chat_templates/` (older saves keep it in
tokenizer_config.json, which is copied anyway).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZERS = ("tokenizer.json", "tokenizer.model")  # one of them makes a tokenizer
COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "generation_config.json")
TEMPLATES = "chat_template*.jinja"  # chat_template.jinja, and any named beside it
TEMPLATE_DIR = "additional_chat_templates"  # transformers 5: the named templates of a tokenizer with several
TOKENIZER_FILES = TOKENIZERS + COMPANIONS + (TEMPLATES, TEMPLATE_DIR)  # what is copied, as the docs list it


def has_tokenizer(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).is_file() for name in TOKENIZERS)


def copy_hf_tokenizer(src: Path, out: Path) -> bool:
    """Copy the tokenizer of directory `src` (and its chat templates) into `out`, existing files of `out`
    replaced; False, copying nothing, when `src` has neither a tokenizer.json nor a tokenizer.model."""
    if not has_tokenizer(src):
        return False
    out.mkdir(parents=True, exist_ok=True)
    files = [src / name for name in TOKENIZERS + COMPANIONS] + sorted(src.glob(TEMPLATES))
    for path in files:
        if path.is_file():
            shutil.copyfile(path, out / path.name)
    if (src / TEMPLATE_DIR).is_dir():
        shutil.copytree(src / TEMPLATE_DIR, out / TEMPLATE_DIR, dirs_exist_ok=True)
    return True


def trained_tokenizer(src: Path, is_run: bool, data_tokenizer: str) -> Path | None:
    """The directory holding the tokenizer a run checkpoint or seed directory `src` was trained (or is
    to be trained) with, or None: the config's data.tokenizer when it is a directory with a tokenizer (a
    converted seed names itself; a run checks its data against it), else for a run checkpoint
    RUN_DIR/tokenizer (what the run copied from its prepared data), else the seed directory itself."""
    named = Path(data_tokenizer) if data_tokenizer not in ("", "byte", "bpe") else None
    if named is not None and named.is_file():  # a tokenizer.json named by its file: its directory
        named = named.parent if named.name in TOKENIZERS else None
    candidates = ([named] if named is not None else []) + [src.parent.parent / "tokenizer" if is_run else src]
    return next((c for c in candidates if has_tokenizer(c)), None)
