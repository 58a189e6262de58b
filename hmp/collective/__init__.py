"""Collective operations between workers: ring all-reduce (:class:`Ring`, :class:`RingHost`; the
pieces' layout per step in :mod:`hmp.collective.plans`) and gradient buckets that feed it during
``backward()`` (:class:`GradientBuckets`); the members' module buffers averaged each step
(:class:`BufferMean`, docs/buffers.md). See docs/collective.md."""

from hmp.collective.buffers import BufferMean
from hmp.collective.buckets import DEFAULT_BUCKET_BYTES, Bucket, GradientBuckets, plan_buckets
from hmp.collective.errors import RingBroken, RingError
from hmp.collective.plans import HalvingSteps, RingLayout
from hmp.collective.ring import DEFAULT_PIECE_BYTES, DEFAULT_SMALL_BYTES, SMALL_STEP, Ring, RingHost

__all__ = ["BufferMean", "DEFAULT_BUCKET_BYTES", "DEFAULT_PIECE_BYTES", "DEFAULT_SMALL_BYTES", "SMALL_STEP", "Bucket",
           "GradientBuckets", "HalvingSteps", "Ring", "RingBroken", "RingError", "RingHost", "RingLayout",
           "plan_buckets"]
