"""Staging a device tensor through a host buffer, piece by piece, overlapped with the ring.

The ring's sends and reductions work on CPU memory (the wire, and the shared-memory transport,
carry host bytes). For a CUDA tensor, :class:`Ring.all_reduce <hmp.collective.ring.Ring>` runs the
whole algorithm on a pinned host buffer of the same size and this module moves the bytes:

* **in** (device -> host): every piece is copied by one copier thread, in the order the ring needs
  them (first the pieces this member sends at step 0, then the segments in the order it receives
  them). Each piece's future is set as soon as its copy is done, so the first pieces go on the
  wire while later ones are still being copied (the D2H overlaps the sends), and a reduction
  into a piece waits only for that piece.
* **out** (host -> device): a piece is copied back as soon as its final value is in the host
  buffer (after the last reduce-scatter step for the segment this member reduces, after each
  all-gather receipt for the others), so the H2D overlaps the all-gather too. The operation
  returns once every piece is back.

The copier is one thread per ring (a FIFO: pieces in order, ins before the outs queued after
them). On CUDA the copies run on a side stream that first waits for the caller's current stream
(the one that produced the gradients), and each ``copy_`` between pageable-or-pinned host memory
and the device is synchronous for that thread, so a piece's future is set once its bytes have
landed. The same code runs on CPU tensors when a ring is built with ``stage=True`` (the tests
use it: there is no GPU here), where the copies are plain memcpys.

The copier never touches the event loop but through ``call_soon_threadsafe``, and never raises
into it: a failed copy is stored in :attr:`Staging.error` and wakes every waiter (the ring then
fails the operation).
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
