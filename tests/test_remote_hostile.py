"""The read side of object storage against a hostile or broken store, through the real CLI: an object rewritten
during the merge (moto, rewritten from a proxy), and a small hostile S3 speaker (tests/hostile_s3.py) claiming huge
headers, holding huge non-weight objects, listing for ever, trickling bytes, and naming keys that cannot be files.
Each case is one ``Error:`` line (or one warning), in bounded time (a generous hang guard) and bounded memory (the
peak RSS of the pmakit process, from wait4)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import SRC, state, write_snapshot
from hostile_s3 import HostileS3, Obj, constant, declared
from peak_rss import measured, peak_bytes
from s3server import FaultProxy, upload_tree

GIB = 2**30
MIB = 2**20
RSS_BOUND = 900 * MIB
"""The pmakit process's peak RSS in these cases: its imports (torch) and a few small objects, far below what the
hostile objects would cost if fetched (each case's store would make it 1.5 GiB or more)."""


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    peak_rss: int


def run_measured(*args: str | Path, env: dict[str, str], timeout: float = 300) -> Ran:
    """The real CLI in a subprocess: its output, wall time and peak RSS (``ru_maxrss`` from ``wait4``, taken by a
    small launcher: see tests/peak_rss.py). ``timeout`` only guards a hang (the processes are killed and the test fails)."""
    full = {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE", **env}
    with (
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
        tempfile.TemporaryDirectory() as scratch,
    ):
        rss = Path(scratch) / "rss"
        command = measured([sys.executable, "-m", "pmakit", *map(str, args)], rss)
        start = time.monotonic()
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=full, start_new_session=True)
        try:
            proc.wait(timeout)
            killed = False
        except subprocess.TimeoutExpired:
            killed = True
            os.killpg(proc.pid, 9)
            proc.wait()
        out.seek(0)
        err.seek(0)
        ran = Ran(proc.returncode, out.read(), err.read(), time.monotonic() - start, peak_bytes(rss))
    assert not killed, f"hung: killed after {timeout} s; stderr: {ran.stderr[-2000:]}"
    return ran


def one_error(ran: Ran) -> str:
    assert ran.returncode != 0, ran.stdout[-2000:]
    assert "Traceback" not in ran.stderr, ran.stderr[-3000:]
    lines = [x for x in ran.stderr.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, ran.stderr[-3000:]
    assert 0 < ran.peak_rss < RSS_BOUND, f"peak RSS {ran.peak_rss / MIB:.0f} MiB"
    return lines[0]


def snapshot_objects(tmp_path: Path, prefix: str, n: int = 2) -> dict[str, Obj]:
    """A real run of ``n`` safetensors snapshots as the hostile store's objects under ``prefix``."""
    objects = {}
    for k in range(1, n + 1):
        snap = write_snapshot(tmp_path / "run" / f"step-{k}", state(k), step=k, tokens=k * 10)
        for f in sorted(snap.iterdir()):
            objects[f"{prefix}/step-{k}/{f.name}"] = constant(f.read_bytes())
    return objects


@pytest.fixture
def hostile() -> Iterator[Callable[[dict[str, Obj]], HostileS3]]:
    servers: list[HostileS3] = []

    def start(objects: dict[str, Obj]) -> HostileS3:
        servers.append(HostileS3("b", objects))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_an_object_rewritten_during_the_merge_is_one_line(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=3)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    upload_tree(client, run, bucket, "r")
    victim = "r/step-000200/model.safetensors"
    original = (run / "step-000200" / "model.safetensors").read_bytes()
    proxy = FaultProxy(s3_server.port)
    seen = {"gets": 0}

    def rewrite(method: str, path: str, headers: dict[str, str]) -> str | None:
        # The mirror reads the header; when the merge asks for the tensors' bytes the object is rewritten under it
        # (same size, other bytes), as a trainer overwriting a snapshot would, before the GET reaches the store.
        if method == "GET" and "Range" in headers and path.split("?")[0].endswith(victim):
            seen["gets"] += 1
            if seen["gets"] == 2:
                client.put_object(Bucket=bucket, Key=victim, Body=original[:-8] + b"\x7f" * 8)
        return None

    proxy.fault = rewrite
    try:
        ran = run_measured(
            "merge",
            f"s3://{bucket}/r",
            "-o",
            tmp_path / "out",
            env={**s3_server.env(proxy.url), "AWS_MAX_ATTEMPTS": "2"},
        )
    finally:
        proxy.stop()
    assert seen["gets"] >= 2
    line = one_error(ran)
    assert f"s3://{bucket}/{victim}" in line and "changed in the store" in line, line
    assert not (tmp_path / "out").exists()


def test_a_huge_header_claim_is_refused_before_it_is_requested(tmp_path: Path, hostile: Any) -> None:
    objects = snapshot_objects(tmp_path, "r", n=1)
    claim = struct.pack("<Q", 5 * GIB) + b'{"a":'
    objects["r/step-1/model.safetensors"] = declared(6 * GIB, claim)
    server = hostile(objects)
    ran = run_measured("inspect", "s3://b/r", env=server.env(), timeout=180)
    line = one_error(ran)
    assert "s3://b/r/step-1/model.safetensors" in line and "safetensors-header-bytes" in line, line
    assert max(stop - start for _, start, stop in server.ranges()) <= 64 * 2**10  # the head only
    assert server.bytes_sent < MIB


def test_only_what_the_layouts_need_is_fetched(tmp_path: Path, hostile: Any) -> None:
    objects = snapshot_objects(tmp_path, "r", n=2)
    objects["r/logs/events.out.tfevents.1700000000.host"] = declared(3 * GIB // 2)
    objects["r/step-2/optimizer.pt"] = declared(2 * GIB)
    server = hostile(objects)
    ran = run_measured("inspect", "s3://b/r", env=server.env(), timeout=180)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "2 complete snapshots" in ran.stdout, ran.stdout
    assert 0 < ran.peak_rss < RSS_BOUND
    fetched = {key for key, _, _ in server.ranges()}
    assert not any("events.out" in k or "optimizer" in k for k in fetched), fetched
    warnings = [x for x in ran.stderr.splitlines() if "left out of the local mirror" in x]
    assert len(warnings) == 1 and "remote-file-bytes" in warnings[0] and "events.out" in warnings[0], (
        ran.stderr
    )


def test_a_listing_of_200000_objects_is_cut_off(tmp_path: Path, hostile: Any) -> None:
    server = hostile(snapshot_objects(tmp_path, "r", n=1))
    server.extra_keys = lambda: ((f"r/junk/{i:06d}.json", 100) for i in range(200_000))
    ran = run_measured("inspect", "s3://b/r", env=server.env(), timeout=600)
    line = one_error(ran)
    assert "s3://b/r" in line and "remote-objects = 100,000" in line, line
    assert not any("junk" in key for key, _, _ in server.ranges())  # nothing downloaded before the cut


def test_a_listing_that_pages_for_ever_is_cut_off(tmp_path: Path, hostile: Any) -> None:
    server = hostile(snapshot_objects(tmp_path, "r", n=1))
    server.page_size = 3
    server.endless_pages = True
    ran = run_measured("inspect", "s3://b/r", env=server.env(), timeout=600)
    line = one_error(ran)
    assert "s3://b/r" in line and "remote-list-pages = 500" in line, line
    assert sum(1 for method, path, _ in server.requests if "list-type=2" in path) == 501


def test_a_response_trickling_a_byte_a_second_is_given_up(tmp_path: Path, hostile: Any) -> None:
    server = hostile(snapshot_objects(tmp_path, "r", n=1))
    server.trickle = True
    env = {**server.env(), "PMAKIT_GET_SECONDS": "3", "AWS_MAX_ATTEMPTS": "2"}
    ran = run_measured(
        "inspect", "s3://b/r", env=env, timeout=900
    )  # a hang guard only: given up, not timed here
    line = one_error(ran)
    assert "s3://b/r/step-1/" in line and "failed 2 times" in line and "within 3 s" in line, line


def test_keys_that_cannot_be_files_of_the_mirror_are_left_out_with_one_warning(
    tmp_path: Path, hostile: Any
) -> None:
    objects = snapshot_objects(tmp_path, "r", n=2)
    junk = constant(b"{}")
    objects["r/step-1/notes.json"] = junk  # a file ...
    objects["r/step-1/notes.json/inner.json"] = junk  # ... and a folder of another key
    objects["r/" + "d/" * 2000 + "deep.json"] = junk  # 2,000 folders deep
    objects["r/a//b.json"] = junk
    objects["r/a/../../escape.json"] = junk
    server = hostile(objects)
    server.extra_keys = lambda: iter(
        [("elsewhere/outside.json", 2)]
    )  # a store listing keys outside the prefix
    ran = run_measured("inspect", "s3://b/r", env=server.env(), timeout=180)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "Traceback" not in ran.stderr
    assert "2 complete snapshots" in ran.stdout, ran.stdout
    warnings = [x for x in ran.stderr.splitlines() if "left out of the local mirror" in x]
    assert len(warnings) == 1, ran.stderr
    for what in (
        "2 with names that would leave the mirror",
        "1 deeper than remote-key-depth",
        "1 both a file and a folder",
        "1 outside the prefix",
    ):
        assert what in warnings[0], warnings[0]
