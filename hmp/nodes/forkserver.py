"""A fork server for daemons started on this machine: import torch once, fork each daemon from it.

Every daemon used to be a fresh ``python -m hmp.nodes.main``; importing torch, numpy and hmp's node modules
costs about 2.5 s of CPU per daemon, so a five-daemon job on two cores spent ~6 s just starting. The fork
server is one process that imports all of that once and forks a daemon per request: a fork costs a few ms.
:class:`hmp.cluster.LocalCluster` uses it for daemons on this machine's own network (a daemon of an emulated host
enters the host's network namespace right after the fork, as ``ip netns exec`` would); ``HMP_FORKSERVER=0``
turns it off.

Each forked daemon is what ``python -m hmp.nodes.main ROLE ARGS`` would be: its own session, stdout and
stderr to its log file, stdin from /dev/null, the requested environment and working directory, fresh
random seeds (a fork would otherwise share the server's numpy and torch generator state), and the same
early-signal handling. Nothing in the server has created a thread pool, a socket or an event loop before
forking (importing numpy starts OpenBLAS's threads, which its own fork handlers take care of, as for
torch's DataLoader workers).

Protocol on the server's stdin/stdout, JSON lines:
  once its imports are done: ``{"ready": IMPORT_SECONDS}``;
  request ``{"id", "argv": [ROLE, ...], "env": {...}, "cwd", "log", "netns": NAME | null}`` -> ``{"id", "pid"}`` or ``{"id", "error"}``;
  when a daemon exits: ``{"exit": PID, "code": C}`` (C < 0: killed by signal -C, as ``Popen.returncode``).
The server exits at the end of its stdin (its parent closed it, or died) or on SIGTERM/SIGINT; each daemon it
started then gets SIGTERM (``PR_SET_PDEATHSIG``) and stops gracefully, so a launcher killed with SIGKILL
leaves nothing running. A launcher that ends normally has stopped its daemons before that.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any


# ---------------------------------------------------------------------------------------------- the server


_CLONE_NEWNET = 0x40000000
_PR_SET_PDEATHSIG = 1


def _enter_netns(name: str) -> None:
    """Move this process into the named network namespace (``ip netns add NAME``; needs root)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name!r}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _stop_with_parent(server_pid: int) -> None:
    """SIGTERM this daemon when the server ends. The server ends when its launcher does (the end of its stdin),
    so a launcher killed with SIGKILL leaves no daemon training on: each stops gracefully, as on Ctrl-C."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != server_pid:  # the server ended between the fork and the prctl
        os.kill(os.getpid(), signal.SIGTERM)


def _child(request: dict[str, Any], wakeup_fds: tuple[int, int], server_pid: int) -> None:
    """In the forked daemon: become a daemon process, run its main, never return."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in wakeup_fds:
            os.close(fd)
        if request.get("netns"):  # an emulated host: what `ip netns exec` does, for the network (all a daemon uses)
            _enter_netns(request["netns"])
        os.setsid()  # as start_new_session: a Ctrl-C on the terminal reaches the launcher only
        _stop_with_parent(server_pid)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]  # the log is read while running
        sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        import numpy as np
        import torch

        np.random.seed()  # fresh, as a new process would have
        torch.seed()
        from hmp.nodes import main as node_main

        # node_main._early_signals is the server's (empty: the server ends at its first signal) and now collects
        # any SIGTERM that reaches this daemon before its loop owns the signals; Node.run replays them.
        role, args = request["argv"][0], request["argv"][1:]
        sys.argv = [f"hmp-{role.replace('_', '-')}", *args]
        try:
            code = node_main.ROLE_MAINS[role](args)
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    except BaseException:  # noqa: BLE001 - anything a fresh interpreter would print and exit 1 for
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _preload() -> None:
    """Import everything a daemon needs, once (the point of this process), including what daemons would each import
    on their own later: the job's assembly, the data loaders, the event loop and structured logging."""
    import numpy  # noqa: F401
    import structlog  # noqa: F401
    import torch  # noqa: F401
    import uvloop  # noqa: F401

    from hmp import job  # noqa: F401
    from hmp.data import loaders  # noqa: F401
    from hmp.nodes import ps_shard, ring_worker, scheduler, stage_worker, worker  # noqa: F401
    from hmp.transport import security  # noqa: F401


def serve() -> int:
    t0 = time.perf_counter()
    # hmp.nodes.main first: it installs the early-signal handlers that forked daemons inherit, so a SIGTERM
    # between fork and their loop is kept.
    from hmp.nodes import main as node_main

    node_main.set_title("hmp-forkserver", "hmp-forkserver")
    _preload()
    out = sys.stdout
    out.write(json.dumps({"ready": round(time.perf_counter() - t0, 3)}) + "\n")
    out.flush()
    server = os.getpid()
    read_fd, write_fd = os.pipe()  # SIGCHLD and SIGTERM wake the select below
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.fileno(), selectors.EVENT_READ)
    sel.register(read_fd, selectors.EVENT_READ)
    buf = b""
    children: set[int] = set()

    def reply(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    def reap() -> None:
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    while not node_main._early_signals:
        for key, _ in sel.select(timeout=1.0):  # the timeout only bounds a missed wake-up
            if key.fd == read_fd:
                os.read(read_fd, 4096)
                continue
            chunk = os.read(key.fd, 1 << 16)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as exc:
                    reply({"id": req["id"], "error": f"fork failed: {exc}"})
                    continue
                if pid == 0:
                    _child(req, (read_fd, write_fd), server)
                children.add(pid)
                reply({"id": req["id"], "pid": pid})
        reap()
    return 0


# ---------------------------------------------------------------------------------------------- the client


class ForkServerExited(OSError):
    """The fork server is gone (killed, or its stdin closed); :meth:`ForkServer.shared` starts another."""


class ForkedProcess:
    """A daemon forked by the server, with the part of ``asyncio.subprocess.Process`` the cluster uses."""

    def __init__(self, pid: int, exited: concurrent.futures.Future[int]) -> None:
        self.pid = pid
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._exited.result() if self._exited.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(asyncio.wrap_future(self._exited))

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:  # once reaped, the pid may belong to someone else
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: one server per process, started on first use, shared by every cluster (and every
    event loop: replies arrive on a reader thread and resolve thread-safe futures)."""

    _instance: ForkServer | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "hmp.nodes.forkserver"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, start_new_session=True)
        self._lock = threading.Lock()
        self._next_id = 0
        self._spawns: dict[int, concurrent.futures.Future[int]] = {}
        self._exits: dict[int, concurrent.futures.Future[int]] = {}
        self._early_exits: dict[int, int] = {}  # an exit read before its spawn reply was handled
        self._dead = False
        #: ``time.time()`` when the server said it had imported everything (None: not yet), and how long that took it
        self.ready_at: float | None = None
        self.import_s: float | None = None
        self._reader = threading.Thread(target=self._read, name="hmp-forkserver-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._dead

    @classmethod
    def shared(cls) -> ForkServer:
        """This process's server (started now if there is none, or it has ended)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance._dead:
                cls._instance = cls()
                atexit.register(cls._instance.close)
            return cls._instance

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            if "ready" in msg:
                self.import_s, self.ready_at = float(msg["ready"]), time.time()
                continue
            with self._lock:
                if "exit" in msg:
                    fut = self._exits.get(msg["exit"])
                    if fut is None:
                        self._early_exits[msg["exit"]] = msg["code"]
                    else:
                        fut.set_result(msg["code"])
                    continue
                spawn = self._spawns.pop(msg["id"])
            if spawn.cancelled():  # its launcher gave up meanwhile (e.g. Ctrl-C while starting): nobody will stop it
                if "pid" in msg:
                    with contextlib.suppress(OSError):
                        os.kill(msg["pid"], signal.SIGTERM)
            elif "error" in msg:
                spawn.set_exception(OSError(msg["error"]))
            else:
                spawn.set_result(msg["pid"])
        self._proc.wait()
        with self._lock:  # the server is gone: nothing will report these exits any more
            self._dead = True
            for fut in self._spawns.values():
                fut.set_exception(ForkServerExited("the fork server exited"))
            for fut in self._exits.values():
                if not fut.done():
                    fut.set_result(-1)

    async def spawn(self, argv: list[str], *, env: dict[str, str], log: str, cwd: str | None = None,
                    netns: str | None = None) -> ForkedProcess:
        """Fork ``python -m hmp.nodes.main *argv`` with this environment, its output to ``log``; with ``netns``,
        inside that network namespace (an emulated host's; it is removed with whatever runs in it)."""
        spawned: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            if self._dead:
                raise ForkServerExited("the fork server exited")
            self._next_id += 1
            rid = self._next_id
            self._spawns[rid] = spawned
            assert self._proc.stdin is not None
            req = {"id": rid, "argv": argv, "env": env, "log": log, "cwd": cwd or os.getcwd(), "netns": netns}
            try:
                self._proc.stdin.write((json.dumps(req) + "\n").encode())
                self._proc.stdin.flush()
            except (OSError, ValueError):  # it ended before the reader thread saw it
                self._spawns.pop(rid)
                self._dead = True
                raise ForkServerExited("the fork server exited") from None
        # Waits while the server imports (its first request) or forks; never long, but it must not block the loop.
        pid = await asyncio.wrap_future(spawned)
        exited: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._lock:
            self._exits[pid] = exited
            if pid in self._early_exits:
                exited.set_result(self._early_exits.pop(pid))
            elif self._dead:
                exited.set_result(-1)
        return ForkedProcess(pid, exited)

    def close(self) -> None:
        """End the server; daemons it forked that still run get SIGTERM (their parent died)."""
        with contextlib.suppress(OSError, ValueError):
            assert self._proc.stdin is not None
            self._proc.stdin.close()
        with self._lock:
            forked = self._next_id > 0
        if not forked:  # e.g. a launcher that met a config error: the server may still be importing torch
            self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.terminate()
            self._proc.wait(timeout=5)
        with contextlib.suppress(OSError, ValueError):
            assert self._proc.stdout is not None
            self._proc.stdout.close()


def enabled() -> bool:
    return os.environ.get("HMP_FORKSERVER", "1") not in ("0", "off", "false", "no")


if __name__ == "__main__":
    sys.exit(serve())
