"""``autopar run`` and ``autopar dry-run``: the command-line side of the runtime.

``autopar run --plan plan.json --nproc-per-node N [--nnodes K --node-rank R
--rdzv-endpoint host:port] script.py [args]`` checks that the launch has the plan's world
size, then starts ``script.py`` on every process with PyTorch's own launcher
(``torch.distributed.run``, what ``torchrun`` runs): ``--standalone`` on one node, c10d
rendezvous across nodes. The script finds the plan in ``AUTOPAR_PLAN`` and creates its
process group with :func:`init_distributed`, whose collective timeout
(``AUTOPAR_PG_TIMEOUT_S``) bounds how long a rank waits for a dead or stuck peer; when a
rank fails, torchrun stops the others and the command names the failed rank; when the
launcher itself is killed, the ranks end too (:mod:`autopar.runtime.orphan`).

``autopar dry-run --plan plan.json --model NAME | --model-fn module:function`` applies a
plan on this machine with meta tensors and a fake process group
(:mod:`autopar.runtime.dry_run`).

The lead wires both into ``autopar/cli.py`` with :func:`add_run_parser` and
:func:`add_dry_run_parser`; each sets ``func`` on its sub-parser, returning an exit code.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, ConfigError
from autopar.plan import Plan
from autopar.runtime.errors import PlanMismatchError
from autopar.runtime.orphan import LAUNCHER_ENV, tie_to_launcher

PLAN_ENV = "AUTOPAR_PLAN"
TIMEOUT_ENV = "AUTOPAR_PG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
"""NCCL's own default collective timeout (10 minutes): long enough for a slow first
step or checkpoint, short enough that a dead peer does not hold the job for hours."""


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar run``."""
    p = subparsers.add_parser(
        "run",
        help="run a training script under a plan on local or multi-node processes",
        description=__doc__.split("\n\n")[1],
    )
    p.add_argument("--plan", required=True, help="plan file (autopar plan ... --out plan.json)")
    p.add_argument("--nproc-per-node", type=int, required=True, help="processes (devices) per node")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    p.add_argument("--rdzv-endpoint", default=None, help="host:port of the c10d rendezvous (multi-node)")
    p.add_argument("--rdzv-id", default="autopar", help="job id shared by all nodes")
    p.add_argument(
        "--pg-timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"collective timeout in seconds (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments of the script")
    p.set_defaults(func=run_command)
    return p


def add_dry_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar dry-run``."""
    p = subparsers.add_parser(
        "dry-run",
        help="apply a plan with meta tensors and a fake process group",
        description="Check a plan against a model and apply it for some ranks on this "
        "machine, without devices: names, stage coverage, tensor-parallel "
        "splits, parameter bytes per rank against the plan's prediction.",
    )
    p.add_argument("--plan", required=True, help="plan file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a registered model name (autopar.models.named_models)")
    source.add_argument("--model-fn", help="module:function returning the model (built on the meta device)")
    p.add_argument("--ranks", default=None, help="comma-separated global ranks (default: one per pipeline rank)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=dry_run_command)
    return p


def torchrun_argv(plan: Plan, args: argparse.Namespace) -> list[str]:
    """torchrun's arguments for ``args``; refuses a launch of another world size."""
    world = args.nproc_per_node * args.nnodes
    if world != plan.config.world_size:
        raise PlanMismatchError(
            f"the plan runs on dp x tp x pp = {plan.config.dp} x {plan.config.tp} x {plan.config.pp} = "
            f"{plan.config.world_size} processes, but --nproc-per-node {args.nproc_per_node} x --nnodes {args.nnodes} "
            f"= {world}. Launch {plan.config.world_size} processes or make a plan for {world}."
        )
    argv = [f"--nproc-per-node={args.nproc_per_node}", f"--nnodes={args.nnodes}"]
    if args.rdzv_endpoint:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={args.rdzv_endpoint}", f"--rdzv-id={args.rdzv_id}"]
        if args.node_rank is not None:
            argv.append(f"--node-rank={args.node_rank}")
    elif args.nnodes == 1:
        argv.append("--standalone")
    else:
        raise ConfigError(
            f"--nnodes {args.nnodes} needs --rdzv-endpoint host:port (a node every other node "
            f"reaches) so the nodes can find each other."
        )
    return [*argv, args.script, *args.script_args]


def run_command(args: argparse.Namespace) -> int:
    """``autopar run``: 0 on success, 1 when a rank failed, 2 on a bad launch."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        plan = Plan.load(args.plan)
        argv = torchrun_argv(plan, args)
    except AutoparError as exc:
        print(f"autopar run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    os.environ[PLAN_ENV] = os.path.abspath(args.plan)
    os.environ[TIMEOUT_ENV] = str(args.pg_timeout_s)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks end with this process
    try:
        run(get_args_parser().parse_args(argv))
    except ChildFailedError as exc:
        print(f"autopar run: {describe_failures(exc.failures)}", file=sys.stderr)
        return 1
    return 0


def describe_failures(failures: dict[int, Any]) -> str:
    """One line per failed rank: its exit code or signal, and its error if recorded."""
    lines = []
    for rank, failure in sorted(failures.items()):
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        message = failure.message if failure.error_file_data else ""  # recorded by @record in the script
        if isinstance(message, dict):
            message = message.get("message", "")
        lines.append(
            f"rank {rank} (local rank {failure.local_rank}) failed with {how}"
            + (f": {message.splitlines()[0]}" if message else "; its error is in that rank's output above")
        )
    return "\n".join(lines)


def init_distributed(timeout_s: float | None = None) -> None:
    """Create the default process group from torchrun's environment: NCCL with CUDA,
    else gloo, with the collective timeout of ``autopar run --pg-timeout-s``."""
    tie_to_launcher()
    if dist.is_initialized():
        return
    seconds = timeout_s if timeout_s is not None else float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=seconds))


def plan_from_env() -> Plan:
    """The plan ``autopar run`` was given."""
    path = os.environ.get(PLAN_ENV)
    if not path:
        raise ConfigError(
            f"{PLAN_ENV} is not set: start the script with 'autopar run --plan plan.json ...', or load "
            f"the plan yourself with autopar.Plan.load(path)."
        )
    return Plan.load(path)


def dry_run_command(args: argparse.Namespace) -> int:
    """``autopar dry-run``: 0 when the plan applies cleanly, 1 with problems, 2 on bad input."""
    from autopar.models import get_named_model
    from autopar.runtime.dry_run import dry_run

    try:
        plan = Plan.load(args.plan)
        sample = None
        if args.model:
            entry = get_named_model(args.model)
            build: Callable[[], Any] = partial(_on_meta, entry.build)
            if entry.input_kind != "tokens":
                sample = entry.sample_input(plan.config.micro_batch_size)
        else:
            build = partial(_built_by, args.model_fn)
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        report = dry_run(build, plan, sample_input=sample, ranks=ranks)
    except AutoparError as exc:
        print(f"autopar dry-run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=1) if args.json else report.to_text())
    return 0 if report.ok else 1


def _on_meta(fn: Callable[[], Any]) -> Any:
    with torch.device("meta"):
        return fn()


def _built_by(spec: str) -> Any:
    """The model ``--model-fn`` names, built on the meta device."""
    return _on_meta(_import(spec))


def _import(spec: str) -> Callable[[], Any]:
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"--model-fn {spec!r} must be module:function, e.g. mypkg.models:build_gpt.")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model-fn {spec!r}: cannot import {name!r} from {module!r} ({exc}).") from None
