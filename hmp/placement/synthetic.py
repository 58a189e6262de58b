"""Seeded random placement problems for tests and the benchmark (synthetic, not measured).

A problem looks like a recommendation/ranking model: a few sparse layers (embedding lookups: slow
everywhere, barely faster on a GPU), then dense layers (fast on GPUs) interleaved with cheap
elementwise ones. Resource types are a CPU worker plus up to three GPU models with list-like
prices. The throughput constraint is drawn around what the largest homogeneous pool can sustain,
so that some problems need mixed plans and some homogeneous plans are infeasible.
"""

from __future__ import annotations

import numpy as np

from hmp.placement.problem import LayerProfile, PlacementProblem, ResourceType

# name, price $/h, count range, speed-up range per kind (sparse, dense, elementwise), overhead s
_CATALOGUE = (
    ("cpu", 0.17, (16, 64), {"sparse": (1, 1), "dense": (1, 1), "elementwise": (1, 1)}, 0.0),
    ("gpu_t4", 0.53, (2, 12), {"sparse": (0.3, 1.0), "dense": (4, 10), "elementwise": (2, 5)}, 2e-4),
    ("gpu_v100", 2.48, (2, 8), {"sparse": (0.4, 1.2), "dense": (10, 25), "elementwise": (4, 10)}, 1e-4),
    ("gpu_a100", 3.67, (1, 6), {"sparse": (0.5, 1.5), "dense": (20, 50), "elementwise": (8, 20)}, 1e-4),
)


def _log_uniform(rng: np.random.Generator, lo: float, hi: float, size=None):
    return np.exp(rng.uniform(np.log(lo), np.log(hi), size))


def random_problem(seed: int, n_layers: int | None = None, n_resources: int | None = None) -> PlacementProblem:
    """A reproducible synthetic problem: 4-40 layers and 2-4 resource types unless given."""
    rng = np.random.default_rng(seed)
    L = int(n_layers if n_layers is not None else rng.integers(4, 41))
    R = int(n_resources if n_resources is not None else rng.integers(2, 5))
    if not (1 <= L and 1 <= R <= len(_CATALOGUE)):
        raise ValueError(f"expected n_layers >= 1 and 1 <= n_resources <= {len(_CATALOGUE)}, got {L}, {R}")
    gpus = sorted(rng.choice(np.arange(1, len(_CATALOGUE)), size=R - 1, replace=False)) if R > 1 else []
    chosen = [_CATALOGUE[0]] + [_CATALOGUE[i] for i in gpus]

    n_sparse = int(min(rng.integers(0, 4), max(L - 1, 0)))
    kinds = ["sparse"] * n_sparse
    while len(kinds) < L:
        kinds.append("dense" if (not kinds or kinds[-1] != "dense" or rng.random() < 0.3) else "elementwise")
    batch = int(rng.choice([256, 512, 1024, 2048]))

    cpu_time = {
        "sparse": lambda: _log_uniform(rng, 5e-3, 8e-2),
        "dense": lambda: _log_uniform(rng, 2e-3, 6e-2),
        "elementwise": lambda: _log_uniform(rng, 2e-4, 4e-3),
    }
    resources = []
    scales = []
    for name, price, (lo, hi), speed, overhead in chosen:
        resources.append(
            ResourceType(name=name, price_per_hour=price, count=int(rng.integers(lo, hi + 1)), measured=False, overhead_s=overhead)
        )
        scales.append({k: float(_log_uniform(rng, *v)) if v[0] != v[1] else float(v[0]) for k, v in speed.items()})

    layers = []
    for i, kind in enumerate(kinds):
        base = float(cpu_time[kind]())
        times = {}
        for res, sc in zip(resources, scales):
            noise = 1.0 if res.name == "cpu" else float(_log_uniform(rng, 0.7, 1.4))
            times[res.name] = base / sc[kind] * noise + res.overhead_s
        out = int(_log_uniform(rng, 2**16, 2**26)) if kind != "sparse" else int(_log_uniform(rng, 2**18, 2**25))
        params = {"sparse": _log_uniform(rng, 1e8, 1e10), "dense": _log_uniform(rng, 1e5, 1e8), "elementwise": 0}[kind]
        layers.append(LayerProfile(name=f"{i}:{kind}", kind=kind, time_s=times, out_bytes=out, param_bytes=int(params)))

    # Throughput the largest homogeneous pool sustains with every worker, ignoring transfers.
    T = np.array([[lay.time_s[r.name] for r in resources] for lay in layers])
    pool = max(r.count * batch / T[:, j].sum() for j, r in enumerate(resources))
    min_thr = float(pool * rng.uniform(0.25, 1.3))
    bandwidth = float(_log_uniform(rng, 1.25e9, 2.5e10))
    return PlacementProblem(
        layers=tuple(layers),
        resources=tuple(resources),
        batch_size=batch,
        samples_to_train=1e9,
        min_throughput=min_thr,
        bandwidth_bytes_per_s=bandwidth,
        name=f"random-{seed}-L{L}-R{R}",
    )
