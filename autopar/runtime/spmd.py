"""Run a function on N local processes with a gloo process group, and collect results.

For tests, the demo and benchmarks on one machine: the parent forks N children (no
re-import of torch, so a launch costs ~0.1 s instead of torchrun's ~10 s), each joins a
process group over a ``file://`` rendezvous (no ports to collide), runs
``fn(rank, world_size, *args)`` and sends its result back over a pipe. Nothing hangs:
the process group has a timeout, the whole run has a wall-clock limit, and the first
rank that fails ends the run with every rank's error shown.

Rules for ``fn``: defined at module level; return picklable data; do not create process
groups in the parent before forking. Results travel as plain ``pickle`` bytes, so
tensors are copied into the message rather than shared through file descriptors that
die with the child.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from autopar.errors import AutoparError


class SPMDError(AutoparError):
    """A rank failed, died or timed out. The message holds every rank's report."""


@dataclass(frozen=True, kw_only=True)
class SPMDSettings:
    """Timeouts (seconds) and threads per rank. After the first failure the others'
    reports are collected for ``report_grace_s`` more, so a rank that died is named even
    when a peer noticed first."""

    timeout_s: float = 180.0
    pg_timeout_s: float = 60.0
    report_grace_s: float = 2.0
    threads_per_rank: int = 1
    backend: str = "gloo"


def _child(
    fn: Callable, rank: int, world: int, init: str, args: tuple, conn, settings: SPMDSettings, env: dict[str, str]
) -> None:
    import torch
    import torch.distributed as dist

    status, payload = "err", f"rank {rank}: did not finish"
    try:
        os.environ.update(env)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        torch.set_num_threads(settings.threads_per_rank)
        dist.init_process_group(
            settings.backend,
            init_method=init,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=settings.pg_timeout_s),
        )
        result = fn(rank, world, *args)
        dist.barrier()
        dist.destroy_process_group()
        status, payload = "ok", result
    except BaseException as exc:  # report everything, including SystemExit, to the parent
        status, payload = "err", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    finally:
        try:
            conn.send_bytes(pickle.dumps((status, payload)))
        except Exception as exc:  # an unpicklable result
            conn.send_bytes(pickle.dumps(("err", f"rank {rank}: could not send the result back: {exc}")))
        conn.close()
        os._exit(0)  # skip interpreter teardown: gloo's threads can abort it


def run_spmd(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    settings: SPMDSettings | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` forked processes.

    Returns the per-rank results in rank order. Raises SPMDError naming each failing
    rank (its exception and traceback, or how it died) as soon as one fails, or when
    ``settings.timeout_s`` passes; every child is killed before returning.
    """
    settings = settings or SPMDSettings()
    if world_size < 1:
        raise SPMDError(f"world_size={world_size} must be >= 1")
    ctx = mp.get_context("fork")
    store_dir = tempfile.mkdtemp(prefix="autopar_pg_")
    init = f"file://{store_dir}/store"
    pipes, procs = [], []
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child, args=(fn, rank, world_size, init, args, child_end, settings, env or {}), daemon=True
            )
            proc.start()
            child_end.close()
            pipes.append(parent_end)
            procs.append(proc)
        results: list[Any] = [None] * world_size
        errors: list[str] = []
        pending = set(range(world_size))

        def collect() -> None:
            for rank in sorted(pending):
                if pipes[rank].poll(0.02):
                    try:
                        status, payload = pickle.loads(pipes[rank].recv_bytes())
                    except EOFError:
                        status, payload = "err", f"rank {rank}: died (exit code {procs[rank].exitcode})"
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = payload
                    else:
                        errors.append(payload)
                elif not procs[rank].is_alive() and not pipes[rank].poll(0):
                    pending.discard(rank)
                    errors.append(f"rank {rank}: died without a result (exit code {procs[rank].exitcode})")

        deadline = time.monotonic() + settings.timeout_s
        while pending and not errors and time.monotonic() < deadline:
            collect()
        grace_end = time.monotonic() + settings.report_grace_s
        while pending and errors and time.monotonic() < grace_end:  # the culprit may report after its victims
            collect()
        if pending and not errors:
            errors.append(f"timed out after {settings.timeout_s:.0f} s; ranks still running: {sorted(pending)}")
        if errors:
            raise SPMDError(f"{len(errors)} of {world_size} rank(s) failed:\n" + "\n".join(errors))
        return results
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        shutil.rmtree(store_dir, ignore_errors=True)
