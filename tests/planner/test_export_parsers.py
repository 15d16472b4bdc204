"""Each export read back by its framework's own config parser, where it is installed
(``pip install 'autopar[interop]'``); skipped otherwise.

- DeepSpeed: ``deepspeed.runtime.config.DeepSpeedConfig``, which checks the batch
  arithmetic against the data-parallel size and validates every section.
- torchtitan 0.2.x: ``ConfigManager`` reading ``--job.config_file``, which refuses
  unknown fields (torchtitan 0.3 reads no TOML: skipped there).
- Accelerate: ``load_config_from_file``, then ``accelerate launch``'s own validation and
  environment, and the FSDP plugin and parallelism config built from that environment.
- Megatron-LM: ``parse_args``, ``validate_args`` and the ``TransformerConfig`` built from
  them when ``megatron.training`` imports (a Megatron-LM checkout on the path: it is not
  on PyPI); always, an argparse parser with the flags as Megatron-LM core_v0.16.1's
  ``arguments.py`` declares them, which refuses any other flag or value.
"""

import argparse
import importlib.util
import json
import math
import shlex
import sys
import types

import pytest
import torch
from torch.distributed.pipelining.schedules import get_schedule_class

import autopar
from autopar.export import export
from autopar.models import build_named_model
from autopar.runtime.pipeline import SCHEDULES
from autopar.vocab import Recompute

from .test_export import variant


@pytest.fixture(scope="module")
def llama_plan():
    """An interleaved, recomputing, tensor- and pipeline-parallel Llama plan, and its model."""
    model = build_named_model("llama3-8b")
    plan = autopar.estimate(
        model,
        autopar.preset("dgx-a100-80gb", nodes=2),
        {"tp": 2, "pp": 4, "virtual_stages": 2, "schedule": "interleaved-1f1b", "recompute": "full", "zero_stage": 1},
        global_batch_size=64,
        seq_len=4096,
    )
    return plan, model


@pytest.fixture()
def cases(gpt2_plan, pipelined_plan, llama_plan):
    """Plans that cover every mapping: ZeRO 0-3, pipelining even, uneven and interleaved,
    recompute uniform (each mode) and per block, fp16, context parallelism, compiled blocks with FP8,
    asynchronous tensor parallelism."""
    llama, _ = llama_plan
    full = {f"layers.{i}": Recompute.FULL for i in (0, 1, 2, 20, 21, 22)}
    return {
        "gpt2-zero2": gpt2_plan,
        "gpt2-zero3-fp16": variant(gpt2_plan, zero_stage=3, dtype="fp16", recompute=Recompute.SELECTIVE),
        "gpt2-zero0": variant(gpt2_plan, zero_stage=0),
        "gpt-tp-pp": pipelined_plan,
        "gpt-uneven-block-recompute": variant(pipelined_plan, blocks_per_stage=[19, 21], overrides=full),
        "gpt-layout": variant(pipelined_plan, pp=4, dp=1, blocks_per_stage=[9, 11, 12, 8], zero_stage=0),
        "llama-interleaved": llama,
        # zero-bubble schedules run eager blocks (torch does not split a compiled backward)
        "llama-zbv": variant(llama, schedule="zbv", compile=False),
        "llama-dualpipev": variant(llama, schedule="dualpipev", compile=False),
        "llama-interleaved-zb": variant(llama, schedule="interleaved-zb", compile=False),
        "gpt2-cp": variant(gpt2_plan, dp=4, cp=2),
        "gpt-tp-pp-cp": variant(pipelined_plan, dp=1, cp=2, zero_stage=1),
        "llama-compiled-fp8": variant(llama, compile=True, fp8=True),
        "llama-op-recompute": variant(llama, recompute=Recompute.OP),
        "llama-async-tp": variant(llama, sequence_parallel=True, compile=True, async_tp=True),
        "gpt2-zero3-bf16-reduce": variant(gpt2_plan, zero_stage=3, reduce_dtype="bf16"),
        "gpt-tp-pp-bf16-reduce": variant(pipelined_plan, zero_stage=2, reduce_dtype="bf16"),
    }


ACCUMULATED_IN_BF16 = {"gpt-tp-pp-bf16-reduce"}
"""The cases whose gradients autopar's runtime sums over micro-batches in bf16 (pipelined,
reduced in bf16: FSDP2 accumulates the unsharded bf16 ``.grad``); fp32 elsewhere."""


def test_deepspeed_parses_every_export(cases, monkeypatch):
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda: 0)
    for name, plan in cases.items():
        if plan.config.cp > 1:
            continue  # refused, see test_export_cp.py
        data = json.loads(export(plan, to="deepspeed").text)
        mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda plan=plan: plan.config.dp)
        parsed = ds_config.DeepSpeedConfig(data, mpu=mpu)
        c = plan.config
        assert parsed.world_size == c.dp, name
        assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu) == (
            c.global_batch_size,
            c.micro_batch_size,
        )
        assert parsed.gradient_accumulation_steps == c.num_microbatches, name
        assert parsed.zero_optimization_stage == (min(c.zero_stage, 1) if c.pp > 1 else c.zero_stage), name
        assert parsed.bfloat16_config.enabled == (c.dtype.value == "bf16"), name
        assert parsed.float16_config.enabled == (c.dtype.value == "fp16"), name
        reduced = {"bf16": torch.bfloat16, "fp32": torch.float32}[c.reduce_dtype.value]
        assert parsed.communication_data_type == (reduced if c.dtype.value != "fp32" else None), name
        wrapper, accumulated = _deepspeed_gradients(parsed, pipelined=c.pp > 1)  # DeepSpeed's own choice
        if c.dtype.value == "fp32":
            assert (wrapper, accumulated) == (None, torch.float32), name
        elif parsed.zero_optimization_stage == 0:  # it accumulates in the training precision only, and is told so
            assert accumulated is {"bf16": torch.bfloat16, "fp16": torch.float16}[c.dtype.value], name
            assert any("accumulates gradients in" in note for note in data["autopar"]["notes"]), name
        else:
            expected = torch.bfloat16 if name in ACCUMULATED_IN_BF16 else torch.float32
            assert accumulated is expected, name
    wrong = types.SimpleNamespace(get_data_parallel_world_size=lambda: 3)
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        ds_config.DeepSpeedConfig(json.loads(export(cases["gpt2-zero2"], to="deepspeed").text), mpu=wrong)


def _deepspeed_gradients(parsed, *, pipelined: bool):
    """The optimizer wrapper ``deepspeed.initialize`` picks for the config ``parsed`` and the
    precision it accumulates gradients in, by ``DeepSpeedEngine``'s own methods on an engine
    holding only the config (which raise for a mix DeepSpeed does not run)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    engine = DeepSpeedEngine.__new__(DeepSpeedEngine)
    torch.nn.Module.__init__(engine)
    engine._config, engine.pipeline_parallelism, engine.global_rank = parsed, pipelined, 0
    wrapper = engine._do_optimizer_sanity_check(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
    return wrapper, engine.get_data_types()[1]


def _torchtitan_config_manager(monkeypatch):
    """torchtitan 0.2.x's ConfigManager, imported without the package's ``__init__``
    (which loads its float8 kernels, and so Triton, to register converters)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None:
        pytest.skip("torchtitan is not installed")
    package = types.ModuleType("torchtitan")
    package.__path__ = list(spec.submodule_search_locations)
    monkeypatch.setitem(sys.modules, "torchtitan", package)
    for name in [m for m in sys.modules if m.startswith("torchtitan.")]:
        monkeypatch.delitem(sys.modules, name)
    if importlib.util.find_spec("torchtitan.config.job_config") is None:
        pytest.skip("torchtitan >= 0.3 reads no TOML job config (its configs are Python functions)")
    return importlib.import_module("torchtitan.config").ConfigManager


def test_torchtitan_parses_every_export(cases, tmp_path, monkeypatch):
    pytest.importorskip("tyro")
    manager = _torchtitan_config_manager(monkeypatch)
    for name, plan in cases.items():
        if plan.config.reduce_dtype.value != "fp32":
            continue  # refused, see test_reduce_dtype.py
        path = export(plan, to="torchtitan").save(tmp_path / f"{name}.toml")
        job = manager().parse_args(["--job.config_file", str(path)])
        c, p, t = plan.config, job.parallelism, job.training
        dp = p.data_parallel_replicate_degree * p.data_parallel_shard_degree
        degrees = (dp, p.context_parallel_degree, p.tensor_parallel_degree, p.pipeline_parallel_degree)
        assert degrees == (c.dp, c.cp, c.tp, c.pp) and math.prod(degrees) == plan.cluster.world_size, name
        assert t.global_batch_size == c.global_batch_size and t.seq_len == plan.model.seq_len, name
        if c.pp > 1:
            assert p.module_fqns_per_model_part == [list(s) for s in plan.stages], name
            # torchtitan hands the name to torch's own lookup: it must name the runtime's class
            assert get_schedule_class(p.pipeline_parallel_schedule) is SCHEDULES[c.schedule], name
            assert t.local_batch_size // p.pipeline_parallel_microbatch_size == c.num_microbatches, name
        expected = {Recompute.NONE: "none", Recompute.FULL: "full"}.get(c.recompute, "selective")
        if not plan.layer_strategies.recompute:
            assert job.activation_checkpoint.mode == expected, name
        assert job.compile.enable == c.compile and (not c.compile or job.compile.components == ["model"]), name
        assert p.enable_async_tensor_parallel == c.async_tp, name
        float8 = job.quantize.linear.float8
        assert (float8.recipe_name, float8.filter_fqns) == (("tensorwise", ["output"]) if c.fp8 else (None, [])), name


def test_accelerate_parses_and_launches_every_export(cases, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    for name, plan in cases.items():
        if plan.config.pp > 1:
            continue  # refused, see test_export.py
        c = plan.config
        path = export(plan, to="accelerate").save(tmp_path / f"{name}.yaml")
        assert load_config_from_file(str(path)).num_processes == c.world_size, name
        args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
        args, _, _ = _validate_launch_command(args)
        assert args.num_processes == c.world_size and args.use_fsdp == (c.zero_stage > 0 or c.cp > 1), name
        env = prepare_multi_gpu_env(args)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        if args.use_fsdp:
            plugin = FullyShardedDataParallelPlugin()
            assert plugin.fsdp_version == 2 and plugin.reshard_after_forward == (c.zero_stage == 3), name
            assert plugin.activation_checkpointing == (c.recompute is not Recompute.NONE), name
    tp = variant(cases["gpt-tp-pp"], pp=1, dp=4)
    path = export(tp, to="accelerate").save(tmp_path / "tp.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    sizes = ParallelismConfig()
    assert (sizes.dp_shard_size, sizes.tp_size, sizes.total_size) == (4, 4, 16)


def _megatron_words(plan, model=None) -> tuple[dict[str, str], list[str]]:
    """The environment and the arguments of an export's launch line."""
    words = shlex.split(export(plan, to="megatron", model=model).launch)
    start = words.index("torchrun")
    env = dict(w.split("=", 1) for w in words[:start])
    return env, words[words.index("pretrain_gpt.py") + 1 :]


def test_megatron_own_parser(cases, llama_plan, monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 8)  # the plans' A100s
    models = {"gpt2": build_named_model("gpt2-small"), "gpt-": build_named_model("gpt3-13b")}
    checked = {name: (plan, models[name[:4]] if name[:4] in models else llama_plan[1]) for name, plan in cases.items()}
    for name, (plan, model) in checked.items():
        env, words = _megatron_words(plan, model)
        words += ["--no-rope-fusion"] * ("rope" in words)  # fused RoPE needs Transformer Engine
        words += ["--tokenizer-type", "NullTokenizer", "--vocab-size", "50257", "--mock-data"]
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *words, "--train-iters", "1", "--lr", "1e-4"])
        monkeypatch.setenv("WORLD_SIZE", str(plan.config.world_size))
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        args = arguments.parse_args()
        arguments.validate_args(args)
        c = plan.config
        assert (args.data_parallel_size, args.global_batch_size) == (c.dp, c.global_batch_size), name
        assert args.context_parallel_size == c.cp, name
        assert args.use_distributed_optimizer == (c.zero_stage in (1, 2) or (c.zero_stage == 3 and c.pp > 1)), name
        config = arguments.core_transformer_config_from_args(args)  # checks the pipeline split
        assert config.num_layers == sum(u.startswith("layers.") for u in plan.model.units), name
        assert (config.virtual_pipeline_model_parallel_size or 1) == c.virtual_stages, name


MEGATRON_FLAGS = {
    # (type, choices) of each flag the exporter may write, as Megatron-LM core_v0.16.1's
    # arguments.py declares it; a type of None is a store_true switch
    "--tensor-model-parallel-size": (int, None),
    "--pipeline-model-parallel-size": (int, None),
    "--context-parallel-size": (int, None),
    # declared without choices (nargs="+"); these are the values TransformerConfig
    # documents and Transformer Engine accepts (the help text's "allgather" is neither)
    "--cp-comm-type": (str, ["p2p", "all_gather", "a2a", "a2a+p2p"]),
    "--sequence-parallel": (None, None),
    "--tp-comm-overlap": (None, None),
    "--num-layers-per-virtual-pipeline-stage": (int, None),
    "--decoder-first-pipeline-num-layers": (int, None),
    "--decoder-last-pipeline-num-layers": (int, None),
    "--pipeline-model-parallel-layout": (str, None),
    "--micro-batch-size": (int, None),
    "--global-batch-size": (int, None),
    "--use-distributed-optimizer": (None, None),
    "--use-megatron-fsdp": (None, None),
    "--data-parallel-sharding-strategy": (str, ["no_shard", "optim", "optim_grads", "optim_grads_params"]),
    "--ckpt-format": (str, ["torch", "torch_dist", "torch_dcp", "fsdp_dtensor"]),
    "--recompute-granularity": (str, ["full", "selective"]),
    "--recompute-method": (str, ["uniform", "block"]),
    "--recompute-num-layers": (int, None),
    "--bf16": (None, None),
    "--fp16": (None, None),
    "--grad-reduce-in-bf16": (None, None),
    "--fp8-format": (str, ["e4m3", "hybrid"]),
    "--num-layers": (int, None),
    "--seq-length": (int, None),
    "--hidden-size": (int, None),
    "--num-attention-heads": (int, None),
    "--ffn-hidden-size": (int, None),
    "--max-position-embeddings": (int, None),
    "--group-query-attention": (None, None),
    "--num-query-groups": (int, None),
    "--normalization": (str, ["LayerNorm", "RMSNorm"]),
    "--norm-epsilon": (float, None),
    "--swiglu": (None, None),
    "--position-embedding-type": (str, ["learned_absolute", "rope", "mrope", "relative", "none"]),
    "--rotary-base": (int, None),
    "--untie-embeddings-and-output-weights": (None, None),
    "--disable-bias-linear": (None, None),
    "--add-qkv-bias": (None, None),
    "--kv-channels": (int, None),
    "--qk-layernorm": (None, None),
    "--rotary-percent": (float, None),
    "--use-rope-scaling": (None, None),
    "--rope-scaling-factor": (float, None),
    "--optimizer": (str, ["adam", "sgd", "muon", "dist_muon"]),
    "--num-experts": (int, None),
    "--moe-router-topk": (int, None),
    "--moe-ffn-hidden-size": (int, None),
    "--moe-router-pre-softmax": (None, None),
    "--moe-expert-capacity-factor": (float, None),
    "--moe-pad-expert-input-to-capacity": (None, None),
    "--moe-token-drop-policy": (str, ["probs", "position"]),
    "--expert-model-parallel-size": (int, None),
    "--expert-tensor-parallel-size": (int, None),
    "--moe-token-dispatcher-type": (str, ["allgather", "alltoall", "flex"]),
    "--moe-shared-expert-intermediate-size": (int, None),
    "--moe-shared-expert-gate": (None, None),
    "--moe-layer-freq": (str, None),  # moe_freq_type: an int, or a list expression it evaluates
    # from TransformerConfig's fields (ArgumentGroupFactory): a Literal's choices, a bool a switch
    "--moe-router-score-function": (str, ["softmax", "sigmoid"]),
    "--moe-router-enable-expert-bias": (None, None),
    "--moe-apply-probs-on-input": (None, None),
    "--moe-router-num-groups": (int, None),
    "--moe-router-group-topk": (int, None),
    "--moe-router-topk-scaling-factor": (float, None),
    "--multi-latent-attention": (None, None),
    "--rope-type": (str, ["rope", "yarn"]),
    "--rotary-scaling-factor": (float, None),
    "--mscale": (float, None),
    "--mscale-all-dim": (float, None),
    "--q-lora-rank": (int, None),
    "--kv-lora-rank": (int, None),
    "--qk-head-dim": (int, None),
    "--qk-pos-emb-head-dim": (int, None),
    "--v-head-dim": (int, None),
}


def _megatron_stage_layers(args: argparse.Namespace, num_stages: int) -> list[int]:
    """Layers per (virtual) stage as Megatron derives them from the parsed flags: the
    layout's ``t`` per stage, else first/last sizes with the rest even, else even."""
    if args.pipeline_model_parallel_layout:
        return [stage.count("t") for stage in _unrolled(args.pipeline_model_parallel_layout).split("|")]
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    ends = [n for n in (first, last) if n is not None]
    middle = num_stages - len(ends)
    each = (args.num_layers - sum(ends)) // middle if middle else 0
    counts = [each] * num_stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _unrolled(layout: str) -> str:
    """Megatron's layout grammar: ``x*n`` repeats one character (no parentheses written)."""
    out = ""
    for part in layout.replace(",", "").split("*"):
        if out and part[:1].isdigit():
            digits = len(part) - len(part.lstrip("0123456789"))
            out += out[-1] * (int(part[:digits]) - 1) + part[digits:]
        else:
            out += part
    return out


def declared_megatron_parser() -> argparse.ArgumentParser:
    """An argparse parser of :data:`MEGATRON_FLAGS`: an undeclared flag or a bad value raises."""
    parser = argparse.ArgumentParser(allow_abbrev=False, exit_on_error=False)
    for flag, (kind, choices) in MEGATRON_FLAGS.items():
        if kind is None:
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=kind, choices=choices)
    return parser


def test_megatron_flags_as_megatron_declares_them(cases, llama_plan):
    parser = declared_megatron_parser()
    checked = {**cases, "llama-interleaved": llama_plan[0]}
    for name, plan in checked.items():
        model = llama_plan[1] if name == "llama-interleaved" else None
        _, words = _megatron_words(plan, model)
        args = parser.parse_args(words)  # an undeclared flag or a bad value raises
        c = plan.config
        model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size
        dp = plan.cluster.world_size // (model_parallel * (args.context_parallel_size or 1))
        assert (dp, args.global_batch_size // (args.micro_batch_size * dp)) == (c.dp, c.num_microbatches), name
        if c.pp > 1:
            counts = _megatron_stage_layers(args, c.num_stages)
            per_stage = [sum(u.startswith("layers.") for u in stage) for stage in plan.stages]
            assert counts == per_stage, name


def test_hsdp_exports_parse_with_the_replicate_and_shard_degrees(gpt2_plan, tmp_path, monkeypatch):
    """dp=8 as 4 replicate groups x shard groups of 2, ZeRO-3: torchtitan and Accelerate
    read the two degrees back from their own parsers; Megatron-LM writes the replicate
    groups as distributed-optimizer instances (Megatron-FSDP's hybrid sharding); DeepSpeed
    writes the closest (sharding over all of dp) and says so."""
    plan = variant(gpt2_plan, zero_stage=3, dp_shard=2)
    assert (plan.config.dp, plan.config.replicate_size) == (8, 4)
    assert any("HSDP" in note and "all 8 data-parallel ranks" in note for note in export(plan, to="deepspeed").notes)
    megatron = export(plan, to="megatron")
    assert not any("HSDP" in note for note in megatron.notes)
    for zero in (2, 3):  # the distributed optimizer's instances, Megatron-FSDP's
        _, words = _megatron_words(variant(gpt2_plan, zero_stage=zero, dp_shard=2))
        assert words[words.index("--num-distributed-optimizer-instances") + 1] == "4", zero
    _, words = _megatron_words(variant(gpt2_plan, zero_stage=3))
    assert "--num-distributed-optimizer-instances" not in words
    if importlib.util.find_spec("tyro") and importlib.util.find_spec("torchtitan"):
        manager = _torchtitan_config_manager(monkeypatch)
        path = export(plan, to="torchtitan").save(tmp_path / "hsdp.toml")
        p = manager().parse_args(["--job.config_file", str(path)]).parallelism
        assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree) == (4, 2)
        assert p.fsdp_reshard_after_forward == "always"
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = export(plan, to="accelerate").save(tmp_path / "hsdp.yaml")
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    sizes = ParallelismConfig()
    assert (sizes.dp_replicate_size, sizes.dp_shard_size, sizes.tp_size) == (4, 2, 1)
    assert sizes.dp_replicate_enabled and sizes.total_size == 8
