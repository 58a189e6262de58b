"""Why a daemon failed, in one line with a hint, from its log: what ``hmp-launch`` prints when a job fails.

A daemon's log is JSON lines (structlog) plus whatever it printed itself (a config error, a traceback).
:func:`cause_of` picks the line that says why it stopped: its own last word on stderr (``hmp-ROLE ID: ...``),
else the last error event that carries a reason (``node_failed``, ``task_failed``, ``job_failed``, ...), else the
last line of a traceback. :func:`hint_for` adds what to change, for the causes that have a usual remedy
(:data:`HINTS`). Pure: text in, text out.
"""

from __future__ import annotations

import json
import re

#: ``(pattern, hint)``: the first pattern found in a cause (a regular expression, case-insensitive) gives its hint
HINTS: tuple[tuple[str, str], ...] = (
    (r"non_finite|NaN or infinite", ("the model diverged: lower the learning rate ([optimizer] lr), or normalise "
                                     "the data ([data] standardize = true)")),
    (r"Invalid device|device string|Expected one of .* device type",
     'set the [[nodes]] entry\'s device to "cpu", "cuda" or "cuda:N" (N: a GPU index of this machine)'),
    (r"CUDA error: invalid device ordinal|invalid device ordinal",
     "that GPU does not exist here: set the [[nodes]] entry's device to an index below torch.cuda.device_count()"),
    (r"out of memory", "lower the batch size ([train] batch_size or the node's batch_size)"),
    (r"did not join within", ("see that node's log for why it did not start; raise [job] join_timeout_s if it "
                              "is only slow to start")),
    (r"scheduler lost", "the scheduler stopped answering: see the scheduler's log"),
    (r"min_workers", "too many workers failed: see the first failed worker's log, or lower [train] min_workers"),
)

#: error events whose fields say why, most telling field first
_REASON_FIELDS = ("reason", "error", "exception")
_OWN_LINE = re.compile(r"^hmp-[a-z_-]+( [^:]+)?: ")


def _event(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def cause_of(log_text: str) -> str:
    """One line saying why the daemon whose log is ``log_text`` failed ("" when its log does not say)."""
    lines = [ln.rstrip() for ln in log_text.splitlines() if ln.strip()]
    for line in reversed(lines):  # its own last word: "hmp-cpu_worker cpu0: cannot start: ...", a config error
        if _OWN_LINE.match(line) and "did not hear" not in line:
            return line.split(": ", 1)[1]
    for line in reversed(lines):
        rec = _event(line)
        if rec is None or rec.get("level") not in ("error", "critical"):
            continue
        for field in _REASON_FIELDS:
            value = rec.get(field)
            if isinstance(value, str) and value:
                return value.strip().splitlines()[-1] if field == "exception" else value
    for line in reversed(lines):  # a traceback's last line: "ValueError: ..."
        if _event(line) is None and re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line):
            return line
    return ""


def hint_for(cause: str) -> str:
    """What to change for ``cause`` ("" when there is no usual remedy)."""
    for pattern, hint in HINTS:
        if re.search(pattern, cause, re.IGNORECASE):
            return hint
    return ""


def failure_line(node: str, role: str, log_text: str, fallback: str) -> str:
    """``NODE (ROLE): CAUSE; hint: HINT``: the cause from its log (``fallback`` when the log does not say)."""
    cause = cause_of(log_text) or fallback
    hint = hint_for(cause)
    return f"{node} ({role}): {cause}" + (f"; hint: {hint}" if hint else "")
