"""`fivefold sample`: text from a run, one of its checkpoints or a seed directory, in one process.

    fivefold sample runs/debug --prompt "def " --max-new-tokens 64
    fivefold sample runs/debug/checkpoints/step_00000200 --prompt "import " --temperature 0
    fivefold sample seeds/llama --prompt "The" --top-k 20 --seed 3

The work is in sample/generate.py, imported only when the command runs (`fivefold --help` stays free of torch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_sample_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate text from a run, a checkpoint or a seed directory",
                       description="Print PROMPT and its continuation by the model in PATH: a run directory (its "
                                   "latest complete checkpoint), RUN_DIR/checkpoints/step_N, or a seed directory "
                                   "(`fivefold init`, `fivefold convert --to fivefold`). One process, any layout "
                                   "the run was trained with.")
    p.add_argument("path", metavar="RUN_DIR|CHECKPOINT|SEED_DIR")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, the start of a document)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy; higher = more random (default 0.8)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens; 0 = all (default 40)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling draws: same seed, same text (default 0)")
    p.add_argument("--tokenizer", default=None,
                   help="'byte', a tokenizer.json or its directory (default: the run's or seed directory's own)")
    p.add_argument("--config", default=None, help="the weights' config (default: RUN_DIR/config.toml or fivefold.toml)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when available; default)")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads; 0 = auto: 1 for a model under 100M parameters, else torch's default")
    p.add_argument("--ignore-eod", action="store_true",
                   help="keep going past the end-of-document token instead of stopping there")
    p.set_defaults(run=run_sample)


def _problems(args: argparse.Namespace) -> list[str]:
    checks = [(args.max_new_tokens < 0, f"--max-new-tokens {args.max_new_tokens}: must be 0 or more"),
              (args.temperature < 0, f"--temperature {args.temperature}: must be 0 (greedy) or more"),
              (args.top_k < 0, f"--top-k {args.top_k}: must be 0 (all tokens) or more"),
              (args.threads < 0, f"--threads {args.threads}: must be 0 (auto) or more")]
    return [what for bad, what in checks if bad]


def _one_line(e: BaseException) -> str:
    """An error as one line: multi-line messages (a config's list of problems) joined."""
    from fivefold.config.load import ConfigError

    if isinstance(e, ConfigError):
        return "; ".join(e.errors)
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip())


def _sample(args: argparse.Namespace) -> str:
    import torch

    from fivefold.model.transformer import count_parameters
    from fivefold.sample.generate import SampleError, complete, load_sampler

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise SampleError(f"--device {args.device}: give cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SampleError(f"--device {args.device}: this machine has no CUDA device; use --device cpu")
    path = Path(args.path)
    model, tokenizer, cfg = load_sampler(path, Path(args.config) if args.config else None, args.tokenizer, device)
    # One token's forward of a small model is too little work to split: intra-op threads only add their
    # synchronisation (measured, debug preset, 100 tokens: 6 ms on 1 thread, 200 ms on 2 of a busy 2-core CPU).
    if args.threads or (device.type == "cpu" and count_parameters(model) < 100_000_000):
        torch.set_num_threads(args.threads or 1)
    # The model saw sequences of train.seq_len tokens: a longer prefix is cut to its last seq_len ids.
    return complete(model, tokenizer, args.prompt, args.max_new_tokens, temperature=args.temperature,
                    top_k=args.top_k, seed=args.seed, context=cfg.train.seq_len, stop_at_eod=not args.ignore_eod,
                    what=str(path))


def run_sample(args: argparse.Namespace) -> int:
    """Print the prompt and its continuation; a problem with the input is one line and exit status 2."""
    problems = _problems(args)
    if problems:  # before importing torch (seconds) for nothing
        print(f"fivefold: {'; '.join(problems)}", file=sys.stderr)
        return 2
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        text = _sample(args)
    except (ValueError, OSError) as e:  # ConfigError, SampleError, weights and tokenizer errors are ValueErrors
        print(f"fivefold: {_one_line(e)}", file=sys.stderr)
        return 2
    except CheckpointException as e:  # DCP's (a BaseException): a data file truncated or damaged
        print(f"fivefold: {args.path}: reading the checkpoint failed ({_one_line(e)}); a data file is truncated "
              f"or corrupt: sample another checkpoint of the run", file=sys.stderr)
        return 2
    print(text)
    return 0
