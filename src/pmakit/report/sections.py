"""Which report section a run directory gets: one table keyed by RUN/experiment.json's ``study`` field.

A study's report module has ``build(run_dir) -> (blocks, plots drawn)`` and ``summary(run_dir) -> str`` (one
terminal screen), and reads the run's files only (never ``pmakit.lab``). A directory without an experiment.json but
with a metrics log is a ``pmakit train`` run (``train_run``); one with only an ``evals.jsonl`` is what ``pmakit eval -o``
wrote (``evals``).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

SECTIONS: dict[str, str] = {
    "pma": "pmakit.report.pma",
    "moe": "pmakit.report.pma",  # the PMA study's report; its MoE section is one of its blocks
    "spike": "pmakit.report.recovery",
    "init": "pmakit.report.recovery",
    "replicas": "pmakit.report.replicas",
    "scaling": "pmakit.report.scaling",
    "sweep": "pmakit.report.sweep",
}
"""experiment.json's ``study`` (none: ``pma``) -> the report module of that study (``pmakit.lab.runner.STUDIES``
names the lab module that writes it)."""


def study_of(run_dir: Path) -> str | None:
    """The ``study`` RUN/experiment.json names; None when it names none (the PMA study) or cannot be read."""
    try:
        value = json.loads((run_dir / "experiment.json").read_text()).get("study")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def section_of(run_dir: Path) -> Any:
    """The report module of the run in ``run_dir`` (an unknown study gets the PMA study's report, with its notes)."""
    from pmakit.report.evals import is_evals_only
    from pmakit.report.train_run import is_train_run

    if is_evals_only(run_dir):  # a folder `pmakit eval -o` wrote
        return importlib.import_module("pmakit.report.evals")
    study = study_of(run_dir)
    if study is None and is_train_run(run_dir):
        return importlib.import_module("pmakit.report.train_run")
    return importlib.import_module(SECTIONS.get(study or "pma", SECTIONS["pma"]))
