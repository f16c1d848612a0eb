"""Bytes one rank sends for a collective under the bandwidth-optimal ring algorithm.

The one formula both sides use: the running code counts its traffic with it (comm/collectives.py) and the
planner predicts with it (planner/comm.py), so a prediction and a measurement are the same
quantity. Pure Python, so that the planner does not import torch.
"""

from __future__ import annotations


def wire_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for collective `op` over n ranks on a tensor of nbytes (the full size)."""
    if n <= 1:
        return 0.0
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
        "send": 1.0,
    }[op]
    return factor * nbytes
