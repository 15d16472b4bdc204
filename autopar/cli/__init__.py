"""The one ``autopar`` command: ``autopar plan | estimate | presets | models | ...``.

Every subcommand prints what a person needs and exits non-zero with a one-line error
(no traceback) on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from autopar.cli.demo import add_demo_parser
from autopar.errors import AutoparError, ConfigError
from autopar.runtime.launch import add_dry_run_parser, add_run_parser


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def parse_assignments(items: Sequence[str] | None) -> dict[str, Any]:
    """``["tp=8", "pp=16,zero_stage=1"]`` -> ``{"tp": 8, "pp": 16, "zero_stage": 1}``."""
    out: dict[str, Any] = {}
    for item in items or ():
        for part in item.split(","):
            if not part.strip():
                continue
            key, sep, value = part.partition("=")
            if not sep:
                raise ConfigError(f"--set {part!r}: expected name=value, e.g. tp=8.")
            out[key.strip()] = _parse_value(value.strip())
    return out


def load_model(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The model named by ``--model``, ``--model-config`` or ``--model-fn`` (built on the
    meta device), and the keyword arguments that describe its input."""
    import torch

    chosen = [x for x in (args.model, args.model_config, args.model_fn) if x]
    if len(chosen) != 1:
        raise ConfigError("give exactly one of --model NAME, --model-config CONFIG.json or --model-fn module:function.")
    seq_len = getattr(args, "seq_len", None)
    if args.model:
        from autopar.models.registry import build_named_model, get_named_model

        entry = get_named_model(args.model)
        model = build_named_model(args.model)
        if entry.input_kind == "tokens":
            return model, {"seq_len": seq_len or entry.seq_len}
        return model, {"sample_input": entry.sample_input(1)}
    if args.model_config:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise ConfigError("--model-config needs Hugging Face transformers: pip install 'autopar[hf]'.") from None
        path = Path(args.model_config)
        if not path.is_file():
            raise ConfigError(f"--model-config {str(path)!r} does not exist.")
        config = AutoConfig.from_pretrained(str(path.parent if path.name == "config.json" else path))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        default = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return model, {"seq_len": seq_len or default}
    module_name, _, fn_name = args.model_fn.partition(":")
    if not fn_name:
        raise ConfigError(f"--model-fn {args.model_fn!r}: expected module:function, e.g. mypkg.models:build.")
    try:
        fn: Callable[[], Any] = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--model-fn {args.model_fn!r}: cannot import it ({exc}).") from None
    with torch.device("meta"):
        model = fn()
    if seq_len:
        return model, {"seq_len": seq_len}
    shape = getattr(args, "sample_shape", None)
    if not shape:
        raise ConfigError("--model-fn needs --seq-len (token models) or --sample-shape C,H,W (one sample's shape).")
    dims = tuple(int(d) for d in shape.split(","))
    return model, {"sample_input": torch.zeros(1, *dims, device="meta")}


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="a registered model name (see 'autopar models')")
    p.add_argument("--model-config", help="a Hugging Face config JSON (built with random weights on meta)")
    p.add_argument("--model-fn", help="module:function returning an nn.Module")
    p.add_argument("--seq-len", type=int, help="tokens per sample (token models)")
    p.add_argument("--sample-shape", help="one sample's shape for non-token models, e.g. 3,224,224")


def _add_search_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--cluster", required=True, help="preset:nodes (e.g. dgx-a100-80gb:128) or a cluster JSON file")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "adafactor"])
    p.add_argument("--attention", default="flash", choices=["flash", "materialized"])
    p.add_argument("--profile", action="append", help="profiler report(s) whose measurements to use")
    p.add_argument("--out", help="write the plan file here")
    p.add_argument("--html", help="write an HTML report with the pipeline timeline and memory pictures")
    p.add_argument("--json", action="store_true", help="print the plan file instead of the explanation")


def _load_profiles(paths: Sequence[str] | None) -> Any:
    """The ``--profile`` files, passed as paths so that errors and plan notes name them."""
    return list(paths) if paths else None


def cmd_plan(args: argparse.Namespace) -> int:
    from autopar.hardware import parse_cluster
    from autopar.search.planner import plan

    model, inputs = load_model(args)
    result = plan(
        model,
        parse_cluster(args.cluster),
        global_batch_size=args.global_batch_size,
        constraints=parse_assignments(args.set),
        optimizer=args.optimizer,
        attention=args.attention,
        profile=_load_profiles(args.profile),
        **inputs,
    )
    return _emit(result, args)


def cmd_estimate(args: argparse.Namespace) -> int:
    from autopar.hardware import parse_cluster
    from autopar.search.planner import estimate

    model, inputs = load_model(args)
    result = estimate(
        model,
        parse_cluster(args.cluster),
        parse_assignments(args.set),
        global_batch_size=args.global_batch_size,
        optimizer=args.optimizer,
        attention=args.attention,
        profile=_load_profiles(args.profile),
        **inputs,
    )
    code = _emit(result, args)
    if not result.prediction.fits:
        print(
            f"\nDOES NOT FIT: {result.prediction.memory_bytes_per_device / 2**30:.1f} GiB needed per device, "
            f"{result.prediction.memory_capacity_bytes / 2**30:.1f} GiB available.",
            file=sys.stderr,
        )
        return 3
    return code


def _emit(result: Any, args: argparse.Namespace) -> int:
    from autopar.present.explain import explain

    if args.out:
        result.save(args.out)
    if args.html:
        from autopar.present.report import save_html

        save_html(result, args.html)
        print(f"report written to {args.html}", file=sys.stderr)
    print(result.to_json() if args.json else explain(result))
    if args.out:
        print(f"\nplan written to {args.out}", file=sys.stderr)
    return 0


def cmd_presets(args: argparse.Namespace) -> int:
    from autopar.hardware import preset_names

    for name, desc in preset_names().items():
        print(f"{name:<16} {desc}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autopar.models.registry import named_models

    for name, entry in named_models().items():
        print(f"{name:<14} {entry.description}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``autopar``."""
    parser = argparse.ArgumentParser(prog="autopar", description="Plan and run parallel training for PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="search the fastest plan that fits")
    _add_search_args(p)
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE", help="fix config fields, e.g. --set tp=8 --set pp=16"
    )
    p.set_defaults(func=cmd_plan)
    e = sub.add_parser("estimate", help="predict one given configuration")
    _add_search_args(e)
    e.add_argument(
        "--set",
        action="append",
        metavar="FIELD=VALUE",
        required=True,
        help="the configuration, e.g. --set tp=8,pp=16,micro_batch_size=1,recompute=full",
    )
    e.set_defaults(func=cmd_estimate)
    sub.add_parser("presets", help="list cluster presets").set_defaults(func=cmd_presets)
    sub.add_parser("models", help="list registered models").set_defaults(func=cmd_models)
    # the profiler's subcommands: it builds on autopar, so it is loaded here, when the
    # command line is read, and never by the library
    from profiler.cli import add_profile_parser
    from profiler.doctor_cli import add_doctor_parser

    add_profile_parser(sub)
    add_doctor_parser(sub)
    add_run_parser(sub)
    add_dry_run_parser(sub)
    add_demo_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autopar`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
