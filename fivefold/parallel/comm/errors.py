"""A failed collective or message, named: the rank, the operation and its bytes, the axis in the
user's words, and for a timeout the ranks of the group that never arrived (parallel/comm/arrivals.py).

comm/collectives.py raises these: a collective whose peers do not answer within the group's timeout
(`parallel.collective_timeout_s`), or whose peer's connection drops, becomes a `CollectiveError`
instead of the backend's anonymous message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch.distributed as dist

from fivefold.parallel.comm.arrivals import Arrivals


class AxisGroup(Protocol):
    """What a message needs of comms.AxisGroup (named here by its fields: comms imports this module)."""

    name: str
    label: str
    pg: dist.ProcessGroup | None
    size: int
    rank: int
    timeout_s: float | None
    arrivals: Arrivals | None


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message says which, where, and the likely cause.
    `missing`: global rank -> why it never arrived, for the peers a timeout could name."""

    def __init__(self, message: str, missing: dict[int, str] | None = None):
        super().__init__(message)
        self.missing = missing or {}


def group_name(group: AxisGroup) -> str:
    """The process group's name, the same on every rank of it (pg None: the default group)."""
    return (group.pg if group.pg is not None else dist.group.WORLD).group_name


def where(group: AxisGroup, label: str) -> str:
    """The group in the user's words first: its axis (`dp`), then the internal view's name (`grad`:
    dp x cp for the gradients) only when it differs; a call charged to "log" (a metrics reduction, a
    barrier, an object gather: not training's traffic) says so."""
    if group.label == "log":  # the group of every rank: the metrics log's and the run's coordination
        return f"the '{group.name}' group (metrics and coordination)"
    axis = f"axis '{group.label}'" + (f" (its '{group.name}' group)" if group.name != group.label else "")
    return axis + (", for metrics or coordination" if label == "log" else "")


def named_error(error: RuntimeError, op: str, group: AxisGroup, nbytes: int, label: str,
                call: int | None = None) -> RuntimeError:
    """The backend's error as a CollectiveError naming the call, or unchanged if it is another kind.
    `call`: the collective's number on its group (comm/collectives.py counts them), for naming the peers that
    never came."""
    text = str(error)
    lowered = text.lower()
    missing: dict[int, str] = {}
    if "timed out" in lowered or "timeout" in lowered:
        waited = f"{group.timeout_s:g} s" if group.timeout_s is not None else "torch's default timeout"
        what = f"got no answer within {waited} (parallel.collective_timeout_s)"
        if call is not None and group.arrivals is not None:
            with contextlib.suppress(Exception):  # the store gone too: the message names no one
                members = dist.get_process_group_ranks(group.pg if group.pg is not None else dist.group.WORLD)
                missing = group.arrivals.missing(group_name(group), members, call)
    elif "closed by peer" in lowered or "reset by peer" in lowered or "broken pipe" in lowered:
        what = "lost the connection to a peer"
    else:
        return error
    axis = where(group, label)
    if missing:
        cause = "Never arrived: " + "; ".join(f"rank {r} {why}" for r, why in sorted(missing.items())) + "."
    else:
        cause = ("Another rank of that group most likely died (look for the first error in the other ranks' "
                 "output) or took another code path and never made this call (a rank-dependent branch, an "
                 "exception caught on one rank).")
    size = f" of {nbytes:,} bytes" if nbytes else ""  # a barrier's or an object gather's: none, or unknown
    return CollectiveError(
        f"rank {dist.get_rank()}: {op}{size} on {axis} (rank {group.rank} of {group.size} "
        f"there) {what}. {cause} Backend: {text.splitlines()[0] if text else type(error).__name__}", missing)


@contextlib.contextmanager
def named_errors(op: str, group: AxisGroup, nbytes: int) -> Iterator[None]:
    """A timeout or a lost peer inside the block is raised as a CollectiveError naming `op`."""
    try:
        yield
    except RuntimeError as e:
        named = named_error(e, op, group, nbytes, group.label)
        if named is e:
            raise
        raise named from e
