"""Launch N local processes the way torchrun does, without a process group.

``autopar.runtime.spmd.run_spmd`` joins every child to a process group before running
its function, which is what most multi-process code wants. ``autopar doctor`` must
instead see the rendezvous happen (or fail), so here the parent plays torchrun's agent:
it hosts the TCP store, and each forked child gets torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_USE_AGENT_STORE``, ``OMP_NUM_THREADS=1``) and runs
``fn(rank, world_size, *args)`` in it. A child
that hangs or dies is reported, not waited on forever, and the others' results still
come back.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from profiler.errors import SettingsError


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """What one local rank did: ``ok`` with its ``value``, or an ``error`` message."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""


def _child(fn: Callable, rank: int, world: int, args: tuple, env: dict[str, str], conn: Any, listening: int) -> None:
    status: tuple[bool, Any] = (False, f"rank {rank}: did not finish")
    try:
        os.close(listening)  # the parent's store socket: only the parent accepts on it
        os.environ.update(env)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))  # the variable alone is read only at torch's start
        status = (True, fn(rank, world, *args))
    except BaseException as exc:  # report everything, SystemExit included
        status = (False, f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        try:
            conn.send(status)
        except Exception as exc:  # an unpicklable result
            conn.send((False, f"rank {rank}: could not send the result back: {exc}"))
        conn.close()
        os._exit(0)  # skip interpreter teardown: gloo's threads can abort it


def _listening_socket(backlog: int) -> socket.socket:
    """A socket on a port the operating system picks, already listening: a rank that
    connects before the store's server serves it waits in the queue."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


def launch_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    env_of_rank: Callable[[int], dict[str, str]] | None = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked processes with
    torchrun's environment and a store hosted here; returns one result per rank.

    ``env_of_rank(rank)`` adds or overrides environment variables of a rank (e.g.
    ``GROUP_RANK`` to pretend ranks sit on different nodes).
    """
    if world_size < 1:
        raise SettingsError(f"world_size={world_size} must be >= 1.")
    # The children are forked before the store's server thread starts: a fork taken
    # while another thread holds a lock (the allocator's, the store's own) can leave a
    # child blocked forever. The store then serves the socket they connect to.
    sock = _listening_socket(backlog=world_size)
    port = sock.getsockname()[1]
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    store = None
    try:
        for rank in range(world_size):
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(world_size),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": "1",
            }
            env.update(env_of_rank(rank) if env_of_rank else {})
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(fn, rank, world_size, args, env, child_end, sock.fileno()), daemon=True
            )
            proc.start()
            child_end.close()
            pipes.append(parent_end)
            procs.append(proc)
        store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=sock.detach())
        results: dict[int, RankResult] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < world_size and time.monotonic() < deadline:
            for rank in range(world_size):
                if rank in results:
                    continue
                if pipes[rank].poll(0.02):
                    try:
                        ok, payload = pipes[rank].recv()
                    except EOFError:
                        ok, payload = False, f"rank {rank}: died (exit code {procs[rank].exitcode})"
                    results[rank] = RankResult(
                        rank=rank, ok=ok, value=payload if ok else None, error="" if ok else str(payload)
                    )
                elif not procs[rank].is_alive() and not pipes[rank].poll(0):
                    results[rank] = RankResult(
                        rank=rank,
                        ok=False,
                        error=f"rank {rank}: died without a result (exit code {procs[rank].exitcode})",
                    )
        for rank in range(world_size):
            results.setdefault(
                rank,
                RankResult(rank=rank, ok=False, error=f"rank {rank}: still running after {timeout_s:.0f} s; stopped"),
            )
        return [results[r] for r in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        sock.close()  # where the store did not take it over
        del store
