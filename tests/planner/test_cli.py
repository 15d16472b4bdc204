"""The autopar command: what a user types, what they see, the exit codes."""

import json

import pytest

from autopar import Plan
from autopar.cli import main, parse_assignments
from autopar.errors import ConfigError


def test_plan_writes_a_loadable_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code = main(
        [
            "plan",
            "--model",
            "gpt2-small",
            "--cluster",
            "dgx-a100-80gb:1",
            "--global-batch-size",
            "64",
            "--seq-len",
            "1024",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    shown = capsys.readouterr().out
    assert "autopar plan: GPT" in shown and "Predicted" in shown
    plan = Plan.load(out)
    assert plan.config.world_size == 8


def test_estimate_reports_when_it_does_not_fit(capsys):
    code = main(
        [
            "estimate",
            "--model",
            "gpt3-175b",
            "--cluster",
            "dgx-a100-80gb:1",
            "--global-batch-size",
            "8",
            "--set",
            "tp=8",
        ]
    )
    captured = capsys.readouterr()
    assert code == 3 and "DOES NOT FIT" in captured.err


def test_json_output_and_constraints(capsys):
    code = main(
        [
            "plan",
            "--model",
            "gpt2-small",
            "--cluster",
            "dgx-a100-80gb:1",
            "--global-batch-size",
            "64",
            "--seq-len",
            "512",
            "--set",
            "tp=2",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["tp"] == 2 and data["model"]["seq_len"] == 512


def test_errors_are_one_line(capsys):
    assert main(["plan", "--model", "nope", "--cluster", "dgx-a100-80gb:1", "--global-batch-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: unknown model 'nope'") and "Traceback" not in err
    assert main(["plan", "--model", "gpt2-small", "--cluster", "dgx-a100-80gb:x", "--global-batch-size", "8"]) == 2
    assert "node count" in capsys.readouterr().err


def test_listing_commands(capsys):
    assert main(["presets"]) == 0 and "dgx-h100" in capsys.readouterr().out
    assert main(["models"]) == 0 and "llama3-405b" in capsys.readouterr().out


def test_parse_assignments():
    assert parse_assignments(["tp=8,pp=2", "recompute=full", "sequence_parallel=true"]) == {
        "tp": 8,
        "pp": 2,
        "recompute": "full",
        "sequence_parallel": True,
    }
    assert parse_assignments(["dp_shard=none,recompute=none", "zero_stage=3"]) == {
        "dp_shard": None,  # plain FSDP
        "recompute": "none",  # the mode
        "zero_stage": 3,
    }
    assert parse_assignments(["dp_shard=8"]) == {"dp_shard": 8}


def test_python_warnings_print_as_one_line_each():
    """A warning raised while a command runs prints as the command line's own: one line,
    ``warning:`` and the message, without the source line Python adds under it (what an
    FP8 dry run on CPU printed: ``job = parallelize(``); another package's warning names
    its category and place. pytest records warnings in its own process, so the console
    script runs in a fresh one, its ``presets`` command made to warn."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import sys, warnings
        from autopar import cli
        from autopar.runtime import dry_run

        def warn(args):  # one as raised in autopar's dry run, one from another package
            warnings.warn_explicit("fp8=True on cpu: emulated", UserWarning, dry_run.__file__, 417)
            warnings.warn_explicit("old knob", DeprecationWarning, "/site-packages/other/mod.py", 7)
            return 0

        cli.cmd_presets = warn
        sys.exit(cli.main(["presets"]))
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "warning: fp8=True on cpu: emulated"
    assert lines[1] == "warning: old knob (DeprecationWarning at /site-packages/other/mod.py:7)"
    assert len(lines) == 2


def test_a_field_set_twice_is_refused():
    """``--set tp=2,tp=4`` kept the last value without a word: the user meant one of them."""
    with pytest.raises(ConfigError, match=r"--set tp= is given twice \(tp=2 and tp=4\)"):
        parse_assignments(["tp=2", "pp=2,tp=4"])


def test_plan_on_the_fewest_nodes(tmp_path, capsys):
    """--fewest-nodes plans on the fewest nodes of the cluster's type (its count unused):
    Llama 3 70B on A100 40GB, batch 256 of 8K tokens, needs 6 DGX nodes (its dp=1
    pipeline casts each stage's weights once, and holds their bf16 gradients until the
    stage's backward is over); 4 nodes are refused when planned directly, and a bound of
    4 refuses in one line, as --max-nodes without --fewest-nodes does before any search."""
    args = ["plan", "--model", "llama3-70b", "--global-batch-size", "256", "--seq-len", "8192"]
    out = tmp_path / "plan.json"
    assert main([*args, "--cluster", "dgx-a100-40gb:64", "--fewest-nodes", "--out", str(out)]) == 0
    shown = capsys.readouterr()
    plan = Plan.load(out)
    assert plan.cluster.nodes == 6 and plan.prediction.fits
    assert "fewest nodes of dgx-a100-40gb a plan fits on: 6 (48 devices;" in shown.err
    assert main([*args, "--cluster", "dgx-a100-40gb:4"]) == 2
    assert "no plan fits" in capsys.readouterr().err
    assert main([*args, "--cluster", "dgx-a100-40gb", "--fewest-nodes", "--max-nodes", "4"]) == 2
    assert capsys.readouterr().err.startswith("autopar: error: no plan fits on up to 4 nodes of dgx-a100-40gb")
    assert main([*args, "--cluster", "dgx-a100-40gb:4", "--max-nodes", "4"]) == 2
    assert "--max-nodes 4 is only used with --fewest-nodes" in capsys.readouterr().err
