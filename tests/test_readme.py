"""README.md's commands work: every fenced block is run here, shortened, or says why it cannot be.

The marking convention. The line just before each fenced block of README.md is an HTML comment, which
a rendered README does not show:

    <!-- readme-test: run -->                  every command of the block runs here, shortened (below),
                                               and must exit with status 0
    <!-- readme-test: run: NOTE -->            the same, with a note for the reader of README.md's
                                               source (what the shortening changes, for example)
    <!-- readme-test: run except 4: REASON --> the same, but the block's command 4 (counted from 1;
                                               several as "4, 5") is skipped, for REASON
    <!-- readme-test: output -->               the block shows `$ command` lines followed by what they
                                               print: each command runs as written, and every line
                                               shown after it must appear in its stdout or stderr
    <!-- readme-test: skip: REASON -->         nothing runs: a picture or a listing rather than
                                               commands, or commands this machine cannot run (REASON
                                               says which, and names the test that runs a shortened
                                               version, where one does)

A block without a marker fails `test_every_block_is_marked`, named by its line. The quick start's
`make demo` / `make test` block is no exception: it is marked skip (CI runs `make test` itself).

How a `run` block runs. Its commands run in order in one fresh temporary directory holding a copy of
configs/, so a command can use what an earlier one of its block wrote (a checkpoint for `--resume`,
a seed directory, a run to convert). A command is a line, or lines joined by a trailing backslash,
without its `# comment`, split as the shell would. `fivefold` is `sys.executable -m fivefold` and
`torchrun` is `sys.executable -m torch.distributed.run`, the venv's own. These changes keep each
command to seconds, and are the only ones made (SHORT_TRAIN and `shorten()`):

- `fivefold train` (also under torchrun) gets `--train.steps=2 --train.warmup_steps=1
  --data.max_bytes=20000 --no-progress` appended (the command line's last value wins): two steps
  instead of hundreds (warmup must fit in them: debug.toml warms up for 20) on 20 kB of the
  standard library rather than 4 MB read and tokenized, without a progress bar in a log. With
  `--resume` it is `--train.steps=4`, so the resumed run trains two steps more than the one it
  continues. `--train.stop_after=N` becomes `--train.stop_after=1` (N must not exceed the steps).
- A fresh run (no `--resume`) whose run directory an earlier command of the block wrote starts with
  that directory removed: the README's commands are alternatives, and fivefold refuses a fresh run
  into a folder that holds checkpoints.
- A path `.../step_XXXXXXXX` (a run's checkpoint) names the shortened run's last checkpoint instead,
  `step_00000002` (README: `step_00000300`, the end of the 300 steps of configs/debug.toml).
- Process counts above 2 (`torchrun --nproc-per-node N`, `fivefold train --nproc N`) become 2: each
  process costs seconds of start-up on this 2-core machine (8 took 30 s). The command's
  configuration, as written, is first checked for its N processes in this process (`validate()`,
  what `fivefold train` checks before it starts anything), so the README's count stays tested.
- torchrun gets `--standalone` when no rendezvous is given: a free port, not 29500, which another
  test may hold.
- `fivefold calibrate` gets `--quick` (seconds instead of minutes of measurement).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ROOT

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.config import read_config
from fivefold.validate import validate

README = ROOT / "README.md"
MARK = re.compile(r"^<!-- readme-test: (run|output|skip)(.*?) -->$")
FENCE = "```"

SHORT_TRAIN = ["--train.warmup_steps=1", "--data.max_bytes=20000", "--no-progress"]  # and --train.steps
SHORT_STEPS, RESUMED_STEPS, STOP_AFTER, MAX_PROCS = 2, 4, 1, 2
TIMEOUT_S = 240


@dataclass
class Block:
    line: int  # of the opening fence, counted from 1
    text: list[str]
    mark: str | None  # run, output, skip, or None when unmarked
    detail: str  # skip's reason; run's "except N: REASON"; otherwise ""


def blocks(text: str) -> list[Block]:
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith(FENCE):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == FENCE), None)
        assert end is not None, f"README.md:{i + 1}: the code block never closes"
        m = MARK.match(lines[i - 1].strip()) if i > 0 else None
        found.append(Block(i + 1, lines[i + 1:end], m and m.group(1), m.group(2).strip() if m else ""))
        i = end + 1
    return found


def commands(text: list[str]) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines dropped."""
    out, pending = [], ""
    for line in text:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command = pending + line
        pending = ""
        if shlex.split(command, comments=True):
            out.append(command)
    return out


def skipped_commands(block: Block) -> set[int]:
    """The 1-based command numbers of `run except N, M: REASON`; a reason is required."""
    if not block.detail or block.detail.startswith(": "):
        return set()
    m = re.fullmatch(r"except ([\d, ]+): (.+)", block.detail)
    assert m, (f"README.md:{block.line}: write the marker as 'run', 'run: NOTE' or 'run except N: REASON', "
               f"not {block.detail!r}")
    return {int(n) for n in m.group(1).split(",")}


def _value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _set(argv: list[str], flag: str, value: str) -> list[str]:
    """`flag VALUE` or `flag=VALUE` in argv with the value replaced."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == flag and i + 1 < len(out):
            out[i + 1] = value
        elif arg.startswith(flag + "="):
            out[i] = f"{flag}={value}"
    return out


def _train_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """The config file and the --section.key=value overrides of a `fivefold train` argv (after `train`)."""
    config = next((a for a in argv if not a.startswith("-")), None)
    return config, [a for a in argv if a.startswith("--") and "." in a.split("=", 1)[0]]


def shorten(argv: list[str], cwd: Path) -> list[str]:
    """A README command line as this test runs it (the module docstring lists every change)."""
    exe, *args = argv
    if exe == "torchrun":
        at = args.index("-m")
        launcher, fivefold_args = args[:at], args[at + 2:]
        nproc = int(_value(launcher, "--nproc-per-node") or 1)
        if nproc > MAX_PROCS:
            _check_config(fivefold_args, nproc, cwd)
            launcher = _set(launcher, "--nproc-per-node", str(MAX_PROCS))
        if _value(launcher, "--rdzv-endpoint") is None and "--standalone" not in launcher:
            launcher = ["--standalone", *launcher]
        return [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "fivefold",
                *_shorten_fivefold(fivefold_args, cwd, launched=True)]
    assert exe == "fivefold", f"a README command this test cannot run: {argv}"
    return [sys.executable, "-m", "fivefold", *_shorten_fivefold(args, cwd, launched=False)]


def _shorten_fivefold(args: list[str], cwd: Path, launched: bool) -> list[str]:
    args = [re.sub(r"step_\d{8}", f"step_{SHORT_STEPS:08d}", a) for a in args]
    if args[0] == "calibrate":
        return [*args, "--quick"]
    if args[0] != "train":
        return args
    nproc = int(_value(args, "--nproc") or 1)
    if not launched and nproc > MAX_PROCS:
        _check_config(args, nproc, cwd)
        args = _set(args, "--nproc", str(MAX_PROCS))
    args = _set(args, "--train.stop_after", str(STOP_AFTER))
    resume = "--resume" in args
    if not resume:  # a fresh run: into a clean run directory (the module docstring says why)
        config, overrides = _train_args(args[1:])
        cfg, errors = read_config(cwd / config if config else None, overrides)
        if not errors:
            shutil.rmtree(cwd / run_dir_of(cfg), ignore_errors=True)
    steps = RESUMED_STEPS if resume else SHORT_STEPS
    return [*args, *SHORT_TRAIN, f"--train.steps={steps}"]


def _check_config(train_argv: list[str], nproc: int, cwd: Path) -> None:
    """The configuration of a `train` command as written, checked for its own process count."""
    assert train_argv[0] == "train", train_argv
    config, overrides = _train_args(train_argv[1:])
    cfg, errors = read_config(cwd / config if config else None, overrides)
    errors += validate(cfg, nproc)
    assert not errors, f"`fivefold {shlex.join(train_argv)}` on {nproc} processes:\n" + "\n".join(errors)


def run(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


ALL = blocks(README.read_text())


def test_every_block_is_marked():
    unmarked = [f"README.md:{b.line}: {b.text[0] if b.text else '(empty)'}" for b in ALL if b.mark is None]
    assert not unmarked, ("these code blocks have no marker on the line before (see tests/test_readme.py):\n"
                          + "\n".join(unmarked))
    for b in ALL:
        if b.mark == "skip":
            assert b.detail.startswith(": ") and b.detail[2:].strip(), f"README.md:{b.line}: skip without a reason"
        if b.mark == "run":
            skipped_commands(b)  # a well-formed marker
        if b.mark == "output":
            assert b.detail == "" and b.text and b.text[0].startswith("$ "), f"README.md:{b.line}: not `$ command`"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "run"], ids=lambda b: f"README.md:{b.line}")
def test_run_block(block, tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    skip = skipped_commands(block)
    cmds = commands(block.text)
    assert cmds and skip <= set(range(1, len(cmds) + 1)), f"README.md:{block.line}: {skip} of {len(cmds)} commands"
    for n, command in enumerate(cmds, 1):
        if n in skip:
            continue
        argv = shorten(shlex.split(command, comments=True), tmp_path)
        out = run(argv, tmp_path)
        assert out.returncode == 0, (f"README.md:{block.line}, command {n}: {command.strip()}\nran as: "
                                     f"{shlex.join(argv)}\nexit status {out.returncode}\n"
                                     f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "output"], ids=lambda b: f"README.md:{b.line}")
def test_output_block(block, tmp_path):
    """`$ command` lines run as written (no shortening); the lines shown after each must be printed."""
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shown: list[tuple[str, list[str]]] = []
    for line in block.text:
        if line.startswith("$ "):
            shown.append((line[2:], []))
        else:
            shown[-1][1].append(line)
    for command, expected in shown:
        exe, *args = shlex.split(command)
        assert exe == "fivefold", command
        out = run([sys.executable, "-m", "fivefold", *args], tmp_path)
        printed = out.stdout + out.stderr
        missing = [line for line in expected if line.strip() and line not in printed]
        assert not missing, f"README.md:{block.line}: `{command}` did not print:\n" + "\n".join(missing) + \
            f"\nit printed (exit status {out.returncode}):\n{printed[-3000:]}"
