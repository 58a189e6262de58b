"""Fit the cost model's constants to the measured Pollux step times (data/throughput, Apache-2.0).

The simulator's cost model (:mod:`hmp.gadget.model`) needs per-model compute and gradient sizes and
shared link constants that match real rings; this fits them by non-negative least squares to the
measured step times of ``<model>/placements.csv`` and keeps ``scalability.csv`` as an
out-of-sample check. The model fitted and the caveats are in docs/gadget.md, "Fit to the measured
Pollux step times".
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Sequence

import numpy as np
from scipy.optimize import nnls

from hmp.errors import ConfigError

from .interface import ClusterSpec
from .model import ModelType, NetworkConstants, RingCostModel, relative_error_summary, ring_factor

POLLUX_MODELS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")
#: the Pollux testbed's host link: 50 Gbit/s (data/throughput/README.md)
POLLUX_LINK_BYTES_S = 50e9 / 8
#: rho = intra-host / link bandwidth, searched on this grid (log-spaced 0.25 .. 64)
RHO_GRID = tuple(float(x) for x in np.geomspace(0.25, 64.0, 33))
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_THROUGHPUT_DIR = os.path.join(_ROOT, "data", "throughput")


@dataclasses.dataclass(frozen=True)
class StepRow:
    model: str
    gpus_per_node: tuple[int, ...]   # e.g. (1, 2, 3, 4) for placement "1234"
    local_bsz: int
    step_time: float
    sync_time: float

    @property
    def workers(self) -> int:
        return sum(self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return len(self.gpus_per_node)


@dataclasses.dataclass(frozen=True)
class FitError:
    rows: int
    median_relative_error: float
    p90_relative_error: float


@dataclasses.dataclass(frozen=True)
class ModelCoefficients:
    name: str
    compute_base_s: float          # c0
    compute_per_sample_s: float    # c1
    effective_grad_bytes: float    # G
    reference_local_bsz: int


@dataclasses.dataclass(frozen=True)
class ThroughputFit:
    link_bytes_s: float
    network: NetworkConstants
    coefficients: tuple[ModelCoefficients, ...]
    intra_to_link: float                     # rho
    placements_error: dict[str, FitError]    # per model, over placements.csv rows (fitted)
    scalability_error: dict[str, FitError]   # per model, over scalability.csv rows (not fitted)

    def model_types(self) -> tuple[ModelType, ...]:
        return tuple(ModelType(c.name, c.effective_grad_bytes,
                               c.compute_base_s + c.compute_per_sample_s * c.reference_local_bsz,
                               c.reference_local_bsz) for c in self.coefficients)

    def cost_model(self, cluster: ClusterSpec) -> RingCostModel:
        return RingCostModel(cluster, self.model_types(), self.network)

    def predict(self, row: StepRow) -> float:
        coef = {c.name: c for c in self.coefficients}[row.model]
        return _predict(coef, self.network, self.link_bytes_s, row.workers, row.nodes,
                        any(g >= 2 for g in row.gpus_per_node), row.local_bsz)


def _predict(coef: ModelCoefficients, net: NetworkConstants, link: float, workers: int, nodes: int,
             intra_hops: bool, local_bsz: int) -> float:
    t = coef.compute_base_s + coef.compute_per_sample_s * local_bsz
    if workers >= 2:
        bw = min(net.intra_host_bytes_s if intra_hops else np.inf, link * net.link_efficiency if nodes >= 2 else np.inf)
        t += ring_factor(workers) * coef.effective_grad_bytes / bw + 2 * (workers - 1) * net.hop_latency_s
    return float(t)


def _float(path: str, line: int, text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ConfigError(path, f"line {line} {what}", f"a number, got {text!r}") from None
    if not v >= 0:
        raise ConfigError(path, f"line {line} {what}", f"a number >= 0, got {text!r}")
    return v


def read_placements(model: str, directory: str = DEFAULT_THROUGHPUT_DIR) -> list[StepRow]:
    path = os.path.join(directory, model, "placements.csv")
    rows: list[StepRow] = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for r in reader:
            digits = r["placement"].strip()
            if not digits.isdigit() or "0" in digits:
                raise ConfigError(path, f"line {reader.line_num} placement", f"digits 1-9, got {digits!r}")
            rows.append(StepRow(model, tuple(int(c) for c in digits), int(r["local_bsz"]),
                                _float(path, reader.line_num, r["step_time"], "step_time"),
                                _float(path, reader.line_num, r["sync_time"], "sync_time")))
    return rows


@dataclasses.dataclass(frozen=True)
class ScaleRow:
    model: str
    nodes: int
    workers: int
    local_bsz: int
    step_time: float


def read_scalability(model: str, directory: str = DEFAULT_THROUGHPUT_DIR) -> list[ScaleRow]:
    path = os.path.join(directory, model, "scalability.csv")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return [ScaleRow(model, int(r["num_nodes"]), int(r["num_replicas"]), int(r["local_bsz"]),
                         _float(path, reader.line_num, r["step_time"], "step_time")) for r in reader]


def _design(rows: Sequence[StepRow], models: Sequence[str], rho: float, link: float) -> tuple[np.ndarray, np.ndarray]:
    """Weighted (1/step_time) design matrix: per model [c0, c1, G], then the shared latency."""
    col = {m: 3 * i for i, m in enumerate(models)}
    a = np.zeros((len(rows), 3 * len(models) + 1))
    y = np.zeros(len(rows))
    for i, r in enumerate(rows):
        j = col[r.model]
        a[i, j] = 1.0
        a[i, j + 1] = r.local_bsz
        if r.workers >= 2:
            bw = np.inf
            if any(g >= 2 for g in r.gpus_per_node):
                bw = rho * link
            if r.nodes >= 2:
                bw = min(bw, link)
            a[i, j + 2] = ring_factor(r.workers) / bw
            a[i, -1] = 2 * (r.workers - 1)
        a[i] /= r.step_time
        y[i] = 1.0
    return a, y


def fit_throughput(directory: str = DEFAULT_THROUGHPUT_DIR, models: Sequence[str] = POLLUX_MODELS,
                   link_bytes_s: float = POLLUX_LINK_BYTES_S, rho_grid: Sequence[float] = RHO_GRID) -> ThroughputFit:
    """Fit the cost model to every placements.csv row of ``models`` (see the module doc)."""
    data = {m: read_placements(m, directory) for m in models}
    rows = [r for m in models for r in data[m]]
    best: tuple[float, float, np.ndarray] | None = None
    for rho in rho_grid:
        a, y = _design(rows, models, rho, link_bytes_s)
        x, _ = nnls(a, y)
        sse = float(np.sum((a @ x - y) ** 2))
        if best is None or sse < best[0]:
            best = (sse, rho, x)
    assert best is not None
    _, rho, x = best
    network = NetworkConstants(intra_host_bytes_s=rho * link_bytes_s, hop_latency_s=float(x[-1]), link_efficiency=1.0)
    coefs = []
    for i, m in enumerate(models):
        grid = sorted({r.local_bsz for r in data[m]})
        coefs.append(ModelCoefficients(m, float(x[3 * i]), float(x[3 * i + 1]), float(x[3 * i + 2]),
                                       grid[len(grid) // 2]))
    fit = ThroughputFit(link_bytes_s, network, tuple(coefs), rho, {}, {})
    placements_error = {}
    scalability_error = {}
    for i, m in enumerate(models):
        errs = [abs(fit.predict(r) - r.step_time) / r.step_time for r in data[m]]
        med, p90 = relative_error_summary(errs)
        placements_error[m] = FitError(len(errs), med, p90)
        scale_rows = read_scalability(m, directory) if os.path.exists(os.path.join(directory, m, "scalability.csv")) else []
        if scale_rows:
            # every scalability row spans >= 6 nodes: link-bound, intra hops irrelevant when rho >= 1
            errs = [abs(_predict(coefs[i], network, link_bytes_s, s.workers, s.nodes, s.workers > s.nodes, s.local_bsz)
                        - s.step_time) / s.step_time for s in scale_rows]
            med, p90 = relative_error_summary(errs)
            scalability_error[m] = FitError(len(errs), med, p90)
    return dataclasses.replace(fit, placements_error=placements_error, scalability_error=scalability_error)
