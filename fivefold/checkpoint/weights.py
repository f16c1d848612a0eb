"""Start a run from weights on disk (`checkpoint.init_from`), reading only this rank's slices.

The source is a directory of safetensors: a seed checkpoint (`fivefold init`, `fivefold convert
--to fivefold`: fivefold's names and layouts) or a Hugging Face directory (read through the name
and layout mapping of its family, `fivefold/checkpoint/hf/`). Either way it is a WeightSource: names,
whole shapes,
and `read(name, index)` returning one box of a tensor in fivefold's layout.

Which box a rank needs comes from the layout itself: `par.model_state_dict()` describes every
entry this rank holds, a plain tensor (the whole thing: pp stages simply lack other stages' names)
or a DTensor whose global shape and placements say how tp, ep and ZeRO-3 cut it. DTensor's own
`compute_local_shape_and_global_offset` turns that into offsets and lengths, the source reads that
box and nothing else (safetensors maps the file and copies the slice), and
`par.load_model_state_dict` puts the values in place. No rank reads or holds more than its share.
"""

from __future__ import annotations

from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fivefold.checkpoint.hf import HFSource
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.config.load import SEED_CONFIG, read_config
from fivefold.config.schema import Config
from fivefold.data.resolve import resolved_model
from fivefold.model.config import ModelConfig
from fivefold.model.lora import is_adapter
from fivefold.model.transformer import Transformer

if TYPE_CHECKING:
    from fivefold.parallel.parallelize import Parallelized

FIELD = "checkpoint.init_from"
# Model fields (by path in ModelConfig) that change the computation without changing any tensor's shape:
# weights made for another value would load without complaint and compute something else.
SHAPELESS_FIELDS = ("norm.eps", "rope.theta", "norm.qk", "tie_embeddings", "moe.top_k", "moe.router_score",
                    "moe.norm_topk", "moe.n_groups", "moe.topk_groups", "moe.routed_scale", "moe.swiglu_limit",
                    "norm.offset", "norm.weight_fp32", "embed_scale", "activation")


class WeightSource(Protocol):
    def names(self) -> frozenset[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def dtype(self, name: str) -> torch.dtype: ...
    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor: ...
    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None: ...  # read, into out


class WeightsMismatchError(ValueError):
    """The weights do not fit this model; nothing was loaded."""


def open_weights(path: Path, field: str = "") -> tuple[WeightSource, ModelConfig | None]:
    """The weights in `path` as fivefold-named tensors, and the model config they were made for
    (None when the directory does not say). A Hugging Face directory is known by its config.json."""
    if (path / "config.json").is_file():
        source = HFSource(path, field)
        return source, source.model_cfg
    made_for = read_config(path / SEED_CONFIG)[0].model if (path / SEED_CONFIG).is_file() else None
    return SafetensorsDir(path, field), made_for


def source_name(name: str, source: WeightSource, tied: bool) -> str | None:
    """Where `name` is in the source: itself, or for a tied head the embedding (a tied model is
    saved with the shared matrix once); None if absent."""
    if name in source.names():
        return name
    if tied and name == "output.weight" and "tok_embeddings.weight" in source.names():
        return "tok_embeddings.weight"
    return None


def fit_problems(source: WeightSource, expected: dict[str, tuple[int, ...]], optional: set[str],
                 tied: bool) -> list[str]:
    """Every tensor the model needs that the source lacks or holds with another whole shape.
    `optional`: names the model keeps its own values for when absent (buffers such as MoE
    routing biases, which Hugging Face checkpoints do not have)."""
    problems = []
    for name, shape in expected.items():
        found = source_name(name, source, tied)
        if found is None:
            if name not in optional:
                problems.append(f"{name}: not in the weights")
        elif source.shape(found) != tuple(shape):
            problems.append(f"{name}: weights {source.shape(found)}, this model {tuple(shape)}")
    return problems


def config_differences(made_for: ModelConfig, run: ModelConfig) -> list[str]:
    values = [(path, attrgetter(path)(made_for), attrgetter(path)(run)) for path in SHAPELESS_FIELDS]
    return [f"the weights were made for model.{path} = {theirs!r}, this run has {ours!r}"
            for path, theirs, ours in values if theirs != ours]


def _summary(problems: list[str]) -> str:
    shown = "\n  ".join(problems[:10])
    return shown + (f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else "")


def check_init_from(cfg: Config) -> list[str]:
    """Problems with cfg.checkpoint.init_from, found before any process starts: the path, its
    files, every tensor's shape against the model (from the files' headers: no weight is read but
    the MoE routing biases, E numbers a block, and a Hugging Face directory's MTP copies of the
    embedding and head, checked equal to the main ones), and the model fields that shapes cannot show.
    Empty when unset, fine, or not used (resuming)."""
    from fivefold.checkpoint.run_dir import latest_checkpoint, run_dir_of

    if not cfg.checkpoint.init_from or (cfg.checkpoint.resume and latest_checkpoint(run_dir_of(cfg)) is not None):
        return []
    path = Path(cfg.checkpoint.init_from)
    try:
        source, made_for = open_weights(path, FIELD)
    except ValueError as e:  # WeightsFileError, HFFormatError: they name the file and the fix
        return [str(e) if FIELD in str(e) else f"{FIELD} = '{path}': {e}"]
    model_cfg = resolved_model(cfg)
    try:
        with torch.device("meta"):
            model = Transformer(model_cfg)
    except (ValueError, RuntimeError):
        return []  # the model section itself is wrong: validate() says how
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    optional = {k for k, _ in model.named_buffers()}
    problems = config_differences(made_for, model_cfg) if made_for is not None else []
    problems += fit_problems(source, expected, optional, model_cfg.tie_embeddings)
    # The model keeps (loads) its routing bias only when it updates it: weights routing with one would
    # otherwise load without it and choose other experts.
    biased = [n for n in sorted(source.names()) if n.endswith(".expert_bias") and n not in expected
              and source.read(n).any()]
    if biased:
        problems.append(f"{biased[0]} (and {len(biased) - 1} more): the weights route with a bias that "
                        f"model.moe.bias_update = 0 does not keep; set it > 0 (DeepSeek-V3: 0.001)")
    if not problems:  # the MTP layers' copies of the embedding and head, read once here as convert does
        copies = source.copy_problems() if isinstance(source, HFSource) and model_cfg.mtp_layers else []
        return [f"{FIELD} = '{path}': {problem}" for problem in copies]
    return [f"{FIELD} = '{path}' does not fit this config's model section; set model.* to what the weights were "
            f"made with (`fivefold convert --to fivefold` writes it for Hugging Face weights, a seed directory has "
            f"it in {SEED_CONFIG}):\n    " + _summary(problems).replace("\n  ", "\n    ")]


def local_box(value: torch.Tensor) -> tuple[slice, ...]:
    """The slice of the whole tensor that this rank's `value` holds: all of it for a plain tensor,
    else the DTensor's local shape at its global offset (tp, ep and ZeRO-3 cuts alike)."""
    if not isinstance(value, DTensor):
        return tuple(slice(0, n) for n in value.shape)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    if tuple(shape) != tuple(value.to_local().shape):  # the layout and its DTensor description disagree
        raise RuntimeError(f"local shard {tuple(value.to_local().shape)} is not what its DTensor describes "
                           f"({tuple(shape)} at {tuple(offset)}): a sharding its placements do not express")
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def load_weights(path: Path, par: Parallelized, field: str = FIELD, adapters: WeightSource | None = None) -> None:
    """Put the weights in `path` into this rank's part of the model, under any layout.

    `par`: a parallelized model (parallel/parallelize.py). Not a collective: each rank reads its own slices.
    `adapters`: where LoRA's adapters come from (model/lora.py), the rest from `path`.
    Raises WeightsMismatchError, before anything is read, if any tensor is missing or has another whole shape.
    """
    source = open_weights(path, field)[0]
    fill_weights(source if adapters is None else WithAdapters(source, adapters), par, str(path))


class WithAdapters:
    """A base model's weights joined by LoRA adapters from another source: each name read from the one
    that holds it (an adapter's from `adapters`, every other from `base`)."""

    def __init__(self, base: WeightSource, adapters: WeightSource):
        self.base, self.adapters = base, adapters

    def _of(self, name: str) -> WeightSource:
        return self.adapters if is_adapter(name) else self.base

    def names(self) -> frozenset[str]:
        return self.base.names() | {n for n in self.adapters.names() if is_adapter(n)}

    def shape(self, name: str) -> tuple[int, ...]:
        return self._of(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._of(name).dtype(name)

    def read(self, name: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        return self._of(name).read(name, index)

    def read_into(self, name: str, index: tuple[slice, ...], out: torch.Tensor) -> None:
        self._of(name).read_into(name, index, out)


@torch.no_grad()
def fill_weights(source: WeightSource, par: Parallelized, what: str = "the weights") -> None:
    """Write `source`'s values into every tensor of this rank's part of the model: the boxes its
    layout holds (tp, ep and ZeRO-3 slices, its stages' layers), each read alone. How a run starts
    from init_from weights and from the seeded initialisation alike (seeded_init.SeededInit)."""
    state = par.model_state_dict()
    tied = par.model.cfg.tie_embeddings
    buffers = {k for k, _ in par.model.named_buffers()}
    problems = fit_problems(source, {k: tuple(v.shape) for k, v in state.items() if torch.is_tensor(v)}, buffers, tied)
    if problems:
        raise WeightsMismatchError(f"{what} does not fit this model:\n  {_summary(problems)}")
    for name, value in state.items():
        found = source_name(name, source, tied)
        if found is None:
            continue  # a buffer the weights do not have: it keeps its initial value
        local = value.to_local() if isinstance(value, DTensor) else value
        # In place: the state's tensors are the parameters (or ZeRO-3's shards) themselves, or copies
        # that load_model_state_dict below puts back; either way nothing larger than a slice is made.
        source.read_into(found, local_box(value), local)
    par.load_model_state_dict(state)
