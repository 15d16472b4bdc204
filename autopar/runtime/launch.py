"""``autopar run``: torchrun under a plan, and what a training script calls to join it.

``autopar run --plan plan.json [torchrun's flags] script.py [args]`` takes every flag of
``torchrun`` (``torch.distributed.run``: its parser is this command's, both spellings,
``--nproc-per-node gpu``, ``--max-restarts``, ``--log-dir``/``--redirects``/``--tee``,
``--local-ranks-filter``, ``-m``, static ``--master-addr``/``--master-port``
rendezvous), checks that the launch has the plan's world size, then starts ``script.py``
on every process with PyTorch's own launcher. What torchrun leaves to its user, autopar
decides from the plan: ``--nproc-per-node`` defaults to the plan's world size over
``--nnodes`` (one node when not given); a plan for several nodes given neither flag is
refused, naming ``--nnodes`` (its node count, run on every node with a rendezvous) and
``--nproc-per-node`` (its world size, every rank on this machine), since starting all its
ranks on one node is rarely meant; one node with no rendezvous flags runs
``--standalone``; an ``--rdzv-endpoint`` without ``--rdzv-backend`` means c10d. The script finds the plan in
``AUTOPAR_PLAN`` and creates its process group with :func:`init_distributed`, whose
collective timeout (``AUTOPAR_PG_TIMEOUT_S``) bounds how long a rank waits for a dead or
stuck peer; when a rank fails, torchrun stops the others and the command names the failed
rank; when the launcher itself is killed, the ranks end too (:mod:`autopar.runtime.orphan`).

It fails fast and says why in one line: a flag torchrun would refuse with a traceback,
a rendezvous endpoint this node cannot bind or reach (:mod:`autopar.runtime.rendezvous`;
torchrun itself waits without a word), a rendezvous torchrun gives up on later. Ctrl-C
(or SIGTERM) stops every rank of this node and exits with 128 + the signal's number (130
for Ctrl-C) after one line; ranks that entered autopar print no traceback for it. A failed
rank is named with the error it recorded (``Type: message``), else its exit code or the
signal that ended it; the ranks torchrun stopped because of it are left out.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import AutoparError, ConfigError
from autopar.plan import Plan
from autopar.plan_checks import overflow
from autopar.runtime.errors import PlanMismatchError
from autopar.runtime.orphan import LAUNCHER_ENV, tie_to_launcher
from autopar.runtime.rendezvous import check_rendezvous

PLAN_ENV = "AUTOPAR_PLAN"
TIMEOUT_ENV = "AUTOPAR_PG_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0
"""NCCL's own default collective timeout (10 minutes): long enough for a slow first
step or checkpoint, short enough that a dead peer does not hold the job for hours."""
DEFAULT_RDZV_WAIT_S = 30.0
"""How long a node waits for the rendezvous endpoint to accept connections: the nodes of
a Slurm job start together, but node 0 may take many seconds longer to import torch from
a cold shared file system, and failing it then would kill a healthy job."""
_NO_ERROR_FILE = "<N/A>"
"""torch's ``ProcessFailure.error_file`` of a rank that recorded no error."""
_DECIDED_FROM_THE_PLAN = {
    "nproc_per_node": None,
    "nnodes": None,
    "rdzv_backend": None,
    "rdzv_id": "autopar",
    "node_rank": None,
    "master_addr": None,
    "master_port": None,
}
"""torchrun's flags whose defaults autopar replaces (None: left unset, so that what the
user gave is told apart from torchrun's default); a ``PET_*`` environment variable of the
same name, torchrun's other way to set a flag, keeps precedence."""
_OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to 1, torchrun's ranks create their own store for each attempt instead of
sharing the rendezvous's."""
_TORCHRUN_MASTER = ("127.0.0.1", 29500)
"""torchrun's static rendezvous address and port when ``--master-addr/--master-port``
are not given."""


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar run``: torchrun's own parser, plus ``--plan``, ``--rdzv-wait-s``
    and ``--pg-timeout-s``."""
    from torch.distributed.run import get_args_parser

    p = subparsers.add_parser(
        "run",
        help="run a training script under a plan on local or multi-node processes (torchrun's flags)",
        description=__doc__.split("\n\n")[1],
        parents=[get_args_parser()],
        conflict_handler="resolve",  # torchrun's -h/--help replaces the sub-parser's own
    )
    for action in p._actions:  # torchrun's help is written as reStructuredText
        action.help = action.help and action.help.replace("``", "")
    p.add_argument("--plan", required=True, help="plan file (autopar plan ... --out plan.json)")
    p.add_argument(
        "--rdzv-wait-s",
        "--rdzv_wait_s",
        type=float,
        default=DEFAULT_RDZV_WAIT_S,
        help="how long a node other than the rendezvous host waits for the rendezvous endpoint to accept "
        f"connections before giving up (default {DEFAULT_RDZV_WAIT_S:.0f})",
    )
    p.add_argument(
        "--pg-timeout-s",
        "--pg_timeout_s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help=f"collective timeout in seconds (default {DEFAULT_TIMEOUT_S:.0f})",
    )
    p.set_defaults(
        func=run_command,
        **{dest: value for dest, value in _DECIDED_FROM_THE_PLAN.items() if f"PET_{dest.upper()}" not in os.environ},
    )
    return p


def torchrun_args(plan: Plan, args: argparse.Namespace) -> argparse.Namespace:
    """The arguments torchrun runs for ``autopar run``'s ``args``, its defaults decided from
    ``plan``; refuses a launch of another world size, and what torchrun itself would refuse
    with a traceback."""
    nnodes = _default_node_count(plan, args) if args.nnodes is None else _node_count(str(args.nnodes))
    nproc = _local_world_size(args.nproc_per_node, plan.config.world_size, nnodes)
    if nproc * nnodes != plan.config.world_size:
        given = "" if str(args.nproc_per_node) == str(nproc) else f" ({args.nproc_per_node} here)"
        c = plan.config
        axes = {"dp": c.dp, **({"cp": c.cp} if c.cp > 1 else {}), "tp": c.tp, "pp": c.pp}
        raise PlanMismatchError(
            f"the plan runs on {' x '.join(axes)} = {' x '.join(map(str, axes.values()))} = "
            f"{plan.config.world_size} processes, but --nproc-per-node {nproc}{given} x --nnodes {nnodes} = "
            f"{nproc * nnodes}. Launch {plan.config.world_size} processes or make a plan for {nproc * nnodes}."
        )
    if args.node_rank is not None and not 0 <= args.node_rank < nnodes:
        raise ConfigError(
            f"--node-rank {args.node_rank} is not allowed: with --nnodes {nnodes} it must be from 0 to {nnodes - 1}."
        )
    launch = argparse.Namespace(**vars(args))
    launch.nproc_per_node, launch.nnodes = str(nproc), str(nnodes)
    launch.rdzv_backend = args.rdzv_backend or _backend(args, nnodes)
    launch.standalone = args.standalone or launch.rdzv_backend == "standalone"
    if launch.standalone:
        launch.rdzv_backend = "c10d"  # what torchrun's --standalone sets
    launch.node_rank = args.node_rank or 0
    launch.master_addr = args.master_addr or _TORCHRUN_MASTER[0]
    launch.master_port = args.master_port or _TORCHRUN_MASTER[1]
    _check_torchrun_accepts(launch)
    return launch


def _default_node_count(plan: Plan, args: argparse.Namespace) -> int:
    """``--nnodes`` when not given: one node, unless the plan's cluster has several and
    ``--nproc-per-node`` is not given either, which would start every rank of the plan on
    this node (1024 ranks on 8 GPUs); that is refused, naming what to pass instead."""
    cluster = plan.cluster
    if cluster.nodes > 1 and args.nproc_per_node is None:
        raise ConfigError(
            f"the plan is for {cluster.nodes} nodes x {cluster.devices_per_node} devices = {cluster.world_size} "
            f"processes, and without --nnodes and --nproc-per-node all {cluster.world_size} would start on this "
            f"node: on each node pass --nnodes {cluster.nodes} with a rendezvous (--rdzv-endpoint host:port), which "
            f"starts {cluster.devices_per_node} processes per node, or pass --nproc-per-node {cluster.world_size} "
            f"to run every rank on this machine."
        )
    return 1


def _node_count(nnodes: str) -> int:
    """``--nnodes`` as a count: a plan is made for one world size, so an elastic range
    ``MIN:MAX`` is refused unless both ends agree."""
    low, sep, high = nnodes.partition(":")
    try:
        counts = (int(low), int(high) if sep else int(low))
    except ValueError:
        counts = (0, 0)
    if counts[0] < 1 or counts[0] != counts[1]:
        raise ConfigError(
            f"--nnodes {nnodes} is not allowed: give the number of nodes, a positive integer (a plan is made for one "
            f"world size, so torchrun's elastic MIN:MAX ranges are not supported; make a plan for each size)."
        )
    return counts[0]


def _local_world_size(nproc: str | None, world: int, nnodes: int) -> int:
    """``--nproc-per-node`` as a count: the plan's world over the nodes when not given,
    else torchrun's reading of it (an integer, ``gpu``, ``cpu``, ``auto``, ``xpu``)."""
    from torch.distributed.run import determine_local_world_size

    if nproc is None:
        if world % nnodes:
            raise ConfigError(
                f"the plan's {world} processes do not divide over --nnodes {nnodes}; pass --nproc-per-node, or "
                f"make a plan for a world size that does."
            )
        return world // nnodes
    allowed = "a positive integer, or gpu, cpu, auto or xpu (what this node has)"
    try:
        count = determine_local_world_size(nproc)
    except ValueError as exc:
        if nproc in ("gpu", "xpu"):  # the node lacks that device: the other words remain
            other = "xpu" if nproc == "gpu" else "gpu"
            reason, allowed = str(exc).rstrip("."), f"a positive integer, or cpu, auto or {other} (what this node has)"
        else:
            reason = "it is not understood"
        raise ConfigError(
            f"--nproc-per-node {nproc} is not allowed here ({reason}): give {allowed}; the plan runs {world} processes."
        ) from None
    if count < 1:
        raise ConfigError(f"--nproc-per-node {nproc} is not allowed: give {allowed}.")
    return count


def _backend(args: argparse.Namespace, nnodes: int) -> str:
    """The rendezvous when ``--rdzv-backend`` is not given: c10d at ``--rdzv-endpoint``,
    torchrun's static rendezvous at ``--master-addr/--master-port``, else one node by itself."""
    if args.rdzv_endpoint:
        return "c10d"
    if nnodes > 1 and args.master_addr is None:
        raise ConfigError(
            f"--nnodes {nnodes} needs --rdzv-endpoint host:port (a node every other node reaches) so the nodes can "
            f"find each other, or torchrun's static --master-addr and --node-rank."
        )
    if nnodes > 1 and args.node_rank is None:
        raise ConfigError(
            f"--nnodes {nnodes} with --master-addr {args.master_addr} needs --node-rank (0 on the node at that "
            f"address, 1 to {nnodes - 1} on the others), or use --rdzv-endpoint, which ranks the nodes itself."
        )
    if args.master_addr is not None or args.master_port is not None:
        return "static"
    return "standalone"


def _check_torchrun_accepts(launch: argparse.Namespace) -> None:
    """torchrun's own reading of ``launch`` (its launch configuration, built and dropped),
    whose refusals are asserts and bare ValueErrors, as one line, and what it reads only
    once the agent starts (the monitor interval, asserted then; the signals to forward,
    an unknown one skipped with a log line). Its warnings and the environment it sets are
    left to the launch itself."""
    import torch.distributed.run as torchrun

    if launch.monitor_interval <= 0:
        raise ConfigError(
            f"--monitor-interval {launch.monitor_interval:g} is not allowed: the launcher checks its ranks every that "
            f"many seconds; give a positive number (torchrun's default is 0.1)."
        )
    names = [name.strip() for name in str(launch.signals_to_handle).split(",")]
    unknown = [name for name in names if not isinstance(getattr(signal, name, None), signal.Signals)]
    if unknown:
        raise ConfigError(
            f"--signals-to-handle names {', '.join(map(repr, unknown))}, which {'is' if len(unknown) == 1 else 'are'} "
            f"not a signal here; give signal names such as SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1."
        )

    saved_env, saved_level = dict(os.environ), torchrun.logger.level
    torchrun.logger.setLevel(logging.ERROR)
    try:
        torchrun.config_from_args(launch)
    except (AssertionError, ValueError, RuntimeError, OSError) as exc:  # OSError: --log-dir is a file
        raise ConfigError(_torchrun_refuses(exc)) from None
    finally:
        torchrun.logger.setLevel(saved_level)
        os.environ.clear()
        os.environ.update(saved_env)


def check_endpoint(args: argparse.Namespace, launch: argparse.Namespace) -> None:
    """Check from this node the rendezvous endpoint that ``launch`` (:func:`torchrun_args`
    of ``args``) uses: c10d's ``--rdzv-endpoint`` or the static rendezvous's
    ``--master-addr:--master-port``."""
    if launch.standalone:
        return
    if launch.rdzv_backend == "c10d" and launch.rdzv_endpoint:
        endpoint, flag = launch.rdzv_endpoint, "--rdzv-endpoint"
    elif launch.rdzv_backend == "static":
        endpoint, flag = f"{launch.master_addr}:{launch.master_port}", "--master-addr/--master-port"
    else:
        return
    check_rendezvous(endpoint, flag=flag, node_rank=args.node_rank, nnodes=int(launch.nnodes), wait_s=args.rdzv_wait_s)


def run_command(args: argparse.Namespace) -> int:
    """``autopar run``: 0 on success, 1 when a rank failed, 2 on a bad launch, 128 + the
    signal's number when stopped by one (130 for Ctrl-C)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import run

    from autopar.runtime.api import check_plan

    try:
        plan = Plan.load(args.plan)
        check_plan(plan)
        check_fits(plan)
        launch = torchrun_args(plan, args)
        check_endpoint(args, launch)
    except AutoparError as exc:
        print(f"autopar run: error: {exc}", file=sys.stderr)
        return 2
    os.environ[PLAN_ENV] = os.path.abspath(args.plan)
    os.environ[TIMEOUT_ENV] = str(args.pg_timeout_s)
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks end with this process
    if launch.max_restarts > 0:
        # torchrun's ranks share its rendezvous store by default, and a restarted rank reads
        # the previous attempt's addresses from it: gloo and NCCL then connect to dead peers
        # (pytorch/pytorch#135712, #167288). A store of each attempt's own avoids that.
        os.environ.setdefault(_OWN_STORE_ENV, "1")
    if int(launch.nnodes) > 1:  # torchrun waits for the other nodes without a word
        where = launch.rdzv_endpoint or f"{launch.master_addr}:{launch.master_port}"
        print(
            f"autopar run: waiting at {where} until all {launch.nnodes} nodes join (start 'autopar run' with the same "
            f"--nnodes and rendezvous on each); the ranks start then",
            file=sys.stderr,
            flush=True,
        )
    try:
        run(launch)
    except ChildFailedError as exc:
        print(f"autopar run: {describe_failures(exc.failures)}", file=sys.stderr)
        return 1
    except RendezvousError as exc:  # a store that never answered, nodes that never came
        print(f"autopar run: {type(exc).__name__}: {_rendezvous_failed(exc, launch)}", file=sys.stderr)
        return 2
    except SignalException as exc:  # torch's agent stopped the ranks, then raised this
        print(f"autopar run: {_stopped_by(exc.sigval, launch)}", file=sys.stderr)
        return 128 + exc.sigval
    except KeyboardInterrupt:  # torch handles signals only once the ranks start
        print("autopar run: interrupted before any rank started", file=sys.stderr)
        return 128 + signal.SIGINT
    except ValueError as exc:  # what torchrun reads only as it starts: an unknown --rdzv-backend
        print(f"autopar run: {_torchrun_refuses(exc)}", file=sys.stderr)
        return 2
    return 0


def check_fits(plan: Plan) -> None:
    """Refuse to launch a plan predicted not to fit (an estimate saved as it was): every
    rank would run out of memory at its first step, on the cluster's whole allocation."""
    problem = overflow(plan.prediction, plan.cluster.device.name)
    if problem:
        raise ConfigError(
            f"{problem} at its first step; run a plan that fits (autopar plan searches them, or estimate another "
            f"configuration)."
        )


def _torchrun_refuses(exc: BaseException) -> str:
    """One line for what torchrun refused, as it reads the arguments or as it starts."""
    detail = " ".join(str(exc).split()) or type(exc).__name__
    return f"torchrun refuses these arguments: {detail}; see 'autopar run --help'."


def _rendezvous_failed(exc: Exception, launch: argparse.Namespace) -> str:
    """One line for a rendezvous torchrun gave up on, with its underlying cause: the
    endpoint answered but is no rendezvous store, or the other nodes never joined."""
    detail = str(exc.__cause__ or exc).strip().splitlines()[0]
    return (
        f"the rendezvous through {launch.rdzv_endpoint or 'the local store'} failed ({detail}); check that "
        f"--rdzv-endpoint names the host:port where node 0's 'autopar run' listens (not another service), and "
        f"that every node passes the same --nnodes and --rdzv-id."
    )


def _stopped_by(sig: signal.Signals, launch: argparse.Namespace) -> str:
    """What a signal to the launcher did: torch's agent passed it on to every rank of this
    node and waited for them (SIGKILL after its shutdown timeout)."""
    what = "interrupted" if sig == signal.SIGINT else f"stopped by {sig.name}"
    n = launch.nproc_per_node
    ranks = f"all {n} ranks" if launch.nnodes == "1" else f"the {n} ranks of this node"
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
