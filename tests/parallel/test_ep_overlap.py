"""parallel.ep_overlap: DualPipe's F&B pairs run at once on two lanes (pipeline/overlap.py), against
the same schedule run one action after the other."""

import pytest
import torch
from helpers import EQUIVALENCE, MOE_ARGS, tiny_config, train_and_gather

from fivefold.parallel.comm.timing import PARTS, _overlapped, _Span
from fivefold.parallel.forked_ranks import run_workers
from fivefold.parallel.pipeline.overlap import paired_plans
from fivefold.parallel.pipeline.schedules import dualpipe_v
from fivefold.parallel.pipeline.simulate import overlapped_pairs


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_paired_plans_match_and_complete(p):
    """Every pair of every rank posts nothing between its halves, and check_plans proves the moved
    plan (its strict model raises DeadlockError where a pair would wait on its own output). No pair
    holds a chunk's first forward or last backward, where data parallel gathers and reduces
    (pipeline/overlap.py): its collectives never run on the side lane."""
    for m in range(2 * p, 2 * p + 4):
        schedule = dualpipe_v(p, m)
        pairs, plans = paired_plans(schedule)
        assert pairs == overlapped_pairs(schedule) and all(pairs)
        for r, ks in enumerate(pairs):
            seq = schedule.actions[r]
            first = {a.stage: i for i, a in reversed(list(enumerate(seq))) if a.kind == "F"}
            last = {a.stage: i for i, a in enumerate(seq) if a.kind in ("B", "W")}
            for k in ks:
                assert not plans[r][k + 1].sends and not plans[r][k + 1].recvs
                assert seq[k].stage != seq[k + 1].stage
                assert first[seq[k].stage] != k and last[seq[k + 1].stage] != k + 1


def test_overlapped_lanes_are_charged_as_the_rank_spent_them():
    """A hand-made pair: the step thread computes [0, 10] with an ep wait [2, 6] inside, then waits
    for the side lane [10, 14]; the side lane computes [0, 14] with ep waits [4, 8] and [11, 13].
    The step thread's wait is hidden where the side lane computes ([2, 4]), exposed where both wait
    ([4, 6]); its wait for the side lane is exposed ep for [11, 13], compute for the rest."""
    spans, at = [], {}

    def span(part, lane, start, end, parent=None):
        s = _Span(None, part, "t", part, [], parent, lane)
        spans.append(s)
        at[id(s)] = (start, end)
        return s

    main = span("compute", "main", 0, 10)
    span("exposed_ep", "main", 2, 6, main)
    span("compute", "wait", 10, 14)
    side = span("compute", "side", 0, 14)
    span("exposed_ep", "side", 4, 8, side)
    span("exposed_ep", "side", 11, 13, side)
    parts = dict.fromkeys(PARTS, 0.0)
    parts.update(compute=6.0 + 4.0, exposed_ep=4.0)  # the step thread's exclusive times, as end_step sums them
    _overlapped(spans, at, parts)
    assert parts["exposed_ep"] == 2.0 + 2.0 and parts["compute"] == 10.0
    assert sum(parts.values()) == 14.0  # the step thread's wall time, still


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_ep_overlap_trains_bit_for_bit_as_the_schedule_run_in_order(tmp_path, dtype):
    """pp2 x ep2 with ZeRO-1 under dualpipe_v, 3 steps: the losses, gradient norms and every parameter
    the same numbers with and without the pairs, every axis's calls and bytes equal, and the executed
    timeline shows each rank's pairs as one action, "F<mb>s<stage>&B<mb>s<stage>". In bf16 autocast
    too: the pair's second thread computes under the autocast the step runs (autocast's state is
    per thread)."""
    from fivefold.train.metrics import read_metrics

    args = (*EQUIVALENCE, *MOE_ARGS, "--train.steps=3", "--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1",
            "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2", "--train.micro_batch=1",
            f"--train.dtype={dtype}")
    results, records = {}, {}
    for on in ("false", "true"):
        results[on] = run_workers(train_and_gather, 4, tiny_config(tmp_path / on, *args, f"--parallel.ep_overlap={on}"))
        records[on] = read_metrics(tmp_path / on / "tiny" / "metrics.jsonl")
    for ref, ours in zip(results["false"], results["true"], strict=True):
        assert ours[:2] == ref[:2]
        assert ours[2].keys() == ref[2].keys()
        for key, value in ref[2].items():
            assert torch.equal(ours[2][key], value), key
    assert [r["comm"] for r in records["true"]] == [r["comm"] for r in records["false"]]
    schedule = dualpipe_v(2, 4)  # 4 micro-batches: tiny.toml's batch over dp 2 at micro_batch 1
    timeline = records["true"][-1]["pipeline_timeline"]
    for r, row in enumerate(timeline):
        expected = [f"{a}&{schedule.actions[r][k + 1]}" if k in overlapped_pairs(schedule)[r] else str(a)
                    for k, a in enumerate(schedule.actions[r]) if k - 1 not in overlapped_pairs(schedule)[r]]
        assert [name for _, _, name in row] == expected


def test_the_report_draws_a_pair_as_one_overlapped_action():
    """The run report's executed timeline names a pair's kind in its legend (viz/report_plots.py)."""
    import base64

    from fivefold.viz.report_plots import timeline_figure

    url = timeline_figure([[[0.0, 0.001, "F0s0"], [0.001, 0.003, "F1s0&B0s3"]]])
    svg = base64.b64decode(url.split(",", 1)[1]).decode()
    assert "a forward and a backward overlapped" in svg and "backward (input grad)" not in svg


# ---- NCCL's rules for two lanes: twins made at setup, one launch order, streams recorded ----------
# NCCL's guide (Using multiple NCCL communicators concurrently): the ranks must launch the collectives
# of their communicators in one order, or the kernels of two communicators can wait for each other.

LANE_ARGS = (*EQUIVALENCE, *MOE_ARGS, "--train.steps=1", "--parallel.pp=2", "--parallel.ep=2", "--parallel.zero=1",
             "--parallel.pp_schedule=dualpipe_v", "--parallel.virtual_stages=2", "--train.micro_batch=1",
             "--parallel.ep_overlap=true")


def _record_one_step(rank: int, world: int, cfg):
    """Worker: one training step of LANE_ARGS with every all_reduce and all_to_all recorded as (lane, op,
    process group), between marks where each pair and the step begin and end; the side lane's twin
    groups by their ranks; and every `record_stream`, with a stand-in stream per chunk (CPU has none;
    the switch of the current stream is skipped). Perturbed: inside a pair, ep rank 0's side lane and
    ep rank 1's main lane sleep 20 ms before each launch, so that left to race, the two ranks' lanes
    would launch in opposite orders (they did before the turns: main first on one, side on the other)."""
    import contextlib
    import threading
    import time

    import torch.distributed as dist

    from fivefold.parallel import mesh as mesh_module
    from fivefold.parallel.pipeline import executor, overlap
    from fivefold.train.loop import train

    calls, lock, in_pair, twins, recorded, received = [], threading.Lock(), [False], {}, [], []
    slow = "side" if dist.get_rank() % 2 == 0 else "main"  # ep rank = world rank % 2 in this layout

    def lane() -> str:
        return "side" if threading.current_thread().name.startswith("fivefold-side-lane") else "main"

    def recording(op, fn):
        def call(*args, **kwargs):
            if in_pair[0] and lane() == slow:
                time.sleep(0.02)
            with lock:
                calls.append((lane(), op, kwargs["group"].group_name if kwargs.get("group") else "world"))
            return fn(*args, **kwargs)
        return call

    def marking(mark, fn):
        def call(*args, **kwargs):
            with lock:
                calls.append(("mark", mark, ""))
            in_pair[0] = mark == "pair"
            try:
                return fn(*args, **kwargs)
            finally:
                in_pair[0] = False
                with lock:
                    calls.append(("mark", "end", ""))
        return call

    def side_lane(self):
        twins["timeout_s"] = self.timeout_s  # what the twins' first collectives wait for their peers
        add_side_lane(self)
        for g in self._groups.values():
            if g.side is not None:
                twins[g.side.pg.group_name] = tuple(dist.get_process_group_ranks(g.side.pg))

    def record_stream(t, stream):
        recorded.append((t, stream))

    def receive(self, step, action):
        t = receive_of(self, step, action)
        received.append((t, self.streams[action.stage]))
        return t

    add_side_lane, receive_of = mesh_module.Mesh.add_side_lane, executor.PipelineExecutor._receive
    dist.all_reduce, dist.all_to_all_single = recording("all_reduce", dist.all_reduce), \
        recording("all_to_all", dist.all_to_all_single)
    executor.run_pair = marking("pair", executor.run_pair)
    executor.PipelineExecutor.run = marking("step", executor.PipelineExecutor.run)
    mesh_module.Mesh.add_side_lane, executor.PipelineExecutor._receive = side_lane, receive
    executor.chunk_streams = lambda device, stages: {s: f"stream of chunk {s}" for s in stages}
    overlap._OnStream = lambda stream: contextlib.nullcontext()
    torch.Tensor.record_stream = record_stream
    train(cfg, progress=False)
    unrecorded = [stream for t, stream in received
                  if t is not None and not any(r is t and s == stream for r, s in recorded)]
    return calls, twins, sum(t is not None for t, _ in received), unrecorded


@pytest.fixture(scope="module")
def one_step_records(tmp_path_factory):
    """Each rank's (calls, twins, received tensors, those not recorded on their action's stream)."""
    return run_workers(_record_one_step, 4, tiny_config(tmp_path_factory.mktemp("lanes"), *LANE_ARGS))


def _pairs(calls) -> list[list[tuple[str, str, str]]]:
    """The launches inside each pair, in the order the rank made them."""
    pairs, inside = [], False
    for call in calls:
        if call[0] == "mark":
            inside = call[1] == "pair"
            pairs += [[]] if inside else []
        elif inside:
            pairs[-1].append(call)
    return pairs


def _alternated(launches):
    """One launch of each lane in turn, the main lane's (the pair's B) first (comm/lanes.py)."""
    queues = {lane: [c for c in launches if c[0] == lane] for lane in ("main", "side")}
    order = []
    while queues["main"] or queues["side"]:
        for lane in ("main", "side"):
            if queues[lane]:
                order.append(queues[lane].pop(0))
    return order


def test_twin_groups_are_made_and_warmed_before_the_first_step(one_step_records):
    """Every twin group has its first collective (NCCL makes its communicator there) before the first
    step, in one order on every rank (sorted by the group's ranks), and not inside the first pair;
    under the first step's timeout, as the other groups' first collectives."""
    for calls, twins, _, _ in one_step_records:
        timeout_s, twins = twins["timeout_s"], {name: ranks for name, ranks in twins.items() if name != "timeout_s"}
        first_step = calls.index(("mark", "step", ""))
        warmed = [group for _, _, group in calls[:first_step] if group in twins]
        assert warmed == sorted(twins, key=twins.get), (warmed, twins)
        assert timeout_s == 1800.0  # parallel.first_step_timeout_s: they make NCCL's communicators


def test_the_lanes_launch_in_one_fixed_order_on_every_rank(one_step_records):
    """Inside every pair the two lanes launch their collectives in turns, the B's lane first, on every
    rank, whichever lane the perturbation slows: the same (lane, op, group) sequence on both ranks of
    each ep group."""
    pairs = [_pairs(calls) for calls, *_ in one_step_records]
    for mine in pairs:
        assert mine and all({lane for lane, _, _ in launches} == {"side", "main"} for launches in mine)
        for launches in mine:
            assert launches == _alternated(launches)
    assert pairs[0] == pairs[1] and pairs[2] == pairs[3]  # ep groups {0, 1} and {2, 3}


def test_every_tensor_an_action_takes_is_recorded_on_its_stream(one_step_records):
    """A received activation or gradient (made on the step's stream, or another chunk's) read on a
    chunk's own stream is recorded there, so the caching allocator does not hand its memory to the
    stream it was made on while the chunk's kernels may still read it."""
    for _, _, received, unrecorded in one_step_records:
        assert received > 0 and unrecorded == []


@pytest.mark.parametrize("launches", [(2, 4), (3, 1), (0, 2)])
def test_turns_alternate_the_lanes_then_let_the_one_left_go_on(launches):
    """comm/lanes.py's Turns, alone: the main lane's first launch, then one of each in turn, then the
    lane still launching alone; each lane sleeping a different time before each launch (main slower
    on its first, side slower after) changes nothing."""
    import threading
    import time

    from fivefold.parallel.comm.lanes import MAIN, SIDE, Turns

    turns, order = Turns((MAIN, SIDE)), []

    def lane(name: str, n: int, pauses: list[float]) -> None:
        for i in range(n):
            time.sleep(pauses[i])
            with turns.turn(name):
                order.append((name, i))
        turns.finish(name)

    n_main, n_side = launches
    side = threading.Thread(target=lane, args=(SIDE, n_side, [0.0] + [0.002] * n_side))
    side.start()
    lane(MAIN, n_main, [0.01] + [0.0] * n_main)
    side.join()
    both = min(n_main, n_side)
    expected = [(name, i) for i in range(both) for name in (MAIN, SIDE)]
    expected += [(MAIN, i) for i in range(both, n_main)] + [(SIDE, i) for i in range(both, n_side)]
    assert order == expected
