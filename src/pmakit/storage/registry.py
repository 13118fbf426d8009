"""The URL schemes pmakit reads and writes, each with the client that serves it (made on first use, one a process:
its connection pool), and the pool of threads that keeps ranged GETs in flight (``GetPool``: the GET the merge needs
soonest goes first)."""

from __future__ import annotations

import collections
import functools
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

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


R = TypeVar("R")


class GetPool:
    """Threads that run GETs, the most urgent first: each job may carry ``rank``, a function read when a thread
    becomes free (lower first; jobs without one rank 0, in the order submitted). A merge's inputs are read side by
    side, so the block a reader needs next is ``rank`` 0 and the ones behind it 1, 2, ...: with a first-come queue,
    the first input's whole file went before the last input's first block, and the fold waited for the last input
    while GETs of bytes needed late filled the pool. The threads are daemons: a process that ends (after an error)
    does not wait for GETs in flight, whose bytes nobody reads."""

    def __init__(self, workers: int, name: str) -> None:
        self._workers, self._name = workers, name
        self._ranked: list[tuple[Callable[[], int], int, Future[Any], Callable[[], Any]]] = []
        """Jobs with a rank: the blocks fetched ahead (``AHEAD_BLOCKS`` or so), scanned at each pick."""
        self._queued: collections.deque[tuple[int, Future[Any], Callable[[], Any]]] = collections.deque()
        """Jobs without one (rank 0), first come first served: a mirror's thousands of small files stay O(1)."""
        self._order = itertools.count()
        self._ready = threading.Condition()
        self._threads = 0
        self._idle = 0

    def submit(self, fn: Callable[..., R], *args: Any, rank: Callable[[], int] | None = None) -> Future[R]:
        future: Future[R] = Future()
        job, order = functools.partial(fn, *args), next(self._order)
        with self._ready:
            if rank is None:
                self._queued.append((order, future, job))
            else:
                self._ranked.append((rank, order, future, job))
            waiting = len(self._queued) + len(self._ranked)
            if waiting > self._idle and self._threads < self._workers:  # nobody free to take it
                self._threads += 1
                name = f"{self._name}_{self._threads}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
            self._ready.notify()
        return future

    def _next(self) -> tuple[Future[Any], Callable[[], Any]]:
        with self._ready:
            self._idle += 1
            while not self._queued and not self._ranked:
                self._ready.wait()
            self._idle -= 1
            best = None
            if self._ranked:
                keys = [(rank(), order) for rank, order, _, _ in self._ranked]
                best = min(range(len(keys)), key=keys.__getitem__)
            if best is None or (self._queued and (0, self._queued[0][0]) < keys[best]):
                _, future, job = self._queued.popleft()
            else:
                _, _, future, job = self._ranked.pop(best)
            return future, job

    def _run(self) -> None:
        while True:
            future, job = self._next()
            if not future.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                result = job()
            except BaseException as e:  # the caller's .result() raises it
                future.set_exception(e)
            else:
                future.set_result(result)
            del future, job  # the bytes go with the caller's future, not this thread's frame


@functools.cache
def pool() -> GetPool:
    """The ranged GETs' threads, shared by every file read (``IN_FLIGHT`` of them)."""
    return GetPool(IN_FLIGHT, "pmakit-get")
