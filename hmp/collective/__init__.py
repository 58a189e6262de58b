"""Collective operations between workers: ring all-reduce (:class:`Ring`, :class:`RingHost`) and
gradient buckets that feed it during ``backward()`` (:class:`GradientBuckets`). See
docs/collective.md."""

from hmp.collective.buckets import DEFAULT_BUCKET_BYTES, Bucket, GradientBuckets, plan_buckets
from hmp.collective.errors import RingBroken, RingError
from hmp.collective.ring import DEFAULT_PIECE_BYTES, DEFAULT_SMALL_BYTES, SMALL_STEP, Plan, Ring, RingHost

__all__ = ["DEFAULT_BUCKET_BYTES", "DEFAULT_PIECE_BYTES", "DEFAULT_SMALL_BYTES", "SMALL_STEP", "Bucket",
           "GradientBuckets", "Plan", "Ring", "RingBroken", "RingError", "RingHost", "plan_buckets"]
