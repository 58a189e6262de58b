"""The placement settings a job gives (a ``[placement]``-like mapping), validated.

:func:`parse_spec` turns a plain mapping (a TOML table, a dict in a test or a benchmark) into a
:class:`PlacementSpec`, the resource types and the training demand, checking every key and naming
the bad one (:class:`hmp.errors.ConfigError` with ``path``, else ``ValueError``). The accepted keys
are in docs/placement.md, "Config mapping".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hmp.config import WORKER_ROLES, Config
from hmp.errors import ConfigError
from hmp.placement.problem import ResourceType

#: Keys of the runtime's ``[placement]`` table that the planner does not read.
RUNTIME_KEYS = frozenset({"enabled", "planner", "min_gain", "join_wait_s", "use_spare_workers", "overlap_push"})
_TOP_KEYS = frozenset(
    {"resources", "bandwidth_bytes_per_s", "samples", "min_throughput", "batch_size", "reps", "profile_repeats", "warmup",
     "num_threads", "message_overhead_s", "micro_batches"}
)
#: Seconds of fixed cost per message crossing a stage boundary on this runtime (hmp over ZeroMQ on
#: loopback, Python on both ends): the one-way cost of a small ``activations`` message, measured
#: with ``python bench/pipeline.py --message-overhead`` on the 2-core development machine (half a
#: request round trip; docs/placement.md, "Cost model"). A link between hosts adds its latency on top.
DEFAULT_MESSAGE_OVERHEAD_S = 120e-6
_RESOURCE_KEYS = frozenset({"name", "price_per_hour", "count", "speed_scale", "measured", "device", "overhead_s", "times_s"})
LAYER_KINDS = ("sparse", "dense", "elementwise")


@dataclass(frozen=True)
class PlacementSpec:
    """Validated placement settings.

    Attributes:
        resources: the resource types; a type with ``measured=False`` carries its ``speed_scale``.
        external_times_s: per-layer seconds per batch, by type name, for types measured elsewhere.
        batch_size, samples_to_train, min_throughput, bandwidth_bytes_per_s: the demand (see
            :class:`~hmp.placement.problem.PlacementProblem`).
        reps: timed forward+backward passes per layer (the median is kept).
        warmup: untimed passes before them.
        num_threads: torch intra-op threads while profiling; None keeps the current setting.
        message_overhead_s: fixed seconds per message across a stage boundary (see
            :class:`~hmp.placement.problem.PlacementProblem`).
        micro_batches: messages each way per boundary per batch (the runtime's micro-batches).
    """

    resources: tuple[ResourceType, ...]
    external_times_s: Mapping[str, tuple[float, ...]]
    batch_size: int
    samples_to_train: float
    min_throughput: float
    bandwidth_bytes_per_s: float
    reps: int = 5
    warmup: int = 2
    num_threads: int | None = None
    message_overhead_s: float = DEFAULT_MESSAGE_OVERHEAD_S
    micro_batches: int = 1


def _error(path: str | None, key: str, expected: str) -> Exception:
    return ConfigError(path, key, expected) if path is not None else ValueError(f"placement config: key {key!r}: {expected}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def device_available(device: str) -> bool:
    """Whether torch can run on ``device`` here (``cpu``, ``cuda``, ``cuda:N``, ``mps``)."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        return False
    if d.type == "cpu":
        return True
    if d.type == "cuda":
        return torch.cuda.is_available() and (d.index is None or d.index < torch.cuda.device_count())
    if d.type == "mps":
        return torch.backends.mps.is_available()
    return False


def _parse_resource(
    entry: object, k: str, path: str | None, counts: Mapping[str, int] | None
) -> tuple[ResourceType, tuple[float, ...] | None]:
    if not isinstance(entry, Mapping):
        raise _error(path, k, f"a table with name, price_per_hour, count, ...; got {entry!r}")
    unknown = sorted(set(entry) - _RESOURCE_KEYS)
    if unknown:
        raise _error(path, f"{k}.{unknown[0]}", f"unknown key; expected one of {sorted(_RESOURCE_KEYS)}")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise _error(path, f"{k}.name", f"a non-empty string, got {name!r}")
    price = entry.get("price_per_hour")
    if not _number(price) or price < 0:
        raise _error(path, f"{k}.price_per_hour", f"a number >= 0 (dollars per worker-hour), got {price!r}")
    count = counts.get(name, entry.get("count")) if counts is not None else entry.get("count")
    if not _int(count) or count < 0:
        raise _error(path, f"{k}.count", f"an integer >= 0 (workers available; or pass counts), got {count!r}")
    default_device = "cuda" if any(tag in name.lower() for tag in ("gpu", "cuda")) else "cpu"
    device = entry.get("device", default_device)
    if not isinstance(device, str):
        raise _error(path, f"{k}.device", f"a torch device string such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise _error(path, f"{k}.device", f"a torch device string such as 'cpu' or 'cuda:0', got {device!r}") from None
    overhead = entry.get("overhead_s", 0.0)
    if not _number(overhead) or overhead < 0:
        raise _error(path, f"{k}.overhead_s", f"a number >= 0 (seconds per layer per batch), got {overhead!r}")
    scale = entry.get("speed_scale", 1.0)
    if isinstance(scale, Mapping):
        for kind, factor in scale.items():
            if kind not in (*LAYER_KINDS, "default"):
                raise _error(path, f"{k}.speed_scale.{kind}", f"a layer kind, one of {[*LAYER_KINDS, 'default']}")
            if not _number(factor) or factor <= 0:
                raise _error(path, f"{k}.speed_scale.{kind}", f"a number > 0 (times faster than cpu), got {factor!r}")
    elif not _number(scale) or scale <= 0:
        raise _error(path, f"{k}.speed_scale", f"a number > 0 or a table {{kind: factor}}, got {scale!r}")
    times = entry.get("times_s")
    if times is not None:
        if not isinstance(times, (list, tuple)) or not times or not all(_number(t) and t > 0 for t in times):
            raise _error(path, f"{k}.times_s", f"a non-empty list of numbers > 0 (seconds per batch per layer), got {times!r}")
        times = tuple(float(t) for t in times)
    measured = entry.get("measured", "auto")
    if measured not in (True, False, "auto"):
        raise _error(path, f"{k}.measured", f"true, false or \"auto\", got {measured!r}")
    if measured == "auto":
        measured = times is None and device_available(device)
    if measured and times is not None:
        raise _error(path, f"{k}.times_s", "only for a type with measured = false (times measured elsewhere)")
    if measured and not device_available(device):
        raise _error(path, f"{k}.measured", f"false (with speed_scale or times_s): device {device!r} is not available here")
    if not measured and times is None and "speed_scale" not in entry:
        raise _error(path, f"{k}.speed_scale", "required for a type that is not measured here (or give times_s)")
    source = "" if measured else ("times from config" if times is not None else "scaled from cpu by speed_scale")
    res = ResourceType(
        name=name,
        price_per_hour=float(price),
        count=int(count),
        speed_scale=dict(scale) if isinstance(scale, Mapping) else float(scale),
        measured=bool(measured),
        device=device,
        overhead_s=float(overhead),
        source=source,
    )
    return res, times


def parse_spec(config: Mapping[str, object], *, path: str | None = None, counts: Mapping[str, int] | None = None, prefix: str = "placement") -> PlacementSpec:
    """Validate a placement mapping (see the module docstring) into a :class:`PlacementSpec`.

    Args:
        config: the mapping.
        path: the config file it came from; errors are then ``ConfigError(path, key, expected)``.
        counts: workers available per type name; overrides (or supplies) each resource's ``count``.
        prefix: prepended to key names in errors (``placement.resources[1].count``).
    """
    pre = f"{prefix}." if prefix else ""
    if not isinstance(config, Mapping):
        raise _error(path, prefix or "placement", f"a table of placement settings, got {type(config).__name__}")
    unknown = sorted(set(config) - _TOP_KEYS - RUNTIME_KEYS)
    if unknown:
        raise _error(path, pre + unknown[0], f"unknown key; expected one of {sorted(_TOP_KEYS)}")
    entries = config.get("resources")
    if not isinstance(entries, (list, tuple)) or not entries:
        raise _error(path, pre + "resources", "a non-empty list of resource tables")
    resources, external = [], {}
    for i, entry in enumerate(entries):
        res, times = _parse_resource(entry, f"{pre}resources[{i}]", path, counts)
        if res.name in {r.name for r in resources}:
            raise _error(path, f"{pre}resources[{i}].name", f"a unique name; {res.name!r} appears twice")
        resources.append(res)
        if times is not None:
            external[res.name] = times
    if counts is not None:
        extra = sorted(set(counts) - {r.name for r in resources})
        if extra:
            raise _error(path, pre + "resources", f"a resource table for every counted type; missing {extra}")
    scaled = [r.name for r in resources if not r.measured and r.name not in external]
    if scaled and not any(r.measured and torch.device(r.device).type == "cpu" for r in resources):
        raise _error(path, pre + "resources", f"a measured cpu type: {scaled} are scaled from the cpu reference")
    if not any(r.measured for r in resources) and not external:
        raise _error(path, pre + "resources", "at least one type measured here or with times_s")

    def positive(key: str, what: str) -> float:
        v = config.get(key)
        if not _number(v) or v <= 0:
            raise _error(path, pre + key, f"a number > 0 ({what}), got {v!r}")
        return float(v)

    batch = config.get("batch_size")
    if not _int(batch) or batch < 1:
        raise _error(path, pre + "batch_size", f"an integer >= 1 (samples per batch), got {batch!r}")
    reps_key = "reps" if "reps" in config else "profile_repeats"
    reps = config.get(reps_key, 5)
    if not _int(reps) or reps < 1:
        raise _error(path, pre + reps_key, f"an integer >= 1 (timed passes per layer), got {reps!r}")
    warmup = config.get("warmup", 2)
    if not _int(warmup) or warmup < 0:
        raise _error(path, pre + "warmup", f"an integer >= 0 (untimed passes per layer), got {warmup!r}")
    overhead = config.get("message_overhead_s", DEFAULT_MESSAGE_OVERHEAD_S)
    if not _number(overhead) or overhead < 0:
        raise _error(path, pre + "message_overhead_s", f"a number >= 0 (seconds per message across a stage boundary), got {overhead!r}")
    micro = config.get("micro_batches", 1)
    if not _int(micro) or micro < 1:
        raise _error(path, pre + "micro_batches", f"an integer >= 1 (messages each way per boundary per batch), got {micro!r}")
    if batch % micro:
        raise _error(path, pre + "micro_batches", f"a divisor of batch_size {batch}, got {micro!r}")
    threads = config.get("num_threads")
    if threads is not None and (not _int(threads) or threads < 1):
        raise _error(path, pre + "num_threads", f"an integer >= 1 (torch threads while profiling), got {threads!r}")
    return PlacementSpec(
        resources=tuple(resources),
        external_times_s=external,
        batch_size=int(batch),
        samples_to_train=positive("samples", "samples to train"),
        min_throughput=positive("min_throughput", "samples per second"),
        bandwidth_bytes_per_s=positive("bandwidth_bytes_per_s", "link bytes per second"),
        reps=int(reps),
        warmup=int(warmup),
        num_threads=None if threads is None else int(threads),
        message_overhead_s=float(overhead),
        micro_batches=int(micro),
    )


def worker_counts(cfg: Config) -> dict[str, int]:
    """Configured workers per ``[placement]`` resource type (a worker's ``resource``, default its role)."""
    counts: dict[str, int] = {}
    for n in cfg.workers:
        counts[n.resource or n.role] = counts.get(n.resource or n.role, 0) + 1
    return counts


def spec_table(cfg: Config, samples: float = 1.0) -> dict[str, Any]:
    """``[placement]`` as the mapping :func:`parse_spec` validates and the profiler reads: the table's
    planner keys plus the demand the job gives elsewhere (``train.batch_size``; ``samples``: epochs
    times the training set, known once the data is loaded). It sets no ``num_threads``: the
    scheduler profiles with its own process's thread count (``[[nodes]] threads``, like the
    workers' by default), set once at start."""
    pl = cfg.placement
    table: dict[str, Any] = {
        "resources": [dict(r) if isinstance(r, dict) else r for r in pl.resources],
        "bandwidth_bytes_per_s": pl.bandwidth_bytes_per_s, "message_overhead_s": pl.message_overhead_s,
        "min_throughput": pl.min_throughput, "micro_batches": pl.micro_batches, "profile_repeats": pl.profile_repeats,
        "batch_size": cfg.train.batch_size, "samples": samples,
    }
    return table


def check_config(cfg: Config) -> None:
    """``[placement]``'s planner keys (resources, link, demand), by :func:`parse_spec`, which names the
    bad key; every worker's resource type declared. (The runtime's keys: :mod:`hmp.config`.)"""
    p, pl = cfg.path, cfg.placement
    if not pl.enabled:
        return
    names = [r.get("name") for r in pl.resources if isinstance(r, dict)]
    counts = worker_counts(cfg)
    parse_spec(spec_table(cfg), path=p, counts={n: counts.get(n, 0) for n in names if isinstance(n, str)})
    for i, n in enumerate(cfg.nodes):
        if n.role in WORKER_ROLES and (n.resource or n.role) not in names:
            raise ConfigError(p, f"nodes[{i}].resource", f"one of the [placement] resources {names}, got "
                                                         f"{n.resource or n.role!r}")
