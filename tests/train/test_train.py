"""The pieces of the training loop: optimizer groups, schedules, clipping, evaluation, options."""

import math

import pytest
import torch
import torch.utils._python_dispatch
from helpers import tiny_config

from fivefold.config.schema import OptimConfig, TrainConfig
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.optimizer import build_optimizer, clip_grad_norm
from fivefold.train.loop import build_model, train
from fivefold.train.lr_schedule import lr_at


def test_no_weight_decay_on_norms_and_biases(tmp_path):
    model = build_model(tiny_config(tmp_path), 320)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("norm.weight") for p in no_decay["params"])
    assert len(no_decay["params"]) == 2 * 8 + 1  # two norms per block and the final norm
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_learning_rate_schedules():
    cos = OptimConfig(warmup_steps=10, lr=1.0, min_lr_ratio=0.1, lr_schedule="cosine")
    assert [lr_at(s, cos, 110) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # linear warmup reaches the peak
    assert lr_at(10, cos, 110) == 1.0 and math.isclose(lr_at(60, cos, 110), 0.55)
    assert math.isclose(lr_at(110, cos, 110), 0.1)
    wsd = OptimConfig(warmup_steps=10, lr=1.0, min_lr_ratio=0.0, lr_schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, wsd, 100) == lr_at(79, wsd, 100) == 1.0  # stable
    assert math.isclose(lr_at(89, wsd, 100), 0.5) and lr_at(99, wsd, 100) == 0.0  # linear decay over the last 20
    const = OptimConfig(warmup_steps=0, lr_schedule="constant")
    assert lr_at(0, const, 100) == lr_at(99, const, 100) == const.lr


def test_clip_grad_norm_scales_to_the_cap():
    grads = [torch.tensor([3.0, 0.0, 0.0]), torch.tensor([0.0, 4.0, 0.0, 0.0])]
    norm = clip_grad_norm(grads, 1.0)
    assert norm.dtype == torch.float64 and norm.dim() == 0 and norm == 5.0  # on the device: nothing read
    assert float(torch.cat(grads).norm()) == pytest.approx(1.0, abs=1e-5)
    assert float(clip_grad_norm(grads, 0.0)) == pytest.approx(1.0, abs=1e-5)  # 0 disables clipping
    assert float(torch.cat(grads).norm()) == pytest.approx(1.0, abs=1e-5)


def _train(rank, world, cfg):
    r = train(cfg, progress=False)
    return r.losses, r.val_losses


def test_validation_loss_is_the_same_for_every_layout(tmp_path):
    args = ("--train.steps=2", "--train.eval_every=1", "--data.val_fraction=0.2", "--train.eval_batches=2")
    _, val1 = run_workers(_train, 1, tiny_config(tmp_path / "a", *args))[0]
    _, val2 = run_workers(_train, 2, tiny_config(tmp_path / "b", *args))[0]
    assert list(val1) == [1, 2]
    for step in val1:  # the same tokens, summed in another order: 1e-6 relative
        assert val2[step] == pytest.approx(val1[step], rel=1e-6)
    assert 3.0 < val1[1] < 6.5  # a real loss near ln(320) = 5.8 at the start, not zero or NaN


def test_bpe_tokenizer_is_trained_once_and_shared(tmp_path):
    cfg = tiny_config(tmp_path, "--data.tokenizer=bpe", "--data.bpe_vocab=400", "--data.max_bytes=30000",
                      "--train.steps=2")
    losses = run_workers(_train, 2, cfg)
    tokenizer = tmp_path / "tiny" / "tokenizer" / "tokenizer.json"  # prepared once, copied into the run
    assert tokenizer.is_file() and tokenizer.read_bytes() == next((tmp_path / ".prepared").glob(
        "*/tokenizer/tokenizer.json")).read_bytes()
    assert losses[0] == losses[1]  # both ranks used the same tokenizer and batches
    assert losses[0][0][0] == pytest.approx(math.log(448), abs=0.3)  # vocabulary padded to 448


def test_moe_model_under_data_parallel_matches_one_process(tmp_path):
    args = ("--model.preset=tiny-moe", "--train.steps=3", "--data.max_bytes=20000")
    ref, _ = run_workers(_train, 1, tiny_config(tmp_path / "a", *args, "--train.micro_batch=8"))[0]
    dp2, _ = run_workers(_train, 2, tiny_config(tmp_path / "b", *args, "--train.micro_batch=2"))[0]
    # fp32 summation order only (see test_data_parallel.py for the measured bound)
    torch.testing.assert_close(torch.tensor(dp2), torch.tensor(ref), rtol=1e-5, atol=0)


def test_compiled_blocks_give_the_same_losses(tmp_path):
    # torch.compile on CPU takes ~35 s for this 2-block model: the one slow test, kept because
    # `train.compile` is a user-facing switch that must not change the numbers. Compiled under
    # ZeRO-3 (2 ranks, compiling side by side): FSDP's gather and free hooks run around the
    # compiled blocks, and freeing a parameter's storage must not disturb what the compiled
    # backward saved (it is refilled, in the same storage, before the block's backward).
    args = ("--train.steps=2", "--model.n_layers=2", "--data.max_bytes=3000")
    eager, _ = run_workers(_train, 1, tiny_config(tmp_path / "a", *args))[0]
    compiled, _ = run_workers(_train, 2, tiny_config(tmp_path / "b", *args, "--train.compile=true",
                                                     "--parallel.zero=3", "--train.micro_batch=1"), timeout=300)[0]
    # fp32 summation order only (2 ranks, 4 micro-batches each), as in test_data_parallel.py
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-5, atol=0)


def test_dynamic_loss_scaling_skips_overflows_and_grows_back():
    from fivefold.train.precision import LossScaler

    scaler = LossScaler(TrainConfig(dtype="fp16", initial_scale_power=4, loss_scale_window=2, min_loss_scale=2.0))
    assert scaler.scale == 16.0
    grads = [torch.tensor([32.0, 16.0])]
    assert scaler.unscale(grads, []) and torch.equal(grads[0], torch.tensor([2.0, 1.0]))
    assert not scaler.unscale([torch.tensor([float("inf")])], [])
    scaler.update(False)
    assert scaler.scale == 8.0  # halved on overflow
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale == 2.0  # never below min_loss_scale
    scaler.update(True)
    scaler.update(True)
    assert scaler.scale == 4.0 and scaler.clean_steps == 0  # doubled after a window of clean steps
    fixed = LossScaler(TrainConfig(dtype="fp16", loss_scale=128.0))
    fixed.update(False)
    assert fixed.scale == 128.0
    assert LossScaler(TrainConfig(dtype="bf16")).scale == 1.0


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_compute_trains_close_to_fp32(tmp_path, dtype):
    args = ("--train.steps=3", "--data.max_bytes=20000", "--parallel.zero=2")
    ref, _ = run_workers(_train, 2, tiny_config(tmp_path / "a", *args))[0]
    low, _ = run_workers(_train, 2, tiny_config(tmp_path / "b", *args, f"--train.dtype={dtype}",
                                                "--parallel.reduce_dtype=bf16"))[0]
    # bf16 keeps 8 bits of mantissa (fp16 11): ~0.4% per rounding; losses stay within 2%.
    torch.testing.assert_close(torch.tensor(low), torch.tensor(ref), rtol=2e-2, atol=0)
    assert low != ref  # the low-precision path really ran


def _train_expecting(rank, world, cfg):
    from fivefold.train.loop import train

    try:
        return train(cfg, progress=False).losses
    except FloatingPointError as e:
        return str(e)


def _fused(flag: bool) -> None:
    """In a forked worker: take (True) or leave (False) the CUDA path of the optimizer step on the
    CPU, whose AdamW has a fused kernel too (found_inf included)."""
    import fivefold.parallel.optimizer as optimizer
    import fivefold.parallel.parallelize as parallelize

    optimizer.fused_on = parallelize.fused_on = lambda device: flag


def _train_expecting_on(rank: int, world: int, cfg, fused: bool):
    _fused(fused)
    return _train_expecting(rank, world, cfg)


@pytest.mark.parametrize("fused", [False, True], ids=["foreach", "fused-on-device-verdict"])
def test_a_nonfinite_gradient_stops_with_the_step_and_parameter_or_is_skipped(tmp_path, fused):
    """lr 1e30 makes every weight ~1e30 after step 1, so step 2's loss and gradients are not finite.
    Both verdicts: read before AdamW (foreach, the CPU's), or on the device (fused AdamW's found_inf, CUDA's)."""
    args = ("--train.steps=3", "--optim.lr=1e30", "--optim.warmup_steps=0", "--data.max_bytes=20000")
    messages = run_workers(_train_expecting_on, 2, tiny_config(tmp_path / "stop", *args), fused)
    for message in messages:  # every rank stops, with the same message
        assert message.startswith("step 2: the gradient is not finite (first: ") and "(rank " in message
        assert "train.nonfinite = 'skip'" in message
    losses = run_workers(_train_expecting_on, 1, tiny_config(tmp_path / "skip", *args, "--train.nonfinite=skip"),
                         fused)[0]
    assert len(losses) == 3  # the run went on; the skipped steps applied nothing


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts .item() / float() of float64 tensors (aten._local_scalar_dense) while active: the norm is
    one; foreach AdamW's step counters (float32) live on the host already and are not device reads."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default and args[0].dtype == torch.float64
        return func(*args, **(kwargs or {}))


def _optimizer_reads(rank: int, world: int, cfg, fused: bool):
    """Train; per step, the host reads inside Parallelized.optimizer_step, the losses, the parameters."""
    from fivefold.parallel.parallelize import Parallelized

    _fused(fused)
    original, reads = Parallelized.optimizer_step, []

    def counted(self, *args, **kwargs):
        with _ScalarReads() as mode:
            outcome = original(self, *args, **kwargs)
        reads.append(mode.n)
        return outcome

    Parallelized.optimizer_step = counted
    result = train(cfg, progress=False, return_state=True)
    return reads, result.losses, result.grad_norms, result.state


def test_fused_adamw_steps_without_a_host_read_and_as_foreach_does(tmp_path):
    """The CUDA path (fused AdamW, its verdict on the device) reads nothing in the optimizer step; the
    foreach path reads the norm once. Both train alike: on the CPU fused AdamW rounds differently
    from foreach by an ulp (measured 1.2e-7 on one step), so the runs agree to the equivalence bounds."""
    cfg = tiny_config(tmp_path, "--train.steps=3", "--data.max_bytes=20000")
    (fused_reads, fused_losses, fused_norms, fused_state), = run_workers(_optimizer_reads, 1, cfg, True)
    (reads, losses, norms, state), = run_workers(_optimizer_reads, 1, tiny_config(tmp_path / "b", "--train.steps=3",
                                                                                   "--data.max_bytes=20000"), False)
    assert fused_reads == [0, 0, 0] and reads == [1, 1, 1]
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(fused_norms), torch.tensor(norms), rtol=5e-4, atol=0)
    for name, value in state.items():
        torch.testing.assert_close(fused_state[name], value, rtol=0, atol=1e-4, msg=name)


def test_adamw_is_fused_on_cuda_and_foreach_elsewhere(monkeypatch):
    import fivefold.parallel.optimizer as optimizer
    from fivefold.parallel.optimizer import init_optimizer_state

    params = [torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(4))]
    group = build_optimizer(params, OptimConfig()).param_groups[0]
    assert group["foreach"] and not group["fused"]
    monkeypatch.setattr(optimizer, "fused_on", lambda device: True)
    opt = build_optimizer(params, OptimConfig())
    assert opt.param_groups[0]["fused"] and not opt.param_groups[0]["foreach"]
    init_optimizer_state(opt)  # the step counter where fused AdamW keeps it: beside the parameter
    assert opt.state[params[0]]["step"].dtype == torch.float32


def test_the_garbage_collector_runs_between_steps_only():
    """train.gc_every: automatic collection off inside the loop, a collection every N steps, and
    Python's own behaviour back afterwards (train/gc_policy.py)."""
    import gc

    from fivefold.train.gc_policy import collect_between_steps

    runs = []
    gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
    try:
        with collect_between_steps(3) as collector:
            assert not gc.isenabled()
            runs.clear()  # the collection before freezing what set-up built
            for done in range(1, 8):
                collector.after_step(done)
            assert runs == [2, 2]  # after steps 3 and 6, full collections
        assert gc.isenabled()
        with collect_between_steps(0) as collector:  # 0: untouched
            assert gc.isenabled()
    finally:
        gc.callbacks.pop()
