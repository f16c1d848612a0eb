"""Data parallel's traffic, overlap and checkpoints, and PyTorch's DDP as an oracle."""

import pytest
import torch
import torch.distributed as dist
from helpers import config_mesh, tiny_config

from fivefold.checkpoint.run_state import complete_checkpoints
from fivefold.model.transformer import count_parameters
from fivefold.parallel.comm import collectives
from fivefold.parallel.data import apply_data_parallel
from fivefold.parallel.forked_ranks import run_workers
from fivefold.planner.comm import dp_traffic
from fivefold.train.loop import build_model, train
from fivefold.train.metrics import read_metrics

STEPS = ("--train.steps=2", "--data.max_bytes=20000", "--data.val_fraction=0.0")


def _train(rank, world, cfg):
    r = train(cfg, progress=False)
    return r.losses, r.samples


@pytest.mark.parametrize("zero,n,micro,keep", [
    (0, 2, 4, False), (0, 4, 1, False), (1, 2, 2, False), (2, 2, 4, False), (2, 2, 2, False),
    (3, 2, 4, False), (3, 4, 1, False), (3, 2, 2, True)])
def test_counted_bytes_equal_the_theory(tmp_path, zero, n, micro, keep):
    cfg = tiny_config(tmp_path, *STEPS, f"--parallel.zero={zero}", f"--train.micro_batch={micro}",
                      "--parallel.bucket_mb=0.2", f"--parallel.reshard_after_forward={str(not keep).lower()}")
    run_workers(_train, n, cfg)
    m = 8 // n // micro  # micro-batches per step
    model = build_model(cfg, 320)
    G = P = count_parameters(model) * 4  # fp32 gradients and parameters, bytes
    H = (count_parameters(model.norm) + count_parameters(model.output)) * 4  # the head's unit
    # The tiny model's rows divide by 2 and 4, so shards carry no padding and counts are exact.
    expected = {
        0: 2 * (n - 1) / n * G,  # all-reduce
        1: (n - 1) / n * G + (n - 1) / n * P,  # reduce-scatter + all-gather
        2: m * (n - 1) / n * G + (n - 1) / n * P,  # a reduce-scatter per micro-batch + all-gather
        3: (2 * P if keep else 3 * m * P - m * H) * (n - 1) / n,  # per micro-batch: gather, gather again
        # (not the head: kept gathered for its backward), reduce-scatter; kept gathered: one gather
        # and one reduce-scatter per step
    }[zero]
    if zero:
        expected += collectives.wire_bytes("all_reduce", 8, n)  # the fp64 sum of squares for the norm
    for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl"):
        assert record["comm"]["dp"]["wire_bytes"] == expected
        assert set(record["comm"]) == {"dp"}  # the loss reduction is charged to "log", not here
    if zero == 2 and m == 2:  # 1.5x DDP's bytes
        assert expected - collectives.wire_bytes("all_reduce", 8, n) == 1.5 * 2 * (n - 1) / n * G
    if zero == 3 and not keep:  # the planner prices the same bytes (planner/comm.py)
        norm_sum = collectives.wire_bytes("all_reduce", 8, n)  # the norm's sum of squares
        assert dp_traffic(zero, n, G, P, m, True, kept_bytes=H).bytes + norm_sum == expected


@pytest.mark.parametrize("zero,schedule,keep", [
    (2, "interleaved_1f1b", False), (3, "interleaved_1f1b", True), (3, "dualpipe_v", False)])
def test_counted_bytes_with_pipelines_equal_the_theory(tmp_path, zero, schedule, keep):
    """pp2 x dp2: each chunk's gradients reduce at its own backwards, and ZeRO-3 kept gathered
    moves its rank's parameters once per step whatever the micro-batch count (4 here)."""
    from fivefold.parallel.pipeline.schedules import build_schedule
    from fivefold.parallel.pipeline.stages import split_stages

    cfg = tiny_config(tmp_path, *STEPS, f"--parallel.zero={zero}", "--train.micro_batch=1", "--parallel.pp=2",
                      f"--parallel.pp_schedule={schedule}", "--parallel.virtual_stages=2",
                      f"--parallel.reshard_after_forward={str(not keep).lower()}")
    run_workers(_train, 4, cfg)
    n, m = 2, 4  # dp ranks; micro-batches per step: 8 samples / (dp 2 x micro-batch 1)
    model = build_model(cfg, 320)
    split_stages(model, build_schedule(schedule, 2, m, 2), 0, (2, 2, 2, 2))  # rank 0's chunks: what it reduces
    G = P = count_parameters(model) * 4
    expected = {
        2: m * (n - 1) / n * G + (n - 1) / n * P,  # a reduce-scatter per chunk backward + all-gather
        3: ((n - 1) / n * (P + G) if keep  # one gather and one reduce-scatter per step
            else 3 * m * (n - 1) / n * P),  # gathers for F and for I/B, reduce-scatter at B/W
    }[zero] + collectives.wire_bytes("all_reduce", 8, n)  # the norm's fp64 sum of squares
    for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl"):  # rank 0's counters
        assert record["comm"]["dp"]["wire_bytes"] == expected
    # The planner prices the same bytes for this rank (planner/comm.py).
    assert dp_traffic(zero, n, G, P, m, not keep).bytes + collectives.wire_bytes("all_reduce", 8, n) == expected


def _gradients_and_issues(rank, world, cfg):
    """DDP's backward, with overlap on and off: the events in order, ("grad", bucket) as each
    parameter's gradient is accumulated and ("issue", bucket) as each all-reduce is issued (in
    bucket order: the k-th issued is bucket k's)."""
    from fivefold.model.transformer import cross_entropy_sum

    mesh, derived = config_mesh(cfg, world)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(rank))
    issue = collectives._issue

    def events_of(overlap: bool) -> tuple[list[tuple[str, int]], int]:
        model = build_model(cfg, 320)
        dp = apply_data_parallel(model, mesh, cfg, derived)
        dp.reducer.overlap = overlap  # the bucket machinery's switch (parallel.overlap_comm)
        events: list[tuple[str, int]] = []
        bucket = {id(p): k for k, b in enumerate(dp.buckets) for p in b.params}
        issued = iter(range(len(dp.buckets)))
        for p in dp.params:  # after DDP's own hook: a bucket's last gradient is logged after its issue
            p.register_post_accumulate_grad_hook(lambda q: events.append(("grad", bucket[id(q)])))

        def logged_issue(op, group, *args, **kwargs):
            if op == "all_reduce" and group.name == "grad":
                events.append(("issue", next(issued)))
            return issue(op, group, *args, **kwargs)

        collectives._issue = logged_issue
        try:
            dp.backward(cross_entropy_sum(model(x), x) / x.numel(), last_micro_batch=True)
        finally:
            collectives._issue = issue
        return events, len(dp.buckets)

    return events_of(True), events_of(False)


def test_buckets_overlap_communication_with_backward(tmp_path):
    """With overlap, bucket k's all-reduce is issued while backward still computes the gradients
    of bucket k + 1; without it, every all-reduce waits for the backward's last gradient. Order of
    events, not time: it holds however loaded the machine is."""
    cfg = tiny_config(tmp_path, "--parallel.bucket_mb=0.1")
    (overlapped, n_buckets), (serial, n_serial) = run_workers(_gradients_and_issues, 2, cfg)[0]
    assert n_buckets == n_serial >= 4
    for events in (overlapped, serial):
        assert sorted(e for e in events if e[0] == "issue") == [("issue", k) for k in range(n_buckets)]
    issued = {k: overlapped.index(("issue", k)) for k in range(n_buckets)}
    last_grad = {k: max(i for i, e in enumerate(overlapped) if e == ("grad", k)) for k in range(n_buckets)}
    for k in range(n_buckets - 1):
        assert issued[k] < last_grad[k + 1], overlapped  # in flight while the next bucket fills
    final = max(i for i, e in enumerate(serial) if e[0] == "grad")
    assert all(serial.index(("issue", k)) > final for k in range(n_buckets)), serial


def _buckets_in_flight(rank, world, cfgs):
    """DDP's backward under each of `cfgs`: its gradient all-reduces as ("issue", bytes, handle) and
    ("wait", handle) in order, and the reduced gradients."""
    from fivefold.model.transformer import cross_entropy_sum

    issue, wait = collectives._issue, collectives.Pending.wait
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(rank))
    runs = []
    for cfg in cfgs:
        mesh, derived = config_mesh(cfg, world)
        model = build_model(cfg, 320)
        dp = apply_data_parallel(model, mesh, cfg, derived)
        events = []

        def logged_issue(op, group, nbytes, *args, events=events, **kwargs):
            handle = issue(op, group, nbytes, *args, **kwargs)
            if op == "all_reduce" and group.name == "grad":
                events.append(("issue", nbytes, id(handle)))
            return handle

        def logged_wait(self, part=None, events=events):
            if self._op == "all_reduce" and self._group.name == "grad":
                events.append(("wait", id(self)))
            return wait(self, part)

        collectives._issue, collectives.Pending.wait = logged_issue, logged_wait
        try:
            dp.backward(cross_entropy_sum(model(x), x) / x.numel(), last_micro_batch=True)
        finally:
            collectives._issue, collectives.Pending.wait = issue, wait
        runs.append((events, [p.grad for p in dp.params]))
    return runs


def test_buckets_in_flight(tmp_path):
    """parallel.buckets_in_flight = K: up to K all-reduces are in flight at once (issued, not yet
    waited for), each waited for in the order issued, just before the (K+1)-th would be issued;
    the reductions (which buckets, in which order) and the gradients are the same for every K."""
    ks = (1, 2, 3)
    cfgs = [tiny_config(tmp_path, "--parallel.bucket_mb=0.1", f"--parallel.buckets_in_flight={k}") for k in ks]
    runs = run_workers(_buckets_in_flight, 2, cfgs)[0]
    issued_bytes = [[e[1] for e in events if e[0] == "issue"] for events, _ in runs]
    assert len(issued_bytes[0]) >= 4 and all(b == issued_bytes[0] for b in issued_bytes)  # the same reductions
    for k, (events, grads) in zip(ks, runs, strict=True):
        issued = [e[2] for e in events if e[0] == "issue"]
        assert [e[1] for e in events if e[0] == "wait"] == issued  # each waited for once, in launch order
        in_flight, most = set(), 0
        for e in events:
            if e[0] == "issue":
                in_flight.add(e[2])
                most = max(most, len(in_flight))
            else:
                in_flight.remove(e[1])
        assert most == k, events
        # The oldest is waited for only when one more would launch: K issues before the first wait.
        assert [e[0] for e in events[:k + 1]] == ["issue"] * k + ["wait"], events
        assert all(torch.equal(g, r) for g, r in zip(grads, runs[0][1], strict=True))


def _collective_order(rank, world, cfg, micro_batches=1):
    """Every collective the backwards of a step's micro-batches issue, and every wait on one:
    ("issue" | "wait", op, group), with ("backward", micro-batch) before each backward."""
    from fivefold.model.transformer import cross_entropy_sum

    events, issue, wait = [], collectives._issue, collectives.Pending.wait

    def logged_issue(op, group, *args, **kwargs):
        events.append(("issue", op, group.name))
        return issue(op, group, *args, **kwargs)

    def logged_wait(self, part=None):
        events.append(("wait", self._op, self._group.name))
        return wait(self, part)

    mesh, derived = config_mesh(cfg, world)
    model = build_model(cfg, 320)
    dp = apply_data_parallel(model, mesh, cfg, derived)
    x = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(rank))
    collectives._issue, collectives.Pending.wait = logged_issue, logged_wait
    try:
        for mb in range(micro_batches):
            events.append(("backward", mb))
            dp.backward(cross_entropy_sum(model(x), x) / x.numel(), last_micro_batch=mb == micro_batches - 1)
    finally:
        collectives._issue, collectives.Pending.wait = issue, wait
    return events, len(dp.buckets)


@pytest.mark.parametrize("zero", [2, 3])
def test_hsdp_all_reduces_each_bucket_while_the_next_one_fills(tmp_path, zero):
    """HSDP 2 x 2: a bucket's rows are all-reduced over the replicas asynchronously, and waited for
    only after the next bucket's reduce-scatter was issued (its gradients were computed meanwhile);
    the last one at the end of the backward. Synchronous, each would stall the backward."""
    cfg = tiny_config(tmp_path, f"--parallel.zero={zero}", "--parallel.dp_replicate=2", "--parallel.bucket_mb=0.1")
    events, n_buckets = run_workers(_collective_order, 4, cfg)[0]
    scatters = [i for i, e in enumerate(events) if e == ("issue", "reduce_scatter", "dp_shard")]
    replicas = [i for i, e in enumerate(events) if e == ("issue", "all_reduce", "dp_replicate")]
    waits = [i for i, e in enumerate(events) if e == ("wait", "all_reduce", "dp_replicate")]
    assert n_buckets >= 4 and len(scatters) == len(replicas) == len(waits) == n_buckets
    for k in range(n_buckets):
        assert scatters[k] < replicas[k] < waits[k]  # the bucket's own rows, reduced first
        if k + 1 < n_buckets:
            assert scatters[k + 1] < waits[k] < replicas[k + 1]  # in flight while bucket k + 1 filled


@pytest.mark.parametrize("zero", [2, 3])
def test_hsdp_all_reduces_the_replicas_once_a_step(tmp_path, zero):
    """ZeRO-2 and resharding ZeRO-3 reduce-scatter on every micro-batch; the replicas' all-reduce
    runs at the last one only, on the step's sum (the equivalence of its values is
    test_data_parallel's hsdp cases with accumulation): the slow link carries the shard once."""
    cfg = tiny_config(tmp_path, f"--parallel.zero={zero}", "--parallel.dp_replicate=2", "--parallel.bucket_mb=0.1")
    events, n_buckets = run_workers(_collective_order, 4, cfg, 3)[0]
    last = events.index(("backward", 2))
    scatters = [i for i, e in enumerate(events) if e == ("issue", "reduce_scatter", "dp_shard")]
    replicas = [i for i, e in enumerate(events) if e == ("issue", "all_reduce", "dp_replicate")]
    assert len(scatters) == 3 * n_buckets and len(replicas) == n_buckets
    assert min(replicas) > last  # none before the last micro-batch's backward


def _torch_oracle(rank, world, cfg, kind):
    """The same training through torch's DistributedDataParallel or FSDP2 (`fully_shard`)."""
    import contextlib

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from fivefold.data.batches import rank_slice
    from fivefold.model.transformer import cross_entropy_sum
    from fivefold.parallel.optimizer import build_optimizer, set_lr
    from fivefold.train.loop import build_datasets
    from fivefold.train.lr_schedule import lr_at

    t = cfg.train
    model = build_model(cfg, 320)
    if kind == "ddp":
        wrapped = DistributedDataParallel(model)
    else:
        for block in model.layers.values():
            fully_shard(block)
        wrapped = fully_shard(model)
    opt = build_optimizer(wrapped, cfg.optim)
    train_set, _, loader = build_datasets(cfg, __import__("pathlib").Path(cfg.run.out_dir))
    losses = []
    for step in range(t.steps):
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        batch = rank_slice(train_set, loader.next_indices(), t.global_batch, world, rank, t.micro_batch)
        total = torch.zeros((), dtype=torch.float64)
        for i, (x, y) in enumerate(batch.micro_batches):
            last = i == len(batch.micro_batches) - 1
            with wrapped.no_sync() if kind == "ddp" and not last else contextlib.nullcontext():
                # fivefold leaves the padding ids (257..319) out of the softmax; the oracle does too.
                loss = cross_entropy_sum(wrapped(x)[..., :257], y) / batch.global_tokens
                loss.backward()
            total += loss.detach().double()
        for p in model.parameters():  # both average over ranks; our loss is already divided by the global count
            p.grad.mul_(world)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        losses.append(float(total))
    return losses


@pytest.mark.parametrize("zero", [0, 2])
def test_bf16_reduction_halves_the_bytes(tmp_path, zero):
    n = 2
    cfg = tiny_config(tmp_path, *STEPS, "--parallel.reduce_dtype=bf16", f"--parallel.zero={zero}",
                      "--train.micro_batch=4")
    run_workers(_train, n, cfg)
    P = count_parameters(build_model(cfg, 320))
    G_bf16 = 2 * P  # gradients travel as bf16; parameters (ZeRO's all-gather) stay fp32
    expected = (2 * (n - 1) / n * G_bf16 if zero == 0
                else (n - 1) / n * (G_bf16 + 4 * P) + collectives.wire_bytes("all_reduce", 8, n))
    for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl"):
        assert record["comm"]["dp"]["wire_bytes"] == expected


def test_ring_all_reduce_traffic_is_the_ring_bound(tmp_path):
    n = 4
    cfg = tiny_config(tmp_path, *STEPS, "--parallel.dp_collective=ring", "--train.micro_batch=2")
    run_workers(_train, n, cfg)
    G = count_parameters(build_model(cfg, 320)) * 4  # divisible by 4: no padding
    for record in read_metrics(tmp_path / "tiny" / "metrics.jsonl"):
        dp = record["comm"]["dp"]
        # Measured: what this rank sent, step by step; theory: 2 (N-1)/N x G (Patarasuk & Yuan 2009).
        assert dp["bytes"] == dp["wire_bytes"] == 2 * (n - 1) / n * G
        assert dp["calls"] == 2 * (n - 1)  # one bucket: 2 (N-1) ring steps


@pytest.mark.parametrize("kind,zero", [("ddp", 0), ("fsdp2", 3)])
def test_torch_as_oracle(tmp_path, kind, zero):
    # No clipping: the oracle would need torch's clipping of DTensor gradients, which is not the point.
    args = (*STEPS, "--train.steps=4", "--train.micro_batch=2", "--optim.grad_clip=0")
    ours, _ = run_workers(_train, 2, tiny_config(tmp_path / "ours", *args, f"--parallel.zero={zero}"))[0]
    theirs = run_workers(_torch_oracle, 2, tiny_config(tmp_path / "torch", *args), kind)[0]
    # The same sums in another order (and DDP's average rescaled): 1e-6 relative was measured.
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-5, atol=0)


@pytest.mark.parametrize("zero", [3])  # ZeRO-1/2 (same shards) go across layouts in test_reshard.py
def test_zero_resume_is_exact(tmp_path, zero):
    args = ("--data.max_bytes=1100", "--data.val_fraction=0.0", "--train.steps=4", "--checkpoint.every=2",
            f"--parallel.zero={zero}", "--train.micro_batch=2")
    losses, _ = run_workers(_train, 2, tiny_config(tmp_path, *args))[0]
    import shutil

    shutil.rmtree(complete_checkpoints(tmp_path / "tiny")[-1])
    resumed, _ = run_workers(_train, 2, tiny_config(tmp_path, *args, "--checkpoint.resume=true"))[0]
    assert resumed == losses[2:]  # master weights and moments came back bit for bit


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_memory_per_rank(tmp_path, zero):
    """Bytes per rank for parameters, gradients and optimizer state, sampled between micro-batches
    (the transient inside backward, a bucket or two gathered units, is not in these samples)."""
    n = 2  # global batch 8 = 2 ranks x 2 micro-batches of 2: ZeRO-1 keeps full gradients between them
    cfg = tiny_config(tmp_path, *STEPS, f"--parallel.zero={zero}", "--train.micro_batch=2")
    run_workers(_train, n, cfg)
    P = count_parameters(build_model(cfg, 320))
    # fp32 on CPU: the parameters are the master weights for DDP; ZeRO keeps fp32 masters beside them.
    expected = {
        0: {"params": 4 * P, "grads": 4 * P, "optimizer": 8 * P},
        1: {"params": 4 * P, "grads": 4 * P, "optimizer": 12 * P / n},  # full gradients kept over micro-batches
        2: {"params": 4 * P, "grads": 4 * P / n, "optimizer": 12 * P / n},
        3: {"params": 0, "grads": 4 * P / n, "optimizer": 12 * P / n},
    }[zero]
    measured = read_metrics(tmp_path / "tiny" / "metrics.jsonl")[1]["model_state_bytes"]  # step 2: Adam state exists
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=0.05, abs=1024), (key, measured)


def _gathered_units(rank, world, cfg, keep):
    from fivefold.model.transformer import cross_entropy_sum
    from fivefold.parallel.optimizer import build_optimizer
    from fivefold.parallel.state_memory import model_state_bytes

    model = build_model(cfg, 320)
    mesh, derived = config_mesh(cfg, world)
    dp = apply_data_parallel(model, mesh, cfg, derived)
    opt = build_optimizer(dp.optimizer_params(), cfg.optim)
    x = torch.randint(0, 320, (2, 32))
    assert model_state_bytes(dp.params, opt)["params"] == 0  # nothing gathered between steps
    for _ in range(2):
        dp.backward(cross_entropy_sum(model(x), x) / x.numel(), last_micro_batch=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dp.after_step()
    return dp.max_gathered, len(dp.units)


@pytest.mark.parametrize("keep", [False, True])
def test_zero3_holds_at_most_two_gathered_units(tmp_path, keep):
    cfg = tiny_config(tmp_path, "--parallel.zero=3", f"--parallel.reshard_after_forward={str(keep is False).lower()}")
    most, units = run_workers(_gathered_units, 2, cfg, keep)[0]
    assert units == 10  # embedding, 8 blocks, head
    # Resharding after forward: the running unit plus one prefetched. Keeping them: all of forward's.
    assert most == (units if keep else 2)


def _unused_on_one_rank(rank, world, cfg):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mesh, derived = config_mesh(cfg, world)
    dp = apply_data_parallel(model, mesh, cfg, derived)
    x = torch.full((2, 4), float(rank + 1))
    # Rank 1 skips the last layer, whose parameters form the first bucket in backward order: rank 0
    # starts that bucket during backward, rank 1 only at its end, with zeros. Same order, no hang.
    out = model(x) if rank == 0 else model[1](model[0](x))
    dp.backward(out.sum(), last_micro_batch=True)
    return [g.clone() for g in dp.gradients()]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_parameter_without_gradient_on_one_rank(tmp_path, zero):
    cfg = tiny_config(tmp_path, f"--parallel.zero={zero}", "--parallel.bucket_mb=0.00001")  # a bucket per tensor
    grads = run_workers(_unused_on_one_rank, 2, cfg)

    def local(rank):  # what each rank's own backward gives, summed by hand
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        x = torch.full((2, 4), float(rank + 1))
        (model(x) if rank == 0 else model[1](model[0](x))).sum().backward()
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]

    expected = [a + b for a, b in zip(local(0), local(1), strict=True)]
    assert expected[-1].abs().sum() > 0  # the last layer did get gradient on rank 0
    for rank, rank_grads in enumerate(grads):
        # ZeRO: rank r holds rows [2r, 2r + 2) of each parameter, in bucket (reverse) order.
        want = [e.chunk(2)[rank] for e in reversed(expected)] if zero else expected
        assert len(rank_grads) == len(want)
        for g, e in zip(rank_grads, want, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
