"""Inputs the command line refuses in one line (exit code 2) before the work they would
spoil: an output path that cannot be written (checked before the model is planned or
measured, not when the result is written), a checkpoint's custom code that is missing or
not Python, and a sequence length for a ``--model-fn`` model that takes no token ids,
said in the command line's own flags."""

import argparse
import importlib
import json
import os
import shlex
import threading
from pathlib import Path

import pytest
import torch

import autopar
from autopar import codec
from autopar.cli import main
from autopar.models import GPT, GPTConfig
from profiler.cli import check_report_out

CPU = "--cluster local-cpu:1 --global-batch-size 4"


def _run(command: str, capsys) -> tuple[int, list[str]]:
    """The exit code and the lines on stderr of ``autopar command``."""
    try:
        code = main(shlex.split(command))
    except SystemExit as stopped:
        code = stopped.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder holding a plan of a tiny GPT for 2 ranks and ``afile``, a regular file."""
    folder = tmp_path_factory.mktemp("refusals")
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, seq_len=64, dim=64, n_layers=2, n_heads=2))
    autopar.estimate(
        model, autopar.preset("local-cpu", devices_per_node=2), {"dp": 2}, global_batch_size=4, seq_len=16
    ).save(folder / "plan.json")
    (folder / "afile").write_text("")
    return folder


def _refuse_to_run(monkeypatch, target: str) -> None:
    """Make ``module:attribute`` (the work a command would do) fail the test if called."""
    module, _, name = target.partition(":")

    def ran(*args, **kwargs):
        raise AssertionError(f"{target} ran before the output path was checked")

    monkeypatch.setattr(importlib.import_module(module), name, ran)


UNDER_A_FILE = {
    # "command flag": the command line (that flag's path under {d}/afile, a file), the work it must not start
    "plan --out": (f"plan --model gpt2-small --seq-len 16 {CPU} --out {{d}}/afile/plan.json", "autopar.cli:load_model"),
    "plan --html": (f"plan --model gpt2-small --seq-len 16 {CPU} --html {{d}}/afile/p.html", "autopar.cli:load_model"),
    "estimate --out": (
        f"estimate --model gpt2-small --seq-len 16 {CPU} --set dp=2 --out {{d}}/afile/e.json",
        "autopar.cli:load_model",
    ),
    "export --out": ("export {d}/plan.json --to deepspeed --out {d}/afile/ds.json", "autopar.export.cli:export"),
    "report --html": ("report {d}/plan.json --html {d}/afile/r.html", "autopar.present.report:save_html"),
    "profile model --out": (
        "profile model --model gpt2-small --seq-len 128 --repeats 1 --out {d}/afile/x.json",
        "profiler.cli:load_model",
    ),
    "profile device --out": ("profile device --out {d}/afile/sub/d.json", "profiler.device:profile_device"),
    "profile network --out": ("profile network --nproc 2 --out {d}/afile/n.json", "autopar.runtime.spmd:run_spmd"),
    "profile report --html": ("profile report {d}/plan.json --html {d}/afile/r.html", "profiler.render:render_html"),
    "profile report --markdown": (
        "profile report {d}/plan.json --markdown {d}/afile/r.md",
        "profiler.render:render_markdown",
    ),
    "doctor --out": ("doctor --nproc 2 --out {d}/afile/d.json", "profiler.launch:launch_local"),
}


@pytest.mark.parametrize("case", list(UNDER_A_FILE))
def test_an_output_under_a_file_is_refused_before_the_work(case, folder, capsys, monkeypatch):
    """Every command says the same of a path whose folder is a file: that file is not a
    directory (they said File exists, or Not a directory, or a traceback), before it
    builds, plans or measures anything."""
    command, work = UNDER_A_FILE[case]
    _refuse_to_run(monkeypatch, work)
    code, lines = _run(command.format(d=folder), capsys)
    assert code == 2, lines
    (line,) = lines
    flag = case.split()[-1]
    assert line.startswith(f"autopar: error: {flag} '{folder}/afile/"), line
    assert f"('{folder}/afile' is a file, not a directory); give a file path in a writable directory." in line


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_the_doctor_refuses_a_folder_that_takes_no_file_before_the_ranks_start(capsys, monkeypatch):
    """``/proc`` takes no new file: the doctor said its verdict, then a traceback of the
    temporary file it could not create."""
    _refuse_to_run(monkeypatch, "profiler.launch:launch_local")
    code, lines = _run("doctor --nproc 2 --out /proc/d.json", capsys)
    assert code == 2
    assert lines == [
        "autopar: error: --out '/proc/d.json' cannot be written (no file can be created in '/proc': No such file or "
        "directory); give a file path in a writable directory."
    ]


def test_only_the_rank_that_writes_checks_the_report_path(folder, monkeypatch):
    """Under a launcher rank 0 writes the report, so it alone refuses a bad --out (another
    node need not have the folder); a local launch writes it from this process."""
    bad = argparse.Namespace(nproc=None, out=folder / "afile" / "n.json")
    monkeypatch.setenv("RANK", "1")
    check_report_out(bad)
    with pytest.raises(autopar.ConfigError, match="is a file, not a directory"):
        check_report_out(argparse.Namespace(nproc=2, out=bad.out))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(autopar.ConfigError, match="is a file, not a directory"):
        check_report_out(bad)


def test_the_check_writes_nothing_and_a_save_names_the_file_in_the_way(folder, tmp_path):
    """The check leaves no probe file behind; a plan saved from Python under a file says
    that file is not a directory (mkdir said File exists)."""
    assert codec.check_writable(tmp_path / "new" / "plan.json") == tmp_path / "new" / "plan.json"
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(NotADirectoryError, match="afile' is a file, not a directory"):
        autopar.Plan.load(folder / "plan.json").save(folder / "afile" / "plan.json")


CUSTOM_CODE = {
    # the files beside config.json, what the one line says
    "model code missing": ({}, "its custom code '{d}/modeling_foo.py' is missing; copy the checkpoint's .py files"),
    "model code not Python": (
        {"modeling_foo.py": "def build(\n"},
        "its custom code '{d}/modeling_foo.py' is not valid Python ('(' was never closed, line 1); fix the file",
    ),
    "code it imports missing": (
        {"modeling_foo.py": "from .layers_foo import Block\n"},
        "its custom code '{d}/layers_foo.py' is missing",
    ),
}
COMMANDS = {
    "plan": f"plan --seq-len 16 {CPU}",
    "export": "export {plan} --to deepspeed",
    "dry-run": "dry-run --plan {plan}",
}


@pytest.mark.parametrize("command", list(COMMANDS.values()), ids=list(COMMANDS))
@pytest.mark.parametrize(("files", "said"), list(CUSTOM_CODE.values()), ids=list(CUSTOM_CODE))
def test_custom_code_that_cannot_be_imported_is_said_in_one_line(
    command, files, said, folder, tmp_path, capsys, monkeypatch
):
    """A checkpoint whose auto_map names a module that is missing, or one Python cannot
    parse, was transformers' traceback (exit code 1); nothing is downloaded or imported."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 256}
    auto_map = {"AutoModelForCausalLM": "modeling_foo.FooForCausalLM", "AutoTokenizer": ["tokenizer_foo.T", None]}
    (checkpoint / "config.json").write_text(json.dumps(config | {"auto_map": auto_map}))
    for name, text in files.items():
        (checkpoint / name).write_text(text)
    argv = f"{command.format(plan=folder / 'plan.json')} --model-config {checkpoint} --trust-remote-code"
    code, lines = _run(argv, capsys)
    assert code == 2, lines
    (line,) = lines
    assert line.startswith(f"autopar: error: --model-config '{checkpoint}/config.json': "), line
    assert said.format(d=checkpoint) in line
    assert not (tmp_path / "modules").exists()


def test_a_sequence_length_for_a_model_fn_without_tokens_names_the_flag_to_use(tmp_path, capsys, monkeypatch):
    """An image model from --model-fn given --seq-len was told to pass sample_input= (the
    Python API's keyword); the command line's flag is --sample-shape."""
    (tmp_path / "vision.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code, lines = _run(f"plan --model-fn vision:build --seq-len 128 {CPU}", capsys)
    assert code == 2
    assert lines == [
        "autopar: error: --seq-len 128 is for token models, but --model-fn 'vision:build' built a Sequential with no "
        "nn.Embedding to take token ids; give --sample-shape with one sample's dimensions instead, e.g. 3,224,224."
    ]


def test_outputs_write_through_links_and_into_pipes(tmp_path, capsys):
    """A plan written to a symbolic link replaces the file it points to and keeps the
    link; one written to a named pipe reaches its reader. Both were renamed over: the
    link became a file (its target unchanged), the pipe's reader read nothing."""
    target = tmp_path / "shared" / "plan.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "plan.json"
    link.symlink_to(target)
    args = "plan --model gpt2-small --cluster dgx-a100-80gb:1 --global-batch-size 8 --seq-len 128 --out"
    assert _run(f"{args} {link}", capsys)[0] == 0
    assert link.is_symlink() and autopar.Plan.load(target).config.world_size == 8
    pipe = tmp_path / "plan.fifo"
    os.mkfifo(pipe)
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(pipe.read_text()), daemon=True)
    reader.start()
    assert _run(f"{args} {pipe}", capsys)[0] == 0
    reader.join(timeout=60)
    assert pipe.is_fifo() and autopar.Plan.from_json(read[0]).config.world_size == 8


def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, capsys):
    """The plan file given to report as its --html, a cluster file as plan's --out, --out
    and --html the same path: each is refused before any work, naming both, and the
    input is left as it was (each was overwritten, exit 0)."""
    plan_file = tmp_path / "plan.json"
    args = "--model gpt2-small --global-batch-size 8 --seq-len 128"
    assert _run(f"plan {args} --cluster dgx-h100:1 --out {plan_file}", capsys)[0] == 0
    cluster = tmp_path / "cluster.json"
    assert _run(f"presets --save dgx-h100:1 {cluster}", capsys)[0] == 0
    before = {p: p.read_bytes() for p in (plan_file, cluster)}
    cases = {
        f"report {plan_file} --html {plan_file}": f"--html '{plan_file}' is plan file '{plan_file}' too",
        f"plan {args} --cluster {cluster} --out {cluster}": f"--out '{cluster}' is --cluster '{cluster}' too",
        f"plan {args} --cluster {cluster} --out {tmp_path / 'x'} --html {tmp_path / 'x'}": "--html",
    }
    for command, said in cases.items():
        code, lines = _run(command, capsys)
        assert code == 2 and len(lines) == 1 and said in lines[0], (command, lines)
        assert lines[0].endswith("writing it would replace that file; give another path.")
    assert {p: p.read_bytes() for p in before} == before and not (tmp_path / "x").exists()
