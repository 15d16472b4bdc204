"""Export a plan to the configuration another training framework runs.

``export(plan, to="megatron")`` returns an :class:`Export`: the file the framework reads
(Megatron-LM launch script, DeepSpeed config JSON, torchtitan job TOML, Accelerate config
YAML), the command that launches it, and notes wherever the framework has no exact
equivalent of a plan's choice (per-layer tensor-parallel styles, per-block recompute,
ZeRO-3 under pipelining, schedules) and the closest one was written instead. The same
notes are comments in the file. ``autopar export plan.json --to NAME`` is the command.

Frameworks build the model from their own definitions; when the caller passes the model
the plan was made for, its sizes are filled in where the framework takes them as flags.
"""

from autopar.export.api import EXPORTERS, export
from autopar.export.cli import add_export_parser
from autopar.export.common import Export, ExportError, UnreadablePlanError
from autopar.export.experts_shape import Experts
from autopar.export.shape import ModelShape

__all__ = [
    "EXPORTERS",
    "Experts",
    "Export",
    "ExportError",
    "ModelShape",
    "UnreadablePlanError",
    "add_export_parser",
    "export",
]
