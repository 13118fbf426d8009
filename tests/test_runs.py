"""pmakit.runs: atomic writes leave the old file or the new one, JSONL readers skip torn lines, and it is a leaf."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest

import pmakit.runs as runs


def test_atomic_write_replaces_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    runs.atomic_write_json(path, {"x": 1})
    runs.atomic_write_json(path, {"x": 2}, indent=None)
    assert path.read_text() == '{"x": 2}\n'
    runs.atomic_write_bytes(tmp_path / "b.bin", b"\x00\r\n")
    runs.atomic_write_text(tmp_path / "c.csv", "a,b\r\n1,2\r\n")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\r\n"
    assert (tmp_path / "c.csv").read_bytes() == b"a,b\r\n1,2\r\n"  # no newline translation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.bin", "c.csv"]


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "results.csv"
    path.write_text("old\n")
    with pytest.raises(RuntimeError), runs.atomic_open(path) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]


def test_read_jsonl_skips_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / runs.RESULTS
    assert runs.read_jsonl(path) == []
    runs.append_jsonl(path, {"a": 1})
    with open(path, "a") as f:
        f.write('{"a": 2, "lo')  # a kill mid-append...
    runs.append_jsonl(path, {"a": 3})  # ...and the resumed run appends after the torn record
    with open(path, "a") as f:
        f.write('[1, 2]\n{"a": 4}\n{"a": 5')
    assert runs.read_jsonl(path) == [{"a": 1}, {"a": 4}]
    assert json.loads(path.read_text().splitlines()[0]) == {"a": 1}


def test_replace_dir_swaps_a_finished_directory_in(tmp_path: Path) -> None:
    out, partial = tmp_path / "merged", tmp_path / ".merged.partial"
    out.mkdir()
    (out / "old").write_text("1")
    partial.mkdir()
    (partial / "new").write_text("2")
    runs.replace_dir(partial, out)
    assert [p.name for p in out.iterdir()] == ["new"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged"]


def test_names() -> None:
    run = Path("RUN")
    assert runs.kept_checkpoint_dir(run, 4096) == Path("RUN/checkpoints/tokens-4096")
    assert runs.trainer_state(runs.checkpoint_dir(run)) == Path("RUN/checkpoint/trainer.pt")
    assert runs.snapshots_dir(runs.replica_dir(run, 1)) == Path("RUN/replicas/rank-1/snapshots")
    assert runs.snapshot_name(420) == "step-00000420" and runs.SNAPSHOT_NAME.match(runs.snapshot_name(10**9))
    assert not runs.SNAPSHOT_NAME.match("step-420")  # not the saver's: never deleted under keep_last


def test_runs_is_a_leaf() -> None:
    """The trainer, the lab, recover and the report all import it: it imports nothing of pmakit but errors and the
    limits table (itself a leaf: standard library and errors only)."""
    tree = ast.parse(Path(runs.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    outside = {m for m in imported if m.split(".")[0] not in sys.stdlib_module_names and m != "__future__"}
    assert outside <= {"pmakit.errors", "pmakit.limits"}
