"""What :func:`~autopar.search.planner.plan` and ``estimate`` take, and refuse in one line
before any model is traced: the cluster (a Cluster or a spec string), the named options,
the batch, the number of runners-up, the routing imbalance and the memory headroom."""

from __future__ import annotations

import math
import numbers
import reprlib
from dataclasses import replace
from enum import StrEnum
from typing import TypeVar

from autopar.errors import ClusterError, ConfigError, check_positive_int
from autopar.hardware.cluster import Cluster
from autopar.hardware.presets import parse_cluster
from autopar.profiles.report import ProfileReport

E = TypeVar("E", bound=StrEnum)


def as_cluster(cluster: object) -> Cluster:
    """``cluster`` itself, or the cluster a spec string names, read as the command line
    reads ``--cluster``: the same words work in both places."""
    if isinstance(cluster, str):
        return parse_cluster(cluster)
    if not isinstance(cluster, Cluster):
        profile = " (a profile report goes in profile=, or autopar.cluster_from_profiles makes a cluster of it)"
        raise ClusterError(
            f"cluster={reprlib.repr(cluster)} is not allowed: give an autopar.Cluster "
            f"(autopar.preset, autopar.load_cluster) or a spec such as 'dgx-a100-80gb:4'"
            f"{profile if isinstance(cluster, ProfileReport) else ''}."
        )
    return cluster


def option(name: str, value: object, kind: type[E]) -> E:
    """``value`` as the member of ``kind`` it names, or a ConfigError listing the allowed
    values (checked before the model is traced, which takes seconds for a large one)."""
    try:
        return kind(value)
    except (ValueError, TypeError):
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ConfigError(f"{name}={value!r} is not allowed; use one of {allowed}.") from None


MAX_GLOBAL_BATCH = 2**20
"""The most samples per optimizer step a plan takes: 1,048,576, some 16 times the largest
published batches (64K images; 16M tokens are 2K sequences of 8K). Beyond it a batch is a
typo (an exponent, tokens given as samples), and its micro-batch schedules would take
minutes and gigabytes to build (10 million samples over an interleaved pipeline: 67 s,
8.4 GB)."""


def check_batch(global_batch_size: object) -> int:
    """``global_batch_size`` as an int from 1 to :data:`MAX_GLOBAL_BATCH`."""
    batch = check_positive_int("global_batch_size", global_batch_size)
    if batch > MAX_GLOBAL_BATCH:
        raise ConfigError(
            f"global_batch_size={batch:,} is not allowed: it counts samples (sequences) per optimizer step, at most "
            f"{MAX_GLOBAL_BATCH:,} here; give the batch in samples, not tokens."
        )
    return batch


def check_top(top: object) -> None:
    """``top`` counts runners-up: an integer >= 0, else a ConfigError."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ConfigError(f"top={top!r} is not allowed: it must be an integer >= 0 (how many runners-up to keep).")


def check_imbalance(value: object) -> None:
    """``routing_imbalance`` is a real number >= 1 (the busiest rank over the mean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1.0 <= value < math.inf:
        raise ConfigError(
            f"routing_imbalance={value!r} is not allowed: give the busiest expert-parallel rank's routed rows over "
            f"the mean, a number >= 1 (1.0: a balanced router)."
        )


def check_headroom(headroom_gib: object) -> float:
    """``memory_headroom_gib`` as a float of GiB, refused in one line where it is not a
    finite real number >= 0 (numpy's too: the plan file keeps the float)."""
    number = isinstance(headroom_gib, numbers.Real) and not isinstance(headroom_gib, bool)
    if not number or not math.isfinite(headroom_gib) or headroom_gib < 0:
        raise ConfigError(f"memory_headroom_gib={headroom_gib!r} is not allowed: give GiB per device, a number >= 0.")
    return float(headroom_gib)


def with_headroom(cluster: Cluster, headroom_gib: float) -> Cluster:
    """``cluster`` with ``headroom_gib`` GiB more of each device's memory reserved
    (:func:`check_headroom`), which no plan allocates: a margin the user keeps for what
    the prediction may miss (the allocator, a framework's own buffers, a longer sample).
    Refused in one line where it leaves the device nothing."""
    if headroom_gib == 0:
        return cluster
    memory = cluster.device.memory
    free_gib = (memory.capacity_bytes - memory.reserved_bytes) / 2**30
    if headroom_gib >= free_gib:
        raise ConfigError(
            f"memory_headroom_gib={headroom_gib:g} is not allowed: each {cluster.device.name} has {free_gib:.1f} GiB "
            f"beyond its {memory.reserved_bytes / 2**30:.1f} GiB reserve; keep less free."
        )
    reserved = memory.reserved_bytes + headroom_gib * 2**30
    return replace(cluster, device=replace(cluster.device, memory=replace(memory, reserved_bytes=reserved)))
