"""``autopar dry-run``: check a plan against a model on this machine, without devices.

``autopar dry-run --plan plan.json --model NAME | --model-fn module:function |
--model-config PATH`` applies the plan for some ranks with meta tensors and a fake
process group (:mod:`autopar.runtime.dry_run`); with ``--measure`` it also runs one
training step of each on fake tensors and compares its peak memory with the plan's.
A model the plan was not made for (another fingerprint: parameter names or shapes) is
refused first, in one line and with exit code 2, by the same check as ``autopar export``'s;
each of its units and layers would otherwise be a problem of its own.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch

from autopar.errors import AutoparError, ConfigError
from autopar.plan import Plan


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


def dry_run_command(args: argparse.Namespace) -> int:
    """``autopar dry-run``: 0 when the plan applies cleanly, 1 with problems, 2 on bad input
    (a model the plan was not made for included)."""
    from autopar.export.shape import check_plans_model
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
        check_plans_model(build(), plan, advice="pass the plan's model")  # export's check, in one line
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        report = dry_run(build, plan, sample_input=sample, ranks=ranks, measure=args.measure)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)  # as every command says bad input
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
