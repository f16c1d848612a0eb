"""Tokenizers: bytes, a byte-level BPE trained here, or a Hugging Face tokenizer.

Every tokenizer has `vocab_size` (the ids it can emit), `eod` (the id that ends a document in a packed
stream), `encode(text) -> list[int]`, `decode(ids) -> str`, `files()` (what reproduces it: written into a
prepared dataset and a run directory) and `hash` (sha256 of those files: a prepared dataset's manifest
carries it, so a dataset is never read with another tokenizer than the one that made it).

A Hugging Face tokenizer is a `tokenizer.json` (the `tokenizers` package's format), or a directory as
`transformers` saves one: its `tokenizer.json` and `tokenizer_config.json`. The special tokens a text gets
are those its `tokenizer.json` post-processor adds (Llama 3: BOS; a TemplateProcessing "<s> $A </s>": BOS
and EOS), which is what `transformers.AutoTokenizer` gives (transformers 5 applies the post-processor and
does not read `add_bos_token` for tokenizer.json-backed tokenizers). A directory with a SentencePiece
`tokenizer.model` and no tokenizer.json is converted by transformers (convert_sentencepiece). The directory's
chat template (`chat_template.jinja`; tokenizer_config.json's `chat_template` comes with that file) is
kept with the tokenizer's files for chat records (chat.py). The document end is the EOS token
named by `tokenizer_config.json` (`eos_token`), else one of the usual names found in the vocabulary;
packing appends it to a document that does not already end with it (fivefold/data/prepare.py).
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np

# What converting a SentencePiece tokenizer.model needs: module -> package (the `hf` extra).
SENTENCEPIECE_EXTRAS = {"transformers": "transformers", "sentencepiece": "sentencepiece", "google.protobuf": "protobuf"}
EOD_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eod|>", "<|im_end|>")  # when no config names one


class TokenizerError(ValueError):
    """A tokenizer file or directory that cannot be used; the message names it and the fix."""


class Tokenizer(Protocol):
    kind: str  # "byte" or "hf" (a trained BPE is a Hugging Face tokenizer.json)
    vocab_size: int
    eod: int

    def encode(self, text: str | bytes) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def files(self) -> dict[str, bytes]: ...


def files_hash(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    return h.hexdigest()


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 ends a document."""

    kind = "byte"
    vocab_size = 257
    eod = 256

    def encode(self, text: str | bytes) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8).tolist()

    def encode_array(self, text: str | bytes) -> np.ndarray:
        data = text.encode() if isinstance(text, str) else text
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def files(self) -> dict[str, bytes]:
        return {"byte.json": b'{"kind": "byte", "vocab_size": 257, "eod": 256}\n'}


def _token_content(value: object) -> str | None:
    """A tokenizer_config.json special token: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """A `tokenizers` tokenizer.json, with tokenizer_config.json's special tokens when given."""

    kind = "hf"

    def __init__(self, json_bytes: bytes, config_bytes: bytes | None = None, where: str = "tokenizer.json",
                 template: bytes | None = None):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.tok = RustTokenizer.from_str(json_bytes.decode())
        except Exception as e:  # the tokenizers package raises its own Exception type
            raise TokenizerError(f"{where}: not a tokenizer.json the tokenizers package reads ({e}); give a "
                                 f"Hugging Face tokenizer.json or its directory") from None
        self.config: dict = {}
        if config_bytes is not None:
            try:
                self.config = json.loads(config_bytes)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{Path(where).parent / 'tokenizer_config.json'}: not valid JSON ({e})") from None
        self._json, self._config_bytes, self._template = json_bytes, config_bytes, template
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos = self._id(_token_content(self.config.get("bos_token")))
        self.eod = self._eod(where)

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tok.token_to_id(token)

    def _eod(self, where: str) -> int:
        named = _token_content(self.config.get("eos_token"))
        if named is not None:
            if self._id(named) is None:
                raise TokenizerError(f"{where}: tokenizer_config.json's eos_token {named!r} is not in the vocabulary")
            return self._id(named)
        for name in EOD_NAMES:
            if self._id(name) is not None:
                return self._id(name)
        raise TokenizerError(f"{where}: no end-of-document token (no eos_token in tokenizer_config.json and none of "
                             f"{', '.join(EOD_NAMES)} in the vocabulary); add an eos_token to tokenizer_config.json")

    @classmethod
    def from_path(cls, path: Path) -> HFTokenizer:
        """A tokenizer.json file, or a directory holding one or a SentencePiece tokenizer.model (and maybe
        tokenizer_config.json, chat_template.jinja)."""
        file = path / "tokenizer.json" if path.is_dir() else path
        if path.is_dir() and not file.is_file() and (path / "tokenizer.model").is_file():
            json_bytes = convert_sentencepiece(path)
        elif not file.is_file():
            raise TokenizerError(f"data.tokenizer: '{path}' holds no tokenizer.json or tokenizer.model; give a "
                                 f"Hugging Face tokenizer.json or the directory transformers saved it in, or 'byte' / "
                                 f"'bpe'")
        else:
            json_bytes = file.read_bytes()
        config, template = file.with_name("tokenizer_config.json"), file.with_name("chat_template.jinja")
        return cls(json_bytes, config.read_bytes() if config.is_file() else None, str(file),
                   template.read_bytes() if template.is_file() else None)

    def encode(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tok.encode(text).ids  # add_special_tokens: the post-processor's BOS / EOS

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def files(self) -> dict[str, bytes]:
        out = {"tokenizer.json": self._json}
        if self._config_bytes is not None:
            out["tokenizer_config.json"] = self._config_bytes
        if self._template is not None:
            out["chat_template.jinja"] = self._template
        return out


def missing_extras() -> list[str]:
    """The packages converting a tokenizer.model needs that do not import here."""
    missing = []
    for module, package in SENTENCEPIECE_EXTRAS.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def convert_sentencepiece(folder: Path) -> bytes:
    """The tokenizer.json transformers builds from `folder`'s SentencePiece tokenizer.model (Llama 2, Mistral,
    Gemma): `AutoTokenizer` converts it, the tokenizer class its tokenizer_config.json or config.json names
    choosing the normalizer, pre-tokenizer and special tokens, and that tokenizer's own tokenizer.json is
    kept, so the ids are transformers' ids."""
    missing = missing_extras()
    if missing:
        raise TokenizerError(f"{folder / 'tokenizer.model'}: converting a SentencePiece model needs "
                             f"{', '.join(missing)}; pip install 'fivefold[hf]' (or: pip install {' '.join(missing)})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # a damaged model: sentencepiece and protobuf raise their own types
        raise TokenizerError(f"{folder / 'tokenizer.model'}: transformers could not convert it "
                             f"({' '.join(str(e).split())}); give a SentencePiece model or a tokenizer.json") from None
    return tok.backend_tokenizer.to_str().encode()


def train_bpe(texts, vocab_size: int) -> HFTokenizer:
    """A byte-level BPE trained here with the `tokenizers` package; `<|eod|>` (id 0) ends a document."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eod|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((t.decode("utf-8", errors="replace") if isinstance(t, bytes) else t for t in texts),
                            trainer=trainer)
    return HFTokenizer(tok.to_str().encode())


def load_tokenizer(spec: str | Path) -> ByteTokenizer | HFTokenizer:
    """"byte", a tokenizer.json, or a directory: a Hugging Face one, or one written by files() (byte.json)."""
    if str(spec) == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if (path / "byte.json").is_file() or path.name == "byte.json":
        return ByteTokenizer()
    if not path.exists():
        raise TokenizerError(f"data.tokenizer = '{spec}' does not exist; give 'byte', 'bpe', a tokenizer.json or its "
                             f"directory")
    return HFTokenizer.from_path(path)


def save_tokenizer(tokenizer: Tokenizer, folder: Path) -> None:
    """Write the files that reproduce `tokenizer` into `folder` (load_tokenizer(folder) reads them)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in tokenizer.files().items():
        tmp = folder / f".{name}.tmp"
        tmp.write_bytes(data)
        tmp.replace(folder / name)
