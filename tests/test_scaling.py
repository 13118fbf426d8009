"""`pmakit experiment --preset scaling-smoke` end to end through the real CLI: the scaling study's rows, its
choice on the selection split, its report and fit, resuming (also after kill -9)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli_env, run_cli
from pmakit.config import load
from pmakit.lab.evaldata import split_batches
from pmakit.lab.scaling import Plan, Recipe, _section, plans, window
from pmakit.train.loop import TrainConfig

KINDS = {"merge", "anneal", "latest"}


@pytest.fixture(scope="module")
def smoke(scaling_smoke: tuple[Path, str]) -> tuple[Path, str]:
    return scaling_smoke  # one scaling-smoke study per session (the README test resumes a copy of it)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_point_has_a_merge_an_anneal_and_the_latest_on_the_test_split(smoke: tuple[Path, str]) -> None:
    run, _ = smoke
    rows = jsonl(run / "results.jsonl")
    exp = json.loads((run / "experiment.json").read_text())
    points = {(r["size"], r["tokens"]) for r in rows}
    assert len(points) == 4 * 4 and len(rows) == 3 * 16  # 4 sizes x 4 budgets, three kinds each, no duplicate
    for size, tokens in points:
        assert {r["kind"] for r in rows if (r["size"], r["tokens"]) == (size, tokens)} == KINDS
    assert {len(r["batch_losses"]) for r in rows} == {exp["config"]["scaling"]["test_batches"]}
    sizes = exp["sizes"]
    assert [s["params"] for s in sizes] == sorted(s["params"] for s in sizes)
    assert sizes[-1]["params"] / sizes[0]["params"] >= 7.9
    # V grows with the size; every merge ends at its budget and starts inside the trunk
    assert [s["every_tokens"] for s in sizes] == sorted(s["every_tokens"] for s in sizes)
    assert sizes[-1]["every_tokens"] > sizes[0]["every_tokens"]
    for r in rows:
        if r["kind"] == "merge":
            assert 0 < r["window_start_tokens"] < r["tokens"] and r["merged"] >= 2


def test_recipe_is_chosen_on_the_selection_split_of_the_fitted_sizes_only(smoke: tuple[Path, str]) -> None:
    run, _ = smoke
    exp = json.loads((run / "experiment.json").read_text())
    selection = jsonl(run / "selection.jsonl")
    assert {len(r["batch_losses"]) for r in selection} == {exp["config"]["scaling"]["selection_batches"]}
    held = exp["sizes"][-1]["name"]
    means = {}
    for recipe in {r["recipe"] for r in selection}:
        losses = [r["val_loss"] for r in selection if r["recipe"] == recipe and r["size"] != held]
        means[recipe] = sum(losses) / len(losses)
    assert exp["recipe"]["label"] == min(means, key=means.get)
    merges = [r for r in jsonl(run / "results.jsonl") if r["kind"] == "merge"]
    assert {r["recipe"] for r in merges} == {exp["recipe"]["label"]}


def test_merge_row_is_the_plain_average_of_its_window(smoke: tuple[Path, str]) -> None:
    """Recompute one test row independently: torch.stack(...).mean(0) of the window's snapshot files, scored on
    the test batches."""
    from safetensors.torch import load_file

    from pmakit.evaluate import evaluate
    from pmakit.train.data import val_batches
    from pmakit.train.loop import load_corpus, swapped
    from pmakit.train.model import build_model

    run, _ = smoke
    exp = json.loads((run / "experiment.json").read_text())
    row = next(r for r in jsonl(run / "results.jsonl") if r["kind"] == "merge" and r["size"] == "m")
    size = next(s for s in exp["sizes"] if s["name"] == "m")
    v = size["every_tokens"]
    tokens = range(
        row["window_start_tokens"],
        row["tokens"] + 1,
        (row["tokens"] - row["window_start_tokens"]) // (row["merged"] - 1),
    )
    assert all(t % v == 0 for t in tokens) and len(tokens) == row["merged"]
    snaps = {
        json.loads((d / "pmakit.json").read_text())["tokens"]: d
        for d in (run / "m/trunk/snapshots").iterdir()
    }
    states = [load_file(snaps[t] / "model.safetensors") for t in tokens]
    mean = {k: torch.stack([s[k] for s in states]).mean(0) for k in states[0]}
    cfg = exp["config"]
    train = TrainConfig.from_dict({**cfg["train"], "model": {**cfg["train"]["model"], "layers": size["layers"],
                                   "hidden": size["hidden"], "heads": size["heads"]}})  # fmt: skip
    corpus = load_corpus(train)
    sc = cfg["scaling"]
    batches = val_batches(corpus.val, batch_size=train.batch_size, seq_len=train.model.seq_len,
                          max_batches=sc["selection_batches"] + sc["test_batches"])  # fmt: skip
    _, test = split_batches(batches, sc["selection_batches"], sc["test_batches"])
    model = build_model(train.model, corpus.vocab_size)
    with swapped(model, mean):
        result = evaluate(model, test)
    assert result.loss == pytest.approx(row["val_loss"], rel=1e-5)


def test_anneal_branches_decay_to_zero_from_the_fork(smoke: tuple[Path, str]) -> None:
    run, _ = smoke
    exp = json.loads((run / "experiment.json").read_text())
    size = exp["sizes"][0]
    lr = exp["config"]["train"]["lr"]
    for budget, fork in zip(size["budgets"], size["forks"]):
        assert fork == pytest.approx(0.8 * budget, abs=exp["config"]["train"]["batch_size"] * 64)
        records = [
            json.loads(x)
            for x in (run / size["name"] / f"anneal-{budget}" / "metrics.jsonl").read_text().splitlines()
        ]
        lrs = [(r["tokens"], r["lr"]) for r in records if r.get("kind") == "train"]
        assert lrs and all(fork < t <= budget for t, _ in lrs)
        end = json.loads((run / size["name"] / f"anneal-{budget}" / "checkpoint" / "pmakit.json").read_text())
        assert end["tokens"] == budget and end["lr"] == 0.0  # the scored weights: the end of the decay
        for t, value in lrs:  # 1 - sqrt(x) over the branch
            assert value == pytest.approx(lr * (1 - math.sqrt((t - fork) / (budget - fork))), abs=1e-9)


def test_report_fit_and_cli_agree(smoke: tuple[Path, str], tmp_path: Path) -> None:
    run, stdout = smoke
    report = (run / "report.md").read_text()
    for heading in (
        "## Targets",
        "## Fits",
        "## The held-out size, predicted",
        "## What the law's form can reach at each size",
        "## Merge − anneal",
        "## Compute bill",
    ):
        assert heading in report
    assert (run / "plots" / "scaling_fit.png").stat().st_size > 10_000
    record = json.loads((run / "scaling_fit.json").read_text())
    assert set(record["fits"]) == {"merge", "anneal"}
    assert record["holdout_n"] == json.loads((run / "experiment.json").read_text())["sizes"][-1]["params"]
    assert len(record["predictions"]) == 4 and "heldout_within" in record["targets"]
    assert len(record["floors"]) == 2 * len(json.loads((run / "experiment.json").read_text())["sizes"])
    assert record["targets"]["heldout_floor"]["n"] == record["holdout_n"]
    assert "Scaling study" in stdout and "save" in stdout
    # a user feeding the study's own results file to `pmakit scaling-fit` gets the report's fit, intervals
    # included: with no options it takes the study's bootstrap count (the smoke preset's 20, not 400) and holdout
    proc = run_cli("scaling-fit", run / "results.jsonl", "-o", tmp_path)
    assert proc.returncode == 0, proc.stderr
    again = json.loads((tmp_path / "scaling_fit.json").read_text())
    assert again["fits"] == record["fits"] and again["predictions"] == record["predictions"]
    assert again["floors"] == record["floors"] and again["bootstrap"] == 20


def test_rerun_resumes_without_redoing_and_a_changed_config_is_refused(
    smoke: tuple[Path, str], tmp_path: Path
) -> None:
    run, _ = smoke
    before = (run / "timings.json").read_text(), (run / "results.jsonl").read_text()
    proc = run_cli("experiment", "--preset", "scaling-smoke", "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ((run / "timings.json").read_text(), (run / "results.jsonl").read_text()) == before
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: scaling-smoke\nscaling:\n  anneal_fraction: 0.3\n")
    proc = run_cli("experiment", str(cfg), "-o", run)
    assert (
        proc.returncode == 1 and "scaling.anneal_fraction" in proc.stderr and "Traceback" not in proc.stderr
    )


def test_plans_of_the_full_preset_meet_the_issue() -> None:
    """At least 4 sizes spanning at least 8x in non-embedding parameters (largest: the demo's model), at least 4
    budgets, V growing with the size."""
    data = load(None, "scaling", "demo")
    study = _section(data)
    base = TrainConfig.from_dict({"every_tokens": study.every_tokens_largest, **data["train"]})
    ps: list[Plan] = plans(base, study, vocab=2048)
    assert len(ps) >= 4 and len(ps[0].budgets) >= 4
    assert ps[-1].params / ps[0].params >= 8
    demo = load(None, "demo", "demo")["train"]["model"]
    assert (ps[-1].train.model.layers, ps[-1].train.model.hidden) == (demo["layers"], demo["hidden"])
    vs = [p.train.every_tokens for p in ps]
    assert vs == sorted(vs) and vs[-1] >= 8 * vs[0]


def test_window_takes_every_kth_snapshot_over_the_fraction() -> None:
    plan = Plan(None, TrainConfig(every_tokens=4096, batch_size=16), 1, 1, (409_600,), (327_680,))  # type: ignore[arg-type]
    # 0.2 x 400K = 80K: 20 snapshots 4K apart is more than 16, so every 2nd: 10 snapshots 8K apart
    assert window(plan, Recipe("sma", 0.2), 409_600, 16) == [409_600 - 8192 * k for k in range(10)][::-1]
    assert window(plan, Recipe("sma", 0.2), 409_600, 32) == [409_600 - 4096 * k for k in range(20)][::-1]
    assert window(plan, Recipe("sma", 0.001), 409_600, 16) == [405_504, 409_600]  # never fewer than 2


def test_selection_and_test_batches_are_disjoint_and_spread() -> None:
    batches = list(range(40))
    selection, test = split_batches(batches, 12, 24)
    assert len(selection) == 12 and len(test) == 24 and not set(selection) & set(test)
    assert max(selection) > 30 and min(selection) < 5  # both splits see the whole held-out set
    with pytest.raises(Exception, match="fewer than"):
        split_batches(batches[:10], 4, 8)


@pytest.mark.slow
def test_killed_study_resumes_to_the_same_numbers(smoke: tuple[Path, str], tmp_path: Path) -> None:
    """kill -9 in the middle of a trunk, run the same command again: the uninterrupted study's results."""
    run, _ = smoke
    other = tmp_path / "run"
    env = cli_env()
    cmd = [sys.executable, "-m", "pmakit", "experiment", "--preset", "scaling-smoke", "-o", str(other)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 1800
    while not (other / "m" / "trunk" / "checkpoint").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "the study ended before the kill"  # else nothing below would test a resume
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = run_cli("experiment", "--preset", "scaling-smoke", "-o", other, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "resumed " in done.stderr, done.stderr[-2000:]  # the killed trunk continued from its checkpoint

    def losses(r: Path) -> dict:
        return {(x["size"], x["tokens"], x["kind"]): x["val_loss"] for x in jsonl(r / "results.jsonl")}

    assert losses(other) == losses(run)
