"""Ranks end with their launcher.

``autopar run`` starts the ranks through PyTorch's elastic agent, which puts each in its
own session: when the launcher itself is killed (``SIGKILL`` from a scheduler or the OOM
killer, which no handler sees), nothing ends them, and on a cluster they would hold their
GPUs and keep training. The launcher records its process id in ``AUTOPAR_LAUNCHER_PID``;
each rank, once it enters autopar (:func:`autopar.runtime.launch.init_distributed`,
:func:`autopar.runtime.api.parallelize`), starts a daemon thread that checks once a second
whether that process is still its parent, and kills its own process when it is not (the
rank was re-parented: its launcher is gone).
"""

from __future__ import annotations

import os
import signal
import threading
import time

LAUNCHER_ENV = "AUTOPAR_LAUNCHER_PID"
_THREAD = "autopar-launcher-watch"
POLL_S = 1.0


def tie_to_launcher() -> None:
    """Start the watch when this process was started by ``autopar run`` (idempotent)."""
    value = os.environ.get(LAUNCHER_ENV, "")
    if not value.isdigit() or any(t.name == _THREAD for t in threading.enumerate()):
        return
    launcher = int(value)
    if os.getppid() != launcher:
        # started by the launcher's agent, but not as its direct child (a wrapper script):
        # watch the launcher's process itself
        threading.Thread(target=_watch_process, args=(launcher,), name=_THREAD, daemon=True).start()
        return
    threading.Thread(target=_watch_parent, args=(launcher,), name=_THREAD, daemon=True).start()


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
