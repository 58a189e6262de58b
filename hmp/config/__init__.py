"""Job topology and settings: TOML files loaded into frozen dataclasses (:mod:`hmp.config.schema`).

The one place config and environment are read. :func:`load` checks what the config alone can
judge (types, ranges, roles, addresses) and names the file, the key and what was expected
(:class:`~hmp.errors.ConfigError`). Each subsystem checks the settings only its code can judge
(a model's arguments, a batch policy's knobs, a planner's resources); :func:`hmp.job.load` runs
them all. A ``[cluster]`` table stands for ``[[nodes]]`` by count; command-line overrides
(:mod:`hmp.config.overrides`) are checked like the file's values; :mod:`hmp.config.toml_text` writes a loaded
config back. docs/config.md's reference table comes from :mod:`hmp.config.reference`.
"""

from hmp.config.schema import (ENV_OVERRIDES, SECTIONS, WORKER_ROLES, BatchPolicyKind, ClusterConfig,
                               CollectiveConfig, Config, Consistency, DataConfig,
                               JobConfig, LimitsConfig, ModelConfig, NodeConfig, OptimizerConfig, PlacementConfig,
                               PSConfig, Role, SecurityConfig, SweepConfig, TrainConfig, env_overrides, from_raw, load, loads,
                               validate)

__all__ = ["ENV_OVERRIDES", "SECTIONS", "WORKER_ROLES", "BatchPolicyKind", "ClusterConfig", "Config",
           "CollectiveConfig", "Consistency", "DataConfig", "JobConfig", "LimitsConfig", "ModelConfig", "NodeConfig", "OptimizerConfig",
           "PlacementConfig", "PSConfig", "Role", "SecurityConfig", "SweepConfig", "TrainConfig", "env_overrides", "from_raw",
           "load", "loads",
           "validate"]
