"""The PS shard's checkpoint file format: a 52-byte header (magic ``HMPSHARD``, format version, payload
length, SHA-256 of the payload), then the ``torch.save`` payload of a shard's state dict. A file is
verified before anything in it is trusted (:func:`read`): a torn, truncated or corrupted one is a
:class:`CheckpointError` naming the file and what is wrong with it. Writing keeps the previous
checkpoint as ``NAME.prev.pt`` (:func:`previous_checkpoint`, rotated by rename), so a resume has a good
one to fall back to.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
from pathlib import Path
from typing import Any

import torch

from hmp.errors import HmpError


#: checkpoint header: magic, format version, payload bytes, SHA-256 of the payload (little-endian)
CHECKPOINT_HEADER = struct.Struct("<8sIQ32s")
CHECKPOINT_MAGIC = b"HMPSHARD"
CHECKPOINT_FORMAT = 1


class CheckpointError(HmpError):
    """A checkpoint file that cannot be used: missing, empty, truncated, corrupted or not one of ours.
    ``path`` is the file, ``why`` what is wrong with it (one line)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"{path}: {why}")
        self.path, self.why = path, why


class _DigestWriter:
    """A file's ``write`` that also counts and hashes what goes through (what ``torch.save`` needs of a file)."""

    def __init__(self, f: Any) -> None:
        self.f, self.nbytes, self.sha256 = f, 0, hashlib.sha256()
        #: the OSError a write raised: torch.save reports it as a RuntimeError of its zip writer
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.nbytes += view.nbytes
        try:
            return self.f.write(view)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self.f.flush()


def previous_checkpoint(path: Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``ps0.pt`` -> ``ps0.prev.pt``."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def write(state: dict[str, Any], path: Path, keep_previous: bool = True) -> None:
    """Write a state dict with its checksum header, atomically (temp file, fsync, rename); the
    checkpoint it replaces becomes :func:`previous_checkpoint` (unless ``keep_previous`` is false:
    then the previous one is left as it is). Touches no shard state, so it may run in a thread (on
    a shard's ``snapshot()``). A failed write (``OSError``: disk full, unwritable folder) leaves no temp
    file, and the checkpoints that were there as they were."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            # Streamed through the digest, not serialized in memory first (that would cost a second
            # copy of the shard); the header, known only at the end, goes into the room left for it.
            f.write(bytes(CHECKPOINT_HEADER.size))
            payload = _DigestWriter(f)
            try:
                torch.save(state, payload)
            except Exception:
                if payload.error is not None:  # the disk's error, not torch's wrapper of it
                    raise payload.error from None
                raise
            f.seek(0)
            f.write(CHECKPOINT_HEADER.pack(CHECKPOINT_MAGIC, CHECKPOINT_FORMAT, payload.nbytes,
                                           payload.sha256.digest()))
            f.flush()
            os.fsync(f.fileno())
        if keep_previous and path.exists():
            # Between these two renames only the previous checkpoint exists: a resume falls back to it.
            os.replace(path, previous_checkpoint(path))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The renames themselves are durable only once the folder is.
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path) -> dict[str, Any]:
    """A checkpoint's state dict, verified against its header first; :class:`CheckpointError`
    (naming the file and what is wrong) for a missing, empty, truncated, corrupted or foreign file."""
    try:
        with open(path, "rb") as f:
            head = f.read(CHECKPOINT_HEADER.size)
            if not head:
                raise CheckpointError(path, "empty file")
            if not head.startswith(CHECKPOINT_MAGIC):
                raise CheckpointError(path, "not an hmp shard checkpoint (no HMPSHARD header; a bare "
                                            "torch.save file or another file)")
            if len(head) < CHECKPOINT_HEADER.size:
                raise CheckpointError(path, f"truncated: {len(head)} bytes, shorter than the "
                                            f"{CHECKPOINT_HEADER.size}-byte header")
            _, fmt, length, digest = CHECKPOINT_HEADER.unpack(head)
            if fmt != CHECKPOINT_FORMAT:
                raise CheckpointError(path, f"checkpoint format {fmt}; this hmp reads format {CHECKPOINT_FORMAT}")
            payload = f.read(length + 1)  # one more byte than announced: trailing bytes are an error too
    except FileNotFoundError:
        raise CheckpointError(path, "no such file") from None
    except IsADirectoryError:
        raise CheckpointError(path, "a directory, not a checkpoint file") from None
    except OSError as exc:
        raise CheckpointError(path, f"unreadable ({exc.strerror or exc})") from None
    if len(payload) < length:
        raise CheckpointError(path, f"truncated: the header announces {length} payload bytes, the file holds "
                                    f"{len(payload)}")
    if len(payload) > length:
        raise CheckpointError(path, f"more bytes than the header's {length}: not one whole checkpoint")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(path, "corrupted: the payload's SHA-256 differs from the header's")
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as exc:  # a checksummed payload torch cannot read: written by something else
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(path, f"unreadable payload ({exc.__class__.__name__}: {first[:200]})") from None
    if not isinstance(state, dict) or not {"params", "optim", "version"} <= set(state):
        raise CheckpointError(path, "not a shard state (params, optim, version missing)")
    return state
