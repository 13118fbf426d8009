"""pmakit tune and the selection/test held-out splits, on a tiny real training run (a 1-layer Llama, seconds)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from conftest import run_cli
from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.formats import read_state
from pmakit.lab import tune as tune_mod
from pmakit.lab.tune import TuneConfig, tune
from pmakit.train.data import HeldOut, corpus_heldout, heldout_splits, prepare_corpus

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(3000))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A corpus of 8 files and a 15-snapshot constant-LR run on it (RUN/snapshots, RUN/checkpoint)."""
    from pmakit.train.loop import TrainConfig, Trainer
    from pmakit.train.model import ModelConfig

    root = tmp_path_factory.mktemp("tune")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"m{i}.py").write_text(TEXT[i * 15000 : (i + 1) * 15000 + 40000])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PMAKIT_CACHE", str(root / "cache"))
        cfg = TrainConfig(
            corpus=str(corpus), vocab_size=300, val_fraction=0.3, max_corpus_bytes=None,
            model=ModelConfig(layers=1, hidden=32, heads=2, seq_len=32), batch_size=4, total_tokens=128 * 30,
            lr=3e-3, warmup_tokens=256, every_tokens=128 * 2, eval_every=0, threads=1, log_every=10,
        )  # fmt: skip
        trainer = Trainer(cfg, root / "run", progress=False)
        trainer.fit()
        trainer.saver.wait()
        trainer.close()
        yield {"root": root, "run": root / "run", "corpus": corpus, "cache": root / "cache"}


@pytest.fixture
def cache(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PMAKIT_CACHE", str(tiny["cache"]))
    return tiny["cache"]


# --- the splits


def _docs(tokens: np.ndarray) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == 0) + 1
    return [tuple(tokens[lo:hi]) for lo, hi in zip([0, *ends[:-1]], ends)]


def test_splits_are_disjoint_whole_documents() -> None:
    # documents of 5, 3, 4 tokens (each ends with EOT = 0) -> selection [doc 0], test [doc 1, doc 2]
    val = np.array([1, 2, 3, 4, 0, 5, 6, 0, 7, 8, 9, 0], dtype=np.uint16)
    held = heldout_splits(val)
    assert held.mode == "by-file" and held.documents == (1, 2)
    assert held.selection.tolist() == [1, 2, 3, 4, 0]
    assert held.test.tolist() == [5, 6, 0, 7, 8, 9, 0]
    halves = heldout_splits(np.arange(1, 11), eot=None)  # no document boundaries: contiguous halves
    assert halves.mode == "contiguous" and halves.selection.tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(PmakitError, match="too few"):
        heldout_splits(np.array([1, 0]))


def test_corpus_splits_share_no_file(tiny: dict[str, Path]) -> None:
    corpus = prepare_corpus(tiny["corpus"], tiny["cache"], vocab_size=300, val_fraction=0.3, seed=0)
    held = corpus_heldout(corpus)
    sel, test = _docs(held.selection), _docs(held.test)
    assert held.mode == "by-file" and len(sel) >= 1 and len(test) >= 1
    assert not set(sel) & set(test)
    assert sorted(sel + test) == sorted(_docs(np.asarray(corpus.val)))  # every held-out file, once
    assert corpus.files["val_files"] == len(sel) + len(test)


# --- the search


def _tune(tiny: dict[str, Path], out: Path, **kw: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"budget_evals": 12, "batches": 4, "seed": 3, **kw}
    return tune(tiny["run"], out, config=TuneConfig(**options))


def test_tune_record_is_complete_and_the_merge_loads(
    tiny: dict[str, Path], cache: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "tuned"
    record = _tune(tiny, out)
    saved = json.loads((out / "tune.json").read_text())
    assert saved["best_trial"] == record["best_trial"]
    assert len(saved["trials"]) == 12  # the budget, baselines included
    for t in saved["trials"]:
        assert {"number", "params", "merge", "selection_loss"} <= set(t)
        assert abs(sum(t["merge"]["weights"]) - 1) < 1e-5
    assert saved["trials"][0]["merge"]["tokens"] == [3840]  # the newest snapshot, enqueued first
    hint = saved[
        "spectrum_hint"
    ]  # the SMA the trajectory's spectrum suggests, tried right after the baselines
    assert 2 <= hint["n"] <= 15 and hint["params"] in [t["params"] for t in saved["trials"][:3]]
    assert len(saved["trials"][1]["merge"]["tokens"]) == 10  # the fixed recipe, SMA of the last 10
    best = min(saved["trials"], key=lambda t: t["selection_loss"])
    models = saved["models"]
    assert models["tuned"]["selection_loss"] == best["selection_loss"]
    assert models["tuned"]["selection_loss"] <= min(
        models["last"]["selection_loss"], models["fixed"]["selection_loss"]
    )
    for name in ("tuned", "last", "fixed"):
        assert np.isfinite(models[name]["test_loss"]) and models[name]["test_loss_se"] > 0
    c = saved["comparisons"]["tuned - fixed"]
    assert c["delta"] == pytest.approx(models["tuned"]["test_loss"] - models["fixed"]["test_loss"])
    assert saved["data"]["mode"] == "by-file" and saved["data"]["batches"] == {"selection": 4, "test": 4}

    # the merge on disk is the recorded weights applied to the recorded snapshots, and it loads in transformers
    merge = models["tuned"]["merge"]
    snaps = {
        int(json.loads((p / "pmakit.json").read_text())["tokens"]): p
        for p in (tiny["run"] / "snapshots").iterdir()
    }
    states = [read_state(snaps[t]) for t in merge["tokens"]]
    merged = read_state(out)
    for key, value in merged.items():
        expected = sum(w * s[key].float() for w, s in zip(merge["weights"], states))
        torch.testing.assert_close(value.float(), expected, atol=1e-5, rtol=1e-4)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[-1] == 300
    assert json.loads((out / "pmakit-merge.json").read_text())["method"] == "tune"


def test_the_search_starts_from_the_baselines_the_hints_and_an_sma_lattice(tiny: dict[str, Path]) -> None:
    """Fixed first trials (up to half the budget), then TPE; a primed score is reused, never recomputed."""
    from pmakit.evaluate import EvalResult

    config = TuneConfig(budget_evals=12, seed=0)
    space = tune_mod.Space.of(tune_mod._run_snapshots(tiny["run"]), config)
    evaluated: list[tuple[Any, ...]] = []

    def fake(candidate: tune_mod.Candidate, split: str) -> EvalResult:
        evaluated.append(candidate.key)
        loss = 1.0 + abs(len(candidate.snapshots) - 6) / 10  # smooth in N, so TPE has a slope to follow
        return EvalResult(loss, 0.1, None, [loss, loss])

    scorer = tune_mod.Scorer(fake)
    sma = {"end_back": 0, "v_mult": 1, "family": "sma"}
    primed = space.candidate({**sma, "n": 4})
    scorer.prime(primed, "selection", EvalResult(0.5, 0.1, None, [0.5, 0.5]))  # as if the grid had scored it
    hint = {"end_back": 1, "v_mult": 1, "n": 3, "family": "wma"}
    trials = tune_mod.search(space, scorer, config, [hint])

    assert len(trials) == 12
    lattice = space.lattice()
    assert lattice[:3] == [{**sma, "n": 2}, {**sma, "n": 4}, {**sma, "n": 8}]  # N doubling, at every V
    assert all(len(space.window(0, p["n"], p["v_mult"])) == p["n"] for p in lattice)  # whole windows only
    assert [t["params"] for t in trials[:6]] == [{**sma, "n": 1}, {**sma, "n": 10}, hint, *lattice[:3]]
    assert primed.key not in evaluated  # the primed score was used as is
    assert len(evaluated) == scorer.evaluations["selection"] == len(set(evaluated))  # each candidate once
    assert tune_mod.chosen_candidate(space, trials).key == primed.key  # the lowest selection loss wins


def test_the_choice_ignores_the_test_split(
    tiny: dict[str, Path], cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing the test split changes the test numbers, never the trials or the choice."""
    first = _tune(tiny, tmp_path / "a")
    real = tune_mod.load_eval_data

    def other_test(*args: Any) -> Any:
        found = real(*args)
        rng = np.random.default_rng(1)
        noise = rng.integers(1, 300, size=len(found.held.test)).astype(found.held.test.dtype)
        found.held = HeldOut(found.held.selection, noise, found.held.mode, found.held.documents)
        return found

    monkeypatch.setattr(tune_mod, "load_eval_data", other_test)
    second = _tune(tiny, tmp_path / "b")
    assert [t["merge"] for t in first["trials"]] == [t["merge"] for t in second["trials"]]
    assert first["models"]["tuned"]["merge"] == second["models"]["tuned"]["merge"]
    assert first["models"]["tuned"]["test_loss"] != second["models"]["tuned"]["test_loss"]


def test_time_budget_stops_the_search(tiny: dict[str, Path], cache: Path, tmp_path: Path) -> None:
    record = _tune(tiny, tmp_path / "t", budget_evals=None, budget_seconds=0.5)
    n = len(record["trials"])
    assert 1 <= n < 500  # one trial takes milliseconds: an unlimited search would run far past 500
    searched = sum(t["seconds"] for t in record["trials"])
    assert searched < 0.5 + max(t["seconds"] for t in record["trials"]) + 0.2  # no trial starts after 0.5 s
    assert record["evaluations"]["selection"] <= n


def test_eval_cmd_scores_merges_written_to_disk(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A user command that prints a loss: here the mean of the head weights, so the choice is predictable."""
    script = tmp_path / "score.py"
    script.write_text(
        "import sys\nfrom safetensors.numpy import load_file\n"  # no torch import: a fast command
        "t = load_file(sys.argv[1] + '/model.safetensors')\n"
        "print('loss', float(t['model.norm.weight'].mean()))\n"
    )
    out = tmp_path / "cmd"
    record = _tune(tiny, out, budget_evals=4, eval_cmd=f"{sys.executable} {script} {{model}} {{split}}")
    assert len(record["trials"]) == 4 and record["comparisons"]["tuned - last"]["delta_se"] is None
    assert not (tmp_path / ".cmd.tune-scratch").exists()
    assert (out / "model.safetensors").is_file()


# --- the CLI


def test_cli_runs_and_prints_both_splits(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cli"
    env = {"PMAKIT_CACHE": str(tiny["cache"])}
    proc = run_cli("tune", tiny["run"], "-o", out, "--budget-evals", "4", "--batches", "2", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "chosen on the selection split" in proc.stdout and "test: tuned - fixed" in proc.stdout
    assert (out / "tune.json").is_file()
    # --compile: the same search through torch.compile, the same choice and (to float rounding) the same scores
    proc = run_cli(
        "tune", tiny["run"], "-o", tmp_path / "compiled", "--budget-evals", "4", "--batches", "2", "--compile",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0 and "torch.compile failed" not in proc.stderr, proc.stderr
    eager, compiled = (json.loads((d / "tune.json").read_text()) for d in (out, tmp_path / "compiled"))
    assert [t["merge"] for t in eager["trials"]] == [t["merge"] for t in compiled["trials"]]
    assert [t["selection_loss"] for t in compiled["trials"]] == pytest.approx(
        [t["selection_loss"] for t in eager["trials"]], rel=1e-5
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--budget-evals", "1"], "at least 2"),
        (["--eval-cmd", "echo 1"], "{model}"),
        (["--eval", "nowhere/*.txt"], "matches no files"),
        (["--eval", "missing.npy"], "corpus not found"),
        (["--budget-seconds", "-1"], "positive"),
    ],
)
def test_cli_errors_are_one_line(
    tiny: dict[str, Path], cache: Path, tmp_path: Path, args: list[str], message: str
) -> None:
    r = CliRunner().invoke(cli, ["tune", str(tiny["run"]), "-o", str(tmp_path / "o"), *args])
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0], r.stderr
    assert not (tmp_path / "o").exists()


def test_cli_refuses_a_missing_run_and_an_existing_output(tiny: dict[str, Path], tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["tune", str(tmp_path / "nope"), "-o", str(tmp_path / "o")])
    assert r.exit_code != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    r = CliRunner().invoke(cli, ["tune", str(tiny["run"]), "-o", str(tmp_path / "taken")])
    assert r.exit_code != 0 and "exists" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
    assert os.listdir(tmp_path / "taken") == ["notes.txt"]


# --- the experiment's headline uses the same machinery


def test_experiment_headline_chosen_on_selection_reported_on_test(smoke_experiment: tuple[Path, str]) -> None:
    from pmakit.runs import read_jsonl

    run, _ = smoke_experiment
    rows = read_jsonl(run / "results.jsonl")
    exp = json.loads((run / "experiment.json").read_text())
    assert exp["heldout"]["mode"] == "by-file" and min(exp["heldout"]["batches"].values()) >= 2
    assert {r["split"] for r in rows} == {"selection", "test"}
    cell = ("method", "n", "v_tokens", "alpha")
    for fork in exp["forks"]:
        at = [r for r in rows if r["fork_tokens"] == fork["fork_tokens"]]
        grid = [r for r in at if r["split"] == "selection" and r["model"] == "merged"]
        test = {r["role"] or r["model"]: r for r in at if r["split"] == "test"}
        assert {"latest", "annealed", "best", "fixed", "tuned"} <= set(test)
        chosen = min(grid, key=lambda r: r["val_loss"])
        assert [test["best"][k] for k in cell] == [chosen[k] for k in cell]  # the selection split's pick
        assert test["best"]["val_loss"] != chosen["val_loss"]  # ... scored again, on other files
        assert test["fixed"]["method"] == "sma" and test["fixed"]["n"] == 10
        assert test["fixed"]["v_tokens"] == exp["base_every_tokens"]
        assert test["tuned"]["tune"]["trials"] == exp["config"]["experiment"]["tune_evals"]
        # the search starts from the grid's best cells (their scores reused): it never picks worse on selection
        assert test["tuned"]["tune"]["selection_loss"] <= chosen["val_loss"]
        assert test["tuned"]["tune"]["evaluations"] < test["tuned"]["tune"]["trials"]
        # experiment.oracle (smoke preset): every SMA cell of the grid scored on test too, none chosen from them
        oracle = [r for r in at if r["split"] == "test" and r["role"] == "oracle"]
        sma = {(r["n"], r["v_tokens"]) for r in grid if r["method"] == "sma"}
        assert sorted((r["n"], r["v_tokens"]) for r in oracle) == sorted(sma) and len(sma) >= 4
        if test["best"]["method"] == "sma":  # the same window, scored on the same test batches
            twin = next(
                r for r in oracle if (r["n"], r["v_tokens"]) == (test["best"]["n"], test["best"]["v_tokens"])
            )
            assert twin["batch_losses"] == pytest.approx(test["best"]["batch_losses"])
        latest = test["latest"]["batch_losses"]
        assert len(latest) == exp["heldout"]["batches"]["test"]
        for role in ("best", "fixed", "tuned"):
            diffs = [a - b for a, b in zip(test[role]["batch_losses"], latest)]
            assert test[role]["delta_vs_latest"] == pytest.approx(sum(diffs) / len(diffs))
    report = (run / "report.md").read_text()
    assert "on the TEST split" in report and "fixed recipe, no selection" in report
    assert "oracle, not a choice" in report and "For scale, not a choice: the best of" in report
    assert "chosen on selection" in report
    from pmakit.units import format_tokens

    compute = report.split("## Compute: anneal vs merge")[1].split("\n## ")[0]
    per_eval = exp["heldout"]["batches"]["selection"] * 16 * 128  # batches x batch size x seq_len (smoke)
    trials = exp["config"]["experiment"]["tune_evals"]
    for record in (r["tune"] for r in rows if r.get("tune")):  # the search's cost: the evaluations it made
        made = record["evaluations"]
        assert (
            f"{made} x {format_tokens(per_eval)} tokens / 3 = {format_tokens(made * per_eval / 3)}" in compute
        )
        assert f"({trials - made} of {trials} trials reused the grid's scores)" in compute


def test_rows_of_an_older_run_are_set_aside_not_mixed(tmp_path: Path) -> None:
    """Rows scored on the whole held-out set (no split) would mix with selection/test rows: re-evaluated instead."""
    from pmakit.lab.pma import _current_rows

    old = {"fork_tokens": 1, "model": "latest", "tokens": 2, "val_loss": 3.0}
    (tmp_path / "results.jsonl").write_text(json.dumps(old) + "\n")
    assert _current_rows(tmp_path) == []
    assert not (tmp_path / "results.jsonl").exists()
    assert json.loads((tmp_path / "results-whole-val.jsonl").read_text()) == old
    (tmp_path / "results.jsonl").write_text(json.dumps({**old, "split": "test"}) + "\n")
    assert _current_rows(tmp_path) == [{**old, "split": "test"}]


def test_a_run_too_big_for_memory_asks_for_eval_cmd(
    tiny: dict[str, Path], cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import psutil

    class Tiny:
        available = 1000  # bytes: less than two snapshots of the 1-layer model

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(PmakitError, match="--eval-cmd"):
        _tune(tiny, tmp_path / "big")
    assert not (tmp_path / "big").exists()


def test_files_too_unequal_to_divide_whole_are_halved() -> None:
    # two held-out files of 5 and 20 tokens: whole files would give selection 5 of 25 tokens; halves give 12 and 13
    small, big = np.arange(1, 6), np.arange(10, 30)
    small[-1] = big[-1] = 0
    held = heldout_splits(np.concatenate([small, big]).astype(np.uint16))
    assert held.mode == "halves" and held.documents == (2, 2)
    assert held.selection.tolist() == [*small[:2], *big[:10]]
    assert held.test.tolist() == [*small[2:], *big[10:]]
