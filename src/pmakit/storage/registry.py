"""The URL schemes pmakit reads and writes, each with the client that serves it (made on first use, one a process:
its connection pool), and the pool of threads that keeps ranged GETs in flight."""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pmakit.errors import PmakitError
from pmakit.storage.base import IN_FLIGHT, Location, Store


def _s3() -> Store:
    from pmakit.storage.s3 import S3Store

    return S3Store()


def _gcs() -> Store:
    from pmakit.storage.gcs import GCSStore

    return GCSStore()


SCHEMES: dict[str, Callable[[], Store]] = {"s3": _s3, "gs": _gcs}
"""URL scheme -> the factory of its client. A new store is one module with a ``Store`` and one line here."""


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for an ``s3://`` or ``gs://`` URL (a ``Path`` never is one: it folds ``//``)."""
    return isinstance(location, str) and "://" in location and location.split("://", 1)[0] in SCHEMES


def parse(url: str) -> Location:
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in SCHEMES or not bucket:
        raise PmakitError(f"{url}: not an object storage URL (s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)")
    if "?" in rest or "#" in rest:  # a signed URL's query would become part of the keys, and be printed
        raise PmakitError(
            f"{url}: an object storage URL takes no query or fragment (s3://BUCKET/PREFIX or gs://BUCKET/PREFIX; "
            "credentials come from the environment)"
        )
    return Location(scheme, bucket, key.strip("/"))


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def store(scheme: str) -> Store:
    """The process's client for ``scheme`` (made on first use)."""
    with _STORES_LOCK:
        if scheme not in _STORES:
            _STORES[scheme] = SCHEMES[scheme]()
        return _STORES[scheme]


def request_count() -> int:
    """Requests sent to every store so far (benchmarks)."""
    return sum(s.requests for s in _STORES.values())


@functools.cache
def pool() -> ThreadPoolExecutor:
    """The ranged GETs' threads, shared by every file read (``IN_FLIGHT`` of them)."""
    return ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="pmakit-get")
