"""Loading a checkpoint never runs code from it.

torch.distributed.checkpoint (torch 2.13) reads two things with pickle that a tampered checkpoint
could use to run code: the `.metadata` file (`FileSystemReader.read_metadata` calls pickle.load)
and every non-tensor item, such as an optimizer's learning rate or betas (`DefaultLoadPlanner
.load_bytes` calls torch.load with weights_only=False). Tensors themselves are already read with
weights_only=True. Here both paths are closed:
- the metadata goes through an unpickler that builds only the classes DCP's metadata is made of
  (listed in ALLOWED, from what torch 2.13 writes) and refuses anything else by name;
- non-tensor items go through torch.load(weights_only=True): numbers, strings, tuples, lists and
  dicts load, anything that needs a class or a function is refused.
A refusal is an UnsafeCheckpointError naming the file and what it tried to load.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [("torch.distributed.checkpoint.metadata", name) for name in _METADATA_CLASSES]
    + [("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
       ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
       ("collections", "OrderedDict")])


class UnsafeCheckpointError(RuntimeError):
    """A checkpoint file holds something other than data; it was not loaded."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in ALLOWED and not is_dtype:
            raise UnsafeCheckpointError(
                f"{self.path}: refusing to load {module}.{name}: checkpoint metadata holds only "
                f"torch.distributed.checkpoint's own classes, so this file was not written by it (or was "
                f"altered); nothing from it was run")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f, str(path)).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: not checkpoint metadata (a {type(metadata).__name__})")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor items read by torch.load(weights_only=True)."""

    def __init__(self, path: Path | str, **kwargs: Any):
        super().__init__(**kwargs)
        self.path = path

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"{self.path}: refusing to load the item '{read_item.dest_index.fqn}': "
                                        f"it is not plain data ({e}); nothing from it was run") from None
        super().load_bytes(read_item, _as_stream(obj))


def _as_stream(obj: Any) -> io.BytesIO:
    """`obj` saved again, for the parent's load_bytes to place (it knows where flattened keys go).
    Its torch.load then reads back only what weights_only=True already accepted."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
