"""Merging where big runs keep their checkpoints: s3:// in and out, against a real S3 API server (moto) on
localhost, through the real CLI. Faults come from a proxy in front of the server: GETs broken off mid-body and
SlowDown answers (retried), the endpoint gone mid-merge (one line, the finished shards kept; a rerun with
--resume continues)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_cli, state, write_snapshot
from pmakit.formats import dcp_io, read_state
from pmakit.snapshot import MERGE_MANIFEST, write_metadata
from s3server import FaultProxy, MotoServer, download_tree, upload_tree


def _bucket(s3_server: Any) -> str:
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name


def _dcp_run(root: Path, n: int = 3) -> Path:
    """Snapshots saved through torch's DCP writer (names at the top level, as torchtitan saves them)."""
    for k in range(1, n + 1):
        snap = root / f"step-{k * 100}"
        dcp_io.save({"model": state(k)}, snap, fsync=False)
        write_metadata(snap, step=k * 100, tokens=k * 1000)
    return root


def _one_line_error(proc: Any) -> str:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_inspect_and_merge_a_safetensors_run_from_s3(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=3)
    bucket = _bucket(s3_server)
    upload_tree(s3_server.client(), run, bucket, "runs/r1")
    url = f"s3://{bucket}/runs/r1"
    env = s3_server.env()

    shown = run_cli("inspect", url, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "3 complete snapshots (pmakit, safetensors)" in shown.stdout

    remote_out, local_out = tmp_path / "from-s3", tmp_path / "from-disk"
    proc = run_cli("merge", url, "-o", remote_out, "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    assert run_cli("merge", run, "-o", local_out, "--quiet").returncode == 0
    # Same bytes as the merge of the same files on disk
    assert (remote_out / "model.safetensors").read_bytes() == (local_out / "model.safetensors").read_bytes()
    manifest = json.loads((remote_out / MERGE_MANIFEST).read_text())
    assert [i["path"] for i in manifest["inputs"]] == [f"{url}/step-{k:06d}" for k in (100, 200, 300)]
    assert (remote_out / "config.json").is_file()  # small files come along


def test_merge_dcp_from_s3_into_s3(s3_server: Any, tmp_path: Path) -> None:
    run = _dcp_run(tmp_path / "run")
    bucket = _bucket(s3_server)
    client = s3_server.client()
    upload_tree(client, run, bucket, "titan")
    out_url = f"s3://{bucket}/merged/m1"
    env = {**s3_server.env(), "PMAKIT_STAGING": str(tmp_path / "staging")}

    proc = run_cli("merge", f"s3://{bucket}/titan", "-o", out_url, "--format", "dcp", env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"published {out_url}" in proc.stdout
    got = download_tree(client, bucket, "merged/m1", tmp_path / "down")
    assert MERGE_MANIFEST in got and ".metadata" in got
    assert not any((tmp_path / "staging").rglob("*.distcp"))  # the staging folder is gone once published
    merged = read_state(tmp_path / "down")
    expected = {k: torch.stack([state(s)[k].float() for s in (1, 2, 3)]).mean(0) for k in state(1)}
    for name, value in merged.items():
        if value.is_floating_point():
            torch.testing.assert_close(value.float(), expected[name], atol=1e-2, rtol=1e-2)
    assert merged["step_counter"].item() == 3  # an int buffer is the newest's

    # A finished merge there is replaced only with --force
    again = run_cli("merge", f"s3://{bucket}/titan", "-o", out_url, "--quiet", env=env)
    assert "holds a finished merge already" in _one_line_error(again)


def test_a_get_broken_off_or_refused_is_retried(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=3)
    bucket = _bucket(s3_server)
    upload_tree(s3_server.client(), run, bucket, "r")
    proxy = FaultProxy(s3_server.port)
    seen = {"ranged": 0}

    def fault(method: str, path: str, headers: dict[str, str]) -> str | None:
        if method == "GET" and "Range" in headers:
            seen["ranged"] += 1
            return {2: "truncate", 4: "503", 5: "truncate"}.get(seen["ranged"])
        return None

    proxy.fault = fault
    try:
        proc = run_cli(
            "merge", f"s3://{bucket}/r", "-o", tmp_path / "out", "--quiet", env=s3_server.env(proxy.url)
        )
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr
    assert seen["ranged"] >= 6  # the faults happened, and were retried
    assert run_cli("merge", run, "-o", tmp_path / "local", "--quiet").returncode == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "local" / "model.safetensors"
    ).read_bytes()


def test_endpoint_gone_mid_publish_leaves_no_manifest_and_resume_completes(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=2)
    bucket = _bucket(s3_server)
    client = s3_server.client()
    upload_tree(client, run, bucket, "r")
    out_url = f"s3://{bucket}/merged"
    proxy = FaultProxy(s3_server.port)
    puts = {"n": 0}

    def fault(method: str, path: str, headers: dict[str, str]) -> str | None:
        if method == "PUT":
            puts["n"] += 1
            return "down" if puts["n"] > 1 else None  # the first file goes up, then the server is gone
        return None

    proxy.fault = fault
    env = {**s3_server.env(proxy.url), "AWS_MAX_ATTEMPTS": "2", "PMAKIT_STAGING": str(tmp_path / "staging")}
    try:
        cut = run_cli("merge", f"s3://{bucket}/r", "-o", out_url, "--quiet", env=env)
        line = _one_line_error(cut)
        assert out_url in line
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="merged/").get("Contents", [])]
        assert keys and f"merged/{MERGE_MANIFEST}" not in keys  # something went up, nothing looks finished

        proxy.fault = lambda *a: None  # the server is back
        done = run_cli("merge", f"s3://{bucket}/r", "-o", out_url, "--quiet", "--resume", env=env)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    got = download_tree(client, bucket, "merged", tmp_path / "down")
    assert MERGE_MANIFEST in got and "model.safetensors" in got
    assert run_cli("merge", run, "-o", tmp_path / "local", "--quiet").returncode == 0
    assert (tmp_path / "down" / "model.safetensors").read_bytes() == (
        tmp_path / "local" / "model.safetensors"
    ).read_bytes()


@pytest.mark.parametrize("gone", ["down", "503"])
def test_endpoint_gone_mid_merge_keeps_the_finished_shard_and_resume_continues(
    s3_server: Any, tmp_path: Path, gone: str
) -> None:
    """The store stops answering (connections closed, or 503 SlowDown past the retries) after the merge finished
    its first output shard: one line, the finished shard kept (a cut, not a bad input: a 70B merge from S3 does not
    start over after an outage), and the same command with --resume continues from it, byte-equal to the merge of
    the same files on disk."""
    import os
    import time

    from pmakit.merge.output import PROGRESS_DIR, partial_dir
    from pmakit.storage.source import BLOCK_BYTES

    root = tmp_path / "run"
    # "a" (8 MiB) is the first output shard and lies in each input's first 16 MiB block; "b" (16 MiB) crosses
    # into the second block, whose GETs fail.
    shapes = {"a": (2048, 1024), "b": (4096, 1024)}
    for k in (1, 2):
        write_snapshot(root / f"step-{k}", state(k, torch.float32, shapes), step=k, tokens=k * 10)
    bucket = _bucket(s3_server)
    upload_tree(s3_server.client(), root, bucket, "r")
    out = tmp_path / "out"
    progress = partial_dir(out) / PROGRESS_DIR
    proxy = FaultProxy(s3_server.port)
    down = {"on": True, "cut": 0}

    def fault(method: str, path: str, headers: dict[str, str]) -> str | None:
        if not (down["on"] and method == "GET" and path.endswith(".safetensors") and "Range" in headers):
            return None
        if int(headers["Range"].split("=")[1].split("-")[0]) < BLOCK_BYTES:
            return None  # the headers and every first block
        deadline = time.monotonic() + 600  # a hang guard only: the first shard is recorded long before
        while not list(progress.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)  # the store goes down once the first shard is on disk and recorded
        down["cut"] += 1
        return gone

    proxy.fault = fault
    env = {**s3_server.env(proxy.url), "AWS_MAX_ATTEMPTS": "2"}
    args = ("merge", f"s3://{bucket}/r", "-o", out, "--max-shard-size", "10MB")
    try:
        cut = run_cli(*args, env=env)
        assert "reading bytes" in _one_line_error(cut) and ("SlowDown" in cut.stderr) == (gone == "503")
        assert down["cut"] > 0 and not out.exists()
        assert "merge interrupted; what it wrote is kept" in cut.stderr, cut.stderr[-2000:]
        kept = [p.name.removesuffix(".json") for p in progress.glob("*.safetensors.json")]
        assert len(kept) == 1, kept
        before = os.stat(partial_dir(out) / kept[0])
        down["on"] = False
        done = run_cli(*args, "--resume", env=env)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert "continuing the interrupted merge" in done.stderr, done.stderr[-2000:]
    after = os.stat(out / kept[0])  # the kept shard is the one published, not written again
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    local = tmp_path / "local"
    assert run_cli("merge", root, "-o", local, "--quiet", "--max-shard-size", "10MB").returncode == 0
    shards = sorted(f.name for f in local.glob("*.safetensors"))
    assert len(shards) > len(kept) and sorted(f.name for f in out.glob("*.safetensors")) == shards
    for name in shards:
        assert (out / name).read_bytes() == (local / name).read_bytes()


def test_missing_bucket_is_one_line(s3_server: Any, tmp_path: Path) -> None:
    proc = run_cli("merge", "s3://no-such-bucket/run", "-o", tmp_path / "out", env=s3_server.env())
    assert "s3://no-such-bucket" in (line := _one_line_error(proc)) and "no such bucket" in line
    proc = run_cli("inspect", "s3://no-such-bucket/run", env=s3_server.env())
    assert "no such bucket" in _one_line_error(proc)


def test_an_empty_prefix_is_one_line(s3_server: Any) -> None:
    bucket = _bucket(s3_server)
    proc = run_cli("inspect", f"s3://{bucket}/nothing-here", env=s3_server.env())
    assert "nothing stored under this prefix" in _one_line_error(proc)


@pytest.fixture(scope="module")
def authenticating_server() -> Any:
    """A second moto server that checks credentials (IAM auth on from the first request)."""
    pytest.importorskip("moto.server")
    server = MotoServer({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    yield server
    server.stop()


def test_wrong_credentials_are_one_line(authenticating_server: Any, tmp_path: Path) -> None:
    proc = run_cli("merge", "s3://some-bucket/run", "-o", tmp_path / "out", env=authenticating_server.env())
    line = _one_line_error(proc)
    assert "s3://some-bucket" in line and "access denied" in line


def test_snapshot_saver_uploads_off_the_training_thread(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pmakit.saver import SnapshotSaver
    from pmakit.storage import registry

    bucket = _bucket(s3_server)
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})  # a client made under this test's endpoint
    url = f"s3://{bucket}/run/snapshots"
    with SnapshotSaver(tmp_path / "snaps", every_tokens=10, keep_last=1, upload_to=url) as saver:
        for step in (1, 2, 3):
            saver.maybe_save(state(step), tokens=step * 10, step=step)
    client = s3_server.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="run/").get("Contents", []))
    assert [k for k in keys if k.endswith("pmakit.json")] == [
        f"run/snapshots/step-{s:08d}/pmakit.json" for s in (1, 2, 3)
    ]
    assert len(list((tmp_path / "snaps").iterdir())) == 1  # retention is local: the bucket keeps all three
    proc = run_cli("merge", url, "-o", tmp_path / "merged", "--quiet", env=s3_server.env())
    assert proc.returncode == 0, proc.stderr
    merged = read_state(tmp_path / "merged")
    want = torch.stack([state(s)["embed.weight"].float() for s in (1, 2, 3)]).mean(0)
    torch.testing.assert_close(merged["embed.weight"].float(), want, atol=1e-2, rtol=1e-2)

    # The training callbacks (HF, Lightning, OLMo-core) build their saver through PMACore: upload_to passes through.
    from pmakit.integrations import PMACore

    core = PMACore(tmp_path / "core", 10, last=2, eval_every=0, upload_to=f"s3://{bucket}/core")
    core.start(None, 0)
    for step in (1, 2):
        core.step(state(step), tokens=step * 10, step=step)
    core.close()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="core/").get("Contents", []))
    assert [k for k in keys if k.endswith("pmakit.json")] == [
        f"core/step-{s:08d}/pmakit.json" for s in (1, 2)
    ]


@pytest.fixture(scope="module")
def gcs_server() -> Any:
    pytest.importorskip(
        "gcp_storage_emulator", reason="the gs:// tests need gcp-storage-emulator (the test extra)"
    )
    from s3server import GCSEmulator

    server = GCSEmulator()
    yield server
    server.stop()


def test_gs_run_merged_into_gs(gcs_server: Any, make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(n=3)
    client = gcs_server.client()
    bucket = client.create_bucket(f"g-{uuid.uuid4().hex[:10]}")
    for path in sorted(run.rglob("*")):
        if path.is_file():
            bucket.blob(f"runs/r/{path.relative_to(run).as_posix()}").upload_from_filename(str(path))
    env = {**gcs_server.env(), "PMAKIT_STAGING": str(tmp_path / "staging")}
    out_url = f"gs://{bucket.name}/merged/m"

    proc = run_cli("merge", f"gs://{bucket.name}/runs/r", "-o", out_url, "--quiet", env=env)
    assert proc.returncode == 0, proc.stderr
    names = sorted(b.name for b in client.list_blobs(bucket.name, prefix="merged/m/"))
    assert names == [f"merged/m/{n}" for n in ("config.json", "model.safetensors", MERGE_MANIFEST)]
    assert run_cli("merge", run, "-o", tmp_path / "local", "--quiet").returncode == 0
    data = bucket.blob("merged/m/model.safetensors").download_as_bytes()
    assert data == (tmp_path / "local" / "model.safetensors").read_bytes()

    missing = run_cli("inspect", "gs://no-such-bucket-here/run", env=env)
    assert "gs://no-such-bucket-here" in (line := _one_line_error(missing)) and "no such bucket" in line


def test_a_dcp_record_is_one_ranged_get_and_no_file_is_fetched(
    s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pmakit.layouts import open_weights
    from pmakit.storage import localize, open_source, registry
    from pmakit.storage.mirror import remote_file

    run = _dcp_run(tmp_path / "run", n=1)
    bucket = _bucket(s3_server)
    upload_tree(s3_server.client(), run, bucket, "titan")
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})
    mirror = localize(f"s3://{bucket}/titan")
    files = list((mirror / "step-100").glob("*.distcp"))
    assert files and all(open_source(f).remote and f.stat().st_blocks == 0 for f in files)  # no disk
    before = registry.request_count()
    with open_weights(mirror / "step-100") as reader:
        for name, info in reader.tensors.items():
            assert torch.equal(reader.read(name, 0, info.numel).reshape(info.shape), state(1)[name]), name
    assert registry.request_count() - before == len(reader.tensors)  # one GET per saved record
    for f in files:  # nothing was written into the placeholders
        assert f.stat().st_blocks == 0 and not remote_file(f).filled()


def test_a_large_input_is_read_in_aligned_blocks(s3_server: Any, tmp_path: Path) -> None:
    """A file bigger than a block: its bytes come in aligned 16 MiB ranged GETs (chunks spanning two blocks are
    joined), the merge byte-equal to the merge of the same files on disk."""
    from pmakit.storage.mirror import HEAD_BYTES
    from pmakit.storage.source import BLOCK_BYTES

    shapes = {"big.weight": (4096, 4200), "norm.weight": (4096,), "small.weight": (300, 7)}
    root = tmp_path / "run"
    for k in (1, 2):
        write_snapshot(root / f"step-{k}", state(k, shapes=shapes), step=k, tokens=k * 10)
    size = (root / "step-1" / "model.safetensors").stat().st_size
    assert size > 2 * BLOCK_BYTES
    bucket = _bucket(s3_server)
    upload_tree(s3_server.client(), root, bucket, "r")
    proxy = FaultProxy(s3_server.port)
    ranges: dict[str, list[tuple[int, int]]] = {"step-1": [], "step-2": []}

    def record(method: str, path: str, headers: dict[str, str]) -> None:
        key = path.split("?")[0]
        if method == "GET" and key.endswith("model.safetensors") and "Range" in headers:
            a, _, b = headers["Range"].removeprefix("bytes=").partition("-")
            ranges[key.split("/")[-2]].append((int(a), int(b)))

    proxy.fault = record
    try:
        proc = run_cli(
            "merge", f"s3://{bucket}/r", "-o", tmp_path / "out", "--quiet", env=s3_server.env(proxy.url)
        )
    finally:
        proxy.stop()
    assert proc.returncode == 0, proc.stderr
    assert run_cli("merge", root, "-o", tmp_path / "local", "--quiet").returncode == 0
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (
        tmp_path / "local" / "model.safetensors"
    ).read_bytes()
    blocks = [(a, min(size, a + BLOCK_BYTES) - 1) for a in range(0, size, BLOCK_BYTES)]
    for got in ranges.values():
        assert sorted(got) == sorted([(0, HEAD_BYTES - 1), *blocks]), got  # the header, then each block once
