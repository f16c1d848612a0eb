"""The dry run (train/dry_run.py): every position of a layout built at the real scale on the meta
device with a fake process group, its model state counted from the storages, beside the planner."""

import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, tiny_config, train_only

from fivefold.cli import main
from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.data.resolve import unpadded_vocab
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.mesh import Mesh
from fivefold.planner.estimate import estimate
from fivefold.planner.machine.datasheet import get_hardware
from fivefold.planner.selfcheck import activation_element_bytes, memory_per_pipeline_rank, predict_for_config
from fivefold.train.dry_run import STATE, build, coordinates, dry_run, positions
from fivefold.train.dry_run_cli import parse_size
from fivefold.train.metrics import read_metrics

# Published layouts (Llama 3 paper, table 4: tp8 x pp16 for 405B; Mixtral 8x22B with ep8), 8,192 tokens a
from fivefold.validate import validate

# Published layouts (Llama 3 paper, table 4: tp8 x pp16 for 405B; Mixtral 8x22B with ep8), 8,192 tokens a
# sequence, one sequence a micro-batch; the global batch sets only the micro-batches per step. 405B's
# 126 layers over 16 stages split by themselves (parallel/pipeline/stage_split.py: 7, 8 x 14, 7), so its
# built-against-predicted check also says that the runtime and the planner hold the same blocks.
PUBLISHED = {
    "llama3-70b-64": (64, "llama3-70b", ["--parallel.tp=8", "--parallel.zero=3", "--parallel.sp=true",
                                         "--train.global_batch=512"]),
    "llama3-70b-512": (512, "llama3-70b", ["--parallel.tp=8", "--parallel.pp=8", "--parallel.zero=1",
                                           "--parallel.sp=true", "--train.global_batch=512"]),
    "llama3-405b-1024": (1024, "llama3-405b", ["--parallel.tp=8", "--parallel.pp=16", "--parallel.zero=1",
                                               "--parallel.sp=true",
                                               "--train.global_batch=2048", "--train.recompute=full"]),
    "mixtral-8x22b-256": (256, "mixtral-8x22b", ["--parallel.tp=4", "--parallel.pp=4", "--parallel.ep=8",
                                                 "--parallel.zero=0", "--train.global_batch=512",
                                                 "--train.recompute=full"]),
    # The source texts' recipes (../shared/seeds): 3D parallel TP2 x PP4 x DP8 with ZeRO-2 (004), and
    # ZeRO-3 beside TP and PP for a 70B model on 64 GPUs (002; its TP8 x PP8 x CP4 cannot be 64 GPUs,
    # so here dp 2 x pp 4 keeps ZeRO-3 something to shard over).
    "3d-llama3-8b-zero2-64": (64, "llama3-8b", ["--parallel.tp=2", "--parallel.pp=4", "--parallel.zero=2",
                                                "--parallel.sp=true", "--train.global_batch=512"]),
    "llama3-70b-zero3-tp-pp-64": (64, "llama3-70b", ["--parallel.tp=8", "--parallel.pp=4", "--parallel.zero=3",
                                                     "--parallel.sp=true", "--train.global_batch=512",
                                                     "--train.recompute=full"]),
    # DeepSeek-V3 as trained (its report, sec. 3.2): 2,048 GPUs, ZeRO-1 + EP64 + PP16 with DualPipe (here
    # DualPipeV, its half-the-ranks form), 61 layers balanced automatically over 32 chunks, 4K sequences,
    # the final batch of 15,360, and its one MTP depth (sec. 2.2): the depth's block, eh_proj and norms join
    # the last stage, which DualPipeV puts on rank 0 beside the embedding, so no copy of it is needed there.
    # Seconds: measured 4.6 s for its 16 positions without MTP (8.2 s while each proved the message plan).
    "deepseek-v3-2048": (2048, "deepseek-v3", ["--parallel.pp=16", "--parallel.ep=64", "--parallel.zero=1",
                                               "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2",
                                               "--train.global_batch=15360", "--train.recompute=full",
                                               "--train.seq_len=4096", "--model.mtp_layers=1"]),
    # an MTP depth on a 1F1B pipeline's last rank, with the untied embedding's copy the depth embeds with,
    # and the loss in one chunk (train.loss_chunk 0, the default being 1,024 in every row above)
    "3d-llama3-8b-mtp-64": (64, "llama3-8b", ["--parallel.tp=2", "--parallel.pp=4", "--parallel.zero=2",
                                              "--parallel.sp=true", "--train.global_batch=512",
                                              "--model.mtp_layers=1", "--train.loss_chunk=0"]),
    # Muon (optim.name): one fp32 momentum per hidden-matrix element, AdamW's two moments on the rest,
    # under ZeRO-2 (with its fp32 masters) and under DDP with experts split by ep (planner/muon.py)
    "3d-llama3-8b-zero2-muon-64": (64, "llama3-8b", ["--parallel.tp=2", "--parallel.pp=4", "--parallel.zero=2",
                                                     "--parallel.sp=true", "--train.global_batch=512",
                                                     "--optim.name=muon"]),
    "mixtral-8x22b-muon-256": (256, "mixtral-8x22b", ["--parallel.tp=4", "--parallel.pp=4", "--parallel.ep=8",
                                                      "--parallel.zero=0", "--train.global_batch=512",
                                                      "--train.recompute=full", "--optim.name=muon"]),
    # LoRA (lora.rank): the frozen base's fp32 weights whole on every rank, the adapters' weights, gradients,
    # fp32 masters and moments under ZeRO-1 (planner/lora.py, memory.lora_state_bytes)
    "llama3-8b-lora-zero1-16": (16, "llama3-8b", ["--parallel.tp=2", "--parallel.zero=1", "--train.global_batch=64",
                                                   "--lora.rank=16"]),
    # ZeRO-3 shards the frozen base too: its fp32 rows, the base's only copy (params: dry_run.frozen_shards)
    "llama3-8b-lora-zero3-16": (16, "llama3-8b", ["--parallel.tp=2", "--parallel.zero=3", "--train.global_batch=64",
                                                   "--lora.rank=16"]),
}
H100 = 80e9


def published(name):
    world, preset, overrides = PUBLISHED[name]
    cfg = load_config(None, [f"--model.preset={preset}", "--train.seq_len=8192", "--train.micro_batch=1",
                             *overrides])
    assert validate(cfg, world) == []
    return cfg, derive(cfg, world, unpadded_vocab(cfg))


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_scale_built_equals_predicted_per_position(name, monkeypatch):
    """Every position's built parameters, gradients and optimizer state within 1% of the planner's
    (measured: within 3e-7; what differs is AdamW's 4-byte step counter per tensor, which the
    planner does not count)."""
    import fivefold.train.dry_run as module

    built = []
    monkeypatch.setattr(module, "build", lambda cfg, derived, rank: built.append(rank) or build(cfg, derived, rank))
    cfg, derived = published(name)
    reports = dry_run(cfg, derived, H100, progress=False)
    assert [r.position.pp for r in reports] == list(range(cfg.parallel.pp))  # one per pipeline rank
    # Built once per position, not per rank: the 405B layout's 1,024 ranks one by one would take
    # minutes to hours (per position: 0.3-8 s here). A count, which no machine's load changes.
    assert built == [r.position.rank for r in reports]
    assert sum(r.position.ranks for r in reports) == derived.world_size
    for r in reports:
        for part in (*STATE, "total"):
            assert abs(r.difference(part)) < 0.01, (r.position.name, part, r.built, r.predicted)
        assert r.built["grads"] > 0 and r.built["optimizer"] > 0
    if cfg.parallel.zero == 3 and not cfg.lora.rank:
        assert all(r.built["params"] == 0 for r in reports)  # ZeRO-3: only the shards hold storage
    # The per-rank prediction is the planner's own: rank 0's is the one the metrics log prints beside
    # its measurement (predict_for_config), the fullest rank's is `fivefold plan`'s (estimate).
    per_rank = memory_per_pipeline_rank(cfg, derived.world_size, "cuda")
    whole = predict_for_config(cfg, derived.world_size, None, "cuda")
    assert per_rank[0]["total"] == (whole["model_state_bytes"]["total"] + whole["activation_bytes"]
                                    + whole["buffer_bytes"])
    planned = estimate(cfg, derived.world_size, get_hardware("h100"), act_bytes=activation_element_bytes(cfg, "cuda"),
                       implementation=True)
    assert max(m["total"] for m in per_rank) == planned.memory["total"]
    assert all(r.fits for r in reports), [r.overflow() for r in reports if not r.fits]


def test_the_message_plan_is_proven_once_not_per_position(tmp_path, monkeypatch):
    """Every position runs the same schedule: the dry run proves its plan once, and the pipelines it
    builds do not (theirs is proven at their first step, which the dry run never runs)."""
    import fivefold.parallel.pipeline.executor as pipeline
    import fivefold.train.dry_run as module

    calls = {"dry run": 0, "pipeline": 0}

    def counted(where, check):
        def call(*args, **kwargs):
            calls[where] += 1
            return check(*args, **kwargs)
        return call

    monkeypatch.setattr(module, "check_plans", counted("dry run", module.check_plans))
    monkeypatch.setattr(pipeline, "check_plans", counted("pipeline", pipeline.check_plans))
    cfg = tiny_config(tmp_path, "--parallel.pp=4", "--train.micro_batch=1")
    reports = dry_run(cfg, derive(cfg, 4, unpadded_vocab(cfg)), H100, progress=False)
    assert len(reports) == 4 and calls == {"dry run": 1, "pipeline": 0}


def test_positions_of_a_large_layout():
    cfg, derived = published("mixtral-8x22b-256")
    collapsed = positions(cfg, derived)
    assert [(p.pp, p.rank, p.ranks) for p in collapsed] == [(s, 64 * s, 64) for s in range(4)]
    every = positions(cfg, derived, every=True)
    assert len(every) == 4 * 4 * 8 and {p.ranks for p in every} == {2}  # pp x tp x ep, 2 dp ranks each
    assert {(p.pp, p.tp, p.ep) for p in every} == {(s, t, e) for s in range(4) for t in range(4) for e in range(8)}


def _mesh_places(world, cfg):
    """Every rank's place on each axis as the real Mesh has it, built in a fake world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    derived, places = derive(cfg, world, unpadded_vocab(cfg)), []
    for rank in range(world):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = Mesh.from_config(cfg, derived, "cpu", device=torch.device("meta"))
            places.append({axis: mesh.rank(axis) for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")})
        finally:
            dist.destroy_process_group()
    return places


def test_coordinates_are_the_meshs(tmp_path):
    cfg = tiny_config(tmp_path, "--model.preset=tiny-moe", "--parallel.pp=2", "--parallel.tp=2", "--parallel.cp=2",
                      "--parallel.dp_replicate=2", "--parallel.zero=1", "--parallel.ep=4", "--train.global_batch=16",
                      "--train.seq_len=64")
    world = 32  # pp 2 x dp_replicate 2 x dp_shard 2 x cp 2 x tp 2; ep 4 over dp x cp = 8
    assert validate(cfg, world) == []
    degrees = {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 2}
    assert [coordinates(r, degrees, 4) for r in range(world)] == _mesh_places(world, cfg)


@pytest.mark.parametrize("layout,world", [
    # ZeRO over 3 ranks: 64-wide rows do not divide by 3, so every shard is padded to 22 rows
    (["--parallel.zero=3", "--parallel.tp=2", "--train.global_batch=12"], 6),
    (["--parallel.zero=1", "--parallel.tp=2", "--parallel.pp=2", "--train.global_batch=12"], 12),
    (["--parallel.zero=2", "--parallel.dp_replicate=2", "--train.global_batch=12"], 6),
    (["--model.preset=tiny-moe", "--parallel.tp=2", "--parallel.pp=2", "--parallel.ep=2"], 8),
])
def test_every_position_holds_what_its_pipeline_rank_holds(tmp_path, layout, world):
    """Why one rank per pipeline rank is enough: built apart, every (pp, tp, ep, dp_shard) position
    holds the same bytes as the first rank of its pipeline rank."""
    cfg = tiny_config(tmp_path, *layout)
    assert validate(cfg, world) == []
    derived = derive(cfg, world, unpadded_vocab(cfg))
    one = {r.position.pp: r.built for r in dry_run(cfg, derived, H100, progress=False)}
    every = dry_run(cfg, derived, H100, every=True, progress=False)
    assert len(every) > len(one)
    for r in every:
        assert r.built == one[r.position.pp], r.position.name


@pytest.mark.parametrize("layout", [
    ["--parallel.zero=1"],  # 2 micro-batches a step: full gradients held between them
    ["--parallel.zero=1", "--train.micro_batch=4"],  # one micro-batch: only the shards' gradients
    ["--parallel.zero=3"],
    ["--parallel.zero=3", "--parallel.offload=params"],  # nothing kept on the device: the shards are the host's
    ["--parallel.tp=2"],
])
def test_built_bytes_equal_what_a_real_run_holds(tmp_path, layout):
    """The dry run's count for rank 0 is what 2 real gloo ranks of the same layout report in their
    metrics (model_state_bytes, step 2: AdamW's state exists), to the byte: both count storages."""
    cfg = tiny_config(tmp_path, "--train.steps=2", "--data.max_bytes=20000", "--data.val_fraction=0.0", *layout)
    run_workers(train_only, 2, cfg)
    measured = read_metrics(tmp_path / "tiny" / "metrics.jsonl")[1]["model_state_bytes"]
    assert build(cfg, derive(cfg, 2, unpadded_vocab(cfg)), rank=0) == measured


def test_the_count_tells_storages_apart_on_the_meta_device_too():
    """model_state_bytes counts each storage once by its identity: meta storages, which the dry run
    counts and which all sit at address 0, give what real ones give."""
    from fivefold.parallel.optimizer import build_optimizer, init_optimizer_state
    from fivefold.parallel.state_memory import model_state_bytes

    cfg = load_config(ROOT / "configs" / "tiny.toml")
    counts = []
    for device in ("cpu", "meta"):
        with torch.device(device):
            model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
        model[1].weight = model[0].weight  # tied: one storage, counted once
        opt = build_optimizer(model, cfg.optim)
        init_optimizer_state(opt)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        counts.append(model_state_bytes(list(model.parameters()), opt))
    real, meta = counts
    assert real["params"] == (32 + 8) * 4  # the tied matrix once, the bias
    assert real["optimizer"] == 2 * (32 + 8) * 4 + 2 * 4  # two moments each, two step counters
    assert meta == real


def test_cli_end_to_end(capsys):
    code = main(["train", str(ROOT / "configs" / "tiny.toml"), "--dry-run", "--world", "8", "--gpu", "h100",
                 "--parallel.pp=2", "--parallel.tp=2", "--parallel.zero=1", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tiny on 8 ranks (pp 2 x dp 2 x tp 2; zero 1; 2 micro-batches per step), 2 positions" in out
    assert "capacity h100: 80.00 GB per device" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("pp ")]
    assert [row[:4] for row in rows] == [["pp", "0", "0", "4"], ["pp", "1", "4", "4"]]  # position, rank, ranks
    assert all(row[-1] == "yes" for row in rows) and "every position fits" in out


def test_a_progress_bar_when_there_are_many_positions(capsys):
    args = ["train", str(ROOT / "configs" / "tiny.toml"), "--dry-run", "--world", "8", "--gpu", "h100",
            "--parallel.pp=2", "--parallel.tp=2", "--parallel.zero=1"]
    assert main([*args, "--all-positions"]) == 0  # 8 positions: pp x tp x dp_shard
    captured = capsys.readouterr()
    assert "dry run: building positions" in captured.err and "pp 1 tp 1 dp_shard 1" in captured.out
    assert main(args) == 0  # 2 positions
    assert "building positions" not in capsys.readouterr().err


def test_a_position_that_does_not_fit_is_named_with_its_part_and_excess(capsys):
    code = main(["train", str(ROOT / "configs" / "tiny.toml"), "--dry-run", "--world", "2", "--parallel.pp=2",
                 "--device-memory", "1MB", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "2 of 2 positions do not fit" in out
    # pp 0 holds 4 blocks and the embedding, 184,832 fp32 weights (739.33 kB), and as much in
    # gradients: with the gradients the sum passes 1 MB
    line = next(line for line in out.splitlines() if line.startswith("  - pp 0 "))
    m = re.fullmatch(r"  - pp 0 \(rank 0\) does not fit: it needs ([\d.]+) MB of 1.00 MB, ([\d.]+) MB over; it "
                     r"overflows at the gradients \(built\): parameters 739.33 kB \+ gradients 739.33 kB = 1.48 MB "
                     r"> 1.00 MB", line)
    assert m, line
    assert float(m.group(1)) - 1 == pytest.approx(float(m.group(2)), abs=0.01)


def test_a_refused_layout_prints_validates_messages(capsys):
    code = main(["train", str(ROOT / "configs" / "tiny.toml"), "--dry-run", "--world", "3", "--parallel.dp=2",
                 "--train.stpes=1", "--gpu", "h100"])
    err = capsys.readouterr().err
    assert code == 2
    assert "unknown key 'train.stpes': did you mean 'steps'?" in err
    assert "parallel.dp x pp x cp x tp = 2 x 1 x 1 x 1 = 2 but 3 processes were launched" in err


def test_a_refused_layout_fails_before_torch_is_imported():
    check = ("import sys; from fivefold.cli import main; code = main(sys.argv[1:]); "
             "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", check, "train", "configs/tiny.toml", "--dry-run", "--world=3",
                          "--parallel.dp=2", "--gpu=h100"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stdout.strip() == "no torch", (out.stdout, out.stderr)


@pytest.mark.parametrize("args,message", [
    (["--gpu", "h100"], "--dry-run needs --world N"),
    (["--world", "2"], "--dry-run needs the memory of one device"),
    (["--world", "2", "--gpu", "h1000"], "unknown GPU 'h1000'"),
    (["--world", "2", "--device-memory", "80 gigs"], "--device-memory '80 gigs': give a positive size"),
    (["--world", "2", "--nproc", "2", "--gpu", "h100"], "give the job's size with --world, not --nproc"),
])
def test_bad_dry_run_arguments(capsys, args, message):
    assert main(["train", str(ROOT / "configs" / "tiny.toml"), "--dry-run", *args]) == 2
    assert message in capsys.readouterr().err


def test_parse_size():
    assert parse_size("80GB") == 80e9 and parse_size("141 GB") == 141e9 and parse_size("96GiB") == 96 * 2**30
    assert parse_size("1.5e9") == 1.5e9 and parse_size("500kB") == 5e5
    for bad in ("-1GB", "80 XB", "", "GB"):
        with pytest.raises(ValueError):
            parse_size(bad)
