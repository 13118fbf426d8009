"""A study's result rows (RUN/results.jsonl): read them back (``pmakit.runs.read_jsonl``), and clear a study's run.

One copy shared by the main study (``pmakit.lab.pma``), the spike and init studies (``pmakit.lab.recovery``) and the
loss-plane analysis (``pmakit.lab.plane``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.runs import RESULTS, read_jsonl


def iter_rows(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The results of a finished or partial study."""
    yield from read_jsonl(Path(run_dir) / RESULTS)


def remove_run(run_dir: Path) -> None:
    """--fresh: remove what an earlier study wrote (only that), so nothing unrelated is deleted."""
    if not (run_dir / "config.json").exists() and any(run_dir.iterdir()):
        raise PmakitError(f"{run_dir} is not empty and not a pmakit experiment; refusing to clear it")
    shutil.rmtree(run_dir)
