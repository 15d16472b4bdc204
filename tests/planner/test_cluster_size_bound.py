"""A cluster of more than 2**20 devices is refused in one line wherever it is made (a
preset's node count on the command line or in Python, a cluster file, another node
count of a cluster): 10**18 nodes ran for minutes in the search's trial division
before. The bound itself, and every count fewest_nodes tries by default, still plan."""

import inspect
import json
import subprocess
import sys

import pytest

from autopar import ClusterError, load_cluster, parse_cluster, preset
from autopar.graph import extract
from autopar.hardware import cluster_to_dict, preset_names
from autopar.hardware.cluster import MAX_DEVICES
from autopar.models import GPT, GPTConfig
from autopar.present.whatif import fewest_nodes

HUGE = 10**18


def _refusal(name: str, nodes: int, per_node: int = 8) -> str:
    return (
        f"cluster {name!r} has {nodes * per_node:,} devices ({nodes:,} node(s) x {per_node:,}); autopar plans up to "
        "1,048,576: give fewer nodes or devices per node."
    )


def test_the_bound_is_a_million_devices():
    assert MAX_DEVICES == 2**20 == 1_048_576


def test_the_reported_command_stops_at_once_with_one_line():
    """The command of the report, in a process of its own: before the bound it ran for
    minutes, so a regression fails on the timeout rather than hanging the suite."""
    argv = f"plan --model gpt2-small --cluster dgx-h100:{HUGE} --global-batch-size 16 --seq-len 1024".split()
    script = f"import sys; from autopar.cli import main; sys.exit(main({argv!r}))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [f"autopar: error: {_refusal(f'dgx-h100 x {HUGE}', HUGE)}"]


def test_every_way_of_making_a_cluster_is_bounded(tmp_path):
    with pytest.raises(ClusterError) as err:
        preset("dgx-h100", nodes=HUGE)
    assert str(err.value) == _refusal(f"dgx-h100 x {HUGE}", HUGE)
    with pytest.raises(ClusterError) as err:
        parse_cluster("hgx-h200:131073")
    assert str(err.value) == _refusal("hgx-h200 x 131073", 131073)
    with pytest.raises(ClusterError) as err:
        preset("dgx-a100-80gb").with_nodes(2**17 + 1)
    assert str(err.value) == _refusal("dgx-a100-80gb x 131073", 131073)
    with pytest.raises(ClusterError) as err:
        preset("p3.16xlarge", devices_per_node=2**21)
    assert str(err.value) == _refusal("p3.16xlarge x 1", 1, 2**21)
    data = cluster_to_dict(preset("dgx-h100", nodes=2))
    data["nodes"] = HUGE
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    assert str(err.value) == f"cluster file {str(path)!r}: {_refusal('dgx-h100 x 2', HUGE)}"


def test_a_local_cpu_cluster_too_big_for_memory_is_still_refused_for_memory():
    """local-cpu builds its device before its cluster: its own, more useful, limit comes first."""
    with pytest.raises(ClusterError, match=r"^local-cpu with \d+ processes leaves .* use fewer than \d+ processes\.$"):
        preset("local-cpu", nodes=HUGE)


@pytest.mark.parametrize("name", sorted(set(preset_names()) - {"local-cpu"}))
def test_the_bound_itself_and_fewest_nodes_default_limit_load(name):
    per_node = preset(name).devices_per_node
    assert preset(name, nodes=MAX_DEVICES // per_node).world_size == MAX_DEVICES
    default = inspect.signature(fewest_nodes).parameters["max_nodes"].default
    assert preset(name).with_nodes(default).world_size == default * per_node <= MAX_DEVICES
    assert preset(name, devices_per_node=MAX_DEVICES).world_size == MAX_DEVICES


def test_fewest_nodes_still_moves_on_to_a_count_that_runs():
    graph = extract(GPT(GPTConfig(vocab_size=1024, seq_len=128, dim=256, n_layers=8, n_heads=16)), seq_len=128)
    plan = fewest_nodes(graph, preset("dgx-a100-80gb"), global_batch_size=64, constraints={"dp": 16, "tp": 1, "pp": 1})
    assert plan.cluster.nodes == 2 and plan.config.dp == 16
