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
from pmakit.evaluate import EvalResult as EvalResultType
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
    assert len(saved["trials"]) == 12 + 1  # the budget, baselines included, then the learned weights
    learned = saved["trials"][-1]
    assert learned["merge"]["family"] == "learned" and learned["learn"] == saved["learned"]
    merges = [t for t in tune_mod.scored(saved["trials"][:-1]) if len(t["merge"]["tokens"]) > 1]
    source = min(merges, key=lambda t: t["selection_loss"])  # the best trial that merges: its window
    assert learned["params"]["learned_from"] == source["number"]
    assert learned["merge"]["tokens"] == source["merge"]["tokens"]
    for t in saved["trials"]:
        assert {"number", "params", "merge"} <= set(t) and (t["selection_loss"] is not None or t["stopped"])
        assert abs(sum(t["merge"]["weights"]) - 1) < 1e-5
    assert saved["trials"][0]["merge"]["tokens"] == [3840]  # the newest snapshot, enqueued first
    hint = saved[
        "spectrum_hint"
    ]  # the SMA the trajectory's spectrum suggests, tried right after the baselines
    assert 2 <= hint["n"] <= 15 and hint["params"] in [t["params"] for t in saved["trials"][:3]]
    assert len(saved["trials"][1]["merge"]["tokens"]) == 10  # the fixed recipe, SMA of the last 10
    best = min(tune_mod.scored(saved["trials"]), key=lambda t: t["selection_loss"])
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

    def fake(candidate: tune_mod.Candidate, split: str) -> Iterator[float]:
        evaluated.append(candidate.key)
        loss = 1.0 + abs(len(candidate.snapshots) - 6) / 10  # smooth in N, so TPE has a slope to follow
        yield from (loss, loss)

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


def _noisy(base: float, n: int = 16, seed: int = 0) -> list[float]:
    """Per-batch losses: a batch-to-batch spread (the text) shared by every model, plus a little model noise."""
    text = np.random.default_rng(99).normal(0, 0.3, n)
    own = np.random.default_rng(seed).normal(0, 0.002, n)
    return [float(base + t + o) for t, o in zip(text, own)]


def test_racing_stops_a_clearly_worse_trial_early_and_nothing_else(tiny: dict[str, Path]) -> None:
    """Paired against the best on the same batches: a trial 0.05 worse stops at the first look (4 of 16 batches),
    its evaluation closed there; one a hair worse (within the noise) or better is scored in full."""
    from pmakit.evaluate import result_of

    config = TuneConfig(budget_evals=12)
    space = tune_mod.Space.of(tune_mod._run_snapshots(tiny["run"]), config)
    level = {1: 1.05, 2: 1.0002, 3: 0.98}  # by N: clearly worse, within noise, better than the best (1.0)
    started, closed = [], []

    def losses(candidate: tune_mod.Candidate, split: str) -> Iterator[float]:
        n = len(candidate.snapshots)
        started.append(n)
        try:
            yield from _noisy(level[n], seed=n)
        finally:
            closed.append(n)

    scorer = tune_mod.Scorer(losses)
    best = result_of(_noisy(1.0, seed=7))
    sma = {"end_back": 0, "v_mult": 1, "family": "sma"}
    worse, close, better = (space.candidate({**sma, "n": n}) for n in (1, 2, 3))

    stopped = scorer.race(worse, "selection", best)
    assert isinstance(stopped, tune_mod.Stopped) and (stopped.batches, stopped.of) == (4, 16)
    assert stopped.delta == pytest.approx(0.05, abs=0.005) and stopped.delta > 10 * stopped.delta_se
    assert closed == [1] and scorer.batches["selection"] == 4 and scorer.stopped == 1
    assert scorer.race(worse, "selection", best) is stopped and started == [1]  # stays stopped, at no cost
    for candidate in (close, better):
        assert isinstance(scorer.race(candidate, "selection", best), EvalResultType)
    assert scorer.batches["selection"] == 4 + 16 + 16 and scorer.stopped == 1
    full = scorer(worse, "selection")  # asked for its full score (the test split's confirm): all 16 batches
    assert len(full.batch_losses) == 16 and full.loss - best.loss == pytest.approx(0.05, abs=0.005)
    small = tune_mod.Scorer(losses)  # 4 batches: every look would come before the 4th, too few to judge
    assert isinstance(small.race(worse, "selection", result_of(_noisy(1.0, n=4))), EvalResultType)


def test_a_search_with_racing_keeps_the_baselines_whole_and_picks_a_complete_trial(
    tiny: dict[str, Path],
) -> None:
    """Trials far from the best N stop early (optuna marks them pruned); the baselines and the choice are
    scored on every batch, and the choice is the best of the complete trials."""
    config = TuneConfig(budget_evals=16, seed=0)
    space = tune_mod.Space.of(tune_mod._run_snapshots(tiny["run"]), config)

    def losses(candidate: tune_mod.Candidate, split: str) -> Iterator[float]:
        n = len(candidate.snapshots)
        yield from _noisy(1.0 + abs(n - 6) / 20, seed=n)

    scorer = tune_mod.Scorer(losses)
    trials = tune_mod.search(space, scorer, config)
    stopped = [t for t in trials if t["selection_loss"] is None]
    assert len(trials) == 16 and stopped and scorer.stopped == len(stopped)
    assert all(t["stopped"]["batches"] < 16 and t["stopped"]["delta"] > 0 for t in stopped)
    assert trials[0]["selection_loss"] is not None and trials[1]["selection_loss"] is not None  # baselines
    assert scorer.batches["selection"] < 16 * scorer.evaluations["selection"]
    chosen = tune_mod.chosen_candidate(space, trials)
    best = min(t["selection_loss"] for t in tune_mod.scored(trials))
    assert scorer(chosen, "selection").loss == best
    for t in stopped:  # no stopped trial would have won: each one's full score is worse than the choice's
        full = scorer(space.candidate(t["params"]), "selection")
        assert full.loss > best
    no_race = tune_mod.search(space, tune_mod.Scorer(losses), TuneConfig(budget_evals=16, seed=0, race=False))
    assert all(t["selection_loss"] is not None for t in no_race)


def _in_memory(tiny: dict[str, Path], config: TuneConfig) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    """The tiny run's space and in-memory evaluator (its model in training mode), with the model's own weights."""
    snapshots = tune_mod._run_snapshots(tiny["run"])
    evaluator, _, _ = tune_mod._evaluator(tiny["run"], tiny["root"] / "x", snapshots, None, config)
    evaluator.model.train()
    before = {k: v.clone() for k, v in evaluator.model.state_dict().items()}
    return tune_mod.Space.of(snapshots, config), evaluator, before


def test_a_stopped_trial_leaves_the_model_as_it_was(tiny: dict[str, Path], cache: Path) -> None:
    """Stopping an in-memory evaluation part way restores the model's own weights and its training mode."""
    from pmakit.evaluate import result_of

    space, evaluator, before = _in_memory(tiny, TuneConfig(batches=8))
    model = evaluator.model
    scorer = tune_mod.Scorer(evaluator)
    sma = {"end_back": 0, "v_mult": 1, "family": "sma"}
    good = scorer(space.candidate({**sma, "n": 8}), "selection")
    best = result_of([x - 1.0 for x in good.batch_losses])  # a rival 1 nat better: every trial stops at once
    stopped = scorer.race(space.candidate({**sma, "n": 2}), "selection", best)
    assert isinstance(stopped, tune_mod.Stopped) and (stopped.batches, stopped.of) == (4, 8)  # the first look
    assert model.training
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_learned_weights_fit_the_selection_split_and_leave_the_model_alone(
    tiny: dict[str, Path], cache: Path
) -> None:
    """The learned soup: weights on the simplex, a lower loss than the SMA it starts from on the batches it was fit
    on, the model's own weights and mode untouched; the search keeps it only if it is better on selection."""
    config = TuneConfig(batches=4, learn_steps=15)
    space, evaluator, before = _in_memory(tiny, config)
    model = evaluator.model
    sma = space.candidate({"end_back": 0, "v_mult": 1, "family": "sma", "n": 8})
    weights, spent = evaluator.learn(sma, 15)
    assert len(weights) == 8 and sum(weights) == pytest.approx(1) and min(weights) > 0
    assert spent == 15 * tune_mod.LEARN_BATCHES and weights != pytest.approx(sma.weights, abs=1e-3)
    scorer = tune_mod.Scorer(evaluator)
    learned = tune_mod.Candidate(sma.snapshots, tuple(weights), {**sma.params, "family": "learned"})
    assert scorer(learned, "selection").loss < scorer(sma, "selection").loss
    assert model.training  # its mode restored
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    # in a search: one more trial after the budget, chosen only if it is the best on selection
    trials = tune_mod.search(space, scorer, TuneConfig(budget_evals=6, batches=4))
    record = tune_mod.add_learned_trial(space, scorer, trials, evaluator.learn, config)
    assert record is trials[-1] and record["learn"]["batches"] == spent and len(trials) == 7
    chosen = tune_mod.chosen_candidate(space, trials)
    best = min(tune_mod.scored(trials), key=lambda t: t["selection_loss"])
    assert (chosen.params["family"] == "learned") == (best is record)
    assert tune_mod.add_learned_trial(space, scorer, trials, None, config) is None  # --eval-cmd: no gradients


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
    """A user command that prints a loss: here the mean of the final norm's weights of the merge written to disk,
    plus 1 on the test split, so every score and the choice can be checked."""
    script, calls = tmp_path / "score.py", tmp_path / "calls.txt"
    script.write_text(
        "import sys\nfrom safetensors.numpy import load_file\n"  # no torch import: a fast command
        "t = load_file(sys.argv[1] + '/model.safetensors')\n"
        "loss = float(t['model.norm.weight'].astype('float64').mean()) + (sys.argv[2] == 'test')\n"
        f"open({str(calls)!r}, 'a').write(f'{{sys.argv[2]}} {{loss!r}}\\n')\n"
        "print('step 7 loss', loss)\n"  # the last number printed is the loss
    )
    out = tmp_path / "cmd"
    record = _tune(tiny, out, budget_evals=4, eval_cmd=f"{sys.executable} {script} {{model}} {{split}}")
    assert len(record["trials"]) == 4 and record["comparisons"]["tuned - last"]["delta_se"] is None
    logged = [line.split() for line in calls.read_text().splitlines()]
    assert {split for split, _ in logged} == {"selection", "test"}
    selection = {float(x) for split, x in logged if split == "selection"}
    losses = [t["selection_loss"] for t in record["trials"]]
    assert set(losses) <= selection  # each trial's score is what the command printed for it
    tuned = record["models"]["tuned"]
    assert tuned["selection_loss"] == min(losses)  # chosen on selection
    assert tuned["test_loss"] == pytest.approx(tuned["selection_loss"] + 1, abs=1e-12)  # {split} given
    written = read_state(out)["model.norm.weight"].double().mean().item()
    assert written == pytest.approx(tuned["selection_loss"], abs=1e-6)  # the chosen merge is the one written
    assert not (tmp_path / ".cmd.tune-scratch").exists()


# --- the CLI


def test_cli_runs_and_prints_both_splits(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "cli"
    env = {"PMAKIT_CACHE": str(tiny["cache"])}
    proc = run_cli("tune", tiny["run"], "-o", out, "--budget-evals", "4", "--batches", "2", env=env)
    assert proc.returncode == 0, proc.stderr
    assert "chosen on the selection split" in proc.stdout and "test: tuned - fixed" in proc.stdout
    assert (
        "held-out loss: mean over 2 selection and 2 test batches of " in proc.stdout
    )  # not the demo's count
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
        learned = 1 if test["tuned"]["tune"]["learned_batches"] else 0  # the learned weights: one more trial
        assert test["tuned"]["tune"]["trials"] == exp["config"]["experiment"]["tune_evals"] + learned
        # the search starts from the grid's best cells (their scores reused): it never picks worse on selection
        assert test["tuned"]["tune"]["selection_loss"] <= chosen["val_loss"]
        assert test["tuned"]["tune"]["evaluations"] < test["tuned"]["tune"]["trials"]
        # experiment.oracle (smoke preset): every SMA cell of the grid scored on test too, none chosen from them
        oracle = [r for r in at if r["split"] == "test" and r["role"] == "oracle"]
        sma = {(r["n"], r["v_tokens"]) for r in grid if r["method"] == "sma"}
        assert sorted((r["n"], r["v_tokens"]) for r in oracle) == sorted(sma) and len(sma) >= 4
        # the best SMA chosen on selection (and the best merge, where it is an SMA): the oracle's scores of the same
        # window on the same test batches
        assert test["best-sma"]["method"] == "sma"
        for role in ("best-sma", "best") if test["best"]["method"] == "sma" else ("best-sma",):
            twin = next(
                r for r in oracle if (r["n"], r["v_tokens"]) == (test[role]["n"], test[role]["v_tokens"])
            )
            assert twin["batch_losses"] == pytest.approx(test[role]["batch_losses"])
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
    per_batch = 16 * 128
    for record in (r["tune"] for r in rows if r.get("tune")):  # the search's cost: the batches it scored
        made, scored, fit = record["evaluations"], record["batches_scored"], record["learned_batches"]
        assert record["evaluations"] * exp["heldout"]["batches"]["selection"] >= scored and fit > 0
        cost = format_tokens(scored * per_batch / 3 + fit * per_batch)  # a fit's batch: forward and backward
        assert (
            f"{scored} batches x {format_tokens(per_batch)} tokens / 3 + learned weights {fit} x "
            f"{format_tokens(per_batch)} = {cost}" in compute
        )
        n = record["trials"]
        assert f"({n - made} of {n} trials reused the grid's scores" in compute


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
    with pytest.raises(PmakitError, match="GB available; pass --eval-cmd"):
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


def test_a_failing_eval_cmd_and_foreign_token_ids_are_one_line(tiny: dict[str, Path], tmp_path: Path) -> None:
    """optuna logged the failing trial with its traceback before our error; token ids past the model's vocabulary
    were an IndexError inside its forward."""
    import numpy as np

    env = {"PMAKIT_CACHE": str(tiny["cache"])}
    failing = run_cli(
        "tune",
        tiny["run"],
        "-o",
        tmp_path / "a",
        "--budget-evals",
        "2",
        "--eval-cmd",
        "false {model}",
        env=env,
    )
    big = tmp_path / "ids.npy"
    np.save(big, np.arange(100_000, 160_000, dtype=np.int64))
    foreign = run_cli(
        "tune", tiny["run"], "-o", tmp_path / "b", "--budget-evals", "2", "--eval", big, env=env
    )
    for proc, message in ((failing, "--eval-cmd failed"), (foreign, "outside the model's vocabulary")):
        assert proc.returncode != 0
        lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("info:")]
        assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr
