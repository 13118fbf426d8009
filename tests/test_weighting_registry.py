"""A weighting registered in one file (this one) is usable from the CLI, the online averager, tune and reports."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import torch
from click.testing import CliRunner

from conftest import load_dir, state
from pmakit.cli import cli
from pmakit.lab.tune import Space, TuneConfig
from pmakit.online import OnlineAverager
from pmakit.report.analysis import weighting_label, weighting_sort_key
from pmakit.snapshot import MERGE_MANIFEST, discover
from pmakit.weights import WEIGHTINGS, register, unregister

NAME = "harmonic-test"


def harmonic(n: int, *, alpha: float = 0.2) -> list[float]:
    """w_i proportional to 1/(n + 1 - i): the newest 1, the one before 1/2, ..."""
    raw = [1.0 / (n + 1 - i) for i in range(1, n + 1)]
    return [r / sum(raw) for r in raw]


@pytest.fixture
def registered() -> Iterator[str]:
    register(NAME, label="Harmonic")(harmonic)
    try:
        yield NAME
    finally:
        unregister(NAME)


def weighted(window: list[dict[str, torch.Tensor]], key: str) -> torch.Tensor:
    w = harmonic(len(window))
    return sum(wi * s[key].double() for wi, s in zip(w, window))  # type: ignore[return-value]


def test_a_registered_weighting_is_a_cli_method(registered: str, make_run: Callable[..., Path]) -> None:
    run = make_run(5, dtype=torch.float32)
    out = run.parent / "out"
    r = CliRunner().invoke(cli, ["merge", str(run), "--last", "3", "--method", registered, "-o", str(out)])
    assert r.exit_code == 0, r.output
    window = [state(i, torch.float32) for i in (3, 4, 5)]
    got = load_dir(out)
    torch.testing.assert_close(
        got["head.weight"].double(), weighted(window, "head.weight"), rtol=0, atol=1e-6
    )
    manifest = json.loads((out / MERGE_MANIFEST).read_text())
    assert manifest["method"] == registered
    assert [i["weight"] for i in manifest["inputs"]] == pytest.approx(harmonic(3))
    assert registered in CliRunner().invoke(cli, ["merge", "--help"]).output
    # It takes no alpha, and says so, as sma does.
    bad = CliRunner().invoke(
        cli, ["merge", str(run), "--method", registered, "--alpha", "0.3", "-o", str(out)]
    )
    assert bad.exit_code != 0 and "--alpha is the EMA factor" in bad.output


def test_an_unregistered_weighting_is_no_cli_method(make_run: Callable[..., Path]) -> None:
    run = make_run(3)
    r = CliRunner().invoke(cli, ["merge", str(run), "--method", NAME, "-o", str(run.parent / "out")])
    assert r.exit_code == 2 and f"'{NAME}' is not one of" in r.output


def test_a_registered_weighting_runs_online(registered: str) -> None:
    averager = OnlineAverager(3, registered, hold_in_memory=True)
    snaps = [state(i, torch.float32) for i in range(1, 6)]
    for t, s in enumerate(snaps, start=1):
        averager.update(s, tokens=t * 100)
    avg = averager.average()
    torch.testing.assert_close(
        avg["embed.weight"].double(), weighted(snaps[-3:], "embed.weight"), rtol=0, atol=1e-6
    )
    assert averager.label == f"merged:{registered}:3"


def test_a_registered_weighting_is_searched_by_tune_and_named_in_reports(
    registered: str, make_run: Callable[..., Path]
) -> None:
    config = TuneConfig()
    assert registered in config.families
    space = Space.of(discover(make_run(6)), config)
    trial = optuna.trial.FixedTrial({"end_back": 0, "v_mult": 1, "n": 4, "family": registered})
    candidate = space.suggest(trial)
    assert list(candidate.weights) == pytest.approx(harmonic(4))
    assert candidate.params["family"] == registered and candidate.params["alpha"] is None
    assert weighting_label(registered) == "Harmonic"
    assert weighting_sort_key(registered)[0] == list(WEIGHTINGS).index(registered)
