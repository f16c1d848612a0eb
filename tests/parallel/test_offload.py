"""ZeRO-Offload (parallel.offload = "optimizer") and ZeRO-Infinity's parameter offload ("params"),
parallel/data/offload.py: the same training as on the device, the bytes each way per step, the host
memory the planner predicts (pinned included), proof that the optimizer really steps host copies,
their one flat buffer and its page-locking, and checkpoints moving between the modes."""

import gc
import shutil

import pytest
import torch
from helpers import EQUIVALENCE, parallelized, tiny_config, train_and_gather

from fivefold.checkpoint.run_state import complete_checkpoints
from fivefold.config.derive import derive
from fivefold.data.resolve import unpadded_vocab
from fivefold.model.transformer import count_parameters
from fivefold.parallel.data import offload
from fivefold.parallel.data.offload import step_bytes
from fivefold.parallel.forked_ranks import run_workers
from fivefold.planner.estimate import estimate
from fivefold.planner.hardware import get_hardware
from fivefold.train.loop import build_model, train
from fivefold.train.metrics import read_metrics

DP2 = (*EQUIVALENCE, "--parallel.dp=2")
OFFLOAD = "--parallel.offload=optimizer"
PARAMS = "--parallel.offload=params"


def _run(tmp_path, zero: int, *extra: str):
    """dp2 with ZeRO `zero` (5 steps, 2 micro-batches a rank): rank 0's (losses, norms, full state),
    and the step records."""
    cfg = tiny_config(tmp_path, *DP2, f"--parallel.zero={zero}", *extra)
    result = run_workers(train_and_gather, 2, cfg)[0]
    return cfg, result, read_metrics(tmp_path / "tiny" / "metrics.jsonl")


@pytest.mark.parametrize("zero,dtype", [(1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16")])
def test_offload_trains_as_the_device_optimizer_bit_for_bit(tmp_path, zero, dtype):
    """The same foreach AdamW on the same fp32 values (clipped on the device before the copy): the
    losses, gradient norms and final weights are identical, bit for bit (measured so on CPU); the
    traffic over the mesh is unchanged and the host link's bytes are the formula's:
    4 bytes per element of this rank's fp32 shard (P / dp, no padding here) each way, every step.
    Under bf16 autocast too: the masters and their gradients stay fp32, whatever the compute dtype."""
    cfg, (losses, norms, state), steps = _run(tmp_path / "off", zero, OFFLOAD, f"--train.dtype={dtype}")
    _, (ref_losses, ref_norms, ref_state), ref_steps = _run(tmp_path / "ref", zero, f"--train.dtype={dtype}")
    assert losses == ref_losses and norms == ref_norms
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), name
    shard_bytes = 4 * count_parameters(build_model(cfg, derive(cfg, 2, unpadded_vocab(cfg)).vocab_size)) // 2
    assert [s["offload"]["d2h_bytes"] for s in steps] == [shard_bytes] * len(steps)  # fp32 gradient shard down
    assert [s["offload"]["h2d_bytes"] for s in steps] == [shard_bytes] * len(steps)  # updated fp32 shard up
    assert [s["comm"] for s in steps] == [s["comm"] for s in ref_steps]  # not mixed into the mesh's counts
    assert all("offload" not in s for s in ref_steps)


def test_host_memory_is_the_planners(tmp_path):
    """dp2 zero=1: the host tensors the run holds per rank are the planner's host bytes per rank,
    16 per shard element (fp32 master, both moments, the fp32 gradient buffer) in fivefold's own
    accounting and ZeRO's alike, plus AdamW's 0-dim step counters (4 bytes per tensor), which no
    per-parameter formula has; of them pinned, the run's flat buffer and the planner's alike, 8 per
    shard element (master and gradient buffer); on the device the moments are gone and the fp32
    shard stays."""
    cfg, _, steps = _run(tmp_path, 1, OFFLOAD)
    model = build_model(cfg, derive(cfg, 2, unpadded_vocab(cfg)).vocab_size)
    P, tensors = count_parameters(model), len([p for p in model.parameters() if p.requires_grad])
    hw = get_hardware("h100")
    ranks_per_node = min(2, hw.gpus_per_node)
    for implementation in (True, False):
        planned = estimate(cfg, 2, hw, implementation=implementation).host_memory_bytes / ranks_per_node
        assert planned == 16 * P / 2
        assert steps[-1]["offload"]["host_bytes"] == planned + 4 * tensors
        pinned = estimate(cfg, 2, hw, implementation=implementation).host_pinned_bytes / ranks_per_node
        assert [s["offload"]["pinned_bytes"] for s in steps] == [pinned] * len(steps) == [8 * P / 2] * len(steps)
    measured, predicted = steps[-1]["model_state_bytes"], steps[-1]["predicted"]["model_state_bytes"]
    assert measured["optimizer"] == 4 * P / 2  # the device's fp32 shard: no moments
    assert measured["optimizer"] == pytest.approx(predicted["optimizer"])


@pytest.mark.parametrize("reshard", [True, False])
def test_params_offload_trains_as_zero3_on_the_device_bit_for_bit(tmp_path, reshard):
    """offload = "params": the host masters are ZeRO-3's shards, brought up for every gather and the
    reduced rows sent down (and added there) at every reduce-scatter; unscaled, clipped and stepped on
    the host. The same fp32 adds, float64 norm and foreach AdamW on the same values: losses, norms and
    final weights bit for bit ZeRO-3's on the device (measured so on CPU), the mesh's traffic
    unchanged, and the host link's bytes offload.step_bytes' formula: resharding, M = 2 micro-batches
    of two gathers a unit (the head's unit one) and a reduce-scatter; kept gathered, one of each."""
    keep = f"--parallel.reshard_after_forward={str(reshard).lower()}"
    cfg, (losses, norms, state), steps = _run(tmp_path / "off", 3, PARAMS, keep)
    _, (ref_losses, ref_norms, ref_state), ref_steps = _run(tmp_path / "ref", 3, keep)
    assert losses == ref_losses and norms == ref_norms
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        assert torch.equal(state[name], ref), name
    assert [s["comm"] for s in steps] == [s["comm"] for s in ref_steps]
    derived = derive(cfg, 2, unpadded_vocab(cfg))
    model = build_model(cfg, derived.vocab_size)
    P, tensors = count_parameters(model), len(list(model.parameters()))
    head = count_parameters(model.norm) + count_parameters(model.output)
    expected = step_bytes(P // 2, head // 2, derived.grad_accum, reshard, pipeline=False)  # no padding at dp 2
    assert derived.grad_accum == 2 and expected["h2d_bytes"] > 0
    assert [{k: s["offload"][k] for k in expected} for s in steps] == [expected] * len(steps)
    # The device keeps no fp32 shard, gradient shard or moment: the planner's fivefold accounting says
    # the same, and its host bytes are the run's, 16 per shard element (the master is the parameter
    # shard), plus AdamW's step counters; ZeRO's accounting adds a bf16 parameter copy, 18.
    measured, predicted = steps[-1]["model_state_bytes"], steps[-1]["predicted"]["model_state_bytes"]
    assert measured["optimizer"] == predicted["optimizer"] == 0
    if reshard:  # kept gathered, the step's full weights and gradients stay until the last backward
        assert measured["total"] == 0 and predicted["grads"] == 0
    hw = get_hardware("h100")
    per_rank = min(2, hw.gpus_per_node)
    assert estimate(cfg, 2, hw, implementation=True).host_memory_bytes / per_rank == 16 * P / 2
    assert steps[-1]["offload"]["host_bytes"] == 16 * P / 2 + 4 * tensors
    assert estimate(cfg, 2, hw).host_memory_bytes / per_rank == 18 * P / 2
    # Pinned: the master (the parameter shard) and the gradient buffer, 8; ZeRO's adds its bf16 copy
    assert steps[-1]["offload"]["pinned_bytes"] == 8 * P / 2
    assert estimate(cfg, 2, hw, implementation=True).host_pinned_bytes / per_rank == 8 * P / 2
    assert estimate(cfg, 2, hw).host_pinned_bytes / per_rank == 10 * P / 2


def _offload_at_work(rank, world, cfg):
    from fivefold.parallel.optimizer import init_optimizer_state

    par = parallelized(cfg, world)
    off = par.offload
    stepped = {id(p) for group in par.optimizer.param_groups for p in group["params"]}  # decay groups apart
    assert off is not None and stepped == {id(h) for h in off.host_masters}
    device_ptrs = {m.untyped_storage().data_ptr() for m in off.device_masters}
    host = [*off.host_masters, *off.host_grads]
    assert not device_ptrs & {t.untyped_storage().data_ptr() for t in host}  # separate memory
    assert all(torch.equal(h, m) for h, m in zip(off.host_masters, off.device_masters, strict=True))  # pulled
    before = [m.clone() for m in off.device_masters]
    for m in off.device_masters:
        m.grad = torch.full_like(m, 0.5)
    off.to_host()
    assert all(h.grad is g and torch.equal(g, m.grad)
               for h, g, m in zip(off.host_masters, off.host_grads, off.device_masters, strict=True))
    par.optimizer.step()
    init_optimizer_state(par.optimizer)
    moments = [par.optimizer.state[h]["exp_avg"] for h in off.host_masters]
    assert not device_ptrs & {t.untyped_storage().data_ptr() for t in moments}  # the state is the host's
    changed_on_host = all(not torch.equal(h, b) for h, b in zip(off.host_masters, before, strict=True))
    still = all(torch.equal(m, b) for m, b in zip(off.device_masters, before, strict=True))  # until copied up
    off.to_device()
    arrived = all(torch.equal(m, h) for m, h in zip(off.device_masters, off.host_masters, strict=True))
    n = sum(m.numel() for m in off.device_masters)
    return changed_on_host, still, arrived, off.d2h_bytes, off.h2d_bytes, 4 * n


def test_the_optimizer_steps_the_host_copies(tmp_path):
    """Fails if offload silently does nothing: the optimizer steps tensors of their own memory, the
    gradients travel down into them, and the device's shards change only when the copy up is made."""
    cfg = tiny_config(tmp_path, "--parallel.dp=2", "--parallel.zero=1", OFFLOAD)
    for changed_on_host, still, arrived, d2h, h2d, shard_bytes in run_workers(_offload_at_work, 2, cfg):
        assert changed_on_host and still and arrived
        assert d2h == h2d == shard_bytes > 0


def _params_at_work(rank, world, cfg):
    par = parallelized(cfg, world)
    off, shards = par.offload, par.dp.shards
    stepped = {id(p) for group in par.optimizer.param_groups for p in group["params"]}
    b = par.dp.buckets[0]
    staged = off.stage(b)  # what a gather sends: a device buffer of its own
    host = {t.untyped_storage().data_ptr() for t in [*off.host_masters, *off.host_grads]}
    return (stepped == {id(h) for h in off.host_masters} and off.device_masters == [],
            all(shards.masters[id(p)] is h for p, h in zip(par.dp.params, off.host_masters, strict=True)),
            staged.untyped_storage().data_ptr() not in host,
            torch.equal(staged, torch.cat([shards.masters[id(p)].reshape(-1) for p in b.params])),
            off.h2d_bytes == 4 * sum(b.shard_numel))


def test_params_offload_gathers_from_staged_copies_of_the_host_shards(tmp_path):
    """Fails if parameter offload silently keeps device shards: the optimizer steps the host masters,
    which are ZeRO-3's shards (no other fp32 shard is kept), and a gather sends a staged copy of them."""
    cfg = tiny_config(tmp_path, "--parallel.dp=2", "--parallel.zero=3", PARAMS)
    for checks in run_workers(_params_at_work, 2, cfg):
        assert all(checks), checks


def _host_layout(rank, world, cfg):
    """Where the host masters and gradient buffers are: (offset in the flat buffer, elements) each."""
    off = parallelized(cfg, world).offload
    flat = off.flat
    assert flat.dtype == torch.float32 and not flat.is_pinned()  # a CPU run pins nothing
    host = [*off.host_masters, *off.host_grads]
    assert all(t.untyped_storage().data_ptr() == flat.data_ptr() for t in host)
    return [((t.data_ptr() - flat.data_ptr()) // 4, t.numel()) for t in host], flat.numel(), off.pinned_bytes


@pytest.mark.parametrize("zero,mode", [(1, OFFLOAD), (3, PARAMS)])
def test_the_host_copies_are_views_into_one_flat_buffer(tmp_path, zero, mode):
    """One host buffer per rank, made (and on CUDA page-locked) once: the masters then their gradient
    buffers, parameter order, back to back; its bytes, 8 per shard element, are the pinned bytes
    reported. Fails where each host tensor was an allocation of its own (pinned one at a time)."""
    cfg = tiny_config(tmp_path, "--parallel.dp=2", f"--parallel.zero={zero}", mode)
    for layout, numel, pinned in run_workers(_host_layout, 2, cfg):
        offsets = [o for o, _ in layout]
        sizes = [n for _, n in layout]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))] and sum(sizes) == numel
        assert sizes[: len(sizes) // 2] == sizes[len(sizes) // 2:]  # a gradient buffer per master
        assert pinned == 4 * numel > 0


class _FakeCudart:
    """torch.cuda.cudart()'s two calls _page_lock makes, recorded (no GPU here)."""

    def __init__(self, error: int = 0):
        self.calls, self.error = [], error

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 - the CUDA runtime's names
        self.calls.append(("register", ptr, nbytes, flags))
        return self.error

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.calls.append(("unregister", ptr))
        return 0


def test_the_flat_buffer_is_page_locked_at_its_exact_size_once(monkeypatch):
    """On CUDA one cudaHostRegister of exactly the buffer's bytes (torch's pinned allocator would round
    them up to a power of two), undone with the device idle when its owner goes; a refusal is one
    line naming the setting and the fix. CUDA's calls are recorded here, not made."""
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: cudart.calls.append(("synchronize",)))

    class Owner:
        pass

    owner, flat = Owner(), torch.empty(3 * 1000 + 5)  # (3005,) fp32: 12,020 bytes, not a power of two
    offload._page_lock(owner, flat)
    assert cudart.calls == [("register", flat.data_ptr(), 12_020, 1)]
    del owner
    gc.collect()
    assert cudart.calls[1:] == [("synchronize",), ("unregister", flat.data_ptr())]
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart(error=2))
    with pytest.raises(RuntimeError) as refused:
        offload._page_lock(Owner(), flat)
    assert str(refused.value) == ("parallel.offload: page-locking the 0.00 GiB host buffer of this rank's masters and "
                                  "gradients failed (cudaError 2): raise the locked-memory limit (ulimit -l) or free "
                                  "host memory")


def _losses(rank, world, cfg):
    return train(cfg, progress=False).losses


@pytest.mark.parametrize("zero,saved,resumed", [(1, "optimizer", "none"), (1, "none", "optimizer"),
                                                (3, "optimizer", "optimizer"), (3, "params", "none"),
                                                (3, "optimizer", "params")])
def test_a_checkpoint_moves_between_offload_modes(tmp_path, zero, saved, resumed):
    """Saved under one parallel.offload, resumed under another: the same master weights and moments
    (the state dicts read the host copies, or with "params" the host shards), so the resumed steps
    are the uninterrupted run's, bit for bit."""
    args = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=4", "--checkpoint.every=2",
            "--parallel.dp=2", f"--parallel.zero={zero}")
    losses = run_workers(_losses, 2, tiny_config(tmp_path, *args, f"--parallel.offload={saved}"))[0]
    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])
    again = run_workers(_losses, 2, tiny_config(tmp_path, *args, f"--parallel.offload={resumed}",
                                                "--checkpoint.resume=true"))[0]
    assert again == losses[2:]
