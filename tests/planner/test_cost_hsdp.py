"""HSDP's cost terms against hand calculation from the alpha-beta formulas and the
preset's link numbers: two-level gradient reduction, state sharded over the shard group."""

import pytest

from autopar.cost.data_parallel import hsdp_reduce_s, replicate_span, shard_span, unhidden_floor_s
from autopar.cost.memory import config_state_bytes
from autopar.cost.model import CostModel
from autopar.errors import ConfigError
from autopar.graph import extract
from autopar.hardware import preset
from autopar.models import build_named_model
from autopar.plan import ParallelConfig
from autopar.vocab import Optimizer

DGX = preset("dgx-a100-80gb", nodes=4)  # 8 devices per node, alpha-beta links (no measured curves)
BI, BE = DGX.intra_node.bandwidth_bytes_per_s, DGX.inter_node.bandwidth_bytes_per_s
AI, AE = DGX.intra_node.latency_s, DGX.inter_node.latency_s


def _config(dp_shard, *, tp=1, zero=3, pp=1):
    return ParallelConfig(
        dp=32 // (tp * pp), tp=tp, pp=pp, micro_batch_size=1, num_microbatches=4, zero_stage=zero, dp_shard=dp_shard
    )


def test_shard_groups_stay_in_a_node_and_replicate_groups_cross_nodes():
    hsdp = _config(8)
    assert (shard_span(hsdp, 8).per_node, shard_span(hsdp, 8).nodes) == (8, 1)
    assert (replicate_span(hsdp, 8).per_node, replicate_span(hsdp, 8).nodes) == (1, 4)
    tp2 = _config(4, tp=2)  # dp=16: shard groups of 4 ranks, 2 apart, fill a node
    assert (shard_span(tp2, 8).per_node, shard_span(tp2, 8).nodes) == (4, 1)
    assert (replicate_span(tp2, 8).size, replicate_span(tp2, 8).nodes) == (4, 4)
    plain = _config(None)
    assert shard_span(plain, 8).size == 32 and replicate_span(plain, 8).size == 1


def test_hsdp_reduction_is_a_reduce_scatter_in_the_node_then_an_all_reduce_of_the_slice_across_nodes():
    """dp=32 on 4 nodes, shard groups of 8: a ring reduce-scatter of S over the node's
    8 ranks, then a tree all-reduce of S/8 over the 4 replicas (one per node), both
    paying their latency once per call."""
    size, calls = 1e9, 3
    rs = 7 / 8 * size / BI + calls * 7 * AI
    ar = 2 * 3 / 4 * (size / 8) / BE + 2 * calls * 2 * AE
    assert hsdp_reduce_s(size, _config(8), DGX, calls=calls) == pytest.approx(rs + ar, rel=1e-12)


def test_plain_fsdp_reduction_is_the_hierarchical_reduce_scatter_over_all_of_dp():
    size = 1e9
    expected = 7 / 8 * size / BI + 7 * AI + 3 / 4 * (size / 8) / BE + 2 * AE
    assert hsdp_reduce_s(size, _config(None), DGX) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("zero, shard, expected", [(3, 8, (4 + 4 + 8) / 8), (2, 4, 4 / 4 + 2 + 4 / 4 + 8 / 4)])
def test_model_states_shard_over_the_shard_group(zero, shard, expected):
    """bf16 Adam per parameter: the master weight, gradient and moments divide by the
    shard group's size, not by dp=32; ZeRO-2 keeps its 2-byte compute copy whole."""
    st = config_state_bytes(_config(shard, zero=zero), Optimizer.ADAM, param_numel=1.0, factored_numel=0.0)
    assert st.params_bytes + st.grads_bytes + st.optimizer_bytes == pytest.approx(expected)


def test_pipelined_floor_pays_the_two_level_reduction_and_steps_the_shard_groups_slice():
    """Under pipelining the deferred reduction is not hidden: the floor is the optimizer
    step of ``params / dp_shard``, the finite check, and :func:`hsdp_reduce_s` of the fp32
    gradients."""
    from autopar.cost.data_parallel import finite_check_s, optimizer_step_s

    graph = extract(build_named_model("gpt3-6.7b"), seq_len=2048, attention="flash")
    model = CostModel(graph=graph, cluster=DGX, optimizer=Optimizer.ADAM, global_batch_size=32)
    config = _config(4, pp=2)  # dp=16: shard groups of 4 in a node, replicas of 4 (2 per node)
    params = 1e9
    expected = (
        optimizer_step_s(DGX.device, config.dtype, Optimizer.ADAM, params / 4)
        + finite_check_s(model, config, params / 4)
        + 3 / 4 * 4 * params / BI  # reduce-scatter of 4-byte gradients over the 4-rank shard group
        + 3 * AI
        + 2 * 1 / 2 * params / BI  # all-reduce of the 1/4 slice: 2 replicas in each node (ranks 4 apart) ...
        + 2 * AI
        + 2 * 1 / 2 * (params / 2) / BE  # ... then over the 2 nodes, each local rank on half of it
        + 2 * AE
    )
    assert (replicate_span(config, 8).per_node, replicate_span(config, 8).nodes) == (2, 2)
    got = unhidden_floor_s(model, config, params)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dp_shard": 3}, r"dp_shard=3 is not allowed with dp=8: .* use one of \[2, 4, 8\]"),
        ({"dp_shard": 1}, r"dp_shard=1 is not allowed with dp=8"),
        ({"dp_shard": 2, "zero_stage": 1}, r"dp_shard=2 needs zero_stage 2 or 3 \(got 1\)"),
        ({"dp_shard": "2"}, r"dp_shard='2' is not allowed: it must be a positive integer"),
    ],
)
def test_bad_shard_groups_are_refused_in_one_line(kwargs, message):
    base = {"zero_stage": 3, **kwargs}
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, **base)


def test_a_shard_group_of_all_of_dp_is_plain_fsdp():
    config = ParallelConfig(dp=8, tp=1, pp=1, micro_batch_size=1, num_microbatches=1, zero_stage=3, dp_shard=8)
    assert config.dp_shard is None and (config.shard_size, config.replicate_size) == (8, 1)
