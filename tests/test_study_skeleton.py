"""A new study is one lab module, one report module, a config and one line in each dispatch table.

This file is both modules of a toy study (``study: toy``): ``resolve`` and ``run_study`` for ``pmakit experiment``
(``pmakit.lab.runner.STUDIES``), ``build`` and ``summary`` for ``pmakit report`` (``pmakit.report.sections.SECTIONS``).
It uses the shared skeleton (``open_run``, ``ResultRows``, ``write_csv``) and runs through the real click entry
point, in-process (the tables are registered in this process).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.lab import runner
from pmakit.lab.context import open_run, utc_now
from pmakit.lab.results import ResultRows, write_csv
from pmakit.report import sections
from pmakit.report.blocks import Block, Heading, Paragraph
from pmakit.runs import RESULTS, RESULTS_CSV, atomic_write_json, read_jsonl

STUDY = "toy"
MEASURED: list[int] = []
"""The i the toy study measured, in order, over every invocation of a test (the fixture empties it)."""

# --- the lab module: a study that "scores" i -> i * i, appending one row at a time (resumable)


def resolve(data: Mapping[str, Any]) -> int:
    n = (data.get(STUDY) or {}).get("n", 3)
    if not isinstance(n, int) or n < 1:
        raise PmakitError(f"toy.n must be a whole number of at least 1, got {n!r}")
    return n


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    from pmakit.report import write_report

    n = resolve(data)
    run = open_run(run_dir, {STUDY: {"n": n}}, fresh=fresh)
    rows = ResultRows(run.dir / RESULTS, lambda r: r["i"])
    for i in range(n):
        if i not in rows:
            MEASURED.append(i)
            rows.add({"i": i, "square": i * i, "measurement": len(MEASURED)})
    write_csv(run.dir / RESULTS_CSV, ("i", "square"), rows.rows)
    started = run.previous().get("started", run.started)
    atomic_write_json(
        run.dir / "experiment.json", {"study": STUDY, "started": started, "finished": utc_now()}
    )
    return write_report(run.dir).html


# --- the report module: reads the run's files only


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    total = sum(r["square"] for r in read_jsonl(run_dir / RESULTS))
    return [Heading("Toy study", 1), Paragraph(f"The squares sum to {total}.")], []


def summary(run_dir: Path) -> str:
    rows = read_jsonl(run_dir / RESULTS)
    return f"Toy study: {run_dir} ({len(rows)} rows, squares sum to {sum(r['square'] for r in rows)})"


# --- the tests


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """The toy study's line in each table, and its config file."""
    monkeypatch.setitem(runner.STUDIES, STUDY, __name__)
    monkeypatch.setitem(sections.SECTIONS, STUDY, __name__)
    MEASURED.clear()
    config = tmp_path / "toy.json"
    config.write_text(json.dumps({"study": STUDY, STUDY: {"n": 4}}))
    yield config


def _pmakit(*args: str | Path) -> Any:
    return CliRunner().invoke(cli, [str(a) for a in args])


def test_a_study_registered_in_both_tables_runs_and_reports(toy: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    result = _pmakit("experiment", toy, "-o", run)
    assert result.exit_code == 0, result.output
    assert "Toy study: " in result.output and "4 rows, squares sum to 14" in result.output
    assert [r["square"] for r in read_jsonl(run / RESULTS)] == [0, 1, 4, 9]
    assert (run / RESULTS_CSV).read_text().splitlines() == ["i,square", "0,0", "1,1", "2,4", "3,9"]
    assert json.loads((run / "config.json").read_text()) == {STUDY: {"n": 4}}
    assert "The squares sum to 14." in (run / "report.md").read_text()

    assert MEASURED == [0, 1, 2, 3]
    uninterrupted, first = (run / RESULTS).read_bytes(), read_jsonl(run / RESULTS)

    again = _pmakit("experiment", toy, "-o", run)  # resumed: no row measured twice
    assert again.exit_code == 0, again.output
    assert len(read_jsonl(run / RESULTS)) == 4
    # nothing measured again, and the rows are the first run's, byte for byte (each row names the measurement that
    # made it: a row measured anew, even to the same square, would carry a later one)
    assert MEASURED == [0, 1, 2, 3] and (run / RESULTS).read_bytes() == uninterrupted

    # Killed after two rows (the rest of the file, the stamp of the finish and the report never written): the
    # resumed run keeps those two rows as they are and measures the other two only, as the uninterrupted run did.
    kept = b"".join(uninterrupted.splitlines(keepends=True)[:2])
    (run / RESULTS).write_bytes(kept)
    for name in ("experiment.json", "report.md", "report.html", RESULTS_CSV):
        (run / name).unlink()
    resumed = _pmakit("experiment", toy, "-o", run)
    assert resumed.exit_code == 0, resumed.output
    assert MEASURED == [0, 1, 2, 3, 2, 3]
    rows = read_jsonl(run / RESULTS)
    assert (run / RESULTS).read_bytes().startswith(kept) and rows[:2] == first[:2]
    made = [(r["i"], r["square"], r["measurement"]) for r in rows]
    assert made == [(0, 0, 1), (1, 1, 2), (2, 4, 5), (3, 9, 6)]
    assert [(r["i"], r["square"]) for r in rows] == [(r["i"], r["square"]) for r in first]
    assert (run / RESULTS_CSV).read_text().splitlines() == ["i,square", "0,0", "1,1", "2,4", "3,9"]

    report = _pmakit("report", run)
    assert report.exit_code == 0, report.output
    assert "4 rows, squares sum to 14" in report.output and "report.html" in report.output


def test_the_skeleton_guards_a_registered_study(toy: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert _pmakit("experiment", toy, "-o", run).exit_code == 0
    toy.write_text(json.dumps({"study": STUDY, STUDY: {"n": 5}}))
    changed = _pmakit("experiment", toy, "-o", run)  # the same-config check of every study
    assert changed.exit_code != 0
    assert "another config (changed: toy.n)" in changed.output
    fresh = _pmakit("experiment", toy, "-o", run, "--fresh")
    assert fresh.exit_code == 0, fresh.output
    assert len(read_jsonl(run / RESULTS)) == 5
    pma = tmp_path / "pma.json"
    pma.write_text(json.dumps({"preset": "smoke"}))
    other = _pmakit("experiment", pma, "-o", run)  # the run directory names its study
    assert other.exit_code != 0
    assert "holds the toy study, not the pma study" in other.output
    toy.write_text(json.dumps({"study": STUDY, STUDY: {"n": 0}}))
    bad = _pmakit("experiment", toy, "-o", tmp_path / "bad")  # the study's resolve, before any file
    assert bad.exit_code != 0 and "toy.n must be" in bad.output
    assert not (tmp_path / "bad").exists()


def test_an_unregistered_study_is_one_error_naming_the_known_ones(tmp_path: Path) -> None:
    config = tmp_path / "toy.json"
    config.write_text(json.dumps({"study": STUDY}))
    result = _pmakit("experiment", config, "-o", tmp_path / "run")
    assert result.exit_code != 0
    assert "unknown study 'toy'; known: moe, spike, init, replicas, scaling, sweep" in result.output
    assert not (tmp_path / "run").exists()


def test_fresh_with_clears_removes_only_the_named_entries_and_the_stamp(tmp_path: Path) -> None:
    # A study run from before the config stamp (no config.json): --fresh removes what the study names, and the
    # stamp and clock that describe it, never the rest (whole-directory removal refuses a folder without a stamp).
    run = tmp_path / "run"
    (run / "arms" / "sync").mkdir(parents=True)
    (run / RESULTS).write_text('{"arm": "sync"}\n')
    (run / "notes.txt").write_text("mine")
    open_run(run, {STUDY: {"n": 1}}, fresh=True, clears=("arms", RESULTS))
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "notes.txt"]
    assert json.loads((run / "config.json").read_text()) == {STUDY: {"n": 1}}
    (run / "arms").mkdir()
    with pytest.raises(PmakitError, match="another config"):
        open_run(run, {STUDY: {"n": 2}}, fresh=False, clears=("arms",))
    opened = open_run(run, {STUDY: {"n": 2}}, fresh=True, clears=("arms",))
    assert not (run / "arms").exists() and (run / "notes.txt").read_text() == "mine"
    assert json.loads((run / "config.json").read_text()) == {STUDY: {"n": 2}}
    assert opened.clock.seconds == {}
