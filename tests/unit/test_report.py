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


def test_the_figure_draws_every_report_point_of_a_one_second_job(tmp_path):
    """Loss, throughput per worker and update shares, each worker's every report point, from the JSON the
    report writes; a final report milliseconds after the last one does not make a rate of its own."""
    from hmp.plots import PANELS, plot_report, throughput

    report = RunReport(job="j", config="c.toml", consistency="async", policy="static")
    for t, samples, updates, loss in ((0.3, 300, 20, 2.0), (0.6, 700, 45, 1.2), (0.9, 1000, 65, 0.8)):
        report.add_sample("gpu0", t, {"samples": samples, "updates": updates, "loss": loss,
                                      "samples_per_s": samples / t})
        report.add_sample("cpu0", t + 0.05, {"samples": samples // 10, "updates": updates // 4, "loss": loss + 0.5,
                                             "test_loss": loss + 0.2, "test_accuracy": 1 - loss / 4,
                                             "samples_per_s": samples / 10 / (t + 0.05)})
    report.add_sample("gpu0", 0.901, {"samples": 1001, "updates": 66, "loss": 0.8})
    report.finish_worker("gpu0", {"updates": 66, "samples": 1001})
    report.finish_worker("cpu0", {"updates": 16, "samples": 100})
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    drawn = plot_report(data, tmp_path / "figure.png")
    assert list(drawn) == list(PANELS)
    assert drawn["loss"] == {"gpu0": 4, "cpu0": 3, "cpu0 test loss": 3}
    assert drawn["test metric"] == {"cpu0 test_accuracy": 3}  # the evaluating worker's curve
    assert drawn["throughput"] == {"gpu0": 3, "cpu0": 3}
    assert drawn["update shares"] == {"gpu0": 7, "cpu0": 7}  # at each of the 7 report times
    assert (tmp_path / "figure.png").stat().st_size > 10_000
    rates = throughput(data["series"]["gpu0"])
    assert [t for t, _ in rates] == [0.3, 0.6, 0.9]
    assert rates[0][1] == 1000 and abs(rates[1][1] - 400 / 0.3) < 1e-6


def test_the_figure_of_a_report_without_points_says_so(tmp_path):
    from hmp.plots import plot_report

    drawn = plot_report(RunReport(job="j", config="c", consistency="sync", policy="static").to_json(),
                        tmp_path / "empty.png")
    assert drawn == {"loss": {}, "test metric": {}, "throughput": {}, "update shares": {}}
    assert (tmp_path / "empty.png").stat().st_size > 1000


def test_without_plot_only_report_json_is_written_and_python_m_hmp_report_draws_it_later(tmp_path, capsys):
    from hmp.report import main

    report = RunReport(job="j", config="c.toml", consistency="sync", policy="static")
    report.add_sample("cpu0", 0.5, {"updates": 5, "loss": 2.0, "batch_size": 16})
    report.add_sample("cpu0", 1.0, {"updates": 10, "loss": 1.0, "batch_size": 16})
    report.finish_worker("cpu0", {"updates": 10, "samples": 160, "samples_per_s": 20.0, "busy_fraction": 0.5,
                                  "batch_size": 16})
    jpath, ppath = write_report(report, tmp_path, plot=False)
    assert jpath.exists() and ppath is None and not (tmp_path / "loss.png").exists()
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    capsys.readouterr()
    assert main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "cannot read" in err and str(tmp_path / "nowhere" / "report.json") in err
