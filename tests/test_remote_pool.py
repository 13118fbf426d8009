"""The order remote bytes come in, and how a merge's process ends: the GET pool runs the most urgent GET first (a
merge's N inputs fetched side by side, block by block, not one whole file after another), and ``pmakit merge``
leaves without the interpreter's teardown but after what exit must do (exit handlers such as the mirror's removal,
output flushed, threads still working waited for)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from pmakit.storage import mirror, source
from pmakit.storage.base import Location
from pmakit.storage.registry import GetPool
from s3server import upload_tree


def _blocked(pool: GetPool) -> threading.Event:
    """Occupy the pool's one thread until the event is set (the jobs submitted meanwhile queue)."""
    release, started = threading.Event(), threading.Event()
    pool.submit(lambda: (started.set(), release.wait(60)))
    assert started.wait(60)
    return release


def test_get_pool_runs_the_most_urgent_first() -> None:
    pool = GetPool(1, "test-get")
    release = _blocked(pool)
    ran: list[str] = []
    urgency = {"late": 5}
    futures = [
        pool.submit(ran.append, "third", rank=lambda: 3),
        pool.submit(ran.append, "first", rank=lambda: 1),
        pool.submit(ran.append, "zero", rank=lambda: 0),
        pool.submit(ran.append, "late", rank=lambda: urgency["late"]),
        pool.submit(ran.append, "unranked"),  # rank 0, in the order submitted
        pool.submit(ran.append, "second", rank=lambda: 2),
        pool.submit(ran.append, "unranked-2"),
    ]
    cancelled = pool.submit(ran.append, "cancelled", rank=lambda: 0)
    assert cancelled.cancel()
    urgency["late"] = -1  # ranks are read when a thread is free, not when submitted
    release.set()
    for f in futures:
        f.result(timeout=60)
    assert ran == ["late", "zero", "unranked", "unranked-2", "first", "second", "third"]


def test_a_failing_get_reaches_its_reader() -> None:
    pool = GetPool(2, "test-get")
    failed = pool.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=60)
    assert pool.submit(lambda: 7).result(timeout=60) == 7  # the thread goes on


@dataclass(frozen=True)
class _Recorded(mirror.RemoteFile):
    """A remote file whose GETs are noted instead of sent (the order the pool runs them in is under test)."""

    log: list[tuple[str, int]] | None = None

    def read(self, start: int, stop: int) -> bytes:
        assert self.log is not None
        self.log.append((self.where.key, start // source.BLOCK_BYTES))
        return bytes(stop - start)


def test_a_merges_inputs_are_fetched_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two inputs of 4 blocks each, both hinted before the pool has a free thread: their blocks run A0 B0 A1 B1 ...
    (first come first served ran all of A before any of B, and the fold waited for B's first block)."""
    monkeypatch.setattr(source, "BLOCK_BYTES", 1024)
    pool = GetPool(1, "test-get")
    monkeypatch.setattr(mirror, "pool", lambda: pool)
    log: list[tuple[str, int]] = []
    files = [_Recorded(Location("s3", "b", k), 4 * 1024, Path(k), log=log) for k in ("A", "B")]
    streams = [source.Sequential(f) for f in files]
    try:
        release = _blocked(pool)
        for s in streams:
            s.hint(0, 1024)
        done = pool.submit(lambda: None, rank=lambda: 99)  # runs after every block
        release.set()
        done.result(timeout=60)
        assert log == [(k, b) for b in range(4) for k in ("A", "B")]
        for s in streams:  # the readers read each file front to back, from the blocks fetched
            for block in range(4):
                assert len(s.read(block * 1024, (block + 1) * 1024)) == 1024
        assert len(log) == 8
    finally:
        for s in streams:
            s.close()


def test_a_merge_from_s3_leaves_no_mirror_behind(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=3)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    upload_tree(s3_server.client(), run, bucket, "runs/r1")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    made = scratch.stat().st_mtime_ns
    out = tmp_path / "out"
    proc = run_cli(
        "merge", f"s3://{bucket}/runs/r1", "-o", out, env={**s3_server.env(), "TMPDIR": str(scratch)}
    )
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout  # the result's lines, all of them out before the process left
    assert (out / "model.safetensors").is_file()
    assert scratch.stat().st_mtime_ns != made  # the mirror was made there (a folder added and removed)
    assert not list(scratch.glob(f"{mirror.MIRROR_PREFIX}*"))  # the exit handler removed the mirror


@dataclass(frozen=True)
class _Served(mirror.RemoteFile):
    """A remote file served from bytes in memory."""

    data: bytes = b""

    def read(self, start: int, stop: int) -> bytes:
        return self.data[start:stop]


def test_a_read_across_blocks_is_its_own_bytes_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's read within a block is a view of it; one that spans blocks is a copy of just the range (joining
    the whole blocks and slicing the join copied up to twice the bytes, and the slice kept the join alive)."""
    monkeypatch.setattr(source, "BLOCK_BYTES", 1024)
    data = bytes(range(256)) * 20  # 5 blocks
    stream = source.Sequential(_Served(Location("s3", "b", "k"), len(data), Path("k"), data=data))
    try:
        for start, stop, spans in [
            (10, 1000, 1),
            (1000, 1100, 2),
            (1100, 3100, 3),
            (3100, 4096, 1),
            (4096, 5120, 1),
        ]:
            got = stream.read(start, stop)
            assert bytes(got) == data[start:stop]
            held = memoryview(got).obj  # what the returned bytes keep alive
            assert held is not None and len(held) == (1024 if spans == 1 else stop - start), (start, stop)
    finally:
        stream.close()
