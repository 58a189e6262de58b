"""The scheduler's sans-IO core (:mod:`hmp.scheduler.core`) and its membership state machine
(:mod:`hmp.scheduler.membership`); the daemon around them is :mod:`hmp.nodes.scheduler`."""
