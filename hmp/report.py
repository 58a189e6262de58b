"""The run report: per-worker progress over time, final figures, JSON plus a PNG plot.

docs/report.md describes every key of ``report.json`` (docs/report.schema.json: the same as a JSON
Schema); :data:`SCHEMA_VERSION` is that page's version."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

#: the version of report.json's keys (docs/report.md): raised when a key is removed or renamed or its type or
#: meaning changes, not when a key is added
SCHEMA_VERSION = 1

#: how a job ended (``final.status``): its stop rules ended it (``completed``), the launcher's timeout passed
#: (``timeout``), it failed (``failed``), or it was stopped before it finished (``interrupted``: Ctrl-C, SIGTERM)
STATUSES = ("completed", "timeout", "failed", "interrupted")

from hmp.plots import plot_report


@dataclasses.dataclass
class RunReport:
    """Collected by the scheduler from workers' reports. Times are seconds since training began."""

    job: str
    config: str
    consistency: str
    policy: str
    workers: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    final: dict[str, Any] = dataclasses.field(default_factory=dict)
    sharding: dict[str, Any] = dataclasses.field(default_factory=dict)
    pipeline: dict[str, Any] = dataclasses.field(default_factory=dict)  # [placement] jobs: plans, stage rates
    rings: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # allreduce jobs: each ring generation
    #: who was lost, left, failed, rejoined or restarted while the job ran: ``{node, event, t, why}``, oldest first
    membership: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: examples handed out again because the worker holding them was gone (first-come-first-served jobs)
    work_redone: int = 0
    #: PS shards restarted while the job ran (``--resume``): ``{node, t, pid, was_pid, address, was_address,
    #: version_before, resumed_version, updates_lost}``; ``version_before`` is its version before the crash as last
    #: known (its heartbeats, the workers' last replies from it), ``resumed_version`` its checkpoint's, ``updates_lost`` the difference
    #: (None until the restarted shard's first heartbeat)
    shard_restarts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: (``[ps] replicas = 2``) primary shards lost while the job ran, each failed over to its backup:
    #: ``{shard, t, detected_after_s, promoted, promote_s, epoch}``; ``promoted`` maps each chunk group (named by the
    #: shard that first held it) to the shard now primary for it, ``detected_after_s`` is the silence that declared it
    #: lost, ``promote_s`` the time from then until every promoted shard had taken over (None until they answered)
    shard_failovers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: (``[ps] replicas = 2``) chunk groups that had no backup for a while (no live shard to hold one):
    #: ``{group, primary, from_t, until_t}`` (``until_t`` None: unreplicated until the end)
    unreplicated: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: each ``--resume`` that continued this run: ``{at, from, elapsed_s, epoch, cursor}`` (``at``: UTC time of the
    #: resume; ``from``: the scheduler state file; the rest: where the previous part had got). Times in the report
    #: run on across the parts: a resumed part's ``t`` starts at the previous part's ``elapsed_s``.
    resumes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def state(self) -> dict[str, Any]:
        """Everything collected so far, as plain data (JSON): what a resumed scheduler continues from
        (:meth:`from_state`)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any], **override: Any) -> RunReport:
        """The report :meth:`state` saved (``override``: fields to replace, e.g. the config's path)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in state.items() if k in names}, **override})

    def _worker(self, worker_id: str) -> dict[str, Any]:
        return self.workers.setdefault(worker_id, {"series": [], "final": {}})

    def add_sample(self, worker_id: str, t: float, metrics: dict[str, float]) -> None:
        self._worker(worker_id)["series"].append({"t": round(t, 4), **metrics})

    def finish_worker(self, worker_id: str, metrics: dict[str, float]) -> None:
        self._worker(worker_id)["final"] = dict(metrics)

    def latest(self) -> dict[str, dict[str, float]]:
        return {w: (d["series"][-1] if d["series"] else {}) for w, d in self.workers.items()}

    def summary(self) -> dict[str, Any]:
        # A worker that left without a final report (lost, or left early) counts with its last
        # progress report, in the total as in its own share, so the shares sum to 1.
        last = {w: d["final"] or (d["series"][-1] if d["series"] else {}) for w, d in self.workers.items()}
        total_updates = sum(f.get("updates", 0) for f in last.values()) or 1
        out = {}
        for w, d in self.workers.items():
            f = last[w]
            out[w] = {"updates": f.get("updates", 0), "samples": f.get("samples", 0),
                      "samples_per_s": f.get("samples_per_s", 0.0), "bytes_out": f.get("bytes_out", 0),
                      "bytes_in": f.get("bytes_in", 0), "busy_fraction": f.get("busy_fraction", 0.0),
                      "update_share": f.get("updates", 0) / total_updates, "batch_size": f.get("batch_size", 0),
                      "batch_size_over_time": batch_size_changes(d["series"])}
        return out

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "job": self.job, "config": self.config, "consistency": self.consistency, "policy": self.policy,
                "final": self.final, "sharding": self.sharding, "pipeline": self.pipeline, "rings": self.rings,
                "membership": self.membership, "work_redone": self.work_redone,
                "shard_restarts": self.shard_restarts, "shard_failovers": self.shard_failovers,
                "unreplicated": self.unreplicated, "ran_unreplicated": bool(self.unreplicated),
                "resumed": self.resumes,
                "workers": self.summary(),
                "series": {w: d["series"] for w, d in self.workers.items()}}


def batch_size_changes(points: list[dict[str, Any]]) -> list[list[float]]:
    """``[[t, batch_size], ...]`` at the first report and wherever the batch size changed (the policy resized it)."""
    out: list[list[float]] = []
    for p in points:
        if "batch_size" in p and (not out or out[-1][1] != p["batch_size"]):
            out.append([p["t"], p["batch_size"]])
    return out


def write_report(report: RunReport, out_dir: Path, plot: bool = True) -> tuple[Path, Path | None]:
    """Write ``report.json`` and, with ``plot``, ``loss.png`` into ``out_dir`` (created); returns both paths
    (the plot's None without one)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = report.to_json()
    jpath, ppath = out_dir / "report.json", out_dir / "loss.png"
    tmp = jpath.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(jpath)
    if not plot:
        return jpath, None
    draw(data, ppath)
    return jpath, ppath


def draw(data: dict[str, Any], path: Path) -> None:
    """``loss.png`` of a report's JSON."""
    plot_report(data, path, f"{data['job']}: loss, test metric, throughput and update shares "
                            f"({data['consistency']}, {data['policy']})")


def main(argv: list[str] | None = None) -> int:
    """``python -m hmp.report RUN_DIR``: draw ``loss.png`` from the run's ``report.json`` (for a job that ran
    with ``[job] plot = false``)."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m hmp.report RUN_DIR  (the folder holding report.json)", file=sys.stderr)
        return 2
    run_dir = Path(args[0])
    try:
        data = json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError) as exc:
        print(f"hmp.report: cannot read {run_dir / 'report.json'}: {exc}", file=sys.stderr)
        return 2
    draw(data, run_dir / "loss.png")
    print(run_dir / "loss.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
