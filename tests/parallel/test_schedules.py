"""Tests for pipeline schedules (fivefold.parallel.pipeline.schedules) and their pictures.

Pure Python apart from the optional PyTorch oracle, which only builds
PyTorch's schedule objects (no process group, no tensors)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from fivefold.parallel.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    build_schedule,
    dualpipe_v,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_v,
)
from fivefold.parallel.pipeline.simulate import Costs, DeadlockError, simulate

REPO = Path(__file__).resolve().parents[2]


def idle_total(result) -> float:
    return sum(result.idle)


# ---------------------------------------------------------------- bubbles

@pytest.mark.parametrize("p,m", [(2, 4), (3, 7), (4, 3), (4, 8), (8, 32)])
@pytest.mark.parametrize("gen", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubble_formulas(gen, p, m):
    # F = B = 1, and also the usual B = 2F: both bubble figures do not depend on it.
    for costs in (Costs(f=1, b=1), Costs(f=1, b=2)):
        r = simulate(gen(p, m), costs)
        assert r.bubble_ratio == pytest.approx((p - 1) / m)
        assert r.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert r.makespan == pytest.approx((m + p - 1) * (costs.f + costs.b))


def test_anchor_figures_p8_m32():
    # p = 8, m = 32: (p-1)/m = 21.9 % of compute, (p-1)/(m+p-1) = 17.9 % of wall-clock (docs/pipeline-schedules.md).
    for name in ("gpipe", "1f1b"):
        r = simulate(build_schedule(name, 8, 32), Costs(f=1, b=1))
        assert r.bubble_ratio == pytest.approx(0.21875)
        assert round(100 * r.bubble_fraction, 1) == 17.9


@pytest.mark.parametrize("p,m,v", [(2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 12, 4), (8, 32, 4)])
def test_interleaved_bubble_divided_by_v(p, m, v):
    # Each chunk is 1/v of a rank's layers, so it costs 1/v of a full stage.
    r = simulate(interleaved_1f1b(p, m, v), Costs(f=1 / v, b=1 / v))
    assert r.bubble_ratio == pytest.approx((p - 1) / (v * m))


def test_interleaved_anchor_p8_m32_v4():
    r = simulate(interleaved_1f1b(8, 32, 4), Costs(f=0.25, b=0.25))
    assert round(100 * r.bubble_ratio, 2) == 5.47


@pytest.mark.parametrize("p,m", [(2, 4), (3, 5), (4, 8), (8, 32)])
def test_zb_h1_bubble_is_one_third_of_1f1b(p, m):
    """Exact comparison: total idle time (summed over ranks) of ZB-H1 with
    F = I = W = 1 equals one third of 1F1B's with F = 1, B = I + W = 2. Both do
    the same work, so the bubble ratio is also exactly one third (Qi et al. 2023:
    (p-1)(F+I-W) versus (p-1)(F+I+W) per rank)."""
    zb = simulate(zero_bubble_h1(p, m), Costs(f=1, b=2, i=1, w=1))
    ref = simulate(one_f_one_b(p, m), Costs(f=1, b=2))
    assert zb.busy == pytest.approx(ref.busy)
    assert idle_total(zb) == pytest.approx(idle_total(ref) / 3)
    assert zb.bubble_ratio == pytest.approx(ref.bubble_ratio / 3)
    # ... at no extra peak memory: the worst rank holds p micro-batches either way.
    assert max(zb.peak_inflight) == max(ref.peak_inflight) == p
    # Activations are counted until W, so the deferred W's make every rank reach p.
    assert zb.peak_inflight == [p] * p


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_zb_v_halves_zb_h1s_bubble_at_the_same_memory(p, m):
    """ZB-V's chunks are half a stage, so F = I = W = 0.5 per chunk does the same work as ZB-H1
    with F = I = W = 1: its bubble is half of ZB-H1's (a sixth of 1F1B's), and every rank holds
    2p half-stage chunks, i.e. the p stages' worth that 1F1B's first rank holds."""
    zbv = simulate(zero_bubble_v(p, m), Costs(f=0.5, b=1, i=0.5, w=0.5))
    zbh1 = simulate(zero_bubble_h1(p, m), Costs(f=1, b=2, i=1, w=1))
    assert zbv.busy == pytest.approx(zbh1.busy)
    assert zbv.bubble_ratio == pytest.approx(zbh1.bubble_ratio / 2)
    assert zbv.peak_inflight == [2 * p] * p


def test_dualpipe_v_beats_1f1b_at_same_work():
    # Not a paper formula; guards against a regression that would make the V worse
    # than the plain schedule it is meant to improve on.
    for p, m in ((4, 8), (8, 32)):
        dpv = simulate(dualpipe_v(p, m), Costs(f=0.5, b=1.0))
        ref = simulate(one_f_one_b(p, m), Costs(f=1, b=2))
        assert dpv.bubble_ratio < simulate(zero_bubble_h1(p, m)).bubble_ratio < ref.bubble_ratio
        assert dpv.makespan < ref.makespan


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("m_per_p", [2, 3, 5])
@pytest.mark.parametrize("f, b, w, fb", [(1.0, 2.0, 1.0, 3.0), (1.0, 2.0, 0.5, 3.0), (1.0, 3.0, 1.0, 4.0),
                                         (1.0, 2.0, 1.0, 2.5), (1.0, 2.0, 0.5, 2.2), (1.0, 2.0, 0.0, 3.0)])
def test_dualpipe_v_bubble_is_deepseeks_formula_when_pairs_start_together(p, m_per_p, f, b, w, fb):
    # DeepSeek-V3 technical report (2024), Table 2, and the DualPipe repository's README for DualPipeV:
    # bubble (PP/2 - 1)(F&B + B - 3W), PP the number of stages. Mapped onto dualpipe_v: PP = 2p stages
    # on p ranks (rank r holds stages r and 2p-1-r), F, B, W one chunk's times, F&B the overlapped
    # pair's. The bubble is the rank that waits most (makespan - its busy time, pairs at F&B).
    res = simulate(dualpipe_v(p, m_per_p * p), Costs(f=f, b=b, w=w, fb=fb))
    assert max(res.idle) == pytest.approx((2 * p / 2 - 1) * (fb + b - 3 * w), abs=1e-9)


def test_dualpipe_v_run_as_fivefold_runs_it_waits_less_than_the_paired_formula():
    # fivefold's executor runs a pair as F then B: the F may start before the B's gradient has arrived,
    # which a pair started together cannot. At F = W = B/2 the bubble halves: (p-1) F, not 2 (p-1) F.
    for p in (2, 4, 8):
        unpaired = simulate(dualpipe_v(p, 4 * p), Costs(f=1.0, b=2.0))
        paired = simulate(dualpipe_v(p, 4 * p), Costs(f=1.0, b=2.0, fb=3.0))
        assert max(unpaired.idle) == pytest.approx(p - 1) and max(paired.idle) == pytest.approx(2 * (p - 1))


def test_comm_latency_is_added_on_cross_rank_edges():
    # GPipe: the fill and the drain each cross p-1 links.
    p, m, c = 4, 8, 0.5
    r = simulate(gpipe(p, m), Costs(f=1, b=1, comm=c))
    assert r.makespan == pytest.approx(2 * m + 2 * (p - 1) * (1 + c))
    # DualPipeV's turn at the bottom of the V (stage p-1 -> p) is on one rank: no comm.
    s = dualpipe_v(2, 4)
    assert s.stage_to_rank(1) == s.stage_to_rank(2) == 1


# ---------------------------------------------------------------- memory

@pytest.mark.parametrize("p,m", [(2, 2), (4, 4), (4, 9), (8, 32)])
def test_activation_memory(p, m):
    assert simulate(one_f_one_b(p, m)).peak_inflight == [p - r for r in range(p)]
    assert simulate(gpipe(p, m)).peak_inflight == [m] * p


# ---------------------------------------------------------------- correctness

def _check_timeline(s: Schedule, costs: Costs) -> None:
    r = simulate(s, costs)
    start, end = {}, {}
    for rank, events in enumerate(r.timeline):
        assert [a for _, _, a in events] == s.actions[rank], "timeline must follow list order"
        for (_, e0, _), (s1, _, _) in zip(events, events[1:], strict=False):
            assert e0 <= s1 + 1e-9, "a rank runs one action at a time"
        for t0, t1, a in events:
            start[a.kind, a.microbatch, a.stage], end[a.kind, a.microbatch, a.stage] = t0, t1
    for mb in range(s.microbatches):
        for st in range(s.num_stages):
            bwd = "B" if ("B", mb, st) in start else "I"
            assert end["F", mb, st] <= start[bwd, mb, st] + 1e-9
            if st > 0:
                assert end["F", mb, st - 1] <= start["F", mb, st] + 1e-9
            if st < s.num_stages - 1:
                up = "B" if ("B", mb, st + 1) in end else "I"
                assert end[up, mb, st + 1] <= start[bwd, mb, st] + 1e-9
            if bwd == "I":
                assert end["I", mb, st] <= start["W", mb, st] + 1e-9
    assert r.makespan == pytest.approx(max(end.values()))


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_schedule_runs_and_respects_dependencies(name, p):
    v = 2 if name in ("interleaved_1f1b", "dualpipe_v", "zb_v") else 1
    ms = [m for m in (1, 2, 3, p, 2 * p, 3 * p, 4 * p + 1)
          if not (name == "interleaved_1f1b" and m % p) and not (name in ("dualpipe_v", "zb_v") and m < 2 * p)]
    for m in ms:
        s = build_schedule(name, p, m, v)
        for costs in (Costs(), Costs(f=1, b=1, comm=0.3), Costs(f=2, b=1, i=0.2)):
            _check_timeline(s, costs)


def test_action_str_and_placement():
    assert str(Action("F", 3, 1)) == "F3s1"
    s = interleaved_1f1b(4, 8, 2)
    assert [s.stage_to_rank(st) for st in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    v = dualpipe_v(4, 8)
    assert [v.stage_to_rank(st) for st in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]


def test_hand_made_deadlock_is_reported():
    # Rank 0 wants B0's gradient before it sends F1; rank 1 wants F1 before B0.
    acts = [
        [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0)],
        [Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1)],
    ]
    with pytest.raises(DeadlockError) as info:
        simulate(Schedule("bad", 2, 2, 1, acts))
    assert info.value.blocked == {0: Action("B", 0, 0), 1: Action("F", 1, 1)}
    assert "rank 0" in str(info.value) and "rank 1" in str(info.value)
    # A weight gradient cannot run before its input gradient on the same rank.
    w_first = [[Action("F", 0, 0), Action("W", 0, 0), Action("I", 0, 0)]]
    with pytest.raises(DeadlockError, match="W0s0"):
        simulate(Schedule("w_first", 1, 1, 1, w_first))


def test_malformed_schedules_are_rejected():
    missing_bwd = [[Action("F", 0, 0), Action("B", 0, 0)], [Action("F", 0, 1)]]
    with pytest.raises(ValueError, match="exactly one F"):
        simulate(Schedule("x", 2, 1, 1, missing_bwd))
    i_without_w = [[Action("F", 0, 0), Action("I", 0, 0)]]
    with pytest.raises(ValueError, match="exactly one F"):
        simulate(Schedule("x", 1, 1, 1, i_without_w))
    wrong_rank = [[Action("F", 0, 1), Action("B", 0, 1)], [Action("F", 0, 0), Action("B", 0, 0)]]
    with pytest.raises(ValueError, match="lives on rank"):
        simulate(Schedule("x", 2, 1, 1, wrong_rank))


def test_build_schedule_errors_name_the_fix():
    with pytest.raises(ValueError) as info:
        build_schedule("pipedream", 4, 8)
    for name in SCHEDULES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"m % p == 0.*m=8"):
        build_schedule("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="m >= 8"):
        build_schedule("dualpipe_v", 4, 7)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        build_schedule("1f1b", 4, 8, 2)


def test_costs_split_backward():
    assert (Costs(b=2).duration("I"), Costs(b=2).duration("W")) == (1, 1)
    assert Costs(b=3, w=2).duration("I") == 1
    assert Costs(b=3, i=0.5).duration("W") == 2.5


def test_schedules_module_does_not_import_torch():
    code = "import sys, fivefold.parallel.pipeline.schedules; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- PyTorch oracle

class _FakeStage:
    """Just the attributes PyTorch's multi-stage schedule constructors read
    (group size/rank, stage count, submod for the torch.compile check); the
    constructors also write stage_index_to_group_rank onto it."""

    def __init__(self, index: int, num_stages: int, p: int):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = p, 0
        self.submod = None
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


def _torch_order(cls, p: int, m: int, v_layout: bool, per_rank: int = 2) -> list[list[Action]]:
    # Rank 0's stages (two, or one); every rank's order is computed in the constructor.
    stages = ([_FakeStage(0, 2 * p, p), _FakeStage(2 * p - 1 if v_layout else p, 2 * p, p)] if per_rank == 2
              else [_FakeStage(0, p, p)])
    sched = cls(stages, m, loss_fn=lambda out, target: out)
    order = []
    for rank in range(p):
        seq = []
        for a in sched.pipeline_order[rank]:
            if a is None:  # PyTorch pads with None to align time steps
                continue
            # DualPipeV's OVERLAP_F_B runs an F and a B together; we list them in order.
            for sub in a.sub_actions or (a,):
                seq.append(Action(sub.computation_type.value, sub.microbatch_index, sub.stage_index))
        order.append(seq)
    return order


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("m_per_p", [2, 3])
def test_against_pytorch_pipelining_orders(p, m_per_p):
    """PyTorch's pipeline_order, obtained without a process group, equals ours per rank:
    ScheduleInterleaved1F1B (v=2) == interleaved_1f1b, ScheduleInterleavedZeroBubble with one stage
    per rank == zero_bubble_h1, ScheduleZBVZeroBubble == zero_bubble_v, and ScheduleDualPipeV ==
    dualpipe_v once each OVERLAP_F_B is flattened to its F then its B (benchmarks/pipeline_parallel.py
    compares each pair's speed on this ground).
    (ZB-V and DualPipeV share the V placement but not the order: under unit costs ZB-V peaks at
    2p chunk activations per rank, DualPipeV at 2p + 1.)
    """
    sched_mod = pytest.importorskip("torch.distributed.pipelining.schedules")
    m = m_per_p * p
    assert _torch_order(sched_mod.ScheduleInterleaved1F1B, p, m, False) == interleaved_1f1b(p, m, 2).actions
    zb1p = _torch_order(sched_mod.ScheduleInterleavedZeroBubble, p, m, False, per_rank=1)
    assert zb1p == zero_bubble_h1(p, m).actions
    assert _torch_order(sched_mod.ScheduleZBVZeroBubble, p, m, True) == zero_bubble_v(p, m).actions
    assert _torch_order(sched_mod.ScheduleDualPipeV, p, m, True) == dualpipe_v(p, m).actions
    unit = Costs(f=1, b=2, i=1, w=1)
    assert simulate(zero_bubble_v(p, m), unit).peak_inflight == [2 * p] * p
    assert simulate(dualpipe_v(p, m), unit).peak_inflight == [2 * p + 1] * p


# ---------------------------------------------------------------- pictures

def test_draw_schedule_writes_png_and_svg(tmp_path):
    from fivefold.viz.schedule import draw_schedule
    s = zero_bubble_h1(4, 8)
    png, svg = draw_schedule(simulate(s), s, tmp_path / "zb")
    assert (png, svg) == (tmp_path / "zb.png", tmp_path / "zb.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    text = svg.read_text()
    assert "<svg" in text and "zb_h1" in text and "12.50%" in text


def test_viz_cli(tmp_path, capsys):
    from fivefold.viz.schedule import add_schedule_parser
    parser = argparse.ArgumentParser()
    add_schedule_parser(parser.add_subparsers())
    args = parser.parse_args(["schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8",
                              "--costs", "1,1", "--out", str(tmp_path / "s")])
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "37.50%" in out and "27.27%" in out and "[4, 3, 2, 1]" in out
    assert (tmp_path / "s.png").stat().st_size > 0 and (tmp_path / "s.svg").stat().st_size > 0
    bad = parser.parse_args(["schedule", "--schedule", "interleaved_1f1b", "--pp", "4",
                             "--microbatches", "6", "--virtual-stages", "2"])
    assert bad.run(bad) == 2
    assert "m % p == 0" in capsys.readouterr().err
