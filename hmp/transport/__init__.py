"""Wire codec (pure: :mod:`hmp.transport.codec`), asyncio ZeroMQ endpoints (:mod:`.endpoint`) and
shared memory between peers on one host (:mod:`.shm`, docs/shm.md)."""
