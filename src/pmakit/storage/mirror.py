"""A remote run or snapshot as a local *mirror* (``localize``), which discovery, the layouts and the readers' header
parsing use as they use any folder.

The mirror holds the folder tree, the small files (JSON metadata, DCP ``.metadata``, indexes, configs, tokenizers,
Megatron's ``common.pt``) downloaded whole within the limits table's bounds (larger non-weight objects, logs and
event files, left out), and each large weight or state file (``.safetensors``, ``.distcp``, ``.pt``/``.bin``) as
a sparse placeholder of its real size that costs no disk and holds only its head (a safetensors header). Beside the
tree, in the mirror's own private folder, a record per placeholder names its object and the version listed: a
reader's ``pmakit.storage.source.open_source`` finds it there and reads the bytes from the store. The mirror knows
itself from its files (no table in the process): a path is a mirror's when a folder above it is a mirror folder
(``MIRROR_PREFIX``, this user's, private) holding ``MIRROR_FILE``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.storage.base import PART_BYTES, Listed, Location
from pmakit.storage.registry import parse, pool, store

log = logging.getLogger(__name__)

RANGED_SUFFIXES = (".safetensors", ".distcp")
"""Files read by ranged GETs whatever their size: always placeholders in a mirror."""
LARGE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
"""``torch.save`` files: placeholders when larger than ``SMALL_FILE`` (filled whole when read as weights); any
other file is downloaded."""
SMALL_FILE = 4 * 2**20
HEAD_BYTES = 64 * 2**10
"""What a placeholder holds of its file up front: enough for a typical safetensors header (read whole if longer)."""
MIRROR_PREFIX = "pmakit-remote-"
"""The name of a mirror's private folder starts so (a temporary folder: removed at exit)."""
MIRROR_FILE = "mirror.json"
"""In the private folder: the URL mirrored and the name of the tree beside it."""
TREE = "tree"
"""In the private folder: the folder the mirrored tree is made in (so that no key's name meets the files above)."""
RECORDS = "objects"
"""In the private folder: one JSON record per placeholder, at the placeholder's path (``<name>.json``), and the
byte ranges already written into it (``<name>.filled``)."""


@dataclass(frozen=True)
class RemoteFile:
    """A large file of a mirror: its object, size and placeholder."""

    where: Location
    size: int
    placeholder: Path
    pin: str | None = None
    """The version listed (``Listed.pin``): every read asks for it."""
    record: Path | None = None
    """Its record in the mirror (``RECORDS``); the ranges ``fill`` wrote are noted beside it."""

    def read(self, start: int, stop: int) -> bytes:
        return store(self.where.scheme).read(self.where, start, stop, self.pin)

    def fetch(self, start: int, stop: int, rank: Callable[[], int] | None = None) -> Future[bytes]:
        """``read`` on the fetch pool: the GET starts when a thread is free, the lowest ``rank`` first (see
        ``GetPool``)."""
        return pool().submit(self.read, start, stop, rank=rank)

    def filled(self) -> set[tuple[int, int]]:
        """The ranges written into the placeholder so far (by any reader of this mirror)."""
        if self.record is None or not (marks := self.record.with_suffix(".filled")).exists():
            return set()
        pairs = (line.split() for line in marks.read_text().splitlines())
        return {(int(a), int(b)) for a, b in pairs}

    def fill(self, start: int = 0, stop: int | None = None) -> None:
        """Write bytes ``[start, stop)`` into the placeholder (for code that reads the file itself), in parts
        fetched in parallel; once per range and mirror."""
        stop = self.size if stop is None else stop
        if (start, stop) in self.filled():
            return
        parts = [(a, min(stop, a + PART_BYTES)) for a in range(start, stop, PART_BYTES)]
        futures = [(a, self.fetch(a, b)) for a, b in parts]
        fd = os.open(self.placeholder, os.O_WRONLY)
        try:
            for a, future in futures:
                os.pwrite(fd, future.result(), a)
        finally:
            os.close(fd)
        if self.record is not None:  # one short appended line: whole even when two threads note at once
            with open(self.record.with_suffix(".filled"), "a") as f:
                f.write(f"{start} {stop}\n")


def _mirror_folder(path: str | os.PathLike[str]) -> tuple[Path, Path] | None:
    """(the private folder of the mirror ``path`` lies in, ``path`` made absolute), or None: a string test on the
    path's parents, then one ``lstat`` where one is named like a mirror's (a folder of another user's, or one
    others may write, is not trusted as one)."""
    absolute = Path(os.path.abspath(path))
    for folder in absolute.parents:
        if not folder.name.startswith(MIRROR_PREFIX):
            continue
        try:
            info = os.lstat(folder)
        except OSError:
            return None
        mine = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022
        return (folder, absolute) if mine and (folder / MIRROR_FILE).is_file() else None
    return None


def remote_file(path: str | os.PathLike[str]) -> RemoteFile | None:
    """The object a mirror's placeholder stands for; None for any other file (a local file, or a small file of a
    mirror, downloaded whole)."""
    found = _mirror_folder(path)
    if found is None:
        return None
    folder, absolute = found
    if folder / TREE not in absolute.parents:
        return None
    record = folder / RECORDS / f"{absolute.relative_to(folder / TREE).as_posix()}.json"
    if not record.is_file():
        return None
    r = json.loads(record.read_text())
    where = Location(r["scheme"], r["bucket"], r["key"])
    return RemoteFile(where, int(r["size"]), absolute, r["pin"], record)


def _mirrored(path: str | os.PathLike[str]) -> tuple[str, str] | None:
    """(the URL mirrored, ``path``'s place in the mirror's tree as a relative POSIX path) for a path of a mirror."""
    found = _mirror_folder(path)
    if found is None:
        return None
    folder, absolute = found
    mirror = json.loads((folder / MIRROR_FILE).read_text())
    root = folder / TREE / str(mirror["root"])
    if absolute != root and root not in absolute.parents:
        return None
    return str(mirror["url"]), absolute.relative_to(root).as_posix()


def origin(path: str | os.PathLike[str]) -> str:
    """Where ``path`` really is: the URL of a mirrored file or folder, else its resolved local path."""
    found = _mirrored(path)
    if found is None:
        return str(Path(path).resolve())
    url, rel = found
    return url if rel == "." else f"{url}/{rel}"


def input_urls(paths: Iterable[str | os.PathLike[str]]) -> list[str]:
    """The URLs a merge of mirrored ``paths`` reads: each one's own and the URL it was mirrored from (a run given
    as input: an output inside it would land among its snapshots)."""
    urls = []
    for path in paths:
        found = _mirrored(path)
        if found is not None:
            urls += [found[0], origin(path)]
    return urls


def localize(url: str) -> Path:
    """A local mirror of the run or snapshot at ``url`` (see the module docstring); removed at exit.

    Only what the layouts and the output can use is fetched: weight files are placeholders holding their heads,
    other objects are downloaded up to ``limits.REMOTE_FILE_BYTES`` each (``DCP_METADATA_BYTES`` for a DCP
    ``.metadata``) and ``limits.REMOTE_FETCH_BYTES`` in all; larger ones (logs, event files) are left out. Every
    read is pinned to the version listed. Keys that cannot be a file of the mirror are left out with one warning.
    A mirror ``prefetch`` began for the same URL is taken (once) rather than made again.
    """
    with _PREFETCH_LOCK:
        started = _PREFETCHED.pop(parse(url).url, None)
    root, warning = started.result() if started is not None else _mirror(url)
    if warning:
        log.warning("%s", warning)
    return root


def prefetch(urls: Iterable[str]) -> None:
    """Begin mirroring ``urls`` in a background thread, for a ``localize`` to come: a command that merges remote
    inputs starts them while torch imports (0.8-1.8 s here), and the listing, headers and small files arrive
    meanwhile. The store's client is made here, in the calling thread, so that no module is imported by the
    background thread while the caller imports others (two threads importing at once can deadlock on a circular
    import); the thread only sends requests. Errors are kept for that ``localize`` (raised there, as its own); a URL
    never localized costs its listing, and its folder goes at exit like any mirror's."""
    fresh = []
    for url in urls:
        try:
            where = parse(url)
            store(where.scheme)
        except Exception:  # a bad URL or a client that cannot be made: said by the localize of it
            continue
        with _PREFETCH_LOCK:
            if where.url not in _PREFETCHED:
                _PREFETCHED[where.url] = Future()
                fresh.append((url, _PREFETCHED[where.url]))
    if fresh:
        threading.Thread(target=_prefetch, args=(fresh,), name="pmakit-prefetch", daemon=True).start()


def _prefetch(jobs: list[tuple[str, Future[tuple[Path, str | None]]]]) -> None:
    for url, future in jobs:
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(_mirror(url))
        except BaseException as e:  # the localize that takes it raises it
            future.set_exception(e)


_PREFETCHED: dict[str, Future[tuple[Path, str | None]]] = {}
_PREFETCH_LOCK = threading.Lock()
_FOLDERS: list[Path] = []
"""Every mirror folder this process made: removed at exit (``_remove_all``)."""
_CLOSING = threading.Event()


def _mirror(url: str) -> tuple[Path, str | None]:
    """``localize``'s work: (the mirror's root, a warning naming what was left out, if anything was)."""
    where = parse(url)
    s = store(where.scheme)
    s.check_bucket(where)
    objects = s.listing(where)
    if not objects:
        raise PmakitError(f"{where.url}: nothing stored under this prefix")
    files, left_out = _mirror_entries(objects, f"{where.key}/" if where.key else "")
    warning = None
    if left_out:
        parts = [f"{len(keys):,} {why} (e.g. {keys[0]!r})" for why, keys in left_out.items()]
        warning = f"{where.url}: left out of the local mirror: {'; '.join(parts)}"
    with _PREFETCH_LOCK:
        if _CLOSING.is_set():
            raise PmakitError(f"{where.url}: the process is ending")
        folder = Path(tempfile.mkdtemp(prefix=MIRROR_PREFIX))  # 0700, this user's
        _FOLDERS.append(folder)
    name = where.key.rsplit("/", 1)[-1] or where.bucket
    (folder / MIRROR_FILE).write_text(json.dumps({"url": where.url, "root": name}))
    root = folder / TREE / name
    for sub in sorted({rel.rsplit("/", 1)[0] for rel in files if "/" in rel}):
        (root / sub).mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    _fetch(where, files, root, folder / RECORDS / name)
    return root, warning


@atexit.register
def _remove_all() -> None:
    """At exit: a prefetch still under way is given a moment to end (it makes no folder after this), then every
    mirror folder goes."""
    _CLOSING.set()
    with _PREFETCH_LOCK:
        pending = list(_PREFETCHED.values())
    for future in pending:
        if future.cancel() or future.done():
            continue
        with suppress(Exception):
            future.exception(timeout=5)
    for folder in _FOLDERS:
        shutil.rmtree(folder, ignore_errors=True)


def _fetch(where: Location, files: dict[str, Listed], root: Path, records: Path) -> None:
    """Make the mirror's files under ``root``: placeholders (their records under ``records``, a safetensors file's
    head fetched) and small files downloaded whole, every GET on the pool."""
    downloads: list[Future[None]] = []
    fetched = 0
    try:
        for rel, obj in files.items():
            target = root / rel
            location = Location(where.scheme, where.bucket, obj.key)
            if _is_weight_file(target.name, obj.size):
                record = _write_record(records / f"{rel}.json", location, obj)
                with open(target, "wb") as f:
                    f.truncate(obj.size)
                if target.suffix == ".safetensors":
                    remote = RemoteFile(location, obj.size, target, obj.pin, record)
                    downloads.append(pool().submit(_fill_head, remote))
                continue
            fetched += obj.size
            if fetched > limits.REMOTE_FETCH_BYTES.value:
                raise limits.refuse(limits.REMOTE_FETCH_BYTES, f"{where.url}: its non-weight objects")
            downloads.append(pool().submit(_download, RemoteFile(location, obj.size, target, obj.pin)))
        for future in downloads:
            future.result()
    except BaseException:
        for future in downloads:
            future.cancel()
        raise


def _write_record(record: Path, where: Location, obj: Listed) -> Path:
    record.parent.mkdir(parents=True, exist_ok=True)
    fields: dict[str, Any] = {"scheme": where.scheme, "bucket": where.bucket, "key": where.key}
    record.write_text(json.dumps({**fields, "size": obj.size, "pin": obj.pin}))
    return record


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
