"""structlog configuration, done once per process in its ``main``, and :class:`ErrorTally` (rate-limited
warnings for what peers cause per message)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import structlog


class _CurrentStderr:
    """``sys.stderr`` as it is at each write, not as it was when logging was configured: a process whose stderr
    is replaced afterwards (a test's capture that is later closed, a redirect) logs to the current one."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()

    def isatty(self) -> bool:
        return sys.stderr.isatty()


def configure(fmt: str = "auto", level: int = logging.INFO, stream=None) -> None:
    """Console rendering on a terminal, JSON lines otherwise (``fmt`` auto | console | json); to ``stream``, or
    to whatever ``sys.stderr`` is at each line."""
    stream = stream or _CurrentStderr()
    use_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )


class ErrorTally:
    """A warning that peers can cause once per message, logged as counts per code, not a line each.

    ``add(code, **fields)`` logs the first occurrence of a code at once (``event`` with ``code`` and
    the fields). Later ones are counted; once ``interval_s`` has passed since the code's last line,
    the next ``add`` or ``tick`` writes one summary line: ``event`` with ``code``, ``count`` (the
    occurrences since that line), ``interval_s`` (the time they span) and the latest occurrence's
    fields. A code quiet for a whole interval starts over (its next occurrence is logged at once).
    Call ``tick()`` now and then (e.g. from a heartbeat loop) so that the count of a burst that
    ended is written without waiting for the next occurrence, and ``flush()`` at exit.

    No timers and no event loop: usable from any thread holding it alone, and from the reader
    callbacks of :mod:`hmp.transport.endpoint`. Memory is bounded: at most ``max_codes`` codes are
    kept apart, any further ones are counted under ``"other"``. ``totals`` counts every occurrence.
    """

    def __init__(self, log: Any, event: str, interval_s: float = 5.0, *, max_codes: int = 64,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or max_codes < 1:
            raise ValueError(f"interval_s must be > 0 and max_codes >= 1, got {interval_s} and {max_codes}")
        self.log = log
        self.event = event
        self.interval_s = interval_s
        self.max_codes = max_codes
        self.clock = clock
        #: code -> [time of its last line, occurrences since, latest fields]
        self._open: dict[str, list[Any]] = {}
        self.totals: dict[str, int] = {}
        self.lines = 0  #: lines written

    def add(self, code: str, **fields: Any) -> None:
        if code not in self.totals and len(self.totals) >= self.max_codes:
            code = "other"
        self.totals[code] = self.totals.get(code, 0) + 1
        now = self.clock()
        entry = self._open.get(code)
        if entry is None or (not entry[1] and now - entry[0] >= self.interval_s):
            self._open[code] = [now, 0, fields]
            self._write(code, fields)
            return
        entry[1] += 1
        entry[2] = fields
        if now - entry[0] >= self.interval_s:
            self._summarise(code, entry, now)

    def tick(self) -> None:
        """Write the summaries that are due, and forget codes that were quiet for a whole interval."""
        now = self.clock()
        for code, entry in list(self._open.items()):
            if now - entry[0] < self.interval_s:
                continue
            if entry[1]:
                self._summarise(code, entry, now)
            else:
                del self._open[code]

    def flush(self) -> None:
        """Write every pending count now (at exit: no occurrence goes unreported) and start over."""
        now = self.clock()
        for code, entry in list(self._open.items()):
            if entry[1]:
                self._summarise(code, entry, now)
        self._open.clear()

    def _summarise(self, code: str, entry: list[Any], now: float) -> None:
        count, span = entry[1], now - entry[0]
        entry[0], entry[1] = now, 0
        self._write(code, entry[2], count=count, interval_s=round(span, 3))

    def _write(self, code: str, fields: dict[str, Any], **counts: Any) -> None:
        self.lines += 1
        self.log.warning(self.event, code=code, **counts, **fields)
