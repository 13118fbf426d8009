"""The frameworks' save folders, written by their own code, merged from s3:// (a moto server on localhost) exactly as
from disk: the same output bytes. torchtitan's at FSDP over 2 ranks (DCP, .distcp per rank), Megatron's torch_dist
at TP=2 (chunks split on an inner dim, common.pt and metadata.json beside them)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from s3server import MotoServer, upload_tree


@pytest.fixture
def s3(request: pytest.FixtureRequest) -> Any:
    """A moto server of the test's own: the session's would tie the torchtitan and Megatron fixtures' xdist groups
    (and every object-storage test) into one worker."""
    pytest.importorskip("moto.server")
    server = MotoServer()
    request.addfinalizer(server.stop)
    return server


def assert_same_merge_from_s3(s3_server: Any, folder: Path, tmp_path: Path) -> None:
    bucket = f"fw-{uuid.uuid4().hex[:10]}"
    client = s3_server.client()
    client.create_bucket(Bucket=bucket)
    upload_tree(client, folder, bucket, "team/run")
    args = ("-q", "--format", "safetensors")
    remote = run_cli(
        "merge", f"s3://{bucket}/team/run", "-o", tmp_path / "remote", *args, env=s3_server.env()
    )
    assert remote.returncode == 0, remote.stderr[-3000:]
    local = run_cli("merge", folder, "-o", tmp_path / "local", *args)
    assert local.returncode == 0, local.stderr[-3000:]
    files = sorted(p.name for p in (tmp_path / "local").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "remote").glob("*.safetensors"))
    for name in files:
        assert (tmp_path / "remote" / name).read_bytes() == (tmp_path / "local" / name).read_bytes(), name


def test_torchtitan_fsdp_save_folder_from_s3(
    s3: Any, torchtitan_runs: dict[str, Path], tmp_path: Path
) -> None:
    assert_same_merge_from_s3(s3, torchtitan_runs["ws2"], tmp_path)


def test_megatron_tp2_save_folder_from_s3(s3: Any, megatron_runs: dict[str, Path], tmp_path: Path) -> None:
    assert_same_merge_from_s3(s3, megatron_runs["tp2"], tmp_path)
