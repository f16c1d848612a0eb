"""The pipeline's stage split (parallel/pipeline/stage_split.py): given, even, or balanced by the planner's
costs; and the planner, the runtime and the dry run holding the same blocks."""

import itertools
import random

import pytest
import torch
import torch.distributed as dist
from helpers import tiny_config

from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.counts import model_counts
from fivefold.parallel.mesh import Mesh
from fivefold.parallel.pipeline.stage_split import PartCosts, balance, part_costs, split_note, stage_split
from fivefold.planner.layout import rank_shares, stage_sizes
from fivefold.train.dry_run import dry_run, format_report
from fivefold.train.loop import parallel_model

# tiny (8 layers) as interleaved 1F1B over 2 ranks x 3 virtual stages: 6 stages, 8 does not divide by 6
from fivefold.validate import validate

# tiny (8 layers) as interleaved 1F1B over 2 ranks x 3 virtual stages: 6 stages, 8 does not divide by 6
UNEVEN_TINY = ("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.virtual_stages=3")


@pytest.mark.parametrize("overrides,split", [
    ((), (8,)),
    (("--parallel.pp=2",), (4, 4)),
    (("--parallel.pp=4",), (2, 2, 2, 2)),
    (("--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.virtual_stages=2"), (2, 2, 2, 2)),
    (("--parallel.pp=2", "--parallel.stage_layers=[5, 3]"), (5, 3)),  # given: taken as it is
    (("--parallel.pp=2", "--parallel.stage_layers=[1, 7]"), (1, 7)),
])
def test_given_or_divisible_splits_are_unchanged(tmp_path, overrides, split):
    cfg = tiny_config(tmp_path, *overrides)
    assert stage_split(cfg, 320) == split
    assert split_note(cfg, split) == ""  # nothing chosen: nothing to say


def test_uneven_tiny_split_by_hand(tmp_path):
    """The costs, by hand (dim 64, 4 heads of 16, ffn 128, seq 32, vocabulary 257 padded to 320):
    a block is 2 x (4 x 64 x 64 attention + 3 x 64 x 128 SwiGLU) + 2 x 32 x 4 x 16 attention core =
    86,016 FLOPs a token and 40,960 + 128 (norms) = 41,088 parameters; the embedding no FLOPs and
    320 x 64 = 20,480 parameters; the head 2 x 320 x 64 = 40,960 FLOPs and 20,480 + 64 parameters.
    8 blocks in 6 stages: some stage holds 2 (172,032 FLOPs), so the last, with the head, holds 1
    (2 x 86,016 + 40,960 is more). Parameters: some middle stage holds 2 (82,176), so the first,
    with the embedding, holds 1. The 4 middle stages hold 6 blocks as {2, 2, 1, 1}, in any order
    equally spread: the earliest take the most."""
    cfg = tiny_config(tmp_path, *UNEVEN_TINY)
    d = derive(cfg, 2, unpadded_vocab(cfg))
    assert validate(cfg, 2) == [] and d.vocab_size == 320
    costs = part_costs(cfg, model_counts(cfg.model, d.vocab_size))
    assert costs == PartCosts(flops=(86_016,) * 8, params=(41_088,) * 8, first=(0, 20_480), last=(40_960, 20_544))
    assert stage_split(cfg, d.vocab_size) == (1, 2, 2, 1, 1, 1)
    assert "[1, 2, 2, 1, 1, 1]" in split_note(cfg, (1, 2, 2, 1, 1, 1))


def test_a_sliding_layer_costs_its_window(tmp_path):
    """The same model with a window of 4 on every other block: a sliding block's attention core is
    2 x 4 x 16 x 2 x k for k = 3.8125 keys per query ((1 + 2 + 3 + 4 x 29) / 32 queries), not 16."""
    cfg = tiny_config(tmp_path, *UNEVEN_TINY, "--model.attention.window=4",
                      "--model.attention.window_pattern=['sliding', 'full']")
    d = derive(cfg, 2, unpadded_vocab(cfg))
    flops = part_costs(cfg, model_counts(cfg.model, d.vocab_size)).flops
    core = 2 * 32 * 4 * 16  # the full block's attention core: 4,096 of its 86,016
    assert flops == (86_016 - core + round(2 * 3.8125 * 4 * 32), 86_016) * 4


def test_balance_by_hand():
    # 7 blocks of 10 FLOPs, a head of 15, 3 stages: [3, 3, 1] costs 30, 30, 25; any split with 2 or
    # more blocks on the last stage costs it 35 or more
    assert balance(PartCosts((10,) * 7, (1,) * 7, (0, 0), (15, 0)), 3) == (3, 3, 1)
    # a costly first stage (an embedding of 15 FLOPs) is lightened the same way
    assert balance(PartCosts((10,) * 7, (1,) * 7, (15, 0), (0, 0)), 3) == (1, 3, 3)
    # 10 equal blocks over 4 stages, nothing at the ends: 3 is the least bound; the spread picks
    # [3, 3, 2, 2] over [3, 3, 3, 1]; the earliest stages take the most
    assert balance(PartCosts((5,) * 10, (1,) * 10, (0, 0), (0, 0)), 4) == (3, 3, 2, 2)
    assert balance(PartCosts((5,) * 4, (1,) * 4, (0, 0), (100, 0)), 4) == (1, 1, 1, 1)
    with pytest.raises(ValueError, match="3 blocks cannot make 4 stages"):
        balance(PartCosts((1,) * 3, (1,) * 3, (0, 0), (0, 0)), 4)


def _exhaustive(costs: PartCosts, stages: int) -> tuple[int, ...]:
    """The module docstring's order, over every split: max FLOPs, max parameters, sum of squared
    FLOPs, then the largest counts in model order."""
    n = len(costs.flops)

    def key(sizes):
        starts = [sum(sizes[:s]) for s in range(stages)]
        fl, pa = [], []
        for s, (a, k) in enumerate(zip(starts, sizes, strict=True)):
            ends = [e for e, on in ((costs.first, s == 0), (costs.last, s == stages - 1)) if on]
            fl.append(sum(costs.flops[a:a + k]) + sum(e[0] for e in ends))
            pa.append(sum(costs.params[a:a + k]) + sum(e[1] for e in ends))
        return max(fl), max(pa), sum(f * f for f in fl), tuple(-k for k in sizes)

    splits = [tuple(b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True))
              for cuts in itertools.combinations(range(1, n), stages - 1)]
    return min(splits, key=key)


def test_balance_is_the_best_split_by_exhaustion():
    """Against every split of up to 11 blocks, with uneven costs (MoE next to dense blocks, small
    integers so that ties are common)."""
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 11)
        costs = PartCosts(tuple(rng.randint(0, 6) for _ in range(n)), tuple(rng.randint(0, 6) for _ in range(n)),
                          (rng.randint(0, 6), rng.randint(0, 6)), (rng.randint(0, 6), rng.randint(0, 6)))
        stages = rng.randint(1, n)
        assert balance(costs, stages) == _exhaustive(costs, stages), (costs, stages)


def llama3_405b(*overrides):
    return load_config(None, ["--model.preset=llama3-405b", "--train.seq_len=8192", "--train.micro_batch=1",
                              "--parallel.tp=8", "--parallel.pp=16", "--parallel.zero=1", "--train.global_batch=2048",
                              *overrides])


def test_llama3_405b_over_16_stages_has_lighter_ends():
    """126 layers over 16 stages, no stage_layers: 7, 8 x 14, 7, as the Llama 3 paper (sec. 3.3.2)
    chose by hand. The head (2 x 128,256 x 16,384 FLOPs a token, 0.63 of a block's 6.64e9 / 8 tp
    ranks) makes the last stage hold 7; the embedding's parameters (0.66 of a block's), the first."""
    cfg = llama3_405b()
    assert validate(cfg, 1024) == []
    d = derive(cfg, 1024, unpadded_vocab(cfg))
    split = stage_split(cfg, d.vocab_size)
    assert split == (7, *(8,) * 14, 7) and sum(split) == 126
    assert stage_sizes(cfg, model_counts(cfg.model, d.vocab_size)) == list(split)


def test_too_few_layers_for_the_stages_is_refused(tmp_path):
    errors = validate(tiny_config(tmp_path, "--parallel.pp=3", "--model.n_layers=2"), 3)
    assert len(errors) == 1 and "model.n_layers = 2 is fewer than parallel.pp x virtual_stages = 3" in errors[0]


def _runtime_split(cfg, world):
    """The blocks of each stage as the runtime builds them, every pipeline rank in turn, in a fake
    world on the meta device (the dry run's build, train/dry_run.py)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    derived, sizes = derive(cfg, world, unpadded_vocab(cfg)), {}
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = Mesh.from_config(cfg, derived, "cpu", device=torch.device("meta"))
            par, _ = parallel_model(cfg, derived, mesh)
            for stage, chunk in par.pipeline.chunks.items():
                sizes[stage] = (mesh.rank("pp"), chunk.layers)
        finally:
            dist.destroy_process_group()
    return [sizes[s] for s in sorted(sizes)]


@pytest.mark.parametrize("overrides,world", [
    (UNEVEN_TINY, 2),
    (("--parallel.pp=3", "--train.global_batch=6"), 3),
    (("--parallel.pp=3", "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2",
      "--train.global_batch=12"), 3),  # 6 stages in a V: the first and last on rank 0
], ids=["interleaved-pp2-v3", "1f1b-pp3", "dualpipe_v-pp3"])
def test_planner_runtime_and_dry_run_hold_the_same_blocks(tmp_path, overrides, world):
    cfg = tiny_config(tmp_path, *overrides)
    assert validate(cfg, world) == []
    d = derive(cfg, world, unpadded_vocab(cfg))
    split = stage_split(cfg, d.vocab_size)
    runtime = _runtime_split(cfg, world)
    assert [len(layers) for _, layers in runtime] == list(split)
    assert [b for _, layers in runtime for b in layers] == [str(i) for i in range(cfg.model.n_layers)]  # in order
    shares = rank_shares(cfg, model_counts(cfg.model, d.vocab_size))
    for r, share in enumerate(shares):  # the planner's blocks of each pipeline rank are the runtime's
        assert share.blocks == sorted(int(b) for rank, layers in runtime if rank == r for b in layers)
    note = split_note(cfg, split)
    assert note and note in format_report(cfg, d, dry_run(cfg, d, 80e9, progress=False), "test", 0.0)
