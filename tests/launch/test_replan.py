"""The layout an elastic job takes for a new world (fivefold/launch/elastic.py), against hand arithmetic, and the
SIGTERM that stops every rank at the same step (train/stop_request.py). No launcher here: test_elastic.py."""

import json
import os
import signal

import pytest
import torch.distributed as dist
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.config.load import replace
from fivefold.data.resolve import unpadded_vocab
from fivefold.launch.elastic import AXES, Policy, ReplanError, decide, layout_for, layout_text, parse_keep
from fivefold.parallel.comm.collectives import AxisGroup, CommStats
from fivefold.parallel.forked_ranks import run_workers
from fivefold.planner.hardware import get_hardware
from fivefold.planner.search import search
from fivefold.planner.selfcheck import predict_for_config
from fivefold.train.stop_request import StopRequest
from fivefold.validate import validate

DATA = ("--data.max_bytes=1100", "--data.val_fraction=0.0")


def _layout(cfg, world):
    d = derive(cfg, world, unpadded_vocab(cfg))
    p = cfg.parallel
    return {"dp": d.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "micro_batch": cfg.train.micro_batch,
            "grad_accum": d.grad_accum}


@pytest.mark.parametrize("world, micro_batch, grad_accum", [(2, 3, 2), (1, 4, 3), (6, 2, 1), (4, 3, 1)])
def test_the_global_batch_stays_and_the_micro_batch_shrinks_only_where_it_must(tmp_path, world, micro_batch,
                                                                              grad_accum):
    """Megatron-LM's count of micro-batches per step, m = B / (b x d) (Narayanan et al., SC'21, sec. 2.2):
    B = 12 written for d = 3 with b = 4. On 2 ranks B/d = 6, which 4 does not divide: b = 3 (its largest
    divisor below 4), m = 12 / (3 x 2) = 2. On 1 rank 4 divides 12: b = 4, m = 3. On 6: b = 2, m = 1.
    On 4: b = 3, m = 1."""
    cfg = tiny_config(tmp_path, *DATA, "--train.global_batch=12", "--train.micro_batch=4")
    new = layout_for(cfg, world, Policy(launch_world=3))
    assert _layout(new, world) == {"dp": world, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "micro_batch": micro_batch,
                                   "grad_accum": grad_accum}
    assert new.train.global_batch == 12 and new.train.steps == cfg.train.steps and new.optim.lr == cfg.optim.lr
    assert validate(new, world) == []


def test_the_written_layout_on_the_written_world_and_the_same_answer_every_time(tmp_path):
    cfg = tiny_config(tmp_path, *DATA, "--parallel.tp=2")
    assert layout_for(cfg, 4, Policy(4)) is cfg  # grown back: the config as written
    assert layout_for(cfg, 2, Policy(4)) == layout_for(cfg, 2, Policy(4))  # pure: every rank reaches it


@pytest.mark.parametrize("world, keep, expected", [
    (4, ("pp",), {"tp": 2, "pp": 2, "dp": 1}),  # tp4 pp2 needs 8; tp 4 -> 2 (its largest divisor that fits)
    (4, ("tp",), {"tp": 4, "pp": 1, "dp": 1}),
    (4, (), {"tp": 4, "pp": 1, "dp": 1}),  # tp4 pp1 and tp2 pp2 both use 4: the earlier axis stays larger
    (2, ("pp",), {"tp": 1, "pp": 2, "dp": 1}),
    (2, (), {"tp": 2, "pp": 1, "dp": 1}),
])
def test_axes_not_kept_shrink_to_the_largest_divisors_that_fit(tmp_path, world, keep, expected):
    cfg = tiny_config(tmp_path, *DATA, "--parallel.tp=4", "--parallel.pp=2")
    new = layout_for(cfg, world, Policy(8, keep))
    assert {a: v for a, v in _layout(new, world).items() if a in expected} == expected


def test_a_kept_layout_that_does_not_fit_the_ranks_left_is_refused_naming_axes_and_ranks(tmp_path):
    cfg = tiny_config(tmp_path, *DATA, "--parallel.tp=4", "--parallel.pp=2")
    with pytest.raises(ReplanError, match=r"re-plan for 4 ranks keeping tp=4, pp=2, cp=1, ep=1 \(the default: "
                                          r"only dp changes\): tp x pp x cp = 8 does not divide 4 ranks"):
        layout_for(cfg, 4, Policy(8))
    with pytest.raises(ReplanError, match=r"keeping tp=4 \(--keep tp\): tp x pp x cp = 4 does not divide 2 ranks"):
        layout_for(cfg, 2, Policy(8, ("tp",)))


def test_replan_takes_the_planners_fastest_valid_layout_with_the_kept_axes(tmp_path):
    cfg = tiny_config(tmp_path, *DATA, "--parallel.tp=2")
    hw = get_hardware("h100")
    ranked = search(cfg, 2, hw, keep=1 << 30).ranked
    free = layout_for(cfg, 2, Policy(4, (), replan=True, gpu="h100"))
    assert free == ranked[0][0]
    pinned = layout_for(cfg, 2, Policy(4, ("tp",), replan=True, gpu="h100"))
    assert pinned == next(c for c, _ in ranked if c.parallel.tp == 2) and validate(pinned, 2) == []
    assert layout_for(cfg, 2, Policy(4, (), replan=True, gpu="h100")) == free  # deterministic


def test_the_decision_names_both_layouts_with_their_predicted_step_times(tmp_path):
    cfg = replace(tiny_config(tmp_path, *DATA, "--parallel.tp=2"), checkpoint={"resume": True})
    # The run's last checkpoint was written by 4 ranks: the layout before is that world's.
    state = tmp_path / "tiny" / "checkpoints" / "step_00000003"
    state.mkdir(parents=True)
    (state / "state.json").write_text(json.dumps({"step": 3, "world_size": 4}))
    priced = decide(cfg, 2, Policy(4, ("tp",), gpu="h100"))
    hw = get_hardware("h100")
    assert priced.predicted_s == (predict_for_config(cfg, 4, hw)["step_time_s"],
                                  predict_for_config(priced.cfg, 2, hw)["step_time_s"])
    event = priced.event()
    assert (event["from"], event["to"], event["from_world_size"]) == ("dp2 tp2 z0 mb2 -", "dp1 tp2 z0 mb2 -", 4)
    assert priced.changed and "on h100" in priced.message()
    unpriced = decide(cfg, 2, Policy(4))
    assert unpriced.predicted_s == (None, None) and "no predicted step time" in unpriced.message()
    assert not decide(cfg, 4, Policy(4)).changed or layout_text(cfg, 4) != "dp2 tp2 z0 mb2 -"


def test_parse_keep():
    assert parse_keep("pp, tp") == ("tp", "pp") and parse_keep(",".join(AXES)) == AXES
    for bad in ("dp", "", "tp,xp"):
        with pytest.raises(ValueError, match="--keep"):
            parse_keep(bad)


def _stop(rank, world):
    group = AxisGroup("world", "log", None, world, rank, CommStats())
    with StopRequest() as quiet:
        calm = quiet.agreed(group)
    with StopRequest() as asked:
        if rank == 0:  # one rank gets the signal: every rank learns it at the same collective
            os.kill(os.getpid(), signal.SIGTERM)
        agreed = asked.agreed(group)
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *_: seen.append("previous"))
    with StopRequest():  # a second SIGTERM runs the handler that was there before (stop now)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
    signal.signal(signal.SIGTERM, previous)
    dist.barrier()
    return calm, agreed, seen


def test_one_ranks_sigterm_stops_every_rank_at_the_same_step():
    assert run_workers(_stop, 2) == [(False, True, ["previous"])] * 2
