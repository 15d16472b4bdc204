"""``autopar report plan.json [--html report.html]``: the report of a saved plan, without
planning again: its explanation on the terminal, or the page ``autopar plan --html``
writes (the explanation and the pictures) from the plan file ``--out`` wrote.

An unreadable plan or an unwritable ``--html`` is one line (a PlanFormatError or a
ConfigError), exit code 2, as every autopar command fails. The command line wires it in
with :func:`add_report_parser`, which sets ``func`` on its sub-parser.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from autopar.codec import check_distinct, check_output, write_output


def add_report_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar report``."""
    p = subparsers.add_parser(
        "report",
        help="explain a saved plan, or write its HTML report",
        description="Explain a plan file (autopar plan ... --out plan.json) on the terminal, or with --html write "
        "its report: the explanation, the pipeline timeline, memory per pipeline rank and the step time by term, "
        "in one standalone page.",
    )
    p.add_argument("plan", help="plan file (autopar plan ... --out plan.json)")
    p.add_argument("--html", help="write the HTML report here instead of printing the explanation")
    p.set_defaults(func=report_command)
    return p


def report_command(args: argparse.Namespace) -> int:
    """Run ``autopar report``: read the plan (its errors name the file), then print its
    explanation or write the page."""
    from autopar.plan import Plan
    from autopar.present.explain import explain
    from autopar.present.report import save_html

    check_output("--html", args.html)  # before the page is drawn, as plan --html does
    check_distinct({"--html": args.html}, {"plan file": args.plan})
    plan = Plan.load(args.plan)  # read before the page is opened, so a bad plan leaves no file
    if args.html is None:
        print(explain(plan))
        return 0
    write_output("--html", args.html, lambda path: save_html(plan, path))
    print(f"report written to {args.html}", file=sys.stderr)
    return 0
