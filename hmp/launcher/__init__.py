"""One lifecycle for a job's daemons (:mod:`hmp.launcher.base`) and the programs its engines run (:mod:`.relay`,
:mod:`.keeper`, :mod:`.ray_actor`); this module imports the standard library only: the keeper and Ray actors load it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class Service:
    """``async with``: :meth:`start`, and :meth:`stop` at the end, also when start() fails (a launcher, the job
    manager)."""

    async def __aenter__(self) -> Any:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()


async def terminate(procs: Iterable[Any], grace_s: float, sig: int | None = signal.SIGTERM) -> None:
    """Stop processes (``asyncio.subprocess.Process`` or alike): ``sig`` to each still running (None: none,
    they were asked some other way), then SIGKILL to those still running after ``grace_s``."""
    import asyncio  # here: the keeper imports this package, and must start in milliseconds

    live = [p for p in procs if p.returncode is None]
    if not live:
        return
    for p in live:
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live], timeout=grace_s)
    for p in live:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            await p.wait()


def tail(path: str | Path, lines: int = 15) -> str:
    """The last ``lines`` lines of a daemon's log ("" when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
