"""A device or network profile measured on another kind of device (CPU processes with
gloo against CUDA GPUs) than the cluster's is refused in one line, not silently put in
place of the cluster's devices and links; a matching one is applied as before."""

import pytest
from profile_factories import device, layers, network

from autopar.cli import main
from autopar.errors import ClusterError
from autopar.hardware import preset
from autopar.profiles import cluster_from_profiles


def _refusal(reports, base) -> str:
    with pytest.raises(ClusterError) as err:
        cluster_from_profiles(reports, base=base)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_cpu_network_profile_is_refused_on_a_gpu_cluster():
    message = _refusal([network()], preset("dgx-h100", nodes=2))
    assert message.startswith("the network profile in report #1 measured gloo between 4 cpu ranks but the cluster ")
    assert "dgx-h100 x 2 has H100-SXM5-80GB (cuda) devices, whose links it would silently replace" in message
    assert message.endswith("drop --profile, or plan for the machine it measured with --cluster local-cpu:2.")


def test_a_cpu_device_profile_is_refused_on_a_gpu_cluster_even_with_a_matching_network():
    message = _refusal([device(), network(kind="cuda")], preset("dgx-a100-80gb", nodes=2))
    assert message.startswith("the device profile in report #1 measured Test device (cpu) but the cluster dgx-a100")
    assert "A100-SXM4-80GB (cuda) devices, whose rates and memory it would silently replace" in message
    assert "profile the device on the cluster's devices, drop --profile" in message


def test_a_gpu_profile_is_refused_on_a_cpu_cluster():
    message = _refusal([device(kind="cuda")], preset("local-cpu", devices_per_node=2))
    assert "measured Test device (cuda) but the cluster local-cpu x 1 has cpu-process (cpu) devices" in message
    assert message.endswith("or pass a --cluster of the GPUs it measured (a preset or cluster file).")


def test_matching_profiles_and_a_layer_profile_of_another_kind_still_apply():
    cpu = preset("local-cpu", devices_per_node=2)
    measured = cluster_from_profiles([device(), network(node_of_rank=("a", "a"), inter=None)], base=cpu)
    assert measured.device.name == "Test device" and "fitted alpha-beta" in measured.intra_node.source
    gpu = preset("dgx-h100", nodes=2)
    assert cluster_from_profiles([layers()], base=gpu) == gpu  # applied to the plan with a note instead


def test_the_cli_refuses_on_one_line(tmp_path, capsys):
    path = network().save(tmp_path / "net.json")
    args = ["plan", "--model", "gpt2-small", "--cluster", "dgx-h100:2", "--global-batch-size", "32"]
    assert main([*args, "--seq-len", "128", "--profile", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert captured.err.startswith(f"autopar: error: the network profile in {path} measured gloo between 4 cpu ranks")
