"""``--model-config`` on the command line: a Hugging Face config file or checkpoint
directory, built (random weights, meta device) as the class its ``architectures`` names,
on ``plan``, ``estimate``, ``dry-run`` and ``profile model``; the defaults it takes are
said, and every refusal is one line with exit code 2."""

import json
import shlex
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from autopar.cli import main  # noqa: E402

CPU = "--cluster local-cpu:1 --global-batch-size 4"
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 64,
}
CUSTOM_CONFIG = """from transformers import LlamaConfig


class TinyConfig(LlamaConfig):
    model_type = "tiny-custom"
"""
CUSTOM_MODEL = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyConfig


class TinyForCausalLM(LlamaForCausalLM):
    config_class = TinyConfig
"""


def _saved(config, folder, **extra):
    """``config`` saved as a checkpoint directory's config.json, with ``extra`` fields."""
    config.save_pretrained(folder)
    if extra:
        data = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**data, **extra}))
    return folder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Checkpoint directories of tiny llama (without architectures), BERT, T5 and ViT
    configs, and broken or custom-code ones."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {name: root / name for name in ("llama", "gpt2", "bert", "t5", "t5-encoder", "vit", "custom", "mismatch")}
    for d in dirs.values():
        d.mkdir()
    _saved(transformers.LlamaConfig(**TINY_LLAMA), dirs["llama"])
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=1000, n_positions=64)
    _saved(gpt2, dirs["gpt2"], bos_token_id=0, eos_token_id=0)
    bert = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
        max_position_embeddings=32,
    )
    _saved(bert, dirs["bert"], architectures=["BertForMaskedLM"])
    t5 = transformers.T5Config(d_model=64, d_ff=128, d_kv=32, num_layers=2, num_heads=2, vocab_size=1000)
    _saved(t5, dirs["t5"], architectures=["T5ForConditionalGeneration"])
    _saved(t5, dirs["t5-encoder"], architectures=["T5EncoderModel"])
    vit = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8
    )
    _saved(vit, dirs["vit"], architectures=["ViTForImageClassification"])
    _saved(bert, dirs["mismatch"], architectures=["LlamaForCausalLM"])
    custom = {
        "model_type": "tiny-custom",
        "architectures": ["TinyForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_tiny.TinyConfig",
            "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        },
    }
    _saved(transformers.LlamaConfig(**TINY_LLAMA), dirs["custom"], **custom)
    (dirs["custom"] / "configuration_tiny.py").write_text(CUSTOM_CONFIG)
    (dirs["custom"] / "modeling_tiny.py").write_text(CUSTOM_MODEL)
    (root / "broken.json").write_text('{"model_type": ')
    (root / "unknown.json").write_text(json.dumps({"model_type": "no-such-type"}))
    (root / "untyped.json").write_text(json.dumps({"hidden_size": 64}))
    (root / "wrong.json").write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    llama = {**TINY_LLAMA, "model_type": "llama"}
    (root / "no-heads.json").write_text(json.dumps({**llama, "num_attention_heads": 0}))
    (root / "negative-layers.json").write_text(json.dumps({**llama, "num_hidden_layers": -3}))
    (root / "ten-million-layers.json").write_text(json.dumps({**llama, "num_hidden_layers": 10_000_000}))
    (root / "kv-groups.json").write_text(json.dumps({**llama, "num_attention_heads": 4, "num_key_value_heads": 3}))
    (root / "heads-do-not-divide.json").write_text(json.dumps({**llama, "hidden_size": 65}))
    (root / "numbered-class.json").write_text(json.dumps({**llama, "architectures": [5]}))
    (root / "one-class.json").write_text(json.dumps({**llama, "architectures": "LlamaForCausalLM"}))
    return root


def _run(command: str, capsys) -> tuple[int, str, str]:
    """The exit code, stdout and stderr of ``autopar command``."""
    try:
        code = main(shlex.split(command))
    except SystemExit as stopped:
        code = stopped.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _plan(config: str, capsys, extra: str = "") -> tuple[dict, str]:
    """The JSON plan of ``--model-config config`` on one CPU, and what went to stderr."""
    code, out, err = _run(f"plan --model-config {config} {CPU} --json {extra}", capsys)
    assert code == 0, err
    return json.loads(out), err


def test_config_file_and_checkpoint_directory_give_the_same_plan(hf, capsys):
    from_dir, _ = _plan(str(hf / "llama"), capsys, "--seq-len 32")
    from_file, _ = _plan(str(hf / "llama" / "config.json"), capsys, "--seq-len 32")
    for field in ("config", "stages", "model", "prediction"):
        assert from_dir[field] == from_file[field]


def test_architectures_name_the_class_built(hf, capsys):
    data, err = _plan(str(hf / "bert"), capsys, "--seq-len 32")
    assert data["model"]["name"] == "BertForMaskedLM"
    assert "no architectures" not in err


LONGEST = (
    "Planned for seq_len {n}, the model's maximum (config.{field}), as no sequence length was given; pass "
    "--seq-len with your training length: memory, FLOPs and the chosen plan depend on it."
)


def test_defaults_are_said(hf, capsys):
    """Without architectures the causal LM is built and named; without --seq-len the
    config's length is used, warned about in one line on stderr and kept among the
    plan's notes."""
    data, err = _plan(str(hf / "llama"), capsys)
    assert data["model"]["name"] == "LlamaForCausalLM" and data["model"]["seq_len"] == 64
    assert "model LlamaForCausalLM (the config names no architectures" in err
    warning = LONGEST.format(n=64, field="max_position_embeddings")
    assert err.splitlines().count(f"warning: {warning}") == 1 and err.count(warning) == 1
    assert warning in data["notes"]


def test_a_given_sequence_length_is_not_warned_about(hf, capsys):
    data, err = _plan(str(hf / "llama"), capsys, "--seq-len 32")
    assert data["model"]["seq_len"] == 32
    assert "warning" not in err and not any("Planned for seq_len" in n for n in data["notes"])


def test_registered_model_length_is_said(capsys):
    code, out, err = _run(f"estimate --model gpt2-small {CPU} --set micro_batch_size=1", capsys)
    assert code in (0, 3)
    warning = LONGEST.format(n=1024, field="seq_len")
    assert f"warning: {warning}" in err.splitlines()
    assert "batch 4 x 1024 tokens" in out and warning in out
    assert "adam optimizer, flash attention" in out  # a model with attention says which is priced


def test_image_model_is_planned_at_the_config_image_size(hf, capsys):
    data, err = _plan(str(hf / "vit"), capsys)
    assert data["model"]["name"] == "ViTForImageClassification"
    assert "sample 3x32x32 (the config's num_channels and image_size; pass --sample-shape to change)" in err


def test_estimate_takes_a_checkpoint_directory(hf, capsys):
    code, out, err = _run(f"estimate --model-config {hf / 'bert'} {CPU} --seq-len 16 --set micro_batch_size=1", capsys)
    assert code == 0, err
    assert "BertForMaskedLM" in out


def test_encoder_decoder_is_refused_in_one_line_naming_its_encoder(hf, capsys):
    """The planner would keep T5's whole encoder in the first pipeline stage: refused,
    pointing at T5EncoderModel, which plans (at a --seq-len given: T5's positions are
    relative, so its config has no length)."""
    code, out, err = _run(f"plan --model-config {hf / 't5'} {CPU} --seq-len 16", capsys)
    assert (code, out) == (2, "")
    [line] = err.strip().splitlines()
    assert "T5ForConditionalGeneration (t5)" in line and "encoder-decoder" in line and "T5EncoderModel" in line
    data, _ = _plan(str(hf / "t5-encoder"), capsys, "--seq-len 16")
    assert data["model"]["name"] == "T5EncoderModel"


ERRORS = {
    "missing file": ("{d}/nope.json", ["nope.json", "does not exist"]),
    "directory without config.json": ("{d}", ["without config.json", "checkpoint directory"]),
    "not JSON": ("{d}/broken.json", ["broken.json", "not valid JSON"]),
    "unknown model_type": ("{d}/unknown.json", ["'no-such-type'", "unknown to transformers"]),
    "no model_type": ("{d}/untyped.json", ["untyped.json", "no model_type"]),
    "field of the wrong type": ("{d}/wrong.json", ["wrong.json", "hidden_size"]),
    "custom code not trusted": ("{d}/custom", ["needs custom code", "--trust-remote-code"]),
    "architectures of another type": ("{d}/mismatch", ["LlamaForCausalLM", "'bert'"]),
    "sequence length for images": ("{d}/vit --seq-len 16", ["--seq-len is for token models", "ViT"]),
    "image shape for tokens": ("{d}/bert --sample-shape 3,32,32", ["--sample-shape", "token ids"]),
    "no length in the config": ("{d}/t5-encoder", ["T5EncoderModel (t5)", "no maximum sequence length", "--seq-len"]),
    "no attention heads": ("{d}/no-heads.json", ["num_attention_heads=0 is not allowed", "at least 1"]),
    "negative layers": ("{d}/negative-layers.json", ["num_hidden_layers=-3 is not allowed", "at least 0"]),
    "ten million layers": ("{d}/ten-million-layers.json", ["num_hidden_layers=10000000 is more than 10,000"]),
    "key/value heads not grouping": ("{d}/kv-groups.json", ["num_attention_heads=4 is not a multiple", "=3"]),
    "heads that do not divide": ("{d}/heads-do-not-divide.json", ["hidden size (65) is not a multiple", "(2)"]),
    "a number for a class": ("{d}/numbered-class.json", ["architectures is [5]", '["LlamaForCausalLM"]']),
}


@pytest.mark.parametrize(("given", "words"), list(ERRORS.values()), ids=list(ERRORS))
def test_bad_config_is_one_line(given, words, hf, capsys):
    code, out, err = _run(f"plan --model-config {given.format(d=hf)} {CPU}", capsys)
    assert (code, out) == (2, "")
    assert "Traceback" not in err
    [line] = err.strip().splitlines()
    assert line.startswith("autopar: error: "), line
    for word in words:
        assert word in line


def test_architectures_given_as_one_name_is_read_as_that_class(hf, capsys):
    data, _ = _plan(str(hf / "one-class.json"), capsys, "--seq-len 16")
    assert data["model"]["name"] == "LlamaForCausalLM"


def test_trust_remote_code_builds_the_custom_class(hf, capsys, tmp_path, monkeypatch):
    """The flag reaches transformers: the checkpoint's own code is run (copied to a
    temporary module cache, not the user's)."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    data, _ = _plan(str(hf / "custom"), capsys, "--seq-len 16 --trust-remote-code")
    assert data["model"]["name"] == "TinyForCausalLM"


def test_a_config_whose_own_code_fails_is_said_in_one_line(capsys, tmp_path, monkeypatch):
    """A checkpoint's configuration class that raises as it is imported (its code runs
    under --trust-remote-code) is the config's problem, said in one line like a value
    transformers cannot read; it was a traceback (a model class that raises already was
    one line). The module cache is a temporary one, and the modules it made are dropped."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    remote = tmp_path / "remote"
    remote.mkdir()
    auto_map = {"AutoConfig": "conf.MyConfig", "AutoModelForCausalLM": "mod.MyThing"}
    (remote / "config.json").write_text(json.dumps({"model_type": "mything", "auto_map": auto_map}))
    (remote / "conf.py").write_text('raise RuntimeError("boom from the config\'s code")\n')
    (remote / "mod.py").write_text("")  # the model's module is there: only the config's code fails
    code, _, err = _run(f"plan --model-config {remote} {CPU} --seq-len 16 --trust-remote-code", capsys)
    assert code == 2, err
    assert err.strip() == (
        f"autopar: error: --model-config '{remote / 'config.json'}' is not a config transformers can read (boom "
        f"from the config's code); give a config.json written by save_pretrained."
    )


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_dry_run_takes_a_model_config(name, hf, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    code, _, err = _run(f"plan --model-config {hf / name} {CPU} --seq-len 16 --out {plan}", capsys)
    assert code == 0, err
    code, out, err = _run(f"dry-run --plan {plan} --model-config {hf / name}", capsys)
    assert code == 0, out + err
    assert "the config names no architectures" in err


def test_olmo2s_whole_projection_norms_are_not_planned_on_sequence_shards(tmp_path, capsys):
    """OLMo 2 13B's widths (two of its 40 layers) at tp=4 on four H100 nodes: its
    q_norm and k_norm normalise the whole query and key projections before the
    attention. The planner ran them on sequence shards, so the attention would have
    read sequence shards (the runtime's check now refuses that); the plan it makes now
    keeps them whole, and its dry run passes that check."""
    config = transformers.Olmo2Config(
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=2,
        num_attention_heads=40,
        num_key_value_heads=40,
        vocab_size=100352,
        max_position_embeddings=4096,
    )
    folder = _saved(config, tmp_path / "olmo2")
    plan = tmp_path / "plan.json"
    cluster = "--cluster dgx-h100:4 --global-batch-size 64 --seq-len 4096 --set tp=4"
    code, _, err = _run(f"plan --model-config {folder} {cluster} --out {plan}", capsys)
    assert code == 0, err
    styles = json.loads(plan.read_text())["layer_strategies"]["tp"]
    assert styles["model.layers.0.self_attn.q_proj"] == "column"
    assert styles.get("model.layers.0.self_attn.q_norm", "replicate") != "sequence", styles
    code, out, err = _run(f"dry-run --plan {plan} --model-config {folder}", capsys)
    assert code == 0 and ": OK" in out, out + err
    # hand-edited: the refusal lists what the norm may take here, replicated only
    data = json.loads(plan.read_text())
    for style, why in [
        ("sequence", "sequence shards, but attention reads every position"),
        ("column", "column and row split a Linear"),
    ]:
        data["layer_strategies"]["tp"]["model.layers.0.self_attn.q_norm"] = style
        plan.write_text(json.dumps(data))
        code, out, err = _run(f"dry-run --plan {plan} --model-config {folder}", capsys)
        assert code != 0, out
        said = out + err
        assert f"'model.layers.0.self_attn.q_norm' (Olmo2RMSNorm) the tensor-parallel style '{style}'" in said, said
        assert why in said and "this layer allows replicate. Use 'replicate'" in said, said


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_profile_model_takes_a_model_config(name, hf, tmp_path, capsys):
    out = tmp_path / "m.json"
    command = (
        f"profile model --model-config {hf / name} --batch 1 --repeats 1 --warmup 0 --no-device --device cpu "
        f"--quiet --out {out}"
    )
    code, _, err = _run(command, capsys)
    assert code == 0, err
    assert out.is_file()
    assert "Planned for seq_len " in err and "(config.max_position_embeddings)" in err


@pytest.mark.parametrize("given", ["config", "registered"])
def test_planning_a_transformers_model_prints_nothing_from_optional_packages(given, hf):
    """transformers imports torchao whenever it is installed; torchao's import-time
    warnings (CUDA extensions a CPU machine cannot load) must not reach a user who plans
    a model, from a config or registered (bert-large, built with transformers). A fresh
    interpreter, as torchao logs only on its first import."""
    pytest.importorskip("torchao")
    model = ["--model-config", str(hf / "llama")] if given == "config" else ["--model", "bert-large"]
    script = f"from autopar.cli import main; main(['plan', *{model!r}, '--seq-len', '16', *{CPU.split()!r}])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "autopar plan:" in done.stdout
    noise = [
        line for line in done.stderr.splitlines() if any(w in line for w in ("torchao", "Enum subclass", "triton"))
    ]
    assert noise == []


def test_exporting_a_transformers_plan_prints_nothing_from_optional_packages(hf, tmp_path, capsys):
    """The export of a plan made from a config looks the model's class up in
    transformers, which imported torchao with its four lines of warnings before the
    script (a fresh interpreter, as torchao logs only on its first import)."""
    pytest.importorskip("torchao")
    plan = tmp_path / "plan.json"
    assert _run(f"plan --model-config {hf / 'llama'} --seq-len 16 {CPU} --out {plan}", capsys)[0] == 0
    script = f"from autopar.cli import main; main(['export', {str(plan)!r}, '--to', 'megatron'])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.startswith("#!/usr/bin/env bash"), done.stderr
    noise = [line for line in done.stderr.splitlines() if any(w in line for w in ("torchao", "Enum subclass"))]
    assert noise == []


def test_quiet_imports_restores_the_loggers():
    import logging

    from autopar.quiet import NOISY_LOGGERS, quiet_imports

    logger = logging.getLogger(NOISY_LOGGERS[0])
    before = logger.level
    logger.setLevel(logging.INFO)
    try:
        with quiet_imports():
            assert logger.getEffectiveLevel() == logging.ERROR
        assert logger.level == logging.INFO
    finally:
        logger.setLevel(before)
