"""Ring all-reduce, step by step: the chunk schedule of parallel/comm/ring.py replayed on small integers.

Rank r starts with a tensor cut into n chunks; chunk c holds the integer `start_value(r, c)`. Each
step applies `ring_all_reduce_schedule(n)` (the schedule the send/recv executor runs): every rank
sends one chunk to its right neighbour and receives one from its left, adding it during
reduce-scatter and overwriting during all-gather. After the last step every rank's chunks are
compared with the direct sum over ranks.
"""

from __future__ import annotations

from typing import Any

from fivefold.parallel.comm.ring import ring_all_reduce_schedule
from fivefold.parallel.comm.wire import wire_bytes
from fivefold.viz.explain.page import Control, Page

RANKS = (2, 3, 4, 5, 6, 8)


def start_value(rank: int, chunk: int) -> int:
    """A small, uneven integer per (rank, chunk), so every partial sum is told apart by eye."""
    return 1 + (3 * rank + 5 * chunk + rank * chunk) % 9


def replay(n: int) -> list[dict[str, Any]]:
    """The state before the first step and after each step of the ring all-reduce of n ranks.

    Each state: "values" [rank][chunk], "ranks" [rank][chunk] (the ranks whose contribution the
    value holds, sorted), and for steps "phase", "sends" [rank] = {to, chunk, value} (what rank
    sent, taken before the step: all ranks send at once) and "received" [rank] = chunk.
    """
    values = [[start_value(r, c) for c in range(n)] for r in range(n)]
    holds = [[{r} for _ in range(n)] for r in range(n)]
    states: list[dict[str, Any]] = [{"phase": "start", "values": [row[:] for row in values],
                                     "ranks": [[[r] for _ in range(n)] for r in range(n)],
                                     "sends": [], "received": []}]
    schedule = ring_all_reduce_schedule(n)
    for s, steps in enumerate(schedule):
        reduce_phase = s < n - 1
        sent = [(values[st.rank][st.send_chunk], set(holds[st.rank][st.send_chunk])) for st in steps]
        for st in steps:
            value, contributors = sent[st.recv_from]
            # The sender's chunk is the one this rank receives: the schedule pairs them.
            assert steps[st.recv_from].send_chunk == st.recv_chunk
            if reduce_phase:
                values[st.rank][st.recv_chunk] += value
                holds[st.rank][st.recv_chunk] |= contributors
            else:
                values[st.rank][st.recv_chunk] = value
                holds[st.rank][st.recv_chunk] = set(contributors)
        states.append({
            "phase": "reduce-scatter" if reduce_phase else "all-gather",
            "values": [row[:] for row in values],
            "ranks": [[sorted(h) for h in row] for row in holds],
            "sends": [{"to": st.send_to, "chunk": st.send_chunk, "value": sent[st.rank][0]} for st in steps],
            "received": [st.recv_chunk for st in steps],
        })
    return states


def direct_sum(n: int) -> list[int]:
    """What an all-reduce must give for each chunk: the sum over ranks, computed directly."""
    return [sum(start_value(r, c) for r in range(n)) for c in range(n)]


def entry(n: int) -> dict[str, Any]:
    states = replay(n)
    total = direct_sum(n)
    final = states[-1]["values"]
    for k, state in enumerate(states):
        # Chunks this rank has sent so far, as a fraction of the whole tensor S (n chunks).
        state["sent_fraction"] = k / n
    return {"n": n, "states": states, "direct_sum": total,
            "matches": [row == total for row in final],
            # The bytes comms.wire_bytes charges an all-reduce of S = 1 byte: 2(n-1)/n.
            "wire_fraction": wire_bytes("all_reduce", 1, n)}


def page() -> Page:
    steps = tuple(range(2 * max(RANKS) - 1))
    return Page(
        slug="ring_allreduce", title="Ring all-reduce, step by step",
        summary="every rank sends one chunk and receives one per step; the result checked against a direct sum",
        intro=("<p>Each of n ranks holds a tensor cut into n chunks (the numbers). In the ring, rank r only "
               "sends to rank r+1 and receives from rank r-1. During <b>reduce-scatter</b> (n-1 steps) a "
               "received chunk is added to the rank's own; after it each rank holds one chunk summed over all "
               "ranks. During <b>all-gather</b> (n-1 steps) the finished chunks travel on and overwrite, until "
               "every rank holds every sum. Move the step slider.</p>"),
        controls=[Control("n", "ranks n", RANKS, default=4),
                  Control("step", "step", steps, kind="slider", default=0, keyed=False)],
        entry=entry, script="ring.js",
        body=('<div class="numbers">'
              '<div class="number"><span class="label">phase</span><span class="value" id="phase"></span></div>'
              '<div class="number"><span class="label">chunks sent per rank so far</span>'
              '<span class="value" id="sent"></span></div>'
              '<div class="number"><span class="label">bytes sent per rank so far (tensor = S)</span>'
              '<span class="value" id="sent-fraction"></span></div>'
              '<div class="number key"><span class="label">after the last step, per rank</span>'
              '<span class="value" id="wire-fraction"></span></div></div>'
              '<div style="display:flex;gap:24px;flex-wrap:wrap;align-items:flex-start">'
              '<svg id="ring" width="260" height="260" viewBox="0 0 300 300" role="img" '
              'aria-label="ranks on a ring"></svg><div><table class="grid" id="chunks"></table>'
              '<p id="check"></p></div></div>'
              '<div class="legend"><span><span class="swatch" style="background:#c9daf8"></span>chunk sent '
              'this step</span><span><span class="swatch" style="background:var(--hl)"></span>chunk received '
              'this step</span><span><b>bold</b>: holds all n ranks\' contributions</span>'
              '<span>small text: the ranks summed in it</span></div>'),
        notes=("<p>The schedule is <code>ring_all_reduce_schedule(n)</code> in "
               "<code>fivefold/parallel/comm/ring.py</code>, the one its send/recv executor runs: "
               "at reduce-scatter step s rank r sends chunk "
               "(r-s-1) mod n and receives chunk (r-s-2) mod n; at all-gather step s it sends (r-s) mod n. "
               "The final figure is <code>comms.wire_bytes(\"all_reduce\", S, n)</code>: 2(n-1)/n of S, below "
               "2S however many ranks there are.</p>"))
