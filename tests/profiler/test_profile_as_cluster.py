"""A profile report given where a cluster goes (``--cluster report.json``, or the report
itself as ``cluster=``) is refused in one line that says what it is and where it goes,
instead of listing the report's sections as unknown cluster fields."""

import pytest
from profile_factories import full

import autopar
from autopar import ClusterError, load_cluster
from autopar.cli import main


def test_a_profile_file_as_the_cluster_says_to_pass_it_as_a_profile(tmp_path, capsys):
    path = full().save(tmp_path / "profile.json")
    with pytest.raises(ClusterError) as err:
        load_cluster(path)
    assert str(err.value) == (
        f"cluster file {str(path)!r} is a profile report ('autopar profile' wrote it), not a cluster: pass it as "
        f"--profile {str(path)!r} beside a cluster such as --cluster local-cpu:1 (profile= in autopar.plan), or "
        f"make a cluster of it with autopar.cluster_from_profiles."
    )
    argv = ["plan", "--model", "gpt2-small", "--cluster", str(path), "--global-batch-size", "8", "--seq-len", "64"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"autopar: error: {err.value}"]
    cluster = autopar.cluster_from_profiles(full())  # the way the message names works
    assert cluster.device.memory.capacity_bytes > 0


def test_a_profile_report_as_cluster_names_where_it_goes():
    model = autopar.models.build_named_model("gpt2-small")
    with pytest.raises(ClusterError, match=r"a profile report goes in profile=, or autopar.cluster_from_profiles"):
        autopar.plan(model, full(), global_batch_size=8, seq_len=64)
