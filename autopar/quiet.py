"""Imports of optional packages that log their host's shortcomings as they load.

torchao, which transformers' quantizers import whenever it is installed and which FP8
plans use, logs at import the CUDA extensions a CPU machine cannot load and the enum
registrations torch has deprecated. None of it concerns a plan, and a user planning a
transformers model would read it as an error. :func:`quiet_imports` holds those
loggers at ERROR while autopar imports such packages, and restores them after.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
"""Loggers that warn about the environment while a package loads, not about the run."""


@contextmanager
def quiet_imports() -> Iterator[None]:
    """Within the block, :data:`NOISY_LOGGERS` log errors only."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
