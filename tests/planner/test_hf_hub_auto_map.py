"""A config whose ``auto_map`` names code in a Hub repository (``repo--module.Class``)
is refused in one line before transformers reads it: autopar loads custom code from the
config's directory only, and transformers would try the network (half a minute offline)
before failing with a message about the config. No network is touched."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from .test_hf_cli import _run  # noqa: E402

CPU = "--cluster local-cpu:1 --global-batch-size 4 --seq-len 16"


@pytest.fixture
def no_transformers_read(monkeypatch):
    """Fail if transformers is asked to read the config (it would reach for the Hub)."""

    def refuse(*args, **kwargs):
        raise AssertionError("transformers was asked to read the config")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)


def _checkpoint(tmp_path, auto_map):
    folder = tmp_path / "rc2"
    folder.mkdir()
    config = {"model_type": "foo", "architectures": ["FooForCausalLM"], "hidden_size": 64, "auto_map": auto_map}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_hub_model_class_is_refused_in_one_line_saying_what_to_copy(tmp_path, capsys, no_transformers_read):
    folder = _checkpoint(tmp_path, {"AutoModelForCausalLM": "someorg/somerepo--modeling_foo.FooForCausalLM"})
    code, out, err = _run(f"plan --model-config {folder} --trust-remote-code {CPU}", capsys)
    assert (code, out) == (2, "")
    assert err.strip() == (
        f"autopar: error: --model-config '{folder / 'config.json'}': auto_map's AutoModelForCausalLM names code in "
        f"the Hub repository 'someorg/somerepo' ('someorg/somerepo--modeling_foo.FooForCausalLM'), which autopar "
        f"does not fetch (it loads custom code from the config's directory only); copy modeling_foo.py from that "
        f"repository next to config.json and set AutoModelForCausalLM to 'modeling_foo.FooForCausalLM'."
    )


def test_a_hub_config_class_is_refused_before_local_files_are_looked_for(tmp_path, capsys, no_transformers_read):
    auto_map = {
        "AutoConfig": "someorg/somerepo--configuration_foo.FooConfig",
        "AutoModelForCausalLM": "modeling_foo.FooForCausalLM",
    }
    folder = _checkpoint(tmp_path, auto_map)
    code, _, err = _run(f"plan --model-config {folder} --trust-remote-code {CPU}", capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert "auto_map's AutoConfig names code in the Hub repository 'someorg/somerepo'" in line
    assert "copy configuration_foo.py from that repository next to config.json" in line
    assert line.endswith("set AutoConfig to 'configuration_foo.FooConfig'.")


def test_a_hub_tokenizer_is_not_refused(tmp_path, capsys, no_transformers_read):
    """The tokenizer is never loaded: its Hub reference is no reason to refuse (here the
    local model code is missing, which is said instead)."""
    auto_map = {
        "AutoModelForCausalLM": "modeling_foo.FooForCausalLM",
        "AutoTokenizer": ["someorg/somerepo--tokenization_foo.FooTokenizer", None],
    }
    folder = _checkpoint(tmp_path, auto_map)
    code, _, err = _run(f"plan --model-config {folder} --trust-remote-code {CPU}", capsys)
    assert code == 2
    assert f"its custom code '{folder / 'modeling_foo.py'}' is missing" in err
    assert "Hub" not in err


def test_untrusted_hub_code_still_asks_for_trust_remote_code(tmp_path, capsys, no_transformers_read):
    folder = _checkpoint(tmp_path, {"AutoModelForCausalLM": "someorg/somerepo--modeling_foo.FooForCausalLM"})
    code, _, err = _run(f"plan --model-config {folder} {CPU}", capsys)
    assert code == 2
    assert "needs custom code" in err and "--trust-remote-code" in err
