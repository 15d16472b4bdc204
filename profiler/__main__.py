"""``python -m profiler {model,device,network,report,doctor}``: the profiler's commands
without the ``autopar`` entry point, e.g. under ``torchrun ... -m profiler network``."""

from __future__ import annotations

import argparse
import shlex
import sys

from profiler.cli import add_profile_commands, run
from profiler.doctor_cli import add_doctor_parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m profiler", description="autopar's profiler and doctor.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_profile_commands(sub)
    add_doctor_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.command_line = "python -m profiler " + " ".join(shlex.quote(a) for a in argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
