"""``autopar doctor`` on the command line: its arguments, a plan's groups read from a plan
file, and a local launch with ``--nproc`` (what the doctor checks: :mod:`profiler.doctor`)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from autopar.codec import write_output
from profiler.cli import check_report_out, parse_bytes, parse_seconds
from profiler.doctor import DoctorReport, DoctorSettings, run_doctor
from profiler.doctor_checks import plan_groups
from profiler.errors import SettingsError

DOCTOR_DESCRIPTION = (
    "Check that a cluster is ready to train. Run it like the training job: under torchrun on every node, or "
    "with --nproc N for N local processes. Every rank first reports itself to the launcher's store, so a rank "
    "that never arrives, or arrives with another torch version or a wrong network interface, is named instead "
    "of leaving the others waiting. Then the ranks form a process group and check an all-reduce with a known "
    "sum over the world and over each group of a plan (--plan), a matmul on every rank, and the bandwidth of "
    "every neighbouring link, flagging ranks and links far slower than their peers. Exits with 0 when the "
    "cluster is ready, 1 when it is not."
)
"""``autopar doctor --help``'s description, in plain words."""


def _ratio(text: str) -> float:
    """A fraction strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction; give a number between 0 and 1, e.g. 0.5.")
    return value


def _doctor_rank(rank: int, world: int, settings: DoctorSettings) -> DoctorReport | None:
    return run_doctor(settings)


def add_doctor_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``doctor`` (handler ``func(args) -> exit code``: 0 ready, 1 problems)."""
    p = subparsers.add_parser(
        "doctor",
        help="check that every rank joins, agrees and communicates correctly and fast",
        description=DOCTOR_DESCRIPTION,
    )
    p.add_argument("--plan", type=Path, help="a plan file: also all-reduce over each of its tp/cp/dp/pp groups")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    p.add_argument(
        "--join-timeout", type=parse_seconds, default=60.0, help="seconds to wait for every rank (default 60)"
    )
    p.add_argument(
        "--pg-timeout", type=parse_seconds, default=60.0, help="process group timeout in seconds (default 60)"
    )
    p.add_argument(
        "--link-bytes",
        type=_link_bytes,
        default=0,
        help="bytes per link test, at least 4 (one float), e.g. 4M (default 4 MiB CPU, 256 MiB GPU)",
    )
    p.add_argument(
        "--slow-ratio", type=_ratio, default=0.5, help="flag what runs below this fraction of its peers (default 0.5)"
    )
    p.add_argument("--nproc", type=int, help="launch N local processes instead of running under torchrun")
    p.add_argument("--out", type=Path, help="also write the report as JSON (rank 0)")
    p.set_defaults(func=_cmd_doctor)
    return p


def _link_bytes(text: str) -> int:
    """A link test's size: at least one fp32 element, which is what each link sends."""
    n = parse_bytes(text)
    if n < 4:
        raise argparse.ArgumentTypeError(f"{text!r} is below 4 bytes, one fp32 element; use e.g. 4M.")
    return n


def plan_degrees(path: Path) -> tuple[int, int, int, int]:
    """``(dp, tp, pp, cp)`` of a plan file, read as data (only the mesh matters here; a
    plan written before context parallelism has no ``cp``: 1)."""
    try:
        config = json.loads(Path(path).read_text())["config"]
        degrees = (config["dp"], config["tp"], config["pp"], config.get("cp", 1))
    except FileNotFoundError:
        raise SettingsError(
            f"plan file {str(path)!r} does not exist; write one with 'autopar plan ... --out'."
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise SettingsError(
            f"plan file {str(path)!r} has no readable config.dp/tp/pp ({exc}); is it a plan written by autopar?"
        ) from None
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in degrees):
        raise SettingsError(f"plan file {str(path)!r}: dp, tp, pp, cp = {degrees} must be positive integers.")
    return degrees[0], degrees[1], degrees[2], degrees[3]


def settings_from_args(args: argparse.Namespace) -> DoctorSettings:
    """The settings the command line asks for (``--plan`` read into its groups)."""
    groups: dict[str, tuple[int, ...]] = {}
    plan_world_size = None
    if args.plan is not None:
        dp, tp, pp, cp = plan_degrees(args.plan)
        groups, plan_world_size = plan_groups(dp, tp, pp, cp), dp * cp * tp * pp
    return DoctorSettings(
        backend=args.backend,
        join_timeout_s=args.join_timeout,
        pg_timeout_s=args.pg_timeout,
        groups=groups,
        plan_world_size=plan_world_size,
        link_bytes=args.link_bytes,
        slow_ratio=args.slow_ratio,
    )


def _cmd_doctor(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    check_report_out(args)
    if args.nproc is not None and args.nproc < 1:
        raise SettingsError(f"--nproc {args.nproc} is not allowed: give the number of local processes, at least 1.")
    if args.nproc is not None:
        from profiler.launch import launch_local

        timeout = settings.join_timeout_s + 2 * settings.pg_timeout_s + 120
        results = launch_local(_doctor_rank, args.nproc, settings, timeout_s=timeout)
        failed = [r for r in results if not r.ok]
        for r in failed:
            print(f"rank {r.rank} failed: {r.error.splitlines()[0]}", file=sys.stderr)
        report = results[0].value if results[0].ok else None
    else:
        report = run_doctor(settings)
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    if report is None:
        print("error: rank 0 produced no report (see the errors above)", file=sys.stderr)
        return 1
    print(report.text())
    if args.out:
        write_output("--out", args.out, report.save)
        print(f"wrote {args.out}")
    return 0 if report.ok else 1
