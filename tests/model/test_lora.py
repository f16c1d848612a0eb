"""LoRA's adapters (model/lora.py): which layers get one, a frozen base, PEFT's initialisation drawn
by name like every parameter, and the adapted layer's function."""

from __future__ import annotations

import dataclasses
import math

import torch
from helpers import tiny_config
from torch import nn

from fivefold.model.lora import LoRALinear, apply_lora, is_adapter
from fivefold.model.seeded_init import init_box
from fivefold.model.transformer import Transformer


def _model(tmp_path, *overrides: str) -> tuple[Transformer, object]:
    cfg = tiny_config(tmp_path, "--lora.rank=4", *overrides)
    model = Transformer(dataclasses.replace(cfg.model, vocab_size=64))
    return model, cfg


def test_targets_get_adapters_and_the_rest_is_frozen(tmp_path):
    model, cfg = _model(tmp_path, "--model.preset=tiny-mla", "--model.mtp_layers=1",
                        "--lora.targets=['q_b_proj', 'kv_b_proj', 'o_proj', 'down_proj', 'eh_proj']")
    chosen = apply_lora(model, cfg.lora)
    assert "layers.0.attn.wq_b" in chosen and "layers.1.ffn.shared.down" in chosen and "mtp.0.eh_proj" in chosen
    assert not any(n.endswith(("wq_a", "wkv_a", "router", "gate", "up")) for n in chosen)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{m}.lora.{f}" for m in chosen for f in "ab"}
    assert all(is_adapter(n) for n in trainable)
    assert "layers.0.attn.wq_b.weight" in dict(model.named_parameters())  # the base keeps its name


def test_a_fresh_adapter_leaves_the_function_and_adds_its_update(tmp_path):
    """B starts at zero: the adapted model computes the frozen one's logits exactly; with B set, a layer
    adds scaling (x A^T) B^T, scaling = alpha / r (rsLoRA: alpha / sqrt(r))."""
    torch.manual_seed(0)
    model, cfg = _model(tmp_path)
    model.init_weights()
    tokens = torch.randint(0, 64, (2, 16))
    before = model(tokens)
    apply_lora(model, cfg.lora)
    model.init_weights()  # the same base values (seeded by name), the adapters' A uniform, B zero
    torch.testing.assert_close(model(tokens), before, rtol=0, atol=0)
    layer = model.layers["0"].attn.wq
    assert isinstance(layer, LoRALinear)
    layer.lora.b.data.normal_()
    x = torch.randn(3, cfg.model.dim)
    expected = x @ layer.weight.T + (x @ layer.lora.a.T) @ layer.lora.b.T * (cfg.lora.alpha / cfg.lora.rank)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    _, rs = _model(tmp_path, "--lora.rslora=true")
    assert LoRALinear.around(nn.Linear(8, 8), rs.lora).lora.scaling == rs.lora.alpha / math.sqrt(rs.lora.rank)


def test_adapters_start_as_peft_does_drawn_by_name(tmp_path):
    """A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform, a = sqrt(5): nn.Linear's and PEFT's), B = 0;
    any box (a tp or ZeRO slice) draws the whole tensor's values there."""
    model, cfg = _model(tmp_path)
    name, shape = "layers.0.ffn.down.lora.a", (4, cfg.model.ffn_dim)
    a = init_box(name, shape, (slice(0, 4), slice(0, shape[1])), cfg.model, 0)
    bound = 1 / math.sqrt(shape[1])
    assert a.abs().max() <= bound and a.abs().max() > 0.9 * bound and abs(float(a.mean())) < 0.2 * bound
    part = init_box(name, shape, (slice(1, 3), slice(32, 96)), cfg.model, 0)
    assert torch.equal(part, a[1:3, 32:96])
    assert not init_box("layers.0.ffn.down.lora.b", (64, 4), (slice(0, 64), slice(0, 4)), cfg.model, 0).any()
