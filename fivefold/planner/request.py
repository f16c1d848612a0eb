"""What `fivefold plan` was asked, read into a config, and the batch the planner chooses for it.

Only values the user gave can refuse a layout. A batch in sequences of the user's own
(--global-batch, train.global_batch in the TOML file or as an override) and a micro-batch of the
user's own (--micro-batch, micro_batch in --layout, train.micro_batch) are kept, and validate()
may refuse them. Otherwise:

- the global batch is --global-batch-tokens (default DEFAULT_BATCH_TOKENS) / seq, rounded to a
  multiple of dp x micro-batch (tokens do not divide into sequences exactly anyway);
- the micro-batch is the fastest of MICRO_BATCHES that validates and fits (estimate()), or, when
  none fits, the smallest that validates.

Without --seq (or train.seq_len), a preset is planned at its report's pre-training sequence length
(presets.PRETRAIN_SEQ_LEN), and then with the default batch of tokens, search included. The explain
rows say which values were the user's and which were chosen. A search at a sequence length the
user gave keeps the config's global batch unless tokens are given (the default 4M over the
config's 64-token sequences would be 65,536 sequences per step for every candidate).
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from fivefold.config.load import ConfigError, parse_overrides, read_config, replace
from fivefold.config.schema import Config
from fivefold.model.presets import PRETRAIN_SEQ_LEN
from fivefold.planner.layout import split_layout
from fivefold.planner.machine.datasheet import Hardware
from fivefold.planner.machine.pricing import Memo, Row
from fivefold.planner.memory import BytesPerParam
from fivefold.planner.options import DEFAULT, PlanOptions
from fivefold.planner.routing import imbalance_by_ep, read_expert_loads
from fivefold.validate import validate

if TYPE_CHECKING:  # estimate imports torch (through fivefold.parallel): `fivefold --help` should not wait for it
    from fivefold.planner.estimate import Estimate

DEFAULT_BATCH_TOKENS = "4M"  # tokens per step when the user gives no batch (Llama 3's first stage, sec. 3.4.1)
MICRO_BATCHES = (1, 2, 4)  # micro-batches tried when the user gives none


def parse_tokens(text: str) -> int:
    """"4M" -> 4 x 2^20 (binary, as in "4M tokens" = 1024 x 4096), "512K", or a plain number."""
    raw = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "B": 2**30}.get(raw[-1:], 1)
    try:
        tokens = int(float(raw[:-1] if scale > 1 else raw) * scale)
    except (ValueError, OverflowError):
        tokens = 0
    if tokens <= 0:
        raise ConfigError([f"--global-batch-tokens '{text}': give a positive token count such as 4M, 512K or 1048576"])
    return tokens


@dataclasses.dataclass(frozen=True)
class Request:
    """What `fivefold plan` was asked, read into a config: the planner's options beside it, and which
    batch values the user gave (the others are the planner's to choose: module docstring)."""

    cfg: Config
    options: PlanOptions
    batch_tokens: int | None  # the global batch comes from these (the user's or the default), else it was given
    micro_batch_given: bool


def _toml_train_keys(path: str | None) -> set[str]:
    """train.* keys a TOML config file sets (read_config reports a file it cannot read)."""
    try:
        return set(tomllib.loads(Path(path).read_text(encoding="utf-8")).get("train", {})) if path else set()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return set()


def read_request(args: argparse.Namespace, rest: list[str], batch_default: bool) -> Request:
    """The config and options asked for; with batch_default, a global batch the user did not give
    comes from DEFAULT_BATCH_TOKENS (a search keeps the config's, today's behaviour)."""
    path, preset = None, []
    if args.model and Path(args.model).suffix == ".toml":
        path = args.model
    elif args.model:
        preset = [f"--model.preset={args.model}"]
    layout, options = split_layout(args.layout) if args.layout else ([], DEFAULT)
    imbalance, loads = expert_imbalance_arg(args.expert_imbalance)
    options = dataclasses.replace(options, causal_flops=args.causal_flops, expert_imbalance=imbalance,
                                  document_tokens=args.document_tokens or 0.0,
                                  kernels=args.kernels or "auto")
    extra = [f"--train.seq_len={args.seq}"] if args.seq else []
    overridden = set(parse_overrides(rest + layout)[0].get("train", {}))  # --train.KEY and --layout micro_batch
    given = overridden | _toml_train_keys(path)
    published_seq = PRETRAIN_SEQ_LEN.get(args.model or "") if not args.seq and "seq_len" not in given else None
    if published_seq:  # a preset's own pre-training length, not the config's 64 tokens for tests
        extra.append(f"--train.seq_len={published_seq}")
        batch_default = True  # and then a batch of tokens that goes with it
    if args.micro_batch:
        extra.append(f"--train.micro_batch={args.micro_batch}")
    tokens = None
    if "global_batch" in overridden:  # an override beats the flags, as it always has
        pass
    elif args.global_batch_tokens:
        tokens = parse_tokens(args.global_batch_tokens)
    elif args.global_batch:
        extra.append(f"--train.global_batch={args.global_batch}")
    elif batch_default and "global_batch" not in given:
        tokens = parse_tokens(DEFAULT_BATCH_TOKENS)
    cfg, errors = read_config(path, preset + extra + rest + layout)
    if errors:
        raise ConfigError(errors)
    check_document_tokens(cfg, options.document_tokens)
    if loads and len(loads[0]) != cfg.model.moe.n_experts:
        raise ConfigError([f"--expert-imbalance {args.expert_imbalance}: the run routed to {len(loads[0])} experts, "
                           f"this model has {cfg.model.moe.n_experts}; give a run of the same model or a number"])
    if loads:
        options = dataclasses.replace(options, measured_imbalance=imbalance_by_ep(loads))
    if tokens is not None:  # sequences from tokens; the flag beats a TOML file's train.global_batch
        cfg = replace(cfg, train={"global_batch": max(1, tokens // cfg.train.seq_len)})
    return Request(cfg, options, tokens, bool(args.micro_batch) or "micro_batch" in given)


def expert_imbalance_arg(text: str) -> tuple[float, tuple[tuple[int, ...], ...]]:
    """--expert-imbalance: a number (the imbalance), or a run directory / metrics.jsonl whose logged
    routing gives it per layout (routing.py). ConfigError naming the flag otherwise."""
    try:
        return float(text), ()
    except ValueError:
        pass
    try:
        return 1.0, read_expert_loads(text)
    except ValueError as e:
        raise ConfigError([str(e)]) from None


def check_document_tokens(cfg: Config, document_tokens: float) -> None:
    """--document-tokens states the data's mean document length: it needs the mask it describes."""
    if document_tokens and document_tokens < 1:
        raise ConfigError([f"--document-tokens {document_tokens:g}: a document holds at least one token"])
    if document_tokens and not cfg.data.document_mask:
        raise ConfigError([f"--document-tokens {document_tokens:g}: data.document_mask is off, so every query sees "
                           "its whole causal prefix; add --data.document_mask=true or drop the flag"])


def _dp(cfg: Config, world: int) -> int:
    """dp as validate derives it (parallel.dp, else what tp x pp x cp leave); 0 when they do not divide."""
    p = cfg.parallel
    rest = p.tp * p.pp * p.cp
    return p.dp or (world // rest if rest > 0 and world % rest == 0 else 0)


def _batch_for(req: Request, micro_batch: int, world: int) -> Config:
    """req.cfg at `micro_batch`, its global batch rounded to a multiple of dp x micro-batch when it
    came from tokens."""
    cfg = replace(req.cfg, train={"micro_batch": micro_batch})
    unit = _dp(cfg, world) * micro_batch
    if req.batch_tokens is None or unit <= 0:
        return cfg
    return replace(cfg, train={"global_batch": max(1, round(cfg.train.global_batch / unit)) * unit})


def estimate_request(req: Request, world: int, hw: Hardware, b: BytesPerParam | None = None,
                     act_bytes: int = 2) -> tuple[Config, Estimate]:
    """The layout asked for, with the batch values the user left open chosen (module docstring);
    ConfigError with validate()'s errors when no choice makes it valid."""
    from fivefold.planner.estimate import Estimate, estimate

    micro_batches = (req.cfg.train.micro_batch,) if req.micro_batch_given else MICRO_BATCHES
    memo, tried = Memo(), []
    for mb in micro_batches:
        cfg = _batch_for(req, mb, world)
        errors = validate(cfg, world)
        tried.append((cfg, errors or estimate(cfg, world, hw, b, act_bytes, memo=memo, options=req.options)))
    valid = [(cfg, est) for cfg, est in tried if isinstance(est, Estimate)]
    if not valid:
        raise ConfigError(tried[0][1])
    cfg, est = min([ce for ce in valid if ce[1].fits] or valid[:1], key=lambda ce: ce[1].step_time_s)
    est.explain.insert(0, _batch_row(req, cfg, tried))
    return cfg, est


def _batch_row(req: Request, cfg: Config, tried: list[tuple[Config, Estimate | list[str]]]) -> Row:
    from fivefold.planner.estimate import Estimate

    t = cfg.train
    if req.batch_tokens is None:
        batch = f"global batch {t.global_batch} sequences (given)"
    else:
        batch = (f"global batch {t.global_batch} sequences of {t.seq_len} = {t.global_batch * t.seq_len:,} tokens "
                 f"({req.batch_tokens:,} tokens asked, rounded to a multiple of dp x micro-batch)")
    if req.micro_batch_given:
        micro = f"micro-batch {t.micro_batch} (given)"
    else:
        def outcome(e: Estimate | list[str]) -> str:
            if not isinstance(e, Estimate):
                return f"invalid ({e[0]})"
            return f"{e.step_time_s:.3f} s" + ("" if e.fits else ", does not fit")

        options = "; ".join(f"{c.train.micro_batch}: {outcome(e)}" for c, e in tried)
        micro = f"micro-batch {t.micro_batch}, picked: the fastest that fits of {options}"
    return ("batch", f"{batch}; {micro}", "planner/request.py: only values the user gave can refuse a layout")
