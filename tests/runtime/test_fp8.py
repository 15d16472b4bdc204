"""FP8 matmuls (``ParallelConfig.fp8``): the runtime swaps the blocks' linears for torchao's
``Float8Linear`` and trains exactly as the model converted by torchao itself does.

FP8 plans are made for an H100 cluster (the planner refuses fp8 elsewhere); the runtime
reads only the plan's config and per-layer decisions, so they run here on CPU gloo
processes, where torchao emulates FP8 (operands rounded to FP8, multiplied in high
precision): the numerics are FP8's.

The references are independent of :mod:`autopar.runtime.fp8`: the same model converted
by torchao's ``convert_to_float8_training`` with its own filter (the block linears whose
dimensions are multiples of 16) and run by the same plan without ``fp8``. Nothing else
differs, so losses and weights must match bit for bit. FP8 must also really change the
numbers (the losses differ from the bf16 run's) while tracking them (``FP8_RTOL``).
"""

import dataclasses

import pytest
import torch
from parity import (
    GPT_CFG,
    LLAMA_CFG,
    LR,
    all_params,
    batches,
    build,
    make_plan,
    megatron_styles,
    run,
    token_loss,
    train,
)
from torch import nn

import autopar
from autopar.models import Llama
from autopar.runtime.api import parallelize
from autopar.runtime.fp8 import convert_blocks

float8 = pytest.importorskip("torchao.float8", reason="FP8 plans need torchao")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear

STEPS = 3
EXACT = dict(rtol=0, atol=0)
FP8_RTOL = 2**-4
"""e4m3 keeps 3 bits of mantissa: one rounding moves a value by up to 2^-4 relative.
The loss of an FP8 run stays within that of the bf16 run's (the head and the loss are
bf16/fp32 in both; only the blocks' matmul operands are rounded coarser)."""

pytestmark = pytest.mark.filterwarnings("ignore:fp8=True on cpu")


def fp8_plan(name: str = "gpt", **config) -> autopar.Plan:
    """A bf16 + fp8 plan for an H100 node of as many devices as the plan has ranks."""
    world = config.get("dp", 1) * config.get("tp", 1) * config.get("pp", 1)
    cluster = autopar.preset("dgx-h100", nodes=1, devices_per_node=world)
    plan = make_plan(name, cluster=cluster, dtype="bf16", fp8=True, **config)
    assert plan.config.fp8
    return plan


def without_fp8(plan: autopar.Plan) -> autopar.Plan:
    """The same plan in plain bf16."""
    return dataclasses.replace(plan, config=dataclasses.replace(plan.config, fp8=False))


def torchao_converted(name: str, device: str = "cpu") -> nn.Module:
    """The reference model: ``build(name, device)`` with torchao's own conversion of the
    block linears (under ``layers.``) whose dimensions are multiples of 16, emulated FP8."""
    model = build(name, device)

    def blocks_only(module: nn.Module, fqn: str) -> bool:
        return fqn.startswith("layers.") and module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = float8.Float8LinearConfig(emulate=True)
    return float8.convert_to_float8_training(model, module_filter_fn=blocks_only, config=config)


def _float8_modules(rank, world, name, plan):
    """The FQNs of the Float8Linear and plain Linear modules of this rank's stages."""
    job = parallelize(build(name), plan, loss_fn=lambda out, y: out.float().mean(), measure_memory=False)
    fp8 = sorted(n for s in job.stages for n, m in s.named_modules() if isinstance(m, Float8Linear))
    plain = sorted(
        n
        for s in job.stages
        for n, m in s.named_modules()
        if isinstance(m, nn.Linear) and not isinstance(m, Float8Linear)
    )
    params = sorted(n for s in job.stages for n, _ in s.named_parameters())
    return fp8, plain, params


def _reference_run(rank, world, name, plan, steps):
    """The plan without fp8 on the model torchao converted."""
    return train(rank, world, name, without_fp8(plan), steps, model_fn=lambda: torchao_converted(name))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_the_block_linears_become_float8_and_nothing_else(name):
    """The linears of every block are Float8Linear; the embeddings and the head keep
    their types, and every parameter keeps its name."""
    plan = fp8_plan(name)
    ((fp8, plain, params),) = run(_float8_modules, 1, name, plan)
    n_layers = {"gpt": GPT_CFG, "llama": LLAMA_CFG}[name].n_layers
    leaves = ["attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w2"]
    leaves += ["feed_forward.w3"] if name == "llama" else []
    assert fp8 == sorted(f"layers.{i}.{leaf}" for i in range(n_layers) for leaf in leaves)
    assert plain == ["output"]
    assert params == sorted(n for n, _ in build(name).named_parameters())


def test_experts_and_linears_with_dimensions_off_16_stay_bf16():
    """Llama with ffn_dim 40 (not a multiple of 16): only the attention projections of
    its blocks convert. The MoE model's experts are 3-D stacks and its router a bare
    parameter, so again only the attention projections convert."""
    units = ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    attention = [f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")]
    torch.manual_seed(0)
    llama = Llama(dataclasses.replace(LLAMA_CFG, n_layers=2, ffn_dim=40))
    assert convert_blocks(llama, units, emulate=True) == attention
    assert not isinstance(llama.layers["0"].feed_forward.w1, Float8Linear)
    assert isinstance(llama.layers["0"].attention.wk, Float8Linear)
    moe = build("moe")
    assert convert_blocks(moe, ["layers.0", "layers.1"], emulate=True) == attention
    assert sorted(n for n, m in moe.named_modules() if isinstance(m, Float8Linear)) == sorted(attention)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_one_process_trains_like_the_torchao_converted_model(name):
    """One rank: the losses and weights of three SGD steps equal, bit for bit, those of
    the torchao-converted model under the bf16 plan; they differ from plain bf16's but
    track them within FP8's precision."""
    plan = fp8_plan(name)
    (fp8,) = run(train, 1, name, plan, STEPS)
    (ref,) = run(_reference_run, 1, name, plan, STEPS)
    (bf16,) = run(train, 1, name, without_fp8(plan), STEPS)
    torch.testing.assert_close(torch.tensor(fp8.losses), torch.tensor(ref.losses), **EXACT)
    for n, value in fp8.params.items():
        torch.testing.assert_close(value, ref.params[n], **EXACT, msg=lambda m, n=n: f"parameter {n}: {m}")
    assert fp8.losses != bf16.losses  # FP8 really ran
    torch.testing.assert_close(torch.tensor(fp8.losses), torch.tensor(bf16.losses), rtol=FP8_RTOL, atol=0)
    assert fp8.extra["dtypes"] == {"torch.float32"}  # fp32 master weights, as bf16 plans keep


BF16_RTOL = 2e-2
"""As in test_features: bf16 keeps 8 bits of mantissa (2^-8 relative per rounding), and a
few steps accumulate several roundings per matmul. A row-split matmul rounds its
partial sums to bf16 before adding them, and a data-parallel step adds gradients of
half-batches: bf16 differences."""

COMPOSITIONS = {
    "dp2-zero0": dict(dp=2, zero_stage=0),
    "pp2": dict(pp=2, num_microbatches=4),
    "fsdp2-zero3": dict(dp=2, zero_stage=3),
    "tp2": dict(tp=2, styles=megatron_styles("gpt")),
    "dp2-zero0-full-recompute": dict(dp=2, zero_stage=0, recompute={f"layers.{i}": "full" for i in range(4)}),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("config", list(COMPOSITIONS.values()), ids=list(COMPOSITIONS))
def test_fp8_composes_with_data_tensor_and_pipeline_parallelism(config):
    """Two gloo ranks: an fp8 plan trains bit for bit as the same plan without fp8 on the
    torchao-converted model (same ranks, same sharding), differs from the bf16 plan, and
    matches one fp8 process over the same micro-batches within bf16's precision: the one
    process casts its weights once under FSDP2's mixed precision (``replicate`` on its
    one-rank group), as the two ranks do."""
    plan = fp8_plan(**config)
    results = run(train, 2, "gpt", plan, STEPS)
    refs = run(_reference_run, 2, "gpt", plan, STEPS)
    bf16 = run(train, 2, "gpt", without_fp8(plan), STEPS)
    for res, ref, plain in zip(results, refs, bf16):
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), **EXACT)
        for n, value in res.params.items():
            torch.testing.assert_close(value, ref.params[n], **EXACT, msg=lambda m, n=n: f"parameter {n}: {m}")
        assert res.losses != plain.losses  # FP8 really ran
    micro_batches = plan.config.global_batch_size // plan.config.micro_batch_size
    one = fp8_plan(micro_batch_size=plan.config.micro_batch_size, num_microbatches=micro_batches)
    (single,) = run(train, 1, "gpt", one, STEPS)
    for res in results:
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(single.losses), rtol=BF16_RTOL, atol=0)


def _meta_gpt() -> nn.Module:
    return build("gpt", "meta")


def _meta_reference_run(rank, world, plan, steps):
    """The plan without fp8 on a meta model torchao converted, initialised by the runtime."""
    return train(rank, world, "gpt", without_fp8(plan), steps, model_fn=lambda: torchao_converted("gpt", "meta"))


@pytest.mark.multiprocess
def test_a_meta_model_converts_before_fsdp2_shards_it():
    """ZeRO-3 over two ranks on a meta model: converted on the meta device, sharded, then
    each rank fills its shards; bit for bit the torchao-converted meta model's run."""
    plan = fp8_plan(dp=2, zero_stage=3)
    results = run(train, 2, "gpt", plan, STEPS, None, _meta_gpt)
    refs = run(_meta_reference_run, 2, plan, STEPS)
    for res, ref in zip(results, refs):
        torch.testing.assert_close(torch.tensor(res.losses), torch.tensor(ref.losses), **EXACT)
        for n, value in res.params.items():
            torch.testing.assert_close(value, ref.params[n], **EXACT, msg=lambda m, n=n: f"parameter {n}: {m}")


def _save_after_one_step(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    opt = job.optimizer(torch.optim.SGD, lr=LR)
    for batch in job.shard(batches("gpt", 1, plan.config.global_batch_size)):
        job.step(batch)
        opt.step()
        opt.zero_grad()
    job.save_checkpoint(path, step=1)
    return all_params(job)


def _load(rank, world, plan, path):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss, measure_memory=False)
    job.optimizer(torch.optim.SGD, lr=LR)
    return job.load_checkpoint(path), all_params(job)


@pytest.mark.multiprocess
def test_a_fp8_checkpoint_loads_under_a_bf16_plan(tmp_path):
    """Float8Linear keeps the linears' parameter names: a checkpoint saved by an fp8
    ZeRO-3 plan on two ranks loads into one bf16 process with the same weights."""
    saved = run(_save_after_one_step, 2, fp8_plan(dp=2, zero_stage=3), str(tmp_path))
    ((step, loaded),) = run(_load, 1, without_fp8(fp8_plan()), str(tmp_path))
    assert step == 1
    assert loaded.keys() == saved[0].keys()
    for n, value in loaded.items():
        torch.testing.assert_close(value, saved[0][n], **EXACT, msg=lambda m, n=n: f"parameter {n}: {m}")


def test_a_dry_run_does_not_warn_of_emulation(recwarn):
    """A dry run converts the blocks as a run would but times nothing: the warning that
    emulated FP8 is not faster belongs to real steps only (a dry run printed it once per
    rank; applied here in this process, where the warning would be recorded)."""
    from autopar.runtime.dry_run import dry_run

    report = dry_run(lambda: build("gpt", "meta"), fp8_plan(dp=2, zero_stage=3), ranks=[0, 1])
    assert report.ok, report.problems
    assert not [w for w in recwarn if "no FP8 tensor cores" in str(w.message)]
