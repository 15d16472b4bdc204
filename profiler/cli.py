"""``autopar profile {model,device,network,report}``: the command line of the profiler.

:func:`add_profile_parser` registers the ``profile`` command on an ``argparse``
sub-parser set (``autopar``'s CLI wires it in); every command sets ``func``, a handler
``args -> exit code``. ``python -m profiler`` offers the same commands at top level, so
``torchrun ... -m profiler network`` works without the ``autopar`` entry point.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import shlex
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from autopar.codec import check_distinct, check_output, write_atomically, write_output
from autopar.errors import AutoparError, first_line, out_of_memory
from profiler.errors import MeasurementError, ProfilerError, SettingsError
from profiler.model_loading import load_model

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """``"1K"``, ``"64M"``, ``"256MiB"``, ``"4096"`` -> bytes (binary multiples)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 4096, 1K, 64M or 1G.")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m.group(2).upper()])


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers.") from None


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, refused while the command line is read
    (before a model is built or processes launched)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give an integer >= {minimum}.")
        return value

    return parse


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_seconds(text: str) -> float:
    """``"60"``, ``"0.5"`` -> seconds: a timeout, a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} is not a timeout; give a finite number of seconds > 0.")
    return value


def _device(text: str) -> str:
    """A device name torch reads (``cpu``, ``cuda``, ``cuda:1``); whether it is here and
    measurable is checked when it is used."""
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; write cpu, cuda or cuda:N.") from None
    return text


def add_profile_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``profile {model,device,network,report}``; returns the ``profile`` parser."""
    parser = subparsers.add_parser(
        "profile",
        help="measure layers, a device or the network; render reports",
        description="Measure what the planner otherwise guesses.",
    )
    add_profile_commands(parser.add_subparsers(dest="profile_command", required=True, metavar="COMMAND"))
    return parser


def add_profile_commands(sub: Any) -> None:
    """Register ``model``, ``device``, ``network`` and ``report`` on ``sub``."""
    m = sub.add_parser("model", help="per-unit forward/backward time, FLOPs and memory of a model (one process)")
    src = m.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a registered model name, e.g. gpt2-small (see autopar.models.named_models)")
    src.add_argument("--model-fn", metavar="MODULE:FUNCTION", help="a function returning an nn.Module")
    src.add_argument(
        "--model-config",
        help="a Hugging Face config.json, or a checkpoint directory holding one (built from the config with "
        "random weights; weights are not read)",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the custom code a --model-config's auto_map names (models outside transformers)",
    )
    m.add_argument("--seq-len", type=int, help="tokens per sample (token models; default: the model's)")
    m.add_argument("--input-shape", type=_ints, help="per-sample input shape for non-token models, e.g. 3,224,224")
    m.add_argument("--batch", type=int, default=1, help="samples per measured call (default 1)")
    m.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    m.add_argument("--repeats", type=_int_at_least(1), default=5, help="timed repeats per unit (default 5)")
    m.add_argument("--warmup", type=_int_at_least(0), default=1, help="untimed calls per unit first (default 1)")
    m.add_argument(
        "--no-device",
        action="store_true",
        help="skip the device sweep (calibration then uses the planner's device numbers)",
    )
    _common(m)
    m.set_defaults(func=_cmd_model)

    d = sub.add_parser("device", help="matmul FLOP/s curves and memory bandwidth of this device")
    d.add_argument("--sizes", type=_ints, default=(), help="square matmul sizes, e.g. 64,256,1024")
    d.add_argument("--dtypes", type=_words, default=(), help="e.g. fp32,bf16 (default: all the device runs)")
    d.add_argument(
        "--array-sizes",
        type=lambda t: tuple(parse_bytes(x) for x in t.split(",")),
        default=(),
        help="streaming array sizes, e.g. 1M,64M,256M",
    )
    _common(d)
    d.set_defaults(func=_cmd_device)

    n = sub.add_parser("network", help="collective bandwidth and latency (run under torchrun, or --nproc N)")
    n.add_argument("--nproc", type=int, help="launch N local CPU processes (gloo) instead of running under torchrun")
    n.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    n.add_argument("--min-bytes", type=parse_bytes, default=2**10)
    n.add_argument("--max-bytes", type=parse_bytes, default=0, help="default 256M on GPUs, 64M on CPUs")
    n.add_argument("--factor", type=_int_at_least(2), default=2, help="size multiplier between points (default 2)")
    n.add_argument(
        "--ops", type=_words, default=(), help="default: all_reduce,all_gather,reduce_scatter,broadcast,send_recv"
    )
    n.add_argument("--levels", type=_words, default=(), help="default: intra,inter,mixed")
    n.add_argument("--repeats", type=_int_at_least(1), default=3, help="timed repeats per size (default 3)")
    n.add_argument("--timeout", type=parse_seconds, default=600.0, help="seconds before a hung run is stopped")
    n.add_argument("--out", required=True, type=Path, help="where to write the report (JSON)")
    n.add_argument("--quiet", action="store_true", help="no progress lines")
    n.set_defaults(func=_cmd_network)

    r = sub.add_parser("report", help="merge reports and render them as HTML or Markdown")
    r.add_argument("reports", nargs="+", type=Path, help="report JSON files (later ones win on shared sections)")
    r.add_argument("--html", type=Path, help="write a standalone HTML report here")
    r.add_argument("--markdown", type=Path, help="write Markdown here (figures in <name>_files/)")
    r.add_argument("--out", type=Path, help="write the merged report (JSON) here")
    r.set_defaults(func=_cmd_report)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--threads", type=_int_at_least(1), default=1, help="CPU threads (default 1: one local-cpu device)")
    p.add_argument("--out", required=True, type=Path, help="where to write the report (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def _command_line(args: argparse.Namespace) -> str:
    """What to record as the command: ``args.command_line`` when the caller set it
    (``python -m profiler``), else this process's ``autopar`` command line."""
    given = getattr(args, "command_line", None)
    return given or "autopar " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _progress(args: argparse.Namespace) -> Any:
    if getattr(args, "quiet", False):
        return None
    return lambda line: print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", file=sys.stderr, flush=True)


def check_report_out(args: argparse.Namespace) -> None:
    """Refuse ``--out`` before anything is measured, in the process that writes the report:
    a local launch's (``--nproc``) or rank 0 of a launcher's (the other ranks write
    nothing, and their nodes need not have its folder)."""
    if args.nproc is not None or os.environ.get("RANK", "0") == "0":
        check_output("--out", args.out)


def _finish(report: Any, out: Path) -> int:
    from profiler.render import summary

    write_output("--out", out, report.save)
    for line in summary(report):
        print(line)
    print(f"wrote {out}")
    return 0


def _cmd_model(args: argparse.Namespace) -> int:
    from autopar.profiles.report import ProfileReport
    from profiler.device import profile_device, resolve_device
    from profiler.layers import LayerSweep, profile_model
    from profiler.timing import Repeats

    check_output("--out", args.out)
    device = resolve_device(args.device)
    if device.type == "cpu" and args.dtype == "fp16":
        raise SettingsError(
            "--dtype fp16 on cpu is not allowed: the planner prices CPU processes in fp32 or bf16 (fp16 is a GPU "
            "training precision), so no plan could use this profile; give --dtype fp32 or bf16, or profile on a GPU."
        )
    model, sample, name = load_model(args, device)
    sweep = LayerSweep(
        repeats=Repeats(warmup=args.warmup, repeats=args.repeats, min_repeats=min(3, args.repeats), budget_s=30.0)
    )
    command = _command_line(args)
    report = profile_model(
        model, sample, sweep=sweep, threads=args.threads, progress=_progress(args), name=name, command=command
    )
    if not args.no_device:
        report = ProfileReport.merge(
            report, profile_device(device=device, threads=args.threads, command=command, progress=_progress(args))
        )
    return _finish(report, args.out)


def _cmd_device(args: argparse.Namespace) -> int:
    from profiler.device import DeviceSweep, profile_device

    check_output("--out", args.out)
    sweep = DeviceSweep(matmul_sizes=args.sizes, dtypes=args.dtypes, array_bytes=args.array_sizes)
    report = profile_device(
        device=args.device, sweep=sweep, threads=args.threads, progress=_progress(args), command=_command_line(args)
    )
    return _finish(report, args.out)


def _network_sweep(args: argparse.Namespace) -> Any:
    from autopar.profiles.network_section import Level
    from profiler.network import NetworkSweep

    kwargs: dict[str, Any] = dict(
        min_bytes=args.min_bytes, max_bytes=args.max_bytes, factor=args.factor, repeats=args.repeats
    )
    if args.ops:
        kwargs["ops"] = args.ops
    if args.levels:
        known = typing.get_args(Level)
        unknown = [level for level in args.levels if level not in known]
        if unknown:
            raise SettingsError(f"--levels {unknown} are not allowed; choose from {', '.join(known)}.")
        kwargs["levels"] = args.levels
    return NetworkSweep(**kwargs)


def _cmd_network(args: argparse.Namespace) -> int:
    check_report_out(args)
    sweep = _network_sweep(args)
    command = _command_line(args)
    if args.nproc is not None:
        return _network_local(args, sweep, command)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SettingsError(
            "no launcher environment (RANK, WORLD_SIZE): run under torchrun, e.g. 'torchrun "
            "--nproc-per-node 8 -m profiler network --out net.json', or pass --nproc N to launch N "
            "local CPU processes."
        )
    return run_network_rank(args, sweep, command)


def run_network_rank(args: argparse.Namespace, sweep: Any, command: str) -> int:
    """Join the launcher's process group (torchrun's environment), sweep, and write the
    report from rank 0."""
    import torch.distributed as dist

    from profiler.network import profile_network

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _join(dist, backend, args.timeout)
    try:
        rank = dist.get_rank()
        try:
            report = profile_network(sweep=sweep, progress=_progress(args) if rank == 0 else None, command=command)
        except (ProfilerError, MemoryError, RuntimeError) as exc:
            # what it refuses, or cannot allocate, it does on every rank alike: rank 0 says it once
            if rank == 0 or not (isinstance(exc, ProfilerError) or out_of_memory(exc)):
                raise
            return 2
        if rank == 0:
            _finish(report, args.out)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def _join(dist: Any, backend: str, timeout_s: float) -> None:
    """Join the launcher's process group; a rank that cannot (its peers never came, the
    rendezvous address does not answer) is a one-line MeasurementError naming this rank,
    the address and what to check, not the store's traceback."""
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as exc:
        env = os.environ
        where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
        cause = first_line(exc)
        raise MeasurementError(
            f"rank {env.get('RANK', '?')} of {env.get('WORLD_SIZE', '?')} could not join the process group at "
            f"{where} within --timeout {timeout_s:g} s ({cause}); start every rank of the launch, check that "
            f"{where} is reachable from each node ('autopar doctor' checks the ranks join), or raise --timeout."
        ) from None


def _network_worker(rank: int, world: int, sweep: Any, command: str, verbose: bool) -> Any:
    """One rank of ``--nproc``'s profile: rank 0's report, None on the others, or what
    running out of memory says (every rank allocates the same buffers)."""
    from profiler.network import profile_network

    say = (
        (lambda line: print(f"[{datetime.datetime.now():%H:%M:%S}] {line}", file=sys.stderr, flush=True))
        if verbose and rank == 0
        else None
    )
    try:
        report = profile_network(sweep=sweep, progress=say, command=command)
    except (MemoryError, RuntimeError) as exc:  # returned, to be said once for all ranks
        if (message := out_of_memory(exc)) is None:
            raise
        return message
    return report if rank == 0 else None


def _network_local(args: argparse.Namespace, sweep: Any, command: str) -> int:
    from autopar.runtime.spmd import SPMDSettings, run_spmd

    if args.nproc < 2:
        raise SettingsError(f"--nproc {args.nproc}: a network profile needs at least 2 processes.")
    if args.backend == "nccl":
        raise SettingsError(
            "--nproc launches CPU processes with gloo (forking after CUDA is initialised is unsafe); "
            "for GPUs run under torchrun: 'torchrun --nproc-per-node N -m profiler network ...'."
        )
    if "intra" not in sweep.levels:
        raise SettingsError(
            f"--levels {','.join(sweep.levels)} measures links between nodes, but --nproc runs every process on "
            f"this machine: add intra, or run under torchrun on two nodes or more."
        )
    settings = SPMDSettings(timeout_s=args.timeout, pg_timeout_s=min(args.timeout, 300.0))
    results = run_spmd(_network_worker, args.nproc, sweep, command, not args.quiet, settings=settings)
    short = next((r for r in results if isinstance(r, str)), None)  # a rank that could not allocate its buffers
    if short is not None:
        raise ProfilerError(short)
    return _finish(results[0], args.out)


def _cmd_report(args: argparse.Namespace) -> int:
    from autopar.profiles.report import ProfileReport
    from profiler.render import render_html, render_markdown, summary

    check_output("--out", args.out)
    check_output("--html", args.html)
    check_output("--markdown", args.markdown)
    check_distinct({"--out": args.out, "--html": args.html, "--markdown": args.markdown}, {"report": args.reports})
    report = ProfileReport.merge(*(ProfileReport.load(p) for p in args.reports))
    for line in summary(report):
        print(line)
    if args.out:
        write_output("--out", args.out, report.save)
        print(f"wrote {args.out}")
    if args.html:
        write_output("--html", args.html, lambda path: write_atomically(path, render_html(report)))
        print(f"wrote {args.html}")
    if args.markdown:
        files = args.markdown.with_name(args.markdown.stem + "_files")
        write_output(
            "--markdown",
            args.markdown,
            lambda path: write_atomically(path, render_markdown(report, image_dir=files, link_prefix=f"{files.name}/")),
        )
        print(f"wrote {args.markdown} and {files}/")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a parsed command, turning typed errors (the profiler's and autopar's) into a
    message and exit code 2."""

    try:
        return int(args.func(args))
    except (ProfilerError, AutoparError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if (message := out_of_memory(exc)) is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2
