"""The longest sequence a transformers model is planned at: a learned position table
(GPT-2's ``wpe``, OPT's) cannot be indexed past its rows, while a rotary model's context
is ``max_position_embeddings`` or, with ``rope_scaling``, ``factor`` x the pre-trained
length (Qwen2.5's yarn factor 4 x 32768 = 131072), the longer of the two. Models are
built from tiny configs on the meta device."""

import json
import shlex

import pytest
import torch

transformers = pytest.importorskip("transformers")

from autopar.cli import main  # noqa: E402
from autopar.errors import ConfigError  # noqa: E402
from autopar.models.positions import check_seq_len, rope_context  # noqa: E402

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1000,
}
YARN = {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
    "rope_theta": 500000.0,
}


def _built(config, cls):
    with torch.device("meta"):
        return cls(config)


def _qwen(**extra):
    config = transformers.Qwen2Config(**TINY, max_position_embeddings=32768, **extra)
    return _built(config, transformers.Qwen2ForCausalLM)


def _llama(max_positions, rope_scaling):
    config = transformers.LlamaConfig(**TINY, max_position_embeddings=max_positions, rope_scaling=rope_scaling)
    return _built(config, transformers.LlamaForCausalLM)


def _refusal(seq_len, model) -> str:
    with pytest.raises(ConfigError) as raised:
        check_seq_len(seq_len, model)
    return str(raised.value)


def test_a_yarn_scaled_qwen2_takes_factor_times_its_original_length():
    model = _qwen(rope_scaling=YARN)
    assert check_seq_len(131072, model) == 131072
    assert _refusal(131073, model) == (
        "seq_len=131073 is longer than the 131072 positions Qwen2ForCausalLM is configured for "
        "(config.max_position_embeddings is 32768; rope_scaling yarn: factor 4 x original_max_position_embeddings "
        "32768 = 131072); give seq_len <= 131072, or raise rope_scaling's factor or max_position_embeddings in the "
        "config."
    )


def test_a_rotary_model_without_rope_scaling_is_refused_past_max_position_embeddings_saying_how_to_raise_it():
    """Intended change: the message of a rotary model names rope_scaling (was: 'or a
    model configured for longer sequences')."""
    model = _qwen()
    assert check_seq_len(32768, model) == 32768
    assert _refusal(131072, model) == (
        "seq_len=131072 is longer than the 32768 positions Qwen2ForCausalLM was built for "
        "(config.max_position_embeddings; its rotary embedding has no rope_scaling); give seq_len <= 32768, or "
        "raise max_position_embeddings or add rope_scaling to the config (e.g. yarn, factor 4 x "
        "original_max_position_embeddings 32768)."
    )


def test_llama3_scaling_keeps_max_position_embeddings_as_its_context():
    """Llama 3.1 already says 131072 in max_position_embeddings; its factor 8 x 8192 is less."""
    model = _llama(131072, LLAMA3)
    assert check_seq_len(131072, model) == 131072
    assert _refusal(131073, model) == (
        "seq_len=131073 is longer than the 131072 positions LlamaForCausalLM is configured for "
        "(config.max_position_embeddings is 131072; rope_scaling llama3: factor 8 x original_max_position_embeddings "
        "8192 = 65536); give seq_len <= 131072, or raise rope_scaling's factor or max_position_embeddings in the "
        "config."
    )


@pytest.mark.parametrize(("kind", "factor", "longest"), [("linear", 4.0, 16384), ("dynamic", 2.0, 8192)])
def test_linear_and_dynamic_scale_max_position_embeddings(kind, factor, longest):
    model = _llama(4096, {"type": kind, "factor": factor})
    assert rope_context(model.config) == (
        longest,
        f"rope_scaling {kind}: factor {factor:g} x max_position_embeddings 4096",
    )
    assert check_seq_len(longest, model) == longest
    assert f"seq_len={longest + 1} is longer than the {longest} positions" in _refusal(longest + 1, model)


def test_longrope_without_factor_stretches_to_max_position_embeddings():
    """Phi-3's longrope: max_position_embeddings is already the stretched context."""
    half = TINY["hidden_size"] // TINY["num_attention_heads"] // 2
    rope = {"type": "longrope", "short_factor": [1.0] * half, "long_factor": [2.0] * half}
    config = transformers.Phi3Config(
        **TINY,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_scaling=rope,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = _built(config, transformers.Phi3ForCausalLM)
    assert rope_context(model.config) is None
    assert check_seq_len(131072, model) == 131072
    assert _refusal(131073, model) == (
        "seq_len=131073 is longer than the 131072 positions Phi3ForCausalLM was built for "
        "(config.max_position_embeddings, with rope_scaling longrope); give seq_len <= 131072, or raise "
        "max_position_embeddings or rope_scaling's factor in the config."
    )


def test_a_learned_position_table_is_still_refused_past_its_rows():
    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, vocab_size=1000)
    gpt2.bos_token_id = gpt2.eos_token_id = 0
    model = _built(gpt2, transformers.GPT2LMHeadModel)
    assert check_seq_len(1024, model) == 1024
    assert _refusal(1025, model) == (
        "seq_len=1025 is longer than the 1024 positions GPT2LMHeadModel was built for "
        "(config.max_position_embeddings); give seq_len <= 1024, or a model configured for longer sequences."
    )
    opt = transformers.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=1000,
        max_position_embeddings=2048, word_embed_proj_dim=64,
    )  # fmt: skip
    model = _built(opt, transformers.OPTForCausalLM)
    assert _refusal(2049, model).startswith("seq_len=2049 is longer than the 2048 positions OPTForCausalLM was built")


def test_a_rotary_config_on_a_learned_table_does_not_stretch_it():
    """A position table of max_position_embeddings rows is indexed past its end whatever
    rope parameters the config carries."""
    model = _qwen(rope_scaling=YARN)
    with torch.device("meta"):
        model.model.wpe = torch.nn.Embedding(32768, 64)
    assert "or a model configured for longer sequences" in _refusal(131072, model)


def test_the_cli_plans_a_yarn_scaled_qwen2_at_131072(tmp_path, capsys):
    config = {
        **TINY,
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "max_position_embeddings": 32768,
        "rope_scaling": YARN,
    }
    path = tmp_path / "qwen_yarn.json"
    path.write_text(json.dumps(config))
    command = f"plan --model-config {path} --cluster dgx-h100:1 --global-batch-size 8 --seq-len 131072 --json"
    try:
        code = main(shlex.split(command))
    except SystemExit as stopped:
        code = stopped.code
    captured = capsys.readouterr()
    assert code == 0, captured.err
    plan = json.loads(captured.out)
    assert plan["model"]["name"] == "Qwen2ForCausalLM"
    assert plan["model"]["seq_len"] == 131072


def test_the_default_length_of_a_yarn_scaled_qwen2_is_not_called_its_maximum():
    """Planned without a length, at max_position_embeddings: the note said "the model's
    maximum" while the same model plans at 131072; it now says how far its scaling goes.
    Without scaling the length is the maximum, and the note says so."""
    import autopar

    cluster = autopar.preset("dgx-h100", nodes=1)
    with pytest.warns(UserWarning) as caught:
        autopar.plan(_qwen(rope_scaling=YARN), cluster, global_batch_size=8)
    (note,) = [str(w.message) for w in caught if "Planned for" in str(w.message)]
    assert note.startswith(
        "Planned for seq_len 32768, the length its config gives (config.max_position_embeddings; its rope_scaling "
        "yarn: factor 4 x original_max_position_embeddings 32768 takes up to 131072), as no sequence length"
    )
    with pytest.warns(UserWarning, match=r"seq_len 32768, the model's maximum \(config.max_position_embeddings\)"):
        autopar.plan(_qwen(), cluster, global_batch_size=8)
