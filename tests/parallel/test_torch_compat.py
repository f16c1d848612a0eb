"""fivefold on the torch it meets: 2.11 through 2.13 (parallel/comm/compat.py).

torch 2.13 names the flat collectives `all_gather_single` and `reduce_scatter_single`; torch 2.11
and 2.12 have only `all_gather_into_tensor` and `reduce_scatter_tensor`. Here, in the forked
workers only, every name newer than torch 2.11 that fivefold calls is removed from
torch.distributed before anything looks it up (the suite runs on 2.13.0), and ZeRO-3 (dp2) and
tensor + sequence parallel (tp2-sp) train through the fallbacks: the run equals the normal path's
exactly and reproduces one process as the equivalence tables require. The fallbacks' calls are
counted, so the test cannot pass without taking them.
"""

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers import EQUIVALENCE, Layout, assert_reproduces, tiny_config, train_and_gather

from fivefold.parallel.comm.compat import (
    FLAT_COLLECTIVES,
    collective_name,
    torch_problem,
    torch_version,
    version_tuple,
)
from fivefold.parallel.forked_ranks import run_workers

# The names of torch 2.13 that torch 2.11 lacks, among those fivefold calls: checked against a torch
# 2.11.0 install (every torch.* and dist.* name the package and benchmarks use looked up there).
NEWER_THAN_2_11 = tuple(newer for newer, _ in FLAT_COLLECTIVES.values())

# Two 2-rank layouts between them exercising both flat collectives through the collective layer:
# ZeRO-3 gathers weights (all-gather) and reduce-scatters gradients; sequence parallel all-gathers
# the sequence before tensor-parallel regions and reduce-scatters after them. Rows and bounds as in
# test_data_parallel.py ("zero3-dp2-accum2") and test_tensor_parallel.py ("tp2-sp").
LAYOUTS = {
    "zero3-dp2": Layout(2, ("--train.micro_batch=2", "--parallel.zero=3")),
    "tp2-sp": Layout(2, ("--parallel.tp=2", "--parallel.sp=true", "--train.micro_batch=4"), param_atol=3e-4),
}


def _counting(name: str, counts: dict[str, int]) -> None:
    """Replace dist.`name` by a wrapper that counts its calls into counts[name]."""
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def _train_counting(rank: int, world: int, cfg, hide: bool):
    """Worker: train (helpers.train_and_gather), with torch 2.13's names removed when `hide`; the
    result and the calls of every flat-collective name, both torch's."""
    counts: dict[str, int] = {}
    if hide:  # this forked worker's torch.distributed only (a torch before 2.13 has none of them)
        for name in NEWER_THAN_2_11:
            if hasattr(dist, name):
                delattr(dist, name)
    for names in FLAT_COLLECTIVES.values():
        for name in names:
            if hasattr(dist, name):
                _counting(name, counts)
    with warnings.catch_warnings():
        # on torch 2.13 the older names still work, with a FutureWarning at each call
        warnings.simplefilter("ignore", FutureWarning)
        result = train_and_gather(rank, world, cfg)
    return result, counts


@pytest.mark.parametrize("name", LAYOUTS)
def test_trains_through_the_torch_2_11_names(tmp_path, reference, name):
    layout = LAYOUTS[name]
    args = (*EQUIVALENCE, *layout.overrides)
    normal = run_workers(_train_counting, layout.ranks, tiny_config(tmp_path / "normal", *args), False)
    fallback = run_workers(_train_counting, layout.ranks, tiny_config(tmp_path / "fallback", *args), True)
    for (result, counts), (normal_result, normal_counts) in zip(fallback, normal, strict=True):
        for op, (newer, older) in FLAT_COLLECTIVES.items():
            assert counts.get(older, 0) > 0, f"{name}: no {op} went through dist.{older}"
            assert newer not in counts
            # the normal path calls the name this torch has, as many times as the fallback's
            assert normal_counts.get(collective_name(op), 0) == counts[older], (op, normal_counts, counts)
        # the same collectives under another name: the same numbers, bit for bit
        losses, norms, state = result
        assert losses == normal_result[0] and norms == normal_result[1]
        assert all(torch.equal(state[k], normal_result[2][k]) for k in normal_result[2])
        assert_reproduces(result, reference, param_atol=layout.param_atol)


def test_the_collective_names_this_torch_has():
    # torch 2.13 (the suite's) has the newer names, and fivefold takes them (the older ones warn there)
    newer = version_tuple(torch.__version__) >= (2, 13)
    assert [collective_name(op) for op in FLAT_COLLECTIVES] == [
        "all_gather_single" if newer else "all_gather_into_tensor",
        "reduce_scatter_single" if newer else "reduce_scatter_tensor"]


def test_an_older_torch_is_refused_in_one_line(monkeypatch, capsys):
    assert version_tuple("2.11.0+cu130") == (2, 11) and version_tuple("2.13.0a0+git1234") == (2, 13)
    assert torch_problem("2.11.0+cu130") is None and torch_problem("2.13.0") is None
    assert torch_problem("3.0.0") is None
    assert version_tuple(torch_version()) == version_tuple(torch.__version__)
    problem = torch_problem("2.10.2+cpu")
    assert "2.11" in problem and "2.10.2+cpu" in problem and "\n" not in problem

    from fivefold.cli import main
    from fivefold.parallel.comm.compat import UnsupportedTorch
    from fivefold.train.loop import train

    monkeypatch.setattr(torch, "__version__", "2.10.2+cpu")
    assert main(["plan", "--params", "7e9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "fivefold needs torch >= 2.11 (this is torch 2.10.2+cpu)" in err
    with pytest.raises(UnsupportedTorch, match="needs torch >= 2.11"):
        train(None)  # refused before the config is looked at
