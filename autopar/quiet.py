"""Imports of optional packages that log their host's shortcomings as they load.

torchao, which transformers' quantizers import whenever it is installed and which FP8
plans use, logs at import the CUDA extensions a CPU machine cannot load and the enum
registrations torch has deprecated. None of it concerns a plan, and a user planning a
transformers model would read it as an error. :func:`quiet_imports` holds those
loggers at ERROR while autopar imports such packages, and restores them after; a trace
on fake tensors holds torch's fake-tensor logger quiet (:func:`quiet_loggers`), whose
failure the trace says in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers that warn about the environment while a package loads, not about the run."""


FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"
"""Logs the whole traceback of an op that fails on fake tensors before raising it; a
trace re-raises that failure as one line (:func:`autopar.graph.trace`)."""


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, :data:`NOISY_LOGGERS` log errors only."""
    with quiet_loggers(NOISY_LOGGERS, logging.ERROR):
        yield


@contextmanager
def quiet_loggers(names: tuple[str, ...], level: int) -> Iterator[None]:
    """Within the block, the loggers ``names`` log at ``level`` and above only."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, old in zip(loggers, levels):
            logger.setLevel(old)
