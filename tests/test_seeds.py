"""pmakit experiment --seeds K: merge - anneal per seed on the test split, its spread, the report table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _seed_run(root: Path, shift: float) -> Path:
    """results.jsonl of one seed: test-split latest, anneal, best, fixed at two forks, 4 batches each."""
    root.mkdir(parents=True)
    rows = []
    for fork in (100, 200):
        for role, base in (("", 3.0), ("best", 2.8 + shift), ("fixed", 2.85 + shift)):
            rows.append({"fork_tokens": fork, "model": "merged" if role else "latest", "role": role,
                         "split": "test", "batch_losses": [base + 0.01 * b for b in range(4)]})  # fmt: skip
        rows.append({"fork_tokens": fork, "model": "annealed", "role": "", "split": "test",
                     "batch_losses": [2.9 + 0.01 * b for b in range(4)]})  # fmt: skip
        rows.append(
            {"fork_tokens": fork, "model": "merged", "role": "", "split": "selection", "batch_losses": [0.0]}
        )
    (root / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_seed_summary_is_the_spread_of_merge_minus_anneal(tmp_path: Path) -> None:
    from pmakit.lab.seeds import seed_summary
    from pmakit.report.seeds import blocks

    runs = [(s, _seed_run(tmp_path / f"s{s}", shift)) for s, shift in ((0, 0.0), (1, 0.02), (2, -0.02))]
    summary = seed_summary(runs)
    best = summary["forks"]["F2"]["best"]
    assert best["per_seed"] == pytest.approx({"0": -0.1, "1": -0.08, "2": -0.12})
    assert best["mean"] == pytest.approx(-0.1) and best["sd"] == pytest.approx(0.02)
    assert best["se"] == pytest.approx(0.02 / 3**0.5) and "tuned" not in summary["forks"]["F1"]
    (tmp_path / "seeds.json").write_text(json.dumps(summary))
    (table,) = [b for b in blocks(tmp_path) if hasattr(b, "rows")]
    assert [
        "F2",
        "best merge (chosen on selection)",
        "-0.1000",
        "-0.0800",
        "-0.1200",
        "-0.1000 ± 0.0200",
        "0.0115",
    ] in table.rows  # type: ignore[attr-defined]


def test_seeds_below_one_is_one_error_line() -> None:
    from click.testing import CliRunner

    from pmakit.cli import cli

    r = CliRunner().invoke(cli, ["experiment", "--preset", "smoke", "-o", "nowhere", "--seeds", "0"])
    assert r.exit_code != 0 and r.stderr.strip() == "Error: --seeds must be at least 1, got 0"
    assert not Path("nowhere").exists()
