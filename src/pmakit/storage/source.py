"""Where a reader's bytes come from: one ``ByteSource`` per input file, opened once (``open_source``).

A local file is read through one read-only ``mmap`` (views, no copies) with the kernel's read-ahead asked for; a
file of an object-store mirror (``pmakit.storage.mirror``) by ranged GETs of the version listed, on a shared pool
of ``IN_FLIGHT`` threads, each retried: read front to back (``sequential``, a safetensors file) in aligned
``BLOCK_BYTES`` blocks fetched ahead as the merge reads (``Sequential``), else one GET per range asked for (a DCP
file's saved records, started by the merge's read-ahead hints through ``fetch``). Memory, remotely: the blocks
fetched ahead (``AHEAD_BLOCKS`` over all inputs), per input the block being read and the chunks in the merge's
hands, and for DCP the saved records of the tensor being merged: independent of the model's size like the local
merge, but process memory where the local merge has page cache, so it grows with N. Code that must read a file
itself (``torch.load``, DCP's decoder for compressed records) asks ``fill`` to write the bytes into the
placeholder first.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from pathlib import Path

from pmakit.errors import PmakitError
from pmakit.storage.base import IN_FLIGHT
from pmakit.storage.mirror import RemoteFile, remote_file

BLOCK_BYTES = 16 * 2**20
"""The ranges a file read front to back is fetched in (``Sequential``), aligned to the file: one merge chunk of
bf16. Whole aligned blocks rather than one GET per tensor chunk: a model's many small tensors (norms, a 1024-wide
attention's 2 MiB projections) would otherwise each be a request, and a store's time per request dominates them."""


class Sequential:
    """Reads of one remote file that move front to back (a merge reads each input in its on-disk order), served
    from aligned blocks of ``BLOCK_BYTES`` fetched ahead on the pool: the GETs of the GET floor, the same size and as
    many in flight. The streams being read keep ``AHEAD_BLOCKS`` blocks ahead together (at least two each), and the
    pool runs first the blocks nearest to their stream's reader (``GetPool``): the N inputs' blocks come in side by
    side, as the fold uses them. A block is dropped once a read reaches its end or starts past it. A read far ahead moves the stream there; a read
    behind the blocks held is a GET of its own."""

    def __init__(self, remote: RemoteFile) -> None:
        self.remote = remote
        self._blocks: dict[int, Future[bytes]] = {}
        self._next = -1
        """The next block to start; -1: none started yet."""
        self._reading = 0
        """The block the last read began in: a block's GET ranks by how far past it the block lies."""
        self._lock = threading.Lock()
        self.waited = 0.0
        """Seconds the reading thread waited for blocks (benchmarks)."""

    def hint(self, start: int, stop: int) -> None:
        """``read(start, stop)`` comes soon: the first hint starts the stream there (its share of blocks ahead);
        later ones change nothing, since the stream reads ahead on its own (a hint's own reach would add to it)."""
        with self._lock:
            if self._next == -1:
                self._advance(start, stop)

    def read(self, start: int, stop: int) -> memoryview | bytes:
        first, last = start // BLOCK_BYTES, (stop - 1) // BLOCK_BYTES
        self._reading = first
        with self._lock:
            for i in [i for i in self._blocks if i < first]:
                del self._blocks[i]
            if not self._advance(start, stop):
                return self.remote.read(start, stop)
            futures = [self._blocks[i] for i in range(first, last + 1)]
            for i in range(
                first, last + 1
            ):  # read to their end: the views returned hold what is still needed
                if min(self.remote.size, (i + 1) * BLOCK_BYTES) <= stop:
                    del self._blocks[i]
        began = time.perf_counter()
        parts = [memoryview(f.result()) for f in futures]
        self.waited += time.perf_counter() - began
        lo, hi = start - first * BLOCK_BYTES, stop - last * BLOCK_BYTES
        if len(parts) == 1:
            return parts[0][lo:hi]
        return b"".join([parts[0][lo:], *parts[1:-1], parts[-1][:hi]])  # a copy of just the range

    def _advance(self, start: int, stop: int) -> bool:
        """Start the blocks ``[start, stop)`` needs and the stream's share ahead of it; False (nothing started) for a
        range behind the blocks held: the caller GETs it on its own."""
        first = start // BLOCK_BYTES
        if self._next == -1 or first > self._next + 2:  # the first read, or past unread bytes: start there
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
            self._next = self._reading = first
        elif first < self._next and first not in self._blocks:
            return False
        with _STREAMS_LOCK:
            _STREAMS.add(self)
            share = max(2, AHEAD_BLOCKS // len(_STREAMS))
        end = min(self.remote.size, max(stop, start + share * BLOCK_BYTES))
        while self._next * BLOCK_BYTES < end:
            a = self._next * BLOCK_BYTES
            rank = functools.partial(self._ahead, self._next)
            self._blocks[self._next] = self.remote.fetch(a, min(self.remote.size, a + BLOCK_BYTES), rank)
            self._next += 1
        if self._next * BLOCK_BYTES >= self.remote.size:  # all started: no share of the pool needed any more
            with _STREAMS_LOCK:
                _STREAMS.discard(self)
        return True

    def _ahead(self, block: int) -> int:
        """How many blocks past the one being read ``block`` lies (its GET's rank; read unlocked: the pool asks)."""
        return block - self._reading

    def close(self) -> None:
        with self._lock:
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
        with _STREAMS_LOCK:
            _STREAMS.discard(self)


_STREAMS: set[Sequential] = set()
"""The streams fetching ahead now (their share of ``AHEAD_BLOCKS``)."""
_STREAMS_LOCK = threading.Lock()


AHEAD_BLOCKS = IN_FLIGHT * 3 // 2
"""Blocks fetched ahead over all streams: in flight or fetched and not yet read. More than the pool's ``IN_FLIGHT``
GETs, so that blocks fetched early (a stream waits for the slowest of the N) do not leave the pool idle."""


class ByteSource(ABC):
    """The bytes of one input file, opened once by its reader: ``read`` ranges of it, ``fetch`` them early,
    ``verify`` it did not change while read. Thread safe for ``read`` and ``fetch``."""

    remote = False
    """True for a file read from object storage (its local path is a placeholder)."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size

    @abstractmethod
    def read(self, start: int, stop: int) -> memoryview | bytes:
        """Bytes ``[start, stop)`` (read-only; a view valid until ``close``)."""

    @abstractmethod
    def fetch(self, start: int, stop: int) -> Future[bytes] | None:
        """Start reading ``[start, stop)`` now: the ranged GET's future, or None where the kernel was asked to read
        ahead instead (``read`` then finds the bytes in the page cache)."""

    def hint(self, start: int, stop: int) -> None:
        """``read(start, stop)`` comes soon, in a front-to-back pass (a remote stream starts there)."""
        self.fetch(start, stop)

    def fill(self, start: int = 0, stop: int | None = None) -> None:  # noqa: B027 - local: nothing to do
        """Make the file at ``path`` hold bytes ``[start, stop)`` (default: all), for code that reads it itself."""

    def verify(self) -> None:  # noqa: B027 - remote: every read is pinned to the version listed
        """Fail with one line if the file changed since it was opened."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what reading holds (maps, descriptors, blocks fetched ahead)."""

    def __enter__(self) -> ByteSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSource(ByteSource):
    """A local file: one read-only map, made on the first read; the kernel asked to read ahead."""

    def __init__(self, path: Path, sequential: bool = False) -> None:
        try:
            info: os.stat_result | None = os.stat(path)
        except OSError:  # said by the first read, if any
            info = None
        super().__init__(path, -1 if info is None else info.st_size)
        self._identity = None if info is None else _identity(info)
        self._sequential = sequential
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_RDONLY)
                except OSError as e:
                    raise PmakitError(f"{self.path}: cannot be read ({e.strerror})") from None
                if self._sequential and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return self._fd

    def read(self, start: int, stop: int) -> memoryview | bytes:
        if stop <= start:
            return b""
        fd = self._open()
        # A mapped page past the end of a file truncated since (or before) it was opened is a SIGBUS, which no
        # Python handler catches: check the file still holds the range before handing out a view.
        if os.fstat(fd).st_size < stop:
            raise PmakitError(
                f"{self.path}: truncated while being merged, or before (bytes {start:,}-{stop:,} lie past its "
                "end); merge again"
            )
        with self._lock:
            if self._map is None:
                self._map = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        return memoryview(self._map)[start:stop]

    def fetch(self, start: int, stop: int) -> Future[bytes] | None:
        if stop > start and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._open(), start, stop - start, os.POSIX_FADV_WILLNEED)
        return None

    def verify(self) -> None:
        try:
            now: tuple[int, int, int, int] | None = _identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self._identity:
            raise PmakitError(
                f"{self.path}: changed while being merged (truncated, replaced or rewritten); merge again"
            )

    def close(self) -> None:
        with self._lock:
            if self._map is not None:
                with contextlib.suppress(BufferError):  # a caller may still hold a view; the map goes with it
                    self._map.close()
            if self._fd is not None:
                os.close(self._fd)
            self._map, self._fd = None, None


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class RemoteSource(ByteSource):
    """A file of an object-store mirror: ranged GETs of the version listed, through ``Sequential`` blocks fetched
    ahead when read front to back, else one GET per range."""

    remote = True

    def __init__(self, remote: RemoteFile, sequential: bool = False) -> None:
        super().__init__(remote.placeholder, remote.size)
        self.file = remote
        self._stream = Sequential(remote) if sequential else None

    def read(self, start: int, stop: int) -> memoryview | bytes:
        if stop <= start:
            return b""
        return self._stream.read(start, stop) if self._stream is not None else self.file.read(start, stop)

    def fetch(self, start: int, stop: int) -> Future[bytes] | None:
        return self.file.fetch(start, stop)

    def hint(self, start: int, stop: int) -> None:
        if self._stream is not None and stop > start:
            self._stream.hint(start, stop)

    def fill(self, start: int = 0, stop: int | None = None) -> None:
        self.file.fill(start, stop)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()


def open_source(path: str | os.PathLike[str], sequential: bool = False) -> ByteSource:
    """The bytes of the input file at ``path`` (a local path, or a path of an object-store mirror).

    Args:
        sequential: the reader reads the file front to back (a remote file is then fetched ahead in blocks; a
            local one gets the kernel's sequential read-ahead).
    """
    remote = remote_file(path)
    if remote is not None:
        return RemoteSource(remote, sequential)
    return LocalSource(Path(path), sequential)
