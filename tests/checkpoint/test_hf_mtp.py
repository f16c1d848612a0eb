"""DeepSeek-V3's multi-token-prediction layer in and out of Hugging Face: the released key layout, the
shared embedding and head, exact round trips, sampling without it, and HF -> train at pp2 x ep2 -> HF."""

import dataclasses
import json
import shutil

import pytest
import test_hf_moe_families
import torch
from helpers import assert_same_hf_directory
from safetensors.torch import load_file, save_file
from test_hf_moe_families import MTP_NAMES, MTP_SCALES, hf_class

from fivefold.checkpoint.convert import fivefold_to_hf, hf_to_fivefold
from fivefold.checkpoint.hf import HFFormatError, HFSource, export_problems
from fivefold.checkpoint.safetensors_io import SafetensorsDir
from fivefold.config.load import load_config
from fivefold.parallel.forked_ranks import run_workers
from fivefold.validate import validate

released = test_hf_moe_families.released  # the fp8 DeepSeek-V3 toy with one MTP layer (module fixture)


@pytest.fixture(scope="module")
def seed(released, tmp_path_factory):
    """The fp8 toy converted (`fivefold convert --to fivefold`): fp32 weights, MTP kept."""
    out = tmp_path_factory.mktemp("mtp") / "seed"
    hf_to_fivefold(released["root"] / "fp8", out, max_shard_bytes=10**9)
    return out


def test_the_released_mtp_layout_converts_both_ways_exactly(tmp_path, released, seed):
    """The toy's layer 2 has the released checkpoint's names (fp8 scales included); fivefold reads it as
    mtp.0.* (the block's tensors named as a main block's), writes it back under the same names, and the
    whole directory comes back bit for bit as the dequantized one, which transformers loads with its logits."""
    assert {n for n in released["quantized"] if n.startswith("model.layers.2.")} == MTP_NAMES | MTP_SCALES
    assert load_config(seed / "fivefold.toml").model.mtp_layers == 1
    ours = SafetensorsDir(seed)
    block = {n.removeprefix("layers.1.") for n in ours.names() if n.startswith("layers.1.")}
    assert {n for n in ours.names() if n.startswith("mtp.")} == (
        {f"mtp.0.{n}.weight" for n in ("enorm", "hnorm", "eh_proj", "norm")} | {f"mtp.0.block.{n}" for n in block})
    deq = released["dequantized"]
    for name, hf in [("mtp.0.enorm.weight", "enorm.weight"), ("mtp.0.norm.weight", "shared_head.norm.weight"),
                     ("mtp.0.eh_proj.weight", "eh_proj.weight"),  # fp8 in the release: dequantized
                     ("mtp.0.block.ffn.router.weight", "mlp.gate.weight")]:
        assert torch.equal(ours.read(name), deq[f"model.layers.2.{hf}"]), name
    assert torch.equal(ours.read("mtp.0.block.ffn.experts.up")[3], deq["model.layers.2.mlp.experts.3.up_proj.weight"].T)

    fivefold_to_hf(seed, tmp_path / "back", max_shard_bytes=60_000)  # fp32, sharded
    assert_same_hf_directory(released["root"] / "deq", tmp_path / "back")  # the round trip: 0 bits differ
    back = SafetensorsDir(tmp_path / "back")
    assert {n for n in back.names() if n.startswith("model.layers.2.")} == MTP_NAMES
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and "quantization_config" not in config
    hf = hf_class("DeepseekV3", "ForCausalLM").from_pretrained(tmp_path / "back").eval()  # ignores layer 2
    with torch.no_grad():
        torch.testing.assert_close(hf(released["x"]).logits, released["logits"], rtol=0, atol=0)


def test_mtp_copies_of_the_embedding_or_head_that_differ_are_refused(tmp_path, released, seed):
    """By `convert`, and by checkpoint.init_from's check before any process starts."""
    from fivefold.checkpoint.weights import check_init_from

    tensors = load_file(str(released["root"] / "deq" / "model.safetensors"))
    tensors["model.layers.2.shared_head.head.weight"][317, 5] += 1e-3
    (tmp_path / "bad").mkdir()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    shutil.copy(released["root"] / "deq" / "config.json", tmp_path / "bad")
    with pytest.raises(HFFormatError, match=r"^[^\n]*model.layers.2.shared_head.head.weight differs from "
                                            r"lm_head.weight[^\n]*$"):
        hf_to_fivefold(tmp_path / "bad", tmp_path / "out", max_shard_bytes=10**9)
    assert not (tmp_path / "out").exists()
    cfg = load_config(seed / "fivefold.toml", [f"--run.out_dir={tmp_path}",
                                               f"--checkpoint.init_from={tmp_path / 'bad'}"])
    (error,) = check_init_from(cfg)
    assert error.startswith(f"checkpoint.init_from = '{tmp_path / 'bad'}': model.layers.2.shared_head.head.weight "
                            f"differs from lm_head.weight") and "\n" not in error
    good = load_config(seed / "fivefold.toml", [f"--run.out_dir={tmp_path}",
                                                f"--checkpoint.init_from={released['root'] / 'deq'}"])
    assert check_init_from(good) == []


def test_a_config_with_mtp_but_weights_without_is_read_without(tmp_path, released):
    """transformers' DeepseekV3Config says num_nextn_predict_layers = 1 unless told, and save_pretrained writes
    no MTP layer: such a directory is read as the model its weights hold."""
    tensors = {k: v for k, v in load_file(str(released["root"] / "deq" / "model.safetensors")).items()
               if not k.startswith("model.layers.2.")}
    (tmp_path / "hf").mkdir()
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    shutil.copy(released["root"] / "deq" / "config.json", tmp_path / "hf")
    source = HFSource(tmp_path / "hf")
    assert source.model_cfg.mtp_layers == 0 and any("read without multi-token prediction" in n for n in source.notes)


def test_only_deepseek_v3_writes_mtp(released):
    from fivefold.model.presets import PRESETS

    assert export_problems(dataclasses.replace(PRESETS["tiny-mla"], mtp_layers=1)) == []  # written as DeepSeek-V3
    problems = export_problems(dataclasses.replace(PRESETS["tiny"], mtp_layers=1))
    assert "model.mtp_layers = 1: HF's Llama computes mtp_layers = 0" in problems


def test_sample_loads_mtp_weights_and_runs_without_them(released, seed):
    """`fivefold sample` runs the main model only: from weights with an MTP depth it builds and reads
    none (model.mtp_layers 0 for sampling): transformers' logits, and generation works."""
    from fivefold.sample.generate import Source, generate, load_model

    model = load_model(Source(seed, seed / "fivefold.toml", None))
    assert len(model.mtp) == 0 and not any(name.startswith("mtp.") for name in model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(released["x"]), released["logits"], rtol=0, atol=2e-5)
    assert generate(model, released["x"][:1, :4], 3).shape == (1, 7)


def _gathered(rank: int, world: int, cfg) -> None:
    from fivefold.train.loop import train

    train(cfg, progress=False)


def test_hf_to_fivefold_train_pp2_ep2_and_back_keeps_and_moves_mtp(tmp_path, released, seed):
    """The "Done when" of issue 51: the DeepSeek-V3 toy with its MTP layer, converted, trains 3 steps at
    pp2 x ep2 (4 ranks; the MTP depth on the last stage, its experts split over ep) and is written back:
    every tensor of layer 2 there, with its shape, moved from what was imported, as the main weights moved;
    its copies of the embedding and head are the trained main ones."""
    from fivefold.train.metrics import read_metrics

    cfg = load_config(seed / "fivefold.toml", [f"--run.out_dir={tmp_path}", "--train.steps=3", "--parallel.pp=2",
                                               "--parallel.ep=2", "--train.global_batch=4", "--train.micro_batch=1",
                                               "--train.seq_len=16", "--data.max_bytes=2000", "--optim.lr=1e-2",
                                               "--optim.warmup_steps=1", "--checkpoint.keep=1"])
    assert validate(cfg, 4) == []
    run_workers(_gathered, 4, cfg)
    records = read_metrics(tmp_path / cfg.run.name / "metrics.jsonl")
    assert len(records) == 3 and all(r["mtp_loss"] > 0 for r in records)
    step = tmp_path / cfg.run.name / "checkpoints" / "step_00000003"
    fivefold_to_hf(step, tmp_path / "back")
    before, after = SafetensorsDir(released["root"] / "deq"), SafetensorsDir(tmp_path / "back")
    assert before.names() == after.names()
    moved = {}
    for name in sorted(before.names()):
        assert before.shape(name) == after.shape(name), name
        moved[name] = (after.read(name) - before.read(name)).abs().max().item()
    frozen = [n for n, d in moved.items() if d == 0 and not n.endswith("e_score_correction_bias")]
    assert frozen == [], frozen  # every weight trained, the MTP layer's included
    assert all(moved[n] > 0 for n in MTP_NAMES)
    for copy, main in [("embed_tokens.weight", "model.embed_tokens.weight"),
                       ("shared_head.head.weight", "lm_head.weight")]:
        assert torch.equal(after.read(f"model.layers.2.{copy}"), after.read(main))
