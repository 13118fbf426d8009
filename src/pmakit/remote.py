"""Object storage (``s3://``, ``gs://``) for merge inputs and outputs: where big runs keep their checkpoints.

Inputs. A remote run or snapshot is presented to the layouts as a local *mirror* (``localize``): its folder tree,
its small files (JSON metadata, DCP ``.metadata``, indexes, configs, tokenizers, Megatron's ``common.pt``)
downloaded whole within the limits table's bounds (larger non-weight objects, logs and event files, left out), and
each large weight or state file (``.safetensors``, ``.distcp``, ``.pt``/``.bin``) a sparse
placeholder of its real size that costs no disk and holds only its head (a safetensors header). Discovery, the
layouts' metadata and the readers' header parsing then run unchanged on the mirror. The readers ask ``lookup``
whether a file is remote and read its bytes from the store instead of the placeholder: ranged GETs on a shared
pool of ``IN_FLIGHT`` threads, each retried and pinned to the version listed: a safetensors file in aligned
``BLOCK_BYTES`` blocks fetched ahead as the merge reads it front to back (``Sequential``), a DCP file one GET per
saved record (``RemoteFile.fetch``, started by the merge's read-ahead hints). Memory: the blocks fetched ahead
(``AHEAD_BLOCKS`` over all inputs), per input the block being read and the chunks in the merge's hands, and for DCP
the saved records of the tensor being merged: independent of the model's size like the local merge, but process
memory where the local merge has page cache, so it grows with N. Records DCP itself must decode (compressed ones) and whole ``torch.save`` files are written into their
placeholder first (``RemoteFile.fill``) and read from there.

Outputs. A merge into a URL is made in a private local staging folder (``staging_dir``: the local merge, with its
resume ledger) and then published (``publish``): every file uploaded in parts (multipart, several parts in flight),
the merge manifest last. A reader of the bucket sees a finished merge only once its manifest is there; publishing
first deletes an older manifest at that URL, then every object under the prefix that is not part of the new merge,
so an interrupted publish leaves nothing that looks complete, a finished one exactly the new merge, and a rerun
with ``--resume`` uploads only what is not there yet (each object carries its sha256). ``check_output`` applies a
folder output's rules first (``pmakit.merge.url`` is the merge's side).

Clients. boto3 for S3 and S3-compatible stores (MinIO, R2, moto), as OLMo-core does; not s3fs, which needs
aiobotocore, and aiobotocore pins botocore to a narrow range (1.43.x for s3fs 2026.9) that would downgrade the
boto3 OLMo-core uses. boto3 reads the standard configuration itself: the credentials chain (environment,
``~/.aws``, SSO, instance roles), ``AWS_PROFILE``, ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` for an
S3-compatible endpoint, ``AWS_MAX_ATTEMPTS`` and ``AWS_RETRY_MODE``. gs:// goes through google-cloud-storage
(application default credentials, ``STORAGE_EMULATOR_HOST``), OLMo-core's client for GCS. Both are imported on
first use: a merge of local files never loads them.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pmakit import limits
from pmakit.checksums import sha256_file
from pmakit.errors import PmakitError

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs")
IN_FLIGHT = 32
"""Ranged GETs in flight at most (the pool's threads; also the S3 client's connection pool)."""
RANGED_SUFFIXES = (".safetensors", ".distcp")
"""Files read by ranged GETs whatever their size: always placeholders in a mirror."""
LARGE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""``torch.save`` files: placeholders when larger than ``SMALL_FILE`` (filled whole when read as weights); any
other file is downloaded."""
SMALL_FILE = 4 * 2**20
HEAD_BYTES = 64 * 2**10
"""What a placeholder holds of its file up front: enough for a typical safetensors header (read whole if longer)."""
PART_BYTES = 64 * 2**20
"""Multipart upload part size."""
SHA256_KEY = "pmakit-sha256"
"""Object metadata: the uploaded file's sha256 (a resumed publish skips objects that already carry the right one)."""

T = TypeVar("T")


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for an ``s3://`` or ``gs://`` URL."""
    return isinstance(location, str) and location.split("://", 1)[0] in SCHEMES and "://" in location


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


def parse(url: str) -> Location:
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme not in SCHEMES or not bucket:
        raise PmakitError(f"{url}: not an object storage URL (s3://BUCKET/PREFIX or gs://BUCKET/PREFIX)")
    return Location(scheme, bucket, key.strip("/"))


# ---------------------------------------------------------------------------------------------------------------
# Stores


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
                raise PmakitError(f"{what}: failed {attempts} times ({type(e).__name__}: {e})") from None
            time.sleep(min(8.0, 0.2 * 2**attempt))
    raise AssertionError("unreachable")


def _check_listing(where: Location, pages: int, objects: int) -> None:
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


class S3Store(Store):
    """S3 and S3-compatible stores through boto3 (see the module docstring for the configuration it reads)."""

    def __init__(self) -> None:
        super().__init__()
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise PmakitError("s3:// needs boto3: pip install -e '.[s3]' in pmakit's checkout") from None

        config = Config(
            max_pool_connections=IN_FLIGHT,
            retries={"mode": os.environ.get("AWS_RETRY_MODE", "standard")},  # max_attempts: AWS_MAX_ATTEMPTS
        )
        try:
            self._client = boto3.session.Session().client("s3", config=config)
        except Exception as e:  # a bad profile or region in the configuration
            raise PmakitError(f"s3: cannot create a client ({type(e).__name__}: {e})") from None
        from boto3.s3.transfer import TransferConfig

        self._transfer = TransferConfig(
            multipart_threshold=PART_BYTES, multipart_chunksize=PART_BYTES, max_concurrency=8
        )

    @functools.cached_property
    def _transient(self) -> tuple[type[BaseException], ...]:
        from botocore.exceptions import ConnectionError, HTTPClientError, ResponseStreamingError
        from urllib3.exceptions import HTTPError

        return (ConnectionError, HTTPClientError, ResponseStreamingError, HTTPError, OSError)

    def _call(self, fn: Callable[[], T], where: Location, what: str) -> T:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return retried(fn, f"{where.url}: {what}", self._transient)
        except NoCredentialsError:
            raise PmakitError(
                f"{where.url}: no AWS credentials found (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or "
                "~/.aws/credentials)"
            ) from None
        except ClientError as e:
            raise PmakitError(f"{where.url}: {what} failed ({_client_error(e)})") from None
        except BotoCoreError as e:
            raise PmakitError(f"{where.url}: {what} failed ({e})") from None

    def listing(self, where: Location) -> list[Listed]:
        prefix = f"{where.key}/" if where.key else ""

        def pages() -> list[Listed]:
            out: list[Listed] = []
            paginator = self._client.get_paginator("list_objects_v2")
            for n, page in enumerate(paginator.paginate(Bucket=where.bucket, Prefix=prefix), 1):
                self.count()
                out += [
                    Listed(str(o["Key"]), int(o["Size"]), o.get("ETag") or None)
                    for o in page.get("Contents", [])
                ]
                _check_listing(where, n, len(out))
            return out

        return self._call(pages, where, "listing")

    def read(self, where: Location, start: int, stop: int, pin: str | None = None) -> bytes:
        seconds = get_seconds()
        condition = {"IfMatch": pin} if pin else {}

        def get() -> bytes:
            self.count()
            response = self._client.get_object(
                Bucket=where.bucket, Key=where.key, Range=f"bytes={start}-{stop - 1}", **condition
            )
            data = read_within(response["Body"], seconds)
            if len(data) != stop - start:
                raise ConnectionError(f"got {len(data)} of {stop - start} bytes")
            return data

        return self._call(get, where, f"reading bytes {start}-{stop}")

    def download(self, where: Location, path: Path) -> None:
        def get() -> None:
            self.count()
            self._client.download_file(where.bucket, where.key, str(path))

        self._call(get, where, "download")

    def upload(self, path: Path, where: Location, sha256: str) -> None:
        def put() -> None:
            self.count(max(1, -(-path.stat().st_size // PART_BYTES)))
            self._client.upload_file(
                str(path),
                where.bucket,
                where.key,
                ExtraArgs={"Metadata": {SHA256_KEY: sha256}},
                Config=self._transfer,
            )

        self._call(put, where, "upload")

    def sha256(self, where: Location) -> str | None:
        from botocore.exceptions import ClientError

        try:
            self.count()
            head = self._client.head_object(Bucket=where.bucket, Key=where.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise PmakitError(f"{where.url}: {_client_error(e)}") from None
        return str(head.get("Metadata", {}).get(SHA256_KEY, ""))

    def delete(self, where: Location) -> None:
        self._call(lambda: self._client.delete_object(Bucket=where.bucket, Key=where.key), where, "delete")

    def check_bucket(self, where: Location) -> None:
        def head() -> None:
            self.count()
            self._client.head_bucket(Bucket=where.bucket)

        self._call(head, Location(where.scheme, where.bucket, ""), "checking the bucket")


def _client_error(e: Any) -> str:
    """One line for a botocore ``ClientError``: what the code means for the user."""
    error = e.response.get("Error", {})
    code = str(error.get("Code", ""))
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("NoSuchBucket",) or (code == "404" and e.operation_name == "HeadBucket"):
        return "no such bucket"
    if code in ("NoSuchKey", "404"):
        return "no such object"
    if code in ("PreconditionFailed", "412"):
        return "changed in the store since pmakit listed it: its ETag no longer matches; merge again"
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "ExpiredToken"):
        return f"access denied: {code} (check the credentials and the bucket's policy)"
    return f"{code or status}: {error.get('Message', '')}".strip()


class GCSStore(Store):
    """Google Cloud Storage through google-cloud-storage (application default credentials;
    ``STORAGE_EMULATOR_HOST`` for an emulator)."""

    def __init__(self) -> None:
        super().__init__()
        try:
            from google.cloud import storage
        except ImportError:
            raise PmakitError(
                "gs:// needs google-cloud-storage: pip install -e '.[s3]' in pmakit's checkout"
            ) from None
        try:
            self._client = storage.Client()
        except Exception as e:  # no default credentials or project
            raise PmakitError(f"gs: cannot create a client ({type(e).__name__}: {e})") from None

    def _call(self, fn: Callable[[], T], where: Location, what: str) -> T:
        from google.api_core import exceptions as gexc

        transient = (
            gexc.ServiceUnavailable,
            gexc.InternalServerError,
            gexc.TooManyRequests,
            ConnectionError,
            OSError,
        )
        try:
            return retried(fn, f"{where.url}: {what}", transient)
        except gexc.PreconditionFailed:
            raise PmakitError(
                f"{where.url}: {what} failed (changed in the store since pmakit listed it: its generation no "
                "longer matches; merge again)"
            ) from None
        except gexc.NotFound:
            raise PmakitError(f"{where.url}: {what} failed (no such bucket or object)") from None
        except (gexc.Forbidden, gexc.Unauthorized) as e:
            raise PmakitError(f"{where.url}: {what} failed (access denied: {e.message})") from None
        except gexc.GoogleAPIError as e:
            raise PmakitError(f"{where.url}: {what} failed ({e})") from None

    def _blob(self, where: Location) -> Any:
        return self._client.bucket(where.bucket).blob(where.key)

    def listing(self, where: Location) -> list[Listed]:
        prefix = f"{where.key}/" if where.key else ""

        def blobs() -> list[Listed]:
            out: list[Listed] = []
            for n, page in enumerate(self._client.list_blobs(where.bucket, prefix=prefix).pages, 1):
                self.count()
                out += [
                    Listed(b.name, int(b.size), str(b.generation) if b.generation else None) for b in page
                ]
                _check_listing(where, n, len(out))
            return out

        return self._call(blobs, where, "listing")

    def read(self, where: Location, start: int, stop: int, pin: str | None = None) -> bytes:
        condition = {"if_generation_match": int(pin)} if pin else {}

        def get() -> bytes:
            self.count()
            data: bytes = self._blob(where).download_as_bytes(
                start=start, end=stop - 1, checksum=None, **condition
            )
            if len(data) != stop - start:
                raise ConnectionError(f"got {len(data)} of {stop - start} bytes")
            return data

        return self._call(get, where, f"reading bytes {start}-{stop}")

    def download(self, where: Location, path: Path) -> None:
        self.count()
        self._call(lambda: self._blob(where).download_to_filename(str(path)), where, "download")

    def upload(self, path: Path, where: Location, sha256: str) -> None:
        def put() -> None:
            self.count(max(1, -(-path.stat().st_size // PART_BYTES)))
            blob = self._blob(where)
            blob.chunk_size = PART_BYTES  # a resumable upload in parts
            blob.metadata = {SHA256_KEY: sha256}
            blob.upload_from_filename(str(path))

        self._call(put, where, "upload")

    def sha256(self, where: Location) -> str | None:
        self.count()
        blob = self._call(lambda: self._client.bucket(where.bucket).get_blob(where.key), where, "stat")
        return None if blob is None else str((blob.metadata or {}).get(SHA256_KEY, ""))

    def delete(self, where: Location) -> None:
        from google.api_core.exceptions import NotFound

        try:
            self._call(lambda: self._blob(where).delete(), where, "delete")
        except PmakitError:
            if self.sha256(where) is not None:
                raise
        except NotFound:
            pass

    def check_bucket(self, where: Location) -> None:
        self.count()
        self._call(
            lambda: self._client.get_bucket(where.bucket), Location(where.scheme, where.bucket, ""), "bucket"
        )


_STORES: dict[str, Store] = {}
_STORES_LOCK = threading.Lock()


def store(scheme: str) -> Store:
    """The process's client for ``scheme`` (made on first use)."""
    with _STORES_LOCK:
        if scheme not in _STORES:
            _STORES[scheme] = S3Store() if scheme == "s3" else GCSStore()
        return _STORES[scheme]


def request_count() -> int:
    """Requests sent to every store so far (benchmarks)."""
    return sum(s.requests for s in _STORES.values())


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="pmakit-get")


# ---------------------------------------------------------------------------------------------------------------
# Inputs: the mirror


@dataclass(frozen=True)
class RemoteFile:
    """A large file of a mirror: its object, size and placeholder."""

    where: Location
    size: int
    placeholder: Path
    pin: str | None = None
    """The version listed (``Listed.pin``): every read asks for it."""

    def read(self, start: int, stop: int) -> bytes:
        return store(self.where.scheme).read(self.where, start, stop, self.pin)

    def fetch(self, start: int, stop: int) -> Future[bytes]:
        """``read`` on the fetch pool: the GET starts now."""
        return _pool().submit(self.read, start, stop)

    def fill(self, start: int = 0, stop: int | None = None) -> None:
        """Write bytes ``[start, stop)`` into the placeholder (for code that reads the file itself), in parts
        fetched in parallel."""
        stop = self.size if stop is None else stop
        key = (start, stop)
        with _FILLED_LOCK:
            if key in _FILLED.setdefault(self.placeholder, set()):
                return
        parts = [(a, min(stop, a + PART_BYTES)) for a in range(start, stop, PART_BYTES)]
        futures = [(a, self.fetch(a, b)) for a, b in parts]
        fd = os.open(self.placeholder, os.O_WRONLY)
        try:
            for a, future in futures:
                os.pwrite(fd, future.result(), a)
        finally:
            os.close(fd)
        with _FILLED_LOCK:
            _FILLED[self.placeholder].add(key)


BLOCK_BYTES = 16 * 2**20
"""The ranges a file read front to back is fetched in (``Sequential``), aligned to the file: one merge chunk of
bf16. Whole aligned blocks rather than one GET per tensor chunk: a model's many small tensors (norms, a 1024-wide
attention's 2 MiB projections) would otherwise each be a request, and a store's time per request dominates them."""


class Sequential:
    """Reads of one remote file that move front to back (a merge reads each input in its on-disk order), served
    from aligned blocks of ``BLOCK_BYTES`` fetched ahead on the pool: the GETs of the GET floor, the same size and as
    many in flight. The streams being read keep ``AHEAD_BLOCKS`` blocks ahead together (at least two each); a
    block is dropped once a read reaches its end or starts past it. A read far ahead moves the stream there; a read
    behind the blocks held is a GET of its own."""

    def __init__(self, remote: RemoteFile) -> None:
        self.remote = remote
        self._blocks: dict[int, Future[bytes]] = {}
        self._next = -1
        """The next block to start; -1: none started yet."""
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
        lo = start - first * BLOCK_BYTES
        if len(parts) == 1:
            return parts[0][lo : lo + stop - start]
        joined = b"".join(parts)
        return memoryview(joined)[lo : lo + stop - start]

    def _advance(self, start: int, stop: int) -> bool:
        """Start the blocks ``[start, stop)`` needs and the stream's share ahead of it; False (nothing started) for a
        range behind the blocks held: the caller GETs it on its own."""
        first = start // BLOCK_BYTES
        if self._next == -1 or first > self._next + 2:  # the first read, or past unread bytes: start there
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
            self._next = first
        elif first < self._next and first not in self._blocks:
            return False
        with _STREAMS_LOCK:
            _STREAMS.add(self)
            share = max(2, AHEAD_BLOCKS // len(_STREAMS))
        end = min(self.remote.size, max(stop, start + share * BLOCK_BYTES))
        while self._next * BLOCK_BYTES < end:
            a = self._next * BLOCK_BYTES
            self._blocks[self._next] = self.remote.fetch(a, min(self.remote.size, a + BLOCK_BYTES))
            self._next += 1
        if self._next * BLOCK_BYTES >= self.remote.size:  # all started: no share of the pool needed any more
            with _STREAMS_LOCK:
                _STREAMS.discard(self)
        return True

    def close(self) -> None:
        with self._lock:
            for future in self._blocks.values():
                future.cancel()
            self._blocks.clear()
        with _STREAMS_LOCK:
            _STREAMS.discard(self)


AHEAD_BLOCKS = IN_FLIGHT * 3 // 2
"""Blocks fetched ahead over all streams: in flight or fetched and not yet read. More than the pool's ``IN_FLIGHT``
GETs, so that blocks fetched early (a stream waits for the slowest of the N) do not leave the pool idle."""
_STREAMS: set[Sequential] = set()
_STREAMS_LOCK = threading.Lock()


_FILES: dict[Path, RemoteFile] = {}
_ROOTS: dict[Path, str] = {}
_FILLED: dict[Path, set[tuple[int, int]]] = {}
_FILLED_LOCK = threading.Lock()


def lookup(path: Path) -> RemoteFile | None:
    """The remote file a mirror's placeholder stands for; None for any other file (a local file, or a small file
    of a mirror, downloaded whole). A dictionary lookup: free on the local path."""
    if not _FILES:
        return None
    return _FILES.get(Path(os.path.abspath(path)))


def origin(path: Path) -> str:
    """Where ``path`` really is: the URL of a mirrored file or folder, else its resolved local path."""
    absolute = Path(os.path.abspath(path))
    for root, url in _ROOTS.items():
        if absolute == root or root in absolute.parents:
            rel = absolute.relative_to(root).as_posix()
            return url if rel == "." else f"{url}/{rel}"
    return str(path.resolve())


def localize(url: str) -> Path:
    """A local mirror of the run or snapshot at ``url`` (see the module docstring); removed at exit.

    Only what the layouts and the output can use is fetched: weight files are placeholders holding their heads,
    other objects are downloaded up to ``limits.REMOTE_FILE_BYTES`` each (``DCP_METADATA_BYTES`` for a DCP
    ``.metadata``) and ``limits.REMOTE_FETCH_BYTES`` in all; larger ones (logs, event files) are left out. Every
    read is pinned to the version listed. Keys that cannot be a file of the mirror are left out with one warning.
    """
    where = parse(url)
    s = store(where.scheme)
    s.check_bucket(where)
    objects = s.listing(where)
    if not objects:
        raise PmakitError(f"{where.url}: nothing stored under this prefix")
    files, left_out = _mirror_entries(objects, f"{where.key}/" if where.key else "")
    if left_out:
        parts = [f"{len(keys):,} {why} (e.g. {keys[0]!r})" for why, keys in left_out.items()]
        log.warning("%s: left out of the local mirror: %s", where.url, "; ".join(parts))
    base = Path(tempfile.mkdtemp(prefix="pmakit-remote-"))
    atexit.register(shutil.rmtree, base, True)
    root = base / (where.key.rsplit("/", 1)[-1] or where.bucket)
    root.mkdir()
    _ROOTS[root] = where.url
    for folder in sorted({rel.rsplit("/", 1)[0] for rel in files if "/" in rel}):
        (root / folder).mkdir(parents=True, exist_ok=True)
    downloads: list[Future[None]] = []
    fetched = 0
    try:
        for rel, obj in files.items():
            target = root / rel
            remote = RemoteFile(Location(where.scheme, where.bucket, obj.key), obj.size, target, obj.pin)
            if _is_weight_file(target.name, obj.size):
                with open(target, "wb") as f:
                    f.truncate(obj.size)
                _FILES[target] = remote
                if target.suffix == ".safetensors":
                    downloads.append(_pool().submit(_fill_head, remote))
                continue
            fetched += obj.size
            if fetched > limits.REMOTE_FETCH_BYTES.value:
                raise limits.refuse(limits.REMOTE_FETCH_BYTES, f"{where.url}: its non-weight objects")
            downloads.append(_pool().submit(_download, remote))
        for future in downloads:
            future.result()
    except BaseException:
        for future in downloads:
            future.cancel()
        raise
    return root


def _is_weight_file(name: str, size: int) -> bool:
    suffix = os.path.splitext(name)[1]
    return suffix in RANGED_SUFFIXES or (size > SMALL_FILE and suffix in LARGE_SUFFIXES)


def _mirror_entries(objects: list[Listed], prefix: str) -> tuple[dict[str, Listed], dict[str, list[str]]]:
    """The objects that become files of the mirror, by their path in it, and those left out by reason. Left out:
    keys outside the prefix, names that would leave the mirror (``..``, ``.``, empty parts from ``//``), keys
    deeper than ``limits.REMOTE_KEY_DEPTH`` or with a part too long for a file name, a key that is also a folder
    of other keys (the folder is kept), and non-weight objects over their size limit."""
    kept: dict[str, Listed] = {}
    left_out: dict[str, list[str]] = {}
    for obj in objects:
        rel = obj.key[len(prefix) :] if obj.key.startswith(prefix) else None
        parts = rel.split("/") if rel else []
        if rel is None:
            why = "outside the prefix"
        elif not rel or rel.endswith("/"):
            continue  # folder markers
        elif any(p in ("", ".", "..") for p in parts):
            why = "with names that would leave the mirror ('..', '.', '//')"
        elif len(parts) - 1 > limits.REMOTE_KEY_DEPTH.value or len(rel.encode()) > 1024:
            why = f"deeper than {limits.REMOTE_KEY_DEPTH.name} = {limits.REMOTE_KEY_DEPTH.value} or over 1,024 bytes"
        elif not _is_weight_file(parts[-1], obj.size) and obj.size > _file_limit(parts[-1]).value:
            limit = _file_limit(parts[-1])
            why = f"non-weight objects over {limit.name} = {limit.value:,} bytes"
        else:
            kept[rel] = obj
            continue
        left_out.setdefault(why, []).append(obj.key)
    folders = {"/".join(rel.split("/")[:i]) for rel in kept for i in range(1, rel.count("/") + 1)}
    for rel in sorted(folders.intersection(kept)):
        left_out.setdefault("both a file and a folder of other keys", []).append(kept.pop(rel).key)
    return kept, left_out


def _file_limit(name: str) -> limits.Limit:
    return limits.DCP_METADATA_BYTES if name.endswith(".metadata") else limits.REMOTE_FILE_BYTES


def _download(remote: RemoteFile) -> None:
    """A small file of the mirror, whole, in ranged GETs of the version listed."""
    fd = os.open(remote.placeholder, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in range(0, remote.size, PART_BYTES):
            os.pwrite(fd, remote.read(a, min(remote.size, a + PART_BYTES)), a)
    finally:
        os.close(fd)


def _fill_head(remote: RemoteFile) -> None:
    """A safetensors placeholder's header (8-byte length + JSON), so that the reader parses it as it is. A length
    over ``limits.SAFETENSORS_HEADER_BYTES`` is refused before its bytes are asked for."""
    head = remote.read(0, min(remote.size, HEAD_BYTES))
    claimed = int.from_bytes(head[:8], "little") if len(head) >= 8 else 0
    if claimed > limits.SAFETENSORS_HEADER_BYTES.value:
        raise limits.refuse(
            limits.SAFETENSORS_HEADER_BYTES, f"{remote.where.url}'s header ({claimed:,} bytes)"
        )
    n = claimed + 8
    if n > len(head) and n <= remote.size:
        head += remote.read(len(head), n)
    with open(remote.placeholder, "r+b") as f:
        f.write(head)


def localize_all(locations: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Command-line locations as local paths: URLs mirrored (``localize``), local paths as they are."""
    return [localize(x) if isinstance(x, str) and is_remote(x) else Path(x) for x in locations]


# ---------------------------------------------------------------------------------------------------------------
# Outputs


STAGED = "merged"
"""The merge's folder inside its staging folder (a fixed name: the staging folder is all this merge's own)."""


def output_location(url: str) -> Location:
    """Where a merge into ``url`` writes: its key with ``//``, ``.`` segments and a trailing slash folded away (object
    stores would keep them literally, as other keys). A ``..`` segment (literal to the store, a parent to a reader)
    and a bucket's root (``--force`` would replace the whole bucket) are refused."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    parts = key.split("/")
    if ".." in parts:
        raise PmakitError(
            f"{url}: '..' in an object key is ambiguous (the store keeps it literally); name the prefix"
        )
    where = parse(f"{scheme}://{bucket}/{'/'.join(p for p in parts if p not in ('', '.'))}")
    if not where.key:
        raise PmakitError(
            f"{where.url}: a merge goes under a prefix (BUCKET/PREFIX), never at a bucket's root"
        )
    return where


def _segments(url: str) -> tuple[str, str, tuple[str, ...]]:
    """``(scheme, bucket, key segments)`` as a path: empty and ``.`` segments dropped, ``..`` taking the one
    before it; only for comparing where things are."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    parts: list[str] = []
    for part in key.split("/"):
        if part == "..":
            parts = parts[:-1]
        elif part not in ("", "."):
            parts.append(part)
    return scheme, bucket, tuple(parts)


def overlap(url: str, inputs: Iterable[str | os.PathLike[str]]) -> str | None:
    """Why an output at ``url`` would touch one of ``inputs`` (it is one, lies inside one or contains one; compared
    after normalising keys), or None. A local path never overlaps a URL."""
    scheme, bucket, out = _segments(url)
    for item in inputs:
        if not (isinstance(item, str) and is_remote(item)):
            continue
        s, b, key = _segments(item)
        if (s, b) != (scheme, bucket):
            continue
        if key == out:
            return f"it is the input {item}"
        if out[: len(key)] == key:
            return f"it is inside the input {item}"
        if key[: len(out)] == out:
            return f"it contains the input {item}"
    return None


def input_urls(paths: Iterable[Path]) -> list[str]:
    """The URLs a merge of mirrored ``paths`` reads: each one's own and the URL it was mirrored from (a run given
    as input: an output inside it would land among its snapshots)."""
    urls = []
    for path in paths:
        absolute = Path(os.path.abspath(path))
        for root, url in _ROOTS.items():
            if absolute == root or root in absolute.parents:
                urls += [url, origin(path)]
    return urls


def staging_dir(url: str, key: str) -> Path:
    """The local folder a merge into ``url`` is made in (in ``STAGED`` inside it) before it is published: the same
    for a rerun of the same merge (``key``: its inputs and options), so that ``--resume`` continues it.

    ``$PMAKIT_STAGING`` (default: the temporary folder) ``/pmakit-staging-<uid>/<digest>``, both private to this
    user (0700) and made without following a link: a link or another user's folder planted there is refused, so no
    one can redirect the merge's files, its lock or its removal, or read the weights.
    """
    digest = hashlib.sha256(f"{url}\0{key}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("PMAKIT_STAGING") or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return _private_dir(_private_dir(root / f"pmakit-staging-{os.getuid()}") / digest)


def _private_dir(path: Path) -> Path:
    """``path`` as a folder of this user's, mode 0700: made if missing, refused if it is a link, not a folder or
    another user's (checked on the folder opened without following links)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise PmakitError(f"refusing the staging folder {path}: it is a link or not a folder") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise PmakitError(
                f"refusing the staging folder {path}: it belongs to another user (uid {info.st_uid})"
            )
        if info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def remove_staging(folder: Path) -> None:
    """Remove a merge's own staging folder (what ``staging_dir`` returned) and nothing else."""
    if folder.parent.name != f"pmakit-staging-{os.getuid()}" or folder.is_symlink():
        raise AssertionError(f"not a staging folder: {folder}")
    shutil.rmtree(folder, ignore_errors=True)


def check_output(
    url: str, manifest: str, force: bool, resume: bool, inputs: Iterable[str | os.PathLike[str]] = ()
) -> Location:
    """Before merging hours into ``url`` (returned normalised, see ``output_location``): it does not overlap an
    input URL, the bucket is there and usable, and what is under the prefix may be replaced: a finished merge (its
    ``manifest``) only with ``force``, anything pmakit did not write only with ``force`` (``resume`` continues a
    cut publish: objects that all carry pmakit's sha256)."""
    where = output_location(url)
    why = overlap(where.url, inputs)
    if why is not None:
        raise PmakitError(f"refusing to write {where.url}: {why}")
    s = store(where.scheme)
    s.check_bucket(where)
    if force:
        return where
    listed = s.list(where)
    objects = [Location(where.scheme, where.bucket, k) for k, n in listed if not (n == 0 and k.endswith("/"))]
    if not objects:  # nothing, or only the empty "folder" markers consoles create
        return where
    if where.child(manifest) in objects:  # finished: nothing to resume (a cut publish deletes it first)
        raise PmakitError(f"{where.url}: holds a finished merge already; pass --force to replace it")
    if resume and len(objects) <= 10_000 and all(s.sha256(o) for o in objects):
        return where
    what = (
        "not all uploaded by pmakit"
        if resume
        else "files pmakit did not write, or a cut publish (see --resume)"
    )
    raise PmakitError(
        f"refusing to write {where.url}: it holds {len(objects)} object(s) and no {manifest} ({what}); pass --force "
        "to replace everything under it"
    )


def publish(local: Path, url: str, manifest: str, resume: bool) -> list[str]:
    """Upload the finished merge in ``local`` to ``url``, its ``manifest`` last; returns the keys written.

    An older manifest at ``url`` is deleted first, then every object under the prefix that is not part of this
    merge (what a ``--force`` replaces: an older merge's other shards and index): until the new manifest is written
    the URL holds no finished merge, and once it is, exactly this one. With ``resume``, objects that already carry
    the sha256 of their file are not uploaded again.
    """

    where = output_location(url)
    s = store(where.scheme)
    s.delete(where.child(manifest))
    files = sorted(
        p
        for p in local.rglob("*")
        if p.is_file()
        and p.name != manifest
        and not any(x.startswith(".pmakit") for x in p.relative_to(local).parts)
    )
    keep = {where.child(p.relative_to(local).as_posix()).key for p in files} | {where.child(manifest).key}
    stale = [Location(where.scheme, where.bucket, k) for k, _ in s.list(where) if k not in keep]

    def put(path: Path) -> str:
        rel = path.relative_to(local).as_posix()
        digest = sha256_file(path)
        target = where.child(rel)
        if not (resume and s.sha256(target) == digest):
            s.upload(path, target, digest)
        return rel

    with ThreadPoolExecutor(4, thread_name_prefix="pmakit-put") as pool:
        list(pool.map(s.delete, stale))
        written = list(pool.map(put, files))
    s.upload(local / manifest, where.child(manifest), sha256_file(local / manifest))
    return [*written, manifest]
