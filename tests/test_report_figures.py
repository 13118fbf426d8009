"""What the study's figures print matches the tables: each names the split and batch count of its numbers, and
every number it writes is a result row of that split. Also the report's layout defects a reader saw: labels that
overlap, a chart whose axis hides the gap its text reports, a clipped table cell, a verdict that contradicts the
data, and the closing lines of `pmakit experiment`.

The split checks run on the smoke study (tests/conftest.py's session fixture, the real CLI); the layout checks on
tests/test_report.py's synthetic run, whose numbers are chosen.
"""

from __future__ import annotations

import csv
import re
import shutil
from collections.abc import Iterator
from itertools import combinations
from pathlib import Path

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from pmakit.report import draw_figures, plots, summary_text, write_report
from pmakit.report.analysis import base_interval, summarize_forks
from pmakit.report.load import RESULT_COLUMNS, Row, load_run
from test_report import FORKS, build_run, read_rows

NUMBER = re.compile(r"^[+−-]?\d+\.\d{4}$")


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Figure]]:
    """Every figure the report draws, by file stem, as it is saved."""
    figs: dict[str, Figure] = {}
    save = plots._save

    def keep(fig: Figure, path: Path) -> Path:
        figs[path.stem] = fig
        return save(fig, path)

    monkeypatch.setattr(plots, "_save", keep)
    yield figs


def texts(fig: Figure) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


def draw(run: Path) -> list[Row]:
    """Draws the run's figures (into ``captured``); returns its result rows."""
    data = load_run(run)
    draw_figures(data, summarize_forks(data), base_interval(data))
    return data.rows


@pytest.fixture(scope="module")
def smoke_copy(smoke_experiment: tuple[Path, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke study's result files (not its snapshots), so that drawing here leaves the shared run alone."""
    run, _ = smoke_experiment
    copy = tmp_path_factory.mktemp("figures") / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("main", "anneal-*", "merged", "plots"))
    return copy


def _split(rows: list[Row], split: str) -> tuple[list[Row], int]:
    chosen = [r for r in rows if r.split == split]
    (count,) = {len(r.batch_losses) for r in chosen if r.batch_losses}
    return chosen, count


def test_every_figure_names_its_split_and_prints_that_splits_numbers(
    smoke_copy: Path, captured: dict[str, Figure]
) -> None:
    rows = draw(smoke_copy)
    test, n_test = _split(rows, "test")
    selection, n_sel = _split(rows, "selection")
    shown = {name: "\n".join(texts(fig)) for name, fig in captured.items()}
    assert {"loss_vs_tokens", "fork_gains", "sma_n_by_v", "weightings", "n_v_sweeps", "loss_plane"} <= set(
        shown
    )
    for name in ("loss_vs_tokens", "fork_gains"):  # the tables' models: the test split
        assert f"test split, {n_test} batches" in shown[name], name
    for name in ("sma_n_by_v", "weightings", "n_v_sweeps"):  # the grid: the selection split
        assert f"selection split, {n_sel} batches" in shown[name], name
    assert re.search(r"selection split, \d+ batches \(a subset", shown["loss_plane"])

    # the fork panels print the test split's losses, exactly as the tables do
    losses = [t for t in texts(captured["loss_vs_tokens"]) if NUMBER.match(t)]
    assert losses and set(losses) <= {f"{r.val_loss:.4f}" for r in test if r.val_loss is not None}
    # the heat map prints Δ vs latest of selection-split rows (to the 4 decimals shown)
    cells = [t.split("\n")[0].replace("−", "-") for t in texts(captured["sma_n_by_v"]) if "\nz =" in t]
    deltas = [r.delta_vs_latest for r in selection if r.method == "sma" and r.delta_vs_latest is not None]
    assert cells
    for cell in cells:
        assert any(abs(float(cell) - d) <= 0.6e-4 for d in deltas), cell


def test_the_split_check_catches_a_figure_with_the_other_splits_numbers(smoke_copy: Path) -> None:
    rows = load_run(smoke_copy).rows
    test, _ = _split(rows, "test")
    selection, _ = _split(rows, "selection")
    test_losses = {f"{r.val_loss:.4f}" for r in test}
    assert not {f"{r.val_loss:.4f}" for r in selection if r.model == "latest"} <= test_losses


def test_experiment_closing_lines_say_where_the_merged_model_is(smoke_experiment: tuple[Path, str]) -> None:
    run, stdout = smoke_experiment
    tail = stdout.strip().splitlines()[-2:]
    assert tail[0].startswith(f"Merged: {run / 'merged'}/"), tail
    assert "from_pretrained" in tail[1]
    assert summary_text(run).splitlines()[-2:] == tail


def test_no_right_aligned_cell_is_long_enough_to_be_clipped(smoke_experiment: tuple[Path, str]) -> None:
    # right-aligned cells do not wrap (numbers); a sentence there overflows the page and is cut off on screen
    run, _ = smoke_experiment
    html = (run / "report.html").read_text()
    cells = [re.sub(r"<[^>]+>", "", c) for c in re.findall(r'<td class="r">(.*?)</td>', html)]
    assert cells and max(map(len, cells)) <= 40, max(cells, key=len)
    assert re.search(r'<td class="l">[^<]*batches x', html)  # the tuner's cell is there, and wraps


# --- on the synthetic run --------------------------------------------------------------------------------


def relabel(run: Path, swap: dict[tuple[str, str], tuple[str, str]]) -> None:
    """Rewrite results.csv with (method, alpha) pairs swapped (and no JSONL, which would take precedence)."""
    rows = read_rows(run)
    for r in rows:
        r["method"], r["alpha"] = swap.get((r["method"], r["alpha"]), (r["method"], r["alpha"]))
    (run / "results.jsonl").unlink()
    with (run / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def test_gain_bar_labels_do_not_overlap(tmp_path: Path, captured: dict[str, Figure]) -> None:
    # The widest label the demo draws, "EMA-norm α=0.1 N=16 V=1x", beside the best SMA's and the anneal's: the
    # synthetic run's EMA(0.2) is the early fork's best merge, renamed to it.
    run = build_run(tmp_path / "run")
    relabel(run, {("ema", "0.2"): ("ema-normalized", "0.1")})
    draw(run)
    fig = captured["fork_gains"]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    ax = fig.axes[0]
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) >= 5
    boxes = [t.get_window_extent(renderer) for t in labels]
    overlapping = [
        (a.get_text(), b.get_text())
        for (a, p), (b, q) in combinations(zip(labels, boxes), 2)
        if p.overlaps(q)
    ]
    assert not overlapping
    title = ax.get_title()
    assert any("EMA-norm" in t.get_text() for t in labels)
    assert "whole held-out set" in title and "error bars" in title  # an older run's rows: no split to name


def test_weightings_axis_is_zoomed_to_the_data(tmp_path: Path, captured: dict[str, Figure]) -> None:
    run = build_run(tmp_path / "run")
    draw(run)
    for ax in captured["weightings"].axes:
        ys = [y for line in ax.lines for y in line.get_ydata() if line.get_linestyle() == "None"]
        lo, hi = ax.get_ylim()
        # from the lowest to the highest error bar, 8% of that above and below: never pinned to the zero line
        bars = [y for c in ax.collections for segment in c.get_segments() for _, y in segment]
        low, high = min(bars + ys), max(bars + ys)
        pad = 0.08 * (high - low)
        assert max(ys) > min(ys) and (lo, hi) == pytest.approx((low - pad, high + pad), abs=1e-12)


def test_finding_4_verdict_needs_the_larger_alpha(tmp_path: Path) -> None:
    # EMA α=0.2 is best at the early fork here (its shorter window loses less to stale weights); swapping the two
    # α labels makes the best one the smaller α, which weights recent snapshots less: no agreement then.
    run = build_run(
        tmp_path / "f4", forks=FORKS[:1], weightings=[("ema", 0.1), ("ema", 0.2)], ns=(16,), vs=(1,)
    )
    write_report(run)
    assert "This run agrees with the paper's finding 4" in (run / "report.md").read_text()
    relabel(run, {("ema", "0.1"): ("ema", "0.2"), ("ema", "0.2"): ("ema", "0.1")})
    write_report(run)
    text = (run / "report.md").read_text()
    assert "does not agree with the paper's finding 4" in text
    assert "EMA α=0.1, the smaller α of those evaluated (0.1, 0.2)" in text


def test_headline_table_has_merge_minus_anneal(tmp_path: Path) -> None:
    run = build_run(tmp_path / "run", forks=FORKS[:1])
    write_report(run)
    text = (run / "report.md").read_text()
    table = text[text.index("## Headline") :]
    header = next(line for line in table.splitlines() if line.startswith("| model"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    k = cols.index("merge − anneal ± paired s.e.")
    rows = {r["label"]: r for r in read_rows(run)}
    anneal = next(float(r["val_loss"]) for r in rows.values() if r["model"] == "annealed")
    lines = [line for line in table.splitlines() if line.startswith("| best merge")]
    assert lines
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        gap = float(cells[k].split(" ")[0].replace("−", "-"))
        loss = float(cells[cols.index("loss ± s.e.")].split(" ")[0])
        assert abs(gap - (loss - anneal)) <= 2e-4, (gap, loss, anneal)
