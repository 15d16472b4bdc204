"""Figures no measurement gives (a hand edit, a unit slip, another tool's file) are
refused when a profile is read, in one line naming the file's field, rather than planned
with or drawn: a negative bandwidth drew "memory -0.0 GB/s", a share of 5 sped up the
plan, and an empty network crashed the report."""

import json

import pytest
from profile_factories import full

from autopar.errors import ProfileFormatError
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
