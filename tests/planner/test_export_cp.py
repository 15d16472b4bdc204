"""Context parallelism in every export: the degrees each framework reads back with its own
parser (where installed) multiply to the plan's world, the batch is split over dp only,
the key/value exchange is the all-gather the plan assumes, a sequence length a framework
cannot split is refused, and DeepSpeed, which has no ring attention, refuses cp in one
line."""

import importlib
import types
from dataclasses import replace

import pytest

from autopar.cli import main
from autopar.export import ExportError, export

from .test_export import megatron_args, torchtitan_config, variant
from .test_export_parsers import _torchtitan_config_manager


@pytest.fixture()
def cp_plans(gpt2_plan, pipelined_plan):
    """cp=2 plans: GPT-2 on 8 devices as dp 4 x cp 2 under ZeRO-1, and the 13B plan's
    tp 4 x pp 2 on 16 devices with cp 2 and dp 1 (ZeRO-0)."""
    return {
        "gpt2-dp4-cp2": variant(gpt2_plan, dp=4, cp=2, zero_stage=1),
        "gpt-tp-pp-cp2": variant(pipelined_plan, dp=1, cp=2),
    }


def test_megatron_context_parallel_flags(cp_plans):
    for name, plan in cp_plans.items():
        c = plan.config
        args = megatron_args(plan)
        tp, pp = int(args["--tensor-model-parallel-size"]), int(args["--pipeline-model-parallel-size"])
        assert (args["--context-parallel-size"], args["--cp-comm-type"]) == ("2", "all_gather"), name
        # Megatron's data-parallel size is world / (tp x pp x cp), and the global batch is split over it only
        dp = plan.cluster.world_size // (tp * pp * 2)
        assert dp == c.dp and int(args["--global-batch-size"]) == dp * int(args["--micro-batch-size"]) * (
            c.num_microbatches
        ), name
        result = export(plan, to="megatron")
        # Megatron asserts one CUDA work queue under context parallelism, with tp=1 too
        assert result.launch.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun"), name
        assert any("--cp-comm-type all_gather" in n and "all-gathers" in n for n in result.notes), name
        assert f"sequence length {plan.model.seq_len}, split over cp 2 ranks" in result.text, name
    assert "--use-distributed-optimizer" in megatron_args(cp_plans["gpt2-dp4-cp2"])
    # ZeRO-1 with dp 1: the distributed optimizer still shards over the 2 context-parallel ranks
    assert "--use-distributed-optimizer" in megatron_args(variant(cp_plans["gpt-tp-pp-cp2"], zero_stage=1))


def test_torchtitan_context_parallel_degrees(cp_plans, gpt2_plan):
    for name, plan in cp_plans.items():
        c = plan.config
        p = torchtitan_config(plan)["parallelism"]
        assert (p["context_parallel_degree"], p["context_parallel_rotate_method"]) == (2, "allgather"), name
        dp = p["data_parallel_replicate_degree"] * p["data_parallel_shard_degree"]
        world = dp * p["context_parallel_degree"] * p["tensor_parallel_degree"] * p["pipeline_parallel_degree"]
        assert dp == c.dp and world == plan.cluster.world_size, name
    # ZeRO-0 is no longer DDP: torchtitan shards with FSDP over dp x cp whenever cp > 1
    ddp = variant(gpt2_plan, dp=4, cp=2, zero_stage=0)
    p = torchtitan_config(ddp)["parallelism"]
    assert (p["data_parallel_replicate_degree"], p["data_parallel_shard_degree"]) == (1, 4)
    assert p["fsdp_reshard_after_forward"] == "never"
    assert any("tensor, pipeline or context parallelism" in n for n in export(ddp, to="torchtitan").notes)
    assert torchtitan_config(variant(gpt2_plan, zero_stage=0))["parallelism"]["data_parallel_replicate_degree"] == 8


def test_torchtitan_parses_context_parallel_exports(cp_plans, tmp_path, monkeypatch):
    """torchtitan's JobConfig reads the degrees, and its ParallelDims, which refuses a
    product other than the world size, accepts them with the plan's world."""
    pytest.importorskip("tyro")
    manager = _torchtitan_config_manager(monkeypatch)
    parallel_dims = importlib.import_module("torchtitan.distributed.parallel_dims").ParallelDims
    for name, plan in cp_plans.items():
        c = plan.config
        path = export(plan, to="torchtitan").save(tmp_path / f"{name}.toml")
        job = manager().parse_args(["--job.config_file", str(path)])
        p = job.parallelism
        assert (p.context_parallel_degree, p.context_parallel_rotate_method) == (c.cp, "allgather"), name
        degrees = {
            "dp_replicate": p.data_parallel_replicate_degree,
            "dp_shard": p.data_parallel_shard_degree,
            "cp": p.context_parallel_degree,
            "tp": p.tensor_parallel_degree,
            "pp": p.pipeline_parallel_degree,
        }
        world = plan.cluster.world_size
        assert degrees["dp_replicate"] * degrees["dp_shard"] * c.cp * c.tp * c.pp == world, name
        dims = parallel_dims(**degrees, ep=1, etp=1, world_size=world)
        # the batch is split over dp only; gradients are averaged and FSDP shards over dp x cp
        assert dims.dp_replicate * dims.dp_shard == c.dp and dims.fsdp_enabled, name
        assert dims.fsdp_gradient_divide_factor == c.dp_cp == c.state_shards, name
        assert job.training.global_batch_size == c.global_batch_size, name
        assert job.training.seq_len % dims.seq_len_divisor == 0, name


def test_accelerate_parses_context_parallel_exports(cp_plans, pipelined_plan, tmp_path, monkeypatch):
    """Accelerate's launch validation, its ParallelismConfig built from the launch
    environment and its own check of that config against the process count."""
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    gpt2 = cp_plans["gpt2-dp4-cp2"]
    plans = {
        "zero0": variant(gpt2, zero_stage=0),
        "zero1": gpt2,
        "zero3": variant(gpt2, zero_stage=3),
        "tp-cp": variant(pipelined_plan, pp=1, dp=2, cp=2),
    }
    for name, plan in plans.items():
        c = plan.config
        path = export(plan, to="accelerate").save(tmp_path / f"{name}.yaml")
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)  # refuses a parallelism config without FSDP2
        assert args.use_fsdp and args.use_parallelism_config and args.num_processes == c.world_size, name
        for key, value in prepare_multi_gpu_env(args).items():
            monkeypatch.setenv(key, value)
        sizes = ParallelismConfig()
        assert (sizes.dp_replicate_size * sizes.dp_shard_size, sizes.cp_size, sizes.tp_size) == (c.dp, 2, c.tp), name
        assert sizes.total_size == plan.cluster.world_size, name
        assert sizes.cp_handler.cp_comm_strategy == "allgather" and "cp" in sizes.non_dp_dim_names, name
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (c.zero_stage == 3), name
        launched = types.SimpleNamespace(
            multi_device=True,
            num_processes=args.num_processes,
            is_fsdp2=True,
            distributed_type=DistributedType.FSDP,
            is_main_process=True,
        )
        sizes._validate_accelerator(launched)  # raises unless the sizes multiply to the process count
    assert any(
        "tensor and context parallelism with FSDP only" in n for n in export(plans["zero0"], to="accelerate").notes
    )


def test_deepspeed_refuses_context_parallelism(cp_plans, tmp_path, capsys):
    plan = cp_plans["gpt2-dp4-cp2"]
    with pytest.raises(
        ExportError,
        match=r"^deepspeed has no ring-attention context parallelism \(the plan has cp=2; .*\); make a plan with --set "
        r"cp=1 for deepspeed\. This plan exports as it is to megatron, torchtitan and accelerate\.$",
    ):
        export(plan, to="deepspeed")
    plan_file = plan.save(tmp_path / "plan.json")
    assert main(["export", str(plan_file), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopar: error: deepspeed has no ring-attention") and err.count("\n") == 1


def test_a_sequence_that_does_not_split_is_refused(cp_plans):
    """Every framework cuts each sequence into 2 x cp chunks; torchtitan's models also
    shard it over tp (2 x cp = 4 here, tp x 2 x cp = 16)."""
    plan = cp_plans["gpt-tp-pp-cp2"]

    def with_seq_len(p, n):
        return replace(p, model=replace(p.model, seq_len=n))

    with pytest.raises(ExportError, match=r"multiple of 2 x cp = 4, but the plan has seq_len=2050; make the plan"):
        export(with_seq_len(plan, 2050), to="megatron")
    fours = with_seq_len(plan, 2052)
    assert "--seq-length 2052" in export(fours, to="megatron").launch
    with pytest.raises(ExportError, match=r"^torchtitan needs .* multiple of tp x 2 x cp = 16, but .* seq_len=2052;"):
        export(fours, to="torchtitan")
    gpt2 = cp_plans["gpt2-dp4-cp2"]
    with pytest.raises(ExportError, match=r"^Accelerate's context parallelism needs .* 2 x cp = 4, .* seq_len=1022;"):
        export(with_seq_len(gpt2, 1022), to="accelerate")
