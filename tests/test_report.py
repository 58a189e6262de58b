"""The run report's per-worker metrics and its loss plot, without a cluster."""

from __future__ import annotations

import json

from hmp.report import RunReport, batch_size_changes, write_report


def test_report_has_every_per_worker_metric_and_batch_size_over_time(tmp_path):
    report = RunReport(job="j", config="c.toml", consistency="async", policy="adaptive")
    for t, batch in ((0.5, 16), (1.0, 16), (1.5, 40), (2.0, 40), (2.5, 32)):
        report.add_sample("gpu0", t, {"updates": t * 10, "loss": 1.0 / t, "batch_size": batch, "samples_per_s": 100.0,
                                      "busy_fraction": 0.5})
    report.add_sample("cpu0", 0.5, {"updates": 5, "loss": 2.0, "test_loss": 1.5, "batch_size": 16})
    report.finish_worker("gpu0", {"updates": 30, "samples": 900, "samples_per_s": 100.0, "busy_fraction": 0.5,
                                  "batch_size": 32})
    report.finish_worker("cpu0", {"updates": 10, "samples": 160, "samples_per_s": 20.0, "busy_fraction": 0.25,
                                  "batch_size": 16})
    jpath, ppath = write_report(report, tmp_path)
    workers = json.loads(jpath.read_text())["workers"]
    for key in ("updates", "update_share", "samples_per_s", "busy_fraction", "batch_size", "batch_size_over_time"):
        assert key in workers["gpu0"] and key in workers["cpu0"], key
    assert workers["gpu0"]["update_share"] == 0.75 and workers["cpu0"]["update_share"] == 0.25
    assert workers["gpu0"]["batch_size_over_time"] == [[0.5, 16], [1.5, 40], [2.5, 32]]
    assert ppath.stat().st_size > 1000


def test_batch_size_changes_skips_points_without_a_batch_size():
    assert batch_size_changes([]) == []
    assert batch_size_changes([{"t": 0.1}, {"t": 0.2, "batch_size": 8}, {"t": 0.3}, {"t": 0.4, "batch_size": 8}]) == [[0.2, 8]]


def test_update_shares_sum_to_one_when_a_worker_left_without_a_final_report():
    """A lost worker's share comes from its last progress report, in the total too."""
    report = RunReport(job="j", config="c.toml", consistency="async", policy="static")
    report.add_sample("cpu0", 1.0, {"updates": 30})
    report.finish_worker("cpu0", {"updates": 30})
    report.add_sample("gpu0", 1.0, {"updates": 10})
    report.finish_worker("gpu0", {})  # left without a done report
    shares = {w: s["update_share"] for w, s in report.summary().items()}
    assert shares == {"cpu0": 0.75, "gpu0": 0.25}
