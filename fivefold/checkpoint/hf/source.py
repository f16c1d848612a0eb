"""A Hugging Face directory read as fivefold's tensors (`HFSource`): `checkpoint.init_from` and
`fivefold convert --to fivefold` read HF weights through it, each box of a tensor alone."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fivefold.checkpoint.hf.family import NOT_WEIGHTS, HFFormatError, is_stacked
from fivefold.checkpoint.hf.registry import family_of, model_config_from_hf
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.model.transformer import Transformer


class HFSource:
    """A Hugging Face directory seen as fivefold's tensors (names, shapes, slices): the
    WeightSource `checkpoint/weights.py` loads from, and what `fivefold convert --to fivefold` writes.
    A tensor of the directory that no fivefold tensor reads is refused (the first ten named) here,
    before anything is read or written; missing ones are for the caller's fit check, with their shapes."""

    def __init__(self, path: Path, field: str = ""):
        config = path / "config.json"
        if not path.is_dir():
            raise HFFormatError(f"{path} is not a directory: give a Hugging Face model directory (config.json and "
                                f"*.safetensors)")
        try:
            self.hf_config = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise HFFormatError(f"{config}: not readable JSON ({e})") from None
        self.model_cfg = model_config_from_hf(self.hf_config, str(config))
        self.family = family_of(self.hf_config)
        self.files = SafetensorsDir(path, field)
        with torch.device("meta"):
            model = Transformer(self.model_cfg)
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        have = self.files.names()
        parts = {k: self.family.hf_names(k, self.model_cfg) for k in self.shapes}
        self._names = frozenset(k for k, names in parts.items() if all(n in have for n in names))
        read = {n for names in parts.values() for n in names}
        if self.model_cfg.tie_embeddings:  # a stored copy of the tied head (Qwen3-0.6B): transformers ties it anyway
            read.add(self.family.top["output.weight"])
        extra = sorted(n for n in have - read if not NOT_WEIGHTS.match(n) and not self.family.skips(n, self.hf_config))
        if extra:
            more = f" and {len(extra) - 10} more" if len(extra) > 10 else ""
            raise HFFormatError(f"{path}: tensors that {self.family.architecture} as fivefold reads it "
                                f"({config.name}) has no place for: {', '.join(extra[:10])}{more}")

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        parts = self.family.hf_names(name, self.model_cfg)
        if not is_stacked(name):
            return self.files.shape(parts[0])
        out_features, in_features = self.files.shape(parts[0])
        return (len(parts), in_features, out_features)

    def dtype(self, name: str) -> torch.dtype:
        return self.files.dtype(self.family.hf_names(name, self.model_cfg)[0])

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """A box of fivefold's tensor `name`; for stacked experts (E, in, out), each expert's box
        is read from HF's (out, in) weight and transposed; for reordered rows (Family.rows), the HF rows
        spanning the box's are read and picked from."""
        parts = self.family.hf_names(name, self.model_cfg)
        if not is_stacked(name):
            order = self.family.rows(name, self.model_cfg, self.hf_config)
            if order is None:
                return self.files.read(parts[0], index)
            rows, *cols = index or tuple(slice(0, n) for n in self.shape(name))
            wanted = order[rows]  # (R,) HF rows of the box: the reordering stays inside each head
            if wanted.numel() == 0:
                return torch.empty(0, *[s.stop - s.start for s in cols], dtype=self.dtype(name))
            low = int(wanted.min())
            return self.files.read(parts[0], (slice(low, int(wanted.max()) + 1), *cols))[wanted - low]  # (R, ...)
        experts, rows, cols = index or tuple(slice(0, n) for n in self.shape(name))
        if min(s.stop - s.start for s in (experts, rows, cols)) <= 0:  # an empty shard (ZeRO-3 with E < dp)
            return torch.empty([max(0, s.stop - s.start) for s in (experts, rows, cols)], dtype=self.dtype(name))
        boxes = [self.files.read(parts[e], (cols, rows))  # (cols, rows) each
                 for e in range(experts.start, experts.stop)]
        return torch.stack([box.T for box in boxes])  # (E', rows, cols)

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        out.copy_(self.read(name, index))
