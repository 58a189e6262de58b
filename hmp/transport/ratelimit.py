"""Warnings a peer can cause once per message, logged as counts per code per interval (docs/protocol.md,
"Trust": logs under attack)."""

from __future__ import annotations

import asyncio
from typing import Any

from hmp.log import ErrorTally

#: Per-message warnings (bad_message, unauthorized) of one code are logged at once the first time,
#: then as one summary line with their count per this many seconds (a storm costs a line, not a line each).
LOG_SUMMARY_S = 5.0


class RateLimitedLog:
    """An endpoint's warnings that peers can cause once per message: one :class:`hmp.log.ErrorTally` per
    event, ticked by a loop timer so that the count of a burst that ended is written within two intervals.

    ``warning(event, code, **fields)`` logs the first occurrence of ``(event, code)`` at once, with its
    fields; later ones are counted and written as one line ``event`` with ``code``, ``count`` (how many
    since the last line), ``interval_s`` and the latest fields, at most once per :data:`LOG_SUMMARY_S`.
    ``flush()`` (at close) writes what is still counted. Usable from reader callbacks (no awaiting).
    """

    def __init__(self, logger: Any, interval_s: float = LOG_SUMMARY_S) -> None:
        self.log = logger
        #: the interval of tallies made from now on (tests shorten it)
        self.interval_s = interval_s
        self._tallies: dict[str, ErrorTally] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._added = 0  # warnings since the last tick: while there are, the timer keeps ticking

    @property
    def lines(self) -> int:
        """Lines written so far."""
        return sum(t.lines for t in self._tallies.values())

    def warning(self, event: str, code: str, **fields: Any) -> None:
        tally = self._tallies.get(event)
        if tally is None:
            tally = self._tallies[event] = ErrorTally(self.log, event, self.interval_s)
        tally.add(code, **fields)
        self._added += 1
        self._arm()

    def _arm(self) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (closing): the next warning, or flush(), writes the counts
            return
        self._timer = loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        self._timer = None
        for tally in self._tallies.values():
            tally.tick()
        if self._added:  # counts may still be open: one more tick after a quiet interval writes them
            self._added = 0
            self._arm()

    def flush(self) -> None:
        """Write the pending counts now (at close: nothing is lost) and stop the timer."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for tally in self._tallies.values():
            tally.flush()


__all__ = ["LOG_SUMMARY_S", "RateLimitedLog"]
