"""Bad input never reaches a person as a traceback: the command prints one line, ``autopar:
error: ...``, naming the value, what is allowed and what to do, and exits with 2; the
public API raises a typed error saying the same."""

import argparse
import json
import re
import shlex

import pytest
import torch

import autopar
from autopar import ClusterError, ConfigError, PlanFormatError
from autopar.cli import build_parser, main
from autopar.models import GPT, GPTConfig
from autopar.search.plan_inputs import MAX_GLOBAL_BATCH

TINY = GPTConfig(vocab_size=256, seq_len=64, dim=64, n_layers=2, n_heads=2)
PLAN = "--model gpt2-small --seq-len 16 --global-batch-size 8"
DGX = f"plan {PLAN} --cluster dgx-a100-80gb:1"
CPU = f"plan {PLAN} --cluster local-cpu:1"


def tiny_gpt() -> GPT:
    with torch.device("meta"):
        return GPT(TINY)


def two_cpus() -> autopar.Cluster:
    return autopar.preset("local-cpu", devices_per_node=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with a plan for 2 ranks, an empty script and malformed JSON files."""
    folder = tmp_path_factory.mktemp("cli_errors")
    autopar.estimate(tiny_gpt(), two_cpus(), {"dp": 2}, global_batch_size=4, seq_len=16).save(folder / "plan.json")
    (folder / "script.py").write_text("")
    (folder / "broken.json").write_text('{"schema": ')
    (folder / "list.json").write_text("[1, 2]")
    (folder / "future.json").write_text(json.dumps({"schema": "autopar-profile", "schema_version": 99}))
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    llama |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}
    (folder / "dtype.json").write_text(json.dumps(llama | {"torch_dtype": "float99"}))
    experts = {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8}
    (folder / "top8of4.json").write_text(json.dumps(llama | experts))
    (folder / "nolayers.json").write_text(json.dumps(llama | {"num_hidden_layers": 0}))
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 0, "vocab_size": 256}
    (folder / "gpt2_nolayers.json").write_text(json.dumps(gpt2 | {"bos_token_id": 0, "eos_token_id": 0}))
    return folder


CLI_CASES = {
    # malformed profiles, under plan --profile and profile report
    "profile not JSON": (f"{CPU} --profile {{d}}/broken.json", ["broken.json", "not valid JSON"]),
    "profile a list": (f"{CPU} --profile {{d}}/list.json", ["list.json", "JSON object"]),
    "profile of a future version": (f"{CPU} --profile {{d}}/future.json", ["schema_version 99", "upgrade autopar"]),
    "profile is a plan": (
        f"{CPU} --profile {{d}}/plan.json",
        ["is a plan file, not a profile report", "autopar report"],
    ),
    "report not JSON": ("profile report {d}/broken.json", ["broken.json", "not valid JSON"]),
    "report missing": ("profile report {d}/missing.json", ["missing.json", "does not exist"]),
    "report a folder": ("profile report {d}", ["cannot be read", "JSON file"]),
    # dry-run --ranks
    "export onto its own plan file": (
        "export {d}/plan.json --to deepspeed --out {d}/plan.json",
        ["plan.json' is the plan file itself", "give another path"],
    ),
    "dry run of a broken plan file": ("dry-run --plan {d}/broken.json --model gpt2-small", ["broken.json", "JSON"]),
    "ranks past the world": ("dry-run --plan {d}/plan.json --model gpt2-small --ranks 99", ["rank 99", "0 to 1"]),
    "ranks negative": ("dry-run --plan {d}/plan.json --model gpt2-small --ranks -1", ["rank -1", "0 to 1"]),
    "ranks not numbers": ("dry-run --plan {d}/plan.json --model gpt2-small --ranks a", ["'a'", "0 to 1"]),
    "ranks twice": ("dry-run --plan {d}/plan.json --model gpt2-small --ranks 0,0", ["twice"]),
    # run's arguments
    "timeout negative": ("run --plan {d}/plan.json --nproc-per-node 2 --pg-timeout-s -5 {d}/script.py", ["-5", "> 0"]),
    "timeout nan": ("run --plan {d}/plan.json --nproc-per-node 2 --pg-timeout-s nan {d}/script.py", ["nan", "> 0"]),
    "no processes": ("run --plan {d}/plan.json --nproc-per-node 0 {d}/script.py", ["--nproc-per-node 0", "positive"]),
    "node rank past the nodes": (
        "run --plan {d}/plan.json --nproc-per-node 2 --node-rank 3 {d}/script.py",
        ["--node-rank 3", "0 to 0"],
    ),
    "script missing": ("run --plan {d}/plan.json --nproc-per-node 2 {d}/nope.py", ["nope.py", "does not exist"]),
    # sequences and samples
    "sequence of 0": (f"{CPU} --seq-len 0", ["--seq-len 0", "positive integer", "leave it out"]),
    "sequence past the positions": (f"{CPU} --seq-len 4096", ["seq_len=4096", "1024 positions", "seq_len <= 1024"]),
    "sequence for a non-token model": (
        "plan --model mlp-wide --cluster local-cpu:1 --global-batch-size 8 --seq-len 16",
        ["--seq-len is for token models", "mlp-wide"],
    ),
    "sample with a zero": (
        "plan --model resnet-small --cluster local-cpu:1 --global-batch-size 8 --sample-shape 3,0,224",
        ["'3,0,224'", "positive integers"],
    ),
    "sample past any memory": (
        "plan --model resnet-small --cluster local-cpu:1 --global-batch-size 8 --sample-shape 3,99999999999999999999,2",
        ["'3,99999999999999999999,2'", "6e+20 values per sample", "more than 2^40"],
    ),
    "features of another width": (
        "plan --model mlp-wide --cluster local-cpu:1 --global-batch-size 8 --sample-shape 8192",
        ["--sample-shape 8192 does not fit mlp-wide", "features of shape (1024,)", "--sample-shape 1024"],
    ),
    "images of other channels": (
        "plan --model resnet-small --cluster local-cpu:1 --global-batch-size 8 --sample-shape 1,224,224",
        ["--sample-shape 1,224,224 does not fit resnet-small", "images of shape (3, 224, 224)"],
    ),
    "model function that fails": (
        "plan --model-fn torch.nn:Linear --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["torch.nn:Linear", "TypeError", "no arguments"],
    ),
    "model function returning no module": (
        "plan --model-fn os:getcwd --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["os:getcwd", "not a torch.nn.Module"],
    ),
    "model config not JSON": (
        "plan --model-config {d}/broken.json --cluster local-cpu:1 --global-batch-size 8",
        ["--model-config", "broken.json"],
    ),
    "model config of a dtype torch lacks": (
        "plan --model-config {d}/dtype.json --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["dtype.json", "float99", "config transformers can read"],
    ),
    "more experts per token than experts": (
        "plan --model-config {d}/top8of4.json --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["num_experts_per_tok=8 of its num_local_experts=4 experts", "between 1 and 4"],
    ),
    "model config of no layers": (
        "plan --model-config {d}/nolayers.json --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["nolayers.json' has num_hidden_layers=0", "embedding and head alone", "1 or more"],
    ),
    "GPT-2 config of no layers, in its own words": (
        "plan --model-config {d}/gpt2_nolayers.json --seq-len 8 --cluster local-cpu:1 --global-batch-size 8",
        ["has n_layer=0"],
    ),
    "routing imbalance of a dense model": (
        f"{DGX} --routing-imbalance 1.5",
        ["routing_imbalance=1.5", "leave it at 1"],
    ),
    "ZeRO stage not an integer": (f"{DGX} --set zero_stage=1.0", ["zero_stage=1.0", "use 0, 1, 2 or 3"]),
    "an odd sequence over a ring": (
        "plan --model gpt2-small --seq-len 15 --global-batch-size 8 --cluster dgx-a100-80gb:1 --set cp=2",
        ["cp=2 is not allowed with seq_len=15", "use cp=1 or a sequence length divisible by 4."],
    ),
    "a ring degree that cuts no sequence, on 16 devices": (
        "plan --model gpt2-small --seq-len 1000 --global-batch-size 8 --cluster dgx-a100-80gb:2 --set cp=3",
        ["cp=3 is not allowed with seq_len=1000", "use a cp in [2, 4] or"],  # 5, 10, 20... cut 1000, not 16
    ),
    # sizes, degrees and clusters
    "output is a folder": (f"{CPU} --out {{d}}", ["--out", "cannot be written", "file path"]),
    "output of no name": (f"{CPU} --out ''", ["--out ''", "cannot be written", "file path"]),
    "sequence parallel without tp": (
        f"{DGX} --set tp=1 --set sequence_parallel=true",
        ["sequence_parallel=True", "tp=1"],
    ),
    "async TP without tp": (f"{DGX} --set tp=1 --set async_tp=true", ["async_tp=True with tp=1", "allow tp > 1"]),
    "stages per rank without a pipeline": (
        f"{DGX} --set pp=1 --set virtual_stages=3",
        ["virtual_stages=3 with pp=1", "no pipeline"],
    ),
    "schedule without a pipeline": (
        f"{DGX} --set pp=1,schedule=interleaved-1f1b",
        ["schedule='interleaved-1f1b' with pp=1", "no pipeline"],
    ),
    "a compiled zero-bubble schedule without a pipeline": (  # the pipeline first: no pp=1 schedule runs
        f"{DGX} --set pp=1,schedule=zbv,compile=true",
        ["schedule='zbv' with pp=1", "no pipeline"],
    ),
    "estimate of stages per rank without a pipeline": (
        f"estimate {PLAN} --cluster dgx-a100-80gb:1 --set schedule=interleaved-1f1b",
        ["schedule='interleaved-1f1b' runs several stages per rank", "no pp was given", "set pp to 2 or more"],
    ),
    "a V of three stages": (
        f"{DGX} --set pp=2,schedule=zbv,virtual_stages=3",
        ["schedule='zbv' with virtual_stages=3 is not allowed", "exactly 2 stages per pipeline rank"],
    ),
    "one stage per rank, twice": (
        f"{DGX} --set pp=2,schedule=1f1b,virtual_stages=2",
        ["schedule='1f1b' with virtual_stages=2 is not allowed", "one stage per pipeline rank"],
    ),
    "a field set twice": (f"{DGX} --set tp=2,tp=4", ["tp= is given twice", "tp=2 and tp=4"]),
    "estimate refusal names only what was set": (
        "estimate --model gpt2-small --seq-len 16 --global-batch-size 8 --cluster dgx-a100-80gb:1 "
        "--set pp=2,micro_batch_size=8",
        ["with constraints pp=2, micro_batch_size=8:", "does not divide"],
    ),
    "dp not dividing": (f"{DGX} --set dp=3", ["dp=3", "8 devices", "[1, 2, 4, 8]"]),
    "micro-batch not dividing": (f"{DGX} --set micro_batch_size=3", ["micro_batch_size=3", "does not divide"]),
    "micro-batch above the batch": (
        f"estimate {PLAN} --cluster dgx-a100-80gb:1 --set micro_batch_size=16",
        ["micro_batch_size=16", "samples per data-parallel rank"],
    ),
    "no nodes": (f"plan {PLAN} --cluster local-cpu:0", ["nodes=0", "positive integer"]),
    "more processes than memory": (f"plan {PLAN} --cluster local-cpu:100000", ["local-cpu", "fewer than"]),
    "unknown preset": (f"plan {PLAN} --cluster dgx-z:1", ["unknown cluster preset 'dgx-z'", "--cluster cluster.json"]),
    "no node count": (f"plan {PLAN} --cluster dgx-h100:", ["dgx-h100:", "node count"]),
    "cluster is a folder": (f"plan {PLAN} --cluster {{d}}", ["cluster file", "cannot be read"]),
    "not a number": (
        f"{CPU} --global-batch-size x",
        ["argument --global-batch-size: 'x' is not allowed", "a positive integer", "autopar plan --help"],
    ),
    "no batch": (f"{CPU} --global-batch-size 0", ["argument --global-batch-size: '0' is not allowed"]),
    "unknown optimizer": (f"{CPU} --optimizer lamb", ["'lamb'", "adam"]),
    "no command": ("", ["command"]),
    # the profiler, the doctor and the demo
    "profile sequence of 0": ("profile model --model gpt2-small --seq-len 0 --out {d}/m.json", ["--seq-len 0"]),
    "profile no repeats": (
        "profile model --model gpt2-small --repeats 0 --out {d}/m.json",
        ["argument --repeats: '0' is not allowed", "integer >= 1"],
    ),
    "profile no threads": ("profile model --model gpt2-small --threads 0 --out {d}/m.json", ["--threads: '0'"]),
    "network sizes that never grow": (
        "profile network --nproc 2 --factor 1 --out {d}/n.json",
        ["argument --factor: '1' is not allowed", "integer >= 2"],
    ),
    "profile model function that fails": (
        "profile model --model-fn torch.nn:Linear --seq-len 8 --out {d}/m.json",
        ["torch.nn:Linear", "TypeError"],
    ),
    "profile unknown device": ("profile model --model gpt2-small --device gpu0 --out {d}/m.json", ["'gpu0'", "cuda:N"]),
    "profile into a folder": ("profile model --model gpt2-small --out {d}", ["--out", "is a directory"]),
    "network unknown level": ("profile network --nproc 2 --levels rack --out {d}/n.json", ["rack", "intra"]),
    "network between nodes on one": (
        "profile network --nproc 2 --levels inter --out {d}/n.json",
        ["--levels inter", "every process on this machine", "add intra"],
    ),
    "network timeout negative": ("profile network --nproc 2 --timeout -1 --out {d}/n.json", ["--timeout", "> 0"]),
    "doctor ratio above 1": ("doctor --nproc 2 --slow-ratio 2", ["--slow-ratio", "between 0 and 1"]),
    "doctor no processes": ("doctor --nproc 0", ["--nproc 0", "at least 1"]),
    "demo one process": ("demo --nproc 1", ["--nproc 1", "at least 2"]),
    "demo no timed step": ("demo --steps 2", ["--steps 2", "at least 3"]),
    "export unknown model": (
        "export {d}/p.json --to megatron --model nosuch",
        ["unknown model 'nosuch'", "Or use --model-config (a transformers config JSON or checkpoint directory)."],
    ),
}


def _run(argv: list[str], capsys) -> tuple[int, str]:
    """The exit code and stderr of ``autopar argv`` (argparse's own errors exit)."""
    try:
        code = main(argv)
    except SystemExit as stopped:
        code = stopped.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("command", "words"), list(CLI_CASES.values()), ids=list(CLI_CASES))
def test_command_says_what_is_wrong_in_one_line(command, words, folder, capsys):
    code, err = _run(shlex.split(command.format(d=folder)), capsys)
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("autopar: error: "), err
    for word in words:
        assert word in lines[0]


def test_an_unknown_model_is_offered_only_the_sources_the_command_takes(folder, capsys):
    """``autopar export`` has no --model-fn; ``autopar plan`` has."""
    _, err = _run(["export", f"{folder}/p.json", "--to", "megatron", "--model", "nosuch"], capsys)
    assert "--model-fn" not in err
    _, err = _run(["plan", "--model", "nosuch", "--cluster", "dgx-h100:1", "--global-batch-size", "8"], capsys)
    assert err.rstrip().endswith("Or use --model-config (a transformers config JSON) or --model-fn module:function.")


def test_a_model_function_that_exits_or_is_not_on_the_path_is_said(tmp_path, monkeypatch, capsys):
    """A --model-fn module beside the user that is not on the import path gets the
    hint to add it; one whose import or function calls sys.exit ended the process
    without a word (exit code 4)."""
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(4)\n")
    (tmp_path / "exits_when_called.py").write_text("import sys\n\ndef build():\n    sys.exit(5)\n")
    monkeypatch.chdir(tmp_path)
    command = "plan --seq-len 8 --cluster local-cpu:1 --global-batch-size 8 --model-fn"
    code, err = _run([*command.split(), "exits_on_import:build"], capsys)
    assert code == 2 and "exits_on_import.py is here" in err and "set PYTHONPATH=. to add it" in err, err
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = _run([*command.split(), "exits_on_import:build"], capsys)
    assert code == 2 and "importing it called sys.exit(4)" in err, err
    code, err = _run([*command.split(), "exits_when_called:build"], capsys)
    assert code == 2 and "called sys.exit(5) instead of returning a torch.nn.Module" in err, err


API_CASES = {
    "optimizer": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=16, optimizer="lamb"),
        ConfigError,
        "optimizer='lamb' is not allowed; use one of 'adam'",
    ),
    "attention": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=16, attention="sparse"),
        ConfigError,
        "attention='sparse' is not allowed; use one of 'flash', 'materialized'",
    ),
    "estimate's optimizer": (
        lambda: autopar.estimate(tiny_gpt(), two_cpus(), {}, global_batch_size=4, seq_len=16, optimizer="lamb"),
        ConfigError,
        "optimizer='lamb'",
    ),
    "cluster of another type": (
        lambda: autopar.plan(tiny_gpt(), None, global_batch_size=4, seq_len=16),
        ClusterError,
        "cluster=None is not allowed: give an autopar.Cluster",
    ),
    "cluster spec of an unknown preset": (
        lambda: autopar.plan(tiny_gpt(), "nope:2", global_batch_size=4, seq_len=16),
        ClusterError,
        "unknown cluster preset 'nope'",
    ),
    "constraints as a string": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=16, constraints="tp=2"),
        ConfigError,
        "constraints='tp=2' is not allowed: give a mapping",
    ),
    "estimate's config as a string": (
        lambda: autopar.estimate(tiny_gpt(), two_cpus(), "tp=2", global_batch_size=4, seq_len=16),
        ConfigError,
        "config='tp=2' is not allowed",
    ),
    "dp not dividing": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=16, constraints={"dp": 3}),
        ConfigError,
        r"dp=3 does not divide the cluster's 2 devices; fix dp to one of \[1, 2\]",
    ),
    "runners-up below 0": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=16, top=-1),
        ConfigError,
        "top=-1 is not allowed",
    ),
    "sequence of 0": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=0),
        ConfigError,
        "seq_len=0 is not allowed",
    ),
    "sequence past the positions": (
        lambda: autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=4, seq_len=65),
        ConfigError,
        r"seq_len=65 is longer than the 64 positions GPT was built for \(config.seq_len\); give seq_len <= 64",
    ),
    "more local processes than memory": (
        lambda: autopar.preset("local-cpu", nodes=10**9),
        ClusterError,
        "use fewer than",
    ),
    "spec without its node count": (lambda: autopar.parse_cluster("dgx-h100:"), ClusterError, "node count"),
    "cluster file path None": (lambda: autopar.load_cluster(None), ClusterError, "cluster file path None"),
    "plan file path None": (lambda: autopar.Plan.load(None), PlanFormatError, r"Plan.load\(None\): give the path"),
    "explain of a number": (lambda: autopar.explain(5), ConfigError, "explain\\(\\) takes a Plan"),
}


@pytest.mark.parametrize(("call", "error", "pattern"), list(API_CASES.values()), ids=list(API_CASES))
def test_api_raises_a_typed_error(call, error, pattern):
    with pytest.raises(error, match=pattern) as raised:
        call()
    assert "\n" not in str(raised.value)


def test_cluster_may_be_a_spec_string():
    plan = autopar.plan(tiny_gpt(), "dgx-a100-80gb:1", global_batch_size=8, seq_len=16)
    assert plan.config.world_size == 8
    est = autopar.estimate(tiny_gpt(), "dgx-a100-80gb:1", {"tp": 2}, global_batch_size=8, seq_len=16)
    assert est.config.tp == 2


@pytest.mark.timeout(60)
def test_the_largest_batch_is_planned_and_a_larger_one_refused():
    """The largest batch a plan takes divides over the ranks exactly; 10**18 samples,
    which planned in seconds here but built schedules of gigabytes for an interleaved
    pipeline, is refused (:data:`autopar.search.plan_inputs.MAX_GLOBAL_BATCH`)."""
    plan = autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=MAX_GLOBAL_BATCH, seq_len=16)
    c = plan.config
    assert c.dp * c.micro_batch_size * c.num_microbatches == MAX_GLOBAL_BATCH
    with pytest.raises(ConfigError, match="at most 1,048,576"):
        autopar.plan(tiny_gpt(), two_cpus(), global_batch_size=10**18, seq_len=16)


def _help_texts(parser: argparse.ArgumentParser, name: str):
    yield name, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _help_texts(sub, f"{name} {sub_name}")


def test_help_texts_are_plain_words():
    markup = re.compile(r"``|:(func|mod|class|meth|attr)?:`")
    for name, text in _help_texts(build_parser(), "autopar"):
        assert not markup.search(text), f"'{name} --help' prints reStructuredText markup"


def test_a_model_that_fails_on_fake_tensors_is_said_without_torchs_logged_traceback(tmp_path):
    """torch logs the whole traceback of an op that fails on fake tensors (some hundred
    lines) before raising it; the trace says the failure in one line, so the log is held
    back. Run in a fresh process: torch's log handler writes to the stderr it found."""
    import subprocess
    import sys

    layers = "nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)"
    (tmp_path / "mymod.py").write_text(f"from torch import nn\n\ndef build():\n    return nn.Sequential({layers})\n")
    command = "plan --model-fn mymod:build --cluster dgx-h100:1 --global-batch-size 8 --sample-shape 17"
    script = f"import sys; from autopar.cli import main; sys.exit(main({command.split()!r}))"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("autopar: error: tracing Sequential on fake tensors failed: RuntimeError:")
    assert "[1, 17] X [16, 32]. Check that the sample input" in lines[0]  # one full stop
