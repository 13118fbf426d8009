"""What every object store's client is: ``Location`` (bucket + key), ``Listed`` (an object and the version that
pins it), the ``Store`` interface, and the retry and deadline rules every client's reads follow."""

from __future__ import annotations

import os
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pmakit import limits
from pmakit.errors import Interrupted, PmakitError

IN_FLIGHT = 32
"""Ranged GETs in flight at most (the pool's threads; also the S3 client's connection pool)."""
PART_BYTES = 64 * 2**20
"""Multipart upload part size."""
SHA256_KEY = "pmakit-sha256"
"""Object metadata: the uploaded file's sha256 (a resumed publish skips objects that already carry the right one)."""

T = TypeVar("T")


class StoreUnreachable(Interrupted):
    """A store that did not answer after every retry (the connection refused or cut, a 5xx answer): a cut, not a
    bad input. A merge reading from it keeps its finished shards for the same command (``--resume``) to continue."""


@dataclass(frozen=True)
class Location:
    scheme: str
    bucket: str
    key: str
    """The object key or prefix, without a trailing slash ('' for the whole bucket)."""

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}".rstrip("/")

    def child(self, name: str) -> Location:
        return Location(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)


class Listed(NamedTuple):
    """One object of a listing."""

    key: str
    size: int
    pin: str | None
    """What names this version of the object, sent with every read of it so that a rewritten object is an error:
    S3's ETag (``If-Match``), GCS's generation (``ifGenerationMatch``); None when the store gave none."""


class Store(ABC):
    """One object store's client: list, ranged read, download, upload, delete; every failure a ``PmakitError``
    naming the URL. Thread safe (the readers call ``read`` from the fetch pool)."""

    def __init__(self) -> None:
        self.requests = 0
        """Requests sent (for benchmarks)."""
        self._lock = threading.Lock()

    def count(self, n: int = 1) -> None:
        with self._lock:
            self.requests += n

    @abstractmethod
    def listing(self, where: Location) -> list[Listed]:
        """Every object under the prefix ``where`` (recursively), at most ``limits.REMOTE_OBJECTS`` of them in at
        most ``limits.REMOTE_LIST_PAGES`` pages (a listing that goes on for ever is one line)."""

    def list(self, where: Location) -> list[tuple[str, int]]:
        """(key, size) of every object under the prefix ``where`` (recursively)."""
        return [(o.key, o.size) for o in self.listing(where)]

    @abstractmethod
    def read(self, where: Location, start: int, stop: int, pin: str | None = None) -> bytes:
        """Bytes ``[start, stop)`` of an object (one ranged GET, retried); with ``pin`` (its ``Listed.pin``),
        only of that version of it: a changed object is one line."""

    @abstractmethod
    def download(self, where: Location, path: Path) -> None: ...

    @abstractmethod
    def upload(self, path: Path, where: Location, sha256: str) -> None: ...

    @abstractmethod
    def sha256(self, where: Location) -> str | None:
        """The sha256 an object was uploaded with, '' for an object without one, None when there is none."""

    @abstractmethod
    def delete(self, where: Location) -> None: ...

    @abstractmethod
    def check_bucket(self, where: Location) -> None:
        """Fail with one line unless the bucket exists and the credentials may use it."""


def _attempts() -> int:
    try:
        return max(1, int(os.environ.get("AWS_MAX_ATTEMPTS", "5")))
    except ValueError:
        return 5


def retried(fn: Callable[[], T], what: str, transient: tuple[type[BaseException], ...]) -> T:
    """``fn()``, tried ``AWS_MAX_ATTEMPTS`` times (default 5) with exponential backoff on ``transient`` errors:
    the clients retry a request that fails, but not a response body that breaks off halfway."""
    attempts = _attempts()
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except transient as e:
            if attempt == attempts:
                raise StoreUnreachable(f"{what}: failed {attempts} times ({type(e).__name__}: {e})") from None
            time.sleep(min(8.0, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def check_listing(where: Location, pages: int, objects: int) -> None:
    if pages > limits.REMOTE_LIST_PAGES.value:
        raise limits.refuse(limits.REMOTE_LIST_PAGES, f"{where.url}: the listing")
    if objects > limits.REMOTE_OBJECTS.value:
        raise limits.refuse(limits.REMOTE_OBJECTS, f"{where.url}: the listing")


def get_seconds() -> float:
    """The deadline of one GET's whole response: ``PMAKIT_GET_SECONDS``, else ``limits.REMOTE_GET_SECONDS``."""
    text = os.environ.get("PMAKIT_GET_SECONDS", "")
    if not text:
        return float(limits.REMOTE_GET_SECONDS.value)
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise PmakitError(f"PMAKIT_GET_SECONDS={text!r}: expected a number of seconds above 0")
    return seconds


def read_within(body: Any, seconds: float) -> bytes:
    """The whole of a streamed response ``body`` (botocore's ``StreamingBody``), given up after ``seconds`` in all
    (``TimeoutError``, which the caller retries): the client's read timeout applies to each read, so a server
    sending a byte a second would hold a GET for ever. At the deadline the connection's socket is shut down, which
    ends the blocked read."""
    expired = threading.Event()

    def cut() -> None:
        expired.set()
        raw = getattr(body, "_raw_stream", None)
        sock = getattr(getattr(raw, "connection", None), "sock", None)
        try:
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
            else:
                body.close()
        except OSError:
            pass

    timer = threading.Timer(seconds, cut)
    timer.daemon = True
    timer.start()
    try:
        data: bytes = body.read()
    except Exception:
        if not expired.is_set():
            raise
        data = b""
    finally:
        timer.cancel()
    if expired.is_set():
        raise TimeoutError(f"no whole response within {seconds:g} s")
    return data
