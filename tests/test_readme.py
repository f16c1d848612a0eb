"""The pages' commands work: every fenced block of README.md and docs/*.md is run here, shortened, or
says why it cannot be; and the paths and links the pages name exist.

The pages. README.md is the entry, docs/*.md the reference pages; every one is read the same way, and
a block is named by its page and line (`docs/planner.md:12`) in test ids and failures. A block runs
once, from the one page that holds it: a page links to another's block rather than repeating it.

The marking convention. The line just before each fenced block is an HTML comment, which a rendered
page does not show:

    <!-- readme-test: run -->                  every command of the block runs here, shortened (below),
                                               and must exit with status 0
    <!-- readme-test: run: NOTE -->            the same, with a note for the reader of the page's
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

A block without a marker fails `test_every_block_is_marked`, named by its page and line. The quick
start's `make demo` / `make test` block is no exception: it is marked skip (CI runs `make test` itself).

How a `run` block runs. Its commands run in order in one fresh temporary directory holding a copy of
configs/, so a command can use what an earlier one of its block wrote (a checkpoint for `--resume`,
a seed directory, a run to convert). A command is a line, or lines joined by a trailing backslash,
without its `# comment`, split as the shell would. `fivefold` is `sys.executable -m fivefold` and
`torchrun` is `sys.executable -m torch.distributed.run`, the venv's own. These changes keep each
command to seconds, and are the only ones made (SHORT_TRAIN and `shorten()`):

- `fivefold train` (also under torchrun) gets `--train.steps=2 --optim.warmup_steps=1
  --data.max_bytes=20000 --no-progress` appended (the command line's last value wins): two steps
  instead of hundreds (warmup must fit in them: debug.toml warms up for 20) on 20 kB of the
  standard library rather than 4 MB read and tokenized, without a progress bar in a log. With
  `--resume` it is `--train.steps=4`, so the resumed run trains two steps more than the one it
  continues. `--train.stop_after=N` becomes `--train.stop_after=1` (N must not exceed the steps).
- A fresh run (no `--resume`) whose run directory an earlier command of the block wrote starts with
  that directory removed: the pages' commands are alternatives, and fivefold refuses a fresh run
  into a folder that holds checkpoints.
- A path `.../step_XXXXXXXX` (a run's checkpoint) names the shortened run's last checkpoint instead,
  `step_00000002` (the pages: `step_00000300`, the end of the 300 steps of configs/debug.toml).
- Process counts above 2 (`torchrun --nproc-per-node N`, `fivefold train --nproc N`) become 2: each
  process costs seconds of start-up on this 2-core machine (8 took 30 s). The command's
  configuration, as written, is first checked for its N processes in this process (`validate()`,
  what `fivefold train` checks before it starts anything), so the page's count stays tested.
- torchrun gets `--standalone` when no rendezvous is given: a free port, not 29500, which another
  test may hold.
- `fivefold calibrate` gets `--quick` (seconds instead of minutes of measurement).

What else is checked, without running anything:
- every repository path a page names (`fivefold/parallel/mesh.py`, `parallel/mesh.py` under
  fivefold/, `docs/planner.md`, or a bare module name such as `zero.py`) exists, outside the blocks
  that run (those write the files they name); NOT_IN_REPO lists the few names that are not ours;
- every relative link (`[planner](docs/planner.md#the-core)`) reaches a file and, with `#`, a heading;
- README.md stays at most README_WORDS words (`wc -w`): docs/ holds the reference;
- each example of README.md's command table is a command of a block on a page its row links to.
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

from fivefold.checkpoint.run_dir import run_dir_of
from fivefold.config.load import read_config
from fivefold.validate import validate


def _repo_root() -> Path:
    """The folder holding pyproject.toml above this file, wherever under tests/ the file lives."""
    return next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


ROOT = _repo_root()
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_WORDS = 2500
MARK = re.compile(r"^<!-- readme-test: (run|output|skip)(.*?) -->$")
FENCE = "```"

SHORT_TRAIN = ["--optim.warmup_steps=1", "--data.max_bytes=20000", "--no-progress"]  # and --train.steps
SHORT_STEPS, RESUMED_STEPS, STOP_AFTER, MAX_PROCS = 2, 4, 1, 2
TIMEOUT_S = 240


@dataclass
class Block:
    page: str  # the page's path from the repository root: README.md, docs/planner.md
    line: int  # of the opening fence, counted from 1
    text: list[str]
    mark: str | None  # run, output, skip, or None when unmarked
    detail: str  # skip's reason; run's "except N: REASON"; otherwise ""

    @property
    def where(self) -> str:
        """PAGE:LINE, the block's name in test ids and failures."""
        return f"{self.page}:{self.line}"


def page_name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def blocks(text: str, page: str = "README.md") -> list[Block]:
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        if not lines[i].startswith(FENCE):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == FENCE), None)
        assert end is not None, f"{page}:{i + 1}: the code block never closes"
        m = MARK.match(lines[i - 1].strip()) if i > 0 else None
        found.append(Block(page, i + 1, lines[i + 1:end], m and m.group(1), m.group(2).strip() if m else ""))
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
    assert m, (f"{block.where}: write the marker as 'run', 'run: NOTE' or 'run except N: REASON', "
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


ALL = [b for page in PAGES for b in blocks(page.read_text(), page_name(page))]


def test_every_block_is_marked():
    unmarked = [f"{b.where}: {b.text[0] if b.text else '(empty)'}" for b in ALL if b.mark is None]
    assert not unmarked, ("these code blocks have no marker on the line before (see tests/test_readme.py):\n"
                          + "\n".join(unmarked))
    for b in ALL:
        if b.mark == "skip":
            assert b.detail.startswith(": ") and b.detail[2:].strip(), f"{b.where}: skip without a reason"
        if b.mark == "run":
            skipped_commands(b)  # a well-formed marker
        if b.mark == "output":
            assert b.detail == "" and b.text and b.text[0].startswith("$ "), f"{b.where}: not `$ command`"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "run"], ids=lambda b: b.where)
def test_run_block(block, tmp_path):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    skip = skipped_commands(block)
    cmds = commands(block.text)
    assert cmds and skip <= set(range(1, len(cmds) + 1)), f"{block.where}: {skip} of {len(cmds)} commands"
    for n, command in enumerate(cmds, 1):
        if n in skip:
            continue
        argv = shorten(shlex.split(command, comments=True), tmp_path)
        out = run(argv, tmp_path)
        assert out.returncode == 0, (f"{block.where}, command {n}: {command.strip()}\nran as: "
                                     f"{shlex.join(argv)}\nexit status {out.returncode}\n"
                                     f"{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


@pytest.mark.parametrize("block", [b for b in ALL if b.mark == "output"], ids=lambda b: b.where)
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
        assert not missing, f"{block.where}: `{command}` did not print:\n" + "\n".join(missing) + \
            f"\nit printed (exit status {out.returncode}):\n{printed[-3000:]}"


# Paths a page names that are not files of this repository: torch's own files, a config the reader writes.
NOT_IN_REPO = {"torch/distributed/checkpoint/hf_storage.py", "filesystem.py", "default_planner.py",
               "configs/x.toml"}
PATH = re.compile(r"(?<![\w./<>*-])((?:[\w.-]+/)*[\w-]+\.(?:py|md|toml|sh))(?![\w/-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(page: Path) -> list[tuple[int, str]]:
    """The page's lines with their numbers, without the blocks that run (they name what they write)."""
    lines = page.read_text().splitlines()
    ran = {n for b in ALL if b.page == page_name(page) and b.mark in ("run", "output")
           for n in range(b.line, b.line + len(b.text) + 1)}
    return [(n, line) for n, line in enumerate(lines, 1) if n not in ran]


def _exists(path: str, names: set[str]) -> bool:
    if "/" not in path:  # a bare name: a module or page somewhere in the repository (`zero.py`)
        return path in names or path.endswith(".toml")  # a bare .toml is a run's file (config.toml)
    return (ROOT / path).exists() or (ROOT / "fivefold" / path).exists()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_named_paths_and_links_exist(page):
    names = {p.name for top in ("fivefold", "tests", "benchmarks", "docs", "scripts", "configs")
             for p in (ROOT / top).rglob("*")} | {p.name for p in ROOT.iterdir()}
    wrong = []
    for n, line in _prose(page):
        for path in PATH.findall(line):
            if path not in NOT_IN_REPO and not _exists(path, names):
                wrong.append(f"{page_name(page)}:{n}: {path} is no file of this repository")
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            if not linked.exists():
                wrong.append(f"{page_name(page)}:{n}: the link {target} reaches no file")
            elif anchor and linked.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", linked.read_text(), re.M)}
                if anchor not in headings:
                    wrong.append(f"{page_name(page)}:{n}: the link {target} reaches no heading")
    assert not wrong, "\n".join(wrong)


def test_readme_is_short():
    words = len(README.read_text().split())  # as `wc -w` counts them
    assert words <= README_WORDS, (f"README.md has {words} words, more than {README_WORDS}: it is the entry; "
                                   f"move reference text to a page of docs/ and link it")


def _command_table() -> list[tuple[int, str, list[str]]]:
    """README.md's `## Commands` table: (line, the example, the pages its row links)."""
    rows, inside = [], False
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("## "):
            inside = line == "## Commands"
        elif inside and line.startswith("| `"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            example = re.fullmatch(r"`(.+)`", cells[2])
            assert example, f"README.md:{n}: the example cell holds one `command`, not {cells[2]!r}"
            rows.append((n, example.group(1), [t.split("#")[0] for t in LINK.findall(cells[3])]))
    return rows


def test_command_table_examples_are_on_their_pages():
    rows = _command_table()
    assert len(rows) >= 10, f"README.md's command table has {len(rows)} rows"
    wrong = []
    for n, example, pages in rows:
        found = []
        for b in ALL:
            if b.page not in pages:
                continue
            lines = [line[2:] for line in b.text if line.startswith("$ ")] if b.mark == "output" else commands(b.text)
            found += [b for c in lines if shlex.split(c, comments=True) == shlex.split(example)]
        if not found:
            wrong.append(f"README.md:{n}: `{example}` is in no block of {', '.join(pages)}")
    assert not wrong, "\n".join(wrong)
