"""A study's result rows (RUN/results.jsonl): read them back (``pmakit.runs.read_jsonl``), and clear a study's run.

One copy shared by the main study (``pmakit.lab.pma``), the spike and init studies (``pmakit.lab.recovery``) and the
loss-plane analysis (``pmakit.lab.plane``); the resume helpers of the scaling and sweep studies.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.runs import RESULTS, atomic_write_json, checkpoint_dir, read_jsonl


def iter_rows(run_dir: Path) -> Iterator[dict[str, Any]]:
    """The results of a finished or partial study."""
    yield from read_jsonl(Path(run_dir) / RESULTS)


def remove_run(run_dir: Path) -> None:
    """--fresh: remove what an earlier study wrote (only that), so nothing unrelated is deleted."""
    if not (run_dir / "config.json").exists() and any(run_dir.iterdir()):
        raise PmakitError(f"{run_dir} is not empty and not a pmakit experiment; refusing to clear it")
    shutil.rmtree(run_dir)


def jsonable(x: Any) -> Any:
    """``x`` as it reads back from JSON (tuples as lists, paths as strings): what a config stamp compares."""
    return json.loads(json.dumps(x, default=str))


def check_same_config(run_dir: Path, config: dict[str, Any]) -> None:
    """Stamp RUN/config.json, or refuse to resume a study with another config: one results file would mix two."""
    stamp = run_dir / "config.json"
    if not stamp.exists():
        stamp.write_text(json.dumps(config, indent=1) + "\n")
        return
    saved = json.loads(stamp.read_text())
    if saved != config:
        changed = sorted(
            f"{s}.{k}" for s in config for k in config[s] if saved.get(s, {}).get(k) != config[s][k]
        )
        raise PmakitError(
            f"{run_dir} holds a study with another config (changed: {', '.join(changed) or 'sections'}); "
            "pass --fresh to start over or use another -o"
        )


def trained_tokens(run: Path) -> int:
    """Tokens of a run's final checkpoint (0 when it has none yet)."""
    try:
        return int(json.loads((checkpoint_dir(run) / "pmakit.json").read_text())["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


class Clock:
    """Wall seconds of each piece of work, summed over invocations (RUN/timings.json)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        atomic_write_json(self.path, self.seconds)
