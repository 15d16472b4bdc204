"""Hardware as numbers: devices, links, clusters and their presets.

cluster = autopar.preset("dgx-a100-80gb", nodes=128)
cluster = autopar.parse_cluster("dgx-h100:16")      # or a cluster file's path
"""

from autopar.hardware.cluster import Cluster, cluster_from_dict, cluster_to_dict, load_cluster, save_cluster
from autopar.hardware.device import DeviceMemory, DeviceSpec, HostEffects, Roofline
from autopar.hardware.links import COLLECTIVE_OPS, CommCurve, LinkSpec, OpLink
from autopar.hardware.presets import parse_cluster, preset, preset_names

__all__ = [
    "COLLECTIVE_OPS",
    "Cluster",
    "CommCurve",
    "DeviceMemory",
    "DeviceSpec",
    "HostEffects",
    "LinkSpec",
    "OpLink",
    "Roofline",
    "cluster_from_dict",
    "cluster_to_dict",
    "load_cluster",
    "parse_cluster",
    "preset",
    "preset_names",
    "save_cluster",
]
