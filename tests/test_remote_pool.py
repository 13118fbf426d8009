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
import torch

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


def test_the_newest_snapshots_weights_are_guessed_from_names_alone() -> None:
    """The files a merge of a run's newest N snapshots reads, as ``prefetch`` guesses them before torch has
    imported: the folders with the highest steps in their names, each one's first shard before any one's second."""
    run = [
        "step-9/model.safetensors",  # steps compared as numbers, not as names
        "step-10/model-00001-of-00002.safetensors",
        "step-10/model-00002-of-00002.safetensors",
        "step-11/model-00001-of-00002.safetensors",
        "step-11/model-00002-of-00002.safetensors",
        "step-11/config.json",
        "checkpoint/model.safetensors",  # the trainer's full state: no step in its name
        "notes/model.safetensors",
    ]
    assert mirror.newest_weights(run, 2) == [
        "step-10/model-00001-of-00002.safetensors",
        "step-11/model-00001-of-00002.safetensors",
        "step-10/model-00002-of-00002.safetensors",
        "step-11/model-00002-of-00002.safetensors",
    ]
    assert mirror.newest_weights(run, 1) == [
        "step-11/model-00001-of-00002.safetensors",
        "step-11/model-00002-of-00002.safetensors",
    ]
    assert mirror.newest_weights(run, 10)[0] == "step-9/model.safetensors"  # fewer than N: all of them
    nested = ["snapshots/step-00000100/model.safetensors", "snapshots/step-00000200/model.safetensors"]
    assert mirror.newest_weights(nested, 1) == ["snapshots/step-00000200/model.safetensors"]
    snapshot = ["model.safetensors", "config.json", "sub/extra.safetensors"]  # the URL is one snapshot
    assert mirror.newest_weights(snapshot, 1) == ["model.safetensors"]
    assert mirror.newest_weights(["a/model.safetensors", "b/model.safetensors"], 1) == []  # no step: no guess
    assert mirror.newest_weights(["step-1/model.distcp"], 1) == []  # DCP records: one GET each, as read


@pytest.mark.parametrize(
    ("argv", "newest"),
    [
        (["merge", "s3://b/run", "-o", "out"], 10),  # the default window
        (["merge", "s3://b/run", "-o", "out", "--last", "4"], 4),
        (["merge", "s3://b/run", "--last=3", "-o", "out"], 3),
        (["merge", "s3://b/run", "-o", "out", "--last", "x"], None),  # click says what is wrong with it
        (["merge", "s3://b/run", "-o", "out", "--recipe", "sma:4"], None),
        (["merge", "s3://b/run", "-o", "out", "--every", "1B"], None),
        (["merge", "s3://b/run", "-o", "out", "--until=2B"], None),
        (["merge", "s3://b/run", "-o", "out", "--exclude", "s3://b/run/step-4"], None),
        (["merge", "s3://b/run", "-o", "out", "--from-previous", "prev"], None),
        (["merge", "s3://b/run", "-o", "out", "--dry-run"], None),
        (["inspect", "s3://b/run"], None),  # reads no weights
        (["eval", "s3://b/run"], None),
    ],
)
def test_what_a_merges_arguments_say_of_its_newest_snapshots(
    argv: list[str], newest: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pmakit import _env

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _env._merged_newest(argv) == newest
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun each rank reads a share: no guess
    assert _env._merged_newest(argv) is None


def test_blocks_fetched_while_torch_imports_are_the_merges_own(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``prefetch`` with ``newest``: once the mirror is made, the first blocks of the newest snapshot's file are
    fetched; the stream that reads the file takes them (no second GET, the same bytes), a reader opened and closed
    unread (for a header) leaves them, a stream that closes drops what it did not take, and the first read of a
    merge that opened no reader for the guessed file drops them."""
    from pmakit.storage import registry

    monkeypatch.setattr(source, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(mirror, "HEAD_BYTES", 256)
    monkeypatch.setattr(source, "_EARLY", {})
    monkeypatch.setattr(source, "_OPENED", set())
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})  # a client made under this test's endpoint
    from safetensors.torch import save_file

    root = tmp_path / "run"
    for step in (1, 2):
        (root / f"step-{step}").mkdir(parents=True)
        weight = torch.arange(25_600, dtype=torch.int32) * step
        save_file({"w": weight}, str(root / f"step-{step}" / "model.safetensors"))
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=bucket)
    upload_tree(s3_server.client(), root, bucket, "r")
    url = f"s3://{bucket}/r"

    mirror.prefetch([url], newest=1)
    local = mirror.localize(url)
    newest = local / "step-2" / "model.safetensors"
    data = (root / "step-2" / "model.safetensors").read_bytes()
    blocks = -(-len(data) // 4096)
    assert blocks > source.EARLY_PER_FILE  # more blocks than are fetched early
    started = sorted(source._EARLY)
    assert started == [(newest, b) for b in range(source.EARLY_PER_FILE)]  # not the older snapshot's
    for future in source._EARLY.values():
        future.result(timeout=60)

    unread = source.open_source(newest, sequential=True)
    unread.close()  # a reader that read nothing (a header parsed from the placeholder) leaves them
    assert sorted(source._EARLY) == started
    gets: list[int] = []
    read = mirror.RemoteFile.read

    def logged(self: mirror.RemoteFile, start: int, stop: int) -> bytes:
        gets.append(start)
        return read(self, start, stop)

    monkeypatch.setattr(mirror.RemoteFile, "read", logged)
    with source.open_source(newest, sequential=True) as reader:
        span = source.EARLY_PER_FILE * 4096 - 100  # within the blocks fetched early
        assert bytes(reader.read(0, span)) == data[:span]
        assert sorted(source._EARLY) == []  # all taken
        assert bytes(reader.read(span, len(data))) == data[span:]
    assert (
        gets and min(gets) == source.EARLY_PER_FILE * 4096
    )  # the rest: read ahead as usual, each block once
    assert sorted(gets) == list(range(min(gets), len(data), 4096))

    mirror.prefetch([url + "/step-1"], newest=1)  # a snapshot's URL: its files are the ones read
    first = mirror.localize(url + "/step-1") / "model.safetensors"
    assert {k[0] for k in source._EARLY} == {first}
    with source.open_source(first, sequential=True) as reader:
        assert bytes(reader.read(8, 100)) == (root / "step-1" / "model.safetensors").read_bytes()[8:100]
    assert source._EARLY == {}  # the blocks it did not take go with the stream

    mirror.prefetch([url], newest=1)  # a guess the merge proves wrong: it reads the older snapshot only
    fresh = mirror.localize(url)
    assert {k[0] for k in source._EARLY} == {fresh / "step-2" / "model.safetensors"}
    with source.open_source(fresh / "step-1" / "model.safetensors", sequential=True) as reader:
        assert bytes(reader.read(8, 100)) == (root / "step-1" / "model.safetensors").read_bytes()[8:100]
        assert source._EARLY == {}  # dropped at its first read: no reader had opened the guessed file
