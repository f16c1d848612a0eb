"""parallel.ep_overlap: DualPipe's F&B pairs run at once on two lanes (pipeline/overlap.py), against
the same schedule run one action after the other."""

import pytest
import torch
from helpers import EQUIVALENCE, MOE_ARGS, tiny_config, train_and_gather

from fivefold.parallel.comm.timing import PARTS, _overlapped, _Span
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.pipeline.overlap import paired_plans
from fivefold.parallel.pipeline.schedules import dualpipe_v
from fivefold.parallel.pipeline.simulate import overlapped_pairs


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_paired_plans_match_and_complete(p):
    """Every pair of every rank posts nothing between its halves, and check_plans proves the moved
    plan (its strict model raises DeadlockError where a pair would wait on its own output). No pair
    holds a chunk's first forward or last backward, where data parallel gathers and reduces
    (pipeline/overlap.py): its collectives never run on the side lane."""
    for m in range(2 * p, 2 * p + 4):
        schedule = dualpipe_v(p, m)
        pairs, plans = paired_plans(schedule)
        assert pairs == overlapped_pairs(schedule) and all(pairs)
        for r, ks in enumerate(pairs):
            seq = schedule.actions[r]
            first = {a.stage: i for i, a in reversed(list(enumerate(seq))) if a.kind == "F"}
            last = {a.stage: i for i, a in enumerate(seq) if a.kind in ("B", "W")}
            for k in ks:
                assert not plans[r][k + 1].sends and not plans[r][k + 1].recvs
                assert seq[k].stage != seq[k + 1].stage
                assert first[seq[k].stage] != k and last[seq[k + 1].stage] != k + 1


def test_overlapped_lanes_are_charged_as_the_rank_spent_them():
    """A hand-made pair: the step thread computes [0, 10] with an ep wait [2, 6] inside, then waits
    for the side lane [10, 14]; the side lane computes [0, 14] with ep waits [4, 8] and [11, 13].
    The step thread's wait is hidden where the side lane computes ([2, 4]), exposed where both wait
    ([4, 6]); its wait for the side lane is exposed ep for [11, 13], compute for the rest."""
    spans, at = [], {}

    def span(part, lane, start, end, parent=None):
        s = _Span(None, part, "t", part, [], parent, lane)
        spans.append(s)
        at[id(s)] = (start, end)
        return s

    main = span("compute", "main", 0, 10)
    span("exposed_ep", "main", 2, 6, main)
    span("compute", "wait", 10, 14)
    side = span("compute", "side", 0, 14)
    span("exposed_ep", "side", 4, 8, side)
    span("exposed_ep", "side", 11, 13, side)
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(compute=6.0 + 4.0, exposed_ep=4.0)  # the step thread's exclusive times, as end_step sums them
    _overlapped(spans, at, parts)
    assert parts["exposed_ep"] == 2.0 + 2.0 and parts["compute"] == 10.0
    assert sum(parts.values()) == 14.0  # the step thread's wall time, still


def test_ep_overlap_trains_bit_for_bit_as_the_schedule_run_in_order(tmp_path):
    """pp2 x ep2 with ZeRO-1 under dualpipe_v, 3 steps: the losses, gradient norms and every parameter
    the same numbers with and without the pairs, every axis's calls and bytes equal, and the executed
    timeline shows each rank's pairs as one action, "F<mb>s<stage>&B<mb>s<stage>"."""
    from fivefold.train.metrics import read_metrics

    args = (*EQUIVALENCE, *MOE_ARGS, "--train.steps=3", "--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1",
            "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2", "--train.micro_batch=1")
    results, records = {}, {}
    for on in ("false", "true"):
        results[on] = run_workers(train_and_gather, 4, tiny_config(tmp_path / on, *args, f"--parallel.ep_overlap={on}"))
        records[on] = read_metrics(tmp_path / on / "tiny" / "metrics.jsonl")
    for ref, ours in zip(results["false"], results["true"], strict=True):
        assert ours[:2] == ref[:2]
        assert ours[2].keys() == ref[2].keys()
        for key, value in ref[2].items():
            assert torch.equal(ours[2][key], value), key
    assert [r["comm"] for r in records["true"]] == [r["comm"] for r in records["false"]]
    schedule = dualpipe_v(2, 4)  # 4 micro-batches: tiny.toml's batch over dp 2 at micro_batch 1
    timeline = records["true"][-1]["pipeline_timeline"]
    for r, row in enumerate(timeline):
        expected = [f"{a}&{schedule.actions[r][k + 1]}" if k in overlapped_pairs(schedule)[r] else str(a)
                    for k, a in enumerate(schedule.actions[r]) if k - 1 not in overlapped_pairs(schedule)[r]]
        assert [name for _, _, name in row] == expected


def test_the_report_draws_a_pair_as_one_overlapped_action():
    """The run report's executed timeline names a pair's kind in its legend (viz/report_plots.py)."""
    import base64

    from fivefold.viz.report_plots import timeline_figure

    url = timeline_figure([[[0.0, 0.001, "F0s0"], [0.001, 0.003, "F1s0&B0s3"]]])
    svg = base64.b64decode(url.split(",", 1)[1]).decode()
    assert "a forward and a backward overlapped" in svg and "backward (input grad)" not in svg
