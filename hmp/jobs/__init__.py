"""Cluster mode: a job manager that places submitted ring-all-reduce jobs onto hosts' worker slots (docs/gadget.md)."""
