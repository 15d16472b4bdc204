"""fewest_nodes: a bad input is raised at once as the ConfigError it is; only a node
count that runs out of memory or has no configuration of its devices moves on."""

import pytest

import autopar
from autopar import ConfigError
from autopar.errors import DeviceCountError
from autopar.graph import extract
from autopar.models import GPT, GPTConfig
from autopar.present.whatif import fewest_nodes

A100 = autopar.preset("dgx-a100-80gb")


@pytest.fixture(scope="module")
def graph():
    """A small GPT of 16 heads and 8 blocks."""
    return extract(GPT(GPTConfig(vocab_size=1024, seq_len=128, dim=256, n_layers=8, n_heads=16)), seq_len=128)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"constraints": {"tpp": 4}}, r"^unknown constraint\(s\) \['tpp'\]; allowed: dp, tp, pp"),
        ({"optimizer": "lion"}, r"^optimizer='lion' is not allowed; use one of 'adam'"),
        ({"constraints": {"tp": 3}}, r"^tp=3 does not fit: attention\.wq splits by whole attention heads and has 16;"),
        ({"constraints": {"fp8": True}}, r"^fp8=True needs FP8 tensor cores, which A100-SXM4-80GB does not have"),
        ({"constraints": "tp=2"}, r"^constraints='tp=2' is not allowed: give a mapping"),
    ],
)
def test_an_input_error_is_raised_as_it_is(graph, kwargs, message):
    with pytest.raises(ConfigError, match=message) as err:
        fewest_nodes(graph, A100, global_batch_size=64, **kwargs)
    assert not isinstance(err.value, DeviceCountError) and "\n" not in str(err.value)


def test_a_degree_the_nodes_do_not_divide_moves_on(graph):
    plan = fewest_nodes(graph, A100, global_batch_size=64, constraints={"dp": 16, "tp": 1, "pp": 1})
    assert plan.cluster.nodes == 2 and plan.config.dp == 16


def test_a_caller_bound_that_stops_the_search_is_named(graph):
    """A GPT that overflows one node of 60 MiB devices and fits on more (as in
    ``test_planner``): with max_nodes=1 the refusal says to raise the bound (what stopped
    it), not that the model needs another device; without the bound a count fits."""
    from autopar.errors import InfeasiblePlanError

    from .exact_reference import tiny_cluster

    model = GPT(GPTConfig(vocab_size=1000, seq_len=512, dim=512, n_layers=4, n_heads=8))
    cluster = tiny_cluster(60 / 1024)
    with pytest.raises(InfeasiblePlanError, match=r"^no plan fits on up to 1 nodes of .*; raise max_nodes above 1"):
        fewest_nodes(model, cluster, global_batch_size=64, seq_len=512, max_nodes=1)
    assert fewest_nodes(model, cluster, global_batch_size=64, seq_len=512, max_nodes=8).cluster.nodes > 1


def test_no_configuration_of_a_small_cluster_moves_on(graph):
    """On 1 node (8 devices) dp is at most 8, so no rank gets 4 samples in one micro-batch:
    the search finds no candidate there, and 2 nodes run dp=16."""
    fixed = {"micro_batch_size": 4, "num_microbatches": 1}
    with pytest.raises(DeviceCountError, match="no configuration of 8 devices can run global_batch_size=64"):
        autopar.plan(graph, A100.with_nodes(1), global_batch_size=64, constraints=fixed)
    plan = fewest_nodes(graph, A100, global_batch_size=64, constraints=fixed)
    assert plan.cluster.nodes == 2 and plan.config.dp * plan.config.cp == 16


def test_a_fixed_degree_the_node_does_not_divide_is_tried_on_multiples_of_its_nodes():
    """12 heads split 3 ways on 8-GPU nodes: 3 divides no power of two of nodes, so the
    counts tried are 3, 6, ... nodes; the tiny model fits on the first."""
    model = GPT(GPTConfig(vocab_size=1024, seq_len=128, dim=192, n_layers=2, n_heads=12))
    plan = fewest_nodes(model, A100, global_batch_size=48, seq_len=128, max_nodes=8, constraints={"tp": 3})
    assert plan.cluster.nodes == 3 and plan.config.tp == 3 and plan.config.world_size == 24


@pytest.mark.parametrize(
    "fixed, devices, step",
    [({"tp": 3}, 8, 3), ({"tp": 4, "pp": 3}, 8, 3), ({"tp": 8, "cp": 2}, 8, 2), ({"tp": 6}, 4, 3), ({}, 8, 1)],
)
def test_node_step_is_the_fewest_nodes_the_fixed_degrees_divide(fixed, devices, step):
    from autopar.present.whatif import node_step

    assert node_step(fixed, devices) == step
    product = 1
    for name in ("dp", "cp", "tp", "pp"):
        product *= fixed.get(name, 1)
    assert min(n for n in range(1, 100) if n * devices % product == 0) == step


def test_a_step_beyond_max_nodes_is_refused_with_the_step():
    model = GPT(GPTConfig(vocab_size=1024, seq_len=128, dim=192, n_layers=2, n_heads=12))
    with pytest.raises(DeviceCountError) as err:
        fewest_nodes(model, A100, global_batch_size=48, seq_len=128, max_nodes=2, constraints={"tp": 3})
    assert str(err.value) == (
        "the fixed degrees need a multiple of 3 nodes of 8 devices, more than max_nodes=2; raise max_nodes to 3 "
        "or more, or fix other degrees."
    )


def test_a_count_no_doubling_reaches_is_refused_with_the_reason_at_the_first_count():
    """All four degrees fixed to 3 devices: whole nodes of 8 never hold exactly 3."""
    model = GPT(GPTConfig(vocab_size=1024, seq_len=128, dim=192, n_layers=2, n_heads=12))
    with pytest.raises(DeviceCountError) as err:
        fewest_nodes(
            model,
            A100,
            global_batch_size=48,
            seq_len=128,
            max_nodes=8,
            constraints={"tp": 3, "dp": 1, "pp": 1, "cp": 1},
        )
    message = str(err.value)
    assert message.startswith("no configuration runs on 3 to 8 nodes of dgx-a100-80gb (node counts doubled from 3);")
    assert "on 3 nodes: " in message and "\n" not in message


def test_a_cluster_spec_string_is_read_as_plan_reads_it(graph):
    """A spec names the node type, as ``autopar.plan`` takes it (its node count is not
    used); anything else is refused in one line."""
    by_spec = fewest_nodes(graph, "dgx-a100-80gb:4", global_batch_size=64)
    by_preset = fewest_nodes(graph, A100, global_batch_size=64)
    assert (by_spec.cluster.nodes, by_spec.config) == (by_preset.cluster.nodes, by_preset.config)
    with pytest.raises(autopar.ClusterError, match=r"^cluster=42 is not allowed: give an autopar.Cluster") as err:
        fewest_nodes(graph, 42, global_batch_size=64)
    assert "\n" not in str(err.value)
