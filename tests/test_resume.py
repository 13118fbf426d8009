"""--resume: a merge killed (SIGKILL) at any point finishes, redoing only unfinished shards, with the same bytes."""

from __future__ import annotations

import json
import multiprocessing
import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_env
from pmakit.errors import PmakitError
from pmakit.merge import PROGRESS_DIR, merge, partial_dir
from pmakit.merge._faults import KILL_ENV
from pmakit.snapshot import discover
from pmakit.weights import get_weights

SHARD = 2048  # every 64x16 bf16 tensor gets a shard of its own: 6 shards


def _files(directory: Path) -> dict[str, Any]:
    """Every file's bytes; DCP's ``.metadata`` without the random save id torch puts in every checkpoint."""
    out: dict[str, Any] = {}
    for f in sorted(directory.rglob("*")):
        if f.is_file() and f.name != "pmakit-merge.json":
            out[str(f.relative_to(directory))] = f.read_bytes()
    if ".metadata" in out:
        metadata = pickle.loads(out[".metadata"])
        out[".metadata"] = (metadata.state_dict_metadata, metadata.storage_data)
    return out


def _output_files(directory: Path) -> list[dict[str, Any]]:
    return [f for f in _manifest(directory)["output"]["files"] if f["name"] != ".metadata"]


def _manifest(directory: Path) -> dict[str, Any]:
    record = json.loads((directory / "pmakit-merge.json").read_text())
    record.pop("created")
    return record


def _killed_merge(point: str, run: Path, out: Path, **options: Any) -> None:
    """Run the merge in a forked child (torch is already imported) that SIGKILLs itself at ``point``."""

    def child() -> None:
        os.environ[KILL_ENV] = point
        snaps = discover(run)
        merge(snaps, get_weights("sma", len(snaps)), out, max_shard_size=SHARD, fsync=False, **options)
        os._exit(0)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(120)
    assert proc.exitcode == -9, f"the merge was not killed at {point} (exit code {proc.exitcode})"


def _merge(run: Path, out: Path, **options: Any) -> None:
    snaps = discover(run)
    merge(snaps, get_weights("sma", len(snaps)), out, max_shard_size=SHARD, fsync=False, **options)


@pytest.fixture
def run(make_run: Callable[..., Path]) -> Path:
    return make_run(4)


@pytest.mark.parametrize("options", [{}, {"keep_fp32": True, "dtype": "fp16"}, {"out_format": "dcp"}])
@pytest.mark.parametrize("point", ["after-shard:1", "after-shard:4", "in-shard:2", "before-rename"])
def test_resume_after_kill_is_identical(
    run: Path, tmp_path: Path, point: str, options: dict[str, Any]
) -> None:
    _merge(run, tmp_path / "ref", **options)
    out = tmp_path / "out"
    _killed_merge(point, run, out, **options)
    assert not out.exists() and partial_dir(out).exists()
    _merge(run, out, resume=True, **options)
    assert not partial_dir(out).exists()
    assert _files(out) == _files(tmp_path / "ref")
    assert _output_files(out) == _output_files(tmp_path / "ref")
    if options.get("out_format") != "dcp":  # DCP's .metadata holds a random save id, so its checksum differs
        assert _manifest(out) == _manifest(tmp_path / "ref")  # all but the creation time


def test_resume_redoes_only_unfinished_shards(
    run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _merge(run, tmp_path / "ref")
    out = tmp_path / "out"
    _killed_merge("after-shard:3", run, out)
    partial = partial_dir(out)
    done = sorted(f.name[: -len(".json")] for f in (partial / PROGRESS_DIR).glob("model-*.json"))
    assert len(done) == 3
    before = {name: (partial / name).stat().st_mtime_ns for name in done}
    # A finished shard damaged after the kill fails its checksum and is written again.
    damaged = partial / done[1]
    damaged.write_bytes(damaged.read_bytes()[:-4] + b"\0\0\0\0")
    _merge(run, out, resume=True)
    assert _files(out) == _files(tmp_path / "ref")
    kept = [n for n in done if (out / n).stat().st_mtime_ns == before[n]]
    assert kept == [done[0], done[2]]
    assert "does not match its checksum" in caplog.text


def test_resume_refuses_other_options_and_partial_needs_a_flag(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    _killed_merge("after-shard:2", run, out)
    with pytest.raises(PmakitError, match="other inputs or options"):
        _merge(run, out, dtype="fp32")  # without --resume too: only the very same merge is continued
    with pytest.raises(PmakitError, match="other inputs or options"):
        _merge(run, out, resume=True, dtype="fp32")
    with pytest.raises(PmakitError, match="other inputs or options"):
        snaps = discover(run)[1:]
        merge(snaps, get_weights("sma", 3), out, max_shard_size=SHARD, fsync=False, resume=True)
    assert partial_dir(out).exists()  # a refused resume leaves the interrupted merge alone
    _merge(run, out, resume=True)
    assert out.exists() and not partial_dir(out).exists()
    _merge(run, tmp_path / "fresh", resume=True)  # nothing to resume: a normal merge
    assert _files(tmp_path / "fresh") == _files(out)


def test_cli_resume_after_sigkill(run: Path, tmp_path: Path) -> None:
    """The real command, killed by SIGKILL in the middle of a shard, then resumed."""
    env = cli_env()
    cmd = [sys.executable, "-m", "pmakit", "merge", str(run), "--last", "4", "-o", str(tmp_path / "out")]
    cmd += ["--max-shard-size", str(SHARD), "--quiet"]
    killed = subprocess.run(
        cmd, env={**env, KILL_ENV: "in-shard:3"}, capture_output=True, text=True, timeout=1800
    )
    assert killed.returncode == -9 and partial_dir(tmp_path / "out").exists()
    resumed = subprocess.run([*cmd, "--resume"], env=env, capture_output=True, text=True, timeout=1800)
    assert resumed.returncode == 0, resumed.stderr
    _merge(run, tmp_path / "ref")
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")
