"""`pmakit experiment --preset sweep-smoke` end to end through the real CLI (rows, the tuned recipe chosen on the
selection split, the report, resuming) and `pmakit sweep-rank` on the runs it wrote; the ranking statistics against
hand-computed values."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli_env, run_cli
from pmakit.config import load
from pmakit.lab.evaldata import split_batches
from pmakit.lab.scaling import Recipe
from pmakit.lab.sweep import KINDS, _section, fixed_window, plans, recipe_window
from pmakit.report.sweep import PAIRS, agreement, rank_table
from pmakit.train.loop import TrainConfig


@pytest.fixture(scope="module")
def smoke(sweep_smoke: Path) -> Path:
    return sweep_smoke  # one sweep-smoke study per session (the docs test resumes a copy of it)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_candidate_has_every_estimate_at_every_point(smoke: Path) -> None:
    rows = jsonl(smoke / "results.jsonl")
    exp = json.loads((smoke / "experiment.json").read_text())
    cands, budgets = exp["candidates"], exp["budgets"]
    assert len(cands) == 4 and budgets == [8192, 16384, 32768]  # 25%, 50% and D = 32K (a multiple of V = 2K)
    assert {(c["lr"], c["weight_decay"]) for c in cands} == {
        (1e-3, 0.0),
        (1e-3, 0.1),
        (1e-2, 0.0),
        (1e-2, 0.1),
    }
    assert len(rows) == len(cands) * len(budgets) * len(KINDS)  # no duplicate
    for c in cands:
        for b in budgets:
            assert {r["kind"] for r in rows if (r["candidate"], r["tokens"]) == (c["name"], b)} == set(KINDS)
    assert {len(r["batch_losses"]) for r in rows} == {exp["config"]["sweep"]["test_batches"]}
    for r in rows:  # every merge ends at its point; the fixed one is the last fixed_n (4) snapshots 2K apart
        if r["kind"] == "fixed":
            assert r["merged"] == 4 and r["window_start_tokens"] == r["tokens"] - 3 * 2048
        if r["kind"] == "tuned":
            assert 0 < r["window_start_tokens"] < r["tokens"] and r["merged"] >= 2


def test_results_csv_is_the_sweep_table_of_results_jsonl(smoke: Path) -> None:
    import csv

    from pmakit.report.schema import SWEEP_COLUMNS

    with open(smoke / "results.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(
        SWEEP_COLUMNS
    )  # its own columns (it once had the scaling study's, all but empty)
    rows = jsonl(smoke / "results.jsonl")
    assert [(r["candidate"], r["kind"], r["tokens"]) for r in table] == [
        (r["candidate"], r["kind"], str(r["tokens"])) for r in rows
    ]


def test_tuned_recipe_is_chosen_on_the_selection_split_only(smoke: Path) -> None:
    selection = jsonl(smoke / "selection.jsonl")
    exp = json.loads((smoke / "experiment.json").read_text())
    assert {len(r["batch_losses"]) for r in selection} == {exp["config"]["sweep"]["selection_batches"]}
    for r in (r for r in jsonl(smoke / "results.jsonl") if r["kind"] == "tuned"):
        mine = [s for s in selection if (s["candidate"], s["tokens"]) == (r["candidate"], r["tokens"])]
        assert len(mine) == 3  # the fixed recipe and the preset's two
        assert r["recipe"] == min(mine, key=lambda s: s["val_loss"])["recipe"]


def test_fixed_row_is_the_plain_average_of_its_window(smoke: Path) -> None:
    """One test row recomputed independently: torch.stack(...).mean(0) of the snapshot files on the test batches."""
    from safetensors.torch import load_file

    from pmakit.evaluate import evaluate
    from pmakit.train.data import val_batches
    from pmakit.train.loop import load_corpus, swapped
    from pmakit.train.model import build_model

    exp = json.loads((smoke / "experiment.json").read_text())
    row = next(r for r in jsonl(smoke / "results.jsonl") if r["kind"] == "fixed" and r["tokens"] == 16384)
    trunk = smoke / row["candidate"] / "trunk" / "snapshots"
    snaps = {json.loads((d / "pmakit.json").read_text())["tokens"]: d for d in trunk.iterdir()}
    states = [
        load_file(snaps[t] / "model.safetensors") for t in range(row["window_start_tokens"], 16385, 2048)
    ]
    mean = {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
    cfg = exp["config"]
    train = TrainConfig.from_dict(cfg["train"])
    corpus = load_corpus(train)
    sc = cfg["sweep"]
    batches = val_batches(corpus.val, batch_size=train.batch_size, seq_len=train.model.seq_len,
                          max_batches=sc["selection_batches"] + sc["test_batches"])  # fmt: skip
    _, test = split_batches(batches, sc["selection_batches"], sc["test_batches"])
    model = build_model(train.model, corpus.vocab_size)
    with swapped(model, mean):
        assert evaluate(model, test).loss == pytest.approx(row["val_loss"], rel=1e-5)


def test_report_states_the_agreement_of_every_estimate(smoke: Path) -> None:
    ranking = json.loads((smoke / "sweep_ranking.json").read_text())
    points = {(r["tokens"], r["kind"]) for r in ranking["rows"]}
    assert points == {(b, k) for b in (8192, 16384, 32768) for k in KINDS} - {
        (32768, "anneal")
    }  # that is the truth
    for r in ranking["rows"]:
        assert -1 <= r["tau_ci"][0] <= r["tau_ci"][1] <= 1 and r["regret"] >= 0
        assert r["top1"] == (r["pick"] == r["best"]) and (r["regret"] == 0) == r["top1"]
    pairs = {(d["tokens"], d["a"], d["b"]) for d in ranking["differences"]}
    assert pairs == {(b, *pair) for b in (8192, 16384) for pair in PAIRS}  # the early points only
    for d in ranking["differences"]:
        assert d["ci"][0] <= d["ci"][1] and d["diff"] == pytest.approx(d["tau_a"] - d["tau_b"])
    by = {r["tokens"]: r["compute"] for r in ranking["rows"] if r["kind"] == "fixed"}
    assert by == {
        8192: 0.25,
        16384: 0.5,
        32768: 1.0,
    }  # trunks to the point over every candidate's WSD run to D
    md = (smoke / "report.md").read_text()
    assert "Hyper-parameter sweep decided early by merges" in md and "Kendall tau" in md
    assert (smoke / "plots" / "sweep_rank_vs_compute.png").stat().st_size > 1000


def test_rerun_resumes_without_redoing_and_a_changed_config_is_refused(smoke: Path, tmp_path: Path) -> None:
    before = (smoke / "timings.json").read_text(), (smoke / "results.jsonl").read_text()
    proc = run_cli("experiment", "--preset", "sweep-smoke", "-o", smoke, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ((smoke / "timings.json").read_text(), (smoke / "results.jsonl").read_text()) == before
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: sweep-smoke\nsweep:\n  fixed_n: 3\n")
    proc = run_cli("experiment", str(cfg), "-o", smoke)
    assert proc.returncode == 1 and "sweep.fixed_n" in proc.stderr and "Traceback" not in proc.stderr


def test_sweep_rank_ranks_the_smoke_runs(smoke: Path) -> None:
    runs = [smoke / c / "trunk" for c in ("lr0.001-wd0", "lr0.01-wd0", "lr0.01-wd0.1")]
    proc = run_cli(
        "sweep-rank", *runs, "--at", "16384", "--last", "4", "--batches", "6", "--bootstrap", "200"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [x for x in proc.stdout.splitlines() if x.strip()[:1].isdigit()]
    assert len(lines) == 3 and "+0.0000 ± 0.0000" in lines[0] and "at 16.38K tokens" in proc.stdout
    assert all("4: 10.24K..16.38K" in x for x in lines)  # the last 4 snapshots at or before --at
    assert "lr0.001" in lines[-1]  # a tenth of the LR is far behind after 16K tokens in both rankings
    losses = [float(x.split("4: 10.24K..16.38K")[1].split()[0]) for x in lines]
    assert losses == sorted(losses)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ((), "at least 2 different run directories"),
        (("{run}/nope",), "no such run directory"),
        (("{run}/lr0.01-wd0/trunk", "--at", "100"), "no snapshot at or before 100 tokens"),
        (("{run}/lr0.01-wd0/trunk", "--batches", "1"), "--batches at least 2"),
        (("{run}/lr0.01-wd0/trunk", "--at", "1M"), "before --at 1M; rank at a point every run has reached"),
        (("{run}/lr0.001-wd0/trunk",), "at least 2 different run directories"),
    ],
)
def test_sweep_rank_mistakes_are_one_error_line(smoke: Path, extra: tuple[str, ...], message: str) -> None:
    args = [smoke / "lr0.001-wd0" / "trunk", *(x.format(run=smoke) for x in extra)]
    proc = run_cli("sweep-rank", *args)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_agreement_against_hand_computed_values() -> None:
    truth = {"a": [1.0, 1.2], "b": [2.0, 2.2], "c": [3.0, 3.2]}
    same = agreement({"a": [5.0, 5.0], "b": [6.0, 6.0], "c": [7.0, 7.0]}, truth, bootstrap=50)
    assert same["tau"] == 1 and same["top1"] and same["regret"] == 0 and same["tau_ci"] == [1.0, 1.0]
    flipped = agreement({"a": [7.0, 7.0], "b": [6.0, 6.0], "c": [5.0, 5.0]}, truth, bootstrap=0)
    assert flipped["tau"] == -1 and not flipped["top1"] and flipped["pick"] == "c" and flipped["best"] == "a"
    assert flipped["regret"] == pytest.approx(2.0)  # truth of c (3.1) - truth of a (1.1)
    one_swap = agreement({"a": [2.0, 2.0], "b": [1.0, 1.0], "c": [3.0, 3.0]}, truth, bootstrap=0)
    assert one_swap["tau"] == pytest.approx(1 / 3)  # 2 concordant pairs, 1 discordant, of 3


def test_rank_table_paired_differences_and_bootstrap() -> None:
    rng = np.random.default_rng(0)
    text = rng.normal(4.0, 0.3, size=20)  # batch-to-batch variation shared by every run
    losses = {"close": list(text + 0.001), "best": list(text), "far": list(text + 0.5)}
    table = rank_table(losses, bootstrap=200)
    assert [r["name"] for r in table] == ["best", "close", "far"]
    assert table[0]["minus_best"] == 0 and table[1]["minus_best"] == pytest.approx(0.001)
    assert table[1]["minus_best_se"] == pytest.approx(0.0, abs=1e-12)  # a constant shift: no paired noise
    assert table[0]["p_best"] == 1.0 and table[2]["rank_range"] == [3, 3]
    assert table[0]["loss_se"] == pytest.approx(text.std(ddof=1) / np.sqrt(20))


def test_windows_at_their_edges() -> None:
    assert fixed_window(2048, 8192, 10) == [2048, 4096, 6144, 8192]  # fewer than 10 when the run is younger
    assert fixed_window(16384, 16384 * 20, 10) == [16384 * k for k in range(11, 21)]
    # 0.4 x 400K = 160K: 10 snapshots 16K apart, [256K, 400K]
    assert (
        recipe_window(16384, Recipe("sma", 0.4), 409_600, 16)
        == [409_600 - 16384 * k for k in range(10)][::-1]
    )
    # 0.4 x 1.6M: 40 snapshots is more than 16, so every 3rd: 13 snapshots 48K apart
    assert (
        recipe_window(16384, Recipe("sma", 0.4), 1_638_400, 16)
        == [1_638_400 - 49152 * k for k in range(13)][::-1]
    )
    assert recipe_window(2048, Recipe("sma", 0.1), 8192, 16) == [6144, 8192]  # never fewer than 2


def test_full_preset_meets_the_issue() -> None:
    """At least 6 candidates, the LR over about a decade, a second axis, points at 10/25/50% of the budget."""
    data = load(None, "sweep", "demo")
    study = _section(data)
    base = TrainConfig.from_dict({"every_tokens": study.every_tokens, **data["train"]})
    ps = plans(base, study)
    assert len(ps) >= 6 and max(study.lrs) / min(study.lrs) >= 9
    assert max(len(study.batch_sizes), len(study.weight_decays)) >= 2  # a second axis
    assert [round(b / ps[0].budgets[-1], 2) for b in ps[0].budgets] == [0.1, 0.25, 0.5, 1.0]
    assert all(f < b for p in ps for f, b in zip(p.forks, p.budgets))


@pytest.mark.slow
def test_killed_study_resumes_to_the_same_numbers(smoke: Path, tmp_path: Path) -> None:
    """kill -9 in the middle of a trunk, run the same command again: the uninterrupted study's results."""
    other = tmp_path / "run"
    env = cli_env()
    cmd = [sys.executable, "-m", "pmakit", "experiment", "--preset", "sweep-smoke", "-o", str(other)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 1800
    while not (other / "lr0.01-wd0" / "trunk" / "checkpoint").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "the study ended before the kill"  # else nothing below would test a resume
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = run_cli("experiment", "--preset", "sweep-smoke", "-o", other, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed " in done.stderr, done.stderr[-2000:]  # the killed trunk continued from its checkpoint

    def losses(r: Path) -> dict:
        return {(x["candidate"], x["tokens"], x["kind"]): x["val_loss"] for x in jsonl(r / "results.jsonl")}

    assert losses(other) == pytest.approx(losses(smoke))


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            "  batch_sizes: [3, 8]\n",
            "sweep.every_tokens must be a multiple of the tokens per step (192, batch 3)",
        ),
        ("  points: [0.5, 1.5]\n", "sweep.points must be in (0, 1), got 1.5"),
        ("  batch_sizes: [0, 8]\n", "sweep.batch_sizes must be at least 1, got 0"),
        ("  budget: 0\n", "sweep.budget must be at least 1, got 0"),
        (
            "  bootstrap: 1000000000000\n",
            "sweep.bootstrap 1,000,000,000,000 is over pmakit's limit bootstrap-resamples",
        ),
        ("  lrs: [1.0e-3]\n  weight_decays: [0.1]\n", "at least 2 candidates"),
        ("  recipes: [{method: nope, fraction: 0.2}]\n", "nope"),
    ],
)
def test_a_bad_sweep_config_is_one_error_line_and_writes_nothing(
    tmp_path: Path, section: str, message: str
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: sweep-smoke\nsweep:\n" + section)
    proc = run_cli("experiment", cfg, "-o", tmp_path / "run")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and message in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()
