"""What LoRA (model/lora.py) asks of data parallel beyond training like one process, which every
dimension's table shows in its LoRA row (helpers.LORA_ROW): nothing but the adapters is reduced or
stepped; under ZeRO-3 the frozen base is sharded, gathered for compute, freed unit by unit and never
reduced, and its shards are in the checkpoint; a LoRA run's checkpoint samples with its adapters."""

from __future__ import annotations

import shutil

import torch
from helpers import EQUIVALENCE, LORA, one_process, tiny_config

from fivefold.model.lora import is_adapter
from fivefold.parallel.forked_ranks import run_workers


def _trainable_and_reduced(rank: int, world: int, cfg):
    from helpers import parallelized

    par = parallelized(cfg, world)
    return ([n for n, p in par.model.named_parameters() if p.requires_grad],
            sum(p.numel() for p in par.dp.params), sum(t.numel() for t in par.dp.optimizer_params()))


def test_only_the_adapters_are_reduced_and_stepped(tmp_path, lora_reference):
    """Data parallel reduces and the optimizer steps the adapters alone: at dp2 ZeRO-1 the buckets hold
    their elements, each rank's optimizer half of them; the frozen base trained no step (its weights
    equal the seeded start: the reference's `exact` rows above hold them to it bit for bit)."""
    cfg = tiny_config(tmp_path, *EQUIVALENCE, *LORA, "--parallel.zero=1", "--train.micro_batch=4")
    names, reduced, stepped = run_workers(_trainable_and_reduced, 2, cfg)[0]
    assert names and all(is_adapter(n) for n in names)
    adapters = 8 * 7 * 2  # 8 layers x 7 targets x (A, B)
    assert len(names) == adapters
    # per layer: q, k, v, o (64 x 64 each) and gate, up (128 x 64), down (64 x 128), rank 4: r (in + out)
    per_layer = 4 * 4 * (64 + 64) + 3 * 4 * (64 + 128)
    assert reduced == 8 * per_layer and stepped == reduced // 2
    start = run_workers(_seeded_base, 1, tiny_config(tmp_path / "start", *EQUIVALENCE, *LORA))[0]
    trained = lora_reference[2]
    for name, value in start.items():
        assert torch.equal(trained[name], value), name


def _zero3_lora_step(rank: int, world: int, cfg):
    """Train under ZeRO-3, recording at each unit's pre-backward how many units hold their frozen
    weights (ran out of a gather: storage), and what each rank keeps of the base between steps."""
    from fivefold.parallel.data.fsdp import FullyShardedDataParallel as FSDP
    from fivefold.train.loop import train

    held, made, pre_backward = [], [], FSDP._pre_backward

    def counting(self, unit):
        pre_backward(self, unit)
        held.append(sum(any(p.untyped_storage().nbytes() for b in u.frozen for p in b.params) for u in self.units))
        made[:] = [self]

    FSDP._pre_backward = counting
    train(cfg, progress=False)
    dp = made[0]
    frozen = [p for p in dp.sharded if not p.requires_grad]
    return (held, sum(p.numel() for p in frozen), sum(dp.shards.masters[id(p)].numel() for p in frozen),
            sum(p.untyped_storage().nbytes() for p in dp.sharded))


def test_zero3_shards_the_frozen_base_and_reduces_only_the_adapters(tmp_path):
    """ZeRO-3 (resharding, 2 micro-batches a step): each rank keeps half of the frozen base, gathers
    it for compute and frees each unit's frozen weights once its backward is past them (one unit at a
    time holds them, not every block by the end of backward); on
    the wire the base is gathered and never reduce-scattered: dp's bytes are the gathers' and the
    adapters' reduce-scatters."""
    from fivefold.parallel.comm import collectives
    from fivefold.train.loop import build_model
    from fivefold.train.metrics import read_metrics

    cfg = tiny_config(tmp_path, "--train.steps=2", "--data.max_bytes=20000", "--data.val_fraction=0.0", *LORA,
                      "--parallel.zero=3", "--train.micro_batch=2")
    held, base, base_shard, resident = run_workers(_zero3_lora_step, 2, cfg)[0]
    # the unit in its backward alone (the one prefetched gets its storage when its gather is waited for)
    assert held and max(held) == 1
    assert base_shard * 2 == base > 0 and resident == 0  # half the base each; nothing gathered after the step
    n, m = 2, 2  # ranks, micro-batches a step
    model = build_model(cfg, 320)  # with its adapters
    every = sum(p.numel() for p in model.parameters()) * 4  # fp32 bytes, adapters included
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    embedding, head = (sum(p.numel() for p in mod.parameters()) * 4 for mod in (model.tok_embeddings, model.output))
    head += sum(p.numel() for p in model.norm.parameters()) * 4
    # per micro-batch: every unit gathered for its forward, again for its backward but the head's (kept
    # gathered across) and the embedding's (a frozen embedding has no backward), the adapters reduce-scattered
    expected = m * (2 * every - head - embedding + adapters) * (n - 1) / n + collectives.wire_bytes("all_reduce", 8, n)
    for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl"):
        assert record["comm"]["dp"]["wire_bytes"] == expected
        assert record["model_state_bytes"]["params"] == 4 * base_shard  # the weights held: the base's fp32 shards


def _train_losses(rank: int, world: int, cfg) -> list[float]:
    from fivefold.train.loop import train

    return train(cfg, progress=False).losses


def _model_state(checkpoint) -> dict[str, torch.Tensor]:
    """The model a checkpoint holds, whole (every rank's shards put together)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, checkpoint.parent / "whole.pt")
    return torch.load(checkpoint.parent / "whole.pt", weights_only=False)["model"]


def test_a_zero3_lora_run_resumes_at_tp2(tmp_path):
    """ZeRO-3's checkpoint holds the frozen base's shards with the adapters': a run saved at dp2 ZeRO-3
    resumes at tp2, continues as the uninterrupted run (losses within 1e-5) and ends with the base it
    started from, bit for bit (a base that missed the checkpoint would resume from empty shards)."""
    from fivefold.checkpoint.run_dir import complete_checkpoints

    args = (*EQUIVALENCE, *LORA, "--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=2")
    losses = run_workers(_train_losses, 2, tiny_config(tmp_path, *args, "--parallel.zero=3",
                                                       "--train.micro_batch=4"))[0]
    first, last = complete_checkpoints(tmp_path / "tiny")
    base = {k: v for k, v in _model_state(first).items() if not is_adapter(k)}
    shutil.rmtree(last)
    resumed = run_workers(_train_losses, 2, tiny_config(tmp_path, *args, "--parallel.tp=2",
                                                        "--checkpoint.resume=true"))[0]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(losses[2:]), rtol=1e-5, atol=0)
    end = _model_state(complete_checkpoints(tmp_path / "tiny")[-1])
    assert base and all(torch.equal(end[k], v) for k, v in base.items())


def _seeded_base(rank: int, world: int, cfg):
    from helpers import parallelized

    par = parallelized(cfg, world)
    return {n: v for n, v in par.full_state_dict().items() if not is_adapter(n) and n.endswith(".weight")}


def test_a_lora_runs_checkpoint_samples_with_its_adapters(tmp_path, lora_reference):
    """`fivefold sample` (sample/generate.py load_model) builds the run's adapters and reads them with
    the base: the loaded model holds the trained state, B's included (trained away from zero)."""
    from fivefold.sample.generate import load_model, resolve_source

    run = lora_reference_dir(tmp_path)
    model = load_model(resolve_source(run))
    trained = lora_reference[2]
    loaded = dict(model.named_parameters())
    assert {n for n in loaded if is_adapter(n)} == {n for n in trained if is_adapter(n)}
    assert any(n.endswith(".lora.b") and trained[n].abs().max() > 0 for n in trained)
    for name, value in trained.items():
        if name in loaded:
            assert torch.equal(loaded[name].detach(), value), name


def lora_reference_dir(tmp_path):
    """A one-process LoRA run like the reference's, its directory (the reference keeps none of its own)."""
    one_process(tmp_path, *EQUIVALENCE, *LORA)
    return tmp_path / "tiny"
