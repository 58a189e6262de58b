"""Staging a device tensor through a host buffer, piece by piece, overlapped with the ring.

The ring's sends and reductions work on host memory, so for a CUDA tensor the ring runs on a pinned
host buffer and one copier thread per ring moves each piece device-to-host in the order the ring
needs it and back as soon as its final value is there, so the copies overlap the ring's steps.
docs/collective.md, "CUDA tensors: staging", has the order and the threading rules.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Hashable, Sequence

import torch


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class Staging:
    """One operation's staging of ``device`` (any 1-D tensor) through ``host`` (CPU, same size)."""

    def __init__(self, device: torch.Tensor, host: torch.Tensor, copier: concurrent.futures.Executor,
                 loop: asyncio.AbstractEventLoop, stream: object | None = None) -> None:
        if device.shape != host.shape or device.dtype != host.dtype:
            raise ValueError(f"host buffer {host.dtype}{list(host.shape)} does not match {device.dtype}"
                             f"{list(device.shape)}")
        self.device, self.host = device, host
        self._copier, self._loop, self._stream = copier, loop, stream
        self._ready: dict[Hashable, asyncio.Future] = {}
        self.error: BaseException | None = None
        self.pending_out = 0  #: pieces being copied back
        self.copies_in = 0  #: pieces copied in so far (the tests check the granularity)
        self.copies_out = 0

    # ------------------------------------------------------------------ in

    def start(self, regions: Sequence[tuple[Hashable, int, int]]) -> None:
        """Copy ``(key, lo, hi)`` regions in, in this order; :meth:`ready` tells when each is."""
        for key, _, _ in regions:
            self._ready[key] = self._loop.create_future()
        jobs = [(self._ready[key], lo, hi) for key, lo, hi in regions]
        self._copier.submit(self._copy_in, jobs)

    def ready(self, key: Hashable) -> asyncio.Future | None:
        """The future of region ``key``'s copy in, or None when it is there already."""
        fut = self._ready.get(key)
        return None if fut is None or fut.done() else fut

    def _copy_in(self, jobs: list[tuple[asyncio.Future, int, int]]) -> None:
        done = 0
        try:
            with self._on_stream():
                for fut, lo, hi in jobs:
                    if self.error is not None:
                        break
                    self.host[lo:hi].copy_(self.device[lo:hi])
                    self.copies_in += 1
                    self._signal(fut)
                    done += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the loop, never raised there
            self.error = exc
        for fut, _, _ in jobs[done:]:  # after an error: wake the rest, they look at .error
            self._signal(fut)

    # ------------------------------------------------------------------ out

    def write_back(self, lo: int, hi: int, on_done: Callable[[], None]) -> None:
        """Copy ``host[lo:hi]`` (now final) to the device; ``on_done()`` on the loop afterwards."""
        self.pending_out += 1
        self._copier.submit(self._copy_out, lo, hi, on_done)

    def _copy_out(self, lo: int, hi: int, on_done: Callable[[], None]) -> None:
        try:
            if self.error is None:
                with self._on_stream():
                    self.device[lo:hi].copy_(self.host[lo:hi])
                self.copies_out += 1
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            self._call(self._out_done, on_done)

    def _out_done(self, on_done: Callable[[], None]) -> None:
        self.pending_out -= 1
        on_done()

    # ------------------------------------------------------------------ plumbing

    def _on_stream(self) -> contextlib.AbstractContextManager:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)  # type: ignore[arg-type]

    def _signal(self, fut: asyncio.Future) -> None:
        self._call(_wake, fut)

    def _call(self, fn: Callable, *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            self._loop.call_soon_threadsafe(fn, *args)


def side_stream(device: torch.device, streams: dict) -> object | None:
    """The copier's CUDA stream for ``device`` (made once per ring), synchronised with the caller's
    current stream so that the copies see every kernel queued before the operation started."""
    if device.type != "cuda":
        return None
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer for staging (pinned where CUDA is there to use it: faster, async-capable copies)."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


__all__ = ["Staging", "host_buffer", "side_stream"]
