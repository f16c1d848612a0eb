"""Small shared pieces of the tests: configs, the equivalence method (Layout, assert_reproduces), meshes.

The single-process references every layout must reproduce are fixtures in conftest.py, all of them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fivefold.config.load import load_config
from fivefold.config.schema import Config
from fivefold.data.resolve import unpadded_vocab

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(out_dir: Path, *overrides: str) -> Config:
    """configs/tiny.toml writing into out_dir, with --section.key=value overrides."""
    return load_config(ROOT / "configs" / "tiny.toml", [f"--run.out_dir={out_dir}", *overrides])


# The data every equivalence test trains on: 1,100 bytes of the standard library make 35 samples of
# 32 tokens, so with batches of 8 the 5th step is an epoch's uneven last batch (3 samples, 5 slots
# of padding), where a per-rank mean loss would go wrong.
# AdamW's eps 1e-6 rather than 1e-8: its first update lr x g / (|g| + eps) has slope lr / (4 eps) where
# |g| ~ eps, so with 1e-8 a 1e-12 difference of summation order in a rarely seen token's gradient
# moved that weight by up to 1e-2 over these 5 steps (measured: cp2 against one process, while the
# losses agreed to 3e-6); how far depends on which weights happen to sit near eps, i.e. on the
# init. With 1e-6 every layout's weights stay within 5e-5 of one process's (measured), so the
# bounds below test the parallel code rather than the luck of an initialisation.
# train.loss_chunk 24: every micro-batch's loss in chunks (64 tokens: 24 + 24 + 16), so each layout's
# head and loss (vocabulary-parallel, sequence-parallel, last stage, cp shard) runs the chunked path.
EQUIVALENCE = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=5", "--checkpoint.keep=1",
               "--optim.eps=1e-6", "--train.loss_chunk=24")


# Tied embeddings (the `tied_reference` fixture, tests/conftest.py). lr 1e-3: at lr 1e-2, one process
# with 4 micro-batches already differs from one with a single micro-batch by 2.5e-5 in the step-5
# loss (AdamW amplifying fp32 summation order in the doubly-fed matrix); at 1e-3 every layout, one
# process included, stays within 7e-8.
TIED_ARGS = (*EQUIVALENCE, "--model.tie_embeddings=true", "--optim.lr=1e-3")
# The MoE every expert-parallel case trains (against the `moe_reference` fixture), and DeepSeek-V3's
# architecture in miniature: latent attention, group-limited sigmoid routing with the routed scale, a
# shared expert, the bias update and the balance loss (against `mla_reference`).
MOE_ARGS = ("--model.preset=tiny-moe", "--model.moe.bias_update=0.01", "--model.moe.aux_loss=0.01")
MLA_ARGS = ("--model.preset=tiny-mla", "--model.moe.bias_update=0.01", "--model.moe.aux_loss=0.01")

# The open families' block features (tests/parallel/test_block_layouts.py), 4 layers, 2 steps: OLMo 2's
# post norms and q/k norm over the whole projection (2 key/value heads: one per tp rank); Gemma 3's
# sandwich norms, (1 + weight) norms, sqrt(dim) embeddings and GeGLU with Qwen2's q/k/v biases, gpt-oss's
# output bias and per-head q/k norms.
BLOCK_STEPS = (*EQUIVALENCE, "--train.steps=2", "--model.n_layers=4")
OLMO2_ARGS = (*BLOCK_STEPS, "--model.norm.position=post", "--model.norm.qk=true", "--model.norm.qk_span=all",
              "--model.n_kv_heads=2", "--model.norm.weight_fp32=true")
GEMMA_ARGS = (*BLOCK_STEPS, "--model.norm.position=sandwich", "--model.norm.offset=1.0", "--model.embed_scale=true",
              "--model.activation=gelu_tanh", "--model.attention.qkv_bias=true", "--model.attention.out_bias=true",
              "--model.norm.qk=true")

# Muon (parallel/muon.py) on the hidden matrices. lr 1e-3: Muon's Newton-Schulz runs in bf16, so fp32
# summation order (which rounds a few of its inputs the other way) moves whole updates; one process with
# 4 micro-batches against 1 measured 2.1e-3 in the weights after 5 steps at lr 1e-2, 9.6e-5 at 1e-3
# (losses 1.5e-5 and norms 3.3e-5 relative at both). Its rows hold weights to 5e-4; losses and norms
# keep the shared bounds. That the owners' exchange is exact is shown apart, bit for bit, from one
# gradient at every layout (tests/parallel/test_muon.py).
MUON = ("--optim.name=muon", "--optim.lr=1e-3")
MUON_ROW = dict(reference="muon_reference", param_atol=5e-4)
# QK-clip (optim.qk_clip) on Muon at tau 0.1: the tiny model's largest logits start near 0.14 (measured), so
# most heads are clipped at each of the 5 steps (tests/parallel/test_qk_clip.py)
QK = (*MUON, "--optim.qk_clip=0.1")
# LoRA (model/lora.py) rank 4 on PEFT's seven default targets; on latent attention its own projections
# (tests/parallel/test_lora_layouts.py)
LORA = ("--lora.rank=4", "--lora.alpha=8")
# A table's LoRA row (tests/parallel/test_lora_layouts.py says what LoRA adds): one process with LoRA, the
# frozen base ending bit for bit where it started, the adapters within the shared bounds
LORA_ROW = dict(reference="lora_reference", exact=(".weight",))
# QLoRA (lora.base_dtype = "nf4"): dim 128, so every adapted weight (128 x 128, the SwiGLU's 128 x 128 of
# tiny's ffn) is one whole NF4 group of 64 x 256 elements
QLORA = (*LORA, "--lora.base_dtype=nf4", "--model.dim=128", "--model.n_layers=2")
LORA_MLA_TARGETS = "--lora.targets=['q_a_proj', 'q_b_proj', 'kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj', 'gate_proj']"

# Packed documents kept apart (data.document_mask, data.reset_positions), on the `short_docs` folder.
DOCUMENTS_ON = ("--data.document_mask=true", "--data.reset_positions=true")
# Everything a query may be kept from (model/masks.py): documents, a sliding window of 6 tokens on every
# other layer (as gpt-oss alternates), attention sinks; rows of 32 tokens, documents of at most 16.
MASKS_ON = (*DOCUMENTS_ON, "--model.attention.window=6", "--model.attention.window_pattern=['sliding', 'full']",
            "--model.attention.sinks=true")


def short_documents(n: int = 88) -> list[bytes]:
    """n short documents of 8..15 bytes: with their eod at most 16 tokens, so every row of 32
    holds two eods or more, whatever the offset."""
    return [f"d{i:02d}: ".encode() + b"abcdefghij"[: 3 + i % 8] for i in range(n)]


def document_args(folder: Path, *extra: str) -> tuple[str, ...]:
    """EQUIVALENCE on the documents of `folder`.

    lr 3e-3, not EQUIVALENCE's 1e-2: on this data at 1e-2 AdamW grew tp2-sp's fp32 summation-order
    difference to 4.9e-6 in the step-4 loss (half the shared 1e-5 bound) while step 1 agreed to
    9e-8; at 3e-3 every layout here stays within 2e-7 (losses) and 2.2e-6 (weights), measured.
    A mask missing on one stage or rank moves the losses by percents from step 1.
    """
    return (*EQUIVALENCE, f'--data.paths=["{folder}"]', "--data.max_bytes=0", "--optim.lr=3e-3", *extra)


# A table's bf16 row: the layout under CPU autocast (train.dtype = "bf16", fp32 weights, bf16 matmuls),
# as users train. It is held to one process under the same autocast (the fixture "bf16_" + its
# reference, which also runs that process in fp32), by the noise bf16 brings by itself: each gap (the
# losses', the gradient norms' relative one, the final parameters') within BF16_NOISE times one
# process's own bf16 gap from its fp32 run. Why a multiple and not a number: a layout sums in another
# order (tp's partial products, dp's reductions, ring attention's tiles), and bf16 rounds each order
# differently, 2^-8 relative, which AdamW carries as it carries bf16's own rounding. A layout that
# dropped a mask, a gradient or a scale in bf16 moves the losses by percents, far past this bound.
# lr 3e-3, not EQUIVALENCE's 1e-2: at 1e-2 this data's step-4 gradient norm is bistable, 1.8 or 3.1-4.8
# by where three steps left the weights (measured: fp32 alone with init_std 0.4% lower lands on 3.8),
# and bf16's rounding picks a side by chance (tp2 and cp2 did, one process did not); at 3e-3 every
# run stays on one side and the gaps measure rounding, not luck.
BF16 = ("--train.dtype=bf16", "--optim.lr=3e-3")
BF16_FP32 = ("--optim.lr=3e-3",)  # the one-process fp32 run whose gap from bf16 is the noise
BF16_NOISE = 3.0


@dataclass(frozen=True)
class Layout:
    """One row of an equivalence table: a layout on `ranks` processes (its config overrides, added to
    the table's base arguments) that must reproduce the single-process run of the fixture named
    `reference` (conftest.py), with parameters within `param_atol` (each table says why its bounds are
    what they are) and the state names ending in `exact` bit-identical. A row whose overrides hold
    BF16 is held to one process in bf16 within `noise` times bf16's own noise instead (`assert_row`)."""

    ranks: int
    overrides: tuple[str, ...] = ()
    reference: str = "reference"
    param_atol: float = 1e-4
    exact: tuple[str, ...] = ()
    noise: float = BF16_NOISE

    @property
    def bf16(self) -> bool:
        return BF16[0] in self.overrides


def train_only(rank: int, world: int, cfg: Config) -> None:
    """Worker: train; what the run wrote (metrics, checkpoints) is the result."""
    from fivefold.train.loop import train

    train(cfg, progress=False)


def reference_records(out_dir: Path, world: int, *overrides: str) -> list[dict]:
    """The step records of an uninterrupted tiny run on `world` forked ranks (a launched job's reference)."""
    from fivefold.parallel.forked_ranks import run_workers
    from fivefold.train.metrics import read_metrics

    run_workers(train_only, world, tiny_config(out_dir, *overrides))
    return read_metrics(out_dir / "tiny" / "metrics.jsonl")


def one_process(out_dir: Path, *overrides: str):
    """The single-process reference of a table: `overrides` trained in one process, each global batch
    in one micro-batch, writing into out_dir; its (losses, grad norms, gathered state)."""
    from fivefold.parallel.forked_ranks import run_workers

    return run_workers(train_and_gather, 1, tiny_config(out_dir, *overrides, "--train.micro_batch=8"))[0]


def one_process_bf16(tmp_path_factory, name: str, *overrides: str):
    """What a table's bf16 row (BF16) is held to: one process in bf16, and in fp32 at the same learning
    rate (their gap is the noise), each in a folder of its own."""
    return (one_process(tmp_path_factory.mktemp(name + "-bf16"), *overrides, *BF16),
            one_process(tmp_path_factory.mktemp(name + "-fp32"), *overrides, *BF16_FP32))


def loss_traffic(tokens: int, chunk: int, tp: int) -> tuple[int, int]:
    """The vocabulary-parallel loss's tp traffic for a micro-batch of `tokens` (model/head.py): per
    chunk of `chunk` tokens one all-gather of each token's log-sum-exp and target logit (fp32) from
    every rank. (calls, wire bytes)."""
    from fivefold.parallel.comm.collectives import wire_bytes

    chunks = [chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else [])
    return len(chunks), sum(wire_bytes("all_gather", tp * 2 * c * 4, tp) for c in chunks)


def train_and_gather(rank: int, world: int, cfg: Config):
    """Worker: train, then return the losses, gradient norms and the gathered final model."""
    from fivefold.train.loop import train

    result = train(cfg, progress=False, return_state=True)
    return result.losses, result.grad_norms, result.state


def assert_reproduces(result, reference, param_atol: float = 1e-4, exact: tuple[str, ...] = ()) -> None:
    """One rank's (losses, grad norms, gathered state) against the single-process reference.

    Losses within 1e-5 and gradient norms within 5e-4 relative, parameters within `param_atol`
    absolute (each caller says why its bounds are what they are); state names ending in one of
    `exact` must be bit-identical.
    """
    import torch

    (losses, norms, state), (ref_losses, ref_norms, ref_state) = result, reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=5e-4, atol=0)
    assert state.keys() == ref_state.keys()
    for name, ref in ref_state.items():
        tol = 0 if name.endswith(exact) and exact else param_atol
        torch.testing.assert_close(state[name], ref, rtol=0, atol=tol, msg=name)


def precision_gaps(run, reference) -> tuple[float, float, float]:
    """How far a run is from a reference, each a (losses, grad norms, gathered state) result: the
    largest loss difference, relative gradient-norm difference and parameter difference."""
    losses = max(abs(a - b) for a, b in zip(run[0], reference[0], strict=True))
    norms = max(abs(a - b) / abs(b) for a, b in zip(run[1], reference[1], strict=True))
    params = max(float((run[2][k].float() - v.float()).abs().max()) for k, v in reference[2].items())
    return losses, norms, params


def assert_within_noise(result, same, above, multiple: float = BF16_NOISE) -> None:
    """A run in a lower precision (bf16 autocast, FP8) against one process in that precision, `same`:
    every gap within `multiple` times that process's own gap from its run one precision up, `above`
    (fp32 for bf16, bf16 for FP8), the noise the precision brings by itself (BF16 above says why).
    And it ran in its precision at all: its first gradient norm (the same weights on every run) is
    nearer `same`'s than `above`'s, which a run that fell back to the precision above would not be."""
    assert result[2].keys() == same[2].keys()
    first = result[1][0]
    assert abs(first - same[1][0]) < abs(first - above[1][0]), (first, same[1][0], above[1][0])
    noise = precision_gaps(same, above)
    assert min(noise) > 0, noise  # the precision did round: else the bound would demand bit-equality of nothing
    for what, gap, own in zip(("losses", "gradient norms", "parameters"), precision_gaps(result, same), noise,
                              strict=True):
        assert gap <= multiple * own, f"{what}: {gap:.2e} from one process in its precision, whose own gap is {own:.2e}"


def assert_row(request, result, layout: Layout) -> None:
    """One rank's result against its row's reference: the fp32 bounds, or bf16's noise (BF16)."""
    if layout.bf16:
        assert_within_noise(result, *request.getfixturevalue("bf16_" + layout.reference), layout.noise)
    else:
        reference = request.getfixturevalue(layout.reference)
        assert_reproduces(result, reference, param_atol=layout.param_atol, exact=layout.exact)


def assert_layout_reproduces(request, cfg: Config, layout: Layout) -> None:
    """Train `cfg` on the layout's ranks: each reproduces the reference fixture the layout names."""
    from fivefold.parallel.forked_ranks import run_workers

    for result in run_workers(train_and_gather, layout.ranks, cfg):
        assert_row(request, result, layout)


def parallelized(cfg: Config, world: int):
    """Worker: `cfg`'s layout over the job's `world` ranks as the training loop builds it (on the meta
    device, then this rank's tensors), with the seeded initial values."""
    from fivefold.checkpoint.weights import fill_weights
    from fivefold.train.loop import parallel_model

    mesh, derived = config_mesh(cfg, world)
    par, seeded = parallel_model(cfg, derived, mesh)
    fill_weights(seeded, par)
    return par


class OneRank:
    """What an optimizer built over a layout asks of data parallel and the mesh (build_muon, QKClip),
    for a model on one process without a process group: DDP's view, the optimizer steps the
    parameters themselves, and every mesh group is this process alone."""

    def __init__(self, model):
        self.model, self.params = model, list(model.parameters())

    def optimizer_params(self):
        return self.params

    def group(self, name: str):
        from fivefold.parallel.comm.collectives import AxisGroup, CommStats

        return AxisGroup(name=name, label=name, pg=None, size=1, rank=0, stats=CommStats())


def mesh_of(ep: int = 1, **degrees: int):
    """Inside a worker: a mesh with the given axis degrees (pp, dp_replicate, dp_shard, cp, tp), 1 for
    the axes not named, and `ep` carved out of its grad view."""
    from fivefold.parallel.mesh import AXES, Mesh

    assert set(degrees) <= set(AXES), f"no mesh axis {sorted(set(degrees) - set(AXES))}"
    return Mesh({axis: degrees.get(axis, 1) for axis in AXES}, ep=ep)


def config_mesh(cfg: Config, world: int):
    """Inside a worker: the mesh `cfg` builds over `world` ranks, and its derived numbers."""
    from fivefold.config.derive import derive
    from fivefold.parallel.mesh import Mesh

    derived = derive(cfg, world, unpadded_vocab(cfg))
    return Mesh.from_config(cfg, derived), derived


SPECIAL_EOS = "<|end|>"  # not one of tokenizer.EOD_NAMES: found only through tokenizer_config.json


def tiny_bpe(folder: Path, added: int = 0) -> Path:
    """A byte-level BPE of at most 300 ids (+ `added` plain tokens after them) saved as transformers
    does: tokenizer.json and a tokenizer_config.json naming its eos_token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[SPECIAL_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    if added:
        tok.add_tokens([f"word{i}" for i in range(added)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": SPECIAL_EOS}))
    return folder


def assert_same_hf_directory(expected: Path, got: Path) -> None:
    """Two Hugging Face directories hold the same tensors (names, dtypes, values, bit for bit) and the
    same config.json: what a round trip through fivefold must give back."""
    import torch

    from fivefold.checkpoint.safetensors_io import SafetensorsDir

    before, after = SafetensorsDir(expected), SafetensorsDir(got)
    assert before.names() == after.names()
    for name in before.names():
        assert before.dtype(name) == after.dtype(name) and torch.equal(before.read(name), after.read(name)), name
    assert json.loads((got / "config.json").read_text()) == json.loads((expected / "config.json").read_text())


def converted_hf(hf, root: Path, vocab: int, max_shard_size: str = "40KB") -> dict:
    """A random transformers model `hf` saved by save_pretrained in small shards (the sharded index path),
    its logits on a fixed batch (drawn after the model, from the test's seeded RNG) and the seed
    directory `fivefold convert --to fivefold` makes of it."""
    import torch

    from fivefold.checkpoint.convert import hf_to_fivefold

    hf.save_pretrained(root / "hf", max_shard_size=max_shard_size)
    x = torch.randint(0, vocab, (2, 16))
    with torch.no_grad():
        logits = hf(x).logits  # (2, 16, vocab)
    hf_to_fivefold(root / "hf", root / "seed", max_shard_bytes=10**9)
    return dict(root=root, hf=root / "hf", seed=root / "seed", x=x, logits=logits)


def sentencepiece_model(words: list[str], vocab_size: int, lines: int = 200) -> bytes:
    """A real SentencePiece model, trained here in a moment: BPE with byte fallback, as Llama 2's and Gemma's."""
    import io

    import sentencepiece as spm

    text = [" ".join(words[i % 7:] + words[: i % 5]) + f" {i} déjà vu" for i in range(lines)]
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=out, vocab_size=vocab_size,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0, unk_id=0, bos_id=1,
                                   eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return out.getvalue()
