"""What each rank holds and what it sends: local parameter shapes against the plan,
collectives of one step against the Megatron-LM / Korthikanti et al. counts the plan
implies, and typed errors raised on every rank before any collective."""

import time

import pytest
import torch
from parity import GPT_CFG, PG_TIMEOUT_S, build, make_plan, megatron_styles, run, step_collectives, token_loss
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.models import CNNConfig, ResNet
from autopar.runtime.api import parallelize
from autopar.runtime.recompute import clean_fqn

pytestmark = pytest.mark.multiprocess


def _local_shapes(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    return {
        clean_fqn(n): tuple((p.to_local() if isinstance(p, DTensor) else p).shape)
        for s in job.stages
        for n, p in s.named_parameters()
    }


def test_local_shapes_follow_the_plan():
    """dp=2 (ZeRO-3) x tp=2 x pp=2: column weights hold out/tp rows, row weights in/tp
    columns, the embedding vocab/tp rows, FSDP2 then splits dim 0 over dp; each
    pipeline rank holds only its stage's units."""
    plan = make_plan("gpt", dp=2, tp=2, pp=2, zero_stage=3, styles=megatron_styles("gpt"))
    shapes = run(_local_shapes, 8, plan, timeout_s=120)
    d, v, f = GPT_CFG.dim, GPT_CFG.vocab_size, GPT_CFG.ffn_dim
    first = shapes[0]
    assert first["layers.0.attention.wq.weight"] == (d // 2 // 2, d)  # column: out/tp, then /dp
    assert first["layers.0.attention.wo.weight"] == (d // 2, d // 2)  # row: in/tp, then out/dp
    assert first["layers.0.feed_forward.w1.weight"] == (f // 2 // 2, d)
    assert first["tok_embeddings.weight"] == (v // 2 // 2, d)  # vocab: rows/tp, then /dp
    assert first["layers.0.attention_norm.weight"] == (d // 2,)  # replicated over tp, /dp
    assert set(first) == {n for n in first if n.startswith(plan.stages[0])}
    last = shapes[7]
    assert last["output.weight"] == (v // 2 // 2, d)  # column head
    assert not any(n.startswith(plan.stages[0]) for n in last)


FUNCTIONAL_COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


def _functional_collective(func, args):
    """A functional collective, including those DTensor issues inside its own ops."""
    return func._opname if func.namespace == "_c10d_functional" and func._opname in FUNCTIONAL_COLLECTIVES else None


def _count_step(rank, world, plan):
    job = parallelize(build("gpt"), plan, loss_fn=token_loss)
    return step_collectives(job, plan, _functional_collective)


@pytest.mark.parametrize("sp", [False, True])
def test_collectives_of_one_step_match_the_plan(sp):
    """Per layer and micro-batch, Megatron-LM TP needs two all-reduces forward and two
    backward (Shoeybi et al. 2019); with sequence parallelism each becomes an
    all-gather plus a reduce-scatter (Korthikanti et al. 2022). Around the blocks: the
    vocabulary-parallel embedding reduces its output once; the column-parallel head
    reduces its input gradient (or, with SP, gathers its input and reduce-scatters the
    gradient; the first block scatters its input, whose gradient is gathered); the
    vocabulary-parallel loss all-reduces the max, the sum of exponentials and the target
    logit (the three the planner prices in loss_parallel_s)."""
    m, layers = 2, GPT_CFG.n_layers
    plan = make_plan(
        "gpt", tp=2, num_microbatches=m, sequence_parallel=sp, styles=megatron_styles("gpt", sequence_parallel=sp)
    )
    counts = run(_count_step, 2, plan)
    if sp:
        expected = {
            "all_gather_into_tensor": m * (4 * layers + 2),
            "reduce_scatter_tensor": m * (4 * layers + 1),
            "all_reduce": m * (1 + 3),
        }
    else:
        expected = {"all_reduce": m * (4 * layers + 1 + 1 + 3)}
    assert counts == [expected, expected]


def _error_of(call):
    """The (type name, message) a rank's call raised: every rank reports its own."""
    try:
        call()
    except AutoparError as exc:
        return type(exc).__name__, str(exc)
    return None


def _wrong_world(rank, world, plan):
    return _error_of(lambda: parallelize(build("gpt"), plan, loss_fn=token_loss))


def test_world_size_mismatch_fails_on_every_rank_fast():
    plan = make_plan("gpt", dp=2, tp=2)
    start = time.monotonic()
    errors = run(_wrong_world, 2, plan)
    assert time.monotonic() - start < PG_TIMEOUT_S  # no collective waited for its timeout
    for kind, message in errors:
        assert kind == "PlanMismatchError" and "needs pp x dp x tp = 1 x 2 x 2 = 4 ranks" in message


def _resnet(rank, world, plan):
    model = ResNet(CNNConfig(image_size=8, width=4, stages=2, blocks_per_stage=1, num_classes=4))
    return _error_of(
        lambda: parallelize(
            model, plan, loss_fn=torch.nn.functional.cross_entropy, sample_input=torch.zeros(1, 3, 8, 8)
        )
    )


def test_style_a_layer_cannot_take_names_the_layer_on_every_rank():
    """A column split on a Conv2d is refused with a ShardingError naming the layer,
    raised identically on both ranks before any collective."""
    import dataclasses

    import autopar

    model = ResNet(CNNConfig(image_size=8, width=4, stages=2, blocks_per_stage=1, num_classes=4))
    plan = autopar.estimate(
        model,
        autopar.preset("local-cpu", devices_per_node=2),
        {"dp": 2, "tp": 1, "pp": 1, "micro_batch_size": 1, "num_microbatches": 1, "dtype": "fp32"},
        global_batch_size=2,
        sample_input=torch.zeros(1, 3, 8, 8),
    )
    # by hand: the planner itself never puts tp > 1 on a model whose layers cannot split
    plan = dataclasses.replace(
        plan,
        config=dataclasses.replace(plan.config, dp=1, tp=2, micro_batch_size=2),
        layer_strategies=dataclasses.replace(plan.layer_strategies, tp={"layers.0.conv1": autopar.TPStyle.COLUMN}),
    )
    for kind, message in run(_resnet, 2, plan):
        assert kind == "ShardingError" and message.startswith(
            "the plan gives layer 'layers.0.conv1' (Conv2d) the tensor-parallel style 'column'"
        )
