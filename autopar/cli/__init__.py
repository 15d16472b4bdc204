"""The one ``autopar`` command: ``autopar plan | estimate | presets | models | ...``.

Every subcommand prints what a person needs and exits non-zero with a one-line error
(no traceback) on bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from autopar import __version__
from autopar.cli.demo import add_demo_parser
from autopar.cli.model_args import LoadedModel, add_model_args, load_model
from autopar.codec import check_distinct, check_output, write_output
from autopar.errors import AutoparError, ConfigError, out_of_memory
from autopar.export import add_export_parser
from autopar.present.report_cli import add_report_parser
from autopar.runtime.dry_run_cli import add_dry_run_parser
from autopar.runtime.launch import add_run_parser


def _parse_value(text: str) -> Any:
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


NULLABLE_FIELDS = ("dp_shard",)
"""Config fields whose ``none`` means None (``--set dp_shard=none``: plain FSDP), not the
word (``--set recompute=none`` is the mode)."""


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
            key, value = key.strip(), value.strip()
            if key in out:
                raise ConfigError(
                    f"--set {key}= is given twice ({key}={out[key]} and {key}={value}): a field takes one value; "
                    "keep the one you mean."
                )
            out[key] = None if key in NULLABLE_FIELDS and value.lower() == "none" else _parse_value(value)
    return out


def _batch(text: str) -> int:
    """``--global-batch-size`` as argparse reads it: a positive integer, refused in the
    flag's own words (the planner's refusal names its keyword, global_batch_size=)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: give the samples per optimizer step, a positive integer"
        )
    return value


def _add_search_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--cluster", required=True, help="preset:nodes (e.g. dgx-a100-80gb:128) or a cluster JSON file")
    p.add_argument("--global-batch-size", type=_batch, required=True, help="samples per optimizer step")
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "adafactor"])
    p.add_argument("--attention", default="flash", choices=["flash", "materialized"])
    p.add_argument(
        "--routing-imbalance",
        type=float,
        default=1.0,
        help="dropless experts under expert parallelism: the busiest rank's routed rows over the mean (default 1.0)",
    )
    p.add_argument(
        "--activations",
        default="batch-first",
        choices=["batch-first", "sequence-first"],
        help="activation layout to price: batch-first (autopar's runtime) or sequence-first (Megatron-LM's, "
        "no copies around sequence-parallel collectives; its kernels keep gather shards and FP8 layers' inputs "
        "in FP8)",
    )
    p.add_argument(
        "--memory-headroom",
        type=float,
        default=0.0,
        metavar="GIB",
        help="GiB of each device to keep free beyond its reserve, a margin for what the prediction may miss "
        "(default 0)",
    )
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

    loaded = load_model(args)
    cluster = parse_cluster(args.cluster)
    options = dict(
        global_batch_size=args.global_batch_size,
        constraints=parse_assignments(args.set),
        optimizer=args.optimizer,
        attention=args.attention,
        profile=_load_profiles(args.profile),
        routing_imbalance=args.routing_imbalance,
        activations=args.activations,
        memory_headroom_gib=args.memory_headroom,
        **loaded.inputs,
    )
    if not args.fewest_nodes:
        return _emit(plan(loaded.model, cluster, **options), args, loaded)
    from autopar.present.whatif import fewest_nodes

    limit = {} if args.max_nodes is None else {"max_nodes": args.max_nodes}
    result = fewest_nodes(loaded.model, cluster, **limit, **options)
    nodes = result.config.world_size // cluster.devices_per_node
    print(
        f"fewest nodes of {cluster.kind} a plan fits on: {nodes} ({result.config.world_size} devices; the node "
        f"count of --cluster is not used)",
        file=sys.stderr,
    )
    return _emit(result, args, loaded)


def cmd_estimate(args: argparse.Namespace) -> int:
    from autopar.hardware import parse_cluster
    from autopar.search.planner import estimate

    loaded = load_model(args)
    result = estimate(
        loaded.model,
        parse_cluster(args.cluster),
        parse_assignments(args.set),
        global_batch_size=args.global_batch_size,
        optimizer=args.optimizer,
        attention=args.attention,
        profile=_load_profiles(args.profile),
        routing_imbalance=args.routing_imbalance,
        activations=args.activations,
        memory_headroom_gib=args.memory_headroom,
        **loaded.inputs,
    )
    code = _emit(result, args, loaded)
    if not result.prediction.fits:
        headroom = result.settings.memory_headroom_bytes
        kept = f" ({headroom / 2**30:.1f} of it the headroom asked for)" if headroom else ""
        print(
            f"\nDOES NOT FIT: {result.prediction.memory_bytes_per_device / 2**30:.1f} GiB needed per device{kept}, "
            f"{result.prediction.memory_capacity_bytes / 2**30:.1f} GiB available.",
            file=sys.stderr,
        )
        return 3
    return code


def _emit(result: Any, args: argparse.Namespace, loaded: LoadedModel) -> int:
    """Print ``result`` (its explanation, or its JSON) with the model's warnings among
    its notes, then on stderr the notes stating the defaults the model was loaded with
    and one line per warning; write the files asked for."""
    from autopar.present.explain import explain

    result = replace(result, notes=result.notes + loaded.warnings)
    notes = [n for n in loaded.notes if n not in loaded.warnings]
    if args.out is not None:  # an empty path too: it is refused, not taken for no --out
        write_output("--out", args.out, result.save)
    if args.html is not None:
        from autopar.present.report import save_html

        write_output("--html", args.html, lambda path: save_html(result, path))
        print(f"report written to {args.html}", file=sys.stderr)
    print(result.to_json() if args.json else explain(result))
    if notes:
        print("\n" + "\n".join(notes), file=sys.stderr)
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if args.out:
        print(f"\nplan written to {args.out}", file=sys.stderr)
    return 0


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse ``--out`` and ``--html`` paths that cannot be written before the model is
    built and searched (the plan would be lost after the search)."""
    check_output("--out", args.out)
    check_output("--html", args.html)
    from autopar.models.hf_config import config_file

    config = config_file(args.model_config) if args.model_config is not None else None
    check_distinct(
        {"--out": args.out, "--html": args.html},
        {"--cluster": args.cluster, "--model-config": config, "--profile": args.profile},
    )


def check_plan_args(args: argparse.Namespace) -> None:
    """Refuse ``--max-nodes`` without ``--fewest-nodes`` (it bounds that search only), and
    unwritable output paths, before the model is built."""
    if args.max_nodes is not None and not args.fewest_nodes:
        raise ConfigError(
            f"--max-nodes {args.max_nodes} is only used with --fewest-nodes: add --fewest-nodes to plan on the "
            f"fewest nodes up to {args.max_nodes}, or drop --max-nodes and give the node count in --cluster."
        )
    check_outputs(args)


def cmd_presets(args: argparse.Namespace) -> int:
    """List the presets; with ``--save SPEC FILE``, write the cluster ``SPEC`` names as a
    cluster file to edit (its fields carry their units in their names)."""
    from autopar.hardware import parse_cluster, preset_names, save_cluster

    if args.save:
        spec, path = args.save
        check_output("--save", path)
        cluster = parse_cluster(spec)
        save_cluster(cluster, path)
        print(
            f"wrote {path}: {cluster.name}, {cluster.world_size} x {cluster.device.name}; edit it, then "
            f"--cluster {path}"
        )
        return 0
    for name, desc in preset_names().items():
        print(f"{name:<16} {desc}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from autopar.models.registry import named_models

    for name, entry in named_models().items():
        print(f"{name:<14} {entry.description}")
    return 0


RUN_DESCRIPTION = (
    "Run a training script under a plan with PyTorch's own launcher (torchrun), one process per device; "
    "every torchrun flag is accepted. The launch must have the plan's world size, --nproc-per-node (default: "
    "the plan's world size over --nnodes) times --nnodes (default 1): one node starts by itself, several meet at "
    "--rdzv-endpoint (c10d) or --master-addr with --node-rank (static). A plan for several nodes needs one of "
    "the two: run it on every node with --nnodes (e.g. --nnodes 128 for 128 nodes of 8 devices, which starts 8 "
    "processes per node), or pass --nproc-per-node with the plan's world size to start every rank on this "
    "machine. The script reads the plan with "
    "plan_from_env() and joins the process "
    "group with init_distributed() (both in autopar.runtime.launch), whose collective timeout is "
    "--pg-timeout-s. When a rank fails, the others are stopped and the failed rank is named; Ctrl-C stops "
    "every rank of this node."
)
"""``autopar run --help``'s description, in plain words (the launcher's module docstring,
which it replaces, is written for readers of the code)."""


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, wrapped at spaces only: option names such as
    --nproc-per-node stay whole on one line."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return textwrap.fill(
            " ".join(text.split()), width, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False
        )


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, as autopar's other errors are,
    pointing at the command's help instead of printing its usage; its sub-commands'
    parsers are of this class too, with the same help layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"autopar: error: {message.rstrip('.')}; see '{self.prog} --help'.\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``autopar``."""
    parser = _Parser(prog="autopar", description="Plan and run parallel training for PyTorch.")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="search the fastest plan that fits")
    _add_search_args(p)
    p.add_argument(
        "--set", action="append", metavar="FIELD=VALUE", help="fix config fields, e.g. --set tp=8 --set pp=16"
    )
    p.add_argument(
        "--fewest-nodes",
        action="store_true",
        help="plan on the fewest nodes of --cluster's node type where a plan fits (its node count is not used)",
    )
    p.add_argument("--max-nodes", type=int, help="with --fewest-nodes: the most nodes to try (default 4096)")
    p.set_defaults(func=cmd_plan)
    _check_first(p, check_plan_args)
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
    _check_first(e, check_outputs)
    presets = sub.add_parser("presets", help="list cluster presets, or write one as a cluster file to edit")
    presets.add_argument(
        "--save",
        nargs=2,
        metavar=("SPEC", "FILE"),
        help="write the cluster SPEC names (e.g. dgx-h100:16) to FILE, a cluster file to edit and pass as --cluster",
    )
    presets.set_defaults(func=cmd_presets)
    sub.add_parser("models", help="list registered models").set_defaults(func=cmd_models)
    # the profiler's subcommands: it builds on autopar, so it is loaded here, when the
    # command line is read, and never by the library
    from profiler.cli import add_profile_parser
    from profiler.doctor_cli import add_doctor_parser

    add_profile_parser(sub)
    add_doctor_parser(sub)
    run = add_run_parser(sub)
    run.description = RUN_DESCRIPTION
    _check_first(run, check_run_args)
    _check_first(add_dry_run_parser(sub), check_dry_run_args)
    add_demo_parser(sub)
    add_export_parser(sub)
    add_report_parser(sub)
    return parser


def _check_first(parser: argparse.ArgumentParser, check: Callable[[argparse.Namespace], None]) -> None:
    """Make ``parser``'s command run ``check(args)`` before its own handler, so that a bad
    argument is one line (a ConfigError) before anything starts."""
    handler = parser.get_default("func")

    def checked(args: argparse.Namespace) -> int:
        check(args)
        return handler(args)

    parser.set_defaults(func=checked)


def check_run_args(args: argparse.Namespace) -> None:
    """Refuse what ``autopar run`` would otherwise pass on to torchrun and the ranks: a
    launch that does not match the plan or that torchrun would refuse, a collective timeout
    that is not a positive number of seconds, a script that is not there."""
    from autopar.plan import Plan
    from autopar.runtime.launch import torchrun_args

    torchrun_args(Plan.load(args.plan), args)
    if not (args.pg_timeout_s > 0 and math.isfinite(args.pg_timeout_s)):
        raise ConfigError(
            f"--pg-timeout-s {args.pg_timeout_s} is not allowed: give the collective timeout in seconds, a finite "
            f"number > 0 (the default is 600)."
        )
    if not (args.rdzv_wait_s >= 0 and math.isfinite(args.rdzv_wait_s)):
        raise ConfigError(
            f"--rdzv-wait-s {args.rdzv_wait_s} is not allowed: give the seconds a node waits for the rendezvous "
            f"endpoint, a finite number >= 0 (the default is 30)."
        )
    if not (args.module or args.no_python or Path(args.training_script).is_file()):
        raise ConfigError(
            f"training script {args.training_script!r} does not exist; give the path of the script every rank "
            f"runs (or a module with -m)."
        )


def check_dry_run_args(args: argparse.Namespace) -> None:
    """Refuse ``--ranks`` that are not comma-separated ranks of the plan, each once (the
    fake process group would fail on them with a traceback)."""
    if args.ranks is None:
        return
    from autopar.plan import Plan

    world = Plan.load(args.plan).config.world_size
    allowed = f"give comma-separated ranks from 0 to {world - 1}, each once"
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        raise ConfigError(f"--ranks {args.ranks!r} is not allowed: {allowed}.") from None
    outside = [r for r in ranks if not 0 <= r < world]
    if outside:
        raise ConfigError(f"--ranks {args.ranks!r}: rank {outside[0]} is not one of the plan's {world}; {allowed}.")
    if len(set(ranks)) != len(ranks):
        raise ConfigError(f"--ranks {args.ranks!r} names a rank twice; {allowed}.")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``autopar`` console script."""
    args = build_parser().parse_args(argv)
    python_format = warnings.formatwarning
    warnings.formatwarning = warning_line
    try:
        return int(args.func(args) or 0)
    except AutoparError as exc:
        print(f"autopar: error: {exc}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as exc:
        if (message := out_of_memory(exc)) is None:
            raise
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into head: not an error
        sys.stderr.close()
        return 0
    finally:
        warnings.formatwarning = python_format


def warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, line=None) -> str:
    """A Python warning as the command line prints its own: one line, ``warning:`` and
    the message, without the source line Python shows under it; another package's
    warning also names its category and where it was raised."""
    own = Path(filename).resolve().is_relative_to(Path(__file__).resolve().parents[1])
    origin = "" if own else f" ({category.__name__} at {filename}:{lineno})"
    return f"warning: {message}{origin}\n"


if __name__ == "__main__":
    sys.exit(main())
