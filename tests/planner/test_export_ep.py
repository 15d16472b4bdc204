"""Expert parallelism in every export: Megatron-LM's expert flags (with the model's experts
read from autopar's mixture-of-experts Llama and from a transformers Mixtral), torchtitan's
expert degrees as its own ``ParallelDims`` lays out the ranks, DeepSpeed's AutoEP section
read back by DeepSpeed and its layer detection, and the one-line refusals: Accelerate
(no expert axis), DeepSpeed where AutoEP cannot run, a model without experts, and an ep
that does not divide the experts."""

import importlib
import json
import shlex
import types
from dataclasses import replace

import pytest
import torch

import autopar
from autopar.cli import main
from autopar.export import ExportError, export
from autopar.models import build_named_model

from .test_export import megatron_args, torchtitan_config, variant
from .test_export_parsers import _torchtitan_config_manager, declared_megatron_parser


def _estimate(model, devices: int, seq_len: int, **config):
    return autopar.estimate(
        model,
        autopar.preset("dgx-a100-80gb", devices_per_node=devices),
        {"pp": 1, "micro_batch_size": 1, **config},
        global_batch_size=32,
        seq_len=seq_len,
    )


@pytest.fixture(scope="module")
def moe_tiny():
    return build_named_model("moe-tiny")


@pytest.fixture(scope="module")
def moe_plans(moe_tiny):
    """moe-tiny (8 experts, top-2) under ZeRO-1: dp 4 x ep 2 on 4 devices, and tp 2 x dp 4
    x ep 2 on 8."""
    four = _estimate(moe_tiny, 4, 128, dp=4, tp=1)
    eight = _estimate(moe_tiny, 8, 128, dp=4, tp=2, sequence_parallel=True)
    return {"dp4-ep2": variant(four, ep=2, zero_stage=1), "tp2-dp4-ep2": variant(eight, ep=2, zero_stage=1)}


def _mixtral(top_k: int = 2):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=top_k,
        max_position_embeddings=128,
    )
    with torch.device("meta"):
        return transformers.MixtralForCausalLM(config)


def _planned(cls, config, seq_len: int):
    """A transformers model of ``cls`` built from ``config`` on the meta device, and its
    plan on 4 devices of data parallelism."""
    with torch.device("meta"):
        model = cls(config)
    return model, _estimate(model, 4, seq_len, dp=4, tp=1)


@pytest.fixture(scope="module")
def mixtral():
    """A transformers Mixtral (4 experts, top-2) and its plan with dp 4 x ep 2."""
    model = _mixtral()
    plan = _estimate(model, 4, 128, dp=4, tp=1)
    return model, replace(plan, config=replace(plan.config, ep=2))


def test_megatron_expert_flags(moe_plans, moe_tiny):
    plan = moe_plans["dp4-ep2"]
    c = plan.config
    args = megatron_args(plan, model=moe_tiny)
    cfg = moe_tiny.config
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == ("8", "2", "128")
    assert (int(args["--num-experts"]), int(args["--moe-router-topk"])) == (cfg.n_experts, cfg.top_k)
    assert float(args["--moe-expert-capacity-factor"]) == cfg.capacity_factor
    assert args["--moe-pad-expert-input-to-capacity"] is True and args["--moe-token-drop-policy"] == "position"
    assert (args["--expert-model-parallel-size"], args["--moe-token-dispatcher-type"]) == ("2", "alltoall")
    assert export(plan, to="megatron", model=moe_tiny).launch.count("--moe-token-dispatcher-type") == 1
    assert "--expert-tensor-parallel-size" not in args and "--moe-router-pre-softmax" not in args
    # Megatron's expert grid (order tp-ep-dp-pp, expert tp defaulting to tp = 1): expert data
    # parallelism world / (etp x ep x pp) = 2 ranks, the plan's expert replicas; an ep group
    # is ep consecutive ranks, [0, 1], as the plan's (ep consecutive data-parallel ranks)
    tp, ep = int(args["--tensor-model-parallel-size"]), int(args["--expert-model-parallel-size"])
    assert plan.cluster.world_size // (tp * ep * 1) == c.expert_replicas == 2
    assert int(args["--num-experts"]) % ep == 0  # Megatron asserts it
    words = export(plan, to="megatron", model=moe_tiny).launch.split("pretrain_gpt.py ")[1].split()
    parsed = declared_megatron_parser().parse_args(words)
    assert (parsed.expert_model_parallel_size, parsed.num_experts) == (2, 8)
    assert not export(plan, to="megatron").launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS")
    # without the model the export still splits the experts, and says which flags to add
    bare = export(plan, to="megatron")
    assert "--expert-model-parallel-size 2" in bare.launch and "--num-experts" not in bare.launch
    assert "add --num-experts, --moe-router-topk and --moe-ffn-hidden-size" in bare.text


def test_a_capacity_without_expert_parallelism_takes_the_alltoall_dispatcher(moe_tiny):
    """Megatron-Core releases up to 2025 refuse --moe-expert-capacity-factor with any other
    dispatcher than alltoall, the default being allgather; it runs without ep as well."""
    plan = _estimate(moe_tiny, 4, 128, dp=4, tp=1)
    assert plan.config.ep == 1
    words = export(plan, to="megatron", model=moe_tiny).launch.split("pretrain_gpt.py ")[1].split()
    assert words.count("--moe-token-dispatcher-type") == 1
    assert words[words.index("--moe-token-dispatcher-type") + 1] == "alltoall"
    assert "--moe-expert-capacity-factor" in words and "--expert-model-parallel-size" not in words


def test_megatron_deepspeed_routes_top_2_by_argmax_and_says_how_it_counts_capacity(moe_tiny):
    """moe-tiny under tp=2 runs on Megatron-DeepSpeed's DeepSpeed-MoE, which samples the
    second of two experts with noise unless told, and counts capacity per micro-batch."""
    plan = _estimate(moe_tiny, 8, 128, dp=4, tp=2, sequence_parallel=True)
    result = export(plan, to="deepspeed", model=moe_tiny)
    words = result.launch.split("pretrain_gpt.py ")[1].split()
    assert words[words.index("--topk") + 1] == "2" and "--disable-moe-top2-2nd-expert-sampling" in words
    assert "--moe-train-capacity-factor" in words
    assert any(
        n.startswith("DeepSpeed-MoE counts an expert's capacity over a rank's micro-batch") for n in result.notes
    )


def test_megatron_expert_parallelism_beside_tensor_parallelism(moe_plans, moe_tiny):
    """Whole experts per rank (expert TP 1, not Megatron's default of tp); Megatron's ep
    groups then take the tp ranks in, which the note quantifies."""
    plan = moe_plans["tp2-dp4-ep2"]
    args = megatron_args(plan, model=moe_tiny)
    assert (args["--tensor-model-parallel-size"], args["--expert-tensor-parallel-size"]) == ("2", "1")
    expert_dp = plan.cluster.world_size // (1 * 2 * 1)  # world / (etp x ep x pp)
    assert (expert_dp, plan.config.expert_replicas) == (4, 2)
    result = export(plan, to="megatron", model=moe_tiny)
    assert any("reduced over dp x cp x tp / ep = 4 ranks instead of 2" in n for n in result.notes)
    assert result.launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun")
    declared_megatron_parser().parse_args(result.launch.split("pretrain_gpt.py ")[1].split())
    # without expert parallelism both frameworks split each expert over tp, the plan does not
    no_ep = variant(plan, ep=1)
    assert "--expert-tensor-parallel-size" not in megatron_args(no_ep, model=moe_tiny)
    for target in ("megatron", "torchtitan"):
        notes = export(no_ep, to=target, model=moe_tiny).notes
        assert any("splits every expert over the 2 tp ranks" in n for n in notes), target


def test_megatron_reads_a_transformers_mixtral(mixtral):
    model, plan = mixtral
    args = megatron_args(plan, model=model)
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == ("4", "2", "128")
    assert "--moe-expert-capacity-factor" not in args  # transformers' Mixtral is dropless, as Megatron's default
    assert args["--swiglu"] is True  # the experts' stacked gate_up_proj states the gated MLP
    # every block routes, by softmax, without shared experts or a latent attention
    assert not {"--moe-layer-freq", "--moe-shared-expert-intermediate-size", "--moe-router-score-function"} & set(args)
    assert "--multi-latent-attention" not in args
    # top-1 routing: Megatron raises without pre-softmax routing; same parameters, so the same plan
    top1 = export(plan, to="megatron", model=_mixtral(top_k=1))
    assert "--moe-router-topk 1 " in top1.launch and "--moe-router-pre-softmax" in top1.launch
    assert any("--moe-router-pre-softmax, which it requires" in n for n in top1.notes)
    declared_megatron_parser().parse_args(top1.launch.split("pretrain_gpt.py ")[1].split())


def test_torchtitan_expert_degrees_build_its_meshes(moe_plans, moe_tiny, tmp_path, monkeypatch):
    """torchtitan's JobConfig reads the degrees; its ParallelDims accepts them and, on a
    fake process group, builds the expert meshes: with tp 1 the plan's expert groups
    (ep consecutive data-parallel ranks) and replicas; with tp 2 groups of tp ranks."""
    pytest.importorskip("tyro")
    manager = _torchtitan_config_manager(monkeypatch)
    parallel_dims = importlib.import_module("torchtitan.distributed.parallel_dims").ParallelDims
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    plans = {**moe_plans, "zero0": variant(moe_plans["dp4-ep2"], zero_stage=0)}
    assert any("shards expert-parallel models with FSDP" in n for n in export(plans["zero0"], to="torchtitan").notes)
    assert any("instead of 2" in n for n in export(plans["tp2-dp4-ep2"], to="torchtitan").notes)
    dropless = "torchtitan's mixture of experts is dropless"
    assert any(dropless in n for n in export(plans["dp4-ep2"], to="torchtitan", model=moe_tiny).notes)
    for name, plan in plans.items():
        c = plan.config
        path = export(plan, to="torchtitan").save(tmp_path / f"{name}.toml")
        p = manager().parse_args(["--job.config_file", str(path)]).parallelism
        assert (p.expert_parallel_degree, p.expert_tensor_parallel_degree) == (c.ep, 1), name
        assert torchtitan_config(plan)["parallelism"]["data_parallel_shard_degree"] == c.dp, name
        world = c.world_size
        torch.distributed.init_process_group("fake", store=fake_pg.FakeStore(), rank=0, world_size=world)
        try:
            dims = parallel_dims(
                dp_replicate=p.data_parallel_replicate_degree,
                dp_shard=p.data_parallel_shard_degree,
                cp=p.context_parallel_degree,
                tp=p.tensor_parallel_degree,
                pp=p.pipeline_parallel_degree,
                ep=p.expert_parallel_degree,
                etp=p.expert_tensor_parallel_degree,
                world_size=world,
            )
            dims.build_mesh()  # checks every mesh's size
            ep_group = dims.get_mesh("ep").mesh.tolist()
            replicas = dims.get_mesh("efsdp").mesh.tolist()
        finally:
            torch.distributed.destroy_process_group()
        # the plan's: ep consecutive data-parallel ranks (stride tp), replicas at stride tp x ep
        planned = [i * c.tp for i in range(c.ep)]
        if c.tp == 1:
            assert (ep_group, replicas) == (planned, [i * c.ep for i in range(c.expert_replicas)]), name
        else:
            assert (ep_group, planned) == ([0, 1], [0, 2]), name  # torchtitan borrows the tp pair
            assert len(replicas) == c.dp_cp * c.tp // c.ep == 4, name


def test_deepspeed_autoep_reads_the_section_and_finds_the_experts(mixtral, moe_plans, moe_tiny, monkeypatch):
    """DeepSpeed's config parser reads the AutoEP section; AutoEP's own validation accepts
    it for the plan's world, and its detection finds the Mixtral's expert layers (and
    none in autopar's model, which the export therefore refuses)."""
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    from deepspeed.module_inject.auto_ep import AutoEP
    from deepspeed.module_inject.auto_ep_config import validate_autoep_config, validate_autoep_post_detection

    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    model, plan = mixtral
    c = plan.config
    data = json.loads(export(plan, to="deepspeed", model=model).text)
    assert data["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: c.dp)
    autoep = ds_config.DeepSpeedConfig(data, mpu=mpu).expert_parallel_config
    assert (autoep.enabled, autoep.autoep_size, autoep.preset_model) == (True, 2, "mixtral")
    validate_autoep_config(autoep, c.world_size, 1, 1, 1, zero_stage=c.zero_stage)
    specs = AutoEP(model, autoep).ep_parser()
    assert [s.num_experts for s in specs] == [4, 4]
    validate_autoep_post_detection(autoep, specs)
    bare = export(plan, to="deepspeed")
    assert "preset_model" not in json.loads(bare.text)["expert_parallel"]
    assert any("AutoEP finds the MoE layers" in n for n in bare.notes)

    # autopar's own mixture-of-experts Llama: AutoEP's detection, trying every preset, finds nothing to replace
    def untyped():
        return ds_config.DeepSpeedConfig(json.loads(bare.text), mpu=mpu).expert_parallel_config

    assert len(AutoEP(model, untyped()).ep_parser()) == 2 and AutoEP(moe_tiny, untyped()).ep_parser() == []
    with pytest.raises(ExportError, match=r"^deepspeed's expert parallelism \(AutoEP\) .* not autopar's mixture-of"):
        export(moe_plans["dp4-ep2"], to="deepspeed", model=moe_tiny)


def test_refusals_are_one_line(moe_plans, mixtral, tiny_gpt, tmp_path, capsys):
    model, plan = mixtral
    tp2 = replace(plan, config=replace(plan.config, tp=2, dp=2, num_microbatches=2 * plan.config.num_microbatches))
    with pytest.raises(ExportError, match=r"^deepspeed's .* does not run under Megatron-DeepSpeed, .* tp=2 pp=1"):
        export(tp2, to="deepspeed")
    # a model AutoEP cannot take is refused as such first: no --set tp=1 that would be refused in turn
    with pytest.raises(ExportError, match=r"not autopar's mixture-of-experts Llama; make a plan with --set ep=1 for"):
        export(moe_plans["tp2-dp4-ep2"], to="deepspeed")
    plan = moe_plans["dp4-ep2"]
    # the plan names autopar's own model, which AutoEP has no preset for, with --model or without
    with pytest.raises(ExportError, match=r"^deepspeed's expert parallelism \(AutoEP\) .* not autopar's mixture-of"):
        export(plan, to="deepspeed")
    with pytest.raises(ExportError, match=r"^accelerate's ParallelismConfig has no expert-parallel axis \(.*ep=2;"):
        export(plan, to="accelerate")
    plan_file = plan.save(tmp_path / "plan.json")
    assert main(["export", str(plan_file), "--to", "accelerate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: accelerate's ParallelismConfig") and err.count("\n") == 1
    dense = variant(_estimate(tiny_gpt, 4, 64, dp=4, tp=1), ep=2)
    for target in ("megatron", "torchtitan", "deepspeed", "accelerate"):
        with pytest.raises(ExportError, match=r"^ep=2 splits a mixture-of-experts model's experts, but .* has none"):
            export(dense, to=target, model=tiny_gpt)
    model = mixtral[0]
    eight = _estimate(model, 8, 128, dp=8, tp=1)
    with pytest.raises(ExportError, match=r"^ep=8 does not divide the model's 4 experts .* ep in \[1, 2, 4\]\.$"):
        export(replace(eight, config=replace(eight.config, ep=8)), to="megatron", model=model)


def test_megatron_builds_a_transformers_deepseek_v3():
    """A small DeepSeek-V3 (transformers' own classes): its multi-latent attention, shared
    expert, first dense block and sigmoid, biased, grouped and scaled router are written as
    Megatron-LM's flags with the config's values, and its pattern of mixture-of-experts
    blocks, evaluated as Megatron evaluates it, is the model's own (which blocks hold a
    routed-experts module); read back by the flags as Megatron declares them. Without
    them Megatron builds another model: softmax routing, no shared expert, every block
    routed, standard attention."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=2,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        rope_scaling={
            "type": "yarn",
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": 64,
        },
    )
    model, plan = _planned(transformers.DeepseekV3ForCausalLM, config, 64)
    args = megatron_args(replace(plan, config=replace(plan.config, ep=2)), model=model)
    assert (args["--num-experts"], args["--moe-router-topk"], args["--moe-ffn-hidden-size"]) == ("8", "2", "32")
    assert args["--moe-shared-expert-intermediate-size"] == str(2 * 32)
    assert args["--ffn-hidden-size"] == "160"  # the dense block's
    routed = [any(type(m).__name__ == "DeepseekV3MoE" for m in layer.modules()) for layer in model.model.layers]
    assert routed == [False, True, True]
    assert [int(x) for x in eval(args["--moe-layer-freq"])] == routed  # as Megatron's moe_freq_type evaluates it
    assert args["--moe-router-score-function"] == "sigmoid" and args["--moe-router-enable-expert-bias"] is True
    assert (args["--moe-router-num-groups"], args["--moe-router-group-topk"]) == ("4", "2")
    assert args["--moe-router-topk-scaling-factor"] == "2.5"
    latent = {f: args[f] for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim")}
    assert latent == {
        "--q-lora-rank": "24",
        "--kv-lora-rank": "16",
        "--qk-head-dim": "16",
        "--qk-pos-emb-head-dim": "8",
    }
    assert args["--v-head-dim"] == "16" and args["--multi-latent-attention"] is True and args["--qk-layernorm"] is True
    assert "--kv-channels" not in args
    yarn = {f: args[f] for f in ("--rope-type", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim")}
    assert yarn == {
        "--rope-type": "yarn",
        "--rotary-scaling-factor": "40",
        "--mscale": "1",
        "--mscale-all-dim": "0.707",
    }
    text = export(replace(plan, config=replace(plan.config, ep=2)), to="megatron", model=model).text
    assert "original_max_position_embeddings=64, which Megatron-LM's flags do not set" in text  # its default 4096
    launch = export(replace(plan, config=replace(plan.config, ep=2)), to="megatron", model=model).launch
    declared_megatron_parser().parse_args(shlex.split(launch.split("pretrain_gpt.py ")[1]))


def test_megatron_reads_shared_experts_and_dense_blocks_from_the_built_model():
    """Qwen2-MoE: a gated shared expert of its own width, and top-k weights left as the
    softmax over every expert (``norm_topk_prob`` false: Megatron's pre-softmax routing);
    Llama 4 with a mixture-of-experts block every second one: the pattern of the blocks
    as built (its experts, which run every token, count as experts here too)."""
    transformers = pytest.importorskip("transformers")
    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    qwen = transformers.Qwen2MoeConfig(
        **tiny,
        num_key_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
    )
    llama4 = transformers.Llama4TextConfig(
        **tiny,
        num_key_value_heads=4,
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=96,
        head_dim=16,
        interleave_moe_layer_step=2,
    )
    found = {}
    for name, config, cls in (("qwen", qwen, "Qwen2MoeForCausalLM"), ("llama4", llama4, "Llama4ForCausalLM")):
        model, plan = _planned(getattr(transformers, cls), config, 32)
        found[name] = megatron_args(plan, model=model)
        declared_megatron_parser().parse_args(
            shlex.split(export(plan, to="megatron", model=model).launch.split("pretrain_gpt.py ")[1])
        )
    q, l4 = found["qwen"], found["llama4"]
    assert q["--moe-shared-expert-intermediate-size"] == "48" and q["--moe-shared-expert-gate"] is True
    assert q["--moe-router-pre-softmax"] is True and "--moe-layer-freq" not in q
    assert [int(x) for x in eval(l4["--moe-layer-freq"])] == [0, 1]
    assert l4["--moe-shared-expert-intermediate-size"] == "128" and "--moe-shared-expert-gate" not in l4
    # Llama 4: the sigmoid of the top-1 logit scales the expert's input; its dense block is
    # intermediate_size_mlp wide, its experts intermediate_size
    assert l4["--moe-router-score-function"] == "sigmoid" and l4["--moe-apply-probs-on-input"] is True
    assert "--moe-router-pre-softmax" not in l4
    assert (l4["--ffn-hidden-size"], l4["--moe-ffn-hidden-size"]) == ("96", "128")


def test_megatron_keeps_deepseek_v2s_softmax_weights_and_says_its_groups_differ():
    """transformers' DeepSeek-V2 never renormalises its top-k softmax weights, whatever
    norm_topk_prob says (Megatron's --moe-router-pre-softmax), and ranks expert groups by
    their best expert, which Megatron's grouped router does not: noted."""
    transformers = pytest.importorskip("transformers")
    config = transformers.DeepseekV2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        norm_topk_prob=True,
        first_k_dense_replace=0,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
    )
    model, plan = _planned(transformers.DeepseekV2ForCausalLM, config, 64)
    args = megatron_args(plan, model=model)
    assert args["--moe-router-pre-softmax"] is True and "--moe-router-score-function" not in args
    assert (args["--moe-router-num-groups"], args["--moe-router-group-topk"]) == ("4", "2")
    assert "--q-lora-rank" not in args and args["--kv-lora-rank"] == "16"
    assert any("ranks them by their best expert" in n for n in export(plan, to="megatron", model=model).notes)


def test_megatron_export_names_what_its_flags_do_not_build():
    """gpt-oss: sliding-window attention on half its layers, attention sinks and a clamped
    SwiGLU, none of which Megatron-LM builds from size flags: the export says so, on the
    command line's notes, rather than write a launch for another model in silence."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GptOssConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=16,
        max_position_embeddings=64,
    )
    model, plan = _planned(transformers.GptOssForCausalLM, config, 32)
    (note,) = [n for n in export(plan, to="megatron", model=model).notes if "which these flags do not build" in n]
    assert "sliding-window attention (window 16) on 1 of its 2 layers" in note
    assert "attention sinks" in note and "a SwiGLU clamped at 7" in note
    mixtral = export(_estimate(_mixtral(), 4, 32, dp=4, tp=1), to="megatron", model=_mixtral())
    assert not any("which these flags do not build" in n for n in mixtral.notes)
