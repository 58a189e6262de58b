"""Job topology and settings: TOML files loaded into frozen dataclasses.

The one place config is read. Every error names the file, the key and what was expected
(:class:`~hmp.errors.ConfigError`). Environment overrides are read in :func:`env_overrides` only
and listed in docs/config.md. Types and ranges are checked by hand, not by pydantic, for the
reasons in docs/architecture.md, "Libraries used, and hand-written code kept".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from hmp.errors import ConfigError



class Role(enum.StrEnum):
    """What a daemon of the topology is (``[[nodes]] role``)."""

    SCHEDULER = "scheduler"
    PS = "ps"
    CPU_WORKER = "cpu_worker"
    GPU_WORKER = "gpu_worker"
    #: a worker whose training loop is the user's own program (``hmp.Worker``, docs/own_loop.md): the
    #: scheduler expects it like any worker, the launcher does not start it
    USER_WORKER = "user_worker"


class Consistency(enum.StrEnum):
    """How PS shards order workers' updates (``[train] consistency``)."""

    ASYNC = "async"
    SYNC = "sync"
    SSP = "ssp"
    #: no PS: workers sum their gradients in a ring (docs/collective.md)
    ALLREDUCE = "allreduce"


class BatchPolicyKind(enum.StrEnum):
    """How the scheduler sizes workers' batches (``[train] policy``; docs/hogbatch.md)."""

    STATIC = "static"
    SYNC = "sync"
    HOGBATCH = "hogbatch"
    ADAPTIVE = "adaptive"


WORKER_ROLES = (Role.CPU_WORKER, Role.GPU_WORKER, Role.USER_WORKER)
#: ``[collective] algorithm``: hmp.collective.ring.ALGORITHMS (the ring's own list; a test keeps them equal)
ALLREDUCE_ALGORITHMS = ("auto", "ring", "halving")
#: ``[train] task``'s built-in names (hmp.train.task.BUILTIN_TASKS; a test keeps them equal)
TASK_NAMES = ("classification", "regression")
#: ``[data] kind``'s built-in loaders (hmp.data.LOADERS less the generator only benchmarks use)
DATA_KINDS = ("digits", "diabetes", "click", "synthetic", "svmlight", "npz")
#: hmp.placement.registry.PLANNERS' names (not imported here: the registry imports torch)
PLANNER_NAMES = ("bruteforce", "greedy", "random", "ga", "rl")


def _field(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    """One daemon of the topology."""

    id: str = _field("", "unique node id, e.g. 'ps0'")
    role: str = _field("", f"one of {', '.join(Role)}")
    host: str = _field("127.0.0.1", "host the launcher starts this daemon on: with hmp-launch --hosts, the name of an "
                                    "emulated host of the hosts file (docs/emulate.md); else unused (this machine)")
    bind: str = _field("tcp://127.0.0.1:0", "ZeroMQ address to bind (port 0: the OS picks one)")
    advertise: str = _field("", "address peers dial; empty: the bound address")
    device: str = _field("", "workers: 'cpu' or 'cuda[:N]'; empty: cpu for cpu_worker, cuda for gpu_worker")
    batch_size: int = _field(0, "workers: initial batch size; 0 takes [train] batch_size")
    threads: int = _field(1, "torch intra-op threads for this process (daemons share the cores)")
    hogwild_threads: int = _field(1, "cpu_worker: lock-free training threads on the local replica")
    resource: str = _field("", "workers, [placement] jobs: the resource type this worker is (a [placement] "
                               "resources name); empty: its role")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    name: str = _field("digits_mlp", "model factory: digits_mlp | click_model | deep_mlp | sparse_mlp (their args: docs/data.md), or "
                                     "an import path 'package.module:function' / 'path/to/file.py:function' (relative "
                                     "to the config file) returning a torch.nn.Module")
    args: dict = _field({}, "keyword arguments for the factory")
    seed: int = _field(0, "seed for the initial parameters (every node builds the same model)")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    kind: str = _field("digits", "digits | diabetes (scikit-learn's, float targets: train.task = \"regression\") | "
                                 "click | synthetic (generated, args: n, n_features, ...) | svmlight | npz (x of "
                                 "any shape [N, ...]) | an import path to a loader returning hmp.data.Dataset "
                                 "(docs/data.md)")
    path: str = _field("", "svmlight/npz: the file (relative paths: to the config file)")
    test_path: str = _field("", "svmlight: an optional separate test file")
    test_fraction: float = _field(0.2, "held-out fraction when the data has no test split")
    samples: int = _field(20000, "click: examples to generate")
    standardize: bool = _field(False, "scale each feature to mean 0, variance 1 with statistics of the training "
                                      "split only (dense data)")
    sparse: bool = _field(False, "svmlight: keep the features sparse (CSR rows, from file to batch) for a sparse-input "
                                 "model (docs/data.md); false makes them a dense matrix")
    targets: str = _field("", "svmlight/npz: what the labels are: classes (integer class labels, mapped to "
                              "0..C-1) | values (float targets as they are, never standardized) | empty: values "
                              "for train.task = \"regression\", else classes")
    args: dict = _field({}, "extra loader arguments")
    seed: int = _field(0, "split / generation seed")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = _field("sgd", "sgd | adam | adagrad (applied per chunk on the PS)")
    lr: float = _field(0.05, "learning rate")
    momentum: float = _field(0.0, "sgd momentum")
    nesterov: bool = _field(False, "sgd nesterov momentum")
    weight_decay: float = _field(0.0, "L2 weight decay")
    betas: list = _field([0.9, 0.999], "adam betas")
    eps: float = _field(1e-8, "adam/adagrad epsilon")
    schedule: str = _field("constant", "learning rate over a shard's updates: constant | step (times gamma every "
                                       "step_size updates) | cosine (to min_lr over total_steps); docs/optimizers.md")
    warmup_steps: int = _field(0, "schedule: the lr rises linearly from 0 over this many updates first")
    step_size: int = _field(1000, "schedule = \"step\": updates between decays")
    gamma: float = _field(0.1, "schedule = \"step\": the factor of each decay")
    total_steps: int = _field(0, "schedule = \"cosine\": updates from the end of warm-up to min_lr (required)")
    min_lr: float = _field(0.0, "schedule = \"cosine\": the final learning rate")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    consistency: str = _field("async", f"one of {', '.join(Consistency)}")
    staleness: int = _field(3, "ssp: how many updates a worker may run ahead of the slowest")
    batch_size: int = _field(32, "default batch size per worker")
    epochs: int = _field(20, "passes over each worker's data shard (upper bound)")
    target_accuracy: float = _field(0.0, "stop once the test accuracy reaches this (0: run all epochs)")
    target_loss: float = _field(0.0, "stop once worker 0's test loss falls to this (0: no loss target)")
    max_seconds: float = _field(600.0, "stop the job after this long (seconds)")
    eval_every_s: float = _field(1.0, "how often worker 0 measures test accuracy (seconds)")
    report_interval_s: float = _field(0.25, "how often workers report to the scheduler (seconds; the report's "
                                            "curves have a point per worker per report)")
    policy: str = _field("static", f"batch sizing: {' | '.join(BatchPolicyKind)}")
    policy_args: dict = _field({}, "policy knobs (see docs/hogbatch.md)")
    work_unit_batches: int = _field(4, "hogbatch/adaptive: batches per first-come-first-served work unit")
    min_workers: int = _field(1, "the job goes on while at least this many workers are live; a lost, hung or "
                                 "failed worker is dropped (its unfinished work goes back to the queue) instead "
                                 "of failing the job")
    task: str = _field("classification", "how a batch becomes a loss and how the model is scored (docs/task.md): "
                                         "classification (cross-entropy; test_accuracy, test_loss) | regression "
                                         "(mean squared error; r2, rmse, test_loss) | an import path "
                                         "'package.module:function' / 'path/to/file.py:function' (relative to the "
                                         "config file) to a function of your own, see task_kind")
    task_kind: str = _field("loss", "what the function train.task names is: loss ((output, target) -> batch-mean "
                                    "loss) | step ((model, (x, y)) -> batch-mean loss: the whole step, model call "
                                    "included)")
    task_score: str = _field("", "a task of your own: an import path to a scorer (model, (x, y)) -> {metric: "
                                 "number}, called on the whole test split; its metrics go into the report by name "
                                 "(empty: test_loss only)")
    target_metric: str = _field("", "stop once this evaluation metric (a key of report.json's final: "
                                    "test_accuracy, test_loss, r2, rmse, a scorer's) reaches train.target "
                                    "(empty: no such target)")
    target: float = _field(0.0, "target_metric's target value, reached when the metric is at least it (higher "
                                "is better) or at most it (lower is better; see target_mode)")
    target_mode: str = _field("auto", "auto (the metric's known direction: accuracy and r2 higher, loss, rmse and "
                                      "names ending in loss or error lower) | max (higher is better) | min")


@dataclasses.dataclass(frozen=True)
class PSConfig:
    chunk_bytes: int = _field(1 << 20, "parameter chunk size (bytes); chunks are spread over the shards")
    table_chunk_bytes: int = _field(8 << 20, "row-sparse tables' chunk size (bytes; 0: chunk_bytes): a sparse push "
                                             "or pull costs a little per table chunk it touches, so tables are cut "
                                             "coarser; keep a few chunks per shard for balance")
    checkpoint_every: int = _field(0, "checkpoint each shard every N updates (0: by time only, see "
                                      "checkpoint_every_s)")
    checkpoint_every_s: float = _field(30.0, "checkpoint each shard at least this often while it has new updates "
                                             "(seconds; 0: only by checkpoint_every and at shutdown)")
    checkpoint_dir: str = _field("", "where shards write checkpoints; empty: <report_dir>/checkpoints")
    reject_nonfinite: bool = _field(True, "shards refuse pushes holding NaN or infinite values (error "
                                          "non_finite) instead of applying them; costs one sum over each push")
    replicas: int = _field(1, "copies of each chunk: 2 keeps a backup on another shard, a push is acknowledged "
                              "once both applied it, and a lost primary's backup takes over (docs/resilience.md)")


@dataclasses.dataclass(frozen=True)
class CollectiveConfig:
    bucket_bytes: int = _field(25 << 20, "allreduce: gradients are summed in buckets of about this many bytes, in "
                                         "reverse parameter order, each as soon as backward has produced it")
    piece_bytes: int = _field(8 << 20, "allreduce: a bucket travels the ring in pieces of at most this many bytes "
                                       "(pipelining granularity; each piece costs CPU of its own: docs/collective.md)")
    small_bytes: int = _field(256 << 10, "allreduce: buckets whose bytes times (workers - 1) are at most this use "
                                         "the one-step algorithm (every worker sends to every other) instead of the "
                                         "ring")
    algorithm: str = _field("auto", "allreduce: what buckets above small_bytes take: \"ring\"; \"halving\" "
                                    "(recursive halving-doubling with 4, 8, ... workers: the ring's bytes in fewer "
                                    "messages; the ring otherwise); \"auto\": halving where every worker is on "
                                    "one host (loopback addresses), the ring across hosts (docs/collective.md)")
    timeout_s: float = _field(0.0, "allreduce: a collective that makes no progress for this long fails (0: "
                                   "limits.request_timeout_s). A backstop: a lost member is found by the heartbeats "
                                   "and the re-formed ring aborts the step at once; it must exceed the longest lag "
                                   "between members' steps")


@dataclasses.dataclass(frozen=True)
class LimitsConfig:
    frame_bytes: int = _field(1 << 26, "tensors are cut into frames of at most this many bytes; a tensor in one "
                                       "frame is received as a view, a split one is copied together once")
    tune_malloc: bool = _field(True, "daemons keep freed receive buffers mapped (glibc mallopt) so large frames "
                                     "do not page-fault; see hmp.transport.endpoint.tune_malloc")
    max_frames: int = _field(4096, "data frames per message")
    max_message_bytes: int = _field(1 << 30, "tensor bytes per message")
    max_rank: int = _field(8, "tensor rank")
    request_timeout_s: float = _field(60.0, "a request without reply fails after this (seconds)")
    queue_bytes: int = _field(1 << 30, "received memory a socket may queue per peer: its receive high-water mark "
                                       "is queue_bytes // frame_bytes messages (at least 16); a peer sending into "
                                       "a full queue waits")
    max_inflight_requests: int = _field(1024, "requests a daemon serves at once (handlers waiting, replies not yet "
                                              "sent); at the cap it stops reading until one finishes")


@dataclasses.dataclass(frozen=True)
class ShmConfig:
    enabled: bool = _field(True, "peers on the same host (detected by a handshake, never assumed) pass tensors "
                                 "through shared memory: ZeroMQ carries only the header (docs/shm.md)")
    min_bytes: int = _field(1 << 16, "tensors smaller than this travel inline, in frames")
    dir: str = _field("/dev/shm", "where segments live (a tmpfs), as files named hmp.JOB.OWNER.PID.N")
    reply_pool_bytes: int = _field(256 << 20, "memory a daemon lends as reply slots (a PS shard's new values); "
                                              "with none free a reply travels inline; 0: replies always inline")
    segment_bytes: int = _field(64 << 20, "size of each reply-pool segment (a larger reply gets one of its own)")


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    members: list = _field([], "HFTA sweep: one table of optimizer settings per member (lr, momentum, "
                               "weight_decay, betas, ...); empty: not a sweep job")
    optimizer: str = _field("sgd", "sweep: fused optimizer of the members (sgd | adam | adamw)")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    enabled: bool = _field(False, "run the job as a planned pipeline of stages (docs/pipeline.md)")
    planner: str = _field("bruteforce", "planner name in hmp.placement.registry (bruteforce, greedy, "
                                        "random, ga, rl)")
    resources: list = _field([], "resource types: tables with name, price_per_hour and optionally measured "
                                 "(true/false/\"auto\"), device, speed_scale (number or {kind: factor}), overhead_s, "
                                 "times_s (docs/placement.md); the count is the joined workers of the type")
    bandwidth_bytes_per_s: float = _field(1e9, "link bandwidth between stages the cost model assumes")
    message_overhead_s: float = _field(1.2e-4, "fixed seconds per message across a stage boundary the cost model "
                                               "adds (one each way per micro-batch); the default was measured on "
                                               "this runtime over loopback")
    min_throughput: float = _field(100.0, "samples/s the planned pipeline must sustain")
    micro_batches: int = _field(4, "micro-batches per step (GPipe fill/drain); a stage uses at most this many "
                                   "workers")
    calibrate: str = _field("predict", "after a plan has run ~1 s, calibrate the runtime model on what its workers "
                                       "measured: off, predict (report the calibrated prediction and predict later "
                                       "plans with it), replan (also re-plan on the calibrated figures; the running "
                                       "plan is kept unless cheaper by min_gain); docs/placement.md")
    min_gain: float = _field(0.1, "re-planning keeps the running plan unless the new one is cheaper by this "
                                  "fraction")
    profile_repeats: int = _field(5, "timed forward+backward passes per layer when profiling")
    join_wait_s: float = _field(10.0, "after the first worker joins, plan once every worker has joined or "
                                      "after this long")
    use_spare_workers: bool = _field(True, "workers the plan does not need join the busiest stage of their "
                                           "type (data parallel within the stage)")
    overlap_push: bool = _field(True, "a stage starts the next step while the PS applies its push; the new values "
                                      "are taken at the next point with no saved graph (staleness <= 1 step); "
                                      "false: wait for them (docs/pipeline.md)")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    name: str = _field("job", "job name, used in logs and the report")
    report_dir: str = _field("runs/{name}", "where the run report goes (relative: to the working dir)")
    heartbeat_interval_s: float = _field(0.5, "nodes heartbeat this often; 3 missed = lost")
    join_timeout_s: float = _field(60.0, "how long the scheduler waits for every node to join")
    log_format: str = _field("auto", "auto | console | json")
    token: str = _field("", "the job's identity: every message a node sends carries it and a message with another "
                            "token is refused (error unauthorized). Empty: the launcher makes a random one per run "
                            "(env HMP_JOB_TOKEN); daemons started by hand without one accept any token")
    restarts: dict = _field({}, "per role, how many times the launcher restarts a crashed daemon of that role, "
                                "e.g. {cpu_worker = 2, ps = 1}; a restarted daemon rejoins the running job")
    plot: bool = _field(True, "draw loss.png beside report.json at the end (about a second of CPU); false: "
                              "report.json only (`python -m hmp.report RUN_DIR` draws the plot later)")


@dataclasses.dataclass(frozen=True)
class SecurityConfig:
    curve: bool = _field(False, "authenticate and encrypt every connection with ZeroMQ CURVE (docs/security.md); "
                                "off: anyone who can reach a port and knows the job token can talk to the job")
    key_dir: str = _field("", "curve: the folder hmp-keygen wrote (NODE.key_secret per node, *.key public keys "
                              "of every allowed peer); relative: to the config file")
    handshake_timeout_s: float = _field(5.0, "curve: a connection whose handshake does not finish in this long "
                                             "fails with an error naming the peer (a wrong key, or not CURVE)")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = _field(False, "every daemon serves its counters and histograms in the Prometheus text "
                                  "format over HTTP (docs/metrics.md); the launcher lists the addresses")
    port: int = _field(0, "HTTP port of each daemon's metrics endpoint (0: the OS picks one per daemon)")


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A topology by count (``[cluster]``): the ``[[nodes]]`` it stands for are made at load
    (:func:`nodes_from_counts`); a config has either this section or ``[[nodes]]`` tables."""

    ps: int = _field(1, "PS shards, ids ps0, ps1, ...; must be 0 with train.consistency = \"allreduce\", "
                        "which is its default there")
    cpu_workers: int = _field(1, "CPU workers, ids cpu0, cpu1, ...")
    gpu_workers: int = _field(0, "GPU workers, ids gpu0, gpu1, ...")
    host: str = _field("127.0.0.1", "the address every daemon binds and its peers dial (not a wildcard); the "
                                    "shards and workers bind a free port on it")
    scheduler_port: int = _field(0, "the scheduler's port, the job's rendezvous point; 0: hmp-launch picks a free "
                                    "one (LocalCluster and daemons started by hand need a fixed port)")
    cpu_batch_size: int = _field(0, "each CPU worker's initial batch size; 0 takes [train] batch_size")
    gpu_batch_size: int = _field(0, "each GPU worker's initial batch size; 0 takes [train] batch_size")
    gpu_device: str = _field("cuda", "the GPU workers' device: 'cuda', 'cuda:N' or 'cpu' (a machine without CUDA)")
    threads: int = _field(1, "torch intra-op threads of each daemon (daemons share the cores)")


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole job: topology plus settings. ``path`` is the file it came from."""

    path: str
    job: JobConfig
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    ps: PSConfig
    limits: LimitsConfig
    sweep: SweepConfig
    nodes: tuple[NodeConfig, ...]
    placement: PlacementConfig = PlacementConfig()
    collective: CollectiveConfig = CollectiveConfig()
    shm: ShmConfig = ShmConfig()
    security: SecurityConfig = SecurityConfig()
    metrics: MetricsConfig = MetricsConfig()
    cluster: ClusterConfig = ClusterConfig()
    #: the TOML tables this config was read from, command-line overrides applied and ``[cluster]`` counts written
    #: out as ``[[nodes]]``: what a file must hold to give this config (:func:`hmp.config.toml_text.resolved_text`)
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    #: the command-line overrides applied, ``KEY=VALUE`` as given (:mod:`hmp.config.overrides`)
    overrides: tuple[str, ...] = ()
    #: the nodes were made from ``[cluster]`` counts, not read from ``[[nodes]]``
    nodes_from_counts: bool = False

    def node(self, node_id: str) -> NodeConfig:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise ConfigError(self.path, "nodes", f"no node with id {node_id!r}; ids are {[n.id for n in self.nodes]}")

    def by_role(self, *roles: str) -> list[NodeConfig]:
        return [n for n in self.nodes if n.role in roles]

    @property
    def scheduler(self) -> NodeConfig:
        return self.by_role(Role.SCHEDULER)[0]

    @property
    def workers(self) -> list[NodeConfig]:
        return self.by_role(*WORKER_ROLES)

    @property
    def shards(self) -> list[NodeConfig]:
        return self.by_role(Role.PS)

    @property
    def report_dir(self) -> Path:
        return Path(self.job.report_dir.format(name=self.job.name))

    def resolve(self, p: str) -> Path:
        """A path from the config, relative to the config file's folder."""
        q = Path(p)
        return q if q.is_absolute() else Path(self.path).resolve().parent / q

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


SECTIONS: dict[str, type] = {"job": JobConfig, "model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
                             "train": TrainConfig, "ps": PSConfig, "limits": LimitsConfig,
                             "sweep": SweepConfig, "placement": PlacementConfig, "collective": CollectiveConfig,
                             "shm": ShmConfig, "security": SecurityConfig,
                             "metrics": MetricsConfig, "cluster": ClusterConfig}


def _type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "an array",
            dict: "a table"}.get(t, str(t))


def _convert(path: str, key: str, value: Any, typ: Any) -> Any:
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, typ) and not (typ in (int, float) and isinstance(value, bool))
    if not ok:
        raise ConfigError(path, key, f"expected {_type_name(typ)}, got {type(value).__name__} {value!r}")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # evaluates the annotations: slow, so once per class


def _build(cls: type, table: Any, path: str, prefix: str) -> Any:
    if not isinstance(table, dict):
        raise ConfigError(path, prefix, "expected a table")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(path, f"{prefix}.{unknown[0]}", f"unknown key; expected one of {sorted(fields)}")
    kwargs = {k: _convert(path, f"{prefix}.{k}", v, hints[k]) for k, v in table.items()}
    return cls(**kwargs)


#: ``free_port(host)``: a port free now on ``host``, for a ``[cluster]`` scheduler_port of 0 (hmp-launch's)
FreePort = typing.Callable[[str], int]


def loads(text: str, path: str = "<string>", overrides: typing.Sequence[str] = (), *,
          free_port: FreePort | None = None) -> Config:
    """Parse TOML text into a validated :class:`Config`; ``overrides``: ``KEY=VALUE`` strings from the
    command line (:mod:`hmp.config.overrides`), applied over the file's values and checked like them;
    ``free_port``: picks the scheduler's port where ``[cluster] scheduler_port`` is 0 (None: an error)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(path, "<file>", f"valid TOML ({exc})") from None
    return from_raw(raw, path, overrides, free_port=free_port)


def from_raw(raw: dict[str, Any], path: str = "<string>", overrides: typing.Sequence[str] = (), *,
             free_port: FreePort | None = None) -> Config:
    """A validated :class:`Config` from TOML tables (``raw`` is not changed); ``overrides`` and ``free_port`` as
    in :func:`loads`. An error an override causes names it and says it came from the command line."""
    from hmp.config import overrides as overrides_mod  # it builds on this module

    given = tuple(overrides)
    if not given:
        return _from_raw(raw, path, free_port)
    parsed = [overrides_mod.parse(o) for o in given]
    try:
        cfg = _from_raw(overrides_mod.apply(raw, parsed, path), path, free_port)
    except ConfigError as exc:
        raise overrides_mod.blame(exc, parsed) from None
    return dataclasses.replace(cfg, overrides=given)


def _from_raw(raw: dict[str, Any], path: str, free_port: FreePort | None = None) -> Config:
    allowed = set(SECTIONS) | {"nodes"}
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(path, unknown[0], f"unknown section; expected one of {sorted(allowed)}")
    sections = {name: _build(cls, raw.get(name, {}), path, name) for name, cls in SECTIONS.items()}
    raw = dict(raw)
    counted = "cluster" in raw
    if counted:
        if "nodes" in raw:
            raise ConfigError(path, "cluster", "either a [cluster] table (a topology by count) or [[nodes]] tables, "
                                               "not both")
        counts = sections["cluster"]
        if counts.scheduler_port == 0 and free_port is not None:
            counts = dataclasses.replace(counts, scheduler_port=free_port(counts.host))
        raw["nodes"] = nodes_from_counts(counts, sections["train"], path, ps_given="ps" in raw["cluster"])
        del raw["cluster"]  # written out as the nodes
        sections["cluster"] = counts
    nodes_raw = raw.get("nodes")
    if not isinstance(nodes_raw, list) or not nodes_raw:
        raise ConfigError(path, "nodes", "an array of tables ([[nodes]]) with at least one node per role, or a "
                                         "[cluster] table saying how many of each role")
    nodes = tuple(_build(NodeConfig, n, path, f"nodes[{i}]") for i, n in enumerate(nodes_raw))
    cfg = Config(path=path, nodes=nodes, raw=raw, nodes_from_counts=counted, **sections)
    try:
        validate(cfg)
    except ConfigError as exc:
        if counted and exc.key.startswith("nodes"):  # a made node's value comes from a [cluster] key: name that
            raise _cluster_error(exc, cfg) from None
        raise
    return _typed(cfg)


def nodes_from_counts(c: ClusterConfig, train: TrainConfig, path: str, *, ps_given: bool = True) -> list[dict]:
    """``[cluster]``'s counts as ``[[nodes]]`` tables: the scheduler at ``host:scheduler_port``, then ps0..,
    cpu0.., gpu0.., each binding a free port on ``host``. ``ps_given``: the file set ``ps`` (else a ring job has
    none). Bad counts are ConfigErrors naming the ``cluster`` key."""
    allreduce = train.consistency == Consistency.ALLREDUCE
    ps = c.ps if ps_given or not allreduce else 0
    for key in ("ps", "cpu_workers", "gpu_workers", "cpu_batch_size", "gpu_batch_size"):
        if getattr(c, key) < 0:
            raise ConfigError(path, f"cluster.{key}", f"an integer >= 0, got {getattr(c, key)!r}")
    if allreduce and ps:
        raise ConfigError(path, "cluster.ps", f"0 when train.consistency = \"allreduce\" (the workers sum their "
                                              f"gradients among themselves, no PS), got {ps}")
    if not allreduce and not ps:
        raise ConfigError(path, "cluster.ps", "an integer >= 1 (the PS shards hold the parameters), or "
                                              "train.consistency = \"allreduce\"")
    if c.cpu_workers + c.gpu_workers < 1:
        raise ConfigError(path, "cluster.cpu_workers", "at least one worker: cpu_workers + gpu_workers >= 1")
    if c.threads < 1:
        raise ConfigError(path, "cluster.threads", f"an integer >= 1, got {c.threads!r}")
    if not c.host or c.host in ("*", "0.0.0.0", "::", "[::]") or any(ch in c.host for ch in "/ "):
        raise ConfigError(path, "cluster.host", f"an address the peers can dial (e.g. 127.0.0.1; not a wildcard, "
                                                f"no scheme), got {c.host!r}")
    if not 0 <= c.scheduler_port <= 65535:
        raise ConfigError(path, "cluster.scheduler_port", f"a port in 1-65535, got {c.scheduler_port!r}")
    if c.scheduler_port == 0:
        raise ConfigError(path, "cluster.scheduler_port", "a fixed port for the scheduler (the rendezvous point): "
                                                          "hmp-launch picks a free one for 0, but LocalCluster and "
                                                          "daemons started by hand need it written")
    if not (c.gpu_device == "cpu" or c.gpu_device == "cuda" or
            (c.gpu_device.startswith("cuda:") and c.gpu_device[5:].isdigit())):
        raise ConfigError(path, "cluster.gpu_device", f"'cpu', 'cuda' or 'cuda:N', got {c.gpu_device!r}")
    free = f"tcp://{c.host}:0"
    extra = {"threads": c.threads} if c.threads != 1 else {}
    nodes: list[dict] = [{"id": "scheduler", "role": str(Role.SCHEDULER), "bind": f"tcp://{c.host}:{c.scheduler_port}",
                          **extra}]
    nodes += [{"id": f"ps{i}", "role": str(Role.PS), "bind": free, **extra} for i in range(ps)]
    for prefix, role, count, batch, device in (("cpu", Role.CPU_WORKER, c.cpu_workers, c.cpu_batch_size, ""),
                                                ("gpu", Role.GPU_WORKER, c.gpu_workers, c.gpu_batch_size,
                                                 c.gpu_device)):
        for i in range(count):
            node = {"id": f"{prefix}{i}", "role": str(role), "bind": free, **extra}
            if device:
                node["device"] = device
            if batch:
                node["batch_size"] = batch
            nodes.append(node)
    return nodes


#: a made node's key -> the [cluster] key its value came from (by role where it differs)
_CLUSTER_KEYS = {"batch_size": {Role.CPU_WORKER: "cpu_batch_size", Role.GPU_WORKER: "gpu_batch_size"},
                 "device": {Role.GPU_WORKER: "gpu_device"}, "threads": "threads", "bind": "host",
                 "hogwild_threads": "threads"}


def _cluster_error(exc: ConfigError, cfg: Config) -> ConfigError:
    """``exc`` about a node made from ``[cluster]`` counts, re-keyed to the ``cluster`` key it came from."""
    head, _, field = exc.key.partition(".")
    key = "cluster"
    if head.startswith("nodes[") and head[6:-1].isdigit() and int(head[6:-1]) < len(cfg.nodes):
        node = cfg.nodes[int(head[6:-1])]
        name = _CLUSTER_KEYS.get(field)
        name = name.get(node.role) if isinstance(name, dict) else name
        if name:
            key = f"cluster.{name}"
        return ConfigError(exc.path, key, f"{exc.expected} (node {node.id!r}, made from the [cluster] counts)")
    return ConfigError(exc.path, key, f"{exc.expected} (the nodes made from the [cluster] counts)")


def _typed(cfg: Config) -> Config:
    """The validated names as their enums (a StrEnum equals its string, so either may be compared)."""
    t = cfg.train
    return cfg.replace(nodes=tuple(dataclasses.replace(n, role=Role(n.role)) for n in cfg.nodes),
                       train=dataclasses.replace(t, consistency=Consistency(t.consistency),
                                                 policy=BatchPolicyKind(t.policy)))


def load(path: str | os.PathLike, overrides: typing.Sequence[str] = (), *, free_port: FreePort | None = None) -> Config:
    """Load and validate a TOML config file (``overrides``, ``free_port``: see :func:`loads`)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(str(p), "<file>", f"a readable file ({exc.strerror})") from None
    return loads(text, str(p), overrides, free_port=free_port)


def validate(cfg: Config) -> None:
    """Cross-field checks: roles, unique ids and addresses, value ranges."""
    p = cfg.path
    seen_ids: dict[str, int] = {}
    seen_bind: dict[str, int] = {}
    for i, n in enumerate(cfg.nodes):
        k = f"nodes[{i}]"
        if not n.id:
            raise ConfigError(p, f"{k}.id", "a non-empty node id")
        if n.role not in tuple(Role):
            raise ConfigError(p, f"{k}.role", f"one of {[str(r) for r in Role]}, got {n.role!r}")
        if n.id in seen_ids:
            raise ConfigError(p, f"{k}.id", f"a unique id; {n.id!r} is also nodes[{seen_ids[n.id]}]")
        seen_ids[n.id] = i
        if not n.bind.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(p, f"{k}.bind", f"a tcp://, ipc:// or inproc:// address, got {n.bind!r}")
        if not n.bind.endswith(":0"):
            if n.bind in seen_bind:
                raise ConfigError(p, f"{k}.bind", f"a unique address; {n.bind!r} is also nodes[{seen_bind[n.bind]}]")
            seen_bind[n.bind] = i
        if n.threads < 1:
            raise ConfigError(p, f"{k}.threads", "an integer >= 1")
        if n.hogwild_threads < 1:
            raise ConfigError(p, f"{k}.hogwild_threads", "an integer >= 1")
        if n.batch_size < 0:
            raise ConfigError(p, f"{k}.batch_size", "an integer >= 0")
        if n.device and not (n.device == "cpu" or n.device.startswith("cuda")):
            raise ConfigError(p, f"{k}.device", f"'cpu' or 'cuda[:N]', got {n.device!r}")
    if (count := len(cfg.by_role(Role.SCHEDULER))) != 1:
        raise ConfigError(p, "nodes", f"exactly one node with role 'scheduler', found {count}")
    allreduce = cfg.train.consistency == Consistency.ALLREDUCE
    if not cfg.shards and not allreduce:
        raise ConfigError(p, "nodes", "at least one node with role 'ps' (or train.consistency = \"allreduce\")")
    if cfg.shards and allreduce:
        raise ConfigError(p, "nodes", "no node with role 'ps' when train.consistency = \"allreduce\" (workers sum "
                                      f"their gradients among themselves), found {[n.id for n in cfg.shards]}")
    if not cfg.workers:
        raise ConfigError(p, "nodes", "at least one node with role 'cpu_worker' or 'gpu_worker'")
    sched = cfg.scheduler
    if sched.bind.endswith(":0") and not sched.advertise:
        raise ConfigError(p, f"nodes[{seen_ids[sched.id]}].bind", "a fixed address for the scheduler (the rendezvous point)")
    t = cfg.train
    if t.consistency not in tuple(Consistency):
        raise ConfigError(p, "train.consistency", f"one of {[str(c) for c in Consistency]}, got {t.consistency!r}")
    if t.policy not in tuple(BatchPolicyKind):
        raise ConfigError(p, "train.policy", f"one of {[str(k) for k in BatchPolicyKind]}, got {t.policy!r}")
    if t.policy == BatchPolicyKind.SYNC and t.consistency != Consistency.SYNC:
        raise ConfigError(p, "train.consistency", "\"sync\" when train.policy is \"sync\" (bulk-synchronous SGD)")
    if t.work_unit_batches < 1:
        raise ConfigError(p, "train.work_unit_batches", "an integer >= 1")
    if t.staleness < 0:
        raise ConfigError(p, "train.staleness", "an integer >= 0")
    if t.batch_size < 1:
        raise ConfigError(p, "train.batch_size", "an integer >= 1")
    if t.epochs < 1:
        raise ConfigError(p, "train.epochs", "an integer >= 1")
    if not 0.0 <= t.target_accuracy <= 1.0:
        raise ConfigError(p, "train.target_accuracy", "a number in [0, 1]")
    if cfg.optimizer.name not in ("sgd", "adam", "adagrad"):
        raise ConfigError(p, "optimizer.name", f"one of ['sgd', 'adam', 'adagrad'], got {cfg.optimizer.name!r}")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(p, "optimizer.lr", "a number > 0")
    if cfg.data.kind not in DATA_KINDS and ":" not in cfg.data.kind:
        raise ConfigError(p, "data.kind", f"one of {list(DATA_KINDS)} or an import path "
                                          f"to a loader ('package.module:function' or 'path/to/file.py:function'), "
                                          f"got {cfg.data.kind!r}")
    if cfg.data.kind in ("svmlight", "npz") and not cfg.data.path:
        raise ConfigError(p, "data.path", f"a file path for data.kind = {cfg.data.kind!r}")
    _validate_task(cfg)
    if cfg.sweep.members:
        if not all(isinstance(m, dict) for m in cfg.sweep.members):
            raise ConfigError(p, "sweep.members", "an array of tables, one per member")
        if cfg.sweep.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(p, "sweep.optimizer", f"one of ['sgd', 'adam', 'adamw'], got {cfg.sweep.optimizer!r}")
        if t.consistency != Consistency.ASYNC:
            raise ConfigError(p, "train.consistency", "\"async\" for a sweep job (workers push parameter deltas)")
    if allreduce:
        _validate_allreduce(cfg)
    if cfg.ps.chunk_bytes < 64:
        raise ConfigError(p, "ps.chunk_bytes", "an integer >= 64")
    if cfg.ps.table_chunk_bytes != 0 and cfg.ps.table_chunk_bytes < 64:
        raise ConfigError(p, "ps.table_chunk_bytes", "0 (the same as ps.chunk_bytes) or an integer >= 64")
    if cfg.limits.frame_bytes < 64:
        raise ConfigError(p, "limits.frame_bytes", "an integer >= 64")
    if cfg.job.log_format not in ("auto", "console", "json"):
        raise ConfigError(p, "job.log_format", "one of ['auto', 'console', 'json']")
    _validate_ranges(cfg)
    _validate_placement(cfg)
    _validate_user_workers(cfg)
    if t.policy == BatchPolicyKind.STATIC and t.policy_args:
        raise ConfigError(p, "train.policy_args", "no knobs for train.policy = \"static\" (it keeps each "
                                                  f"worker's configured batch), got {t.policy_args!r}")


def _validate_task(cfg: Config) -> None:
    """[train] task and targets, [data] targets: names and forms (hmp.train.task.check_config imports what they
    name and checks them against the rest of the job)."""
    p, t = cfg.path, cfg.train
    if t.task not in TASK_NAMES and ":" not in t.task:
        raise ConfigError(p, "train.task", f"one of {list(TASK_NAMES)} or an import path to a function of your own "
                                           f"('package.module:function' or 'path/to/file.py:function', relative to "
                                           f"the config file; docs/task.md), got {t.task!r}")
    if t.task_kind not in ("loss", "step"):
        raise ConfigError(p, "train.task_kind", f"one of ['loss', 'step'], got {t.task_kind!r}")
    if t.task_kind == "step" and t.task in TASK_NAMES:
        raise ConfigError(p, "train.task_kind", f"\"loss\" for the built-in task {t.task!r} (\"step\" is for a "
                                                "step function of your own named by train.task)")
    if t.target_mode not in ("auto", "max", "min"):
        raise ConfigError(p, "train.target_mode", f"one of ['auto', 'max', 'min'], got {t.target_mode!r}")
    if t.target_accuracy and t.task == "regression":
        raise ConfigError(p, "train.target_accuracy", "0 for train.task = \"regression\" (it has no accuracy); "
                                                      "e.g. target_metric = \"r2\" with target = 0.5")
    if cfg.data.targets not in ("", "classes", "values"):
        raise ConfigError(p, "data.targets", f"one of ['classes', 'values'] or empty (by the task), got "
                                             f"{cfg.data.targets!r}")
    float_targets = cfg.data.kind == "diabetes" or cfg.data.targets == "values"
    if float_targets and t.task == "classification":
        what = "[data] kind = \"diabetes\" has" if cfg.data.kind == "diabetes" else "data.targets = \"values\" loads"
        raise ConfigError(p, "train.task", f"\"regression\" (or a task of your own) for float targets: {what} "
                                           "float targets, classification needs class labels")
    if cfg.data.targets == "classes" and t.task == "regression":
        raise ConfigError(p, "data.targets", "\"values\" (or empty) for train.task = \"regression\"")


def _validate_ranges(cfg: Config) -> None:
    """Numbers that only make sense in a range, and addresses a socket can bind."""
    p = cfg.path
    positive = {"limits.max_frames": cfg.limits.max_frames, "limits.max_message_bytes": cfg.limits.max_message_bytes,
                "limits.max_rank": cfg.limits.max_rank, "limits.request_timeout_s": cfg.limits.request_timeout_s,
                "limits.queue_bytes": cfg.limits.queue_bytes,
                "limits.max_inflight_requests": cfg.limits.max_inflight_requests,
                "job.heartbeat_interval_s": cfg.job.heartbeat_interval_s, "job.join_timeout_s": cfg.job.join_timeout_s,
                "train.max_seconds": cfg.train.max_seconds,
                "security.handshake_timeout_s": cfg.security.handshake_timeout_s}
    for key, value in positive.items():
        if not value > 0:
            raise ConfigError(p, key, f"a number > 0, got {value!r}")
    for key, value, off in (("ps.checkpoint_every", cfg.ps.checkpoint_every, "by time only"),
                            ("ps.checkpoint_every_s", cfg.ps.checkpoint_every_s, "by updates only")):
        if value < 0:
            raise ConfigError(p, key, f"a number >= 0 (0: {off}), got {value!r}")
    _validate_resilience(cfg)
    shm = cfg.shm
    for key, value, low in (("shm.min_bytes", shm.min_bytes, 0), ("shm.reply_pool_bytes", shm.reply_pool_bytes, 0),
                            ("shm.segment_bytes", shm.segment_bytes, 4096)):
        if value < low:
            raise ConfigError(p, key, f"an integer >= {low}, got {value!r}")
    if not shm.dir:
        raise ConfigError(p, "shm.dir", "a directory (a tmpfs such as /dev/shm)")
    d = cfg.data
    # digits and click are always split, svmlight without a test file too; npz may carry its own
    # test arrays (then the fraction is unused), so there only the range is checked.
    always_split = d.kind in ("digits", "diabetes", "click") or (d.kind == "svmlight" and not d.test_path)
    if not 0.0 <= d.test_fraction < 1.0 or (always_split and d.test_fraction == 0.0):
        allowed = "(0, 1)" if always_split else "[0, 1) (0: the data file must hold its own test split)"
        raise ConfigError(p, "data.test_fraction", f"a number in {allowed}, got {d.test_fraction!r}")
    if cfg.placement.calibrate not in ("off", "predict", "replan"):
        raise ConfigError(p, "placement.calibrate", f"one of ['off', 'predict', 'replan'], got "
                                                    f"{cfg.placement.calibrate!r}")
    o = cfg.optimizer
    if o.schedule not in ("constant", "step", "cosine"):
        raise ConfigError(p, "optimizer.schedule", f"one of ['constant', 'step', 'cosine'], got {o.schedule!r}")
    for key, value, low in (("optimizer.warmup_steps", o.warmup_steps, 0), ("optimizer.step_size", o.step_size, 1),
                            ("optimizer.total_steps", o.total_steps, 0)):
        if value < low:
            raise ConfigError(p, key, f"an integer >= {low}, got {value!r}")
    if not 0 < o.gamma <= 1:
        raise ConfigError(p, "optimizer.gamma", f"a number in (0, 1], got {o.gamma!r}")
    if o.schedule == "cosine" and o.total_steps < 1:
        raise ConfigError(p, "optimizer.total_steps", "an integer >= 1 with schedule = \"cosine\" (the updates "
                                                      "over which the lr falls to min_lr)")
    if not 0 <= o.min_lr <= o.lr:
        raise ConfigError(p, "optimizer.min_lr", f"a number from 0 to optimizer.lr ({o.lr}), got {o.min_lr!r}")
    betas = cfg.optimizer.betas
    if not (len(betas) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                                    for b in betas)):
        raise ConfigError(p, "optimizer.betas", f"two numbers in [0, 1), got {betas!r}")
    for i, n in enumerate(cfg.nodes):
        for key in ("bind", "advertise"):
            address = getattr(n, key)
            if address.startswith("tcp://"):
                host, _, port = address[len("tcp://"):].rpartition(":")
                if not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
                    raise ConfigError(p, f"nodes[{i}].{key}", f"tcp://HOST:PORT with a port in 0-65535 or *, "
                                                              f"got {address!r}")


def _validate_resilience(cfg: Config) -> None:
    """[train] min_workers, [job] restarts and token: counts in range, roles that exist."""
    p = cfg.path
    workers = len(cfg.workers)
    if not 1 <= cfg.train.min_workers <= max(workers, 1):
        raise ConfigError(p, "train.min_workers", f"an integer from 1 to the topology's {workers} worker(s) (the job "
                                                  f"fails once fewer are live), got {cfg.train.min_workers!r}")
    shards = len(cfg.shards)
    if cfg.ps.replicas not in (1, 2) or (cfg.ps.replicas == 2 and shards < 2 and cfg.workers):
        raise ConfigError(p, "ps.replicas", f"1 (no backup) or 2 (a backup of each chunk on another shard, which "
                                            f"needs at least 2 [[nodes]] with role = \"ps\"; the topology has "
                                            f"{shards}), got {cfg.ps.replicas!r}")
    if not 0 <= cfg.metrics.port <= 65535:
        raise ConfigError(p, "metrics.port", f"a port in 0-65535 (0: the OS picks one), got {cfg.metrics.port!r}")
    for role, count in cfg.job.restarts.items():
        if role not in tuple(Role):
            raise ConfigError(p, f"job.restarts.{role}", f"a role, one of {[str(r) for r in Role]}")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(p, f"job.restarts.{role}", f"an integer >= 0 (restarts of each {role} daemon), "
                                                         f"got {count!r}")
    token = cfg.job.token
    if len(token) > 256 or not token.isprintable():
        raise ConfigError(p, "job.token", f"at most 256 printable characters, got {len(token)} "
                                          f"{'characters' if token.isprintable() else 'with a control character'}")


def _validate_user_workers(cfg: Config) -> None:
    """``role = "user_worker"``: a loop of the user's (docs/own_loop.md) runs plain steps of the job's model."""
    p = cfg.path
    users = [(i, n) for i, n in enumerate(cfg.nodes) if n.role == Role.USER_WORKER]
    if not users:
        return
    why = "a user_worker's loop is your own program (docs/own_loop.md)"
    if cfg.job.restarts.get(Role.USER_WORKER):
        raise ConfigError(p, "job.restarts.user_worker", f"0: the launcher does not start user workers ({why})")
    if cfg.sweep.members:
        raise ConfigError(p, "nodes", f"no user_worker in a [sweep] job (its workers step fused arrays); found "
                                      f"{[n.id for _, n in users]}")
    if cfg.placement.enabled:
        raise ConfigError(p, "nodes", f"no user_worker in a [placement] job (its workers run pipeline stages); "
                                      f"found {[n.id for _, n in users]}")
    for i, n in users:
        if n.hogwild_threads > 1:
            raise ConfigError(p, f"nodes[{i}].hogwild_threads", f"1 for a user_worker ({why})")


def _validate_allreduce(cfg: Config) -> None:
    """``consistency = "allreduce"``: what the ring can run, and the [collective] numbers."""
    p, c, t = cfg.path, cfg.collective, cfg.train
    if cfg.sweep.members:
        raise ConfigError(p, "train.consistency", "not \"allreduce\" for a [sweep] job (workers push parameter deltas)")
    if t.policy != BatchPolicyKind.STATIC:
        raise ConfigError(p, "train.policy", "\"static\" when train.consistency = \"allreduce\" (the ring steps "
                                             f"every worker in lockstep), got {t.policy!r}")
    for i, n in enumerate(cfg.nodes):
        if n.hogwild_threads > 1:
            raise ConfigError(p, f"nodes[{i}].hogwild_threads", "1 when train.consistency = \"allreduce\"")
        if n.role in WORKER_ROLES and n.batch_size not in (0, t.batch_size):
            raise ConfigError(p, f"nodes[{i}].batch_size", f"unset or train.batch_size ({t.batch_size}) when "
                                                          "train.consistency = \"allreduce\" (every worker takes an "
                                                          f"equal slice of the global batch), got {n.batch_size}")
    for key in ("bucket_bytes", "piece_bytes"):
        if getattr(c, key) < 64:
            raise ConfigError(p, f"collective.{key}", f"an integer >= 64, got {getattr(c, key)!r}")
    if c.small_bytes < 0:
        raise ConfigError(p, "collective.small_bytes", f"an integer >= 0, got {c.small_bytes!r}")
    if c.algorithm not in ALLREDUCE_ALGORITHMS:
        raise ConfigError(p, "collective.algorithm", f"one of {', '.join(map(repr, ALLREDUCE_ALGORITHMS))}, "
                                                     f"got {c.algorithm!r}")
    if c.timeout_s < 0:
        raise ConfigError(p, "collective.timeout_s", f"a number >= 0 (0: from the heartbeat), got {c.timeout_s!r}")


def _validate_placement(cfg: Config) -> None:
    """[placement]: the runtime's keys. The planner's keys (resources, link, demand) are checked by the
    planner's own ``hmp.placement.spec.check_config`` (see :func:`hmp.job.check`)."""
    p, pl = cfg.path, cfg.placement
    if not pl.enabled:
        return
    if cfg.sweep.members:
        raise ConfigError(p, "placement.enabled", "false for a [sweep] job")
    if cfg.train.consistency != Consistency.ASYNC:
        raise ConfigError(p, "train.consistency", "\"async\" for a [placement] job (stages push their own chunks "
                                                  "at their own pace)")
    if not pl.resources:
        raise ConfigError(p, "placement.resources", "at least one resource table when placement is enabled")
    if pl.planner not in PLANNER_NAMES:
        raise ConfigError(p, "placement.planner", f"one of {list(PLANNER_NAMES)}, got {pl.planner!r}")
    if pl.micro_batches < 1:
        raise ConfigError(p, "placement.micro_batches", "an integer >= 1")
    if cfg.train.batch_size % pl.micro_batches:
        raise ConfigError(p, "train.batch_size", f"a multiple of placement.micro_batches ({pl.micro_batches})")
    if not 0.0 <= pl.min_gain < 1.0:
        raise ConfigError(p, "placement.min_gain", "a fraction in [0, 1)")
    if pl.join_wait_s < 0:
        raise ConfigError(p, "placement.join_wait_s", "a number >= 0")

#: environment variable -> (section, key); the only environment overrides hmp reads.
ENV_OVERRIDES = {
    "HMP_MAX_SECONDS": ("train", "max_seconds"),
    "HMP_REPORT_DIR": ("job", "report_dir"),
    "HMP_LOG_FORMAT": ("job", "log_format"),
    "HMP_JOB_TOKEN": ("job", "token"),  # the launcher's per-run token for the daemons it starts
}


def env_overrides(cfg: Config, environ: typing.Mapping[str, str] | None = None) -> Config:
    """Apply the HMP_* environment overrides listed in :data:`ENV_OVERRIDES`."""
    environ = os.environ if environ is None else environ
    for var, (section, key) in ENV_OVERRIDES.items():
        if var in environ:
            sec = getattr(cfg, section)
            typ = typing.get_type_hints(type(sec))[key]
            try:
                value = typ(environ[var])
            except ValueError:
                raise ConfigError(f"${var}", f"{section}.{key}", f"{_type_name(typ)}, got {environ[var]!r}") from None
            cfg = cfg.replace(**{section: dataclasses.replace(sec, **{key: value})})
    used = [f"${var}" for var in ENV_OVERRIDES if var in environ]
    if used:
        try:
            validate(cfg)  # an override is checked like the file's own value
        except ConfigError as exc:
            raise ConfigError(f"{exc.path} with {', '.join(used)}", exc.key, exc.expected) from None
    return cfg
