"""A merge into object storage obeys the rules of a folder output, for s3:// (a moto server) and gs:// (the GCS
emulator), through the real CLI and the library: no output equal to, inside or containing an input (keys compared
after normalising), foreign objects replaced only with --force, --force leaving exactly the new merge (manifest
deleted first, written last), `.`/`//` keys folded and `..` refused, a private per-user staging folder that a
planted link cannot redirect, and no credential of an endpoint URL in any message."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli
from pmakit.errors import PmakitError, redact
from pmakit.formats import read_state
from pmakit.snapshot import MERGE_MANIFEST
from s3server import FaultProxy, free_port

SNAPS = ("step-000100", "step-000200", "step-000300")


@pytest.fixture(scope="module")
def gcs_server() -> Iterator[Any]:
    pytest.importorskip(
        "gcp_storage_emulator", reason="the gs:// tests need gcp-storage-emulator (the test extra)"
    )
    from s3server import GCSEmulator

    server = GCSEmulator()
    yield server
    server.stop()


class Bucket:
    """A fresh bucket on the test server of ``scheme``: put objects, read them all back, the env that reaches it."""

    def __init__(self, scheme: str, server: Any) -> None:
        self.scheme, self.server, self.name = scheme, server, f"b-{uuid.uuid4().hex[:12]}"
        self.client = server.client()
        if scheme == "s3":
            self.client.create_bucket(Bucket=self.name)
        else:
            self.client.create_bucket(self.name)
        self.env = server.env()

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.name}/{key}" if key else f"{self.scheme}://{self.name}"

    def put(self, key: str, data: bytes) -> None:
        if self.scheme == "s3":
            self.client.put_object(Bucket=self.name, Key=key, Body=data)
        else:
            self.client.bucket(self.name).blob(key).upload_from_string(data)

    def put_tree(self, local: Path, prefix: str) -> None:
        for path in sorted(local.rglob("*")):
            if path.is_file():
                self.put(f"{prefix}/{path.relative_to(local).as_posix()}", path.read_bytes())

    def objects(self, prefix: str = "") -> dict[str, bytes]:
        """Every object under ``prefix``: key -> bytes."""
        if self.scheme == "s3":
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
            keys = [o["Key"] for page in pages for o in page.get("Contents", [])]
            return {k: self.client.get_object(Bucket=self.name, Key=k)["Body"].read() for k in keys}
        blobs = self.client.list_blobs(self.name, prefix=prefix)
        return {b.name: b.download_as_bytes() for b in blobs}

    def download(self, prefix: str, local: Path) -> Path:
        for key, data in self.objects(prefix + "/").items():
            target = local / key[len(prefix) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
        return local


@pytest.fixture(params=["s3", "gs"])
def bucket(request: pytest.FixtureRequest) -> Bucket:
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    return Bucket(request.param, server)


def _merge_keys(prefix: str) -> list[str]:
    """The objects of a one-file merge under ``prefix``, sorted."""
    return sorted(f"{prefix}/{n}" for n in ("config.json", MERGE_MANIFEST, "model.safetensors"))


def _one_line_error(proc: Any) -> str:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def _env(bucket: Bucket, tmp_path: Path, **more: str) -> dict[str, str]:
    return {**bucket.env, "PMAKIT_STAGING": str(tmp_path / "staging"), **more}


def test_an_output_overlapping_an_input_is_refused(
    bucket: Bucket, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    bucket.put_tree(make_run(n=3), "run")
    before = bucket.objects()
    env = _env(bucket, tmp_path)
    run = bucket.url("run")
    cases = [
        ((run,), run, "is the input"),
        (
            (run,),
            f"{run}//./",
            "is the input",
        ),  # the same prefix once `//`, `.` and the trailing slash are folded
        ((run,), f"{run}/{SNAPS[0]}", "inside the input"),  # over an input snapshot's own files
        ((run,), f"{run}/merged", "inside the input"),  # among the run's snapshots
        ((f"{run}/{SNAPS[0]}", f"{run}/{SNAPS[1]}"), run, "contains the input"),
        ((run,), bucket.url(), "never at a bucket's root"),
    ]
    for inputs, out, why in cases:
        line = _one_line_error(run_cli("merge", *inputs, "-o", out, "--quiet", env=env))
        assert why in line, (out, line)
    assert bucket.objects() == before  # not one object written or replaced


def test_foreign_objects_need_force_and_force_leaves_only_the_merge(
    bucket: Bucket, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    bucket.put_tree(make_run(n=2), "run")
    foreign = {
        "prod/model.safetensors": b"someone's model",
        "prod/config.json": b"{}",
        "prod/notes/a.txt": b"a",
    }
    for key, data in foreign.items():
        bucket.put(key, data)
    env = _env(bucket, tmp_path)
    for flags in ((), ("--resume",)):
        line = _one_line_error(run_cli("merge", bucket.url("run"), "-o", bucket.url("prod"), *flags, env=env))
        assert "no pmakit-merge.json" in line and "--force" in line
    assert bucket.objects("prod/") == foreign

    done = run_cli("merge", bucket.url("run"), "-o", bucket.url("prod"), "--force", "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(bucket.objects("prod/")) == _merge_keys("prod")
    finished = bucket.objects("prod/")
    line = _one_line_error(
        run_cli("merge", bucket.url("run"), "--last", "1", "-o", bucket.url("prod"), "--resume", env=env)
    )
    assert (
        "holds a finished merge already" in line and bucket.objects("prod/") == finished
    )  # as a folder's --resume

    bucket.put("empty/", b"")  # a console's "folder": no content of anyone's
    done = run_cli("merge", bucket.url("run"), "-o", bucket.url("empty"), "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert sorted(bucket.objects("empty/")) == _merge_keys("empty")


def _merged_locally(run: Path, out: Path, *flags: str) -> dict[str, torch.Tensor]:
    assert run_cli("merge", run, "-o", out, "--quiet", *flags).returncode == 0
    return read_state(out)


def test_force_replaces_a_bigger_merge_with_exactly_the_new_one(
    bucket: Bucket, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=3)
    bucket.put_tree(run, "run")
    env = _env(bucket, tmp_path)
    out = bucket.url("merged")
    first = run_cli("merge", bucket.url("run"), "-o", out, "--max-shard-size", "2KB", "--quiet", env=env)
    assert first.returncode == 0, first.stderr
    old = bucket.objects("merged/")
    assert (
        "merged/model.safetensors.index.json" in old
        and len([k for k in old if k.endswith(".safetensors")]) > 2
    )

    proxy = FaultProxy(bucket.server.port) if bucket.scheme == "s3" else None
    if proxy is not None:
        env["AWS_ENDPOINT_URL"] = proxy.url
    try:
        second = run_cli("merge", bucket.url("run"), "-o", out, "--last", "1", "--force", "--quiet", env=env)
    finally:
        if proxy is not None:
            proxy.stop()
    assert second.returncode == 0, second.stderr
    new = bucket.objects("merged/")
    assert sorted(new) == _merge_keys("merged")
    # pmakit's own reader of what is there now returns the new merge (the newest snapshot alone)
    got = read_state(bucket.download("merged", tmp_path / "down"))
    want = _merged_locally(run, tmp_path / "local", "--last", "1")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if (
        proxy is not None
    ):  # the order of the writes: manifest deleted first, the old files next, manifest last
        writes = [(m, p.split("?")[0]) for m, p in proxy.requests if m in ("PUT", "POST", "DELETE")]
        manifest = f"/{bucket.name}/merged/{MERGE_MANIFEST}"
        assert writes[0] == ("DELETE", manifest) and writes[-1] == ("PUT", manifest), writes
        deletes = [i for i, (m, p) in enumerate(writes) if m == "DELETE" and p != manifest]
        puts = [i for i, (m, _) in enumerate(writes) if m != "DELETE"]
        assert len(deletes) == len(old) - 2 and max(deletes) < min(puts), writes


def test_dot_keys_are_folded_and_only_the_merges_own_staging_folder_goes(
    bucket: Bucket, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    bucket.put_tree(make_run(n=2), "run")
    staging = tmp_path / "staging"
    others = [
        staging / "pmakit-staging" / "other" / "shard",
        staging / f"pmakit-staging-{os.getuid()}" / "o" / "f",
    ]
    for path in others:  # other merges' staging folders, in progress or waiting for --resume
        path.parent.mkdir(parents=True)
        path.write_text("another merge")
    env = _env(bucket, tmp_path)
    done = run_cli("merge", bucket.url("run"), "-o", bucket.url("merged/."), env=env)
    assert done.returncode == 0, done.stderr
    assert f"published {bucket.url('merged')}\n" in done.stdout
    written = sorted(k for k in bucket.objects() if not k.startswith("run/"))
    assert written == _merge_keys("merged")
    assert all(p.read_text() == "another merge" for p in others)
    assert sorted(p.name for p in (staging / f"pmakit-staging-{os.getuid()}").iterdir()) == ["o"]

    line = _one_line_error(run_cli("merge", bucket.url("run"), "-o", bucket.url("x/../merged2"), env=env))
    assert "'..'" in line and not bucket.objects("merged2/") and not bucket.objects("x/")


def test_a_planted_staging_link_is_refused_and_staging_is_private(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    bucket = Bucket("s3", s3_server)
    bucket.put_tree(make_run(n=2), "run")
    staging, victim = tmp_path / "staging", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    staging.mkdir()
    mine = staging / f"pmakit-staging-{os.getuid()}"
    for name in ("pmakit-staging", mine.name):  # the shared name older versions used, and this user's own
        (staging / name).symlink_to(victim)
    env = _env(bucket, tmp_path)
    line = _one_line_error(run_cli("merge", bucket.url("run"), "-o", bucket.url("merged"), env=env))
    assert f"refusing the staging folder {mine}" in line and "link" in line
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"] and not bucket.objects("merged/")

    mine.unlink()
    done = run_cli("merge", bucket.url("run"), "-o", bucket.url("merged"), "--quiet", env=env)
    assert done.returncode == 0, done.stderr
    assert stat.S_IMODE(mine.lstat().st_mode) == 0o700 and not mine.is_symlink()
    assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"]


def test_credentials_in_the_endpoint_are_never_printed(tmp_path: Path) -> None:
    secrets = ("AKIAEXAMPLEKEY", "wJalrSuperSecret", "sigsigsig", "tok3n")
    endpoint = f"http://{secrets[0]}:{secrets[1]}@127.0.0.1:{free_port()}/?X-Amz-Signature={secrets[2]}&token={secrets[3]}"
    env = {"AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_DEFAULT_REGION": "us-east-1"}
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_MAX_ATTEMPTS="1")
    for args in (
        ("merge", "s3://bkt/run", "-o", tmp_path / "out"),
        ("merge", "s3://bkt/run", "-o", "s3://bkt/m"),
    ):
        proc = run_cli(*args, env={**env, "AWS_ENDPOINT_URL": endpoint})
        line = _one_line_error(proc)
        assert "s3://bkt" in line and "***" in line, line
        assert not any(s in proc.stderr + proc.stdout for s in secrets), proc.stderr


def test_redact_removes_userinfo_and_credential_parameters() -> None:
    cases = {
        "endpoint `http://KEY:SECRET@host:9000/b` down": "endpoint `http://***@host:9000/b` down",
        "https://h/o?X-Amz-Credential=AK%2F1&X-Amz-Date=1&X-Amz-Signature=ab12": (
            "https://h/o?X-Amz-Credential=***&X-Amz-Date=1&X-Amz-Signature=***"
        ),
        "GET https://a.blob/c?sv=1&sig=xyz&se=2 failed": "GET https://a.blob/c?sv=1&sig=***&se=2 failed",
        "s3://bucket/run/step-100 and /home/u@x/run": "s3://bucket/run/step-100 and /home/u@x/run",
        "http://h/?access_key=AK&password=pw&monkey=1": "http://h/?access_key=***&password=***&monkey=1",
        "Authorization: AWS4-HMAC-SHA256 Credential=AK/2026/s3, SignedHeaders=host, Signature=ab": (
            "Authorization: AWS4-HMAC-SHA256 Credential=***, SignedHeaders=host, Signature=***"
        ),
        "exit code=3, key=4": "exit code=3, key=4",  # only a URL's query parameters are read as credentials
    }
    for text, want in cases.items():
        assert redact(text) == want
    assert (
        str(PmakitError("s3://b: failed (http://k:s@h/?token=t)"))
        == "s3://b: failed (http://***@h/?token=***)"
    )


_SEGMENT = st.text(alphabet="abz0-_", min_size=1, max_size=4)


def _noisy(parts: list[str], draw: Any) -> str:
    """The key of ``parts`` as a careless user may write it: `//`, `/./`, `x/..` detours, a trailing slash."""
    out = []
    for part in parts:
        out.append(draw(st.sampled_from(["", "/", "./", "zz/../"])) + part)
    return "/".join(out) + draw(st.sampled_from(["", "/", "/.", "//"]))


@st.composite
def _overlapping(draw: Any) -> tuple[str, str]:
    """An input URL and an output URL that is it, lies inside it or contains it."""
    scheme = draw(st.sampled_from(["s3", "gs"]))
    key = draw(st.lists(_SEGMENT, min_size=1, max_size=4))
    how = draw(st.sampled_from(["same", "inside", "contains"]))
    if how == "inside":
        out = key + draw(st.lists(_SEGMENT, min_size=1, max_size=3))
    elif how == "contains":
        out = key[: draw(st.integers(1, len(key)))]
    else:
        out = key
    return f"{scheme}://bkt/{_noisy(key, draw)}", f"{scheme}://bkt/{_noisy(out, draw)}"


@settings(max_examples=300, deadline=None)
@given(_overlapping())
def test_every_output_overlapping_an_input_is_refused(case: tuple[str, str]) -> None:
    from pmakit.merge.url import check_url_output

    given_input, out = case
    with pytest.raises(PmakitError, match="refusing to write|'..'"):
        check_url_output(out, inputs=[given_input], force=True)  # refused before any request: no server here


@settings(max_examples=100, deadline=None)
@given(st.lists(_SEGMENT, min_size=1, max_size=3), st.lists(_SEGMENT, min_size=1, max_size=3))
def test_a_sibling_prefix_does_not_overlap(base: list[str], tail: list[str]) -> None:
    from pmakit.storage.publish import output_location, overlap

    out = output_location(f"s3://bkt/{'/'.join([*base, 'out', *tail])}").url
    assert overlap(out, [f"s3://bkt/{'/'.join([*base, 'in'])}", f"gs://bkt/{'/'.join(base)}"]) is None
    assert overlap(out, [f"s3://bkt/{'/'.join([*base, 'ou'])}"]) is None  # segments, not characters


def test_the_library_merges_into_a_url_with_the_folder_rules_and_the_device(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pmakit.merge import merge
    from pmakit.snapshot import discover
    from pmakit.storage import localize, registry
    from pmakit.world import World

    run = make_run(n=3)
    bucket = Bucket("s3", s3_server)
    bucket.put_tree(run, "run")
    for k, v in _env(bucket, tmp_path).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})  # a client made under this test's endpoint
    snaps = discover(localize(bucket.url("run")))
    weights = [1 / 3] * 3

    # Inside an input: found through the mirror the snapshots came from
    with pytest.raises(PmakitError, match="inside the input"):
        merge(snaps, weights, f"{bucket.url('run')}/{SNAPS[1]}/x")
    # The device reaches the staging merge: a meta device fails there as it fails a folder's merge
    with pytest.raises(NotImplementedError) as folder:
        merge(snaps, weights, tmp_path / "meta", world=World(0, 1, "meta"))
    with pytest.raises(NotImplementedError) as url:
        merge(snaps, weights, bucket.url("meta"), world=World(0, 1, "meta"))
    assert str(url.value) == str(folder.value) and f"meta/{MERGE_MANIFEST}" not in bucket.objects("meta/")

    result = merge(snaps, weights, bucket.url("lib//"))
    assert result.url == bucket.url("lib") and not result.path.exists()  # the staging folder is gone
    manifest = json.loads(bucket.objects("lib/")[f"lib/{MERGE_MANIFEST}"])
    assert manifest["output_url"] == bucket.url("lib")
    assert [i["path"] for i in manifest["inputs"]] == [bucket.url(f"run/{s}") for s in SNAPS]
    got = read_state(bucket.download("lib", tmp_path / "down"))
    want = _merged_locally(run, tmp_path / "local")
    assert all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(PmakitError, match="holds a finished merge already"):
        merge(snaps, weights, bucket.url("lib"))
    assert merge(snaps[-1:], [1.0], bucket.url("lib"), force=True).url == bucket.url("lib")


def test_the_library_resumes_a_cut_publish_without_merging_again(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pmakit.merge import merge
    from pmakit.snapshot import discover
    from pmakit.storage import localize, registry

    bucket = Bucket("s3", s3_server)
    bucket.put_tree(make_run(n=2), "run")
    proxy = FaultProxy(s3_server.port)
    puts = {"n": 0}

    def fault(method: str, path: str, headers: dict[str, str]) -> str | None:
        if method == "PUT":
            puts["n"] += 1
            return "down" if puts["n"] > 1 else None  # the first file goes up, then the server is gone
        return None

    for k, v in _env(bucket, tmp_path, AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(registry, "_STORES", {})
    try:
        snaps = discover(localize(bucket.url("run")))
        proxy.fault = fault
        with pytest.raises(PmakitError, match="upload"):
            merge(snaps, [0.5, 0.5], bucket.url("m"), max_shard_size=3000)
        assert bucket.objects("m/") and f"m/{MERGE_MANIFEST}" not in bucket.objects("m/")
        with pytest.raises(PmakitError, match="a cut publish"):  # not a merge there yet
            merge(snaps, [0.5, 0.5], bucket.url("m"), max_shard_size=3000)
        proxy.fault = lambda *a: None
        result = merge(snaps, [0.5, 0.5], bucket.url("m"), max_shard_size=3000, resume=True)
    finally:
        proxy.stop()
    assert result.seconds == 0.0  # the staged merge was published as it was, not made again
    assert f"m/{MERGE_MANIFEST}" in bucket.objects("m/")
    assert not any((tmp_path / "staging" / f"pmakit-staging-{os.getuid()}").iterdir())


def test_a_killed_staging_merge_is_continued_by_the_same_command(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    run = make_run(n=2)
    bucket = Bucket("s3", s3_server)
    bucket.put_tree(run, "run")
    args = ("merge", bucket.url("run"), "-o", bucket.url("m"), "--max-shard-size", "2KB", "--quiet")
    scratch = tmp_path / "tmp"  # the commands' TMPDIR, where their mirrors are made
    scratch.mkdir()
    killed = run_cli(*args, env=_env(bucket, tmp_path, TMPDIR=str(scratch), PMAKIT_TEST_KILL="after-shard:1"))
    assert killed.returncode == -9 and not bucket.objects(
        "m/"
    )  # killed in the staging merge: nothing published
    left = list(scratch.glob("pmakit-remote-*"))  # a SIGKILL runs no exit handler: the input's mirror stays
    again = run_cli(*args, env=_env(bucket, tmp_path, TMPDIR=str(scratch)))
    assert again.returncode == 0, again.stderr
    assert len(left) == 1 and list(scratch.glob("pmakit-remote-*")) == left  # the second one removed its own
    assert "continuing the interrupted merge" in again.stderr  # as a folder's merge: not started over
    got = read_state(bucket.download("m", tmp_path / "down"))
    want = _merged_locally(run, tmp_path / "local", "--max-shard-size", "2KB")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_gcs_reads_pin_the_listed_generation_and_a_rewritten_object_is_one_line(
    gcs_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """The emulator ignores ``ifGenerationMatch``, so a recording proxy in front of it checks that every read of
    an object carries the generation the listing gave, then answers 412 as GCS does for a rewritten object."""
    from urllib.parse import parse_qs, urlsplit

    bucket = Bucket("gs", gcs_server)
    bucket.put_tree(make_run(n=2), "run")
    generations = {b.name: str(b.generation) for b in bucket.client.list_blobs(bucket.name, prefix="run/")}
    proxy = FaultProxy(gcs_server.port)
    try:
        env = {**_env(bucket, tmp_path), "STORAGE_EMULATOR_HOST": proxy.url, "AWS_MAX_ATTEMPTS": "1"}
        done = run_cli("merge", bucket.url("run"), "-o", tmp_path / "out", "--quiet", env=env)
        assert done.returncode == 0, done.stderr
        reads = [urlsplit(p) for m, p in proxy.requests if m == "GET" and "alt=media" in p]
        assert reads, proxy.requests
        for url in reads:
            name = url.path.split("/o/", 1)[1].replace("%2F", "/")
            assert parse_qs(url.query).get("ifGenerationMatch") == [generations[name]], url

        weights = "model.safetensors"
        proxy.fault = lambda method, path, headers: (
            "412" if method == "GET" and "alt=media" in path and weights in path else None
        )
        line = _one_line_error(
            run_cli("merge", bucket.url("run"), "-o", tmp_path / "out2", "--quiet", env=env)
        )
        assert "generation" in line and "gs://" in line, line
        assert not (tmp_path / "out2" / MERGE_MANIFEST).exists()
    finally:
        proxy.stop()


def test_credentials_in_a_gcs_endpoint_are_never_printed_or_written(
    gcs_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """STORAGE_EMULATOR_HOST with a user:password and signed-URL style parameters: a merge through it and a
    failing one (no such bucket) print and write none of them (the Error line, the log lines, the manifest)."""
    secrets = ("AKIAEXAMPLEKEY", "wJalrSuperSecret", "sigsigsig", "tok3n")
    bucket = Bucket("gs", gcs_server)
    bucket.put_tree(make_run(n=2), "run")
    host = f"http://{secrets[0]}:{secrets[1]}@127.0.0.1:{gcs_server.port}"
    env = _env(bucket, tmp_path, STORAGE_EMULATOR_HOST=host, AWS_MAX_ATTEMPTS="1")
    out = f"{bucket.url('merged')}?X-Goog-Signature={secrets[2]}&token={secrets[3]}"
    shown = ""
    for args in (
        ("merge", bucket.url("run"), "-o", bucket.url("merged")),
        ("merge", f"gs://no-such-{bucket.name}/run", "-o", tmp_path / "out"),
        ("merge", bucket.url("run"), "-o", out),
    ):
        proc = run_cli(*args, env=env)
        shown += proc.stdout + proc.stderr
        if args[1] != bucket.url("run") or args[3] == out:
            assert "***" in _one_line_error(proc) or "no such" in _one_line_error(proc), proc.stderr
    assert f"merged/{MERGE_MANIFEST}" in bucket.objects("merged/"), shown[-3000:]
    manifest = bucket.objects("merged/")[f"merged/{MERGE_MANIFEST}"].decode()
    assert not any(s in shown + manifest for s in secrets), shown
    assert sorted(bucket.objects()) == sorted([*bucket.objects("run/"), *_merge_keys("merged")])


def test_a_second_writer_during_publish_leaves_no_finished_mix(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """Another merge into the same prefix rewrites a shard just as this one writes its manifest (the proxy makes
    the race certain): one Error line, and no manifest beside the other writer's bytes."""
    bucket = Bucket("s3", s3_server)
    bucket.put_tree(make_run(n=2), "run")
    proxy = FaultProxy(s3_server.port)
    rewritten = {"n": 0}

    def other_writer(method: str, path: str, headers: dict[str, str]) -> str | None:
        if method == "PUT" and MERGE_MANIFEST in path and not rewritten["n"]:
            rewritten["n"] += 1
            bucket.put("merged/model.safetensors", b"another merge's bytes")
        return None

    proxy.fault = other_writer
    try:
        env = _env(bucket, tmp_path, AWS_ENDPOINT_URL=proxy.url, AWS_MAX_ATTEMPTS="1")
        line = _one_line_error(
            run_cli("merge", bucket.url("run"), "-o", bucket.url("merged"), "--quiet", env=env)
        )
    finally:
        proxy.stop()
    assert rewritten["n"] == 1 and "another writer" in line, line
    assert f"merged/{MERGE_MANIFEST}" not in bucket.objects("merged/")


def test_two_racing_merges_into_one_prefix_leave_one_whole_merge_or_none(
    s3_server: Any, make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """Two real CLI processes, a sharded merge and a one-file merge, publish into the same prefix at once: each
    exits 0 or with one Error line, and whatever manifest is left stands beside exactly its own merge."""
    import subprocess
    import sys

    from conftest import SRC

    bucket = Bucket("s3", s3_server)
    run = make_run(n=3)
    bucket.put_tree(run, "run")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE", **_env(bucket, tmp_path)}
    _merged_locally(run, tmp_path / "local-a", "--max-shard-size", "2KB")
    _merged_locally(run, tmp_path / "local-b", "--last", "1")
    flags = [("--max-shard-size", "2KB", "--force"), ("--last", "1", "--force")]
    for _ in range(2):
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "pmakit", "merge", bucket.url("run"), "-o", bucket.url("merged"), *f],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for f in flags
        ]
        for p in procs:
            _, err = p.communicate(timeout=600)
            assert "Traceback" not in err and (p.returncode == 0 or err.count("Error:") == 1), err[-2000:]
        left = bucket.objects("merged/")
        if f"merged/{MERGE_MANIFEST}" not in left:
            continue  # none: each merge's check found the other's objects and took its manifest back
        # Beside the manifest, exactly the files of one of the two merges (made on disk), byte for byte, each
        # weight file with the size and sha256 the manifest names.
        files = json.loads(left.pop(f"merged/{MERGE_MANIFEST}"))["output"]["files"]
        for f in files:
            data = left[f"merged/{f['name']}"]
            assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"], f["name"]
        ones = [
            {f"merged/{x.name}": x.read_bytes() for x in local.iterdir() if x.name != MERGE_MANIFEST}
            for local in (tmp_path / "local-a", tmp_path / "local-b")
        ]
        assert left in ones, sorted(left)
