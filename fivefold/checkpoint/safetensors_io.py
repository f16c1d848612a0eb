"""safetensors files: written tensor by tensor (our own writer), read slice by slice (the library).

The format (https://github.com/huggingface/safetensors, README "Format"): an 8-byte little-endian
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
"__metadata__": {str: str}}, then the raw little-endian bytes of every tensor, offsets counted from
the end of the header. Since every shape is known before any value is (a model built on the meta
device, or another file's header), the header is written first and each tensor streamed after it,
so a writer never holds more than the tensor (or the piece of it) being written.

Reading goes through `safetensors.safe_open(...).get_slice(...)`: it maps the file and copies
only the requested slice, and the format holds nothing but data, so no file can run code.
A directory is one `*.safetensors` file, several, or Hugging Face's sharded layout with a
`*.safetensors.index.json` naming the file of each tensor. Pickle-based weights
(`pytorch_model.bin`, `*.pt`) are refused: loading them can run code.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fivefold.progress import progress_bar

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")


class WeightsFileError(ValueError):
    """A weights file or directory that cannot be used; the message names it and the fix."""


class SafetensorsWriter:
    """Write one safetensors file whose tensors are announced up front and then streamed in order.

    specs: name -> (dtype, shape), in the order the tensors will be written. `write(name, piece)`
    appends bytes of `name`: the whole tensor, or consecutive pieces along dim 0, so a stacked
    (E, ...) tensor can be written one expert at a time.
    """

    def __init__(self, path: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":  # the format is little-endian; we copy memory as it is
            raise RuntimeError("writing safetensors needs a little-endian machine")
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        self.sizes: dict[str, int] = {}
        offset = 0
        for name, (dtype, shape) in specs.items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self.sizes[name] = nbytes
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the reference writer pads to 8 bytes so tensor data stays aligned
        self.specs, self.path = specs, path
        self.order = iter(specs)
        self.current: str | None = None
        self.left = 0  # bytes of `current` still to come
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, piece: torch.Tensor) -> None:
        if self.left == 0:  # the previous tensor is complete: `name` must be the next one
            self.current = next(self.order, None)
            self.left = self.sizes.get(self.current, 0) if self.current is not None else 0
            if self.current != name:
                raise ValueError(f"{self.path}: wrote '{name}' where '{self.current}' comes next")
        elif name != self.current:
            raise ValueError(f"{self.path}: '{name}' started before '{self.current}' was complete")
        dtype, shape = self.specs[name]
        if piece.dtype != dtype or (len(shape) > 1 and tuple(piece.shape[1:]) != tuple(shape[1:])):
            raise ValueError(f"{self.path}: '{name}' is {dtype} {tuple(shape)}, "
                             f"got a {piece.dtype} {tuple(piece.shape)} piece")
        data = piece.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # its bytes, no copy when contiguous
        if data.numel() > self.left:
            raise ValueError(f"{self.path}: '{name}' got more than its {self.sizes[name]} bytes")
        self.file.write(memoryview(data.numpy()))
        self.left -= data.numel()

    def close(self) -> None:
        rest = [n for n in self.order] + ([self.current] if self.left else [])
        self.file.close()
        if rest:
            raise ValueError(f"{self.path}: incomplete, '{rest[0]}' was never (fully) written")


def find_safetensors(path: Path, field: str = "") -> list[Path]:
    """The safetensors files of a directory (or the file itself); else a WeightsFileError saying why.
    `field`: the config key the path came from, named in the message."""
    where = f"{field} = '{path}'" if field else f"'{path}'"
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsFileError(f"{where} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise WeightsFileError(f"{where} does not exist: give a directory written by `fivefold init` or "
                               f"`fivefold convert`, or a Hugging Face model directory with safetensors weights")
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if indexes:  # the index names the shards: other safetensors files beside them are not this model
        index = path / "model.safetensors.index.json" if len(indexes) > 1 else indexes[0]
        try:
            files = [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise WeightsFileError(f"{index}: not a readable safetensors index ({type(e).__name__}: {e})") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise WeightsFileError(f"{index} names {missing[0]}, which is not in {path}: the download is incomplete")
        return files
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickled = [p.name for pattern in PICKLED for p in path.glob(pattern)]
    if pickled:
        raise WeightsFileError(
            f"{where} holds {pickled[0]}, a pickle file: fivefold reads weights only from safetensors, since "
            f"unpickling can run code. Convert it once where you trust it, e.g. transformers' "
            f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT) writes safetensors")
    raise WeightsFileError(f"{where} holds no *.safetensors file: give a directory written by `fivefold init` "
                           f"or `fivefold convert`, or a Hugging Face model directory")


def _open(file: Path):
    """safe_open naming the file when its header is damaged (garbage, a huge length, bad offsets, a
    file cut short: the safetensors package reports those without the path)."""
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # SafetensorError, from Rust; OSError for an unreadable file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise WeightsFileError(f"{file}: not a readable safetensors file ({reason}); it is damaged or cut short: "
                               f"write it again (`fivefold init`, `fivefold convert`) or copy it anew") from None


class SafetensorsDir:
    """Every tensor of a directory of safetensors files, readable slice by slice."""

    def __init__(self, path: Path, field: str = ""):
        self.path = path
        files = find_safetensors(path, field)
        self._handles = {f: _open(f) for f in files}
        self.file_of: dict[str, Path] = {}
        for f, handle in self._handles.items():
            for name in handle.keys():
                if name in self.file_of:
                    raise WeightsFileError(f"{path}: tensor '{name}' is in both {self.file_of[name].name} and {f.name}")
                self.file_of[name] = f
        self._names = frozenset(self.file_of)
        self.metadata: dict[str, str] = {}
        for handle in self._handles.values():
            self.metadata.update(handle.metadata() or {})

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _torch_dtype(self._slice(name).get_dtype())

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor `name`, or only its `index` (one slice per dim): nothing else is copied."""
        part = self._slice(name)
        if index is None:
            return self._handles[self.file_of[name]].get_tensor(name)
        if any(s.stop <= s.start for s in index):  # an empty shard (ZeRO with more ranks than rows)
            shape = [s.stop - s.start for s in index]
            return torch.empty([max(0, n) for n in shape], dtype=_torch_dtype(part.get_dtype()))
        return part[index]

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        out.copy_(self.read(name, index))

    def _slice(self, name: str) -> Any:
        if name not in self.file_of:
            raise KeyError(f"{self.path}: no tensor '{name}'")
        return self._handles[self.file_of[name]].get_slice(name)


def _torch_dtype(code: str) -> torch.dtype:
    return {v: k for k, v in DTYPES.items()}[code]


def write_sharded(out: Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...], Any]], max_shard_bytes: int,
                  metadata: dict[str, str] | None = None, progress: bool = True) -> list[Path]:
    """Write tensors [(name, dtype, shape, produce)] into `out` as Hugging Face lays them out:
    `model.safetensors` when they fit in one shard of max_shard_bytes, else
    `model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json`. `produce()` returns the
    tensor (or yields dim-0 pieces of it) only when its turn comes, so one tensor is held at a time."""
    shards: list[list] = [[]]
    size = 0
    for item in tensors:
        nbytes = torch.Size(item[2]).numel() * item[1].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    out.mkdir(parents=True, exist_ok=True)
    total = sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape, _ in tensors)
    with progress_bar(f"writing {out}", total, progress) as advance:
        for file, shard in zip(names, shards, strict=True):
            writer = SafetensorsWriter(out / file, {name: (dtype, shape) for name, dtype, shape, _ in shard}, metadata)
            for name, dtype, shape, produce in shard:
                value = produce()
                for piece in [value] if torch.is_tensor(value) else value:
                    writer.write(name, piece)
                advance(torch.Size(shape).numel() * dtype.itemsize)
            writer.close()
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(names, shards, strict=True) for name, *_ in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return [out / f for f in names]
