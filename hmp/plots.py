"""The run report's figure: loss, the test metric, throughput per worker and update shares against wall time.

:func:`plot_report` draws ``report.json``'s data as four panels sharing the time axis: each
worker's training loss (and, dashed, the evaluating worker's test loss), the evaluating worker's
test metric (the task's: ``final.best_reported_metric``, e.g. test_accuracy or r2), each worker's
samples/s between reports, and each worker's stacked share of all updates so far. Headless (matplotlib's Agg
backend); it imports nothing of hmp.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: A line with at most this many points is drawn with a marker at each.
MARKERS_UP_TO = 30

#: The panels :func:`plot_report` draws, top to bottom.
PANELS = ("loss", "test metric", "throughput", "update shares")


#: A throughput point spans at least this long: a report right after the one before it (the final report,
#: sent as the worker stops) is measured from an earlier one instead of drawing a rate over a millisecond.
MIN_RATE_INTERVAL_S = 0.05


def throughput(points: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``[(t, samples/s), ...]`` of one worker's report points: the rate between each point and the one
    before it (``samples`` over ``t``, over at least :data:`MIN_RATE_INTERVAL_S`), and at the first point
    its own ``samples_per_s`` (its average so far)."""
    out: list[tuple[float, float]] = []
    prev = None
    for p in points:
        if "samples" not in p:
            continue
        if prev is None:
            if "samples_per_s" in p:
                out.append((p["t"], p["samples_per_s"]))
            prev = p
        elif p["t"] - prev["t"] >= MIN_RATE_INTERVAL_S:
            out.append((p["t"], (p["samples"] - prev["samples"]) / (p["t"] - prev["t"])))
            prev = p
    return out


def update_shares(series: dict[str, list[dict[str, Any]]]) -> tuple[list[float], dict[str, list[float]]]:
    """At each report time of any worker, each worker's share of the updates reported so far (its last
    report's ``updates`` over the sum of every worker's last): ``(times, {worker: shares})``."""
    events = sorted((p["t"], w, p["updates"]) for w, pts in series.items() for p in pts if "updates" in p)
    last = {w: 0.0 for w in series}
    times: list[float] = []
    shares: dict[str, list[float]] = {w: [] for w in series}
    for t, w, updates in events:
        last[w] = float(updates)
        total = sum(last.values())
        if total <= 0:
            continue
        if times and times[-1] == t:  # several reports at one instant: one point, the latest shares
            for s in shares.values():
                s.pop()
        else:
            times.append(t)
        for name in series:
            shares[name].append(last[name] / total)
    return times, shares


def plot_report(data: dict[str, Any], path: Path | str, title: str = "") -> dict[str, dict[str, int]]:
    """Write the figure of report ``data`` to ``path`` (PNG); returns what each panel shows, ``{panel:
    {line: points}}`` (an empty panel says so in its middle and returns ``{}``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict[str, Any]]] = data.get("series") or {}
    final_shares = {w: s.get("update_share") for w, s in (data.get("workers") or {}).items()}
    drawn: dict[str, dict[str, int]] = {p: {} for p in PANELS}
    metric = (data.get("final") or {}).get("best_reported_metric") or "test_accuracy"
    fig, axes = plt.subplots(4, 1, figsize=(8, 11), dpi=100, sharex=True)
    ax_loss, ax_metric, ax_rate, ax_share = axes

    def line(ax: Any, panel: str, label: str, pts: list[tuple[float, float]], **kw: Any) -> None:
        if not pts:
            return
        if len(pts) <= MARKERS_UP_TO:
            kw.setdefault("marker", "o")
            kw.setdefault("markersize", 3)
        ax.plot(*zip(*pts), label=label, **kw)
        drawn[panel][label] = len(pts)

    colors = {w: f"C{i}" for i, w in enumerate(series)}
    for w, points in series.items():
        line(ax_loss, "loss", w, [(p["t"], p["loss"]) for p in points if _finite(p.get("loss"))], color=colors[w])
        line(ax_loss, "loss", f"{w} test loss", [(p["t"], p["test_loss"]) for p in points
                                                  if _finite(p.get("test_loss"))], color=colors[w], linestyle="--")
        line(ax_metric, "test metric", f"{w} {metric}", [(p["t"], p[metric]) for p in points
                                                         if _finite(p.get(metric))], color=colors[w])
        line(ax_rate, "throughput", w, throughput(points), color=colors[w])
    times, shares = update_shares(series)
    if times:
        names = list(shares)
        labels = [f"{w} ({final_shares[w]:.0%} at the end)" if isinstance(final_shares.get(w), (int, float))
                  else w for w in names]
        if len(times) == 1:  # one instant: a stack of bars says more than a line of zero length
            bottom = 0.0
            for w, label in zip(names, labels):
                ax_share.bar(times, shares[w], bottom=bottom, width=0.05 * max(1.0, times[0]), label=label,
                             color=colors[w])
                bottom += shares[w][0]
        else:
            ax_share.stackplot(times, *(shares[w] for w in names), labels=labels,
                               colors=[colors[w] for w in names], alpha=0.8)
        for w in names:
            drawn["update shares"][w] = len(times)
    for ax, panel, ylabel in ((ax_loss, "loss", "loss"), (ax_metric, "test metric", metric),
                              (ax_rate, "throughput", "samples/s"),
                              (ax_share, "update shares", "share of updates")):
        ax.set_title(panel, fontsize=10)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn[panel]:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "no reports", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax_share.set_ylim(0, 1)
    ax_share.set_xlabel("wall time since training began (s)")
    fig.suptitle(title or _title(data))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf"))


def _title(data: dict[str, Any]) -> str:
    return f"{data.get('job', 'job')} ({data.get('consistency', '?')}, {data.get('policy', '?')})"


__all__ = ["MARKERS_UP_TO", "MIN_RATE_INTERVAL_S", "PANELS", "plot_report", "throughput", "update_shares"]
