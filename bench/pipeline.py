"""Planned pipeline vs data parallel for the click model on this machine.

    python bench/pipeline.py [--config conf/click_pipeline.toml] [--json]

Runs the config as the scheduler plans it (a pipeline of stages over the workers, parameters on
the PS), then the same model, data, optimizer, batch size and processes as a data-parallel job
(``[placement] enabled = false``: every worker trains the whole model and pushes to the PS).
Throughput: pipeline, the samples/s through the last stage under the last plan (what the run
report measures); data parallel, the sum over workers of samples per second of training. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hmp.cluster import LocalCluster  # noqa: E402


def variant(config: Path, out: Path, *, pipeline: bool) -> Path:
    """The config with placement on or off and its own report dir."""
    text = config.read_text()
    text = re.sub(r"(?m)^enabled = \w+", f"enabled = {'true' if pipeline else 'false'}", text)
    text = re.sub(r'(?m)^report_dir = .*$', f'report_dir = "{out}"', text)
    path = out.parent / f"{out.name}.toml"
    path.write_text(text)
    return path


async def run(path: Path) -> dict:
    async with LocalCluster(path) as cluster:
        return await cluster.train(timeout_s=180)


def pipeline_figures(report: dict) -> dict:
    last = report["pipeline"]["plans"][-1]
    return {"samples_per_s": last["measured"][-1]["samples_per_s"],
            "predicted_samples_per_s": last["predicted_throughput"],
            "stages": [{"layers": s["layers"], "resource": s["resource"], "workers": s["workers"],
                        "predicted": round(s["predicted_samples_per_s"]), "measured": round(m["samples_per_s"]),
                        "compute_only": round(m["compute_samples_per_s"])}
                       for s, m in zip(last["stages"], last["measured"])],
            "cost": last["cost"], "test_accuracy": report["final"]["test_accuracy"],
            "elapsed_s": report["final"]["elapsed_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "conf/click_pipeline.toml"))
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hmp-bench-pipeline-") as tmp:
        tmpd = Path(tmp)
        pipe = pipeline_figures(asyncio.run(run(variant(Path(args.config), tmpd / "pipeline", pipeline=True))))
        dp_report = asyncio.run(run(variant(Path(args.config), tmpd / "data_parallel", pipeline=False)))
    dp = {"samples_per_s": sum(w["samples_per_s"] for w in dp_report["workers"].values()),
          "workers": len(dp_report["workers"]), "test_accuracy": dp_report["final"]["test_accuracy"],
          "elapsed_s": dp_report["final"]["elapsed_s"]}
    result = {"bench": "pipeline", "config": args.config, "pipeline": pipe, "data_parallel": dp,
              "pipeline_over_data_parallel": pipe["samples_per_s"] / dp["samples_per_s"]}
    if not args.json:
        print(f"pipeline      {pipe['samples_per_s']:9.0f} samples/s (cost model predicted "
              f"{pipe['predicted_samples_per_s']:.0f}), test accuracy {pipe['test_accuracy']:.3f}")
        for s in pipe["stages"]:
            print(f"  layers {s['layers'][0]}-{s['layers'][1]} on {s['resource']} {s['workers']}: predicted "
                  f"{s['predicted']}, measured {s['measured']}, compute only {s['compute_only']} samples/s")
        print(f"data parallel {dp['samples_per_s']:9.0f} samples/s on {dp['workers']} workers, test accuracy "
              f"{dp['test_accuracy']:.3f}")
        print(f"ratio pipeline / data parallel: {result['pipeline_over_data_parallel']:.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
