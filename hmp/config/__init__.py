"""Job topology and settings: TOML files loaded into frozen dataclasses (:mod:`hmp.config.schema`).

The one place config and environment are read. :func:`load` checks what the config alone can
judge (types, ranges, roles, addresses) and names the file, the key and what was expected
(:class:`~hmp.errors.ConfigError`). Each subsystem checks the settings only its code can judge
(a model's arguments, a batch policy's knobs, a planner's resources); :func:`hmp.job.load` runs
them all. docs/config.md's reference table comes from :mod:`hmp.config.reference`.
"""

from hmp.config.schema import (ENV_OVERRIDES, SECTIONS, WORKER_ROLES, BatchPolicyKind, CollectiveConfig, Config,
                               Consistency, DataConfig,
                               JobConfig, LimitsConfig, ModelConfig, NodeConfig, OptimizerConfig, PlacementConfig,
                               PSConfig, Role, SecurityConfig, SweepConfig, TrainConfig, env_overrides, load, loads, validate)

__all__ = ["ENV_OVERRIDES", "SECTIONS", "WORKER_ROLES", "BatchPolicyKind", "Config",
           "CollectiveConfig", "Consistency", "DataConfig", "JobConfig", "LimitsConfig", "ModelConfig", "NodeConfig", "OptimizerConfig",
           "PlacementConfig", "PSConfig", "Role", "SecurityConfig", "SweepConfig", "TrainConfig", "env_overrides", "load", "loads",
           "validate"]
