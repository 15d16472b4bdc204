"""``autopar export plan.json --to megatron|deepspeed|torchtitan|accelerate [--out PATH]
[--model NAME | --model-config PATH]``: the command-line side of :func:`autopar.export.export`.

Without ``--out`` the exported file is printed (so it can be piped or redirected); the
launch line and the notes go to standard error either way. A bad target, an unreadable
plan or an unwritable ``--out`` (checked before the model is built) is one line (an
ExportError or a ConfigError), exit code 2, as every autopar command fails. The lead
wires it into ``autopar/cli`` with :func:`add_export_parser`, which sets ``func`` on its
sub-parser, returning an exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from autopar.codec import check_output
from autopar.export.api import EXPORTERS, export, exporter_for
from autopar.export.common import ExportError


def add_export_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``autopar export``."""
    p = subparsers.add_parser(
        "export",
        help="write a plan as Megatron-LM, DeepSpeed, torchtitan or Accelerate configuration",
        description="Write what another framework runs for a plan: Megatron-LM arguments in a launch script, a "
        "DeepSpeed config JSON, a torchtitan job TOML or an Accelerate config YAML, with the launch line. Where "
        "the framework has no exact equivalent of a choice, the closest is written and a note says so.",
    )
    p.add_argument("plan", help="plan file (autopar plan ... --out plan.json)")
    p.add_argument("--to", required=True, metavar="|".join(EXPORTERS), help="the framework")
    p.add_argument("--out", help="write the file here (default: print it)")
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="the registered model the plan was made for, to fill in its sizes (see 'autopar models')"
    )
    source.add_argument(
        "--model-config",
        help="the Hugging Face config.json, or checkpoint directory holding one, the plan was made from: fills in "
        "the model's sizes and, where the config states it, its architecture",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the custom code a --model-config's auto_map names (models outside transformers)",
    )
    p.set_defaults(func=export_command)
    return p


def export_command(args: argparse.Namespace) -> int:
    """Run ``autopar export``: print or write the export, then its launch line and notes
    on standard error."""
    exporter_for(args.to)  # an unknown target fails before a model is built
    check_output("--out", args.out)
    if args.out is not None and Path(args.out).resolve() == Path(args.plan).resolve():
        raise ExportError(
            f"--out {args.out!r} is the plan file itself: the export would overwrite the plan; give another path."
        )
    model = None
    if args.model:
        from autopar.models.registry import build_named_model

        model = build_named_model(
            args.model, others="--model-config (a transformers config JSON or checkpoint directory)"
        )
    elif args.model_config:
        from autopar.models.hf_config import build_hf_model, load_hf_model

        model = build_hf_model(load_hf_model(args.model_config, trust_remote_code=args.trust_remote_code), "meta")
    result = export(args.plan, to=args.to, model=model)
    if args.out:
        result.save(args.out)
        print(f"{result.target} export written to {args.out}", file=sys.stderr)
        launch = result.launch_for(args.out)
    else:
        sys.stdout.write(result.text)
        launch = result.launch
    print(f"launch: {launch}", file=sys.stderr)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    return 0
