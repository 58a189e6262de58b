"""Between a Ray actor and its daemon: ``python -m hmp.launcher.keeper ACTOR_PID``.

When an actor's process exits, Ray SIGKILLs its child processes (``kill_child_processes_on_worker_exit``): that
child is this keeper, not the daemon, whose ``PR_SET_PDEATHSIG`` then gives it SIGTERM, a graceful stop (it leaves
the job, frees its shared memory). The keeper starts the daemon as ``python -m hmp.nodes.main -`` (which reads its
arguments from stdin, inherited: the actor writes them once it knows the scheduler's address), passes SIGTERM and
SIGINT on, exits with the daemon's exit code (128 + N: killed by signal N), and gets SIGTERM itself when the actor
dies without killing it. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def keep(actor_pid: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != actor_pid:  # the actor died before the prctl
        return 0
    me = os.getpid()

    def arm() -> None:  # in the daemon, before it runs: SIGTERM when this keeper ends
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != me:
            os.kill(os.getpid(), signal.SIGTERM)

    child = subprocess.Popen([sys.executable, "-m", "hmp.nodes.main", "-"], preexec_fn=arm)  # noqa: PLW1509

    def forward(sig: int, _frame: object) -> None:
        try:
            child.send_signal(sig)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(keep(int(sys.argv[1])))
