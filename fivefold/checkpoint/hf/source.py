"""A Hugging Face directory read as fivefold's tensors (`HFSource`): `checkpoint.init_from` and
`fivefold convert --to fivefold` read HF weights through it, each box of a tensor alone."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fivefold.checkpoint.dequant import DequantizedFiles, dequantizing
from fivefold.checkpoint.hf.family import NOT_WEIGHTS, HFFormatError, is_stacked
from fivefold.checkpoint.hf.registry import DTYPE_NAMES, family_of, model_config_from_hf
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.model.transformer import Transformer

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def source_main(name: str, tied: bool) -> str:
    """The fivefold tensor a main one is stored as: a tied head is the embedding."""
    return "tok_embeddings.weight" if tied and name == "output.weight" else name


class HFSource:
    """A Hugging Face directory seen as fivefold's tensors (names, shapes, slices): the
    WeightSource `checkpoint/weights.py` loads from, and what `fivefold convert --to fivefold` writes.
    A tensor of the directory that no fivefold tensor reads is refused (the first ten named) here,
    before anything is read or written; missing ones are for the caller's fit check, with their shapes.
    Quantized weights (config.json quantization_config) are read dequantized to `dtype` (default: the
    config's torch_dtype), through checkpoint/dequant.py. `notes`: what the reading changes or leaves
    out (dequantized tensors, MTP layers), one line each, for the user to be told."""

    def __init__(self, path: Path, field: str = "", dtype: torch.dtype | None = None):
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
        self.dtype_asked = dtype or DTYPES.get(self.hf_config.get("torch_dtype", self.hf_config.get("dtype")),
                                               torch.bfloat16)
        self.files = dequantizing(SafetensorsDir(path, field), self.hf_config, self.dtype_asked, str(config))
        self.notes: list[str] = []
        have = self.files.names()
        m = self.model_cfg
        if m.mtp_layers and not any(n.startswith(f"model.layers.{m.n_layers}.") for n in have):
            # transformers' DeepseekV3Config says 1 unless told otherwise, and save_pretrained writes it without
            # any MTP weights (transformers has no MTP module): the model is read as what the weights hold
            self.notes.append(f"config.json says num_nextn_predict_layers = {m.mtp_layers} but the weights hold no "
                              f"model.layers.{m.n_layers}.*: read without multi-token prediction (mtp_layers = 0)")
            self.model_cfg = m = dataclasses.replace(m, mtp_layers=0)
        with torch.device("meta"):
            model = Transformer(m)
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        parts = {k: self.family.hf_names(k, self.model_cfg) for k in self.shapes}
        self._names = frozenset(k for k, names in parts.items() if all(n in have for n in names))
        read = {n for names in parts.values() for n in names}
        if self.model_cfg.tie_embeddings:  # a stored copy of the tied head (Qwen3-0.6B): transformers ties it anyway
            read.add(self.family.top["output.weight"])
        # The MTP depths' copies of the embedding and head (DeepSeek-V3): the main ones are read, these only
        # checked against them (copy_problems)
        self.copies = [(hf, main) for hf, main in self.family.copies(m) if hf in have]
        read |= {hf for hf, _ in self.copies}
        if isinstance(self.files, DequantizedFiles):
            count = len(read & (self.files.fp8 | self.files.mx))
            what = (f"fp8 tensors ({self.files.block[0]} x {self.files.block[1]} block scales)" if self.files.fp8
                    else "MXFP4 tensors (blocks of 32 with a shared scale)")
            self.notes.append(f"dequantized {count} {what} to {str(self.dtype_asked).removeprefix('torch.')}")
        if m.mtp_layers:
            last = m.n_layers + m.mtp_layers - 1
            layers = f"model.layers.{m.n_layers}.*" + (f" .. model.layers.{last}.*" if m.mtp_layers > 1 else "")
            depths = "mtp.0" + (f" .. mtp.{m.mtp_layers - 1}" if m.mtp_layers > 1 else "")
            self.notes.append(f"read {layers} as multi-token prediction ({depths}); its {len(self.copies)} stored "
                              f"copies of the embedding and head kept once")
        extra = sorted(n for n in have - read if not NOT_WEIGHTS.match(n))
        if extra:
            more = f" and {len(extra) - 10} more" if len(extra) > 10 else ""
            raise HFFormatError(f"{path}: tensors that {self.family.architecture} as fivefold reads it "
                                f"({config.name}) has no place for: {', '.join(extra[:10])}{more}")

    def copy_problems(self, rows: int = 4096) -> list[str]:
        """Each MTP depth's stored copy of the embedding or head that is not the main model's, bit for bit
        (fivefold keeps one of each: DeepSeek's README_WEIGHTS.md says they are shared), one line each.
        Reads both, `rows` rows at a time."""
        problems = []
        for hf, main in self.copies:
            found = self.family.hf_names(source_main(main, self.model_cfg.tie_embeddings), self.model_cfg)[0]
            shape = self.files.shape(found)
            if self.files.shape(hf) != shape or self.files.dtype(hf) != self.files.dtype(found):
                problems.append(f"{hf} {tuple(self.files.shape(hf))} {self.files.dtype(hf)} is not a copy of {found} "
                                f"{tuple(shape)} {self.files.dtype(found)}")
                continue
            for start in range(0, shape[0], rows):
                box = (slice(start, min(start + rows, shape[0])), *(slice(0, n) for n in shape[1:]))
                if not torch.equal(self.files.read(hf, box), self.files.read(found, box)):
                    problems.append(f"{hf} differs from {found} (first in rows {start}..{box[0].stop - 1}): fivefold "
                                    f"shares the main model's embedding and head with the MTP layers, as DeepSeek-V3 "
                                    f"does; give a checkpoint whose copies are equal")
                    break
        return problems

    def names(self) -> frozenset[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        parts = self.family.hf_names(name, self.model_cfg)
        fused = self.family.fused_part(name)
        if fused is not None:
            *lead, last = self.files.shape(parts[0])
            return (*lead, (last - fused[0] + fused[1] - 1) // fused[1])
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
        fused = self.family.fused_part(name)
        if fused is not None:  # HF's [..., start::step]: its columns from the first to the last wanted
            *lead, cols = index or tuple(slice(0, n) for n in self.shape(name))
            start, step = fused
            if cols.stop <= cols.start:
                return torch.empty([max(0, s.stop - s.start) for s in (*lead, cols)], dtype=self.dtype(name))
            span = slice(start + cols.start * step, start + (cols.stop - 1) * step + 1)
            return self.files.read(parts[0], (*lead, span))[..., ::step].contiguous()
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
