"""`pmakit experiment --preset smoke` end to end through the real CLI: the study, its files, resuming."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from pmakit.lab.pma import RESULT_COLUMNS, ExperimentConfig, resolve
from pmakit.snapshot import discover
from pmakit.weights import get_weights


@pytest.fixture(scope="module")
def smoke(smoke_experiment: tuple[Path, str]) -> tuple[Path, str]:
    return smoke_experiment  # one smoke study per session (the README test analyzes it too)


def rows(run: Path) -> list[dict[str, str]]:
    with open(run / "results.csv") as f:
        return list(csv.DictReader(f))


def test_results_have_the_contract_columns_and_every_kind_of_model(smoke: tuple[Path, str]) -> None:
    run, _ = smoke
    with open(run / "results.csv") as f:
        assert next(csv.reader(f))[: len(RESULT_COLUMNS)] == list(RESULT_COLUMNS)
    kinds = {(r["model"], r["method"]) for r in rows(run)}
    assert {
        ("latest", ""),
        ("annealed", ""),
        ("merged", "sma"),
        ("merged", "wma"),
        ("merged", "ema"),
    } <= kinds
    exp = json.loads((run / "experiment.json").read_text())
    forks = [f["fork_tokens"] for f in exp["forks"]]
    assert sorted({int(r["fork_tokens"]) for r in rows(run) if r["fork_tokens"]}) == forks
    for r in rows(run):
        assert float(r["val_loss"]) > 0 and float(r["val_loss_se"]) > 0


def test_smoke_shows_the_merge_beating_the_latest_snapshot(smoke: tuple[Path, str]) -> None:
    """The product's first promise, at the final fork: the best SMA beats the latest snapshot beyond noise."""
    run, _ = smoke
    last = max(int(r["fork_tokens"]) for r in rows(run) if r["fork_tokens"])
    sma = [r for r in rows(run) if r["fork_tokens"] == str(last) and r["method"] == "sma"]
    best = min(sma, key=lambda r: float(r["val_loss"]))
    assert float(best["delta_vs_latest"]) < -5 * float(best["delta_se"]), best
    annealed = next(r for r in rows(run) if r["fork_tokens"] == str(last) and r["model"] == "annealed")
    assert float(annealed["delta_vs_latest"]) < 0  # annealing helps too: the baseline is a real one


def test_headline_merge_is_the_real_engine_and_matches_the_grid(smoke: tuple[Path, str]) -> None:
    """RUN/merged is the grid's best SMA on the SELECTION split at the last fork (its window: the row's N, V and
    end), merged by the streaming engine."""
    from pmakit.runs import read_jsonl

    run, _ = smoke
    manifest = json.loads((run / "merged" / "pmakit-merge.json").read_text())
    results = read_jsonl(run / "results.jsonl")
    last = max(r["fork_tokens"] for r in results if r["fork_tokens"] is not None)
    grid = [
        r
        for r in results
        if r["fork_tokens"] == last
        and r["model"] == "merged"
        and r["method"] == "sma"
        and r["split"] == "selection"
    ]
    best = min(grid, key=lambda r: r["val_loss"])
    assert len(grid) >= 4 and manifest["experiment_row"] == best["label"]
    assert manifest["selection"] == {"last": best["n"], "every": best["v_tokens"], "until": best["tokens"]}
    snaps = {s.path.resolve(): s for s in discover(run / "main")}
    chosen = [snaps[Path(i["path"])] for i in manifest["inputs"]]
    assert len(chosen) == best["n"] and chosen[-1].tokens == best["tokens"]
    assert all(b.tokens - a.tokens == best["v_tokens"] for a, b in zip(chosen, chosen[1:]))
    states = [load_file(s.path / "model.safetensors") for s in chosen]
    merged = load_file(run / "merged" / "model.safetensors")
    for name, value in merged.items():
        expected = sum(w * st[name].double() for st, w in zip(states, get_weights("sma", len(states))))
        torch.testing.assert_close(value.double(), expected, rtol=1e-6, atol=1e-7)


def test_report_and_summary(smoke: tuple[Path, str]) -> None:
    run, stdout = smoke
    for name in ("report.md", "report.html", "curves.csv", "results.jsonl"):
        assert (run / name).stat().st_size > 0, name
    assert "report" in stdout
    # the summary's table cuts no label: the tuned merge's names its window whole ("... ending at 5.98M")
    tuned = max((r for r in rows(run) if r["role"] == "tuned"), key=lambda r: int(r["fork_tokens"]))
    assert f"tuned: {tuned['label'].split(' (best of ')[0]} " in stdout


def test_rerun_resumes_without_redoing(smoke: tuple[Path, str]) -> None:
    run, _ = smoke
    before = (run / "results.csv").read_text()
    proc = run_cli("experiment", "--preset", "smoke", "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "already done" in proc.stderr
    assert (run / "results.csv").read_text() == before


def test_changed_config_on_resume_is_refused(smoke: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = smoke
    cfg = tmp_path / "c.yaml"
    cfg.write_text("preset: smoke\ntrain:\n  lr: 0.01\n")
    proc = run_cli("experiment", cfg, "-o", run)
    assert proc.returncode != 0 and proc.stderr.startswith("Error: ") and "train.lr" in proc.stderr


def test_a_run_from_an_older_pmakit_resumes_when_its_new_keys_are_what_it_did(tmp_path: Path) -> None:
    """A key added to train: or experiment: after the run was started changes nothing when it is set to what the
    older run did (its default, or what the run did before the key: no learned weights): resume. Any other value is
    a changed config, and the error says what the older run did."""
    import json

    from pmakit.config import load
    from pmakit.errors import PmakitError
    from pmakit.lab.pma import _check_same_config

    smoke = load(None, "smoke", "demo")
    before = {**smoke, "experiment": {**smoke["experiment"], "tune_learn_steps": 0}}
    as_before = resolve(before)
    _check_same_config(tmp_path, as_before)  # stamps config.json
    saved = json.loads((tmp_path / "config.json").read_text())
    del saved["train"]["compile"], saved["experiment"]["tune_learn_steps"]  # as an older pmakit wrote it
    (tmp_path / "config.json").write_text(json.dumps(saved))
    _check_same_config(tmp_path, as_before)  # compile at its default, no learned weights: what the run did
    changed = resolve({**before, "train": {**smoke["train"], "compile": "on"}})
    with pytest.raises(PmakitError, match=r"changed: train\.compile\); it is from an older pmakit that ran as "
                       r'train\.compile: "off"; pass --fresh'):  # fmt: skip
        _check_same_config(tmp_path, changed)
    # the smoke preset's learned weights (4 steps) are not what the older run did: its tuned rows would be stale
    with pytest.raises(
        PmakitError, match=r"changed: experiment\.tune_learn_steps\).*ran as experiment\.tune_learn_steps: 0"
    ):
        _check_same_config(tmp_path, resolve(smoke))


def test_forks_are_aligned_to_the_snapshot_grid() -> None:
    train = {"every_tokens": 10240, "warmup_tokens": 1000, "batch_size": 10, "model": {"seq_len": 128}}
    study = resolve({"train": train, "experiment": {"forks": ["400K"]}})
    # 400K rounds to 39 x 10240 = 399,360; D = 0.2 x F = 79,872 -> 8 intervals = 81,920
    assert [(f.fork_tokens, f.anneal_tokens) for f in study.forks] == [(399_360, 81_920)]
    assert study.train.total_tokens == 399_360 + 81_920 and study.train.decay_tokens == 0


def test_bad_experiment_configs() -> None:
    from pmakit.errors import PmakitError

    with pytest.raises(PmakitError, match="unknown method"):
        ExperimentConfig(methods=("sma", "bogus"))
    with pytest.raises(PmakitError, match="unknown experiment config keys: fork"):
        ExperimentConfig.from_dict({"fork": [1]})


def _fork_table(report_md: str) -> dict[str, dict[str, float]]:
    """The 'At each fork' table of report.md: per fork (F1, ...), latest and the merge's and anneal's Δ."""
    section = report_md.split("## At each fork", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not line.startswith("| F") or len(cells) < 7:
            continue
        number = lambda cell: float(cell.split()[0])  # noqa: E731  "3.7396 ± 0.0380" -> 3.7396
        out[cells[0].split()[0]] = {
            "latest": number(cells[3]),
            "merge_delta": number(cells[5]),
            "anneal_delta": number(cells[6]),
        }
    return out


def test_every_figure_plots_the_numbers_its_table_prints(
    smoke: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 14: the loss-vs-tokens figure's fork panels and the gains bars show exactly the fork table's numbers
    (same models, same tokens, same evaluation), read back from the drawn matplotlib figures."""
    from pmakit import report
    from pmakit.report import plots

    drawn: dict[str, object] = {}
    save = plots._save
    monkeypatch.setattr(
        plots, "_save", lambda fig, path: drawn.setdefault(path.name, fig) and save(fig, path)
    )
    run, _ = smoke
    report.write_report(run)
    table = _fork_table((run / "report.md").read_text())
    assert set(table) == {"F1", "F2"}

    curves = drawn["loss_vs_tokens.png"]
    panels = [ax for ax in curves.axes if ax.get_title().startswith("F")]  # type: ignore[attr-defined]
    assert [ax.get_title().split()[0] for ax in panels] == ["F1", "F2"]
    for ax in panels:
        fork = table[ax.get_title().split()[0]]
        y = {line.get_label(): float(line.get_ydata()[0]) for line in ax.get_lines()}
        assert y["latest"] == pytest.approx(fork["latest"], abs=6e-5)
        assert y["best merge"] - y["latest"] == pytest.approx(fork["merge_delta"], abs=1.1e-4)
        assert y["anneal"] - y["latest"] == pytest.approx(fork["anneal_delta"], abs=1.1e-4)
        # the values printed on the panel are the table's own digits
        assert {t.get_text() for t in ax.texts} >= {f"{fork['latest']:.4f}"}

    gains = drawn["fork_gains.png"]
    (ax,) = gains.axes  # type: ignore[attr-defined]
    bars = [(p.get_x() + p.get_width() / 2, p.get_height(), p.get_facecolor()) for p in ax.patches]
    anneal_color = tuple(int(plots.ANNEAL[i : i + 2], 16) / 255 for i in (1, 3, 5))
    for i, name in enumerate(("F1", "F2")):
        group = sorted((b for b in bars if abs(b[0] - i) < 0.5), key=lambda b: b[0])
        anneal = [h for _, h, c in group if tuple(c[:3]) == pytest.approx(anneal_color)]
        assert anneal == [pytest.approx(table[name]["anneal_delta"], abs=6e-5)]
        merges = [h for _, h, c in group if tuple(c[:3]) != pytest.approx(anneal_color)]
        # the table's best grid merge is one of the bars (the tuner's pick, also drawn, may be lower still)
        assert any(h == pytest.approx(table[name]["merge_delta"], abs=6e-5) for h in merges), merges


def test_downstream_table_scores_the_headline_models_on_test_items(smoke: tuple[Path, str]) -> None:
    """The study's downstream stage: the final fork's headline models and the noise band's raw snapshots on both
    offline lm-eval tasks (test items), each difference paired over the same items, and the report's table. The
    earlier forks are not scored (the report shows the final fork's table)."""
    from pmakit.eval import stats
    from pmakit.report.downstream import summarize
    from pmakit.runs import read_jsonl

    run, _ = smoke
    rows_ = read_jsonl(run / "downstream.jsonl")
    forks = {int(r["fork_tokens"]) for r in rows(run) if r["fork_tokens"]}
    assert len(forks) >= 2
    last = max(forks)
    assert {r["fork_tokens"] for r in rows_} == {last}
    assert {r["model"] for r in rows_} >= {"latest", "annealed", "merged", "raw"}
    assert {r.get("role") for r in rows_} >= {"", "best", "fixed", "tuned", "noise"}
    # one row per model, task and metric: 8 models (5 of the headline, 3 raw snapshots) on both tasks
    assert len({(r["label"], r["task"], r["metric"]) for r in rows_}) == len(rows_)
    assert len({(r["model"], r.get("role"), r.get("raw_back")) for r in rows_}) == 8
    assert {(r["task"], r["metric"]) for r in rows_} >= {
        ("pmakit_next_line", "acc"),
        ("pmakit_bpb", "bits_per_byte"),
    }
    acc = [r for r in rows_ if r["metric"] == "acc"]
    assert all(0.0 <= stats.score("acc", r["items"])[0] <= 1.0 for r in acc)
    summary = summarize(rows_)
    latest = next(
        r for r in rows_ if r["fork_tokens"] == last and r["model"] == "latest" and r["metric"] == "acc"
    )
    best = next(
        r for r in rows_ if r["fork_tokens"] == last and r.get("role") == "best" and r["metric"] == "acc"
    )
    row = next(
        s
        for s in summary
        if s["fork_tokens"] == last and s["label"] == best["label"] and s["metric"] == "acc"
    )
    # the paired difference by hand: per-item accuracy differences on the same items
    a, b = stats.aligned(best, latest)
    diffs = [x - y for x, y in zip(a, b)]
    mean = sum(diffs) / len(diffs)
    sd = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1)) ** 0.5
    assert row["vs_latest"]["delta"] == pytest.approx(mean, abs=1e-12)
    assert row["vs_latest"]["se"] == pytest.approx(sd / len(diffs) ** 0.5, rel=1e-9)
    assert row["noise"]["k"] >= 2
    report = (run / "report.md").read_text()
    assert (
        "Downstream tasks (lm-evaluation-harness, test items)" in report
        and "pmakit_next_line / acc" in report
    )
