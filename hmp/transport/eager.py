"""Start a coroutine eagerly: its first step runs at once, and only one that suspends gets a Task.

Most request handlers finish without suspending, and a Task per request costs more than the rest
of such a request. Python 3.12+ does this natively (``eager_start=True``, the first step inside the
Task); on 3.11 the first step runs here, outside any Task, and a coroutine that suspends continues
in a Task driving :class:`_Resume`. Standard library only: ``tests/cluster/test_transport.py`` loads this
file by path under every installed Python, without zmq or torch.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import sys
from typing import Any

#: ``asyncio.Task(..., eager_start=True)`` exists from Python 3.12.
NATIVE = sys.version_info >= (3, 12)

_STARTED = object()


class _Resume(collections.abc.Coroutine):
    """The rest of a coroutine whose first step already ran outside any Task.

    A Task driving this first gets what that step yielded (the future the coroutine waits on),
    then every send/throw goes straight to the coroutine: the Task drives it as if it had run the
    first step itself, cancellation included.
    """

    __slots__ = ("_coro", "_first")

    def __init__(self, coro: collections.abc.Coroutine, first: Any) -> None:
        self._coro, self._first = coro, first

    def send(self, value: Any) -> Any:
        if self._first is not _STARTED:
            first, self._first = self._first, _STARTED
            return first
        return self._coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self._first = _STARTED
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        raise TypeError("_Resume is driven by a Task only")


def start_eager(coro: collections.abc.Coroutine, loop: asyncio.AbstractEventLoop,
                context: contextvars.Context | None = None, *, native: bool | None = None) -> asyncio.Task | None:
    """Run ``coro`` up to its first suspension now; return the Task that continues it, or None if it finished.

    Call from a callback of the running ``loop``. ``context`` (default: a copy of the current
    one, as ``create_task`` would give) is the context the coroutine runs in throughout. An
    exception raised before the first suspension propagates from here. ``native`` picks the
    implementation (default: the interpreter's own eager start where it has one); tests use it
    to run the 3.11 path on newer interpreters too.
    """
    ctx = contextvars.copy_context() if context is None else context
    if NATIVE if native is None else native:
        task = asyncio.Task(coro, loop=loop, context=ctx, eager_start=True)  # type: ignore[call-arg]
        if not task.done():
            return task
        task.result()  # re-raises what the first step raised, like the 3.11 path
        return None
    try:
        first = ctx.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_Resume(coro, first), context=ctx)


__all__ = ["NATIVE", "start_eager"]
