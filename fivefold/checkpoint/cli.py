"""`fivefold init` and `fivefold convert` on the command line (the work is in checkpoint/convert.py and
checkpoint/seed.py, imported only when a command runs: `fivefold --help` stays free of torch).

    fivefold init configs/tiny.toml --out seeds/tiny --model.n_layers=2
    fivefold convert HF_DIR seeds/llama --to fivefold
    fivefold convert runs/x/checkpoints/step_00000300 hf/x --to hf --dtype bf16
    fivefold convert runs/x/checkpoints/step_00000300 peft/x --to peft     # a LoRA run's adapters
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from fivefold.config.load import ConfigError, read_config
from fivefold.config.schema import ParallelConfig

DTYPES = ("fp32", "bf16", "fp16")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("init", help="write a model's initial weights (a seed checkpoint), one tensor at a time",
                       description="Write the initial weights of CONFIG's model, one tensor at a time; "
                                   "--section.key=value overrides the config as for train.")
    p.add_argument("config", nargs="?", default=None, help="TOML file (see configs/)")
    p.add_argument("--out", default=None, help="directory to write (default: RUN_DIR/seed)")
    p.set_defaults(run=run, overrides=True)
    p = sub.add_parser("convert", help="convert weights: Hugging Face <-> fivefold",
                       description="Hugging Face model directory (Llama 3.x, Mistral, Mixtral, Qwen2.5, Qwen3, "
                                   "Qwen3-MoE, OLMo 2, Gemma 3, gpt-oss, DeepSeek-V3, Kimi K2) -> seed directory "
                                   "(--to fivefold), or run checkpoint / seed directory -> Hugging Face directory "
                                   "(--to hf); a LoRA run's adapters -> PEFT adapter directory (--to peft).")
    p.add_argument("src", help="--to fivefold: an HF directory; --to hf: checkpoints/step_X or a seed directory; "
                               "--to peft: checkpoints/step_X of a LoRA run")
    p.add_argument("out", help="directory to write (new or empty)")
    p.add_argument("--to", choices=["fivefold", "hf", "peft"], required=True)
    p.add_argument("--merge", action="store_true",
                   help="--to hf of a LoRA run: each adapted weight merged, W + scaling B A (else the base alone)")
    p.add_argument("--config", default=None, help="--to hf, peft: the run's config (default: the run's config.toml)")
    p.add_argument("--hf-config", default=None,
                   help="--to hf, peft: an HF config.json whose other keys (token ids, context length) to keep")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="--to hf, peft: save in this dtype (default: as stored); --to fivefold: dequantize fp8 / MXFP4 "
                        "weights to this dtype (default: config.json's torch_dtype)")
    p.add_argument("--max-shard-size", default="5GB", help="split the weights into files of at most this size")
    p.set_defaults(run=run, overrides=True)


def _fresh(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory: choose another output or delete it")


@contextlib.contextmanager
def _written_whole(out: Path) -> Iterator[Path]:
    """The output is written into a hidden sibling folder and renamed to `out` only when complete,
    so a failure, or a kill, never leaves a partial file where a complete one belongs. The paths
    its TOML files give for the folder (init_from, data.tokenizer) are rewritten to `out`'s."""
    _fresh(out)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for toml in tmp.glob("*.toml"):
        toml.write_text(toml.read_text().replace(str(tmp), str(out)))
    if out.exists():
        out.rmdir()  # empty (_fresh): the complete folder takes its place
    tmp.rename(out)


def _init(args: argparse.Namespace, rest: list[str]) -> None:
    from fivefold.checkpoint.seed import write_seed_checkpoint
    from fivefold.config.load import SEED_CONFIG
    from fivefold.validate import validate

    cfg, errors = read_config(args.config, rest)
    # The layout does not matter for initial weights: check the rest as for one process.
    errors += validate(dataclasses.replace(cfg, parallel=ParallelConfig()), 1)
    if errors:
        raise ConfigError(errors)
    out = Path(args.out) if args.out else Path(cfg.run.out_dir) / (cfg.run.name or "run") / "seed"
    with _written_whole(out) as tmp:
        path = write_seed_checkpoint(cfg, tmp)
    print(f"wrote {out / path.name}; train from it (any layout): fivefold train {out / SEED_CONFIG}")


def _convert(args: argparse.Namespace) -> None:
    import torch

    from fivefold.checkpoint.convert import fivefold_to_hf, fivefold_to_peft, hf_to_fivefold, parse_size
    from fivefold.checkpoint.peft import ADAPTER_CONFIG
    from fivefold.config.load import SEED_CONFIG

    src, out, size = Path(args.src), Path(args.out), parse_size(args.max_shard_size)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype] if args.dtype else None
    if args.merge and args.to != "hf":
        raise ValueError("--merge: only with --to hf (a LoRA run's model with its adapters merged)")
    config, hf_config = Path(args.config) if args.config else None, Path(args.hf_config) if args.hf_config else None
    with _written_whole(out) as tmp:
        if args.to == "fivefold":
            files = hf_to_fivefold(src, tmp, size, dtype)
        elif args.to == "peft":
            files = [fivefold_to_peft(src, tmp, config, hf_config, dtype)]
        else:
            files = fivefold_to_hf(src, tmp, config, hf_config, dtype, size, args.merge)
    if args.to == "fivefold":
        print(f"wrote {len(files)} safetensors file(s) to {out}; train from them: fivefold train {out / SEED_CONFIG}")
    elif args.to == "peft":
        print(f"wrote {out / ADAPTER_CONFIG} and {out / files[0].name}: load it with peft.PeftModel.from_pretrained("
              f"model, '{out}') over the model --to hf writes")
    else:
        print(f"wrote {out / 'config.json'} and {len(files)} safetensors file(s)")


def run(args: argparse.Namespace, rest: list[str]) -> int:
    """Run `init` or `convert`; a problem with the input is one message and exit status 2."""
    try:
        if args.command == "init":
            _init(args, rest)
        elif rest:
            raise ConfigError([f"unrecognized arguments: {' '.join(rest)}"])
        else:
            _convert(args)
    except (ValueError, OSError) as e:  # ConfigError and every weights error are ValueErrors
        print(f"fivefold: {e}", file=sys.stderr)
        return 2
    return 0
