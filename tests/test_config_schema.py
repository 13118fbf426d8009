"""Every config value of every preset is checked before anything runs: the bounds declared on each section's
fields (``pmakit.config.check_fields``), then the checks that tie fields together; a bad value is one `Error:` line
through the real CLI and no file is written."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path
from typing import Annotated, Any

import pytest

from conftest import run_cli
from pmakit.config import Length, OneOf, Range, load, preset_names
from pmakit.errors import PmakitError
from pmakit.lab.pma import ExperimentConfig
from pmakit.lab.recovery import InitStudyConfig, SpikeStudyConfig
from pmakit.lab.replicas import ReplicaStudy
from pmakit.lab.runner import validate
from pmakit.lab.scaling import ScalingConfig
from pmakit.lab.sweep import SweepConfig
from pmakit.train.loop import TrainConfig

SECTIONS: dict[str | None, tuple[str, type]] = {
    None: ("experiment", ExperimentConfig),
    "moe": ("experiment", ExperimentConfig),
    "sweep": ("sweep", SweepConfig),
    "scaling": ("scaling", ScalingConfig),
    "replicas": ("replicas", ReplicaStudy),
    "spike": ("spike", SpikeStudyConfig),
    "init": ("init", InitStudyConfig),
}


def _bad(mark: Any) -> Any:
    """A value the bound ``mark`` refuses."""
    if isinstance(mark, Range):
        if mark.lo is not None:
            return mark.lo if mark.lo_open else mark.lo - 1
        return mark.hi if mark.hi_open else mark.hi + 1
    if isinstance(mark, OneOf):
        return "zigzag"
    assert isinstance(mark, Length)
    return []


def _declared(cls: type) -> list[tuple[str, Any]]:
    """(field, a value its declared bounds refuse) for every bounded field of ``cls`` and of its list items."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if typing.get_origin(hint) is Annotated:
            out += [
                (f.name, _bad(m)) for m in typing.get_args(hint)[1:] if isinstance(m, (Range, OneOf, Length))
            ]
            hint = typing.get_args(hint)[0]
        if typing.get_origin(hint) is tuple:
            item = typing.get_args(hint)[0]
            if typing.get_origin(item) is Annotated:
                out += [
                    (f.name, [_bad(m)]) for m in typing.get_args(item)[1:] if isinstance(m, (Range, OneOf))
                ]
    return out


def _cases() -> list[tuple[str, str, str, Any]]:
    cases = []
    for preset in preset_names():
        data = load(None, preset, "demo")
        section, cls = SECTIONS[data.get("study")]
        cases += [(preset, section, key, value) for key, value in _declared(cls)]
        cases += [(preset, "train", key, value) for key, value in _declared(TrainConfig)]
    return cases


@pytest.mark.parametrize(("preset", "section", "key", "value"), _cases())
def test_every_declared_bound_of_every_preset_is_checked(
    preset: str, section: str, key: str, value: Any
) -> None:
    data = copy.deepcopy(load(None, preset, "demo"))
    data.setdefault(section, {})[key] = value
    with pytest.raises(PmakitError, match=f"^{section}\\.{key}"):
        validate(data)


def test_every_study_section_declares_its_bounds() -> None:
    for section, cls in {SECTIONS[k] for k in ("sweep", "scaling", "replicas", None)}:
        assert len(_declared(cls)) >= 3, section


BAD_VALUES = {
    # preset: the cases and one per field kind (a count, a fraction, a choice, a list, a token count)
    "demo": "experiment:\n  method_n: 0\n",
    "smoke": "experiment:\n  points: -3\n",
    "moe-smoke": "experiment:\n  anneal_shape: zigzag\n",
    "moe": "experiment:\n  eval_batches: 0\n",
    "sweep-smoke": "sweep:\n  batch_sizes: [0, 8]\n",
    "sweep": "sweep:\n  budget: -5\n",
    "scaling-smoke": "scaling:\n  anneal_fraction: 1.5\n",
    "scaling": "scaling:\n  budgets: [0, 16K]\n",
    "replicas-smoke": "replicas:\n  eval_batches: 0\n",
    "replicas": "replicas:\n  replicas: two\n",
    "spike": "spike:\n  last: 0\n",
    "init": "init:\n  shape: zigzag\n",
}


@pytest.mark.parametrize("preset", sorted(BAD_VALUES))
def test_a_bad_value_of_each_preset_is_one_error_line_and_writes_nothing(tmp_path: Path, preset: str) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"preset: {preset}\n" + BAD_VALUES[preset])
    proc = run_cli("experiment", cfg, "-o", tmp_path / "run", timeout=600)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    section, key = BAD_VALUES[preset].split(":")[0], BAD_VALUES[preset].split("\n")[1].split(":")[0].strip()
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{section}.{key}" in errors[0], errors
    assert not (tmp_path / "run").exists()


def test_the_presets_cover_every_study() -> None:
    assert set(BAD_VALUES) == set(preset_names())
