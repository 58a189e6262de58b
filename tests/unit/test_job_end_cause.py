"""The one line hmp-launch prints when a job fails: the cause read from a daemon's log, and its hint."""

from __future__ import annotations

import json

from hmp.launcher.diagnose import cause_of, failure_line, hint_for


def _event(event: str, level: str = "info", **fields) -> str:
    return json.dumps({"event": event, "level": level, "timestamp": "2026-11-27T18:00:00Z", **fields})


def test_a_refused_non_finite_push_names_the_cause_and_hints_at_the_learning_rate():
    log = "\n".join([
        _event("serving", address="tcp://127.0.0.1:1"),
        _event("joined"),
        _event("training", samples=718),
        _event("node_failed", "error", reason="RemoteError: ps0: non_finite: push: chunk 3 has 12 NaN or infinite "
                                              "value(s); nothing was applied"),
        _event("stopped", failed="RemoteError: ..."),
    ])
    line = failure_line("cpu0", "cpu_worker", log, "exited with code 1")
    assert line.startswith("cpu0 (cpu_worker): RemoteError: ps0: non_finite: push: chunk 3")
    assert "hint: the model diverged: lower the learning rate ([optimizer] lr)" in line
    assert "\n" not in line


def test_the_daemons_own_last_word_wins_over_its_log_events():
    log = "\n".join([_event("serving"), "hmp-gpu_worker gpu0: cannot start: gpu_worker gpu0: CUDA is not available "
                                        "on this machine; set device = \"cpu\" in its [[nodes]] entry"])
    assert cause_of(log).startswith("cannot start: gpu_worker gpu0: CUDA is not available")


def test_a_traceback_gives_its_last_line_and_an_unknown_log_the_fallback():
    log = "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\nValueError: bad thing"
    assert cause_of(log) == "ValueError: bad thing"
    assert failure_line("ps0", "ps", "nothing useful\n", "exited with code -9") == "ps0 (ps): exited with code -9"


def test_an_error_event_with_an_exception_gives_the_exceptions_last_line():
    log = _event("node_crashed", "error", exception="Traceback ...\n  ...\nZeroDivisionError: division by zero")
    assert cause_of(log) == "ZeroDivisionError: division by zero"


def test_hints_cover_the_usual_remedies_and_nothing_else():
    assert "join_timeout_s" in hint_for("node cpu0 (cpu_worker) did not join within 60 s")
    assert "device" in hint_for("RuntimeError: Invalid device string: 'cuda:x'")
    assert "batch size" in hint_for("RuntimeError: CUDA out of memory. Tried to allocate 2 GiB")
    assert "min_workers" in hint_for("only 0 of 2 workers remain (none) after gpu0 failed; [train] min_workers = 1")
    assert hint_for("some failure nobody has seen before") == ""
