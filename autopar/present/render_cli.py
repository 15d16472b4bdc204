"""``autopar render plan.json --html report.html``: the report of a saved plan, without
planning again (the page ``autopar plan --html`` writes, from the plan file ``--out``
wrote).

An unreadable plan or an unwritable ``--html`` is one line (a PlanFormatError or a
ConfigError), exit code 2, as every autopar command fails. The command line wires it in
with :func:`add_render_parser`, which sets ``func`` on its sub-parser.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autopar.errors import ConfigError


def add_render_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar render``."""
    p = subparsers.add_parser(
        "render",
        help="write the HTML report of a saved plan",
        description="Write the HTML report of a plan file (autopar plan ... --out plan.json): the explanation, "
        "the pipeline timeline, memory per pipeline rank and the step time by term, in one standalone page.",
    )
    p.add_argument("plan", help="plan file (autopar plan ... --out plan.json)")
    p.add_argument("--html", required=True, help="write the report here")
    p.set_defaults(func=render_command)
    return p


def render_command(args: argparse.Namespace) -> int:
    """Run ``autopar render``: read the plan (its errors name the file), write the page."""
    from autopar.plan import Plan
    from autopar.present.report import save_html

    plan = Plan.load(args.plan)  # read before the page is opened, so a bad plan leaves no file
    try:
        save_html(plan, args.html)
    except OSError as exc:
        raise ConfigError(
            f"--html {args.html!r} cannot be written ({exc.strerror or exc}); give a file path in a writable directory."
        ) from None
    print(f"report written to {args.html}", file=sys.stderr)
    return 0
