"""What every study's run does before and around its own work: one copy for ``pmakit experiment``'s studies.

``open_run`` resolves the run directory, clears it on ``--fresh`` (only what an earlier study wrote), creates it,
stamps its config (or refuses to resume one with another config: one results file would mix two studies) and
starts the clock; the returned ``StudyRun`` carries the directory, when this invocation started and the wall
seconds of each part of the work (RUN/timings.json, summed over invocations).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.runs import atomic_write_json, read_json_object, remove_tree

log = logging.getLogger(__name__)

TIMINGS = "timings.json"
"""Wall seconds of each piece of a study's work, summed over invocations."""


def utc_now() -> str:
    """The time now, as every study's record writes it (UTC, whole seconds)."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def jsonable(x: Any) -> Any:
    """``x`` as it reads back from JSON (tuples as lists, paths as strings): what a config stamp compares."""
    return json.loads(json.dumps(x, default=str))


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file, or {} when it is missing or not one."""
    return read_json_object(path) or {}


class Clock:
    """Wall seconds of each piece of work, summed over invocations (RUN/timings.json)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = json.loads(path.read_text()) if path.exists() else {}

    def add(self, key: str, seconds: float) -> None:
        self.seconds[key] = self.seconds.get(key, 0.0) + seconds
        atomic_write_json(self.path, self.seconds)


class StudyProgress:
    """A whole study's progress and time left, for its progress lines ("study 40% done, about 11 min left").

    Each stage's work is counted in trained-token equivalents (a token trained is 1; what a held-out token scored
    or a tuner's step costs beside it is the caller's estimate) and the time left is the work left at the rate this
    invocation has worked so far. A stage's estimate is replaced by its exact size when it starts (``resize``; 0 for
    one a resumed run has already done, which then counts neither as work nor as time). An estimate: the lines say
    "about".
    """

    def __init__(self, work: Mapping[str, float]) -> None:
        self.size = {k: float(v) for k, v in work.items() if v > 0}
        self.done: dict[str, float] = {}
        self._t0 = time.monotonic()

    def resize(self, stage: str, units: float) -> None:
        """``stage`` is about to run ``units`` of work (0: nothing left to do, a resumed stage)."""
        self.size[stage] = max(float(units), self.done.get(stage, 0.0))
        if not self.size[stage]:
            self.size.pop(stage)

    def at(self, stage: str, units: float) -> str:
        """``stage`` has done ``units`` of its work in this invocation; returns ``note()``."""
        self.done[stage] = min(float(units), self.size.get(stage, 0.0))
        return self.note()

    def end(self, stage: str) -> None:
        """``stage`` is over: all of its (estimated) work counts as done, so that the rate stays in the units the
        stages still to come are estimated in."""
        if stage in self.size:
            self.done[stage] = self.size[stage]

    def note(self) -> str:
        """ "study 40% done, about 11 min left" (no time before the first work is done)."""
        total, done = sum(self.size.values()), sum(self.done.values())
        if total <= 0:
            return ""
        text = f"study {100 * done / total:.0f}% done"
        elapsed = time.monotonic() - self._t0
        if done <= 0 or elapsed < 1:
            return text
        left = (total - done) * elapsed / done
        return f"{text}, about {_duration(left)} left"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


@dataclass
class StudyRun:
    """A study's run directory, opened: where it is, when this invocation started, the clock of its parts."""

    dir: Path
    """The run directory (created)."""
    started: str
    """When this invocation started (``utc_now``); a record keeps the first invocation's."""
    clock: Clock
    """RUN/timings.json."""

    def previous(self) -> dict[str, Any]:
        """RUN/experiment.json as an earlier invocation wrote it ({} when there is none)."""
        return read_json(self.dir / "experiment.json")

    def stamp(self) -> dict[str, Any]:
        """The end of a study's record: when it started (its first invocation) and finished, the machine's load,
        torch's threads and the versions."""
        import torch

        import pmakit

        return {
            "started": self.previous().get("started", self.started),
            "finished": utc_now(),
            "load_average": os.getloadavg(),
            "threads": torch.get_num_threads(),
            "pmakit": pmakit.__version__,
            "torch": torch.__version__,
        }


def open_run(
    run_dir: str | Path,
    config: Mapping[str, Mapping[str, Any]],
    *,
    fresh: bool,
    clears: Collection[str] | None = None,
    ignore: Mapping[str, Collection[str]] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    grows: tuple[str, str] | None = None,
    indent: int = 1,
) -> StudyRun:
    """Open ``run_dir`` for a study whose config stamp is ``config`` (``check_same_config``'s rules); ``clears``:
    what ``fresh`` removes (``remove_run``)."""
    path = Path(run_dir)
    if fresh and path.exists():
        remove_run(path, clears)
    path.mkdir(parents=True, exist_ok=True)
    check_same_config(path, config, ignore=ignore, defaults=defaults, grows=grows, indent=indent)
    return StudyRun(path, utc_now(), Clock(path / TIMINGS))


def remove_run(run_dir: Path, clears: Collection[str] | None = None) -> None:
    """--fresh: remove what an earlier study wrote (only that), so nothing unrelated is deleted.

    ``clears``: the entries of ``run_dir`` to remove, for a study that names what it wrote (its runs from before
    the config stamp have no ``config.json`` to mark them); None: the whole directory, when ``config.json`` marks it
    as a study's (or it is empty)."""
    if clears is not None:
        for name in (*clears, "config.json", TIMINGS):  # the stamp and the clock describe what is cleared
            remove_tree(run_dir / name)
        return
    if not (run_dir / "config.json").exists() and any(run_dir.iterdir()):
        raise PmakitError(f"{run_dir} is not empty and not a pmakit experiment; refusing to clear it")
    shutil.rmtree(run_dir)


def check_same_config(
    run_dir: Path,
    config: Mapping[str, Mapping[str, Any]],
    *,
    ignore: Mapping[str, Collection[str]] | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
    grows: tuple[str, str] | None = None,
    indent: int = 1,
) -> None:
    """Stamp RUN/config.json, or refuse to resume a study with another config: one results file would mix two.

    ``ignore``: keys per section that change no result row (a resumed study may change them). ``defaults``: what a
    run stamped before a key existed did (keys newer than the stamp compare as these). ``grows``: a (section, key)
    list that may gain entries (more seeds for a finished study: the stamp is rewritten, the done ones kept).
    """
    stamp = run_dir / "config.json"
    if not stamp.exists():
        stamp.write_text(json.dumps(config, indent=indent) + "\n")
        return
    saved = json.loads(stamp.read_text())
    added = _grown(saved, config, *grows) if grows is not None else None
    if added is not None:
        log.info("adding %s %s to the study in %s", grows and grows[1], added, run_dir)
        stamp.write_text(json.dumps(config, indent=indent) + "\n")
        return
    current = {section: dict(values) for section, values in config.items()}
    for section, keys in (ignore or {}).items():
        for key in keys:
            for d in (saved.get(section, {}), current.get(section, {})):
                d.pop(key, None)
    newer: dict[str, Any] = {}  # keys newer than the saved run: what it did instead
    for section, values in current.items() if defaults is not None else ():
        for key in values.keys() - saved.get(section, {}).keys():
            newer[f"{section}.{key}"] = (defaults or {}).get(section, {}).get(key)
            saved.setdefault(section, {})[key] = newer[f"{section}.{key}"]
    if saved != current:
        changed = sorted(
            f"{s}.{k}" for s in current for k in current[s] if saved.get(s, {}).get(k) != current[s][k]
        )
        older = [f"{k}: {json.dumps(newer[k])}" for k in changed if k in newer]
        raise PmakitError(
            f"{run_dir} holds a study with another config (changed: {', '.join(changed) or 'sections'}); "
            + (f"it is from an older pmakit that ran as {', '.join(older)}; " if older else "")
            + "pass --fresh to start over or use another -o"
        )


def _grown(saved: Mapping[str, Any], config: Mapping[str, Any], section: str, key: str) -> list[Any] | None:
    """The entries ``config`` adds to ``saved``'s ``section.key`` list when nothing else changed, else None."""
    old, new = saved.get(section, {}).get(key, []), config[section][key]
    same_else = {**saved, section: {**saved.get(section, {}), key: new}} == config
    return sorted(set(new) - set(old)) if saved != config and same_else and set(old) <= set(new) else None
