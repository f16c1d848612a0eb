"""Muon's optimizer step: fivefold's distributed Muon against torch.optim.Muon on every rank.

Run: `.venv/bin/python benchmarks/muon.py [--nproc 2 4] [--steps N] [--rounds R] [--quick]`
(extra `--section.key=value` arguments override the config, e.g. `--model.dim=384`).

What is compared, on 2 and on 4 forked gloo ranks (CPU, fp32 model, one thread each), the same
dense model (configs/tiny.toml widened to dim 256, 8 heads, ffn 768, 4 layers: 28 hidden matrices
of 256 x 256 and 768 x 256, so Newton-Schulz is most of the step), weights and batches:
1. `ddp`:   fivefold `--optim.name=muon` at `parallel.zero = 0` (each replica orthogonalises every
            matrix, as each steps AdamW: nothing to exchange);
2. `zero1`: the same at `parallel.zero = 1` (each matrix's rows gathered in bf16 to one owner of
            the dp ranks, orthogonalised there once, sent back: parallel/muon.py, matrix_owners.py);
against the naive peer: torch `DistributedDataParallel` over the plain model, torch.optim.Muon on the
same matrices (`is_muon_matrix`; the dense model has no expert stacks) with fivefold's hyper-parameters
and learning-rate rule, torch.optim.AdamW (`build_optimizer`) on the rest; every rank orthogonalises
every matrix. fivefold's sides are built by `parallelize()` and stepped as train/loop.py steps them.

What is timed: the optimizer step alone. Each step runs forward + backward (with the gradient
reduction) untimed on every side, then a barrier, then the timed part: fivefold's
`Parallelized.optimizer_step` (the global-norm clip, Muon + AdamW, and at ZeRO-1 the gather of the
updated shards) against the peer's `clip_grad_norm_` + `Muon.step` + `AdamW.step`; a step takes as
long as its slowest rank. `ratio_optimizer_step` (fivefold / torch) compares those; `ratio_step_only`
compares the optimizers' `step()` alone (fivefold's Muon.step, its AdamW inside, against the peer's
Muon.step + AdamW.step), without the clip and ZeRO's gather. The three sides alternate step by step
(the order rotating), over rounds in fresh workers; medians over all timed steps of all rounds.

Counted, not timed (exact on any machine): each rank's Newton-Schulz FLOPs per step (fivefold's
`Muon.flops`, the peer's every matrix's `ns_flops`), and the bytes Muon's exchange sends per step
on each rank: the mesh's CommStats around `Muon.step` (its only collectives are the all_to_alls),
beside the planner's predictions from the model's shape (planner/muon.py: `stage_pieces`, each
stage's gather and return, and `rank_ns_flops`), the analytic figure, 2 (N-1)/N x this rank's
pieces of the matrices in bf16 (a gather and a return over the N dp ranks), and the exact one from
the owners (`Matrix.owners`: a rank sends its piece of every matrix another rank owns, and each
piece but its own of the matrices it owns).
The first-step losses of the three sides are checked to agree within 1e-5 (the same forward).
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch: forked workers must not inherit a busy thread pool

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from benchmarks.common import (  # noqa: E402
    alternate,
    comparison_record,
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
from benchmarks.pipeline_sides import rank_batches  # noqa: E402
from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import load_config, replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import tokenizer_vocab, unpadded_vocab  # noqa: E402
from fivefold.model.counts import model_counts  # noqa: E402
from fivefold.model.transformer import cross_entropy_sum  # noqa: E402
from fivefold.parallel.comm.wire import wire_bytes  # noqa: E402
from fivefold.parallel.forked_ranks import run_workers  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.muon import is_muon_matrix, ns_flops  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.planner.layout import rank_shares  # noqa: E402
from fivefold.planner.muon import rank_ns_flops, stage_pieces  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402

torch.set_num_threads(1)
COMPARISONS = {"ddp": "fivefold_ddp", "zero1": "fivefold_zero1"}  # each against "torch"
ZERO = {"fivefold_ddp": 0, "fivefold_zero1": 1}
BF16 = 2  # bytes per element of the exchanged pieces


def exchange_bytes(optimizer: torch.optim.Optimizer) -> tuple[float, int]:
    """This rank's bytes sent per Muon step: (analytic, exact). Analytic: 2 (N-1)/N of its pieces'
    bf16 bytes per cut (a gather and a return over N ranks, owners balanced). Exact, from the owners
    (one cut per matrix here: tp = 1): the piece of each matrix another rank owns goes there, and
    the owner sends back every piece but its own."""
    analytic, exact = 0.0, 0
    for t, pieces in optimizer.pieces.items():
        for pc in pieces:
            numel = pc.view(t).numel()
            for s, owner in zip(pc.matrix.splits, pc.matrix.owners, strict=True):
                n = s.group.size
                analytic += 2 * (n - 1) / n * numel * BF16
                exact += (n - 1) * numel * BF16 if owner == s.group.rank else numel * BF16
    return analytic, exact


def planner_prediction(cfg: Config, world: int) -> tuple[float, float]:
    """The planner's (planner/muon.py) bytes one rank sends in Muon's all_to_alls per step (each stage's
    gather and return) and its NS5 FLOPs, from the model's shape alone (pp = 1: one pipeline rank)."""
    d = derive(cfg, world, unpadded_vocab(cfg))
    share = rank_shares(cfg, model_counts(cfg.model, d.vocab_size))[0]
    sent = sum(2 * wire_bytes("all_to_all", nbytes, n) for _, n, nbytes in stage_pieces(cfg, d, share))
    return sent, rank_ns_flops(cfg, d, share)


class FivefoldSide:
    """fivefold's Muon at one `parallel.zero`, built by parallelize(), stepped as train/loop.py does."""

    def __init__(self, kind: str, cfg: Config, world: int):
        self.kind, self.times, self.cpu_times, self.losses = kind, [], [], []
        self.step_only: list[float] = []
        self.sent: list[float] = []  # all_to_all wire bytes this rank sent in each Muon.step
        self.calls: list[int] = []
        self.cfg = cfg = replace(cfg, parallel={"zero": ZERO[kind]})
        derived = derive(cfg, world, unpadded_vocab(cfg))
        self.mesh = Mesh.from_config(cfg, derived)
        self.par = parallelize(build_model(cfg, derived.vocab_size), self.mesh, cfg, derived)
        self.scaler = LossScaler(cfg.train)  # fp32: a scale of 1 that never skips
        opt = self.par.optimizer
        inner = opt.step

        def counted_step() -> None:  # Muon.step (AdamW's inside it), timed and its exchange counted
            before = self.mesh.stats.snapshot()
            began = time.perf_counter()
            inner()
            self.step_only.append(time.perf_counter() - began)
            after = self.mesh.stats.snapshot()
            self.sent.append(sum(v["wire_bytes"] - before.get(k, {}).get("wire_bytes", 0) for k, v in after.items()))
            self.calls.append(sum(v["calls"] - before.get(k, {}).get("calls", 0) for k, v in after.items()))

        opt.step = counted_step  # what optimizer_step calls

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.par.pipeline.run([(x, y)], x.numel() * self.mesh.size("batch")).loss  # / global tokens

    def optimizer_step(self) -> None:
        o = self.cfg.optim
        self.par.optimizer_step(o.lr, self.scaler, o.grad_clip)

    def counts(self) -> dict:
        analytic, exact = exchange_bytes(self.par.optimizer)
        return {"ns_flops": self.par.optimizer.flops, "sent_bytes": self.sent[-1], "all_to_all_calls": self.calls[-1],
                "analytic_bytes": analytic, "exact_bytes": exact,
                "sent_bytes_every_step_equal": len(set(self.sent)) == 1}


class TorchSide:
    """The naive peer: DistributedDataParallel, torch.optim.Muon on the Muon matrices, AdamW on the rest."""

    kind = "torch"

    def __init__(self, cfg: Config, world: int):
        self.times, self.cpu_times, self.losses, self.step_only = [], [], [], []
        self.cfg, o, m = cfg, cfg.optim, cfg.optim.muon
        model = build_model(cfg, derive(cfg, world, unpadded_vocab(cfg)).vocab_size)
        self.net = DistributedDataParallel(model, bucket_cap_mb=cfg.parallel.bucket_mb * 1e6 / 2**20)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        matrices = [p for n, p in named if is_muon_matrix(n, p)]
        assert all(p.ndim == 2 for p in matrices), "a dense model: torch.optim.Muon takes 2-D matrices only"
        self.params = [p for _, p in named]
        self.muon = torch.optim.Muon(matrices, lr=m.lr or o.lr, weight_decay=o.weight_decay, momentum=m.momentum,
                                     nesterov=m.nesterov, ns_steps=m.ns_steps, adjust_lr_fn=m.adjust_lr)
        self.adamw = build_optimizer([p for n, p in named if not is_muon_matrix(n, p)], o)
        self.flops = sum(ns_flops(tuple(p.shape), m.ns_steps) for p in matrices)  # every matrix, on every rank
        self.local_tokens = cfg.train.micro_batch * cfg.train.seq_len
        self.real = tokenizer_vocab(cfg)  # fivefold masks the vocabulary's padding ids out of the loss; so does this

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = cross_entropy_sum(self.net(x)[..., :self.real], y) / self.local_tokens  # DDP averages over ranks
        loss.backward()
        return loss.detach() / dist.get_world_size()  # this rank's share of the global mean

    def optimizer_step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
        began = time.perf_counter()
        self.muon.step()
        self.adamw.step()
        self.step_only.append(time.perf_counter() - began)
        self.muon.zero_grad(set_to_none=True)
        self.adamw.zero_grad(set_to_none=True)

    def counts(self) -> dict:
        return {"ns_flops": self.flops, "sent_bytes": 0, "all_to_all_calls": 0}


def timed_step(side: FivefoldSide | TorchSide, x: torch.Tensor, y: torch.Tensor) -> None:
    """Forward + backward untimed, then the optimizer step timed (after a barrier: no rank's wait
    for a slower backward counts as optimizer time)."""
    loss = side.backward(x, y)
    dist.barrier()
    cpu, began = time.process_time(), time.perf_counter()
    side.optimizer_step()
    side.times.append(time.perf_counter() - began)
    side.cpu_times.append(time.process_time() - cpu)
    total = loss.detach().double()
    dist.all_reduce(total)  # the global mean loss, outside the timed region
    side.losses.append(float(total))


def _worker(rank: int, world: int, kinds: tuple[str, ...], cfg: Config, warmup: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    sides = [TorchSide(cfg, world) if k == "torch" else FivefoldSide(k, cfg, world) for k in kinds]
    results = alternate(sides, rank_batches(cfg, rank, warmup + steps), warmup, timed_step)
    for res, side in zip(results, sides, strict=True):
        res.update(side.counts(), step_only=side.step_only[warmup:])
    return results


def run_round(kinds: tuple[str, ...], cfg: Config, world: int, warmup: int, steps: int) -> dict[str, dict]:
    """One round in fresh workers: per side the slowest rank's times, and every rank's counts."""
    results = run_workers(_worker, world, kinds, cfg, warmup, steps, timeout=600.0)  # [rank][side]
    out = slowest_rank(results, kinds)
    for i, kind in enumerate(kinds):
        out[kind]["step_only"] = [max(ts) for ts in zip(*(r[i]["step_only"] for r in results), strict=True)]
        for key in results[0][i]:
            if key not in ("times", "cpu_times", "losses", "step_only"):
                out[kind][key] = [r[i][key] for r in results]  # per rank
    return out


def record(name: str, kind: str, runs: dict[str, list[dict]], cfg: Config, world: int, steps: int,
           rounds: int) -> dict:
    """comparison_record of fivefold's `kind` against torch, with the step-only ratio, the counts and
    the planner's predictions of them."""
    a, b = runs[kind], runs["torch"]
    out = comparison_record({"name": name, "fivefold": kind, "torch": "torch_ddp_muon", "nproc": world}, a, b, {},
                            steps, rounds, ratio_key="ratio_optimizer_step")
    s_a, s_b = (median([t for r in side for t in r["step_only"]]) for side in (a, b))
    out.update({"fivefold_step_only_s": round(s_a, 4), "torch_step_only_s": round(s_b, 4),
                "ratio_step_only": ratio(s_a, s_b)})
    last = a[-1]  # counts: the same every round (checked below), per rank
    same = all(r["sent_bytes"] == last["sent_bytes"] and r["ns_flops"] == last["ns_flops"]
               and all(r["sent_bytes_every_step_equal"]) for r in a)
    out.update({"fivefold_ns_flops_per_rank": last["ns_flops"], "torch_ns_flops_per_rank": b[-1]["ns_flops"],
                "ratio_ns_flops_max_rank": ratio(max(last["ns_flops"]), max(b[-1]["ns_flops"])),
                "muon_sent_bytes_per_rank": last["sent_bytes"],
                "muon_all_to_all_calls_per_rank": last["all_to_all_calls"],
                "muon_analytic_bytes_per_rank": [round(x) for x in last["analytic_bytes"]],
                "muon_exact_bytes_per_rank": last["exact_bytes"], "counts_repeat_every_round": same})
    planned_bytes, planned_flops = planner_prediction(replace(cfg, parallel={"zero": ZERO[kind]}), world)
    out.update({"planner_muon_bytes_per_rank": round(planned_bytes), "planner_ns_flops_per_rank": round(planned_flops)})
    return out


def table(records: list[dict]) -> str:
    """The README's table: ratios and counts (rank 0's; every rank's in the JSON lines)."""
    rows = ["| ranks | layout | optimizer_step / peer | step() alone / peer | CPU time / peer | NS5 GFLOP per rank: "
            "fivefold, planner, peer | Muon bytes sent per rank: counted, planner, exact | all_to_all calls |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        flops = (r["fivefold_ns_flops_per_rank"][0], r["planner_ns_flops_per_rank"], r["torch_ns_flops_per_rank"][0])
        sent = (r["muon_sent_bytes_per_rank"][0], r["planner_muon_bytes_per_rank"], r["muon_exact_bytes_per_rank"][0])
        rows.append(f"| {r['nproc']} | {r['name'].split('_')[0]} | {r['ratio_optimizer_step']:.2f} | "
                    f"{r['ratio_step_only']:.2f} | {r.get('ratio_cpu_time', float('nan')):.2f} | "
                    + ", ".join(f"{f / 1e9:.2f}" for f in flops) + " | " + ", ".join(f"{b:,.0f}" for b in sent)
                    + f" | {r['muon_all_to_all_calls_per_rank'][0]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = make_parser(__doc__, str(ROOT / "configs" / "tiny.toml"), COMPARISONS, steps=8, rounds=3,
                         unit="world size")
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4], help="rank counts (forked worker processes)")
    args, overrides = parse(parser, argv)
    base = load_config(args.config, [
        "--model.dim=256", "--model.n_heads=8", "--model.n_kv_heads=8", "--model.ffn_dim=768", "--model.n_layers=4",
        "--train.seq_len=64", "--train.micro_batch=2", "--train.dtype=fp32", "--train.device=cpu",
        "--optim.name=muon", *overrides])
    prewarm()
    began = time.perf_counter()
    kinds = (*(COMPARISONS[name] for name in args.only), "torch")
    summary: dict = {"summary": True}
    records: list[dict] = []
    for world in args.nproc:
        cfg = replace(base, train={"global_batch": base.train.micro_batch * world})  # one micro-batch per rank
        runs: dict[str, list[dict]] = {k: [] for k in kinds}
        for rnd in range(args.rounds):
            order = kinds[rnd % len(kinds):] + kinds[:rnd % len(kinds)]  # who is built and stepped first rotates
            for kind, res in run_round(order, cfg, world, args.warmup, args.steps).items():
                runs[kind].append(res)
                log(f"nproc {world} round {rnd + 1}/{args.rounds} {kind:15s} optimizer step median "
                    f"{median(res['times']):.4f} s  first loss {res['losses'][0]:.7f}  "
                    f"[{time.perf_counter() - began:.0f} s]")
        for name in args.only:
            out = record(f"{name}_n{world}", COMPARISONS[name], runs, cfg, world, args.steps, args.rounds)
            records.append(out)
            key = f"{name}_n{world}"
            report(key, out, summary, {f"{key}_ratio_optimizer_step": "ratio_optimizer_step",
                                       f"{key}_ratio_step_only": "ratio_step_only"}, labels=("", ""))
    log(table(records))
    m = base.model
    summary["model"] = f"dim {m.dim}, ffn {m.ffn_dim}, {m.n_layers} layers"
    # expected, not asserted: ZeRO-1 orthogonalises each matrix once across the ranks, the peer on every rank
    finish_summary(summary, {f"zero1_n{w}_ratio_optimizer_step": 1.0 for w in args.nproc}, began)


if __name__ == "__main__":
    main()
