"""Wire codec (pure: :mod:`hmp.transport.codec`) and asyncio ZeroMQ endpoints (:mod:`.endpoint`)."""
