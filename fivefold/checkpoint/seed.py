"""Seed checkpoints: a model's initial weights written by one process, one tensor at a time.

At scale no process can build the whole model to initialise it. Here the model is built on the
meta device (shapes, no memory), and each parameter in turn is materialised, given its seeded
initial values (model/seeded_init.py: a pure function of train.seed, its name and its row blocks),
streamed into a safetensors file and dropped. So the peak memory is the largest single tensor, and
the numbers are bit-identical to what a training run of any layout starts from with the same
`train.seed`.

A seed directory holds `model.safetensors` (fivefold's names; a tied head is saved once, as
`tok_embeddings.weight`) and `fivefold.toml`, the resolved config with `checkpoint.init_from`
pointing at the directory: `fivefold train DIR/fivefold.toml` starts from it under any layout.
When the config names a tokenizer file or directory (not "byte", "bpe" that a run trains, or "", the
data's own),
its files are copied in too and `data.tokenizer` points at the directory, as for a converted model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from fivefold.checkpoint.safetensors_io import SafetensorsWriter
from fivefold.config.load import SEED_CONFIG, replace, to_toml
from fivefold.config.schema import Config
from fivefold.data.resolve import resolved_model
from fivefold.data.tokenizer import load_tokenizer, save_tokenizer
from fivefold.model.seeded_init import init_tensor
from fivefold.model.transformer import Transformer
from fivefold.progress import progress_bar

WEIGHTS = "model.safetensors"


def write_seed_config(cfg: Config, out: Path) -> Path:
    """The config that trains from `out`: cfg with checkpoint.init_from = out."""
    path = out / SEED_CONFIG
    path.write_text(to_toml(replace(cfg, checkpoint={"init_from": str(out), "resume": False})))
    return path


def copy_tokenizer(cfg: Config, out: Path) -> Config:
    """Copy the tokenizer cfg names into `out` (its tokenizer.json + tokenizer_config.json, read and
    checked first); return cfg with data.tokenizer = out. "byte", "bpe" and "" have no files to copy."""
    if cfg.data.tokenizer in ("", "byte", "bpe"):
        return cfg
    save_tokenizer(load_tokenizer(cfg.data.tokenizer), out)
    return replace(cfg, data={"tokenizer": str(out)})


@torch.no_grad()
def write_seed_checkpoint(cfg: Config, out: Path, progress: bool = True) -> Path:
    """Write cfg's initial weights into out/model.safetensors (and out/fivefold.toml); return the
    weights file. Holds one parameter at a time."""
    model_cfg = resolved_model(cfg)
    with torch.device("meta"):
        model = Transformer(model_cfg)
    params = list(model.named_parameters())  # a tied matrix appears once
    out.mkdir(parents=True, exist_ok=True)
    seed_cfg = copy_tokenizer(cfg, out)  # first: a tokenizer that cannot be read fails before the weights
    writer = SafetensorsWriter(out / WEIGHTS, {name: (torch.float32, tuple(p.shape)) for name, p in params},
                               metadata={"format": "pt", "fivefold": "seed", "seed": str(cfg.train.seed)})
    with progress_bar(f"initialising {out / WEIGHTS}", sum(p.numel() for _, p in params), progress) as advance:
        for name, p in params:
            value = torch.empty(p.shape, dtype=torch.float32)  # this tensor only, for as long as it is written
            init_tensor(name, value, model_cfg, cfg.train.seed)
            writer.write(name, value)
            del value
            advance(p.numel())
    writer.close()
    write_seed_config(seed_cfg, out)
    return out / WEIGHTS
