"""What machine and software a measurement ran on (a report's provenance).

Numbers measured on one cluster are worthless on another unless the file says where
they came from, so every section records the host, CPU, accelerator, memory and the
versions of the software stack that decides the speed (torch, CUDA, cuDNN, NCCL).
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
from importlib import metadata

import torch

from autopar.profiles.sections import Provenance


def provenance(command: str) -> Provenance:
    """The provenance of a measurement made now, here, by ``command``."""
    return Provenance(
        host=socket.gethostname(),
        platform=platform.platform(),
        cpu=cpu_model(),
        cpu_count=os.cpu_count() or 1,
        memory_bytes=float(physical_memory_bytes()),
        accelerator=accelerator(),
        software=software_versions(),
        created_utc=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command,
    )


def cpu_model() -> str:
    """The processor's model name (from /proc/cpuinfo on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def physical_memory_bytes() -> int:
    """Physical memory of the machine."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def accelerator() -> str:
    """``"none"`` or e.g. ``"8 x NVIDIA H100 80GB HBM3"``."""
    if not torch.cuda.is_available():
        return "none"
    count = torch.cuda.device_count()
    return f"{count} x {torch.cuda.get_device_name(0)}"


def software_versions() -> dict[str, str]:
    """Versions of what decides the speed of a measurement."""
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for pkg in ("numpy", "autopar"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    if torch.version.cuda:
        versions["cuda"] = torch.version.cuda
        versions["cudnn"] = str(torch.backends.cudnn.version())
        if torch.cuda.is_available():
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return versions
