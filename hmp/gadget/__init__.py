"""GADGET: online placement of ring-all-reduce jobs onto a cluster's worker slots (docs/gadget.md).

Pure code, no sockets and no processes: the cluster and cost model (:mod:`hmp.gadget.model`), its fit to
measured step times (:mod:`hmp.gadget.fit`), jobs and their utilities (:mod:`hmp.gadget.jobs`), the
schedulers (:mod:`hmp.gadget.schedulers`: GADGET and the baselines, one interface), the trace-driven
simulator (:mod:`hmp.gadget.simulate`) and small random rounds against the exact optimum
(:mod:`hmp.gadget.instances`). The real cluster
mode that starts jobs on hosts builds on these (:mod:`hmp.manager`).
"""
