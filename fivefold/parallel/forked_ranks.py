"""Run one function on N gloo ranks inside a test: forked workers, a store on port 0, real tracebacks.

Forked workers start in milliseconds where spawned ones cost seconds each (docs/torch-cpu-notes.md),
which is what lets the suite run dozens of multi-process cases. Three details make fork safe:
- each child calls torch.set_num_threads(1) before touching torch, or it can hang on the thread
  pool inherited from the parent (and freezes the objects it inherited, which its garbage
  collections would otherwise walk: a test's whole pytest process);
- the parent forks every worker first and only then opens the TCPStore on port 0 (a store's
  server thread alive during fork can leave a child holding a copy of a lock that is never
  released), and hands the chosen port to the children: no race for a "free" port either;
- a child's exception travels back as text and is re-raised in the parent with the rank named,
  and a child that dies or hangs fails the test instead of hanging it.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any, Callable

import torch
import torch.distributed as dist


class WorkerError(RuntimeError):
    pass


def _child(fn: Callable[..., Any], rank: int, world_size: int, conn: Any, args: tuple) -> None:
    # Everything inherited from the parent (pytest's objects, every imported module) is the parent's
    # to collect: frozen, the worker's collections (train/gc_policy.py) walk only what it made.
    gc.freeze()
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        port = conn.recv()  # the store exists only after every worker was forked
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        # The harness's own barrier, outside the collective layer: no mesh exists here (fn's is gone),
        # and a rank that never comes is the harness's to name (its deadline), not a collective's.
        dist.barrier()
        dist.destroy_process_group()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything, including SystemExit, goes back to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()
        os._exit(0)  # skip atexit handlers inherited from pytest


def run_workers(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Call fn(rank, world_size, *args) on `world_size` forked gloo ranks; return their results.

    Fork copies the parent, so fn may be a closure; its results must be picklable. The first
    failure fails the call within seconds: the other ranks are killed rather than awaited.
    """
    ctx = mp.get_context("fork")
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        p = ctx.Process(target=_child, args=(fn, rank, world_size, child_conn, args), daemon=True)
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    # Open the store only now: its server thread (which takes locks, e.g. in name resolution) must
    # not exist while we fork, or a child can inherit a lock held forever.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
    for conn in conns:
        conn.send(store.port)
    results: list[Any] = [None] * world_size
    errors: list[str] = []
    pending = dict(zip(conns, range(world_size), strict=True))
    deadline = time.monotonic() + timeout
    grace: float | None = None  # after a failure: when the others are killed rather than awaited
    try:
        while pending:
            ends = min(deadline, grace) if grace is not None else deadline
            ready = mp_connection.wait(list(pending), timeout=max(0.0, ends - time.monotonic()))
            if not ready:  # (which of the two ended the wait is said: a test asserts it)
                why = ("killed 2 s after the failure above (likely waiting for it in a collective)"
                       if grace is not None and grace < deadline else f"no result within {timeout:.0f} s (hung or "
                       "deadlocked)")
                errors += [f"rank {r}: {why}" for r in pending.values()]
                break
            for conn in ready:
                rank = pending.pop(conn)
                try:
                    status, payload = conn.recv()
                except EOFError:
                    errors.append(f"rank {rank}: died without a result (exit code {procs[rank].exitcode})")
                    continue
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors.append(f"rank {rank} raised:\n{payload}")
            if errors and grace is None:  # the other ranks are likely stuck in a collective with the failed one
                grace = time.monotonic() + 2.0
    finally:
        for p in procs:
            p.join(timeout=0.5)
            if p.is_alive():
                p.kill()
                p.join()
        del store  # stops its server thread before the next call forks again
    if errors:
        raise WorkerError("\n".join(errors))
    return results
