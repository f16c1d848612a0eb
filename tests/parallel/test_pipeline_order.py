"""Pipeline messages in an order every backend matches (fivefold.parallel.pipeline.messages). Pure Python.

NCCL matches the messages between two ranks by the order they are posted, ignoring tags: the
k-th send from a rank to a neighbour must be the k-th receive that neighbour posts from it, and
the batches each rank posts must complete without any message being buffered.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.parallel.pipeline.messages import (
    Batch,
    Message,
    MessageOrderError,
    check_plans,
    forward_schedule,
    incoming,
    message_plans,
    outgoing,
)
from fivefold.parallel.pipeline.schedules import SCHEDULES, Action, Schedule, build_schedule
from fivefold.parallel.pipeline.simulate import DeadlockError

REPO = Path(__file__).resolve().parents[2]


def _accepted(name: str, p: int) -> list[tuple[int, int]]:
    """(m, v) pairs validate() accepts for `name` at pp = p: m >= p, several of them."""
    if name == "interleaved_1f1b":
        return [(m, v) for m in (p, 2 * p, 3 * p) for v in (2, 4)]
    if name in ("zb_v", "dualpipe_v"):
        return [(m, 2) for m in (2 * p, 2 * p + 1, 3 * p, 4 * p + 1)]
    return [(m, 1) for m in (p, p + 1, 2 * p, 4 * p + 1)]


def _posted_at_production(schedule: Schedule) -> list[list[Batch]]:
    """What the executor posted before this plan existed: each send right after the action that
    produced it, each receive right before the action that uses it."""
    plans = []
    for seq in schedule.actions:
        batches = [Batch() for _ in range(len(seq) + 1)]
        for i, a in enumerate(seq):
            if (msg := incoming(schedule, a)) is not None:
                batches[i].recvs.append(msg)
            if (msg := outgoing(schedule, a)) is not None:
                batches[i + 1].sends.append(msg)
        plans.append(batches)
    return plans


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_pair_sends_in_its_receivers_order_and_nothing_deadlocks(name, p):
    for m, v in _accepted(name, p):
        schedule = build_schedule(name, p, m, v)
        plans = check_plans(schedule)  # raises on a mismatch or a deadlock
        for r, batches in enumerate(plans):  # every message the executor's actions touch is posted once
            assert len(batches) == len(schedule.actions[r]) + 1
            assert sorted(map(str, (msg for b in batches for msg in b.sends))) == sorted(
                str(msg) for a in schedule.actions[r] if (msg := outgoing(schedule, a)) is not None)
        forward, ends = forward_schedule(schedule, m)  # evaluation's forward-only pass
        check_plans(forward, message_plans(forward, ends))


@pytest.mark.parametrize("name,p,first", [
    ("zb_v", 2, (0, 1, 2, "activation of mb 2 from stage 0", "gradient of mb 0 from stage 3")),
    ("zb_v", 4, (0, 1, 6, "activation of mb 6 from stage 0", "gradient of mb 0 from stage 7")),
    ("zb_v", 8, (0, 1, 14, "activation of mb 14 from stage 0", "gradient of mb 0 from stage 15")),
    ("dualpipe_v", 4, (0, 1, 6, "activation of mb 6 from stage 0", "gradient of mb 0 from stage 7")),
    ("dualpipe_v", 8, (0, 1, 14, "activation of mb 14 from stage 0", "gradient of mb 0 from stage 15")),
])
def test_sending_in_production_order_mixes_messages_up(name, p, first):
    """Why the plan exists: the V schedules produce messages for a neighbour in another order than
    the neighbour uses them (same shape: on NCCL an activation would land where a gradient is due)."""
    src, dst, k, sent, wanted = first
    with pytest.raises(MessageOrderError) as info:
        check_plans(build_schedule(name, p, 2 * p), _posted_at_production(build_schedule(name, p, 2 * p)))
    assert f"rank {src}'s send #{k} to rank {dst} is the {sent}" in str(info.value)
    assert f"receives the {wanted}" in str(info.value)


@pytest.mark.parametrize("name,p,m,v", [("interleaved_1f1b", 2, 4, 2), ("interleaved_1f1b", 4, 8, 2),
                                        ("dualpipe_v", 2, 4, 2)])
def test_posting_in_use_order_deadlocks_without_buffering(name, p, m, v):
    """Even where the orders agree, posting each receive just before its action leaves two
    neighbours each in a send to the other (two directions between the same ranks): a deadlock on
    NCCL once messages exceed its buffers. The plan's early receives are what avoid it."""
    schedule = build_schedule(name, p, m, v)
    with pytest.raises(DeadlockError, match="posting its messages deadlocks"):
        check_plans(schedule, _posted_at_production(schedule))
    check_plans(schedule)


def test_plans_of_hand_made_schedules():
    # 1F1B at p = 2, m = 2 (rank 0: F0 F1 B0 B1, rank 1: F0 B0 F1 B1), on simulate()'s clock (F = 1,
    # B = 2): each send goes right after the action that made it; rank 1 receives activation 1,
    # made at t = 2, before its B0 (it is there already), and rank 0 posts the receive of
    # gradient 0 (t = 4) with the send of activation 1, before B0.
    s = build_schedule("1f1b", 2, 2)
    plans = check_plans(s)
    act = [Message("activation", i, 0, 0, 1) for i in range(2)]
    grad = [Message("gradient", i, 1, 1, 0) for i in range(2)]
    assert [(b.sends, b.recvs) for b in plans[0]] == [([], []), ([act[0]], []), ([act[1]], [grad[0]]), ([], [grad[1]]),
                                                      ([], [])]
    assert [(b.sends, b.recvs) for b in plans[1]] == [([], [act[0]]), ([], [act[1]]), ([grad[0]], []), ([], []),
                                                      ([grad[1]], [])]
    # A plan whose receiver swaps two messages of one pair is refused, naming the first mismatch.
    swapped = check_plans(s)
    swapped[1][0].recvs, swapped[1][1].recvs = [act[1], act[0]], []
    with pytest.raises(MessageOrderError, match="send #0 to rank 1 is the activation of mb 0"):
        check_plans(s, swapped)
    # A receive posted after the action that needs it is refused too.
    late = check_plans(s)
    late[1][0].recvs, late[1][1].recvs = [], [act[0]]
    with pytest.raises(MessageOrderError, match="needs activation of mb 0"):
        check_plans(s, late)


def test_v_layout_handovers_stay_on_the_rank():
    s = build_schedule("zb_v", 2, 4)
    assert s.stage_to_rank(1) == s.stage_to_rank(2) == 1
    assert outgoing(s, Action("F", 0, 1)) is None and incoming(s, Action("F", 0, 2)) is None
    assert incoming(s, Action("I", 0, 1)) is None and outgoing(s, Action("I", 0, 2)) is None
    assert outgoing(s, Action("I", 0, 3)) == Message("gradient", 0, 3, 0, 1)


def test_messages_module_does_not_import_torch():
    code = "import sys, fivefold.parallel.pipeline.messages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
