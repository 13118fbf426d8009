"""Metadata JSON that pmakit reads beside weights: nesting past the limit, FIFOs and files over the size limit are
refused in one line naming the limit (``limits.py``), never a RecursionError, MemoryError or a hang."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.layouts import torchtitan_hf
from pmakit.merge import capacity, incremental
from pmakit.snapshot import MERGE_MANIFEST

DEEP = "[" * 100_000 + "]" * 100_000  # past the interpreter's recursion limit, not only JSON_DEPTH


def test_loads_json_refuses_nesting_by_name() -> None:
    with pytest.raises(PmakitError, match=limits.JSON_DEPTH.name):
        limits.loads_json(DEEP, "x.json")
    with pytest.raises(PmakitError, match=limits.JSON_DEPTH.name):
        limits.loads_json("[" * 65 + "]" * 65, "x.json")
    assert limits.loads_json("[" * 64 + "]" * 64, "x.json") is not None


@pytest.mark.parametrize("text", [DEEP, '{"a": ' * 70 + "1" + "}" * 70], ids=["lists", "objects"])
def test_a_deep_capacity_layout_file_is_one_error(tmp_path: Path, text: str) -> None:
    (tmp_path / "layout.json").write_text(text)
    with pytest.raises(PmakitError, match=limits.JSON_DEPTH.name):
        capacity.load_layout(tmp_path / "layout.json")


def test_a_deep_previous_manifest_is_one_error(tmp_path: Path) -> None:
    (tmp_path / MERGE_MANIFEST).write_text(DEEP)
    with pytest.raises(PmakitError, match=limits.JSON_DEPTH.name):
        incremental._read_previous(tmp_path, "ema", 0.5)


def test_torchtitan_job_config_skips_fifos_and_deep_files(tmp_path: Path) -> None:
    """A FIFO named ``*.json`` in torchtitan's dump folder blocked the reader forever; a deep one raised."""
    checkpoint = tmp_path / "dump" / "checkpoint" / "step-10"
    checkpoint.mkdir(parents=True)
    os.mkfifo(tmp_path / "dump" / "a.json")
    (tmp_path / "dump" / "b.json").write_text(DEEP)
    (tmp_path / "dump" / "c.json").write_text('{"model_spec": {"name": "llama3", "flavor": "debug"}}')
    found: list[object] = []
    reader = threading.Thread(target=lambda: found.append(torchtitan_hf.job_config(checkpoint)), daemon=True)
    reader.start()
    reader.join(timeout=120)  # a hang guard, not a timing assertion
    assert not reader.is_alive(), "job_config blocked on a FIFO"
    assert found == [{"model_spec": {"name": "llama3", "flavor": "debug"}}]


@pytest.mark.parametrize("where", ["input", "output"])
def test_a_path_longer_than_path_max_is_one_line(tmp_path: Path, where: str) -> None:
    from conftest import run_cli, state, write_snapshot

    long = tmp_path / "/".join(["d" * 250] * 20)  # 5,000 characters: past PATH_MAX (4,096)
    run = tmp_path / "run"
    write_snapshot(run / "step-1", state(0), step=1, tokens=100)
    args = ("merge", long, "-o", tmp_path / "out") if where == "input" else ("merge", run, "-o", long)
    result = run_cli(*args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-1500:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "too long" in errors[0], result.stderr[-1500:]
    assert not (tmp_path / "out").exists()


def test_the_docs_limits_table_is_the_code_table() -> None:
    """docs/reliability.md lists every limit with its value (a limit added to limits.TABLE must be documented)."""
    text = (Path(__file__).parents[1] / "docs" / "reliability.md").read_text()
    for limit in limits.TABLE:
        assert f"| `{limit.name}` | {limit.value:,} |" in text, limit.name
