"""Documents from the files a user names: text, .jsonl / .jsonl.gz records, .parquet rows.

One order for everything: the paths as given, a folder's files sorted (hidden ones skipped), a file's
records in file order. Each document has a name, stable when the corpus grows or shrinks: the file's
path, or `path:line` (jsonl, 1-based) / `path:row` (parquet, 0-based); the validation split hashes it.

A .jsonl record is text (its `text_field`), or fine-tuning data, told apart by its fields when it has
no text field: `prompt` and `completion` (strings: only the completion is trained), or `messages` (a
chat: a list of {"role", "content"}, rendered by the model's chat template; only the assistant turns
are trained). fivefold/data/records.py tokenizes them and marks the trained tokens.

A file that is neither of the record formats is text, unless it holds a NUL byte in its first 8 kB (a
binary file inside a text folder): those are skipped, counted and named (`Skipped`), never silently.
Prepared datasets and pre-tokenized token files are not documents: fivefold/data/resolve.py tells
them apart before anything is read.
"""

from __future__ import annotations

import gzip
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator


class DataError(ValueError):
    """Input data that cannot be read; the message names the file (and line) and the fix."""


@dataclass
class Document:
    name: str
    text: str | bytes  # bytes for text files (the byte tokenizer keeps them exact), str for records; a
    # prompt/completion record's completion; "" for a chat
    prompt: str | None = None  # a prompt/completion record's prompt (not trained)
    messages: list[dict] | None = None  # a chat record's messages

    @property
    def kind(self) -> str:
        return "chat" if self.messages is not None else "completion" if self.prompt is not None else "text"

    def __len__(self) -> int:
        """Its size in characters (bytes for text files): what units and max_bytes count."""
        if self.messages is not None:
            return sum(len(str(m.get("content") or "")) for m in self.messages)
        return len(self.text) + len(self.prompt or "")


@dataclass
class Skipped:
    """Binary files met inside the inputs, skipped (reported in a warning)."""

    files: list[str] = field(default_factory=list)

    def warning(self) -> str | None:
        if not self.files:
            return None
        shown = ", ".join(self.files[:5]) + (f" and {len(self.files) - 5} more" if len(self.files) > 5 else "")
        return f"skipped {len(self.files)} binary file(s) (a NUL byte in the first 8 kB): {shown}"


def stdlib_sources() -> list[Path]:
    """This Python's standard-library .py files, without site-packages and test suites."""
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # prune: site-packages alone holds ~90% of the files
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def is_jsonl(path: Path) -> bool:
    return path.name.endswith((".jsonl", ".jsonl.gz"))


def is_parquet(path: Path) -> bool:
    return path.suffix == ".parquet"


def path_kind(path: str) -> str:
    p = Path(path)
    if p.is_dir() and (p / "manifest.json").is_file():
        return "prepared"
    if p.suffix in (".bin", ".idx") and p.with_suffix(".idx").is_file() and p.with_suffix(".bin").is_file():
        return "megatron"
    if not p.exists() and Path(f"{path}.idx").is_file() and Path(f"{path}.bin").is_file():
        return "megatron"
    if p.suffix == ".bin" and p.is_file():
        return "nanogpt"
    return "text"


def input_files(paths: list[str] | tuple[str, ...]) -> list[Path]:
    """The files behind the given paths (a folder: its files, sorted, hidden ones skipped); none given:
    the standard-library sources."""
    if not paths:
        return stdlib_sources()
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += [f for f in sorted(p.rglob("*"))
                      if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)]
        else:
            raise DataError(f"data input '{p}' does not exist; give existing files or folders")
    return files


def _string(record: dict, key: str, where: str, fix: str) -> str:
    if key not in record:
        raise DataError(f"{where}: no field '{key}' (has: {', '.join(map(str, record))}); {fix}")
    if not isinstance(record[key], str):
        raise DataError(f"{where}: field '{key}' is {type(record[key]).__name__}, not a string")
    return record[key]


def _messages(record: dict, where: str) -> list[dict]:
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field 'messages' is not a non-empty list; a chat record holds a list of "
                        f"{{\"role\": ..., \"content\": ...}}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise DataError(f"{where}: messages[{i}] has no 'role' string; each message is {{\"role\": ..., "
                            f"\"content\": ...}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no message with role 'assistant', so nothing would be trained; give each chat "
                        f"an assistant turn")
    return messages


def _record(record: object, text_field: str, where: str) -> Document:
    """A record's document: its text field, else a prompt/completion pair, else a chat's messages."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: a {type(record).__name__}, not a JSON object; each line holds one record")
    if text_field not in record and "messages" in record:
        return Document(where, "", messages=_messages(record, where))
    if text_field not in record and ("prompt" in record or "completion" in record):
        fix = "a prompt/completion record needs both as strings"
        return Document(where, _string(record, "completion", where, fix), prompt=_string(record, "prompt", where, fix))
    return Document(where, _string(record, text_field, where, "name the text field with --text-field (prepare) or "
                                   "data.text_field, or give prompt and completion, or messages"))


def _jsonl(path: Path, text_field: str) -> Iterator[Document]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not a JSON object ({e.msg}); each line of a .jsonl file holds one "
                                    f"record") from None
                yield _record(record, text_field, where)
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a damaged .gz, or not UTF-8
        raise DataError(f"{path}: cannot be read as {'gzip ' if path.name.endswith('.gz') else ''}JSON lines "
                        f"({e})") from None


def _parquet(path: Path, text_field: str) -> Iterator[Document]:
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a Parquet file pyarrow reads ({e})") from None
    if text_field not in handle.schema_arrow.names:
        raise DataError(f"{path}: no column '{text_field}' (has: {', '.join(handle.schema_arrow.names)}); name the "
                        f"text column with --text-field (prepare) or data.text_field")
    row = 0
    for batch in handle.iter_batches(columns=[text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield Document(f"{path}:{row}", text)
            row += 1


def documents(files: list[Path], text_field: str = "text", max_bytes: int = 0,
              skipped: Skipped | None = None) -> Iterator[Document]:
    """Every document of the files in order, up to max_bytes of text in all (0: no cap; the last
    one cut there)."""
    total = 0
    for path in files:
        if is_jsonl(path):
            docs = _jsonl(path, text_field)
        elif is_parquet(path):
            docs = _parquet(path, text_field)
        else:
            content = path.read_bytes()
            if b"\0" in content[:8192]:  # binary file inside a text folder
                if skipped is not None:
                    skipped.files.append(str(path))
                continue
            docs = iter([Document(str(path), content)])
        for doc in docs:
            size = len(doc)
            if max_bytes and total + size > max_bytes and doc.kind != "text":
                return  # a record is whole or absent: half a chat or completion trains on a cut answer
            if max_bytes and total + size > max_bytes:
                doc = Document(doc.name, doc.text[: max_bytes - total])
                size = len(doc.text)
            yield doc
            total += size
            if max_bytes and total >= max_bytes:
                return
