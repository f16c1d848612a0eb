"""A model's chat template, rendered by transformers, and the spans of a chat's assistant turns.

The template is the one transformers reads from a tokenizer directory (`chat_template.jinja`, else
`tokenizer_config.json`'s `chat_template`), and `transformers.AutoTokenizer.apply_chat_template`
renders it: the same Jinja environment, special-token variables and filters as at inference, so the
text trained on is the text the model will be prompted with (transformers is an optional extra:
`pip install 'fivefold[hf]'`).

Which tokens are an assistant's, two ways:
- a template that marks the assistant's text with `{% generation %}` ... `{% endgeneration %}`: those
  characters, as transformers' `return_assistant_tokens_mask` marks them (its ids checked against ours);
- any other template: for assistant message k, the rendering of messages[:k] with the generation prompt
  (what a model sees before it answers) and the rendering of messages[:k+1] must both be prefixes of the
  whole chat's rendering; the characters between their ends are the turn: its content and the
  end-of-turn marker the template closes it with, i.e. what a model must generate. Published templates
  (Llama 3, Mistral, Qwen2.5, Gemma 3) have no `{% generation %}`, and this needs nothing of a template
  beyond rendering a chat's prefix as a prefix of the chat; that is checked per record (a template that
  rewrites earlier turns once later ones exist, as Qwen3's drops old reasoning, is refused for that
  record by name, unless it marks its turns).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from fivefold.data.sources import DataError

GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _one_line(e: Exception) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


class ChatTemplate:
    """The chat template of a tokenizer directory, rendered by transformers (loaded at the first chat)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.found = (folder / "chat_template.jinja").is_file() or bool(_config(folder).get("chat_template"))
        self._tok = None

    def _tokenizer(self):
        if self._tok is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise DataError("chat records need transformers to render the model's chat template; pip install "
                                "'fivefold[hf]' (or transformers)") from None
            self._tok = AutoTokenizer.from_pretrained(str(self.folder))
        return self._tok

    def render(self, messages: list[dict], name: str, add_generation_prompt: bool = False) -> str:
        """The chat as text; a failure names the record in one line."""
        if not self.found:
            raise DataError(f"{name}: a chat record needs the model's chat template, and the tokenizer has none; "
                            f"give --tokenizer (data.tokenizer) the model's directory, with chat_template.jinja or "
                            f"tokenizer_config.json's chat_template")
        tok = self._tokenizer()
        try:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja2's TemplateError, or what the template raises (raise_exception)
            raise DataError(f"{name}: the chat template failed to render this record ({_one_line(e)}); fix the "
                            f"record's messages or the template") from None

    def marks_turns(self) -> bool:
        """Whether the template marks the assistant's text with {% generation %}."""
        return bool(GENERATION_TAG.search(self._tokenizer().get_chat_template()))

    def generation_mask(self, messages: list[dict], name: str, ids: list[int]) -> np.ndarray:
        """transformers' return_assistant_tokens_mask for the chat, whose ids must be `ids` (ours)."""
        self.render(messages, name)  # a template that raises is named here, as on the other path
        out = self._tokenizer().apply_chat_template(messages, tokenize=True, return_dict=True,
                                                    return_assistant_tokens_mask=True)
        if list(out["input_ids"]) != list(ids):
            raise DataError(f"{name}: transformers' tokenizer encodes this chat otherwise than the prepared "
                            f"tokenizer.json; give the model's directory as saved by transformers")
        return np.asarray(out["assistant_masks"], dtype=np.uint8)

    def assistant_spans(self, messages: list[dict], name: str) -> tuple[str, list[tuple[int, int]]]:
        """(the chat's text, the [start, end) character spans of its assistant turns)."""
        text = self.render(messages, name)
        spans = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], name, add_generation_prompt=True)
            through = self.render(messages[: k + 1], name)
            if not (text.startswith(before) and text.startswith(through) and len(before) <= len(through)):
                raise DataError(f"{name}: the chat template renders messages[:{k}] as other than the start of the "
                                f"whole chat, so assistant turn {k} cannot be located; give the chat up to that turn "
                                f"as its own record, or a template that renders turns in place")
            spans.append((len(before), len(through)))
        return text, spans


def _config(folder: Path) -> dict:
    import json

    path = folder / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
