"""Ranks end with their launcher.

``autopar run`` starts the ranks through PyTorch's elastic agent, which puts each in its
own session: when the launcher itself is killed (``SIGKILL`` from a scheduler or the OOM
killer, which no handler sees), nothing ends them, and on a cluster they would hold their
GPUs and keep training. The launcher records its process id in ``AUTOPAR_LAUNCHER_PID``;
each rank, once it enters autopar (:func:`autopar.runtime.launch.init_distributed`,
:func:`autopar.runtime.api.parallelize`), starts a daemon thread that checks once a second
whether that process is still its parent, and kills its own process when it is not (the
rank was re-parented: its launcher is gone).

Ctrl-C reaches only the launcher (the ranks are in their own sessions); torch's agent
passes it on to each rank as SIGINT and ``autopar run`` reports it in one line, so a rank
prints no traceback for the ``KeyboardInterrupt`` it ends with. A script may still catch
it, to save a checkpoint say.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

LAUNCHER_ENV = "AUTOPAR_LAUNCHER_PID"
_THREAD = "autopar-launcher-watch"
POLL_S = 1.0


def tie_to_launcher() -> None:
    """Start the watch, and quiet the rank's traceback on Ctrl-C, when this process was
    started by ``autopar run`` (idempotent)."""
    value = os.environ.get(LAUNCHER_ENV, "")
    if not value.isdigit() or any(t.name == _THREAD for t in threading.enumerate()):
        return
    launcher = int(value)
    sys.excepthook = _quiet_on_interrupt(sys.excepthook)
    if os.getppid() != launcher:
        # started by the launcher's agent, but not as its direct child (a wrapper script):
        # watch the launcher's process itself
        threading.Thread(target=_watch_process, args=(launcher,), name=_THREAD, daemon=True).start()
        return
    threading.Thread(target=_watch_parent, args=(launcher,), name=_THREAD, daemon=True).start()


def _quiet_on_interrupt(hook: Callable[..., object]) -> Callable[..., None]:
    """``hook``, but silent for an uncaught ``KeyboardInterrupt``: the launcher passed on a
    Ctrl-C and says so once for all ranks. The interpreter still ends the rank by SIGINT."""

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not issubclass(kind, KeyboardInterrupt):
            hook(kind, value, tb)

    return excepthook


def _watch_parent(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _watch_process(launcher: int) -> None:
    while _alive(launcher):
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
