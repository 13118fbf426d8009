"""The one guard on a merge's output directory: what ``--force`` may replace, and one writer at a time.

``--force`` replaces only what a merge wrote: a directory holding a merge manifest (or an empty directory). It never
replaces an input, a directory holding an input, a directory inside an input, a plain file, a symlink or a device,
and never anything else a user keeps there. Two merges into one output take an exclusive lock beside it, so one
wins and the other stops with one line instead of interleaving their files (a manifest describing the other's
bytes).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from pmakit.errors import PmakitError
from pmakit.layouts.base import MERGE_MANIFEST

LOCK_SUFFIX = ".pmakit-lock"


def _within(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def guard_output(out: Path, inputs: Iterable[Path], force: bool) -> None:
    """Refuse an output that would destroy an input or anything pmakit did not write (before any work)."""
    target = out.resolve()
    for src in inputs:
        real = src.resolve()
        if _within(real, target):
            raise PmakitError(f"refusing to write {out}: it is or contains the input {src}")
        if _within(target, real):
            raise PmakitError(f"refusing to write {out}: it is inside the input {src}")
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise PmakitError(
            f"refusing to replace {out}: it is not a directory (a file, symlink or device); "
            "pmakit replaces only a model it merged"
        )
    if not force:
        with contextlib.suppress(PmakitError), output_lock(out):
            pass  # the lock file of a merge killed after publishing its output goes too
        raise PmakitError(f"{out} exists; pass --force to replace it")
    if not (out / MERGE_MANIFEST).is_file() and any(out.iterdir()):
        raise PmakitError(
            f"refusing to replace {out}: it holds no {MERGE_MANIFEST}, so pmakit did not write it "
            "(--force replaces only a model it merged)"
        )


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out`` for a whole merge (a hidden lock file beside it, removed at the end; the
    lock goes with the process, even on kill -9). A second merge into the same output stops at once with one line."""
    import fcntl  # Unix only

    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.parent / f".{out.name}{LOCK_SUFFIX}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise PmakitError(
                    f"another pmakit merge is writing {out}; wait for it or choose another -o"
                ) from None
            raise
        # The holder before us may have removed the file between our open and our lock: then this lock guards
        # nothing, and we lock the file that is there now.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while still holding the lock (see above)
        os.close(fd)
