"""`fivefold train CONFIG --dry-run --world N (--gpu NAME | --device-memory SIZE)`: the command
line of the dry run (train/dry_run.py). The arguments and the configuration are checked before
torch is imported, as `fivefold train` checks them, so a typo fails in under a second.
"""

from __future__ import annotations

import argparse
import re
import time

from fivefold.config.derive import derive
from fivefold.config.load import ConfigError, read_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.planner.machine.datasheet import get_hardware
from fivefold.validate import validate

UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
         "tib": 2**40}


def parse_size(text: str) -> float:
    """"80GB" -> 80e9 bytes (GB = 1e9 as the planner counts; GiB = 2^30); a plain number is bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if not m or m.group(2) not in UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--device-memory '{text}': give a positive size such as 80GB, 141GB or 96GiB")
    return float(m.group(1)) * UNITS[m.group(2)]


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """`fivefold train CONFIG --dry-run --world N ...` (cli.py): 0 when every position fits, 1
    when one does not; a config validate() refuses raises ConfigError (printed, exit status 2)."""
    errors, world = [], args.world
    if world is None or world < 1:
        errors.append(f"--dry-run needs --world N, the number of ranks to build (at least 1), not {world}")
    if args.nproc or str(args.nnodes) != "1":
        errors.append("--dry-run builds every rank in this one process: give the job's size with --world, "
                      "not --nproc / --nnodes")
    if args.gpu and args.device_memory:
        errors.append("--gpu and --device-memory both give the capacity: give one")
    capacity, capacity_name = 0.0, ""
    try:
        if args.device_memory:
            capacity, capacity_name = parse_size(args.device_memory), f"--device-memory {args.device_memory}"
        elif args.gpu:
            capacity, capacity_name = get_hardware(args.gpu).memory_bytes, get_hardware(args.gpu).name
        else:
            errors.append("--dry-run needs the memory of one device: --gpu NAME (h100, a100-80gb, ...) or "
                          "--device-memory SIZE (80GB)")
    except ValueError as e:
        errors.append(str(e))
    if errors:
        raise ConfigError(errors)
    if args.deepspeed:
        from fivefold.config.deepspeed import format_mapping, load_deepspeed

        mapping = load_deepspeed(args.deepspeed, world)
        print(format_mapping(mapping))
        errors += mapping.errors
        overrides = [*mapping.overrides, *overrides]
    cfg, parse_errors = read_config(args.config, overrides)
    errors += parse_errors + validate(cfg, world)
    if errors:
        raise ConfigError(errors)
    from fivefold.train.dry_run import dry_run, format_report

    derived = derive(cfg, world, unpadded_vocab(cfg))
    start = time.perf_counter()
    reports = dry_run(cfg, derived, capacity, every=args.all_positions, progress=not args.no_progress)
    print(format_report(cfg, derived, reports, capacity_name, time.perf_counter() - start))
    return 0 if all(r.fits for r in reports) else 1
