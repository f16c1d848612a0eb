"""Start this node's workers through torch's elastic agent (what torchrun runs), alone or as one
node of several, with a c10d rendezvous.

    fivefold train CONFIG --nproc 8                                          # this machine only
    fivefold train CONFIG --nproc 8 --nnodes 4 --node-rank R --rdzv-endpoint node0:29500  # each node
    fivefold train CONFIG --nproc 8 --nnodes 2:4 --node-rank R --rdzv-endpoint node0:29500  # elastic

Node 0 hosts the rendezvous at --rdzv-endpoint and every node names the same endpoint. Global ranks
are handed out by the rendezvous (nodes sorted by address), not by --node-rank.

Where this differs from torchrun's c10d rendezvous, and why:
- node 0 binds the rendezvous port here, before anything starts: a port in use fails at once,
  naming the address (torch would fall back to being a client of whatever listens there);
- on a loopback endpoint (every local run) the rendezvous and the workers' store listen on that
  address only; torch's TCPStore listens on every interface whatever host it is given;
- the workers' store is new in every rendezvous round: torch keeps one for the whole job, and a
  restarted group reads the dead workers' addresses from it and cannot connect (pytorch#135712);
- a rendezvous that times out says which nodes arrived, and a node that cannot reach node 0 says so.

Elastic (--nnodes MIN:MAX, torch's min_nodes / max_nodes): a round completes with MAX nodes at once,
or with at least MIN once --rdzv-last-call seconds have passed since MIN arrived. A node silent for
3 of its --rdzv-keep-alive heartbeats is taken for lost (torch's keep_alive_max_attempt). Losing a
node fails the survivors' workers, so it spends one of --max-restarts (default MAX - MIN in an
elastic job); a node that joins makes the running nodes restart without spending one (torch's rule
for membership changes). The layout for each round's world: launch/elastic.py.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from fivefold.launch.worker_report import WORKER_DIR, culprit_summary, one_line_failures

LOCAL_ENDPOINT = "127.0.0.1:0"  # one machine: loopback, a port the OS picks
BACKEND = "fivefold-c10d"  # our rendezvous handler's name in torch's registry
ARRIVED = "fivefold.arrived."  # + node rank: a node reached the rendezvous (store key)
LOST_AFTER = 3  # missed heartbeats after which a node is taken for lost (torch's keep_alive_max_attempt, its default)


class LaunchError(RuntimeError):
    """The job could not start; the message names the address and what to change."""


class RendezvousLost(LaunchError):
    """Node 0's rendezvous store went away: its launcher or machine is gone, or it ended the job
    (its workers finished first and it closed the store while this node's agent was polling)."""


@dataclass(frozen=True)
class LaunchSpec:
    nproc: int  # workers on this node
    nnodes: int = 1
    node_rank: int = 0
    endpoint: str = LOCAL_ENDPOINT  # HOST:PORT of the rendezvous, hosted by node 0
    rdzv_timeout_s: int = 300  # how long nodes wait for each other
    max_restarts: int = 0
    min_nodes: int = 0  # elastic: fewest nodes a round may start with (0: nnodes, not elastic)
    last_call_s: float = 30.0  # elastic: wait after min_nodes arrived for more (torch's default)
    keep_alive_s: float = 5.0  # seconds between a node's rendezvous heartbeats (torch's default)

    @property
    def world_size(self) -> int:
        """Ranks of the job at its full size (--nnodes MAX): what the config is written for."""
        return self.nproc * self.nnodes

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nnodes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nnodes", default="1", metavar="N|MIN:MAX",
                   help="nodes in the job (each runs --nproc workers); MIN:MAX: elastic, it goes on with MIN to MAX")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index; node 0 hosts the rendezvous")
    p.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                   help="node 0's address and a free port, the same on every node (default: loopback, one node)")
    p.add_argument("--rdzv-timeout", type=int, default=300, metavar="SECONDS",
                   help="how long a node waits for the others to join before giving up (default 300)")
    p.add_argument("--rdzv-last-call", type=float, default=30.0, metavar="SECONDS",
                   help="elastic: once MIN nodes are in, how long to wait for more before starting (default 30)")
    p.add_argument("--rdzv-keep-alive", type=float, default=5.0, metavar="SECONDS",
                   help="seconds between a node's heartbeats; 3 missed: the node is lost (default 5)")


def node_range(text: str) -> tuple[int, int]:
    """'4' -> (4, 4); '2:4' -> (2, 4); ValueError naming --nnodes."""
    low, sep, high = text.partition(":")
    try:
        pair = (int(low), int(high) if sep else int(low))
    except ValueError:
        raise ValueError(f"--nnodes = '{text}': expected N or MIN:MAX (e.g. 4, or 2:4 for an elastic job)") from None
    if pair[0] < 1 or pair[1] < pair[0]:
        raise ValueError(f"--nnodes = '{text}': need 1 <= MIN <= MAX (e.g. 2:4)")
    return pair


def spec_from_args(args: argparse.Namespace, nproc: int, under_torchrun: bool) -> tuple[LaunchSpec, list[str]]:
    """The launch asked for on the command line, and every problem with it."""
    errors = []
    try:
        min_nodes, nnodes = node_range(str(args.nnodes))
    except ValueError as e:
        errors.append(str(e))
        min_nodes = nnodes = 1
    restarts = args.max_restarts if args.max_restarts is not None else nnodes - min_nodes
    given = [f for f, v in (("--nnodes", nnodes != 1), ("--node-rank", args.node_rank is not None),
                            ("--rdzv-endpoint", args.rdzv_endpoint is not None)) if v]
    if under_torchrun and (given or restarts):
        errors.append(f"{', '.join(given + ['--max-restarts'] * bool(restarts))}: under torchrun use "
                      f"torchrun's own flags (--nnodes, --node-rank, --rdzv-endpoint, --max-restarts)")
    if nnodes > 1 and (args.node_rank is None or args.rdzv_endpoint is None):
        errors.append(f"--nnodes = {args.nnodes} needs --node-rank (0..{nnodes - 1}) and --rdzv-endpoint "
                      f"HOST:PORT (node 0's address and a free port), the same endpoint on every node")
    node_rank = args.node_rank or 0
    if not 0 <= node_rank < nnodes:
        errors.append(f"--node-rank = {node_rank}: must be within 0..{nnodes - 1} (--nnodes = {args.nnodes})")
    endpoint = args.rdzv_endpoint or LOCAL_ENDPOINT
    try:
        if split_endpoint(endpoint)[1] == 0 and nnodes > 1:
            errors.append(f"--rdzv-endpoint = '{endpoint}': port 0 lets the OS pick one the other nodes cannot "
                          f"know; give a fixed free port, e.g. 29500")
    except ValueError as e:
        errors.append(str(e))
    if restarts < 0:
        errors.append(f"--max-restarts = {restarts}: must be 0 or more")
    errors += rendezvous_errors(args.rdzv_timeout, args.rdzv_last_call, args.rdzv_keep_alive, min_nodes < nnodes)
    spec = LaunchSpec(nproc=nproc, nnodes=nnodes, node_rank=node_rank, endpoint=endpoint,
                      rdzv_timeout_s=args.rdzv_timeout, max_restarts=restarts,
                      min_nodes=min_nodes if min_nodes < nnodes else 0, last_call_s=args.rdzv_last_call,
                      keep_alive_s=args.rdzv_keep_alive)
    return spec, errors


def rendezvous_errors(timeout_s: int, last_call_s: float, keep_alive_s: float, elastic: bool) -> list[str]:
    """The rendezvous timings, and an elastic job's together: a round that lost a node waits LOST_AFTER
    keep-alives to take it for lost, then its last call, in at most two thirds of --rdzv-timeout (the last
    third is for the surviving nodes, whose workers fail and restart at their own pace, to come back:
    --rdzv-timeout 30 with --rdzv-last-call 5 and the default keep-alive shrinks and finishes)."""
    errors = [] if timeout_s >= 1 else [f"--rdzv-timeout = {timeout_s}: must be at least 1 second"]
    for flag, value in (("--rdzv-last-call", last_call_s), ("--rdzv-keep-alive", keep_alive_s)):
        if not 0 < value < math.inf:
            errors.append(f"{flag} = {value}: must be a finite number of seconds above 0")
    wait, most = last_call_s + LOST_AFTER * keep_alive_s, timeout_s * 2 / 3 - LOST_AFTER * keep_alive_s
    if errors or not elastic or wait <= timeout_s * 2 / 3:
        return errors
    fixes = [f"--rdzv-last-call <= {most:g}"] * (most > 0) + [f"--rdzv-timeout >= {math.ceil(1.5 * wait)}"]
    return [f"--rdzv-last-call {last_call_s:g} + {LOST_AFTER} x --rdzv-keep-alive {keep_alive_s:g} = {wait:g} s "
            f"does not fit in --rdzv-timeout {timeout_s}: a round that lost a node waits that long before it forms "
            f"(the missed heartbeats, then the last call) and must form within the timeout, with half as long again "
            f"to spare; use {' or '.join(fixes)}"]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:29500' or '[::1]:29500' -> (host, port)."""
    host, sep, port = endpoint.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--rdzv-endpoint = '{endpoint}': expected HOST:PORT with a port in 0..65535, "
                         f"e.g. node0:29500 or 127.0.0.1:29500")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Written as a loopback address. A name is not resolved: /etc/hosts often maps the machine's
    own name to 127.0.1.1 while other nodes reach it by its real address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """A listening socket for a store: on host itself when it is a loopback address, else on every
    interface (as torch does: other nodes may reach this one by any of its addresses)."""
    if is_loopback(host):
        addr = "127.0.0.1" if host == "localhost" else host
        return socket.create_server((addr, port), family=socket.AF_INET6 if ":" in addr else socket.AF_INET)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("::", port), family=socket.AF_INET6, dualstack_ipv6=True)
    return socket.create_server(("", port))


def bind_rendezvous(endpoint: str) -> socket.socket:
    """Node 0's rendezvous socket, or a LaunchError naming the address."""
    host, port = split_endpoint(endpoint)
    try:
        return listen(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise LaunchError(f"rendezvous endpoint {endpoint}: the port is already in use (another job, or a "
                              f"previous run still exiting); pick a free port with --rdzv-endpoint "
                              f"{host}:PORT, the same on every node") from None
        raise LaunchError(f"rendezvous endpoint {endpoint}: cannot listen there ({e.strerror}); node 0 must run "
                          f"on the endpoint's host, or give --rdzv-endpoint an address of this machine") from None


def check_writable(run_dir: Path) -> list[str]:
    """The run directory can be created and written: checked before any process starts, writing
    nothing but a temporary file in the nearest existing folder (removed at once)."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        reason = f"'{existing}' is a file, not a folder"
    else:
        try:
            tempfile.TemporaryFile(dir=existing).close()
            return []
        except OSError as e:
            reason = f"cannot write in '{existing}': {e.strerror}"
    return [f"run directory '{run_dir}' is not writable ({reason}); set --run.out_dir to a writable folder"]


def _store_server(host: str, port: int, sock: socket.socket | None = None, **kwargs: Any):
    """A TCPStore server on `sock` (or a new socket from listen()): torch would bind every interface."""
    import torch.distributed as dist

    sock = sock or listen(host, port)
    # The store owns the descriptor from here on (detach: Python must not close it).
    return dist.TCPStore(host, sock.getsockname()[1], is_master=True, master_listen_fd=sock.detach(),
                         wait_for_workers=False, **kwargs)


def _handler_class():
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    class Rendezvous(DynamicRendezvousHandler):
        """torch's dynamic (c10d) rendezvous with a fresh, loopback-aware workers' store per round
        and a timeout that says who is missing."""

        endpoint: str
        nnodes: int
        min_nodes: int
        timeout_s: int

        def next_rendezvous(self):
            # torch keeps the first round's workers' store; a new one per round holds no stale addresses.
            self._shared_tcp_store_server = None
            self._bootstrap_store_info = None
            try:
                return super().next_rendezvous()
            except RendezvousTimeoutError:
                raise RendezvousTimeoutError(self._who_is_missing()) from None

        def get_backend(self) -> str:
            return BACKEND

        def _create_tcp_store_server(self, master_addr: str, master_port: int):
            if not is_loopback(master_addr):
                return super()._create_tcp_store_server(master_addr, master_port)
            return _store_server(master_addr, master_port, multi_tenant=True)

        def _who_is_missing(self) -> str:
            arrived = [r for r in range(self.nnodes) if self._store.check([f"{ARRIVED}{r}"])]
            missing = [r for r in range(self.nnodes) if r not in arrived]
            nodes = f"{self.min_nodes}:{self.nnodes}" if self.min_nodes < self.nnodes else str(self.nnodes)
            if not missing:  # every node came once: a node was lost after the start
                need = f"at least {self.min_nodes}" if self.min_nodes < self.nnodes else f"all {self.nnodes}"
                return (f"rendezvous at {self.endpoint}: a round needs {need} nodes (--nnodes {nodes}) and fewer "
                        f"came back within {self.timeout_s} s (--rdzv-timeout) after a restart: a node was lost "
                        f"(look at its launcher's log). Start it again, the same command with --resume, to continue "
                        f"from the last checkpoint")
            return (f"rendezvous at {self.endpoint}: {len(arrived)} of {self.nnodes} nodes joined within "
                    f"{self.timeout_s} s (--rdzv-timeout); missing node-rank {', '.join(map(str, missing))}. Start "
                    f"`fivefold train` there with --nnodes {nodes} --node-rank R --rdzv-endpoint "
                    f"{self.endpoint}, check that those nodes reach this address, or raise --rdzv-timeout")

    return Rendezvous


def _create_handler(params):
    """torch's registry calls this with LaunchConfig's rendezvous settings (rdzv_configs below)."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousTimeout

    host, port = split_endpoint(params.endpoint)
    node_rank, timeout_s = params.get_as_int("node_rank"), params.get_as_int("join_timeout")
    last_call, keep_alive = float(params.get("last_call")), float(params.get("keep_alive"))
    fd = params.get_as_int("listen_fd", -1)
    timeout = timedelta(seconds=timeout_s)
    if fd >= 0:  # node 0: the socket bound by launch()
        store = _store_server(host, port, socket.socket(fileno=fd), timeout=timeout, multi_tenant=True)
    else:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timeout)
        except (RuntimeError, TimeoutError) as e:
            raise LaunchError(f"no rendezvous at {params.endpoint} within {timeout_s} s (--rdzv-timeout): "
                              f"start node-rank 0 on that host, check this node can reach it (firewall, address), "
                              f"or raise --rdzv-timeout ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    store.set(f"{ARRIVED}{node_rank}", "1")
    handler = _handler_class().from_backend(
        params.run_id, store, C10dRendezvousBackend(store, params.run_id), params.min_nodes, params.max_nodes,
        params.local_addr, RendezvousTimeout(join=timeout, last_call=timedelta(seconds=last_call)),
        keep_alive_max_attempt=LOST_AFTER,
        keep_alive_interval=keep_alive)  # type: ignore[arg-type] - torch takes seconds, a float works
    handler.endpoint, handler.nnodes, handler.timeout_s = params.endpoint, params.max_nodes, timeout_s
    handler.min_nodes = params.min_nodes
    return handler


LAUNCHER_PID = "FIVEFOLD_LAUNCHER_PID"  # the environment variable launch/forkserver_guard.py reads


def die_with_parent() -> None:
    """This process ends when its parent does: on Linux the kernel sends it SIGTERM then (prctl
    PR_SET_PDEATHSIG). A launched worker's parent is the launcher's forkserver, which does the same
    with the launcher (fivefold/launch/forkserver_guard.py), or torchrun's agent; so a SIGKILLed launcher
    leaves no worker behind holding ports and writing its run directory. A parent already gone
    before the call (pid 1 adopted this process) ends it at once."""
    import ctypes
    import signal
    import sys

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    if parent == 1 or os.getppid() != parent:
        raise SystemExit("fivefold: the launcher of this process is gone; stopping")


def _own_reports() -> Path:
    """The workers' report folder (launch/worker_report.py) of this launcher, unless the environment names one."""
    return Path(tempfile.gettempdir()) / f"fivefold-workers-{os.getpid()}"


def start_worker_server(nproc: int) -> None:
    """Start the server process the workers are forked from, if it is not running yet.

    It imports torch and fivefold once, so a restart starts the workers in a fraction of a second
    instead of every worker importing again (seconds each), and it forks from its single thread: no
    lock held by the launcher's store threads is copied. `fivefold train` starts it as soon as the
    config is checked, so its imports run while the launcher prepares the data, imports torch's
    agent and meets the other nodes (1.2 s of a 4.5 s two-step run here), not after them. The
    workers inherit its environment, fixed now: the OpenMP threads, the launcher's pid (the guard
    makes it end with this launcher: a SIGKILL here leaves it otherwise) and the reports folder.
    """
    # Each worker gets an equal share of the cores; oversubscribed OpenMP threads slow everyone down.
    # OpenMP reads it when torch is imported in the server.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[LAUNCHER_PID] = str(os.getpid())
    os.environ.setdefault(WORKER_DIR, str(_own_reports()))  # made by launch(), removed at its end
    multiprocessing.set_forkserver_preload(["fivefold.launch.forkserver_guard", "fivefold.train.loop", "torch._dynamo"])
    from multiprocessing import forkserver  # the server torch's agent forks from (start_method below)

    forkserver.ensure_running()


def launch(spec: LaunchSpec, entrypoint: Callable[..., Any], args: tuple) -> None:
    """Run entrypoint(*args) in spec.nproc local workers, restarting them all up to max_restarts times."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousConnectionError,
        RendezvousError,
        rendezvous_handler_registry,
    )
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    host, _ = split_endpoint(spec.endpoint)
    endpoint, fd = spec.endpoint, -1
    if spec.node_rank == 0:
        sock = bind_rendezvous(spec.endpoint)
        endpoint = f"{host}:{sock.getsockname()[1]}"  # the port the OS chose for ":0"
        fd = sock.detach()
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    start_worker_server(spec.nproc)  # (running already when train/cli.py started it)
    config = LaunchConfig(
        min_nodes=spec.min_nodes or spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc, run_id="fivefold",
        rdzv_backend=BACKEND, rdzv_endpoint=endpoint, max_restarts=spec.max_restarts, monitor_interval=0.5,
        start_method="forkserver",
        rdzv_configs={"node_rank": spec.node_rank, "join_timeout": spec.rdzv_timeout_s, "listen_fd": fd,
                      "last_call": spec.last_call_s, "keep_alive": spec.keep_alive_s},
        local_addr=host if is_loopback(host) else None,  # what the workers connect to
    )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    reports = Path(os.environ[WORKER_DIR])
    own = reports == _own_reports()  # (a test may name the folder, to read the reports itself)
    reports.mkdir(parents=True, exist_ok=True)
    try:
        with one_line_failures():
            elastic_launch(config, entrypoint)(*args)
    except RendezvousConnectionError:  # node 0's store went away: its launcher (or machine) is gone
        raise RendezvousLost(f"lost the rendezvous at {spec.endpoint}: node 0, which hosts it, is gone or unreachable, "
                          f"and the job cannot go on without it") from None
    except RendezvousError as e:
        raise LaunchError(str(e)) from None
    except ChildFailedError as e:  # torch names the first failure it saw; the reports name the cause
        summary = culprit_summary(reports, note="(torch's lines above list the failures in the order it saw them; "
                                                "the first cause is what to fix)")
        if summary is None:
            raise
        raise LaunchError(summary) from e
    finally:
        if own:
            shutil.rmtree(reports, ignore_errors=True)
