"""A model's chat template, rendered by transformers, and the spans of a chat's assistant turns.

The template is the one transformers reads from a tokenizer directory (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), and `transformers.AutoTokenizer.apply_chat_template`
renders it: the same Jinja environment, special-token variables and filters as at inference, so the
text trained on is the text the model will be prompted with (transformers is an optional extra:
`pip install 'fivefold[hf]'`).

Which characters are an assistant's: for assistant message k, the rendering of messages[:k] with the
generation prompt (what a model sees before it answers) and the rendering of messages[:k+1] must both
be prefixes of the whole chat's rendering; the characters between their ends are the turn: its content
and the end-of-turn marker the template closes it with, i.e. what a model must generate. This works for
any template that renders a chat's prefix as a prefix of the chat, and it is checked per record (a
template that rewrites earlier turns once later ones exist, as Qwen3's drops old reasoning, is refused
for that record by name). transformers' `return_assistant_tokens_mask` would need the template to mark
turns with `{% generation %}`, which the published templates of Llama 3, Mistral, Qwen2.5 and Gemma 3
do not.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fivefold.data.sources import DataError


def _one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


@functools.lru_cache(maxsize=2)
def _hf_tokenizer(folder: str):
    """transformers' tokenizer of a directory (one load per process)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("chat records need transformers to render the model's chat template; pip install "
                        "'fivefold[hf]' (or transformers)") from None
    return AutoTokenizer.from_pretrained(folder)


def has_template(folder: Path) -> bool:
    """Whether the tokenizer directory names a chat template (where transformers looks)."""
    import json

    if (folder / "chat_template.jinja").is_file():
        return True
    config = folder / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def render(folder: Path, messages: list[dict], name: str, add_generation_prompt: bool = False) -> str:
    """The chat as text, by the directory's template; a failure names the record in one line."""
    if not has_template(folder):
        raise DataError(f"{name}: a chat record needs the model's chat template, and the tokenizer has none; give "
                        f"--tokenizer (data.tokenizer) the model's directory, with chat_template.jinja or "
                        f"tokenizer_config.json's chat_template")
    tok = _hf_tokenizer(str(folder))
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja2's TemplateError, or what the template raises (raise_exception)
        raise DataError(f"{name}: the chat template failed to render this record ({_one_line(e)}); fix the record's "
                        f"messages or the template") from None


def assistant_spans(folder: Path, messages: list[dict], name: str) -> tuple[str, list[tuple[int, int]]]:
    """(the chat's text, the [start, end) character spans of its assistant turns)."""
    text = render(folder, messages, name)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(folder, messages[:k], name, add_generation_prompt=True)
        through = render(folder, messages[: k + 1], name)
        if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
            raise DataError(f"{name}: the chat template renders messages[:{k}] as other than the start of the whole "
                            f"chat, so assistant turn {k} cannot be located; give the chat up to that turn as its own "
                            f"record, or a template that renders turns in place")
        spans.append((len(before), len(through)))
    return text, spans
