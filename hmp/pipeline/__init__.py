"""Pipeline runtime, pure parts (no sockets): layer-aligned parameter chunks, stage compute,
the micro-batch order, profiling into a placement problem, and stage/worker assignment.

The daemons that use them: ``hmp/nodes/stage_worker.py`` and ``hmp/nodes/placement_loop.py``
(see docs/pipeline.md).
"""
