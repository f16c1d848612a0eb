"""`fivefold viz schedule|trace`, `fivefold explain` and `fivefold report`: the parsers, and the commands
run with lazy imports (the pages import the planner and torch; `fivefold --help` should not wait for them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_viz_parser(sub: argparse._SubParsersAction) -> None:
    """`fivefold viz schedule` (viz/schedule.py) and `fivefold viz trace` (train/trace.py)."""
    from fivefold.train.trace import add_trace_parser
    from fivefold.viz.schedule import add_schedule_parser

    viz = sub.add_parser("viz", help="draw pictures").add_subparsers(dest="what", required=True)
    add_schedule_parser(viz)
    add_trace_parser(viz)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="write the interactive explainer pages (HTML)",
                       description="Write self-contained HTML pages (ring all-reduce, gradient buckets, "
                                   "pipeline schedules, ZeRO memory) and an index.")
    p.add_argument("--out", default="explain", help="folder to write the pages into (default: explain/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)
    p = sub.add_parser("report", help="write a run's report (one HTML file)",
                       description="Plots of a run's metrics log in one self-contained HTML file.")
    p.add_argument("run_dir", help="the run directory (runs/<name>/)")
    p.add_argument("--out", default=None, help="the HTML file to write (default: RUN_DIR/report.html)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.command == "explain":
        from fivefold.viz.explain import write_pages

        paths = write_pages(Path(args.out), progress=not args.no_progress)
        print(f"wrote {len(paths)} pages to {Path(args.out)}/; open {paths[0]} in a browser:")
        for path in paths:
            print(f"  {path}  ({path.stat().st_size / 1e3:,.0f} kB)")
        return 0
    from fivefold.viz.report import write_report

    try:
        out = write_report(Path(args.run_dir), Path(args.out) if args.out else None, not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"fivefold report: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({out.stat().st_size / 1e3:,.0f} kB); open it in a browser")
    return 0
