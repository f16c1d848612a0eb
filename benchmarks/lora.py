"""LoRA under ZeRO-3: fivefold's LoRA against its full fine-tuning, and against HF PEFT on FSDP2.

Run: `.venv/bin/python benchmarks/lora.py [--steps N] [--rounds R] [--only full peft] [--quick]` (extra
`--section.key=value` arguments override the config, e.g. `--model.dim=256`).

Three sides, each on 2 forked gloo ranks at dp 2 (CPU, fp32, one thread each), the same Llama-shaped
model (configs/tiny.toml widened to dim 384, 8 heads of 48, 4 KV heads, ffn 1024, 4 layers, seq 128,
a micro-batch of 4 per rank, AdamW at a constant 1e-4), the same weights and batches:
1. `lora`: fivefold with `--lora.rank=16 --lora.alpha=32` (the seven PEFT targets) at parallel.zero = 3,
   built by parallelize() and stepped as train/loop.py steps it (pipeline.run, optimizer_step);
2. `full`: the same model trained whole at parallel.zero = 3;
3. `peft`: transformers' LlamaForCausalLM of the same shape (config.json from fivefold's `hf_config`,
   the weights by the Llama family's names, so the same function: its logits are checked against
   fivefold's within 1e-5 before anything runs), `peft.get_peft_model` with the same rank, alpha
   and targets (the adapters' A copied from fivefold's, B zero in both), torch FSDP2 `fully_shard`
   on each decoder layer and then the root (reshard_after_forward=True), AdamW (`build_optimizer`'s
   hyper-parameters) over the trainable parameters, clip_grad_norm_ as fivefold clips.
The sides alternate step by step within a round (the order rotating over rounds, fresh workers each
round); a step takes as long as its slowest rank; medians over all timed steps of all rounds.
Ratios: `lora / full` and `lora / peft`. The first-step losses of all three must agree within 1e-5
(B = 0: LoRA starts from the base's function); `lora` and `peft` then train the same adapters, so
their last losses stay close too (`loss_last_step_abs_diff`, informative).

Peak memory is counted, not read from RSS: a separate run per side (3 steps) under `LiveStorages`,
which adds up the bytes of every tensor storage an operation creates (the local tensors of DTensors
too) from its creation until it is freed, and follows the storages both frameworks grow and shrink in
place (`UntypedStorage.resize_`: fivefold's and FSDP2's gathered weights). Counted: the peak from the
start of the first step to the end of the third (shards, gathered weights, activations, gradients,
optimizer state, communication buffers a framework allocates), and what stays between steps. RSS
would add glibc's and the allocator's slack and the libraries each side maps (transformers' modules),
which is noise beside a difference of a few MB. What is not counted: gloo's own buffers (the same
collectives on all sides).

Bytes per step: in the memory run's last step, every flat all-gather, reduce-scatter and all-reduce
torch.distributed is asked for (`common.counting_collectives`, the ring formula fivefold's CommStats
uses), per op, on each side alike; fivefold's own CommStats "dp" total beside it as a check. Under
LoRA the frozen base is still gathered (forward and backward) but never reduce-scattered: only the
adapters' gradients are. (The peer's clip reduces its norm through DTensor's functional collectives,
which this does not see: fivefold's shows as 8 bytes of all_reduce.)

`--quick`: dim 128, ffn 384, seq 64, one round of 2 steps after 1 warm-up step (~15 s).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fivefold.parallel.data.fsdp  # noqa: E402,F401  imported here so forked workers do not pay for it
from benchmarks.common import (  # noqa: E402
    LOSS_TOL,
    alternate,
    comparison_record,
    counting_collectives,
    finish_summary,
    log,
    make_parser,
    median,
    parse,
    prewarm,
    ratio,
    report,
    slowest_rank,
)
from benchmarks.pipeline_sides import global_batches, rank_batches  # noqa: E402
from fivefold.checkpoint.hf import hf_config  # noqa: E402
from fivefold.checkpoint.hf.llama import FAMILY  # noqa: E402
from fivefold.checkpoint.peft import adapted_layers, peft_module  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config, replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import tokenizer_vocab, unpadded_vocab  # noqa: E402
from fivefold.model.lora import LORA_A, LORA_B, is_adapter  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402

torch.set_num_threads(1)
SIDES = ("lora", "full", "peft")
COMPARISONS = {"full": ("lora", "full"), "peft": ("lora", "peft")}  # name -> (a, b): ratios a / b
RANK, ALPHA = 16, 32.0
WORLD = 2  # dp 2: the layout
LOGITS_TOL = 1e-5  # fivefold's and the peer's logits on the same weights, one process, fp32


def side_config(base: Config, kind: str) -> Config:
    """The run's config of a side: LoRA (fivefold's and the peer's shape) or full fine-tuning."""
    return replace(base, lora={"rank": RANK, "alpha": ALPHA}) if kind != "full" else base


# ---- the peer ------------------------------------------------------------------------------------
def peer_model(cfg: Config, b_std: float = 0.0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(fivefold's LoRA model, the PEFT model over transformers' Llama with the same weights and adapters);
    `b_std`: the B's drawn N(0, b_std) instead of zero (a check that sees the adapters' names and scaling)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = derive(cfg, 1, unpadded_vocab(cfg)).vocab_size
    ours = build_model(cfg, vocab)
    if b_std:
        with torch.no_grad():
            g = torch.Generator().manual_seed(cfg.train.seed)
            for name, p in ours.named_parameters():
                if name.endswith(LORA_B):
                    p.copy_(torch.randn(p.shape, generator=g) * b_std)
    m = dataclasses.replace(cfg.model, vocab_size=vocab)
    hf = LlamaForCausalLM(LlamaConfig(**hf_config(m, torch.float32)))
    state = {FAMILY.hf_names(n, m)[0]: t for n, t in ours.state_dict().items() if not is_adapter(n)}
    hf.load_state_dict(state, strict=True)
    peer = get_peft_model(hf, LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=0.0,
                                         target_modules=list(cfg.lora.targets)))  # the seven, PEFT's names
    with torch.no_grad():
        for layer in adapted_layers(set(ours.state_dict())):
            module = peer.base_model.model.get_submodule(peft_module(layer, FAMILY, m))
            module.lora_A["default"].weight.copy_(ours.get_parameter(layer + LORA_A))  # (r, in) both
            module.lora_B["default"].weight.copy_(ours.get_parameter(layer + LORA_B))  # (out, r) both
    return ours, peer


def check_logits(cfg: Config) -> float:
    """Largest |fivefold - peer| logit on one batch, one process, with nonzero B's (at B = 0 the adapters
    would not show); refuses to go on beyond LOGITS_TOL."""
    ours, peer = peer_model(cfg, b_std=0.5)
    x = global_batches(cfg, 1)[0][0]
    with torch.no_grad():
        diff = float((ours.eval()(x) - peer.eval()(input_ids=x).logits).abs().max())
    if diff > LOGITS_TOL:
        raise SystemExit(f"the peer's logits differ from fivefold's by {diff:.2e} (> {LOGITS_TOL}): not the same model")
    return diff


# ---- the sides ------------------------------------------------------------------------------------
class FivefoldSide:
    """fivefold at parallel.zero = 3, LoRA or full, built by parallelize(), stepped as train/loop.py does."""

    def __init__(self, kind: str, base: Config, world: int):
        self.kind, self.times, self.cpu_times, self.losses = kind, [], [], []
        self.cfg = cfg = side_config(base, kind)
        derived = derive(cfg, world, unpadded_vocab(cfg))
        self.mesh = Mesh.from_config(cfg, derived)
        self.par = parallelize(build_model(cfg, derived.vocab_size), self.mesh, cfg, derived)
        self.scaler = LossScaler(cfg.train)  # fp32: a scale of 1 that never skips
        self.trainable = sum(p.numel() for p in self.par.model.parameters() if p.requires_grad)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        o = self.cfg.optim
        loss = self.par.pipeline.run([(x, y)], x.numel() * self.mesh.size("batch")).loss  # / global tokens
        self.par.optimizer_step(o.lr, self.scaler, o.grad_clip)
        return loss

    def dp_wire_bytes(self) -> float:
        return self.mesh.stats.snapshot().get("dp", {}).get("wire_bytes", 0.0)


class PeftSide:
    """HF PEFT over transformers' Llama, FSDP2 per decoder layer and the root, AdamW on the adapters."""

    kind = "peft"

    def __init__(self, base: Config, world: int):
        self.times, self.cpu_times, self.losses = [], [], []
        self.cfg = cfg = side_config(base, "peft")
        _, self.net = peer_model(cfg)
        mesh = init_device_mesh("cpu", (world,))
        for layer in self.net.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        fully_shard(self.net, mesh=mesh, reshard_after_forward=True)
        self.params = [p for p in self.net.parameters() if p.requires_grad]
        self.trainable = sum(p.numel() for p in self.params)  # a DTensor's numel is the whole parameter's
        self.opt = build_optimizer(self.params, cfg.optim)  # after fully_shard: it steps the DTensor shards
        self.local_tokens = cfg.train.micro_batch * cfg.train.seq_len
        self.real = tokenizer_vocab(cfg)  # fivefold masks the vocabulary's padding ids out of the loss; so does this

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.net(input_ids=x).logits  # (B, T, V)
        loss = cross_entropy_sum(logits[..., :self.real], y) / self.local_tokens  # FSDP2 averages over ranks
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach() / dist.get_world_size()  # this rank's share of the global mean


def make_side(kind: str, base: Config, world: int) -> FivefoldSide | PeftSide:
    return PeftSide(base, world) if kind == "peft" else FivefoldSide(kind, base, world)


def timed_step(side: FivefoldSide | PeftSide, x: torch.Tensor, y: torch.Tensor) -> None:
    cpu, began = time.process_time(), time.perf_counter()
    loss = side.step(x, y)
    side.times.append(time.perf_counter() - began)
    side.cpu_times.append(time.process_time() - cpu)  # the process's CPU seconds: work, not waits
    total = loss.detach().double()
    dist.all_reduce(total)  # the global mean loss, outside the timed region
    side.losses.append(float(total))


# ---- memory: live tensor storages -----------------------------------------------------------------
class LiveStorages(TorchDispatchMode):
    """While active: the bytes of the tensor storages operations create, alive now and at most.

    A storage counts from the operation that returned it (not an input's: a view or an in-place
    result; a DTensor by its local tensor) until a finalizer sees it freed, at its current size:
    `UntypedStorage.resize_`, which both fivefold and FSDP2 use to free and refill gathered weights
    in place, is wrapped while active, so a regrown storage counts again and a shrunk one stops."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.size: dict[int, int] = {}  # id(storage) -> the bytes counted for it

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        if key not in self.size:
            weakref.finalize(storage, self._freed, key)
        self.live += nbytes - self.size.get(key, 0)
        self.size[key] = nbytes
        self.peak = max(self.peak, self.live)

    def _freed(self, key: int) -> None:
        self.live -= self.size.pop(key, 0)

    @staticmethod
    def _storages(tree) -> list[torch.UntypedStorage]:
        leaves = [t._local_tensor if isinstance(t, DTensor) else t for t in pytree.tree_leaves(tree)]
        return [t.untyped_storage() for t in leaves if isinstance(t, torch.Tensor) and t.device.type != "meta"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(s) for s in self._storages((args, kwargs))}
        for storage in self._storages(out):
            if id(storage) not in inputs and id(storage) not in self.size:
                self._count(storage)
        return out

    @contextlib.contextmanager
    def resizes(self):
        """Count every storage resized in place while the block runs (created before or not)."""
        original = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):
            out = original(storage, nbytes)
            self._count(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original


# ---- workers --------------------------------------------------------------------------------------
def _setup() -> None:
    torch.set_num_threads(1)
    # FSDP2 may call all_gather_into_tensor / reduce_scatter_tensor, deprecated in favour of *_single.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _timed_worker(rank: int, world: int, kinds: tuple[str, ...], cfg: Config, warmup: int, steps: int) -> list[dict]:
    _setup()
    sides = [make_side(k, cfg, world) for k in kinds]
    return alternate(sides, rank_batches(cfg, rank, warmup + steps), warmup, timed_step)


def _memory_worker(rank: int, world: int, kind: str, cfg: Config, steps: int) -> dict:
    """One side alone, built and stepped under LiveStorages; the last step's collectives counted."""
    _setup()
    *first, last = rank_batches(cfg, rank, steps)
    live, sent = LiveStorages(), {}
    record = lambda op, group, wire: sent.__setitem__(op, sent.get(op, 0.0) + wire)  # noqa: E731
    with live.resizes(), live:
        side = make_side(kind, cfg, world)
        live.peak = live.live  # the steps' peak, from what the built side holds
        for x, y in first:
            side.step(x, y)
        dp_before = side.dp_wire_bytes() if kind != "peft" else 0.0
        with counting_collectives(record):
            side.step(*last)
        held = live.live
    sent["commstats_dp"] = side.dp_wire_bytes() - dp_before if kind != "peft" else None
    return {"peak_mb": live.peak / 2**20, "held_mb": held / 2**20, "sent": sent, "trainable": side.trainable}


# ---- driver ---------------------------------------------------------------------------------------
def run_round(kinds: tuple[str, ...], cfg: Config, world: int, warmup: int, steps: int) -> dict[str, dict]:
    return slowest_rank(run_workers(_timed_worker, world, kinds, cfg, warmup, steps, timeout=600.0), kinds)


def run_memory(kind: str, cfg: Config, world: int) -> dict:
    ranks = run_workers(_memory_worker, world, kind, cfg, 3, timeout=600.0)  # 3 steps: the optimizer state exists
    return {"peak_mb": max(r["peak_mb"] for r in ranks), "held_mb": max(r["held_mb"] for r in ranks),
            "per_rank": [round(r["peak_mb"], 1) for r in ranks],
            "sent": ranks[0]["sent"], "sent_per_rank_equal": all(r["sent"] == ranks[0]["sent"] for r in ranks),
            "trainable": ranks[0]["trainable"]}


def memory_record(a: str, b: str, mem: dict[str, dict]) -> dict:
    ma, mb = mem[a], mem[b]
    out = {f"{a}_peak_mb": round(ma["peak_mb"], 2), f"{b}_peak_mb": round(mb["peak_mb"], 2),
           "ratio_peak_memory": ratio(ma["peak_mb"], mb["peak_mb"]),
           f"{a}_held_mb": round(ma["held_mb"], 2), f"{b}_held_mb": round(mb["held_mb"], 2),
           "ratio_held_memory": ratio(ma["held_mb"], mb["held_mb"]),
           f"{a}_peak_mb_per_rank": ma["per_rank"], f"{b}_peak_mb_per_rank": mb["per_rank"]}
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        out[f"{a}_{op}_bytes"], out[f"{b}_{op}_bytes"] = (round(m["sent"].get(op, 0.0)) for m in (ma, mb))
    ta, tb = (sum(m["sent"].get(op, 0.0) for op in ("all_gather", "reduce_scatter", "all_reduce")) for m in (ma, mb))
    out.update({f"{a}_dp_bytes": round(ta), f"{b}_dp_bytes": round(tb), "ratio_dp_bytes": ratio(ta, tb),
                f"{a}_trainable_params": ma["trainable"], f"{b}_trainable_params": mb["trainable"]})
    for side in (a, b):
        if mem[side]["sent"].get("commstats_dp") is not None:  # fivefold's own count of the same step
            out[f"{side}_commstats_dp_bytes"] = round(mem[side]["sent"]["commstats_dp"])
        # what the reduce-scatters would carry for the trainable parameters alone, fp32, over 2 ranks:
        # under LoRA the adapters' gradients, the base's reduction gone
        out[f"{side}_reduce_scatter_is_trainable_only"] = (
            mem[side]["sent"].get("reduce_scatter", 0.0) == mem[side]["trainable"] * 4 * (WORLD - 1) / WORLD)
    return out


def table(records: dict[str, dict], mem: dict[str, dict], times: dict[str, float]) -> str:
    rows = ["| side | step s | peak MB | held MB | all_gather MB | reduce_scatter MB | trainable |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind in SIDES:
        if kind in mem:
            m, s = mem[kind], mem[kind]["sent"]
            rows.append(f"| {kind} | {times.get(kind, float('nan')):.4f} | {m['peak_mb']:.1f} | {m['held_mb']:.1f} | "
                        + " | ".join(f"{s.get(op, 0.0) / 2**20:.2f}" for op in ("all_gather", "reduce_scatter"))
                        + f" | {m['trainable']:,} |")
    for name, r in records.items():
        rows.append(f"lora / {name}: step time {r['ratio_step_time']}, peak {r['ratio_peak_memory']}, "
                    f"held {r['ratio_held_memory']}, dp bytes {r['ratio_dp_bytes']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), COMPARISONS, steps=8, rounds=3,
                         unit="set of sides")
    args, overrides = parse(parser, argv)
    world = WORLD
    quick = ["--model.dim=128", "--model.ffn_dim=384", "--train.seq_len=64"] if args.quick else []
    cfg = load_config(args.config, [
        "--model.dim=384", "--model.n_heads=8", "--model.n_kv_heads=4", "--model.ffn_dim=1024", "--model.n_layers=4",
        "--train.seq_len=128", "--train.micro_batch=4", f"--train.global_batch={4 * world}", "--train.dtype=fp32",
        "--train.device=cpu", "--parallel.zero=3", "--optim.lr=1e-4", *quick, *overrides])
    kinds = tuple(dict.fromkeys(k for name in args.only for k in COMPARISONS[name]))
    prewarm()
    began = time.perf_counter()
    diff = check_logits(side_config(cfg, "peft")) if "peft" in kinds else None
    m, t = cfg.model, cfg.train
    log(f"model dim {m.dim}, {m.n_layers} layers, ffn {m.ffn_dim}; {world} ranks x micro-batch {t.micro_batch} x seq "
        f"{t.seq_len}, fp32, ZeRO-3; LoRA r {RANK} alpha {ALPHA}; logits fivefold vs peer max |diff| {diff}")
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    for rnd in range(args.rounds):
        order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]  # who is built and stepped first rotates
        for kind, res in run_round(order, cfg, world, args.warmup, args.steps).items():
            runs[kind].append(res)
            log(f"round {rnd + 1}/{args.rounds} {kind:5s} median {median(res['times']):.4f} s/step  "
                f"first loss {res['losses'][0]:.7f}  [{time.perf_counter() - began:.0f} s]")
    mem = {}
    for kind in kinds:
        mem[kind] = run_memory(kind, cfg, world)
        log(f"memory {kind:5s} peak {mem[kind]['peak_mb']:.1f} MB held {mem[kind]['held_mb']:.1f} MB, "
            f"sent {mem[kind]['sent']}  [{time.perf_counter() - began:.0f} s]")
    summary: dict = {"summary": True, "logits_max_abs_diff": diff}
    records = {}
    for name in args.only:
        a, b = COMPARISONS[name]
        records[name] = out = comparison_record({"name": f"lora_vs_{name}", "a": a, "b": b}, runs[a], runs[b],
                                                memory_record(a, b, mem), args.steps, args.rounds, labels=(a, b))
        report(f"lora_vs_{name}", out, summary, {f"lora_vs_{name}_ratio_step_time": "ratio_step_time",
                                                 f"lora_vs_{name}_ratio_peak_memory": "ratio_peak_memory",
                                                 f"lora_vs_{name}_ratio_dp_bytes": "ratio_dp_bytes"},
               labels=(f"{a} ", f"{b} "))
    firsts = [runs[k][0]["losses"][0] for k in kinds]
    summary["first_losses_agree"] = max(firsts) - min(firsts) <= LOSS_TOL
    log(table(records, mem, {k: median([x for r in runs[k] for x in r["times"]]) for k in kinds}))
    summary["model"] = f"dim {m.dim}, ffn {m.ffn_dim}, {m.n_layers} layers, seq {t.seq_len}, mb {t.micro_batch}"
    finish_summary(summary, None, began, note="no target: the issue asks for the figures")


if __name__ == "__main__":
    main()
