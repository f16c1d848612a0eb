"""`fivefold train`: check the configuration, then train here or launch the workers that do.

    fivefold train configs/debug.toml --nproc 2 --train.steps=500
    fivefold train CONFIG --nproc 8 --nnodes 2 --node-rank R --rdzv-endpoint node0:29500   (on each node)
    fivefold train CONFIG --nproc 8 --nnodes 2:4 --node-rank R --rdzv-endpoint node0:29500 (elastic: 2 to 4 nodes)
    torchrun --nproc-per-node 8 -m fivefold train configs/tiny.toml --train.global_batch=16

`train` checks the whole configuration for the number of processes it will run on before any
process starts, then either trains in this process (under torchrun, or alone) or starts `--nproc`
workers on this node through PyTorch's elastic launcher, the machinery behind torchrun (launch/agent.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys

from fivefold.config.derive import Derived, derive
from fivefold.config.load import ConfigError, read_config, replace
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab
from fivefold.launch.agent import LaunchError, RendezvousLost
from fivefold.launch.agent import add_arguments as add_launch_arguments
from fivefold.launch.elastic import Policy


def add_train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model",
                       description="Train; any --table.key=value overrides the config (--optim.lr=1e-3, "
                                   "--model.rope.theta=1e6).")
    p.add_argument("config", nargs="?", default=None, help="TOML file (see configs/); defaults apply without one")
    p.add_argument("--nproc", type=int, default=None, help="worker processes on this node (default: 1, or torchrun's)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint of the run")
    p.add_argument("--max-restarts", type=int, default=None,
                   help="when a worker fails, restart every worker (all nodes) up to this many times, "
                        "from the last checkpoint (default 0; MAX - MIN with --nnodes MIN:MAX: a lost node is "
                        "one failure, a node joining costs none)")
    p.add_argument("--keep", default=None, metavar="AXES",
                   help="elastic: the axes (of tp,pp,cp,ep) that stay when the world changes; the others may "
                        "shrink (default: all stay, only dp changes)")
    p.add_argument("--replan", action="store_true",
                   help="elastic: the planner's fastest valid, fitting layout for each new world (run.hardware, "
                        "or --gpu NAME), with the --keep axes pinned")
    p.add_argument("--deepspeed", metavar="JSON", default=None,
                   help="a DeepSpeed config: its keys with a fivefold meaning apply between the TOML and the overrides")
    p.add_argument("--no-progress", action="store_true", help="print lines only, no progress bar")
    p.add_argument("--trace", action="store_true",
                   help="write a Chrome trace per rank of a few steps (run.trace_steps) to RUN_DIR/trace/")
    dry = p.add_argument_group("dry run", "build what every rank of --world ranks would hold, on the meta device "
                               "with a fake process group, beside the planner's prediction (train/dry_run.py)")
    dry.add_argument("--dry-run", action="store_true", help="build and count, train nothing (no device, no peers)")
    dry.add_argument("--world", type=int, default=None, metavar="N", help="ranks of the job the dry run builds")
    dry.add_argument("--gpu", default=None, metavar="NAME",
                     help="its device: a catalog GPU (h100, a100-80gb, ...); also what --replan plans for")
    dry.add_argument("--device-memory", default=None, metavar="SIZE", help="or its memory: 80GB (GB = 1e9), 96GiB")
    dry.add_argument("--all-positions", action="store_true",
                     help="build every (pp, tp, ep, dp_shard) position apart, not one rank per pipeline rank")
    add_launch_arguments(p)
    p.set_defaults(run=run_train, overrides=True)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _overrides(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    return [*overrides, "--checkpoint.resume=true"] if args.resume else overrides


def _deepspeed_layer(path: str, nproc: int) -> tuple[list[str], list[str]]:
    """The DeepSpeed config as overrides (printed for the user), and its refusals."""
    from fivefold.config.deepspeed import format_mapping, load_deepspeed

    mapping = load_deepspeed(path, nproc)
    print(format_mapping(mapping), file=sys.stderr)
    return mapping.overrides, mapping.errors


def _worker(cfg: Config, derived: Derived, progress: bool, policy: Policy | None = None) -> None:
    """Entry point of each launched process: the config checked by the launcher, its own rank; in an
    elastic job, the layout for the world this round admitted (launch/elastic.py)."""
    from fivefold.launch.agent import die_with_parent
    from fivefold.launch.worker_report import reporting
    from fivefold.train.loop import resolve_device_type, train

    die_with_parent()
    # What is imported by now (torch, fivefold: the forkserver's, when forked from it) stays for the
    # process's life: frozen, the loop's collections (train/gc_policy.py) walk only what this worker
    # makes, and a forked worker's collections leave the pages it shares with its server untouched.
    gc.freeze()
    with reporting():  # how this rank ended, for the launcher's summary
        decision = None
        if policy is not None:
            from fivefold.launch.elastic import decide

            world = int(os.environ["WORLD_SIZE"])
            decision = decide(cfg, world, policy, resolve_device_type(cfg))
            cfg, derived = decision.cfg, derive(decision.cfg, world, derived.vocab_limit)
        if train(cfg, derived, progress=progress, elastic=decision).stopped:
            # The agent's SIGTERM asked for this stop: end as it asked (the report's handler says
            # "stopped"). A worker that returned would wait for the agent's all-finished event, which
            # a shutdown never sends, until the agent's SIGKILL 30 s later.
            os.kill(os.getpid(), signal.SIGTERM)


def _warn_oversubscribed(cfg: Config, nproc: int) -> None:
    """More CPU workers than cores on this node: each still runs, but they take turns on the cores."""
    cores = os.cpu_count() or 1
    if nproc > cores and cfg.train.device != "cuda":
        from fivefold.train.loop import resolve_device_type

        if resolve_device_type(cfg) == "cpu":
            print(f"fivefold: warning: {nproc} processes on {cores} CPU cores: they will take turns on the cores "
                  f"(each step about {nproc / cores:.0f}x slower than with {cores}); lower --nproc", file=sys.stderr)


def _elastic_policy(args: argparse.Namespace, world: int, elastic: bool) -> tuple[Policy | None, list[str]]:
    """How an elastic job re-plans (--keep, --replan, --gpu), and the problems with those flags."""
    if not elastic:
        given = [f for f, v in (("--keep", args.keep is not None), ("--replan", args.replan)) if v]
        return None, [f"{', '.join(given)}: only an elastic job changes its layout; launch it with "
                      f"--nnodes MIN:MAX (MIN < MAX)"] if given else []
    from fivefold.launch.elastic import AXES, parse_keep

    try:
        keep = parse_keep(args.keep) if args.keep is not None else (() if args.replan else AXES)
    except ValueError as e:
        return None, [str(e)]
    if args.gpu:
        from fivefold.planner.hardware import get_hardware

        try:
            get_hardware(args.gpu)
        except ValueError as e:
            return None, [f"--gpu: {e}"]
    return Policy(world, keep, args.replan, args.gpu or ""), []


def _finished(cfg: Config) -> bool:
    """Whether the run's last complete checkpoint is at its final step (train.stop_after or steps)."""
    from fivefold.checkpoint.run_dir import checkpoint_step, latest_checkpoint, run_dir_of

    latest = latest_checkpoint(run_dir_of(cfg))
    return latest is not None and checkpoint_step(latest) >= (cfg.train.stop_after or cfg.train.steps)


def _resume_note(cfg: Config) -> str:
    """Where a failed job can continue from, for its last message."""
    from fivefold.checkpoint.run_dir import latest_checkpoint, run_dir_of

    latest = latest_checkpoint(run_dir_of(cfg))
    if latest is None:
        return "no checkpoint was written yet: the run starts again from step 0"
    return f"the last complete checkpoint is {latest}: the same command with --resume continues from it"


def _prepare_text(cfg: Config, progress: bool) -> None:
    """Text given to train is tokenized here, once, with every core, before any worker starts (later
    runs on the same inputs reuse the cache: fivefold/data/resolve.py)."""
    from fivefold.data.resolve import data_kind, ensure_prepared
    from fivefold.data.sources import DataError, Skipped

    if data_kind(cfg.data) != "text":
        return
    from fivefold.data.prepare import read_manifest

    try:
        folder = ensure_prepared(cfg, workers=min(os.cpu_count() or 1, 8), progress=progress)
    except DataError as e:
        raise ConfigError([str(e)]) from None
    skipped = read_manifest(folder)["skipped_binary"]
    if skipped:
        print(f"fivefold: warning: {Skipped(skipped).warning()}", file=sys.stderr)


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.dry_run:
        from fivefold.train.dry_run_cli import run as dry_run

        return dry_run(args, overrides)
    from fivefold.checkpoint.run_dir import run_dir_of
    from fivefold.launch.agent import check_writable, launch, spec_from_args, start_worker_server
    from fivefold.launch.run_lock import RunLock
    from fivefold.train.preflight import preflight

    nproc = args.nproc if args.nproc is not None else (int(os.environ["WORLD_SIZE"]) if _under_torchrun() else 1)
    if args.nproc and _under_torchrun():
        raise ConfigError(["--nproc starts local processes; under torchrun use torchrun's --nproc-per-node instead"])
    if nproc < 1:
        raise ConfigError([f"--nproc = {nproc}: must be at least 1"])
    if _under_torchrun() and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        args.resume = True  # torchrun restarted the workers after a failure: continue from the last checkpoint
    spec, errors = spec_from_args(args, nproc, _under_torchrun())
    policy, policy_errors = _elastic_policy(args, spec.world_size, spec.elastic)
    errors += policy_errors
    if args.trace:
        overrides = [*overrides, "--run.trace=true"]
    if args.deepspeed:
        ds_overrides, ds_errors = _deepspeed_layer(args.deepspeed, spec.world_size)
        errors += ds_errors
        overrides = [*ds_overrides, *overrides]  # later wins: the command line over the JSON
    cfg, parse_errors = read_config(args.config, _overrides(args, overrides))
    joining = spec.elastic and spec.node_rank > 0  # node 0 judges the run directory of an elastic job
    errors += parse_errors + preflight(cfg, spec.world_size, joining) + check_writable(run_dir_of(cfg))
    if not errors and policy is not None:  # every world the job may shrink to has a layout, known now
        from fivefold.launch.elastic import check_node_range

        errors += check_node_range(cfg, nproc, spec.min_nodes, spec.nnodes, policy)
    if errors:
        raise ConfigError(errors)
    # Checked once, here: every worker receives this resolved config and its derived numbers.
    derived = derive(cfg, spec.world_size, unpadded_vocab(cfg))
    _warn_oversubscribed(cfg, nproc)
    launching = not _under_torchrun() and (spec.world_size > 1 or spec.max_restarts > 0)
    if launching:  # its imports overlap what this launcher does before the workers start
        start_worker_server(nproc)
    progress = not args.no_progress
    # One job per run directory: node 0's launcher holds the lock for the whole job (rank 0 under torchrun).
    holds = os.environ.get("RANK", "0") == "0" if _under_torchrun() else spec.node_rank == 0
    lock = RunLock(run_dir_of(cfg)) if holds else None
    if lock is not None:
        lock.acquire()
        if lock.took_over:
            print(f"fivefold: {lock.took_over}", file=sys.stderr)
    try:
        if holds:  # node 0 (rank 0 under torchrun) prepares text; the other nodes read its cache
            _prepare_text(cfg, progress)
        if not launching:
            if _under_torchrun():  # a worker of torchrun's agent: it ends with the agent
                _worker(cfg, derived, progress)
            else:  # this process is the job: it lives as long as the user's shell wants
                from fivefold.train.loop import train

                train(cfg, derived, progress=progress)
            return 0
        # Restarted workers continue from the last checkpoint; any checkpoint they find was written by
        # this job, since a fresh run into a folder holding checkpoints was refused above.
        if spec.max_restarts or spec.elastic:
            cfg = replace(cfg, checkpoint={"resume": True})
        try:
            launch(spec, _worker, (cfg, derived, progress, policy))
        except RendezvousLost as e:
            if not _finished(cfg):  # else node 0 ended the finished job a moment before this node's agent did
                raise LaunchError(f"{e}\n{_resume_note(cfg)}") from None
        except LaunchError as e:
            if not (spec.max_restarts or spec.elastic):
                raise
            raise LaunchError(f"{e}\n{_resume_note(cfg)}") from None
        return 0
    finally:
        if lock is not None:
            lock.release()


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """`fivefold train`; a launch that failed, or running out of memory, is one line (the configuration's
    problems are cli.py's)."""
    try:
        return _train(args, overrides)
    except LaunchError as e:
        print(f"fivefold: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # out of memory where this process was the job: its one line (train/oom.py)
        from fivefold.train.oom import OutOfMemory

        if not isinstance(e, OutOfMemory):
            raise
        print(f"fivefold: {e}", file=sys.stderr)
        return 1
