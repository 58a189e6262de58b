"""ErrorTally: one line per error code per interval under a storm, nothing lost at flush."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from hmp.log import ErrorTally, configure


class Clock:
    """A settable clock, so that intervals pass without sleeping."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def logged():
    """The JSON lines a real structlog configuration writes, as dicts."""
    stream = io.StringIO()
    configure("json", stream=stream)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    structlog.reset_defaults()


def test_a_storm_costs_one_line_per_code_per_interval(logged):
    """10,000 occurrences of two codes over 3 intervals write the first of each at once, then one count per
    code per interval, and the counts add up to every occurrence."""
    clock = Clock()
    tally = ErrorTally(structlog.get_logger("t"), "bad_message", interval_s=5.0, clock=clock)
    for i in range(10_000):
        clock.now = 100.0 + i * 0.0015  # 15 s in all
        tally.add("malformed" if i % 3 else "too_large", peer=f"p{i}")
    tally.flush()
    lines = logged()
    assert all(line["event"] == "bad_message" for line in lines)
    # per code: the first at once, then a count every 5 s of the 15 (the last one possibly at flush)
    assert 2 * 3 <= len(lines) == tally.lines <= 2 * 4
    firsts = [line for line in lines if "count" not in line]
    assert {line["code"] for line in firsts} == {"malformed", "too_large"} and len(firsts) == 2
    for code, total in (("malformed", 6666), ("too_large", 3334)):
        assert 1 + sum(line["count"] for line in lines if line["code"] == code and "count" in line) == total
        assert tally.totals[code] == total
    # each summary carries the latest occurrence's fields and the span it covers
    last = [line for line in lines if line["code"] == "malformed"][-1]
    assert last["peer"] == "p9998" and 0 < last["interval_s"] <= 5.0 + 0.01


def test_tick_writes_the_count_of_a_burst_that_ended_and_a_quiet_code_starts_over(logged):
    """tick() writes a finished burst's count once its interval is over; a code then quiet for a whole
    interval is logged at once again."""
    clock = Clock()
    tally = ErrorTally(structlog.get_logger("t"), "bad_message", interval_s=1.0, clock=clock)
    for _ in range(50):
        tally.add("malformed")
    tally.tick()  # within the interval: nothing yet
    assert [line.get("count") for line in logged()] == [None]
    clock.now += 1.0
    tally.tick()  # the burst ended: its count is written without a further occurrence
    assert [line.get("count") for line in logged()] == [None, 49]
    clock.now += 1.0
    tally.tick()  # quiet for a whole interval: forgotten
    tally.add("malformed", peer="late")
    assert logged()[-1] == {**logged()[-1], "code": "malformed", "peer": "late"} and "count" not in logged()[-1]


def test_codes_beyond_the_cap_are_counted_as_other(logged):
    """Memory stays bounded whatever codes the caller passes: past max_codes they are tallied as other."""
    tally = ErrorTally(structlog.get_logger("t"), "bad_message", max_codes=3, clock=Clock())
    for i in range(10):
        tally.add(f"code{i}")
    tally.flush()
    assert tally.totals == {"code0": 1, "code1": 1, "code2": 1, "other": 7}
    assert len(tally._open) == 0 and tally.lines == 5  # 4 firsts, and other's count of 6 at flush


def test_bad_arguments_are_refused():
    """A non-positive interval is a clear error, not a tally that never summarises."""
    with pytest.raises(ValueError, match="interval_s"):
        ErrorTally(structlog.get_logger("t"), "e", interval_s=0)
