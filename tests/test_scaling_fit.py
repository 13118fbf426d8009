"""The Chinchilla fit (``pmakit.report.scaling_fit``) against synthetic losses with known parameters, and
``pmakit scaling-fit`` through the real CLI."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from scipy.optimize import nnls

from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.report.scaling import verdicts
from pmakit.report.scaling_fit import Law, Point, fit, fit_law, fit_study, floor, read_points

# A law in the range of the scaling preset (N 1e5..1e6 non-embedding parameters, D 5e5..4e6 tokens).
TRUTH = Law(E=1.6, A=250.0, B=700.0, alpha=0.42, beta=0.36)
SIZES = (1e5, 2e5, 4e5, 8e5, 1.6e6)
BUDGETS = (5e5, 1e6, 2e6, 3e6, 4e6)


def synthetic(law: Law, noise: float, seed: int, kind: str = "anneal") -> list[Point]:
    """law(N, D) times a log-normal factor of relative spread ``noise``."""
    rng = np.random.default_rng(seed)
    return [
        Point(n, d, float(law(n, d) * math.exp(rng.normal(0, noise))), kind) for n in SIZES for d in BUDGETS
    ]


def test_noise_free_points_give_back_the_law() -> None:
    law, objective = fit_law(synthetic(TRUTH, 0.0, 0))
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(law, name) == pytest.approx(getattr(TRUTH, name), rel=1e-3), name
    assert objective < 1e-12


def test_noisy_points_recover_the_law_and_the_bootstrap_interval_covers_it() -> None:
    f = fit(synthetic(TRUTH, 0.003, 1), bootstrap=150, seed=0)
    assert f.law.alpha == pytest.approx(TRUTH.alpha, abs=0.06)
    assert f.law.beta == pytest.approx(TRUTH.beta, abs=0.04)
    assert abs(f.law.E / TRUTH.E - 1) < 0.1
    assert f.bootstrap + f.bootstrap_failed == 150 and f.bootstrap >= 140
    for name in ("E", "A", "B", "alpha", "beta"):
        lo, hi = f.ci95[name]
        assert lo <= getattr(TRUTH, name) <= hi, (name, lo, hi)
        assert lo < getattr(f.law, name) < hi  # the point estimate sits inside its own interval
    assert f.rms_log_residual == pytest.approx(0.003, rel=0.5)  # the residuals are the noise, not a bad fit


def test_more_noise_gives_wider_intervals() -> None:
    narrow = fit(synthetic(TRUTH, 0.002, 2), bootstrap=30).ci95["beta"]
    wide = fit(synthetic(TRUTH, 0.02, 2), bootstrap=30).ci95["beta"]
    assert wide[1] - wide[0] > 2 * (narrow[1] - narrow[0])


def test_held_out_size_is_predicted_by_each_kind_and_the_targets_follow() -> None:
    # merges follow a law whose data exponent is off: its prediction of the held-out anneals must miss.
    off = Law(E=TRUTH.E, A=TRUTH.A, B=TRUTH.B * 3, alpha=TRUTH.alpha, beta=TRUTH.beta + 0.1)
    points = synthetic(TRUTH, 0.001, 3) + synthetic(off, 0.001, 4, kind="merge")
    study = fit_study(points, bootstrap=40)
    assert study.holdout_n == max(SIZES)
    assert all(f.sizes == list(SIZES[:-1]) for f in study.fits.values())
    assert [p.d for p in study.predictions] == list(BUDGETS)
    for p in study.predictions:
        assert p.rel_error["anneal"] is not None and abs(p.rel_error["anneal"]) < 0.01
        assert p.rel_error["merge"] == pytest.approx(off(p.n, p.d) / TRUTH(p.n, p.d) - 1, abs=0.01)
    targets = study.targets(0.01)
    assert targets["heldout_within"]["met"] is False
    assert targets["exponents_inside_anneal_ci"]["beta"]["met"] is False
    assert targets["exponents_inside_anneal_ci"]["alpha"]["met"] is True
    # the anneals' own fit extrapolates fine, so the miss is the merges': the two fits disagree by > 1%
    assert targets["anneal_fit_within"]["met"] is True
    assert targets["fits_agree_within"]["met"] is False
    worst = max(abs(p.predicted["merge"] / p.predicted["anneal"] - 1) for p in study.predictions)
    assert targets["fits_agree_within"]["max_abs_rel_gap"] == pytest.approx(worst)


def test_backtest_predicts_each_fitted_size_from_the_smaller_ones_and_flags_a_law_that_does_not_extrapolate() -> (
    None
):
    # On points that follow the law, every fitted size from the third on is predicted from the smaller ones alone.
    study = fit_study(synthetic(TRUTH, 0.0, 0) + synthetic(TRUTH, 0.0, 0, kind="merge"), bootstrap=0)
    assert sorted({p.n for p in study.backtest}) == list(SIZES[3:-1])  # never the held-out size
    assert [p.d for p in study.backtest if p.n == SIZES[3]] == list(BUDGETS)
    assert all(abs(e) < 1e-3 for p in study.backtest for e in p.rel_error.values() if e is not None)
    assert study.targets(0.01)["backtest_within"]["met"] is True

    # Larger models gain more from more tokens (an N x D interaction the law cannot express): the backtest misses,
    # naming its worst point, before the held-out size is used.
    def bend(n: float, d: float) -> float:
        return float(TRUTH(n, d) - 0.5 * (n / 1e5) ** 0.5 * (d / 4e6) ** 2)

    points = [Point(n, d, bend(n, d), kind) for n in SIZES for d in BUDGETS for kind in ("anneal", "merge")]
    bent = fit_study(points, bootstrap=0)
    back = bent.targets(0.01)["backtest_within"]
    assert back["met"] is False and back["max_abs_rel_error"] > 0.02
    assert back["sizes"] == list(SIZES[3:-1]) and back["d"] == max(BUDGETS)
    at = next(p for p in bent.backtest if (p.n, p.d) == (back["n"], back["d"]))
    assert at.rel_error["merge"] == pytest.approx(at.predicted["merge"] / bend(at.n, at.d) - 1)
    assert abs(at.rel_error["merge"]) == pytest.approx(back["max_abs_rel_error"])
    # Three fitted sizes: nothing to backtest (from two sizes the law's N part is not identified).
    three = [p for p in points if p.n != SIZES[3]]
    assert fit_study(three, bootstrap=0).backtest == []


def test_too_few_points_is_one_clear_error() -> None:
    with pytest.raises(PmakitError, match="at least 6 points"):
        fit_law(synthetic(TRUTH, 0.0, 0)[:5])
    with pytest.raises(PmakitError, match="2 model sizes"):
        fit_law([Point(1e5, d, 3.0, "anneal") for d in BUDGETS * 2])


def _write_csv(path: Path, points: list[Point]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["params", "tokens", "loss", "kind"])
        w.writerow([1e5, 1e6, 3.0, "latest"])  # another kind of row: skipped
        for p in points:
            w.writerow([p.n, p.d, p.loss, p.kind])


def test_cli_fits_a_users_csv_and_writes_json_and_plot(tmp_path: Path) -> None:
    points = synthetic(TRUTH, 0.001, 5) + synthetic(TRUTH, 0.001, 6, kind="merge")
    _write_csv(tmp_path / "runs.csv", points)
    result = CliRunner().invoke(
        cli, ["scaling-fit", str(tmp_path / "runs.csv"), "-o", str(tmp_path / "out"), "--bootstrap", "30"]
    )
    assert result.exit_code == 0, result.output
    assert "alpha" in result.output and "Held out: N = 1,600,000" in result.output
    assert "Backtest (each fitted size from the smaller ones):" in result.output
    assert "The law's floor (the least worst error any law of this form can have at a size" in result.output
    assert "the 1% target is within the law's reach" in result.output
    assert "within" in next(
        x for x in result.output.splitlines() if x.startswith("Backtest on the fitted sizes")
    )
    record = json.loads((tmp_path / "out" / "scaling_fit.json").read_text())
    assert {p["n"] for p in record["backtest"]} == {SIZES[3]} and record["targets"]["backtest_within"]["met"]
    assert all(p["interval"] == {} for p in record["backtest"])  # no bootstrap there: no interval, not NaNs
    assert len(record["floors"]) == 2 * len(SIZES) and record["targets"]["heldout_floor"]["reachable"] is True
    assert "NaN" not in (tmp_path / "out" / "scaling_fit.json").read_text()
    assert set(record["fits"]) == {"merge", "anneal"}
    assert record["fits"]["anneal"]["law"]["alpha"] == pytest.approx(TRUTH.alpha, abs=0.05)
    assert record["targets"]["heldout_within"]["met"] is True
    assert (tmp_path / "out" / "scaling_fit.png").stat().st_size > 10_000


def test_cli_without_bootstrap_prints_no_intervals_and_claims_no_interval_check(tmp_path: Path) -> None:
    points = synthetic(TRUTH, 0.001, 5) + synthetic(TRUTH, 0.001, 6, kind="merge")
    _write_csv(tmp_path / "runs.csv", points)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["scaling-fit", str(tmp_path / "runs.csv"), "-o", str(out), "--bootstrap", "0"]
    )
    assert result.exit_code == 0, result.output
    assert "nan" not in result.output.lower() and "[no interval]" in result.output
    assert "OUTSIDE" not in result.output  # no interval: no verdict on the exponents
    assert "No bootstrap refits for the merge and anneal fits" in result.output or (
        "No bootstrap refits for the anneal and merge fits" in result.output
    )
    text = (out / "scaling_fit.json").read_text()
    record = json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in scaling_fit.json"))
    assert "exponents_inside_anneal_ci" not in record["targets"]
    assert record["fits"]["anneal"]["ci95"]["alpha"] == [None, None]


def test_read_points_takes_jsonl_with_the_studys_column_names(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    rows = [
        {"params": p.n, "tokens": p.d, "val_loss": p.loss, "kind": p.kind} for p in synthetic(TRUTH, 0.0, 0)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_points([path]) == synthetic(TRUTH, 0.0, 0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tokens,loss,kind\n1,2,anneal\n", "no params"),
        ("params,tokens,loss,kind\n1e5,1e6,-3,anneal\n", "positive"),
        ("params,tokens,loss,kind\n1e5,1e6,abc,anneal\n", "not a number"),
        ("params,tokens,loss,kind\n1e5,1e6,3,latest\n", "no rows with kind merge or anneal"),
    ],
)
def test_cli_bad_results_file_is_one_error_line(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "bad.csv").write_text(text)
    result = CliRunner().invoke(cli, ["scaling-fit", str(tmp_path / "bad.csv"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 1
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "o" / "scaling_fit.json").exists()


def test_cli_missing_file_and_holdout_none(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["scaling-fit", str(tmp_path / "nope.csv"), "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "no such results file" in result.output
    # one size only: with the largest held out nothing is left to fit, and the error says so
    _write_csv(tmp_path / "one.csv", [p for p in synthetic(TRUTH, 0.0, 0) if p.n == SIZES[0]])
    result = CliRunner().invoke(cli, ["scaling-fit", str(tmp_path / "one.csv"), "-o", str(tmp_path / "o1")])
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        "Error: no merge or anneal points to fit besides the held-out size N = 100,000 (--holdout none fits every size)"
    ]
    assert not (tmp_path / "o1" / "scaling_fit.json").exists()
    _write_csv(tmp_path / "runs.csv", synthetic(TRUTH, 0.0, 0))
    result = CliRunner().invoke(
        cli,
        [
            "scaling-fit",
            str(tmp_path / "runs.csv"),
            "-o",
            str(tmp_path / "o"),
            "--holdout",
            "none",
            "--bootstrap",
            "0",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "o" / "scaling_fit.json").read_text())
    assert record["holdout_n"] is None and record["predictions"] == [] and set(record["fits"]) == {"anneal"}
    assert record["fits"]["anneal"]["sizes"] == list(SIZES)  # nothing held out: every size fitted


def test_the_laws_floor_bounds_every_fit_and_says_when_the_target_is_out_of_reach() -> None:
    # On points that follow the law, the law's form can reach every size: floors ~0, the target reachable.
    study = fit_study(synthetic(TRUTH, 0.0, 0) + synthetic(TRUTH, 0.0, 0, kind="merge"), bootstrap=0)
    assert {(f.n, f.kind) for f in study.floors} == {(n, k) for n in SIZES for k in ("merge", "anneal")}
    assert all(f.max_abs_rel_error < 1e-4 for f in study.floors)
    assert all(later < first for f in study.floors for first, later in zip(f.drops, f.drops[1:]))  # shrinking
    assert study.targets(0.01)["heldout_floor"]["reachable"] is True

    # The largest size's loss still steepens in log D (as before a power-law regime): the floor says no fit of the
    # law can predict it within 1%, and it is a lower bound: neither the study's fits nor the least-squares curve
    # c + B/D^beta at any beta come closer to those points.
    def steep(n: float, d: float) -> float:
        return float(TRUTH(n, d) - (0.7 * (d / 4e6) ** 2 if n == max(SIZES) else 0.0))

    points = [Point(n, d, steep(n, d), kind) for n in SIZES for d in BUDGETS for kind in ("anneal", "merge")]
    bent = fit_study(points, bootstrap=0)
    reach = bent.targets(0.01)["heldout_floor"]
    assert reach["n"] == max(SIZES) and reach["reachable"] is False and reach["max_abs_rel_error"] > 0.01
    assert reach["drops"][-1] > reach["drops"][0]
    said = " ".join(verdicts(bent.targets(0.01), bent.holdout_n))
    assert "still steepening" in said and "target is out of reach of any fit" in said
    assert all(f.max_abs_rel_error < 1e-4 for f in bent.floors if f.n != max(SIZES))
    assert max(abs(p.rel_error["anneal"]) for p in bent.predictions) >= reach["max_abs_rel_error"]
    d = np.array(BUDGETS) / BUDGETS[0]
    measured = np.array([steep(max(SIZES), x) for x in BUDGETS])
    closest = math.inf
    for beta in np.linspace(0.01, 4, 400):
        x = d**-beta
        (c, b), _ = nnls(np.stack([1 / measured, x / measured], axis=1), np.ones_like(x))
        closest = min(closest, float(np.max(np.abs((c + b * x) / measured - 1))))
    assert (
        reach["max_abs_rel_error"] <= closest < 1.3 * reach["max_abs_rel_error"]
    )  # a bound, and a close one
    # A repeated measurement (a user's file may hold two runs of a point): its budget's mean in the drops, not a
    # division by a zero step, and both in the bound.
    repeat = floor(
        [
            *(Point(1.0, x, y, "anneal") for x, y in zip(BUDGETS, measured)),
            Point(1.0, BUDGETS[-1], 4.0, "anneal"),
        ]
    )
    assert (
        repeat is not None and len(repeat.drops) == len(BUDGETS) - 1 and all(map(math.isfinite, repeat.drops))
    )
    assert repeat.drops[-1] > reach["drops"][-1] and repeat.max_abs_rel_error > reach["max_abs_rel_error"]
    # Two budgets: any two points lie on a curve of the law's shape, so there is no floor to report.
    assert fit_study([p for p in points if p.d in BUDGETS[:2]], bootstrap=0, holdout="none").floors == []
