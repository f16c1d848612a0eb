"""LoRA's price (lora.rank > 0; planner/lora.py, lora_step.py): what trains, its state, its traffic."""

import dataclasses

import pytest
import torch

from fivefold.cli import main
from fivefold.config.derive import derive
from fivefold.config.load import load_config
from fivefold.model.lora import PEFT_NAMES, apply_lora
from fivefold.model.transformer import Transformer
from fivefold.planner.estimate import estimate
from fivefold.planner.lora import adapter_params, model_adapters
from fivefold.planner.machine.datasheet import get_hardware

SEVEN = 41_943_040  # Llama 3 8B, r = 16 on q,k,v,o,gate,up,down: 32 x 16 x (3 x 4096 + 2 x 5120 + 3 x 18432)
BASE = 8_030_261_248  # its parameters (meta-llama/Meta-Llama-3-8B)


def llama(*extra):
    return load_config(None, ["--model.preset=llama3-8b", "--train.seq_len=8192", "--train.micro_batch=1",
                              "--train.global_batch=64", *extra])


def test_llama3_8b_adapter_count():
    assert adapter_params(llama("--lora.rank=16")) == SEVEN
    assert len(model_adapters(llama("--lora.rank=16"))) == 32 * 7


@pytest.mark.parametrize("implementation", [False, True])
def test_state_bytes_dp8_zero1(implementation):
    """The base as weights only (2 bytes in ZeRO's accounting, fivefold's fp32), the adapters with their
    whole state, ZeRO-1 sharding their optimizer state over 8."""
    e = estimate(llama("--lora.rank=16", "--parallel.zero=1"), 8, get_hardware("h100"), implementation=implementation)
    if implementation:  # fp32 weights and gradients (8 micro-batches: the full gradient held), fp32 master + 2 moments
        expected = {"params": 4.0 * (BASE + SEVEN), "grads": 4.0 * SEVEN, "optimizer": 12.0 * SEVEN / 8}
    else:
        expected = {"params": 2.0 * (BASE + SEVEN), "grads": 2.0 * SEVEN, "optimizer": 12.0 * SEVEN / 8}
    for k, v in expected.items():
        assert e.memory[k] == pytest.approx(v, rel=1e-12), k
    full = estimate(llama("--parallel.zero=1"), 8, get_hardware("h100"), implementation=implementation)
    assert full.memory["optimizer"] > 100 * e.memory["optimizer"]


def test_dp_traffic_is_the_adapters_gradients():
    """ZeRO-1: reduce-scatter of the adapters' bf16 gradients and all-gather of their weights, (N-1)/N each."""
    e = estimate(llama("--lora.rank=16", "--parallel.zero=1"), 8, get_hardware("h100"))
    assert e.comm["dp"].bytes == pytest.approx(2 * 7 / 8 * 2.0 * SEVEN, rel=1e-12)
    ddp = estimate(llama("--lora.rank=16", "--parallel.zero=0"), 8, get_hardware("h100"))
    assert ddp.comm["dp"].bytes == pytest.approx(2 * 7 / 8 * 2.0 * SEVEN, rel=1e-12)  # all-reduce: the same


def test_tp_all_reduces_the_whole_factors_once():
    """tp = 2: A of q,k,v,gate,up and B of o,down whole on both ranks, their gradients summed once a step
    (ZeRO-1 over 4: this rank's rows); nothing else on tp changes."""
    hw = get_hardware("h100")
    base = estimate(llama("--parallel.tp=2", "--parallel.zero=1"), 8, hw).comm["tp"].bytes
    lora = estimate(llama("--parallel.tp=2", "--parallel.zero=1", "--lora.rank=16"), 8, hw).comm["tp"].bytes
    partial = 32 * 16 * (5 * 4096 + 2 * 4096)
    assert lora - base == pytest.approx(2 * 1 / 2 * 2.0 * partial / 4, rel=1e-9)


def test_step_is_faster_and_mfu_counts_no_base_weight_gradients():
    hw = get_hardware("h100")
    full, lora = (estimate(llama("--parallel.zero=1", *x), 8, hw) for x in ((), ("--lora.rank=16",)))
    assert lora.step_time_s < full.step_time_s
    # model FLOPs per token: 6 N_matmul + attention -> 4 N_matmul + attention + 6 x adapters
    saved = full.flops["model_per_token"] - lora.flops["model_per_token"]
    assert saved > 0 and saved == pytest.approx(2 * (BASE - 128256 * 4096) - 6 * SEVEN, rel=1e-3)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mla", "tiny-moe", "llama3-8b"])
def test_adapted_layers_equal_apply_lora(preset):
    """Every target named: the planner's layers, shapes and order are apply_lora's on the meta model."""
    targets = '["' + '","'.join(sorted(set(PEFT_NAMES.values()))) + '"]'
    cfg = load_config(None, [f"--model.preset={preset}", "--lora.rank=4", "--model.mtp_layers=1",
                             f"--lora.targets={targets}"])
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(cfg.model, vocab_size=1024))
    names = apply_lora(model, cfg.lora)
    built = [(n, (model.get_submodule(n).in_features, model.get_submodule(n).out_features)) for n in names]
    assert built == [(a.name, a.shape) for a in model_adapters(cfg)]
    assert adapter_params(cfg) == sum(p.numel() for n, p in model.named_parameters() if ".lora." in n)


def test_plan_states_lora(capsys):
    rc = main(["plan", "--model", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--seq", "8192", "--global-batch", "64",
               "--layout", "dp=8,zero=1,micro_batch=1", "--lora.rank", "16", "--explain"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "41,943,040 adapter parameters" in out and "compute: LoRA" in out
    assert "fits" in out and "yes" in out


@pytest.mark.parametrize("keep", [False, True])
def test_zero3_dp_bytes_are_the_counted_runs(tmp_path, keep):
    """ZeRO-3 at the counted run's settings (tests/parallel/test_lora_layouts.py: tiny, dp2, 2 micro-batches a
    step, fp32): whole units gathered, base and adapters, the frozen embedding once a micro-batch (no backward),
    the head's unit once (kept across), the adapters alone reduce-scattered; kept gathered, once a step. The
    run counts the norm's 8-byte all-reduce besides, which the planner leaves to the step sync."""
    from helpers import LORA, tiny_config

    from fivefold.planner.selfcheck import predict_for_config
    from fivefold.train.loop import build_model

    cfg = tiny_config(tmp_path, *LORA, "--parallel.zero=3", "--train.micro_batch=2",
                      f"--parallel.reshard_after_forward={str(not keep).lower()}")
    n, m = 2, 2
    model = build_model(cfg, 320)
    every = sum(p.numel() for p in model.parameters()) * 4  # fp32 bytes, adapters included
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad) * 4
    embedding, head = (sum(p.numel() for p in mod.parameters()) * 4 for mod in (model.tok_embeddings, model.output))
    head += sum(p.numel() for p in model.norm.parameters()) * 4
    expected = ((every + adapters) if keep else m * (2 * every - head - embedding + adapters)) * (n - 1) / n
    assert predict_for_config(cfg, n)["comm_wire_bytes"]["dp"] == expected


@pytest.mark.parametrize("implementation", [False, True])
def test_zero3_shards_the_base_and_gathers_whole_units(implementation):
    """Llama 3 8B dp8 ZeRO-3 r16: the frozen base sharded (fp32 rows in fivefold's code, b_p in ZeRO's), no
    gradient for it; two whole units gathered at once (the head's, the largest: V d + d), in param_dtype;
    dp moves each unit twice a micro-batch (the head's and the frozen embedding's once) and the adapters'
    gradients, where ZeRO-1 moves the adapters alone."""
    e = estimate(llama("--lora.rank=16", "--parallel.zero=3"), 8, get_hardware("h100"), implementation=implementation)
    p = 4.0 if implementation else 2.0
    expected = {"params": p * BASE / 8 + (0.0 if implementation else 2.0 * SEVEN / 8), "grads": p * SEVEN / 8,
                "optimizer": 12.0 * SEVEN / 8}
    for k, v in expected.items():
        assert e.memory[k] == pytest.approx(v, rel=1e-12), k
    vocab = 128256 * 4096
    assert e.memory["buffers"] == 2 * (vocab + 4096) * 2.0  # b_p = 2 gathers (BytesPerParam, both accountings)
    every, m = p * (BASE + SEVEN), 8  # dp 8, global batch 64: 8 micro-batches
    assert e.comm["dp"].bytes == pytest.approx(m * (2 * every - p * (2 * vocab + 4096) + p * SEVEN) * 7 / 8, rel=1e-12)
    zero1 = estimate(llama("--lora.rank=16", "--parallel.zero=1"), 8, get_hardware("h100"),
                     implementation=implementation)
    print(f"Llama 3 8B dp8 r16 ({'fivefold' if implementation else 'ZeRO'}): ZeRO-3 {e.memory['total'] / 1e9:.2f} GB, "
          f"dp {e.comm['dp'].bytes / 1e9:.2f} GB; ZeRO-1 {zero1.memory['total'] / 1e9:.2f} GB, "
          f"dp {zero1.comm['dp'].bytes / 1e9:.4f} GB")
    assert e.memory["total"] < zero1.memory["total"] and e.comm["dp"].bytes > 100 * zero1.comm["dp"].bytes


def test_nf4_base_bytes_are_the_built_tensors():
    """lora.base_dtype = "nf4": the planner's bytes of the NF4 base (planner/lora.py nf4_base) are those of
    the buffers model/lora.py quantise_base builds, layer by layer summed, on a tiny model; 8x under fp32."""
    from fivefold.model.counts import model_counts
    from fivefold.model.lora import quantise_base
    from fivefold.planner.layout import rank_shares
    from fivefold.planner.lora import nf4_base
    from fivefold.planner.memory import BytesPerParam, rank_state_bytes

    cfg = load_config(None, ["--model.dim=128", "--model.n_layers=2", "--lora.rank=4", "--lora.base_dtype=nf4"])
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=256))
    apply_lora(model, cfg.lora)
    quantise_base(model)
    built = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".nf4." in n)
    share = rank_shares(cfg, model_counts(cfg.model, 256))[0]
    elements, planned = nf4_base(cfg, share)
    assert (elements, planned) == (2 * 7 * 128 * 128, built)
    assert 4 * elements / planned == pytest.approx(7.7, abs=0.05)  # 0.5156 bytes an element, and per-layer constants
    # the model state fivefold's meter counts (train/loop.py quantise_lora_base): the fp32 parameters left (the
    # adapters', the embedding's, norms', head's) and the NF4 buffers, where the dense base was priced before
    state = rank_state_bytes(cfg, derive(cfg, 1, 256), share, BytesPerParam(), implementation=True)
    assert state["params"] == 4 * sum(p.numel() for p in model.parameters()) + built
