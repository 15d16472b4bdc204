"""Profile reports: what the profiler measured, as typed data, and what the planner
takes from them (a measured cluster, per-unit corrections)."""

from autopar.profiles.calibration import (
    UnitCalibration,
    calibrate_units,
    layer_calibration,
    profile_sources,
    recompute_calibration,
)
from autopar.profiles.identity import ProfileModelError, parameter_shapes
from autopar.profiles.report import SCHEMA, SCHEMA_VERSION, ProfileReport
from autopar.profiles.to_cluster import cluster_from_profiles

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "ProfileModelError",
    "ProfileReport",
    "UnitCalibration",
    "calibrate_units",
    "cluster_from_profiles",
    "layer_calibration",
    "parameter_shapes",
    "profile_sources",
    "recompute_calibration",
]
