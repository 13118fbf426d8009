"""Outputs in object storage: a merge into a URL is made in a private local staging folder (``staging_dir``: the
local merge, with its resume ledger) and then published (``publish``): every file uploaded in parts (multipart,
several parts in flight), the merge manifest last.

A reader of the bucket sees a finished merge only once its manifest is there; publishing first deletes an older
manifest at that URL, then every object under the prefix that is not part of the new merge, so an interrupted
publish leaves nothing that looks complete, a finished one exactly the new merge, and a rerun with ``--resume``
uploads only what is not there yet (each object carries its sha256). ``check_output`` applies a folder output's
rules first (``pmakit.merge.url`` is the merge's side).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pmakit.checksums import sha256_file
from pmakit.errors import PmakitError
from pmakit.storage.base import Location, Store
from pmakit.storage.registry import is_remote, parse, store

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
        digests = {where.child(p.relative_to(local).as_posix()).key: sha256_file(p) for p in files}
        digests[where.child(manifest).key] = sha256_file(local / manifest)
        s.upload(local / manifest, where.child(manifest), digests[where.child(manifest).key])
        _verify(s, where, manifest, digests, pool)
    return [*written, manifest]


def _verify(
    s: Store, where: Location, manifest: str, digests: dict[str, str], pool: ThreadPoolExecutor
) -> None:
    """After the manifest: the prefix holds exactly this merge's objects, each with its sha256; else another
    writer (a second merge into the same prefix) changed it while publishing, and the manifest is taken back, so
    that no mix looks finished."""
    keys = {k for k, _ in s.list(where)}
    found = dict(zip(digests, pool.map(lambda k: s.sha256(Location(where.scheme, where.bucket, k)), digests)))
    if keys == set(digests) and found == digests:
        return
    s.delete(where.child(manifest))
    raise PmakitError(
        f"{where.url}: changed by another writer while this merge was published (two merges into one output?); "
        "its manifest was taken back: merge again into a prefix of its own"
    )
