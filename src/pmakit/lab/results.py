"""A study's result rows: read back, appended as they are measured (a resumed study skips the done ones), tabled.

One copy shared by every study of ``pmakit experiment`` and the loss-plane analysis (``pmakit.lab.plane``); the
columns of each study's table are declared in ``pmakit.report.schema``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from pmakit.runs import RESULTS, append_jsonl, atomic_open, checkpoint_dir, read_jsonl


def iter_rows(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The results of a finished or partial study."""
    yield from read_jsonl(Path(run_dir) / RESULTS)


class ResultRows:
    """The rows of one results file (JSONL), appended as they are measured; ``key`` names what a row measured, so
    a resumed study skips what is done (``key in rows``)."""

    def __init__(
        self,
        path: Path,
        key: Callable[[Mapping[str, Any]], Hashable],
        rows: list[dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.key = key
        self.rows = read_jsonl(path) if rows is None else rows
        self.done = {key(r) for r in self.rows}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.done

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self.done.add(self.key(row))
        append_jsonl(self.path, row)


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    """The table of ``rows`` (a missing or None cell is empty), rewritten whole: results.jsonl is the record."""
    with atomic_open(path, fsync=False) as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r[c] for c in columns])


def trained_tokens(run: Path) -> int:
    """Tokens of a run's final checkpoint (0 when it has none yet)."""
    try:
        return int(json.loads((checkpoint_dir(run) / "pmakit.json").read_text())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
