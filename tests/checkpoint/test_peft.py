"""LoRA adapters in PEFT's format (checkpoint/peft.py), with the `peft` package as the reference: a LoRA run's
adapters exported with `--to peft` give fivefold's logits in PeftModel over the `--to hf` base, `--to hf --merge`
gives PEFT's merge_and_unload, and an adapter PEFT saved starts a run (lora.init_from) with PEFT's logits."""

import json

import pytest
import torch
import torch.distributed as dist
from helpers import converted_hf, parallelized

from fivefold.checkpoint.convert import DCPSource
from fivefold.checkpoint.hf import HFFormatError
from fivefold.checkpoint.hf.deepseek_v3 import FAMILY as DEEPSEEK_V3
from fivefold.checkpoint.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PeftSource, peft_module
from fivefold.checkpoint.weights import load_weights, source_name
from fivefold.cli import main
from fivefold.config.load import load_config
from fivefold.model.config import ModelConfig
from fivefold.model.lora import apply_lora
from fivefold.model.transformer import Transformer
from fivefold.parallel.forked_ranks import run_workers
from fivefold.train.metrics import read_metrics
from fivefold.train.preflight import preflight
from fivefold.validate import validate

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=320, initializer_range=0.2)  # std 0.2: logits of order 1, so a wrong mapping shows
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ("--lora.rank=4", "--lora.alpha=8")
TRAIN = ("--train.steps=2", "--train.global_batch=2", "--train.micro_batch=1", "--train.seq_len=16",
         "--data.max_bytes=4000", "--data.val_fraction=0.0", "--optim.lr=1e-2", "--optim.warmup_steps=1",
         "--checkpoint.keep=1")
# One process, fp32, the same weights: the bound of tests/checkpoint/test_hf.py (2e-5); a wrong name, a lost
# scaling or a transposed A moves logits of order 1 by O(0.01-1).
ATOL = 2e-5


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A random Llama saved by transformers, its seed directory, and a LoRA run trained from that seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    m = converted_hf(LlamaForCausalLM(LlamaConfig(**SHAPE)).eval(), root, SHAPE["vocab_size"])
    cfg = load_config(m["seed"] / "fivefold.toml", [f"--run.out_dir={root / 'runs'}", "--run.name=lora",
                                                    *LORA, *TRAIN])
    run_workers(_train, 1, cfg)
    m["run"] = root / "runs/lora"
    m["checkpoint"] = m["run"] / "checkpoints/step_00000002"
    return m


def _train(rank, world, cfg):
    from fivefold.train.loop import train

    train(cfg, progress=False)


def fivefold_logits(checkpoint, run_config, x):
    """The LoRA run checkpoint's model (base and adapters) in this process on x (B, T) -> (B, T, V)."""
    cfg = load_config(run_config)
    model = Transformer(cfg.model)
    apply_lora(model, cfg.lora)
    source = DCPSource(checkpoint)
    model.load_state_dict({n: source.read(source_name(n, source, cfg.model.tie_embeddings))
                           for n in model.state_dict()})
    with torch.no_grad():
        return model.eval()(x)


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_peft_loads_the_exported_adapter_with_fivefold_logits_and_merge_equals_peft(llama, tmp_path):
    from peft import PeftModel

    assert main(["convert", str(llama["checkpoint"]), str(tmp_path / "hf"), "--to", "hf"]) == 0
    assert main(["convert", str(llama["checkpoint"]), str(tmp_path / "peft"), "--to", "peft"]) == 0
    config = json.loads((tmp_path / "peft" / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["use_rslora"]) == ("LORA", 4, 8.0, False)
    assert sorted(config["target_modules"]) == sorted(TARGETS) and config["task_type"] == "CAUSAL_LM"
    x = llama["x"]
    ours = fivefold_logits(llama["checkpoint"], llama["run"] / "config.toml", x)
    base = _hf(tmp_path / "hf")
    with torch.no_grad():
        plain = base(x).logits
        peft = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
        assert len([n for n, _ in peft.named_parameters() if "lora_A" in n]) == 2 * len(TARGETS)  # all loaded
        theirs = peft(x).logits
        torch.testing.assert_close(theirs, ours, rtol=0, atol=ATOL)  # measured bit-equal
        assert (theirs - plain).abs().max() > 0.1  # the adapters trained: they move the logits (measured 1.5)
        merged_by_peft = peft.merge_and_unload()(x).logits

    assert main(["convert", str(llama["checkpoint"]), str(tmp_path / "merged"), "--to", "hf", "--merge"]) == 0
    with torch.no_grad():
        merged = _hf(tmp_path / "merged")(x).logits
    torch.testing.assert_close(merged, merged_by_peft, rtol=0, atol=ATOL)  # measured bit-equal
    # W + s B A rounded once into W, against x W^T + s (x A^T) B^T: measured 1.0e-5 on logits up to 5.6
    torch.testing.assert_close(merged, ours, rtol=0, atol=ATOL)


def test_what_peft_cannot_address_is_refused_by_name(llama, tmp_path, capsys):
    # a seed directory (no adapters): one line, naming the way out
    assert main(["convert", str(llama["seed"]), str(tmp_path / "none"), "--to", "peft"]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err and not (tmp_path / "none").exists()
    assert main(["convert", str(llama["seed"]), str(tmp_path / "none"), "--to", "hf", "--merge"]) == 2
    assert "no LoRA adapters" in capsys.readouterr().err
    # DeepSeek-V3's MTP layers: transformers builds no module for them
    m = ModelConfig(n_layers=2, mtp_layers=1)
    assert peft_module("layers.1.attn.wo", DEEPSEEK_V3, m) == "model.layers.1.self_attn.o_proj"
    with pytest.raises(HFFormatError, match=r"mtp\.0\.eh_proj .*model\.layers\.2\.eh_proj.weight, an MTP layer"):
        peft_module("mtp.0.eh_proj", DEEPSEEK_V3, m)


def _peft_adapter(hf_dir, out, x, r=4, alpha=8):
    """An adapter written by peft itself over the HF model: PEFT's initialisation with B drawn (not zero,
    so that it changes the function); its logits on x."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(_hf(hf_dir), LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        logits = model.eval()(x).logits
    model.save_pretrained(out)
    return logits


def _loaded_logits(rank, world, cfg, seed, adapter, x):
    """Worker: the run's layout loaded as setup() loads it (the base from `seed`, the adapters from the PEFT
    directory), run on x; the whole logits (B, T, V)."""
    par = parallelized(cfg, world)
    load_weights(seed, par, adapters=PeftSource(adapter, cfg))
    with torch.no_grad():
        h = par.model(x)  # (B, T, V / tp)
    parts = [torch.empty_like(h) for _ in range(par.mesh.size("tp"))]
    dist.all_gather(parts, h.contiguous(), group=par.mesh.group("tp").pg)
    return torch.cat(parts, dim=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_adapter_peft_saved_starts_a_run_with_peft_logits(llama, tmp_path, tp):
    expected = _peft_adapter(llama["hf"], tmp_path / "adapter", llama["x"])
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {ADAPTER_CONFIG, ADAPTER_WEIGHTS}
    cfg = load_config(llama["seed"] / "fivefold.toml", [f"--run.out_dir={tmp_path}", *LORA,
                                                        f"--lora.init_from={tmp_path / 'adapter'}",
                                                        f"--parallel.tp={tp}", "--train.global_batch=2",
                                                        "--train.micro_batch=1"])
    assert validate(cfg, tp) == []
    logits = run_workers(_loaded_logits, tp, cfg, llama["seed"], tmp_path / "adapter", llama["x"])[-1]
    # one process: measured bit-equal; tp adds each row-parallel product from two halves: measured 4.9e-6
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    with torch.no_grad():
        assert (expected - llama["logits"]).abs().max() > 1e-2  # the adapter changes the function


def test_a_run_continues_a_peft_adapter(llama, tmp_path):
    """Through the training loop's setup(): the first step's loss (the starting weights') is not that of
    new adapters (B zero: the base's)."""
    _peft_adapter(llama["hf"], tmp_path / "adapter", llama["x"])
    losses = {}
    for name, extra in (("new", ()), ("continued", (f"--lora.init_from={tmp_path / 'adapter'}",))):
        cfg = load_config(llama["seed"] / "fivefold.toml", [f"--run.out_dir={tmp_path}", f"--run.name={name}",
                                                            *LORA, *TRAIN, *extra])
        run_workers(_train, 1, cfg)
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")]
    assert len(losses["continued"]) == 2 and abs(losses["continued"][0] - losses["new"][0]) > 1e-3


def test_an_adapter_that_does_not_fit_is_refused_before_training(llama, tmp_path):
    _peft_adapter(llama["hf"], tmp_path / "adapter", llama["x"], r=8, alpha=16)

    def errors(*overrides):  # before any process starts: the checks `fivefold train` makes (train/preflight.py)
        return preflight(load_config(llama["seed"] / "fivefold.toml", [f"--run.out_dir={tmp_path}", *LORA,
                                                                       *overrides]), 1)

    (rank, alpha) = errors(f"--lora.init_from={tmp_path / 'adapter'}")
    assert "r = 8" in rank and "set lora.rank = 8" in rank and "set lora.alpha = 16" in alpha
    (targets,) = errors(f"--lora.init_from={tmp_path / 'adapter'}", "--lora.rank=8", "--lora.alpha=16",
                        "--lora.targets=['q_proj', 'v_proj']")
    assert "target_modules" in targets and "lora.targets" in targets
    assert errors(f"--lora.init_from={tmp_path / 'adapter'}", "--lora.rank=8", "--lora.alpha=16") == []
    (missing,) = errors(f"--lora.init_from={tmp_path}")
    assert "adapter_config.json, adapter_model.safetensors not found" in missing
    (off,) = errors(f"--lora.init_from={tmp_path / 'adapter'}", "--lora.rank=0")
    assert "lora.rank = 0" in off


# DeepSeek-V3 in miniature (tests/checkpoint/test_hf.py's): latent attention whose q_b_proj and kv_a_proj_with_mqa
# rows fivefold reorders (RoPE features in [even, odd] order), so the adapters' B rows move with them.
DEEPSEEK = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=12, num_mtp_layers=0)
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


class Tensors:
    """A dict of whole tensors as a WeightSource."""

    def __init__(self, tensors):
        self.tensors = tensors

    def names(self):
        return frozenset(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def dtype(self, name):
        return self.tensors[name].dtype

    def read(self, name, index=None):
        return self.tensors[name] if index is None else self.tensors[name][index]


def _loaded_state(rank, world, cfg, seed, adapter, x):
    """Worker, one process: the logits of the model loaded from `seed` and the PEFT adapter, and its state."""
    par = parallelized(cfg, world)
    load_weights(seed, par, adapters=PeftSource(adapter, cfg))
    with torch.no_grad():
        return par.model(x), {k: v.detach().clone() for k, v in par.model_state_dict().items()}


def test_deepseek_adapters_follow_the_reordered_rope_rows_both_ways(tmp_path):
    from safetensors.torch import load_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from fivefold.checkpoint.convert import run_config
    from fivefold.checkpoint.peft import write_peft
    from fivefold.data.resolve import resolved_model

    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**{**SHAPE, **DEEPSEEK})).eval()
    with torch.no_grad():  # transformers starts norms at 1: random ones, as test_hf.py does
        for name, t in hf.named_parameters():
            if name.endswith("norm.weight"):
                t.normal_(1, 0.2)
    m = converted_hf(hf, tmp_path, SHAPE["vocab_size"])
    assert json.loads((m["hf"] / "config.json").read_text()).get("rope_interleave", True)  # rows reordered
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    peft = get_peft_model(_hf(m["hf"]), LoraConfig(r=4, lora_alpha=8, target_modules=MLA_TARGETS))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        expected = peft.eval()(m["x"]).logits
    peft.save_pretrained(tmp_path / "adapter")
    cfg = load_config(m["seed"] / "fivefold.toml", [f"--run.out_dir={tmp_path}", *LORA, f"--lora.targets={MLA_TARGETS}",
                                                    f"--lora.init_from={tmp_path / 'adapter'}",
                                                    "--train.global_batch=2", "--train.micro_batch=1"])
    assert validate(cfg, 1) == []
    logits, state = run_workers(_loaded_state, 1, cfg, m["seed"], tmp_path / "adapter", m["x"])[0]
    # test_hf.py's DeepSeek-V3 bound (its attention and MoE differ from HF's by fp32 ulps; measured 6.4e-6)
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    assert (expected - m["logits"]).abs().max() > 1e-2

    # ... and written back: PEFT's own tensors, bit for bit (B's rows back in HF's order)
    assert run_config(m["seed"]).lora.rank == 0  # the seed's own config: [lora] from the run's
    write_peft(Tensors(state), resolved_model(cfg), cfg.lora, json.loads((m["hf"] / "config.json").read_text()),
               tmp_path / "back")
    theirs, ours = load_file(tmp_path / "adapter" / ADAPTER_WEIGHTS), load_file(tmp_path / "back" / ADAPTER_WEIGHTS)
    assert sorted(ours) == sorted(theirs) and len(ours) == 2 * len(MLA_TARGETS) * SHAPE["num_hidden_layers"]
    for key, value in theirs.items():
        assert torch.equal(ours[key], value), key
