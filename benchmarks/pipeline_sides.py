"""The two sides the pipeline benchmarks compare (pipeline_parallel.py, zero3_pipeline.py): fivefold's
executor through parallelize(), and torch.distributed.pipelining's stages and schedules around the
very same modules, with what both step with (the global batches, one timed step). pipeline_parallel.py's
docstring says how each side is built and why the two do the same work."""

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from fivefold.config.derive import derive  # noqa: E402
from fivefold.config.load import replace  # noqa: E402
from fivefold.config.schema import Config  # noqa: E402
from fivefold.data.resolve import tokenizer_vocab, unpadded_vocab  # noqa: E402
from fivefold.model.rope import rope_cos_sin  # noqa: E402
from fivefold.model.transformer import Transformer, cross_entropy_sum  # noqa: E402
from fivefold.parallel.mesh import Mesh  # noqa: E402
from fivefold.parallel.optimizer import build_optimizer  # noqa: E402
from fivefold.parallel.parallelize import parallelize  # noqa: E402
from fivefold.parallel.pipeline.schedules import build_schedule  # noqa: E402
from fivefold.parallel.pipeline.stage_split import stage_split  # noqa: E402
from fivefold.parallel.pipeline.stages import stage_layers  # noqa: E402
from fivefold.train.loop import build_model  # noqa: E402
from fivefold.train.precision import LossScaler  # noqa: E402

# fivefold schedule name -> (torch schedule class, stages per rank). Each pair runs the same
# per-rank action order (tests/parallel/test_schedules.py checks it against torch's pipeline_order):
# ScheduleInterleavedZeroBubble with one stage per rank is ZB-H1, fivefold's "zb_h1" (fivefold has
# no interleaved zero-bubble schedule with v > 1); DualPipeV's overlapped F + B pairs run one after
# the other in torch too (no overlap on one CPU thread), as fivefold lists them.
SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2),
    "zb_h1": (ScheduleInterleavedZeroBubble, 1),
    "zb_v": (ScheduleZBVZeroBubble, 2),
    "dualpipe_v": (ScheduleDualPipeV, 2),
}
# fivefold / torch at 2 processes, from the issue: no slower and no larger than torch on any schedule


def schedule_cfg(cfg: Config, name: str) -> Config:
    return replace(cfg, parallel={"pp_schedule": name, "virtual_stages": SCHEDULES[name][1]})


def global_batches(cfg: Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n global batches (inputs, targets), (global_batch, T) each; the same in every run and rank."""
    t = cfg.train
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(t.seed * 100_003 + step)
        tokens = torch.randint(0, 256, (t.global_batch, t.seq_len + 1), generator=g)  # (B_global, T+1)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def rank_batches(cfg: Config, rank: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This data-parallel rank's rows of global_batches(cfg, n), train.micro_batch of each."""
    mb = cfg.train.micro_batch
    return [(x[rank * mb:(rank + 1) * mb], y[rank * mb:(rank + 1) * mb]) for x, y in global_batches(cfg, n)]


# ---- the torch side ---------------------------------------------------------------------------------
class TorchStage(nn.Module):
    """One pipeline stage for torch.distributed.pipelining, around modules of a fivefold Transformer."""

    def __init__(self, model: Transformer, layers: list[str], first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[name] for name in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.head_dim, self.cfg = model.head_dim, model.cfg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x  # (B, T, dim)
        cos, sin = rope_cos_sin(torch.arange(h.shape[1], device=h.device), self.head_dim, self.cfg.rope)
        for block in self.layers:
            h = block(h, cos, sin)
        if self.output is not None:
            h = self.output(self.norm(h))  # (B, T, V)
        return h


class FivefoldSide:
    """fivefold's pipeline on this rank, stepped as train/loop.py steps it."""

    kind = "fivefold"

    def __init__(self, cfg: Config, mesh: Mesh):
        self.cfg, self.mesh = cfg, mesh
        derived = derive(cfg, mesh.world_size, unpadded_vocab(cfg))
        self.par = parallelize(build_model(cfg, derived.vocab_size), mesh, cfg, derived)
        self.scaler = LossScaler(cfg.train)  # fp32: a scale of 1 that never skips
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []
        self.comm: list[dict[str, dict[str, float]]] = []
        self.timelines: list[list[tuple[float, float, str]]] = []
        self.step_spans: list[tuple[float, float]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        t, o, par, mesh = self.cfg.train, self.cfg.optim, self.par, self.mesh
        mesh.stats.reset()
        rows = x.shape[0] // mesh.size("batch")  # this dp rank's rows of the global batch, as rank_slice takes them
        mine = slice(mesh.rank("batch") * rows, (mesh.rank("batch") + 1) * rows)
        micro = list(zip(x[mine].split(t.micro_batch), y[mine].split(t.micro_batch), strict=True))  # in order
        stats = par.pipeline.run(micro, x.numel(), clock=clock)
        par.optimizer_step(o.lr, self.scaler, o.grad_clip)
        self.comm.append(mesh.stats.snapshot())  # this step's traffic per axis, as train_step's metrics "comm"
        if clock:
            self.timelines.append(stats.timeline)
        return float(stats.loss)  # this rank's sum of micro-batch losses (0 off the last stage)


class TorchSide:
    """torch.distributed.pipelining with the same stages, loss, clipping and AdamW. `pp_group`: the
    stages' group (default: every rank, dp = 1); with dp > 1 ranks are pp-major as fivefold's mesh, a
    subclass's `shard` adds data parallel, which averages over dp (so the loss / this dp rank's tokens)."""

    kind = "torch"

    def __init__(self, cfg: Config, world: int, name: str, pp_group: dist.ProcessGroup | None = None):
        t, m = cfg.train, cfg.model
        self.cfg = cfg
        self.group = dist.group.WORLD if pp_group is None else pp_group
        pp = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)  # this rank's place in the pipeline
        self.dp, self.dp_rank = world // pp, dist.get_rank() % (world // pp)
        cls, v = SCHEDULES[name]
        n_stages, n_micro = pp * v, t.global_batch // (self.dp * t.micro_batch)
        vocab = derive(cfg, world, unpadded_vocab(cfg)).vocab_size
        model = build_model(cfg, vocab)
        layers = stage_layers(stage_split(cfg, vocab))  # fivefold's blocks per stage
        # fivefold's placement, which is torch's: stage s on rank s % pp ("loop"), or r and 2pp-1-r ("v")
        to_rank = build_schedule(name, pp, n_micro, v).stage_to_rank
        mine = [s for s in range(n_stages) if to_rank(s) == self.rank]
        self.modules = [TorchStage(model, layers[s], s == 0, s == n_stages - 1) for s in mine]
        del model  # what no stage of this rank uses is freed with it
        for module in self.modules:
            self.shard(module)
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        mb, T = t.micro_batch, t.seq_len
        stages = []
        for s, module in zip(mine, self.modules, strict=True):
            # Static example shapes: non-first inputs and every output need requires_grad (docs/torch-cpu-notes.md).
            inp = (torch.zeros(mb, T, dtype=torch.long) if s == 0
                   else torch.zeros(mb, T, m.dim, requires_grad=True))
            out = torch.zeros(mb, T, vocab if s == n_stages - 1 else m.dim, requires_grad=True)
            stages.append(PipelineStage(module, s, n_stages, torch.device("cpu"), input_args=(inp,),
                                        output_args=(out,), group=self.group))
        rank_tokens = t.global_batch * T // self.dp  # the tokens of this dp rank's rows, of every micro-batch

        real = tokenizer_vocab(cfg)  # fivefold masks the padding ids out of the loss; so does this side

        def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return cross_entropy_sum(logits[..., :real], target) / rank_tokens

        self.schedule = cls(stages if issubclass(cls, PipelineScheduleMulti) else stages[0], n_micro,
                            loss_fn=loss_fn, scale_grads=False)
        holder = nn.ModuleList(self.modules)
        self.params = [p for p in holder.parameters() if p.requires_grad]
        self.opt = build_optimizer(holder, cfg.optim)  # after `shard`: FSDP2 steps the DTensor shards
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.losses: list[float] = []

    def shard(self, module: nn.Module) -> None:
        """Data parallel for one stage module: none here (dp = 1)."""

    def step(self, x: torch.Tensor, y: torch.Tensor, clock=None) -> float:
        rows = x.shape[0] // self.dp  # this dp rank's rows of the global batch, as fivefold takes them
        x, y = (z[self.dp_rank * rows : (self.dp_rank + 1) * rows] for z in (x, y))
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        if isinstance(norm, DTensor):  # FSDP2: the shards' norm, reduced over dp
            norm = norm.full_tensor()
        sq = norm.double() ** 2  # this rank's part of the global norm
        dist.all_reduce(sq, group=self.group)
        torch.nn.utils.clip_grads_with_norm_(self.params, self.cfg.optim.grad_clip, sq.sqrt().float())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return sum(float(loss.detach()) for loss in losses) / self.dp  # summed over ranks: the mean over dp


def timed_step(side, x: torch.Tensor, y: torch.Tensor, clock=None) -> None:
    cpu, began = time.process_time(), time.perf_counter()
    loss = side.step(x, y, clock)
    ended = time.perf_counter()
    side.times.append(ended - began)
    side.cpu_times.append(time.process_time() - cpu)  # every thread of the process: gloo's, the send waiter
    if clock:
        side.step_spans.append((began, ended))
    total = torch.tensor(loss, dtype=torch.float64)  # outside the timed region; lines the ranks up
    dist.all_reduce(total)
    side.losses.append(float(total))
