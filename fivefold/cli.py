"""`fivefold <command>`: the command line, a table of subcommands.

    fivefold train configs/debug.toml --nproc 2 --train.steps=500
    fivefold plan --model llama3-8b --gpus 8
    fivefold convert ~/hf/Llama-3.2-1B runs/llama-seed --to fivefold

Each command's parser lives beside its code (`<package>/cli.py`) and names the function that runs it
(`set_defaults(run=...)`); a command that takes `--table.key=value` overrides also sets
`overrides=True` and its run function receives them. A configuration's problems
(ConfigError) are printed here, one line each, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from fivefold.checkpoint.cli import add_parsers as add_weights_parsers
from fivefold.config.load import ConfigError
from fivefold.data.cli import add_prepare_parser
from fivefold.parallel.comm.compat import torch_problem
from fivefold.planner.cli import add_calibrate_parser, add_plan_parser
from fivefold.sample.cli import add_sample_parser
from fivefold.train.cli import add_train_parser
from fivefold.viz.cli import add_parsers as add_page_parsers
from fivefold.viz.cli import add_viz_parser

COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    add_train_parser,  # train                 train/cli.py
    add_viz_parser,  # viz schedule, viz trace  viz/schedule.py, train/trace.py
    add_plan_parser,  # plan                  planner/cli.py
    add_calibrate_parser,  # calibrate        planner/cli.py
    add_weights_parsers,  # init, convert     checkpoint/cli.py
    add_page_parsers,  # explain, report      viz/cli.py
    add_prepare_parser,  # prepare            data/cli.py
    add_sample_parser,  # sample              sample/cli.py
)


def main(argv: list[str] | None = None) -> int:
    problem = torch_problem()  # an older torch: one line before anything runs (parallel/comm/compat.py)
    if problem is not None:
        print(f"fivefold: {problem}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="fivefold", description="Train LLMs with five kinds of parallelism.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args, rest = parser.parse_known_args(argv)
    takes_overrides = getattr(args, "overrides", False)
    if rest and not takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.run(args, rest) if takes_overrides else args.run(args)
    except ConfigError as e:
        print(f"fivefold: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the planner's bad input (an unknown GPU, an option the GPU lacks): one line
        if args.command != "plan":
            raise
        print(f"fivefold: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
