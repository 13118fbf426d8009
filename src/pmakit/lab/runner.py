"""``pmakit experiment``: which study a config asks for, run (or resumed) into a run directory.

A config's ``study`` key picks the study in ``STUDIES``: none is the paper's PMA study (``pma``), ``spike`` and
``init`` the recovery studies (``recovery``), ``replicas`` model copies (``replicas``), ``scaling`` scaling laws from
merges (``scaling``), ``moe`` the PMA study on a mixture of experts plus its routing health (``moe``), ``sweep`` a
hyper-parameter sweep ranked early by merges (``sweep``). ``--seeds K`` repeats the PMA study over K training seeds
(``seeds``).
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError

log = logging.getLogger(__name__)


STUDIES: dict[str, str] = {
    "pma": "pmakit.lab.pma",
    "moe": "pmakit.lab.moe",
    "spike": "pmakit.lab.recovery",
    "init": "pmakit.lab.recovery",
    "replicas": "pmakit.lab.replicas",
    "scaling": "pmakit.lab.scaling",
    "sweep": "pmakit.lab.sweep",
}
"""A config's ``study`` (none: ``pma``) -> the lab module that runs it. The module has ``resolve(data)`` (the config
checked whole, before anything is written) and ``run_study(data, run_dir, *, fresh, progress)`` (run or resume it;
returns the report's path); its report section is ``pmakit.report.sections.SECTIONS``'s entry of the same name."""

SEEDED = ("pma", "moe")
"""The studies ``--seeds`` repeats (the others have their own seeds or replicas)."""


def study_name(data: Mapping[str, Any]) -> str:
    """The study a config asks for (``pma`` when it names none)."""
    return str(data.get("study") or "pma")


def study_module(data: Mapping[str, Any]) -> Any:
    """The lab module of the study ``data`` asks for; an unknown study is one error naming the known ones."""
    name = study_name(data)
    if name not in STUDIES:
        raise PmakitError(f"unknown study {name!r}; known: {', '.join(s for s in STUDIES if s != 'pma')}")
    return importlib.import_module(STUDIES[name])


def run_experiment(
    data: Mapping[str, Any],
    run_dir: str | Path,
    *,
    fresh: bool = False,
    progress: bool = True,
    seeds: int = 1,
) -> Path:
    """Run (or resume) the study ``data`` asks for into ``run_dir``; returns the report's path.

    ``seeds`` > 1 repeats the whole study with ``train.seed`` + 1, + 2, ... into RUN/seeds/seed-S/ and gathers
    merge - anneal across seeds into RUN/seeds.json (``pmakit.lab.seeds``).
    """
    if seeds < 1:
        raise PmakitError(f"--seeds must be at least 1, got {seeds}")
    validate(data)
    check_study_dir(Path(run_dir), data.get("study"))
    if seeds > 1:
        return _run_seeds(data, Path(run_dir), seeds, fresh=fresh, progress=progress)
    return Path(study_module(data).run_study(data, run_dir, fresh=fresh, progress=progress))


def validate(data: Mapping[str, Any]) -> None:
    """Every value of the config ``data``, checked before anything is written or trained: the sections of the
    study it asks for, built as the study builds them (each section's bounds are declared on its dataclass's
    fields, ``pmakit.config.check_fields``; the checks that tie fields together run after them)."""
    study_module(data).resolve(data)


OTHER_RUNS = (
    ("pmakit-merge.json", "a merged model"),
    ("pmakit.json", "a snapshot"),
    ("metrics.jsonl", "a `pmakit train` run"),
    ("checkpoint", "a `pmakit train` run"),
    ("snapshots", "a `pmakit train` run"),
)
"""Files at the top of a directory that mark another kind of run than a study (whose runs live one level down)."""


def check_study_dir(run_dir: Path, study: str | None) -> None:
    """Refuse a run directory that holds another kind of run (a ``pmakit train`` run, a snapshot, a merged model)
    or another study: a study started there would write its files among the other run's."""
    if run_dir.exists() and not run_dir.is_dir():
        raise PmakitError(f"{run_dir} is not a directory")
    for name, what in OTHER_RUNS:
        if (run_dir / name).exists():
            raise PmakitError(
                f"{run_dir} holds {what} (its {name}), not a study; give pmakit experiment another -o"
            )
    try:
        found = json.loads((run_dir / "experiment.json").read_text()).get("study") or "pma"
    except (OSError, ValueError, AttributeError):
        return
    study = study or "pma"
    if found != study and not {found, study} <= {"pma", "moe"}:  # the moe study writes the PMA study's record
        raise PmakitError(f"{run_dir} holds the {found} study, not the {study} study this config asks for; give "
                          "pmakit experiment another -o")  # fmt: skip


def _run_seeds(data: Mapping[str, Any], run_dir: Path, seeds: int, *, fresh: bool, progress: bool) -> Path:
    """The study at the config's seed into RUN, then at the next seeds into RUN/seeds/seed-S, then seeds.json."""
    from pmakit.lab.seeds import seed_summary
    from pmakit.report import write_report
    from pmakit.runs import atomic_write_json

    if study_name(data) not in SEEDED:
        raise PmakitError(
            "--seeds repeats the PMA study; the spike, init, replicas, scaling and sweep studies have their own"
        )
    run_experiment(data, run_dir, fresh=fresh, progress=progress)
    base = int((data.get("train") or {}).get("seed", 0) or 0)
    runs = [(base, run_dir)]
    for k in range(1, seeds):
        seed = base + k
        log.info("seed %d of %d (train.seed = %d)", k + 1, seeds, seed)
        again = {**data, "train": {**(data.get("train") or {}), "seed": seed}}
        run_experiment(again, run_dir / "seeds" / f"seed-{seed}", fresh=fresh, progress=progress)
        runs.append((seed, run_dir / "seeds" / f"seed-{seed}"))
    atomic_write_json(run_dir / "seeds.json", seed_summary(runs))
    return Path(getattr(write_report(run_dir), "html", run_dir / "report.html"))
