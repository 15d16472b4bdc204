"""Typed errors of the runtime. Each message says the value, why it is wrong and what to do.

They are raised on every rank *before* any collective whenever the cause is visible
locally (a wrong world size, a plan for another model, a style a layer cannot take), so
a bad plan fails fast and identically everywhere instead of hanging in a collective.
"""

from __future__ import annotations

from autopar.errors import AutoparError, ConfigError


class PlanMismatchError(ConfigError):
    """The plan does not fit this job: another world size, another model, units the
    model does not have."""


class ShardingError(ConfigError):
    """A tensor-parallel style names a layer that cannot take it (a column split on a
    Conv2d, a split that does not divide a dimension, layouts that disagree)."""


class PipelineError(ConfigError):
    """The model cannot be cut into the plan's pipeline stages (a unit container that
    renumbers its children, a forward that cannot skip missing parts)."""


class ContextParallelError(ConfigError):
    """The plan's context parallelism cannot run on this model or sequence length (a
    sequence that does not split into ``2 * cp`` chunks, an attention the causal ring
    cannot compute)."""


class ExpertParallelError(ConfigError):
    """The plan's expert parallelism cannot run on this model (no experts module, an
    expert count that ``ep`` does not divide, a combination the runtime does not run)."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete or does not match the job."""


class JobError(AutoparError):
    """The job was used out of order (an optimizer created twice, a step without one)."""


class NonFiniteError(AutoparError):
    """Too many steps in a row had a non-finite loss or gradient on some rank; every
    rank raises it at the same step (:mod:`autopar.runtime.finite`)."""


class CompileError(AutoparError):
    """A block of a plan with ``compile=True`` failed to compile at its first call
    (:mod:`autopar.runtime.compile`); a plan with ``compile=False`` runs it eager."""


class FP8Error(ConfigError):
    """A plan with ``fp8=True`` cannot run here: torchao is missing, or FP8 is combined
    with a choice the runtime does not run with it (:mod:`autopar.runtime.fp8`)."""


class AsyncTPError(ConfigError):
    """A plan with ``async_tp=True`` cannot run here: asynchronous tensor parallelism
    needs CUDA devices (:mod:`autopar.runtime.async_tp`)."""
