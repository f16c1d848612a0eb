"""`fivefold <command>`: the command line.

    fivefold train configs/debug.toml --nproc 2 --train.steps=500
    torchrun --nproc-per-node 8 -m fivefold train configs/llama3_8b.toml   (several nodes: torchrun's usual flags)

`train` checks the whole configuration for the number of processes it will run on before any
process starts, then either trains in this process (under torchrun, or alone) or starts `--nproc`
local workers through PyTorch's elastic launcher, the machinery behind torchrun.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from fivefold.config import ConfigError, load_config, read_config


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model", description="Train; any --section.key=value overrides the config.")
    p.add_argument("config", nargs="?", default=None, help="TOML file (see configs/); defaults apply without one")
    p.add_argument("--nproc", type=int, default=None, help="start this many local processes (default: 1, or torchrun's)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of the run")
    p.add_argument("--max-restarts", type=int, default=0, help="restart all workers this many times if one fails")
    p.add_argument("--deepspeed", metavar="JSON", default=None,
                   help="a DeepSpeed config: its keys with a fivefold meaning apply between the TOML and the overrides")
    p.add_argument("--no-progress", action="store_true", help="print lines only, no progress bar")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return [*overrides, "--checkpoint.resume=true"] if args.resume else overrides


def _deepspeed_layer(path: str, nproc: int) -> tuple[list[str], list[str]]:
    """The DeepSpeed config as overrides (printed for the user), and its refusals."""
    from fivefold.deepspeed import format_mapping, load_deepspeed

    mapping = load_deepspeed(path, nproc)
    print(format_mapping(mapping), file=sys.stderr)
    return mapping.overrides, mapping.errors


def _worker(config: str | None, overrides: list[str], resume: bool, progress: bool) -> None:
    """Entry point of each launched process: the same config, the same code, its own rank."""
    from fivefold.train.loop import train

    # After a failure the launcher restarts every worker: continue from the last checkpoint.
    resume = resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    args = argparse.Namespace(resume=resume)
    train(load_config(config, _overrides(args, overrides)), progress=progress)


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    from fivefold.train.loop import check_run_dir
    from fivefold.validate import validate

    nproc = args.nproc or (int(os.environ["WORLD_SIZE"]) if _under_torchrun() else 1)
    if args.nproc and _under_torchrun():
        raise ConfigError(["--nproc starts local processes; under torchrun use torchrun's --nproc-per-node instead"])
    if nproc < 1:
        raise ConfigError([f"--nproc = {nproc}: must be at least 1"])
    errors: list[str] = []
    if args.deepspeed:
        ds_overrides, errors = _deepspeed_layer(args.deepspeed, nproc)
        overrides = [*ds_overrides, *overrides]  # later wins: the command line over the JSON
    cfg, parse_errors = read_config(args.config, _overrides(args, overrides))
    errors += parse_errors + validate(cfg, nproc) + check_run_dir(cfg)
    if errors:
        raise ConfigError(errors)
    progress = not args.no_progress
    if _under_torchrun() or (nproc == 1 and not args.max_restarts):
        _worker(args.config, overrides, args.resume, progress)
        return 0
    launch_local(nproc, args.max_restarts, (args.config, overrides, args.resume, progress))
    return 0


def launch_local(nproc: int, max_restarts: int, worker_args: tuple) -> None:
    """Start nproc workers on this machine through torch's elastic launcher (what torchrun runs)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Each worker gets an equal share of the cores; oversubscribed OpenMP threads slow everyone down.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"fivefold-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",  # loopback only, port chosen by the OS
        max_restarts=max_restarts, monitor_interval=0.5,
    )
    elastic_launch(config, _worker)(*worker_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fivefold", description="Train LLMs with five kinds of parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    viz = sub.add_parser("viz", help="draw pictures").add_subparsers(dest="what", required=True)
    from fivefold.viz.schedule import add_schedule_parser

    add_schedule_parser(viz)
    from fivefold.planner.cli import add_calibrate_parser, add_plan_parser, run as run_planner

    add_plan_parser(sub)
    add_calibrate_parser(sub)
    args, rest = parser.parse_known_args(argv)
    try:
        if args.command == "train":
            return cmd_train(args, rest)
        if args.command in ("plan", "calibrate"):  # plan takes --model.KEY VALUE overrides in `rest`
            return run_planner(args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command == "viz":
            from fivefold.viz.schedule import run_schedule_viz

            return run_schedule_viz(args)
    except ConfigError as e:
        print(f"fivefold: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
