"""Figures no measurement gives (a hand edit, a unit slip, another tool's file) are
refused when a profile is read, in one line naming the file's field, rather than planned
with or drawn: a negative bandwidth drew "memory -0.0 GB/s", a share of 5 sped up the
plan, and an empty network crashed the report. A file of another kind (a plan, a cluster
file) is named for what it is, wherever it is given."""

import json

import pytest
from profile_factories import full

import autopar
from autopar.errors import ClusterError, PlanFormatError, ProfileFormatError
from autopar.hardware import load_cluster, save_cluster
from autopar.models import build_named_model
from autopar.profiles import cluster_from_profiles


def _edit(section: str, path: tuple, value):
    data = full().to_dict()
    node = data[section]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    "section, path, value, said",
    [
        ("device", ("memory_bandwidth_bytes_per_s",), 13.8, "device: memory_bandwidth_bytes_per_s=13.8 is not allowed"),
        ("device", ("memory_bandwidth_bytes_per_s",), -5.0, "device: memory_bandwidth_bytes_per_s=-5.0"),
        ("device", ("threads",), 0, "device: threads=0 is not allowed"),
        ("device", ("op_overhead_s",), -1.0, "device: the device's op_overhead_s=-1.0 is not allowed"),
        ("device", ("tp_overhead_s",), -2e-06, "device: the device's tp_overhead_s=-2e-06 is not allowed"),
        ("device", ("matmul", 0, "m"), -16, "device.matmul[0]: a matmul of m=-16"),
        ("network", ("world_size",), 0, "network: world_size=0 with 4 node labels"),
        ("network", ("series",), [], "network: series is empty"),
        ("network", ("memory_share",), 5.0, "network: memory_share=5.0 is not allowed"),
        ("network", ("fits", 0, "alpha_s"), -0.5, "network.fits[0]: the intra link fit's alpha_s=-0.5"),
        ("network", ("fits", 0, "bandwidth_bytes_per_s"), -1e9, "bandwidth_bytes_per_s=-1000000000.0 is not allowed"),
    ],
)
def test_an_impossible_figure_is_refused_naming_its_field(tmp_path, section, path, value, said):
    file = tmp_path / "edited.json"
    file.write_text(json.dumps(_edit(section, path, value)))
    with pytest.raises(ProfileFormatError) as err:
        cluster_from_profiles([file])
    message = str(err.value)
    assert message.startswith(f"profile {str(file)!r}: ") and said in message, message
    assert message.endswith("measure the profile again with autopar profile.") and "\n" not in message


def test_the_factory_profile_itself_is_read():
    """The edits above are what is refused: the profile they start from is read."""
    assert cluster_from_profiles([full().to_dict()]).world_size >= 1


def test_a_file_of_another_kind_is_named_for_what_it_is(tmp_path):
    """A profile report given as a plan, a plan given as a cluster or a profile, a cluster
    file given as a profile or a plan: each is refused naming what the file is and what
    takes it, where the loaders said "schema_version 1 is not supported ... re-create the
    plan", "unknown field(s) alternatives" or "its 'schema' is None"."""
    profile = full().save(tmp_path / "profile.json")
    cluster = save_cluster(autopar.preset("dgx-h100", nodes=2), tmp_path / "cluster.json")
    plan = autopar.plan(build_named_model("gpt2-small"), "dgx-h100:1", global_batch_size=8, seq_len=128)
    plan_file = plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanFormatError, match=r"is a profile report, not a plan \('autopar profile' wrote it: pass"):
        autopar.Plan.load(profile)
    with pytest.raises(PlanFormatError, match=r"is a cluster file, not a plan \('autopar presets --save' writes one"):
        autopar.Plan.load(cluster)
    with pytest.raises(ClusterError, match=r"is a plan file, not a cluster \('autopar plan --out' wrote it: give it"):
        load_cluster(plan_file)
    for other, kind in ((plan_file, "a plan file"), (cluster, "a cluster file")):
        with pytest.raises(ProfileFormatError, match=f"is {kind}, not a profile report"):
            cluster_from_profiles([other])
    assert autopar.Plan.load(plan_file).config == plan.config and load_cluster(cluster).nodes == 2
