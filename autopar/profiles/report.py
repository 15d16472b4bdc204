"""``ProfileReport``: what the profiler measured, as one versioned JSON file.

A report holds up to three sections (:mod:`autopar.profiles.sections`), each measured
on its own; a model profile and a network profile are two reports that
:meth:`ProfileReport.merge` joins. The file is the dataclasses through
:mod:`autopar.codec` with a ``schema`` tag and a version, read and written by this
one type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from autopar import codec
from autopar.errors import ProfileFormatError
from autopar.profiles.network_section import NetworkProfile
from autopar.profiles.sections import DeviceProfile, ModelProfile

SCHEMA = codec.PROFILE_SCHEMA
SCHEMA_VERSION = 1
SECTIONS = ("device", "layers", "network")
PROFILE_REMEDY = "make one with 'autopar profile model|device|network --out FILE'"


@dataclass(frozen=True, kw_only=True)
class ProfileReport:
    """Measurements: any of a device, a model's layers and a network section."""

    schema_version: int = SCHEMA_VERSION
    device: DeviceProfile | None = None
    layers: ModelProfile | None = None
    network: NetworkProfile | None = None

    @property
    def measured(self) -> tuple[str, ...]:
        """Names of the sections present."""
        return tuple(s for s in SECTIONS if getattr(self, s) is not None)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data, the inverse of :meth:`from_dict`."""
        return {"schema": SCHEMA, **codec.encode(self, error=ProfileFormatError)}

    @staticmethod
    def from_dict(data: Any, *, origin: str = "profile data") -> ProfileReport:
        """Build from :meth:`to_dict` output; errors name the file and the bad field."""
        if not isinstance(data, dict):
            raise ProfileFormatError(f"{origin}: a profile report is a JSON object, got {type(data).__name__}.")
        other = codec.misfiled(data, "profile", "a profile report")
        if other:
            raise ProfileFormatError(f"{origin} {other}.")
        if data.get("schema") != SCHEMA:
            raise ProfileFormatError(
                f"{origin}: not an autopar profile report (its 'schema' is "
                f"{data.get('schema')!r}, expected {SCHEMA!r}). Make one with 'autopar profile'."
            )
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            hint = (
                "upgrade autopar to read it"
                if isinstance(version, int) and version > SCHEMA_VERSION
                else "measure again with this version ('autopar profile ...')"
            )
            raise ProfileFormatError(
                f"{origin}: schema_version {version!r} is not supported; this autopar reads "
                f"version {SCHEMA_VERSION}: {hint}."
            )
        body = {k: v for k, v in data.items() if k != "schema"}
        try:
            return codec.decode(ProfileReport, body, "", error=ProfileFormatError)
        except ProfileFormatError as exc:
            raise ProfileFormatError(f"{origin}: {exc}") from None

    def to_json(self) -> str:
        """The report as JSON text (floats written exactly)."""
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the report to ``path`` (atomically, parents created); returns the path."""
        return codec.write_atomically(path, self.to_json())

    @staticmethod
    def load(path: str | Path) -> ProfileReport:
        """Read a report written by :meth:`save`."""
        data = codec.read_json(path, what="profile", error=ProfileFormatError, remedy=PROFILE_REMEDY)
        return ProfileReport.from_dict(data, origin=f"profile {str(path)!r}")

    @staticmethod
    def merge(*reports: ProfileReport) -> ProfileReport:
        """One report with every section of ``reports``; where several hold the same
        section, the later argument wins (so ``merge(old, new)`` updates ``old``)."""
        if not reports:
            raise ProfileFormatError("merge() needs at least one report.")
        merged = ProfileReport()
        for r in reports:
            if not isinstance(r, ProfileReport):
                raise ProfileFormatError(
                    f"merge() takes ProfileReport objects, got {type(r).__name__}; load files "
                    f"with ProfileReport.load(path)."
                )
            merged = replace(merged, **{s: getattr(r, s) for s in r.measured})
        return merged
