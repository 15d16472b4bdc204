"""A rank 1 that fails in a given way, for the launcher's failure summary:
``autopar run --plan plan.json --nproc-per-node 2 fail_as.py MODE``. MODE is ``exit-3``
(``sys.exit(3)``), ``os-exit-4`` (``os._exit(4)``: no Python exception at all),
``sigkill`` (killed by a signal), ``empty-message`` (``RuntimeError()``) or ``raise``
(``ValueError("bad value")``). Rank 0 sleeps until the launcher stops it (30 s at most),
so the summary must leave out the rank it stopped."""

import os
import signal
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(mode: str) -> None:
    if os.environ["RANK"] != "1":
        time.sleep(30)
        return
    if mode == "exit-3":
        sys.exit(3)
    if mode == "os-exit-4":
        os._exit(4)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "empty-message":
        raise RuntimeError()
    raise ValueError("bad value")


if __name__ == "__main__":
    main(sys.argv[1])
