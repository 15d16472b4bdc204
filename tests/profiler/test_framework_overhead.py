"""What sharded layers cost beyond their arithmetic and their transfers, on 2 gloo ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from autopar.runtime.spmd import SPMDSettings, run_spmd
from profiler.contention import contended_share
from profiler.framework_overhead import (
    fsdp_copy_bytes_per_s,
    fsdp_overhead_s,
    fsdp_tensor_overhead_s,
    tp_overhead_s,
    tp_width,
)
from profiler.timing import Repeats

pytestmark = pytest.mark.multiprocess
SETTINGS = SPMDSettings(timeout_s=120, pg_timeout_s=60)
REPEATS = Repeats(warmup=2, repeats=5)


def _measure(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    cpu = torch.device("cpu")
    free = lambda nbytes: 0.0  # noqa: E731
    dear = lambda nbytes: 1.0  # noqa: E731  a second per collective: more than the whole run
    fsdp = fsdp_overhead_s(mesh, cpu, REPEATS, free, free)
    return {
        "tp": tp_overhead_s(mesh, cpu, REPEATS, free),
        "tp_dear": tp_overhead_s(mesh, cpu, REPEATS, dear),
        "fsdp": fsdp,
        "fsdp_dear": fsdp_overhead_s(mesh, cpu, REPEATS, dear, dear),
        "tensor": fsdp_tensor_overhead_s(mesh, cpu, REPEATS, free, free, fsdp),
        "tensor_dear": fsdp_tensor_overhead_s(mesh, cpu, REPEATS, dear, dear, 0.0),
        "copies": fsdp_copy_bytes_per_s(mesh, cpu, REPEATS, free, free, fsdp),
        "copies_dear": fsdp_copy_bytes_per_s(mesh, cpu, REPEATS, dear, dear, 0.0),
        "share": contended_share(dist.group.WORLD, (0, 1), REPEATS),
    }


def test_sharded_layers_cost_more_than_plain_ones_and_the_rest_is_clamped():
    """With the collectives priced at nothing, what is left is the whole extra time of
    the sharded model: the transfers and the framework around them, strictly positive
    and far below a second per call. Priced at a second each (more than was measured),
    nothing is left, and the figure is 0, not negative. Every rank reports the slowest
    rank's figure. Two ranks streaming together keep at most all of one's bandwidth.
    FSDP units of 2.25 MiB cost more per call than units of 16 KiB (their transfers,
    priced at nothing here, and their copies), which gives a finite copy rate; priced
    dear, nothing grows and the rate is 0 (the cost model's cue for the streaming
    bandwidth). Each parameter tensor of a unit adds a finite, non-negative time per
    call, well under a unit of one linear's whole call; priced dear, 0."""
    results = run_spmd(_measure, 2, settings=SETTINGS)
    for key in ("tp", "tp_dear", "fsdp", "fsdp_dear", "tensor", "tensor_dear", "copies", "copies_dear", "share"):
        assert results[0][key] == results[1][key], key
    got = results[0]
    assert 0 < got["tp"] < 0.05 and 0 < got["fsdp"] < 0.05
    assert got["tp_dear"] == 0.0 and got["fsdp_dear"] == 0.0 and got["tensor_dear"] == 0.0
    assert 0 <= got["tensor"] < got["fsdp"]
    assert 1e8 < got["copies"] < 1e12 and got["copies_dear"] == 0.0
    assert 0 < got["share"] <= 1


def _tp_on_three(rank, world):
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    return tp_overhead_s(mesh, torch.device("cpu"), Repeats(warmup=1, repeats=3), lambda nbytes: 0.0)


def test_the_tensor_parallel_probe_runs_on_a_group_that_does_not_divide_its_width():
    """Three ranks: the probe's 64 columns do not split evenly over them, and its row-
    parallel layer then failed on every rank (``profile network --nproc 3`` lost its whole
    sweep); the probe widens to 66, a multiple of 3, and measures a finite, positive
    time, the same on every rank."""
    assert tp_width(3) == 66 and tp_width(2) == 64 and tp_width(8) == 64
    results = run_spmd(_tp_on_three, 3, settings=SETTINGS)
    assert results[0] == results[1] == results[2] and 0 < results[0] < 0.05
