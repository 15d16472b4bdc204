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

It fails fast and says why in one line. Before launching, the node that will host the
rendezvous store (``--rdzv-endpoint`` names this machine, on one node or node 0) checks
that it can bind the port, and any other node that the endpoint accepts connections
within ``--rdzv-wait-s``: torchrun itself waits without a word on a port held by another
process (it connects to it as a client) or an endpoint nobody serves. A rendezvous
torchrun gives up on later is one line too. Ctrl-C (or SIGTERM) stops every rank of this
node and exits with 128 + the signal's number (130 for Ctrl-C) after one line; ranks that
entered autopar print no traceback for it. A failed rank is named with the error it
recorded (``Type: message``), else its exit code or the signal that ended it; the ranks
torchrun stopped because of it are left out.

``autopar dry-run --plan plan.json --model NAME | --model-fn module:function`` applies a
plan on this machine with meta tensors and a fake process group
(:mod:`autopar.runtime.dry_run`).

The lead wires both into ``autopar/cli.py`` with :func:`add_run_parser` and
:func:`add_dry_run_parser`; each sets ``func`` on its sub-parser, returning an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import errno
import importlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
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
RDZV_DEFAULT_PORT = 29400
"""torchrun's c10d rendezvous port when ``--rdzv-endpoint`` names none."""
DEFAULT_RDZV_WAIT_S = 30.0
"""How long a node waits for the rendezvous endpoint to accept connections: the nodes of
a Slurm job start together, but node 0 may take many seconds longer to import torch from
a cold shared file system, and failing it then would kill a healthy job."""
_NO_ERROR_FILE = "<N/A>"
"""torch's ``ProcessFailure.error_file`` of a rank that recorded no error."""


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
        "--rdzv-wait-s",
        type=float,
        default=DEFAULT_RDZV_WAIT_S,
        help="how long a node other than the rendezvous host waits for --rdzv-endpoint to accept "
        f"connections before giving up (default {DEFAULT_RDZV_WAIT_S:.0f})",
    )
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
        "splits, parameter bytes per rank against the plan's prediction; with --measure, "
        "one training step of each on fake tensors and its peak memory against the plan's.",
    )
    p.add_argument("--plan", required=True, help="plan file")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="a registered model name (autopar.models.named_models)")
    source.add_argument("--model-fn", help="module:function returning the model (built on the meta device)")
    source.add_argument(
        "--model-config",
        help="a Hugging Face config.json, or a checkpoint directory holding one (built from the config on meta)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the custom code a --model-config's auto_map names (models outside transformers)",
    )
    p.add_argument("--ranks", default=None, help="comma-separated global ranks (default: one per pipeline rank)")
    p.add_argument(
        "--measure",
        action="store_true",
        help="also run one training step of each rank on fake tensors and measure its peak memory "
        "(token models; about a minute per rank of a 175B model)",
    )
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


def check_rendezvous(args: argparse.Namespace) -> None:
    """Refuse, before torchrun starts, a rendezvous endpoint this node cannot use: torchrun
    connects as a client when it cannot bind the port, so a port held by another process, or
    an endpoint nobody serves, leaves it waiting without a word. The node that hosts the store
    (``--rdzv-endpoint`` names this machine, on one node or node 0) must be able to bind the
    port; any other node must reach it. ``--standalone`` picks a free port itself."""
    if not args.rdzv_endpoint:
        return
    host, port = _parse_endpoint(args.rdzv_endpoint)
    if args.node_rank or not _is_this_machine(host):
        _check_reachable(host, port, args.rdzv_wait_s)
    else:
        _check_bindable(host, port, args)


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``host[:port]`` as torchrun reads it, its errors as a ConfigError."""
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    try:
        return parse_rendezvous_endpoint(endpoint, default_port=RDZV_DEFAULT_PORT)
    except ValueError:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not allowed: it must be host:port with a port from 1 to 65535, "
            f"e.g. node0.cluster:{RDZV_DEFAULT_PORT}."
        ) from None


def _is_this_machine(host: str) -> bool:
    """Whether torchrun's c10d rendezvous will host its store here for ``host``: torch's own
    rule (a loopback address, this machine's name or one of its addresses)."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    try:
        return _matches_machine_hostname(host)
    except OSError:  # this machine's own name does not resolve
        return False


def _check_bindable(host: str, port: int, args: argparse.Namespace) -> None:
    """Bind ``port`` on every interface, as torch's TCPStore server does, and let go."""
    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    try:
        socket.create_server(("", port), family=family, dualstack_ipv6=family == socket.AF_INET6).close()
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise ConfigError(
                f"the rendezvous port {port} on {host} cannot be bound ({exc.strerror}); pass --rdzv-endpoint "
                f"{host}:PORT with a port from 1024 to 65535 that this user may bind."
            ) from None
        if args.nnodes == 1:
            fix = "omit --rdzv-endpoint (one node then picks a free port itself), pass another port"
        else:
            fix = "pass another port on every node"
            if args.node_rank is None:
                fix += " (or, for a second node on this machine, --node-rank 1 or more)"
        raise ConfigError(
            f"the rendezvous port {port} on {host} is held by another process{_port_holder(port)}; "
            f"{fix}, or stop that process."
        ) from None


def _check_reachable(host: str, port: int, wait_s: float) -> None:
    """Connect to ``host:port``, retrying for ``wait_s`` seconds (the host's node may start
    later than this one)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"the rendezvous host {host!r} of --rdzv-endpoint {host}:{port} does not resolve ({exc.strerror}); "
            f"pass node 0's hostname or address as seen from this node."
        ) from None
    deadline = time.monotonic() + wait_s
    while (reason := _connect_error(host, port)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if reason:
        raise ConfigError(
            f"the rendezvous endpoint {host}:{port} could not be reached within {wait_s:g} s ({reason}); start "
            f"'autopar run' on the node it names first, check --rdzv-endpoint and the firewall, or wait longer "
            f"with --rdzv-wait-s."
        )


def _connect_error(host: str, port: int) -> str:
    """Why a TCP connection to ``host:port`` failed within two seconds; empty when it
    succeeded."""
    try:
        socket.create_connection((host, port), timeout=2.0).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


def _port_holder(port: int) -> str:
    """ " (pid P, NAME)" of the process holding TCP ``port`` on this machine, read from
    ``/proc``; empty where that cannot be known (not Linux, another user's process)."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for row in Path(table).read_text().splitlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] != "0":
                    sockets.add(f"socket:[{fields[9]}]")
    for fds in Path("/proc").glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) in sockets for fd in fds.iterdir()):
                name = (fds.parent / "comm").read_text().strip()
                return f" (pid {fds.parent.name}, {name})"
    return ""


def run_command(args: argparse.Namespace) -> int:
    """``autopar run``: 0 on success, 1 when a rank failed, 2 on a bad launch, 128 + the
    signal's number when stopped by one (130 for Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    try:
        plan = Plan.load(args.plan)
        argv = torchrun_argv(plan, args)
        check_rendezvous(args)
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
    except RendezvousError as exc:  # a store that never answered, nodes that never came
        print(f"autopar run: {type(exc).__name__}: {_rendezvous_failed(exc, args)}", file=sys.stderr)
        return 2
    except SignalException as exc:  # torch's agent stopped the ranks, then raised this
        print(f"autopar run: {_stopped_by(exc.sigval, args)}", file=sys.stderr)
        return 128 + exc.sigval
    except KeyboardInterrupt:  # torch handles signals only once the ranks start
        print("autopar run: interrupted before any rank started", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def _rendezvous_failed(exc: Exception, args: argparse.Namespace) -> str:
    """One line for a rendezvous torchrun gave up on, with its underlying cause: the
    endpoint answered but is no rendezvous store, or the other nodes never joined."""
    detail = str(exc.__cause__ or exc).strip().splitlines()[0]
    return (
        f"the rendezvous through {args.rdzv_endpoint or 'the local store'} failed ({detail}); check that "
        f"--rdzv-endpoint names the host:port where node 0's 'autopar run' listens (not another service), and "
        f"that every node passes the same --nnodes and --rdzv-id."
    )


def _stopped_by(sig: signal.Signals, args: argparse.Namespace) -> str:
    """What a signal to the launcher did: torch's agent passed it on to every rank of this
    node and waited for them (SIGKILL after its shutdown timeout)."""
    what = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    ranks = f"all {args.nproc_per_node} ranks" if args.nnodes == 1 else f"the {args.nproc_per_node} ranks of this node"
    return f"{what}; {ranks} stopped"


def describe_failures(failures: dict[int, Any]) -> str:
    """One line per failed rank: its exit code or signal, and its error if recorded. The
    ranks torch's agent stopped with SIGTERM because another failed are left out, unless
    none failed otherwise (the job itself was sent SIGTERM)."""
    own = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    return "\n".join(_describe_failure(rank, failure) for rank, failure in sorted(own.items()))


def _describe_failure(rank: int, failure: Any) -> str:
    """``rank R (local rank L) failed with exit code N | signal NAME``, then the error the
    rank recorded (``@record`` on the script's main) or where to look instead."""
    if failure.exitcode < 0:
        try:
            how = f"signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            how = f"signal {-failure.exitcode}"
    else:
        how = f"exit code {failure.exitcode}"
    error = _recorded_error(failure)
    return f"rank {rank} (local rank {failure.local_rank}) failed with {how}" + (
        f": {error}" if error else " (no Python error recorded; see its output above)"
    )


def _recorded_error(failure: Any) -> str:
    """The first line of the error a rank recorded, ``Type: message`` (``Type (no message)``
    for an empty one); empty when it recorded none: torch then makes up a message (a link
    to its docs, or the signal again) that says nothing about the rank."""
    if failure.error_file == _NO_ERROR_FILE:
        return ""
    message = failure.error_file_data.get("message", "")
    message = str(message.get("message", "") if isinstance(message, dict) else message)
    kind, sep, text = message.partition(": ")  # @record writes f"{type(e).__name__}: {e}"
    lines = [line.strip() for line in (text if sep else message).splitlines() if line.strip()]
    if not sep:
        return lines[0] if lines else ""
    return f"{kind}: {lines[0]}" if lines else f"{kind} (no message)"


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
        sample, note = None, None
        if args.model:
            entry = get_named_model(args.model)
            build: Callable[[], Any] = partial(_on_meta, entry.build)
            if entry.input_kind != "tokens":
                sample = entry.sample_input(plan.config.micro_batch_size)
        elif args.model_config:
            build, sample, note = _config_source(args.model_config, args.trust_remote_code, plan)
        else:
            build = partial(_built_by, args.model_fn)
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        report = dry_run(build, plan, sample_input=sample, ranks=ranks, measure=args.measure)
    except AutoparError as exc:
        print(f"autopar dry-run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(asdict(report), indent=1) if args.json else report.to_text())
    if note:
        print(f"\n{note}", file=sys.stderr)
    return 0 if report.ok else 1


def _config_source(text: str, trust_remote_code: bool, plan: Plan) -> tuple[Callable[[], Any], Any, str | None]:
    """The Hugging Face model ``--model-config`` names, built on meta for each rank; its
    sample input at the plan's micro-batch (None for a model fed token ids alone: the dry
    run feeds those at the plan's length); the line naming the class built when the
    config names none."""
    from autopar.models.hf_config import build_hf_model, hf_input, load_hf_model

    hf = load_hf_model(text, trust_remote_code=trust_remote_code)
    build = partial(build_hf_model, hf, "meta")
    model = build()
    tokens = getattr(model, "main_input_name", None) == "input_ids"
    feed = hf_input(model, hf.config, seq_len=plan.model.seq_len if tokens else None, sample_shape=None)
    sample = None if feed.seq_len is not None else feed.sample(plan.config.micro_batch_size, "meta")
    return build, sample, hf.note


def _on_meta(fn: Callable[[], Any]) -> Any:
    with torch.device("meta"):
        return fn()


def _built_by(spec: str) -> Any:
    """The model ``--model-fn`` names, built on the meta device."""
    model = _on_meta(_import(spec))
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"--model-fn {spec!r} returned a {type(model).__name__}, not a torch.nn.Module; name a function "
            f"that builds the model (e.g. mypkg.models:build_gpt)."
        )
    return model


def _import(spec: str) -> Callable[[], Any]:
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"--model-fn {spec!r} must be module:function, e.g. mypkg.models:build_gpt.")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model-fn {spec!r}: cannot import {name!r} from {module!r} ({exc}).") from None
