"""What a plan takes from profile reports: the measured cluster, the per-unit
corrections, and one line per report saying where they came from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.hardware.cluster import Cluster
from autopar.profiles.calibration import layer_calibration, profile_sources, recompute_calibration
from autopar.profiles.sections import ModelProfile
from autopar.profiles.to_cluster import cluster_from_profiles, latest, read_reports


@dataclass(frozen=True, kw_only=True)
class Measurements:
    """The inputs a profile changes.

    Attributes:
        cluster: the cluster with the measured device and links.
        sources: one line per report (what, where, when).
        calibration: unit key -> measured over predicted compute time.
        recompute_fractions: unit key -> full recomputation's cost over the forward.
        layers: the layers section the factors come from, with its report's origin
            (None where the profile has none), to check it against the planned model
            (:func:`autopar.profiles.identity.match_layer_profile`).
    """

    cluster: Cluster
    sources: tuple[str, ...] = ()
    calibration: Mapping[str, float] = field(default_factory=dict)
    recompute_fractions: Mapping[str, float] = field(default_factory=dict)
    layers: tuple[str, ModelProfile] | None = None


def measurements(cluster: Cluster, profile: Any) -> Measurements:
    """``cluster`` as ``profile`` (None, one report or several) measured it: device curves
    and links replace the datasheet's, and the units the profile measured get their
    compute factors and recompute fractions."""
    if profile is None:
        return Measurements(cluster=cluster)
    found = latest(read_reports(profile), "layers")
    return Measurements(
        cluster=cluster_from_profiles(profile, base=cluster),
        sources=profile_sources(profile, cluster.devices_per_node),
        calibration=layer_calibration(profile, base=cluster) if found is not None else {},
        recompute_fractions=recompute_calibration(profile),
        layers=found,
    )
