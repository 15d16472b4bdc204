"""autopar export: the values each framework gets, checked by hand against the plan
(world size, batch arithmetic, ZeRO mapping, pipeline split, recompute), the notes where
a choice has no exact equivalent, and the command line's output. Its refusals are in
test_export_refusals.py; the frameworks' own parsers check the same files in
test_export_parsers.py."""

import json
import shlex
import tomllib
from dataclasses import replace

import pytest
import torch

import autopar
from autopar import Plan, TPStyle
from autopar.cli import main
from autopar.export import ExportError, export
from autopar.models import build_named_model
from autopar.plan import LayerStrategies
from autopar.vocab import ActivationLayout, Recompute

TARGETS = ("megatron", "deepspeed", "torchtitan", "accelerate")


def variant(plan: Plan, *, blocks_per_stage=None, overrides=None, **config) -> Plan:
    """``plan`` with config fields changed (the global batch kept), its blocks re-split
    (embeddings on the first stage, norm and head on the last) and per-unit recompute
    overrides."""
    dp, mbs = config.get("dp", plan.config.dp), config.get("micro_batch_size", plan.config.micro_batch_size)
    config.setdefault("num_microbatches", plan.model.global_batch_size // (dp * mbs))
    new = replace(plan.config, **config)
    units = plan.model.units
    blocks = [u for u in units if u.startswith("layers.")]
    counts = blocks_per_stage or [len(blocks) // new.num_stages] * new.num_stages
    stages, start = [], 0
    for n in counts:
        stages.append(blocks[start : start + n])
        start += n
    stages[0] = [u for u in units[: units.index(blocks[0])]] + stages[0]
    stages[-1] = stages[-1] + [u for u in units[units.index(blocks[-1]) + 1 :]]
    strategies = replace(plan.layer_strategies, recompute=overrides or {})
    return replace(plan, config=new, stages=tuple(map(tuple, stages)), layer_strategies=strategies)


def megatron_args(plan: Plan, **kw) -> dict[str, str | bool]:
    words = shlex.split(export(plan, to="megatron", **kw).launch)
    args: dict[str, str | bool] = {}
    for word in words[words.index("pretrain_gpt.py") + 1 :]:
        if word.startswith("--"):
            key = word
            args[key] = True
        else:
            args[key] = word
    return args


def test_megatron_parallel_sizes_and_batch_arithmetic(pipelined_plan):
    c = pipelined_plan.config
    args = megatron_args(pipelined_plan)
    tp, pp = int(args["--tensor-model-parallel-size"]), int(args["--pipeline-model-parallel-size"])
    assert tp * pp * c.dp == pipelined_plan.cluster.world_size == 16
    mbs, gbs = int(args["--micro-batch-size"]), int(args["--global-batch-size"])
    assert gbs == mbs * c.num_microbatches * (pipelined_plan.cluster.world_size // (tp * pp)) == 32
    assert args["--sequence-parallel"] is True and args["--bf16"] is True
    assert args["--num-layers"] == "40" and args["--seq-length"] == "2048"
    assert "--use-distributed-optimizer" not in args  # zero 0: plain data parallelism
    launch = export(pipelined_plan, to="megatron").launch
    assert launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nnodes 2 --nproc-per-node 8")


@pytest.mark.parametrize(
    ("zero", "pp", "flags", "noted"),
    [
        (1, 1, {"--use-distributed-optimizer"}, False),
        (1, 2, {"--use-distributed-optimizer"}, False),
        (2, 1, {"--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format"}, False),
        (2, 2, {"--use-distributed-optimizer"}, False),
        (3, 1, {"--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--ckpt-format"}, False),
        (3, 2, {"--use-distributed-optimizer"}, True),
    ],
)
def test_megatron_zero_stages(pipelined_plan, zero, pp, flags, noted):
    """Each ZeRO stage as the Megatron option holding what the plan predicts: the
    distributed optimizer (whole bf16 weights and fp32 gradients, the rest sharded) is a
    pipelined ZeRO-2's state, Megatron-FSDP's strategies ZeRO-2 and -3 without a pipeline;
    only ZeRO-3 under a pipeline has no match and is noted."""
    plan = variant(pipelined_plan, zero_stage=zero, pp=pp, dp=4 // pp)
    args = megatron_args(plan)
    assert flags <= set(args)
    if zero >= 2 and pp == 1:
        assert args["--data-parallel-sharding-strategy"] == ("optim_grads" if zero == 2 else "optim_grads_params")
        assert not export(plan, to="megatron").launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS")
    assert any(f"ZeRO-{zero}" in n for n in export(plan, to="megatron").notes) == noted


def test_megatron_pipeline_splits(pipelined_plan):
    assert "--decoder-first-pipeline-num-layers" not in megatron_args(pipelined_plan)  # even: Megatron's default
    uneven = variant(pipelined_plan, blocks_per_stage=[19, 21])
    args = megatron_args(uneven)
    assert args["--decoder-first-pipeline-num-layers"] == "19" and args["--decoder-last-pipeline-num-layers"] == "21"
    four = variant(pipelined_plan, pp=4, dp=1, blocks_per_stage=[8, 11, 11, 10])
    args = megatron_args(four)
    assert args["--decoder-first-pipeline-num-layers"] == "8" and args["--decoder-last-pipeline-num-layers"] == "10"
    ragged = variant(pipelined_plan, pp=4, dp=1, blocks_per_stage=[9, 11, 12, 8])
    assert megatron_args(ragged)["--pipeline-model-parallel-layout"] == "Et*9|t*11|t*12|t*8L"
    interleaved = variant(pipelined_plan, virtual_stages=2, schedule="interleaved-1f1b")
    assert megatron_args(interleaved)["--num-layers-per-virtual-pipeline-stage"] == "10"
    ragged_v = variant(interleaved, blocks_per_stage=[9, 10, 10, 11])
    assert megatron_args(ragged_v)["--pipeline-model-parallel-layout"] == "Et*9|t*10|t*10|t*11L"
    gpipe = export(variant(pipelined_plan, schedule="gpipe"), to="megatron")
    assert any("GPipe" in n for n in gpipe.notes)
    zbv = variant(pipelined_plan, virtual_stages=2, schedule="zbv")
    assert megatron_args(zbv)["--num-layers-per-virtual-pipeline-stage"] == "10"
    assert any("no zbv (zero-bubble) schedule" in n for n in export(zbv, to="megatron").notes)
    dualpipev = export(variant(pipelined_plan, virtual_stages=2, schedule="dualpipev"), to="megatron")
    assert any("no dualpipev (zero-bubble) schedule" in n and "the V" in n for n in dualpipev.notes)


def test_megatron_recompute(pipelined_plan):
    full = megatron_args(variant(pipelined_plan, recompute=Recompute.FULL))
    assert (full["--recompute-granularity"], full["--recompute-method"], full["--recompute-num-layers"]) == (
        "full",
        "uniform",
        "1",
    )
    assert megatron_args(variant(pipelined_plan, recompute=Recompute.SELECTIVE))["--recompute-granularity"] == (
        "selective"
    )
    # no per-operator policy in Megatron-LM: op blocks in full, which keeps less, noted
    op = export(variant(pipelined_plan, recompute=Recompute.OP), to="megatron")
    assert "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in op.launch
    assert any("no per-operator selective recomputation" in n for n in op.notes)
    # the first 3 blocks of each stage in full, the rest none: Megatron's block method exactly
    # (its sequence parallelism keeping shards of the gathers, as the plan then does, on
    # the sequence-first activations the plan is priced for)
    first3 = {f"layers.{i}": Recompute.FULL for s in (0, 20) for i in range(s, s + 3)}
    as_megatron = variant(pipelined_plan, overrides=first3, regather=True)
    as_megatron = replace(
        as_megatron, settings=replace(as_megatron.settings, activations=ActivationLayout.SEQUENCE_FIRST)
    )
    exact = export(as_megatron, to="megatron")
    assert "--recompute-method block --recompute-num-layers 3" in exact.launch and not exact.notes
    # 2 blocks on stage 0, 5 scattered on stage 1: the most any stage recomputes, noted
    scattered = {f"layers.{i}": Recompute.FULL for i in (0, 1, 21, 25, 30, 33, 39)}
    approx = export(variant(pipelined_plan, overrides=scattered), to="megatron")
    assert "--recompute-num-layers 5" in approx.launch
    assert any("7 full" in n and "N = 5" in n for n in approx.notes)
    assert any(
        "every pipeline stage" in n and "recomputes 10 of the 40 layers in full where the plan recomputes 7" in n
        for n in approx.notes
    )
    assert all(f"# NOTE: {n}" in approx.text for n in approx.notes)
    # interleaved, Megatron-LM counts N per model chunk: 4 chunks of 10, the most is 3 (layers 30, 33, 39)
    chunks = export(
        variant(pipelined_plan, overrides=scattered, virtual_stages=2, schedule="interleaved-1f1b"), to="megatron"
    )
    assert "--num-layers-per-virtual-pipeline-stage 10" in chunks.launch and "--recompute-num-layers 3" in chunks.launch
    assert any(
        "every model chunk (virtual stage)" in n
        and "recomputes 12 of the 40 layers in full where the plan recomputes 7" in n
        for n in chunks.notes
    )


def test_megatron_model_sizes():
    model = build_named_model("llama3-8b")
    plan = autopar.estimate(
        model, autopar.preset("dgx-a100-80gb", nodes=1), {"tp": 8}, global_batch_size=8, seq_len=2048
    )
    args = megatron_args(plan, model=model)
    assert args["--hidden-size"] == "4096" and args["--num-attention-heads"] == "32"
    assert args["--num-query-groups"] == "8" and args["--ffn-hidden-size"] == "14336"
    assert args["--normalization"] == "RMSNorm" and args["--rotary-base"] == "500000"
    assert {"--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"} <= set(args)
    assert "--hidden-size" not in megatron_args(plan)
    # two models both called Llama, told apart by their sizes (the plan's model is Llama 3 8B)
    with pytest.raises(
        ExportError,
        match=r"\(Llama, 6\.74B parameters, .* not the one the plan was made for \(Llama, "
        r"8\.03B parameters",
    ):
        export(plan, to="megatron", model=build_named_model("llama2-7b"))


def _hf_export(tmp_path, config: dict) -> dict[str, str | bool]:
    """Megatron-LM arguments for a plan of the transformers model ``config`` describes,
    made and exported from the command line as a user with a checkpoint directory would."""
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    plan = tmp_path / "plan.json"
    common = ["--cluster", "dgx-a100-80gb:1", "--global-batch-size", "8", "--seq-len", "128"]
    assert main(["estimate", "--model-config", str(folder), *common, "--set", "tp=2", "--out", str(plan)]) == 0
    out = tmp_path / "megatron.sh"
    assert main(["export", str(plan), "--to", "megatron", "--model-config", str(folder), "--out", str(out)]) == 0
    return megatron_args(Plan.load(plan), model=_built(folder))


TINY_DECODER = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512,
}  # fmt: skip
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}  # fmt: skip
ARCHITECTURES = {
    "qwen2": ("Qwen2ForCausalLM", {}, {"--disable-bias-linear": True, "--add-qkv-bias": True}, None),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}, {"--kv-channels": "32", "--qk-layernorm": True}, None),
    "gemma3_text": (
        "Gemma3ForCausalLM",
        {"head_dim": 32, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 64},
        {"--kv-channels": "32", "--qk-layernorm": True, "--swiglu": None},
        "multiplies by gelu_pytorch_tanh (GeGLU, not SwiGLU)",
    ),
    "gpt_neox": ("GPTNeoXForCausalLM", {"rotary_pct": 0.25}, {"--rotary-percent": "0.25"}, None),
    "llama": (
        "LlamaForCausalLM",
        {"rope_scaling": LLAMA3_SCALING, "rope_theta": 500000.0},
        {"--use-rope-scaling": True, "--rope-scaling-factor": "8", "--swiglu": True},
        None,
    ),
    "olmo2": ("Olmo2ForCausalLM", {}, {"--qk-layernorm": None}, "over the whole projection (OLMo 2)"),
}


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_megatron_architecture_flags_of_transformers_decoders(model_type, tmp_path):
    """The flags each family's shape needs, read from its config and one built block,
    checked against what the config states (None: the flag must be absent), and where no
    flag can say it (GeGLU, OLMo 2's norms over the whole projection) a comment in the
    script; every flag is one Megatron-LM declares."""
    from .test_export_parsers import declared_megatron_parser

    cls, extra, expected, comment = ARCHITECTURES[model_type]
    args = _hf_export(tmp_path, {"architectures": [cls], "model_type": model_type, **TINY_DECODER, **extra})
    for flag, value in expected.items():
        assert args.get(flag) == value, (flag, args)
    script = (tmp_path / "megatron.sh").read_text()
    assert comment is None or comment in script
    words = [w for k, v in args.items() for w in ([k] if v is True else [k, v])]
    declared_megatron_parser().parse_known_args(words)


def _built(folder):
    from autopar.models.hf_config import build_hf_model, load_hf_model

    return build_hf_model(load_hf_model(str(folder)), "meta")


def test_megatron_architecture_of_a_transformers_llama(tmp_path):
    """Every value checked against the config it was read from (a Llama-3-style config)."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 160,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    }  # fmt: skip
    args = _hf_export(tmp_path, config)
    assert (args["--hidden-size"], args["--num-attention-heads"], args["--ffn-hidden-size"]) == ("64", "4", "160")
    assert (args["--num-query-groups"], args["--max-position-embeddings"]) == ("2", "512")
    assert (args["--normalization"], args["--norm-epsilon"], args["--rotary-base"]) == ("RMSNorm", "1e-05", "500000")
    assert {"--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"} <= set(args)


def test_megatron_architecture_of_a_transformers_gpt2(tmp_path):
    """GPT-2's architecture is Megatron-LM's default (LayerNorm, GELU, learned positions,
    tied embeddings, biases): sizes only, no architecture flag."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4}
    args = _hf_export(tmp_path, config)
    assert (args["--hidden-size"], args["--num-attention-heads"], args["--max-position-embeddings"]) == (
        "64",
        "4",
        "1024",
    )
    assert args["--norm-epsilon"] == "1e-05"
    assert not {"--normalization", "--swiglu", "--position-embedding-type", "--disable-bias-linear"} & set(args)
    assert "--untie-embeddings-and-output-weights" not in args


def test_an_unstated_architecture_is_left_to_the_user(tmp_path):
    """BLOOM's ALiBi positions are neither rotary nor learned: sizes are written, the
    architecture flags are left out and a comment in the script says which to add."""
    config = {
        "architectures": ["BloomForCausalLM"],
        "model_type": "bloom",
        "hidden_size": 64,
        "n_layer": 2,
        "n_head": 4,
    }
    args = _hf_export(tmp_path, config)
    assert args["--hidden-size"] == "64" and "--position-embedding-type" not in args
    text = (tmp_path / "megatron.sh").read_text()
    assert "# add the architecture flags (--normalization, --swiglu, --position-embedding-type" in text


@pytest.mark.parametrize(("zero", "pp", "stage"), [(0, 1, 0), (1, 1, 1), (2, 1, 2), (3, 1, 3), (3, 2, 1), (1, 2, 1)])
def test_deepspeed_config(pipelined_plan, zero, pp, stage):
    plan = variant(pipelined_plan, zero_stage=zero, pp=pp, tp=8 // pp)
    result = export(plan, to="deepspeed")
    config = json.loads(result.text)
    c = plan.config
    assert config["train_batch_size"] == (
        config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * c.dp
    )
    assert config["zero_optimization"]["stage"] == stage
    assert config["bf16"] == {"enabled": True} and "fp16" not in config
    assert any("Megatron-DeepSpeed" in n for n in result.notes)
    assert config["autopar"]["notes"] == list(result.notes)
    assert ("--no-pipeline-parallel" in result.launch) == (pp == 1)
    assert (stage != zero) == any("ZeRO stage 0 or 1" in n for n in result.notes)
    # Megatron-DeepSpeed refuses tensor parallelism on more than one CUDA work queue; the
    # launcher forwards it to other nodes from .deepspeed_env only
    assert result.launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 deepspeed --num_nodes")
    assert any(".deepspeed_env" in n for n in result.notes) == (plan.cluster.nodes > 1)


def test_deepspeed_plain_data_parallel(gpt2_plan):
    result = export(variant(gpt2_plan, dtype="fp16", recompute=Recompute.FULL), to="deepspeed")
    config = json.loads(result.text)
    assert config["fp16"]["enabled"] and config["fp16"]["loss_scale"] == 0 and "bf16" not in config
    assert "activation_checkpointing" in config
    assert (
        result.launch == "deepspeed --num_nodes 1 --num_gpus 8 train.py --deepspeed --deepspeed_config ds_config.json"
    )
    assert not any("Megatron-DeepSpeed" in n for n in result.notes)
    assert any("does not turn recomputation on" in n for n in result.notes)


def torchtitan_config(plan: Plan) -> dict:
    return tomllib.loads(export(plan, to="torchtitan").text)


@pytest.mark.parametrize(
    ("zero", "tp", "pp", "replicate", "reshard"),
    [(0, 1, 1, 16, None), (0, 2, 1, 1, "never"), (1, 2, 2, 1, "never"), (2, 2, 2, 1, "never"), (3, 2, 2, 1, "always")],
)
def test_torchtitan_parallelism(pipelined_plan, zero, tp, pp, replicate, reshard):
    plan = variant(pipelined_plan, zero_stage=zero, tp=tp, pp=pp, dp=16 // (tp * pp), sequence_parallel=tp > 1)
    p = torchtitan_config(plan)["parallelism"]
    dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
    assert dp * p["tensor_parallel_degree"] * p["pipeline_parallel_degree"] == plan.cluster.world_size
    assert p["data_parallel_replicate_degree"] == replicate and p.get("fsdp_reshard_after_forward") == reshard
    assert p["context_parallel_degree"] == 1 and p["enable_async_tensor_parallel"] is False
    assert any("ZeRO" in n for n in export(plan, to="torchtitan").notes) == (zero in (0, 1) and reshard is not None)


def test_torchtitan_pipeline_and_batch(pipelined_plan, gpt2_plan):
    interleaved = variant(
        pipelined_plan, virtual_stages=2, schedule="interleaved-1f1b", blocks_per_stage=[9, 11, 10, 10]
    )
    config = torchtitan_config(interleaved)
    p, t = config["parallelism"], config["training"]
    assert p["pipeline_parallel_schedule"] == "Interleaved1F1B"
    for schedule, name in (
        ("interleaved-zb", "InterleavedZeroBubble"),
        ("zbv", "ZBVZeroBubble"),
        ("dualpipev", "DualPipeV"),
    ):
        zb = variant(interleaved, schedule=schedule)
        assert torchtitan_config(zb)["parallelism"]["pipeline_parallel_schedule"] == name
        # a hand-edited plan compiling under a split backward, which torch does not run
        with pytest.raises(ExportError, match=f"schedule '{schedule}' with compiled blocks, which torchtitan's torch"):
            export(variant(zb, compile=True), to="torchtitan")
    assert p["module_fqns_per_model_part"] == [list(s) for s in interleaved.stages]
    c = interleaved.config
    # pipelined: a rank's whole batch per step, split into micro-batches of the plan's size
    assert t["local_batch_size"] // p["pipeline_parallel_microbatch_size"] == c.num_microbatches
    assert t["global_batch_size"] == t["local_batch_size"] * c.dp == c.global_batch_size
    t = torchtitan_config(variant(gpt2_plan, micro_batch_size=2, num_microbatches=4))["training"]
    # not pipelined: one micro-batch per load, the rest is gradient accumulation
    assert t["global_batch_size"] // (t["local_batch_size"] * 8) == 4 and t["seq_len"] == 1024


def accelerate_config(plan: Plan, **kw) -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(export(plan, to="accelerate", **kw).text)


@pytest.mark.parametrize(("zero", "kind", "reshard"), [(0, "MULTI_GPU", None), (2, "FSDP", False), (3, "FSDP", True)])
def test_accelerate_data_parallel(gpt2_plan, zero, kind, reshard):
    config = accelerate_config(variant(gpt2_plan, zero_stage=zero), model=build_named_model("gpt2-small"))
    assert config["distributed_type"] == kind and config["num_processes"] == 8 and config["num_machines"] == 1
    assert config["mixed_precision"] == "bf16"
    if reshard is not None:
        fsdp = config["fsdp_config"]
        assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_reshard_after_forward"] is reshard
        assert fsdp["fsdp_transformer_layer_cls_to_wrap"] == "Block"


def test_accelerate_tensor_parallel_and_refusal(pipelined_plan):
    tp_only = variant(pipelined_plan, pp=1, dp=4)
    config = accelerate_config(tp_only)
    sizes = config["parallelism_config"]
    assert sizes["parallelism_config_dp_shard_size"] * sizes["parallelism_config_tp_size"] == 16
    assert any("tp_plan" in n for n in export(tp_only, to="accelerate").notes)
    with pytest.raises(ExportError, match=r"accelerate cannot run pipeline parallelism \(the plan has pp=2\)"):
        export(pipelined_plan, to="accelerate")


def test_notes_are_comments_in_every_file(pipelined_plan):
    plan = variant(pipelined_plan, zero_stage=1, pp=1, dp=4, overrides={"layers.3": Recompute.FULL})
    for target in TARGETS:
        result = export(plan, to=target)
        assert result.notes, target
        text = "\n".join(json.loads(result.text)["autopar"]["notes"]) if target == "deepspeed" else result.text
        for note in result.notes:
            assert note in text, (target, note)


def test_cli_prints_or_writes(tmp_path, capsys, gpt2_plan):
    plan_file = gpt2_plan.save(tmp_path / "plan.json")
    assert main(["export", str(plan_file), "--to", "torchtitan"]) == 0
    out, err = capsys.readouterr()
    assert tomllib.loads(out)["parallelism"]["data_parallel_shard_degree"] == 8
    assert "launch: torchrun --standalone --nproc-per-node 8 -m torchtitan.train" in err
    out_file = tmp_path / "ds" / "ds.json"
    assert main(["export", str(plan_file), "--to", "deepspeed", "--out", str(out_file)]) == 0
    out, err = capsys.readouterr()
    assert out == "" and json.loads(out_file.read_text())["train_batch_size"] == 64
    assert f"--deepspeed_config {out_file}" in err
    assert main(["export", str(plan_file), "--to", "megatron", "--model", "gpt2-small"]) == 0
    assert "--hidden-size 768" in capsys.readouterr().out


def test_layer_strategies_without_block_split_are_noted(pipelined_plan):
    replicated = replace(pipelined_plan, layer_strategies=LayerStrategies())
    for target in ("megatron", "torchtitan"):
        assert any("per-layer styles differ" in n for n in export(replicated, to=target).notes)
    assert not any("per-layer styles" in n for n in export(pipelined_plan, to="megatron").notes)


def test_row_parallel_key_and_value_projections_are_noted(pipelined_plan):
    """The planner may split a block's key and value projections by rows (its grouped
    query attention's few key heads): Megatron-LM and DeepSpeed split them by columns,
    with no all-reduce after them, and the export says so."""
    styles = {
        leaf: TPStyle.ROW if leaf.endswith((".wk", ".wv")) else style
        for leaf, style in pipelined_plan.layer_strategies.tp.items()
    }
    rowed = replace(pipelined_plan, layer_strategies=LayerStrategies(tp=styles))
    for target in ("megatron", "deepspeed"):
        note = next(n for n in export(rowed, to=target).notes if "per-layer styles differ" in n)
        assert "(wk, wv row-parallel, each output all-reduced, where it splits them by columns)" in note


def test_torchtitan_stages_of_a_transformers_llama_use_torchtitans_names():
    """torchtitan's Llama names its modules tok_embeddings, layers.N, norm and output
    (the FP8 filter already said output); a plan of transformers' Llama listed its
    stages as model.embed_tokens, model.layers.N, model.norm and lm_head, with the
    rotary table, a buffer in torchtitan, as a module. The stages hold the same layers."""
    import tomllib

    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**TINY_DECODER, "num_hidden_layers": 4})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    plan = autopar.estimate(
        model, autopar.preset("dgx-a100-80gb", nodes=1), {"pp": 2}, global_batch_size=8, seq_len=128
    )
    out = export(plan, to="torchtitan")
    stages = tomllib.loads(out.text)["parallelism"]["module_fqns_per_model_part"]
    assert [m for stage in stages for m in stage] == [
        "tok_embeddings",
        *(f"layers.{i}" for i in range(4)),
        "norm",
        "output",
    ]
    assert [len(s) for s in stages] == [len([m for m in s if m != "model.rotary_emb"]) for s in plan.stages]
    assert "model.rotary_emb" in plan.stages[0]
    assert "mapped from the transformers model" in out.text


def test_the_model_may_be_named_as_the_command_line_names_it(gpt2_plan):
    """``model=`` takes a registered name as ``--model`` does: the same export as the
    module; a name or object that is neither is one line."""
    assert export(gpt2_plan, to="megatron", model="gpt2-small") == export(
        gpt2_plan, to="megatron", model=build_named_model("gpt2-small")
    )
    with pytest.raises(autopar.ConfigError, match=r"^unknown model 'gpt2-tiny'; known models: gpt2-small"):
        export(gpt2_plan, to="megatron", model="gpt2-tiny")
    with pytest.raises(ExportError, match=r"^model=3 is not allowed: give the torch.nn.Module") as err:
        export(gpt2_plan, to="megatron", model=3)
    assert "\n" not in str(err.value)
