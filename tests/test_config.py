"""config.from_mapping: one typed parser for every config section."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pmakit.config import Tokens, from_mapping
from pmakit.errors import PmakitError


@dataclass(frozen=True)
class Inner:
    width: int = 2
    scale: float = 1.0


@dataclass(frozen=True)
class Section:
    every_tokens: Tokens = 1000
    until_tokens: Tokens | None = None
    at: tuple[Tokens, ...] = ()
    betas: tuple[float, float] = (0.9, 0.95)
    lr: float = 1e-3
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_values_are_converted_by_field_type() -> None:
    s = from_mapping(
        Section,
        {
            "every_tokens": "2M",
            "until_tokens": "1.5K",
            "at": ["4K", 5000],
            "betas": ["0.8", 0.9],
            "lr": "3e-3",
        },
        "study",
    )
    assert (s.every_tokens, s.until_tokens, s.at) == (2_000_000, 1500, (4000, 5000))
    assert s.betas == (0.8, 0.9) and s.lr == 0.003
    assert s.inner == Inner()


def test_nulls_mean_defaults_for_sections_and_empty_tuples() -> None:
    s = from_mapping(Section, {"inner": None, "at": None, "until_tokens": None}, "study")
    assert (s.inner, s.at, s.until_tokens) == (Inner(), (), None)
    assert from_mapping(Section, {"inner": {"width": 4}}, "study").inner == Inner(width=4)


def test_unknown_keys_name_the_section_and_list_the_known_ones() -> None:
    with pytest.raises(
        PmakitError, match=r"unknown study config keys: bogus, zz; known: at, betas, every_tokens"
    ):
        from_mapping(Section, {"zz": 1, "bogus": 2}, "study")
    with pytest.raises(PmakitError, match=r"unknown study\.inner config keys: depth; known: scale, width"):
        from_mapping(Section, {"inner": {"depth": 3}}, "study")


def test_bad_values_are_one_clear_error() -> None:
    with pytest.raises(PmakitError, match=r"study\.lr: expected a number, got 'fast'"):
        from_mapping(Section, {"lr": "fast"}, "study")
    with pytest.raises(PmakitError, match=r"study\.at: expected a list"):
        from_mapping(Section, {"at": "4M"}, "study")
    with pytest.raises(PmakitError, match="token count"):
        from_mapping(Section, {"every_tokens": "lots"}, "study")
    with pytest.raises(PmakitError, match="the study config must be a mapping"):
        from_mapping(Section, ["every_tokens"], "study")


def test_every_presets_printed_config_reproduces_its_run(tmp_path: Path) -> None:
    # `experiment --preset P --print-config > my.yaml; experiment my.yaml` must run P, not the demo's precision,
    # batch counts and whatever else P's file does not spell out.
    from conftest import run_cli
    from pmakit.config import load, preset_names

    for name in preset_names():
        proc = run_cli("experiment", "--preset", name, "--print-config")
        assert proc.returncode == 0, proc.stderr
        printed = tmp_path / f"{name}.yaml"
        printed.write_text(proc.stdout)
        assert load(printed, None, "demo") == load(None, name, "demo"), name
    # and a config file's printed form (JSON, which YAML reads) reproduces that file's run
    proc = run_cli("experiment", tmp_path / "smoke.yaml", "--print-config")
    again = tmp_path / "again.yaml"
    again.write_text(proc.stdout)
    assert load(again, None, "demo") == load(None, "smoke", "demo")


def test_every_shipped_study_preset_resolves() -> None:
    """Each preset passes the checks a user's config goes through (the moe preset's last anneal once ended past its
    own total_tokens: refused at start)."""
    from pmakit.config import _parse, preset_names, preset_text
    from pmakit.lab import pma

    for name in preset_names():
        data = _parse(preset_text(name), name)
        if data.get("study", "pma") in ("pma", "moe"):
            pma.resolve(data)  # raises on a fork past the run, a fork in the warmup, a bad field
