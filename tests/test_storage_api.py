"""Object storage through the Python API, against a real S3 API server (moto) on localhost: every path argument
takes an ``s3://`` URL (``discover``, ``read_snapshot``, ``gather``, ``select_for_merge``, ``inspect_inputs``), the
merge of those snapshots writes into a URL from ``merge`` and from ``execute`` of a plan made once, and a URL
output follows ``--force`` and ``--resume`` like a folder. The reader's bytes come from ``open_source``: a local
file mapped, a mirrored one read by ranged GETs, with no table of remote files in the process."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import load_dir
from pmakit.errors import PmakitError
from pmakit.formats import read_state
from pmakit.snapshot import MERGE_MANIFEST

SNAPS = ("step-000100", "step-000200", "step-000300")


@pytest.fixture
def bucket(s3_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh bucket, this process's environment pointed at the server and a client made for it."""
    from pmakit.storage import registry

    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    for k, v in {**s3_server.env(), "PMAKIT_STAGING": str(tmp_path / "staging")}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})  # a client made under this test's endpoint
    yield name


def _put_tree(s3_server: Any, local: Path, bucket: str, prefix: str) -> None:
    client = s3_server.client()
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.put_object(
                Bucket=bucket, Key=f"{prefix}/{path.relative_to(local).as_posix()}", Body=path.read_bytes()
            )


def _objects(s3_server: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    client = s3_server.client()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
    return {k: client.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


def _state_at(s3_server: Any, bucket: str, prefix: str, local: Path) -> dict[str, torch.Tensor]:
    for key, data in _objects(s3_server, bucket, prefix + "/").items():
        target = local / key[len(prefix) + 1 :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return read_state(local)


def test_every_input_function_takes_a_url(s3_server: Any, bucket: str, make_run: Callable[..., Path]) -> None:
    import pmakit
    from pmakit.snapshot import gather
    from pmakit.storage import origin

    run = make_run(n=3)
    _put_tree(s3_server, run, bucket, "run")
    url = f"s3://{bucket}/run"
    local = pmakit.discover(run)

    snaps = pmakit.discover(url)
    assert [origin(s.path) for s in snaps] == [f"{url}/{s}" for s in SNAPS]
    assert [s.tokens for s in snaps] == [s.tokens for s in local]
    one = pmakit.read_snapshot(f"{url}/{SNAPS[1]}/")
    assert one.tokens == local[1].tokens and origin(one.path) == f"{url}/{SNAPS[1]}"

    found, from_run = gather([url], exclude=[f"{url}/{SNAPS[0]}/"])  # excluded by its URL
    assert from_run and [origin(s.path) for s in found] == [f"{url}/{s}" for s in SNAPS[1:]]
    with pytest.raises(PmakitError, match="names none of the snapshots"):
        gather([url], exclude=[f"{url}/step-9"])
    chosen = pmakit.select_for_merge([url], last=2)
    assert [origin(s.path) for s in chosen] == [f"{url}/{s}" for s in SNAPS[1:]]

    report = pmakit.inspect_inputs([url], last=2)
    assert report["compatible"] and len(report["snapshots"]) == 3
    twin = pmakit.inspect_inputs([run], last=2)
    assert report["model"] == twin["model"] and report["merge"]["tokens"] == twin["merge"]["tokens"]


def test_a_plan_made_once_is_executed_into_a_url(
    s3_server: Any, bucket: str, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    import pmakit
    from pmakit.merge import execute

    run = make_run(n=3)
    _put_tree(s3_server, run, bucket, "run")
    snaps = pmakit.discover(f"s3://{bucket}/run")
    weights = [0.2, 0.3, 0.5]
    plan = pmakit.plan_merge(snaps, weights, max_shard_size=3000)
    result = execute(plan, f"s3://{bucket}/planned")
    assert result.plan is plan and result.url == f"s3://{bucket}/planned" and not result.path.exists()
    manifest = json.loads(_objects(s3_server, bucket, "planned/")[f"planned/{MERGE_MANIFEST}"])
    assert [i["path"] for i in manifest["inputs"]] == [f"s3://{bucket}/run/{s}" for s in SNAPS]

    want = load_dir(pmakit.merge(pmakit.discover(run), weights, tmp_path / "local", max_shard_size=3000).path)
    got = _state_at(s3_server, bucket, "planned", tmp_path / "down")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_url_output_takes_force_and_resume_like_a_folder(
    s3_server: Any, bucket: str, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    import pmakit

    run = make_run(n=3)
    _put_tree(s3_server, run, bucket, "run")
    snaps = pmakit.discover(f"s3://{bucket}/run")
    out = f"s3://{bucket}/m"
    pmakit.merge(snaps, [1 / 3] * 3, out, max_shard_size=3000)
    shards = [k for k in _objects(s3_server, bucket, "m/") if k.endswith(".safetensors")]
    assert len(shards) > 1
    with pytest.raises(PmakitError, match="holds a finished merge already"):
        pmakit.merge(snaps, [1 / 3] * 3, out)
    with pytest.raises(PmakitError, match="holds a finished merge already"):  # as a folder's --resume
        pmakit.merge(snaps, [1 / 3] * 3, out, resume=True)
    # --force leaves exactly the new merge: the old shards and index go
    result = pmakit.merge(snaps[-1:], [1.0], out, force=True)
    assert result.url == out
    assert sorted(_objects(s3_server, bucket, "m/")) == sorted(
        f"m/{n}" for n in ("config.json", MERGE_MANIFEST, "model.safetensors")
    )
    got = _state_at(s3_server, bucket, "m", tmp_path / "down")
    want = read_state(run / SNAPS[-1])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)

    # A folder-only option is refused for a URL before any work
    with pytest.raises(PmakitError, match="merge into folders only"):
        pmakit.merge(snaps, [1 / 3] * 3, f"s3://{bucket}/fp32", keep_fp32=True)
    assert not _objects(s3_server, bucket, "fp32/")


def test_a_mirror_is_known_by_its_files_not_by_a_table(
    s3_server: Any, bucket: str, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """A mirror made in one process is read as remote from its records; a local file is mapped; a folder named like
    a mirror's that another user could write is not trusted as one."""
    from pmakit.storage import localize, open_source
    from pmakit.storage.mirror import MIRROR_FILE

    run = make_run(n=1)
    _put_tree(s3_server, run, bucket, "run")
    mirror = localize(f"s3://{bucket}/run")
    file = mirror / SNAPS[0] / "model.safetensors"
    local = run / SNAPS[0] / "model.safetensors"
    with open_source(file) as remote_source, open_source(local) as local_source:
        assert remote_source.remote and not local_source.remote
        assert (
            bytes(remote_source.read(8, 200)) == bytes(local_source.read(8, 200)) == local.read_bytes()[8:200]
        )

    planted = tmp_path / "pmakit-remote-x"
    (planted / "tree" / "run").mkdir(parents=True)
    (planted / MIRROR_FILE).write_text(json.dumps({"url": f"s3://{bucket}/run", "root": "run"}))
    (planted / "objects" / "run").mkdir(parents=True)
    (planted / "objects" / "run" / "f.json").write_text(
        json.dumps({"scheme": "s3", "bucket": bucket, "key": "run/x", "size": 1, "pin": None})
    )
    (planted / "tree" / "run" / "f").write_bytes(b"x")
    assert open_source(planted / "tree" / "run" / "f").remote  # this user's, private: a mirror
    planted.chmod(0o777)
    try:
        assert not open_source(planted / "tree" / "run" / "f").remote  # others may write there: not trusted
    finally:
        planted.chmod(0o700)


def test_a_prefetched_mirror_is_the_one_localize_returns(
    s3_server: Any, bucket: str, make_run: Callable[..., Path]
) -> None:
    """``prefetch`` (the CLI starts it while torch imports) makes the mirror once in the background: the
    ``localize`` that follows takes it (no second listing), a second ``localize`` makes a fresh one, and an error
    of the prefetch is raised by the localize of that URL, as its own."""
    from pmakit.storage import mirror, registry

    run = make_run(n=2)
    _put_tree(s3_server, run, bucket, "run")
    url = f"s3://{bucket}/run"
    mirror.prefetch([url, f"{url}/"])  # one URL, however written
    assert len(mirror._PREFETCHED) == 1
    before = registry.request_count()
    mirror._PREFETCHED[url].result(timeout=60)
    fetched = registry.request_count() - before
    assert fetched > 0
    root = mirror.localize(url + "/")
    assert registry.request_count() - before == fetched  # nothing asked again
    assert sorted(p.name for p in root.iterdir()) == ["step-000100", "step-000200"]
    assert mirror.origin(root / "step-000200") == f"{url}/step-000200"
    again = mirror.localize(url)
    assert again != root and registry.request_count() - before > fetched

    mirror.prefetch([f"s3://{bucket}/nothing-here"])
    with pytest.raises(PmakitError, match="nothing stored under this prefix"):
        mirror.localize(f"s3://{bucket}/nothing-here")
    mirror.prefetch(["s3://b/x?sig=1"])  # not a URL it takes: left to the localize of it
    assert "s3://b/x?sig=1" not in mirror._PREFETCHED


def test_the_cli_prefetches_its_inputs_not_its_output(monkeypatch: pytest.MonkeyPatch) -> None:
    from pmakit import _env
    from pmakit.storage import mirror

    started: list[list[str]] = []
    monkeypatch.setattr(mirror, "prefetch", lambda urls: started.append(list(urls)))
    _env.prefetch_inputs(["merge", "s3://b/run", "gs://c/s1", "-o", "s3://b/out", "--last", "4"])
    _env.prefetch_inputs(["inspect", "--output", "s3://b/x", "s3://b/run"])
    _env.prefetch_inputs(["merge", "s3://b/run", "--output=s3://b/out"])
    _env.prefetch_inputs(["merge", "runs/local", "-o", "s3://b/out"])  # nothing remote to read
    _env.prefetch_inputs(["train", "s3://b/run"])  # not a command that mirrors its arguments
    assert started == [["s3://b/run", "gs://c/s1"], ["s3://b/run"], ["s3://b/run"]]


def test_an_unused_prefetch_leaves_no_folder(s3_server: Any, bucket: str, tmp_path: Path) -> None:
    """A process that ends before it takes its prefetched mirror (a usage error after the prefetch began) leaves
    no mirror folder behind."""
    import subprocess
    import sys

    client = s3_server.client()
    for k in range(40):
        client.put_object(Bucket=bucket, Key=f"run/s/f{k}.json", Body=b"{}")
    temp = tmp_path / "tmp"
    temp.mkdir()
    code = (
        "from pmakit.storage import mirror\n"
        f"mirror.prefetch(['s3://{bucket}/run'])\n"
        "mirror._PREFETCHED.popitem()[1].result(timeout=60)\n"  # one made
        f"mirror.prefetch(['s3://{bucket}/run/s'])\n"  # one under way at exit
    )
    env = {**os.environ, **s3_server.env(), "TMPDIR": str(temp)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert list(temp.iterdir()) == []
