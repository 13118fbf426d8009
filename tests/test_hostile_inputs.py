"""Hostile inputs on the config, CLI and studies side: each is one ``Error:`` line (or a ``PmakitError``) before
any work, never a traceback, a hang or an exhausted machine. Every case here failed on the code before its fix."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.conftest import run_cli

from pmakit import config, limits
from pmakit.errors import PmakitError
from pmakit.lab.pma import resolve
from pmakit.lab.tune import TuneConfig
from pmakit.report import scaling_fit
from pmakit.runs import read_jsonl
from pmakit.train.loop import TrainConfig


def _results(path: Path, rows: int, *, loss: Any = None) -> Path:
    """A results CSV of the scaling study's columns: 6 sizes x 4 budgets, merges then anneals."""
    rng = np.random.default_rng(0)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["params", "tokens", "loss", "kind"])
        for i in range(rows):
            n, d = 1e6 * 2 ** (i % 6), 1e8 * 2 ** ((i // 6) % 4)
            value = (1.7 + 400 / n**0.34 + 410 / d**0.28) * (1 + 0.003 * rng.standard_normal())
            w.writerow(
                [n, d, loss if loss is not None and i == 1 else value, ("merge", "anneal")[(i // 24) % 2]]
            )
    return path


# --------------------------------------------------------------------------------------------------- scaling-fit


def test_scaling_fit_refuses_an_output_file_before_fitting(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("mine\n")
    proc = run_cli("scaling-fit", _results(tmp_path / "r.csv", 48), "-o", tmp_path / "taken")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip()
        == f"Error: {tmp_path / 'taken'}: exists and is not a directory (-o names the directory to write)"
    )
    assert (tmp_path / "taken").read_text() == "mine\n"


def test_scaling_fit_refuses_more_points_than_its_limit(tmp_path: Path) -> None:
    path = _results(tmp_path / "r.csv", limits.SCALING_POINTS.value + 1)
    with pytest.raises(PmakitError, match="scaling-points = 10,000"):
        scaling_fit.read_points([path])


@pytest.mark.parametrize("loss", ["1e-320", "1e300"])
def test_scaling_fit_refuses_a_value_out_of_range(tmp_path: Path, loss: str) -> None:
    with pytest.raises(PmakitError, match=r"r.csv:3: loss '1e[-0-9]+' is outside 1e-30 .. 1e\+30"):
        scaling_fit.read_points([_results(tmp_path / "r.csv", 30, loss=loss)])


def test_scaling_fit_refuses_a_huge_csv_field_and_deep_json(tmp_path: Path) -> None:
    big = tmp_path / "big.csv"
    big.write_text("params,tokens,loss,kind\n1e6,1e8," + "9" * 140_000 + ",merge\n")
    with pytest.raises(PmakitError, match="not a readable CSV file"):
        scaling_fit.read_points([big])
    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"a":' * 100_000 + "1" + "}" * 100_000 + "\n")
    with pytest.raises(PmakitError, match="deep.jsonl:1 is over pmakit's limit json-depth"):
        scaling_fit.read_points([deep])


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
def test_the_floor_survives_a_badly_scaled_programme() -> None:
    # HiGHS raises ValueError on coefficients near 1e308; the floor then has no curve there (inf), not a traceback
    assert scaling_fit._minimax_at(1.0, np.array([1.0, 2.0, 4.0]), np.array([1e-320, 1.0, 1.0])) == math.inf


def test_grid_scoring_in_chunks_is_the_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    log_n, log_d = rng.uniform(13, 18, 700), rng.uniform(18, 22, 700)
    log_l = np.log(1.7 + 400 / np.exp(log_n) ** 0.34 + 410 / np.exp(log_d) ** 0.28)
    whole = scaling_fit._grid_starts(log_n, log_d, log_l, 24, 1e-3)  # 700 < 5 chunks of 256: also chunked
    monkeypatch.setattr(scaling_fit, "_GRID_CHUNK", 10_000)
    np.testing.assert_array_equal(scaling_fit._grid_starts(log_n, log_d, log_l, 24, 1e-3), whole)


# --------------------------------------------------------------------------------------------------- configs

BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")
)


def test_a_yaml_alias_bomb_is_refused_on_its_node_count(tmp_path: Path) -> None:
    (tmp_path / "bomb.yaml").write_text(BOMB + "train: {}\n")
    proc = run_cli("experiment", tmp_path / "bomb.yaml", "--print-config", timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "config-nodes = 100,000" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    with pytest.raises(PmakitError, match="a YAML alias refers to a value that contains it"):
        config._parse("a: &a [*a]\n", "c.yaml")
    # aliases within the limit are an ordinary YAML feature
    assert config._parse("a: &a [1, 2]\nb: *a\n", "c.yaml") == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"model": {"heads": 0}}, "train.model.heads must be at least 1, got 0"),
        ({"log_every": 0}, "train.log_every must be at least 1"),
        ({"vocab_size": "abc"}, "train.vocab_size: expected a whole number, got 'abc'"),
        (
            {"total_tokens": "1e400"},
            "train.total_tokens: cannot read token count '1e400': not a finite number",
        ),
        ({"seed": 1e40}, "train.seed: expected a whole number"),
        ({"seed": -1}, r"train.seed must be in 0 .. 2\^63 - 1"),
        ({"betas": [2, -1]}, r"train.betas must be two numbers in \[0, 1\)"),
        ({"model": {"intermediate": -64}}, "train.model.intermediate must be at least 1, got -64"),
        (
            {"model": {"kv_heads": 3, "heads": 2, "hidden": 64}},
            r"model.kv_heads \(3\) must be a positive divisor",
        ),
        ({"threads": -1}, "train.threads must be at least 1"),
        ({"grad_clip": float("nan")}, "train.grad_clip: expected a finite number, got nan"),
        ({"grad_clip": "nan"}, "train.grad_clip: expected a finite number"),
        ({"model": {"tie_embeddings": 1}}, "train.model.tie_embeddings: expected true or false, got 1"),
    ],
)
def test_bad_train_configs_name_their_field(train: dict[str, Any], message: str) -> None:
    valid = {"every_tokens": 40_960}  # the defaults' own interval is not a whole number of their steps
    TrainConfig.from_dict(valid)
    with pytest.raises(PmakitError, match=message):
        TrainConfig.from_dict({**valid, **train})


def test_a_toml_float_seed_is_refused_before_any_work(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text("[train]\nseed = 1e40\n")
    proc = run_cli("train", tmp_path / "c.toml", "-o", tmp_path / "run")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == "Error: train.seed: expected a whole number, got 1e+40"
    assert not (tmp_path / "run").exists()
    # TOML's own float spelling of a token count is still a token count
    assert TrainConfig.from_dict({"total_tokens": 81920.0, "every_tokens": 40960}).total_tokens == 81920


# --------------------------------------------------------------------------------------------------- studies


def test_forks_beyond_the_run_or_negative_are_refused() -> None:
    with pytest.raises(PmakitError, match=r"end at 1.2B tokens, beyond train.total_tokens \(8.192K\)"):
        resolve({"train": {"total_tokens": 8192, "every_tokens": 4096}, "experiment": {"forks": ["1e9"]}})
    with pytest.raises(PmakitError, match="experiment.forks must be at least 1, got -1024"):
        resolve({"experiment": {"forks": [-1024]}})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"budget_seconds": math.nan}, "--budget-seconds must be a positive number of seconds, got nan"),
        ({"budget_seconds": math.inf}, "--budget-seconds must be a positive number"),
        ({"seed": -1}, r"--seed must be in 0 .. 2\^32 - 1"),
    ],
)
def test_tune_budgets_and_seed(options: dict[str, Any], message: str) -> None:
    with pytest.raises(PmakitError, match=message):
        TuneConfig(**options)


def test_a_deeply_nested_metrics_line_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1}) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n{torn\n")
    with pytest.raises(PmakitError, match="metrics.jsonl:2 is over pmakit's limit json-depth"):
        read_jsonl(path)
    path.write_text(json.dumps({"step": 1}) + "\n" + '{"a":' * 200 + "1" + "}" * 200 + "\n")
    with pytest.raises(PmakitError, match="json-depth"):
        read_jsonl(path)
    path.write_text(json.dumps({"step": 1}) + "\n{torn\n")
    assert read_jsonl(path) == [{"step": 1}]
