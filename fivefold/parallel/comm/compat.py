"""The torch versions fivefold runs on, and the one place that picks the names each of them has.

fivefold runs on torch 2.11 through 2.13 (pyproject.toml states the range; the CPU install the
tests run on pins 2.13.0). What differs between them, for the code here:

- the flat all-gather and reduce-scatter: torch 2.13 names them `all_gather_single` and
  `reduce_scatter_single` and deprecates the older `all_gather_into_tensor` and
  `reduce_scatter_tensor` (a FutureWarning on every call); torch 2.11 and 2.12 have only the older
  names. Same arguments, same semantics: the newer name where the running torch has it, else the
  older one, looked up at each call (a lookup costs nothing beside a collective, and a test that
  hides a name from a running worker sees the fallback taken).

Everything else fivefold calls exists in torch 2.11 (the suite's collectives, ZeRO-3 and
sequence-parallel runs were run on torch 2.11.0 as well as on 2.13.0). An older torch is refused
where a command or a training run starts (`require_supported_torch`), with one line naming the
version needed, instead of failing at its first collective. The check reads the installed torch's
version without importing it: a command refused for its config (a dry run's layout) stays free of
torch's seconds of import.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch.distributed as dist

MIN_TORCH = (2, 11)

# The flat collectives: op -> (torch 2.13's name, the name torch 2.11 and 2.12 have).
FLAT_COLLECTIVES = {"all_gather": ("all_gather_single", "all_gather_into_tensor"),
                    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor")}


def collective_name(op: str) -> str:
    """The torch.distributed function that runs the flat `op` ("all_gather", "reduce_scatter") on this torch."""
    import torch.distributed as dist

    newer, older = FLAT_COLLECTIVES[op]
    return newer if hasattr(dist, newer) else older


def flat_collective(op: str) -> Callable[..., dist.Work | None]:
    """torch.distributed's flat `op` under the name this torch gives it: all_gather(output, input, group=,
    async_op=) and reduce_scatter(output, input, op=, group=, async_op=), as in every version supported."""
    import torch.distributed as dist

    return getattr(dist, collective_name(op))


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: "2.11.0+cu130" -> (2, 11), "2.13.0a0+git1234" -> (2, 13)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def torch_version() -> str:
    """The running torch's version: torch.__version__ once imported, else its installed package's
    (a torch built in place, with no package metadata, is imported to ask it)."""
    if "torch" not in sys.modules:
        try:
            return importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            import torch  # noqa: F401 - only to read its version
    return sys.modules["torch"].__version__


def torch_problem(version: str | None = None) -> str | None:
    """Why this torch (or `version`) cannot run fivefold, in one line; None when it can."""
    version = version or torch_version()
    if version_tuple(version) >= MIN_TORCH:
        return None
    need = ".".join(map(str, MIN_TORCH))
    return (f"fivefold needs torch >= {need} (this is torch {version}): install torch {need} to 2.13, "
            f"e.g. pip install 'torch>={need},<2.14'")


class UnsupportedTorch(RuntimeError):
    """The running torch is older than fivefold supports."""


def require_supported_torch() -> None:
    """Raise UnsupportedTorch, with one line, when the running torch is older than fivefold supports."""
    problem = torch_problem()
    if problem is not None:
        raise UnsupportedTorch(problem)
