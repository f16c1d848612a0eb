"""Fine-tuning records as token ids with a loss mask: which tokens are trained.

mask[t] = 1 when token t is a trained target (the loss counts predicting it), 0 when it is context
only. Per kind of document (sources.py):
- text: every token trained (pre-training, as without a mask);
- prompt/completion: the text `prompt + completion` encoded whole (the tokenizer's own special tokens
  included, as for text), a token trained when its characters reach into the completion (a token that
  straddles the boundary is the completion's: its last characters must be generated);
- chat: the template's rendering (chat.py) encoded without the tokenizer's special tokens (the
  template writes its own, as transformers' apply_chat_template does), a token trained when its
  characters overlap an assistant turn's span (or, with a template's {% generation %} marks, as
  transformers' return_assistant_tokens_mask says).
The end-of-document id that ends each document (appended unless already there) is trained when the
token before it is: after a completion the model learns to stop; after a prompt it learns nothing.
Characters are mapped to tokens by the tokenizer's offsets (the `tokenizers` package's, in characters
of the text), so the ids are exactly the whole text's encoding, never pieces encoded apart.
"""

from __future__ import annotations

import numpy as np

from fivefold.data.chat import ChatTemplate
from fivefold.data.sources import DataError, Document


def _ends(ids: np.ndarray, mask: np.ndarray, eod: int) -> tuple[np.ndarray, np.ndarray]:
    if len(ids) and ids[-1] == eod:
        return ids, mask
    last = mask[-1:] if len(mask) else np.ones(1, np.uint8)
    return np.concatenate([ids, [eod]]), np.concatenate([mask, last]).astype(np.uint8)


def _spans_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]], special: list[int]) -> np.ndarray:
    """1 for each token whose characters overlap a span; a special token added by the post-processor
    (no characters) is trained when a trained token comes before it."""
    mask = np.zeros(len(offsets), np.uint8)
    for t, (a, b) in enumerate(offsets):
        if special[t] and a == b:
            mask[t] = mask[:t].any()
        else:
            mask[t] = any(a < hi and b > lo for lo, hi in spans)
    return mask


def encode_record(tokenizer, doc: Document, chat: ChatTemplate) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) of one document, ending with the end-of-document id; `chat` renders chats."""
    eod = tokenizer.eod
    if doc.kind == "text":
        ids = np.asarray(tokenizer.encode(doc.text), dtype=np.int64)
        return _ends(ids, np.ones(len(ids), np.uint8), eod)
    if tokenizer.kind == "byte":
        if doc.kind == "chat":
            raise DataError(f"{doc.name}: a chat record needs the model's tokenizer and chat template; give "
                            f"--tokenizer (data.tokenizer) the model's directory")
        prompt, completion = doc.prompt.encode(), doc.text.encode()
        ids = np.frombuffer(prompt + completion, dtype=np.uint8).astype(np.int64)
        mask = (np.arange(len(ids)) >= len(prompt)).astype(np.uint8)
        return _ends(ids, mask, eod)
    if doc.kind == "completion":
        text = doc.prompt + doc.text
        enc = tokenizer.tok.encode(text, add_special_tokens=True)
        spans = [(len(doc.prompt), len(text))]
    elif chat.found and chat.marks_turns():  # the template's {% generation %} marks
        enc = tokenizer.tok.encode(chat.render(doc.messages, doc.name), add_special_tokens=False)
        mask = chat.generation_mask(doc.messages, doc.name, enc.ids)
        return _ends(np.asarray(enc.ids, dtype=np.int64), mask, eod)
    else:
        text, spans = chat.assistant_spans(doc.messages, doc.name)
        enc = tokenizer.tok.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int64)
    return _ends(ids, _spans_mask(enc.offsets, spans, enc.special_tokens_mask), eod)
