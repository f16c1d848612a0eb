"""Documents from the files a user names: text, .jsonl / .jsonl.gz records, .parquet rows.

One order for everything: the paths as given, a folder's files sorted (hidden ones skipped), a file's
records in file order. Each document has a name, stable when the corpus grows or shrinks: the file's
path, or `path:line` (jsonl, 1-based) / `path:row` (parquet, 0-based); the validation split hashes it.

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
    text: str | bytes  # bytes for text files (the byte tokenizer keeps them exact), str for records


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


def _record_text(record: object, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        keys = ", ".join(map(str, record)) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where}: no field '{text_field}' (has: {keys}); name the text field with --text-field "
                        f"(prepare) or data.text_field")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field '{text_field}' is {type(text).__name__}, not a string")
    return text


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
                yield Document(where, _record_text(record, text_field, where))
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
            size = len(doc.text)
            if max_bytes and total + size > max_bytes:
                doc = Document(doc.name, doc.text[: max_bytes - total])
                size = len(doc.text)
            yield doc
            total += size
            if max_bytes and total >= max_bytes:
                return
