"""The PMA study's report (the moe study's too): its tables, figures and terminal summary, from RUN/experiment.json,
results.csv and curves.csv (``pmakit.report.load``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pmakit.report import document, fmt
from pmakit.report.analysis import (
    ForkSummary,
    base_interval,
    n_for_v_sweep,
    stable_points,
    summarize_forks,
    v_for_n_sweep,
    v_for_weightings,
    verdict,
)
from pmakit.report.blocks import Block
from pmakit.report.load import RunData, load_run

log = logging.getLogger(__name__)

PLOT_FILES = {
    "curves": "loss_vs_tokens.png",
    "fork_gains": "fork_gains.png",
    "heatmap": "sma_n_by_v.png",
    "weightings": "weightings.png",
    "sweeps": "n_v_sweeps.png",
    "plane": "loss_plane.png",
    "spectrum": "spectrum.png",
}


def draw_figures(data: RunData, forks: list[ForkSummary], base: int | None) -> document.Figures:
    """Draw every plot the data allows; a failing plot becomes a note, never a failed report."""
    figs = document.Figures()
    out = data.run_dir / "plots"
    try:
        from pmakit.report import plane, plots, spectrum
    except ImportError as e:
        figs.failures.append(f"matplotlib is not available ({e}); install `pmakit[report]` for the plots.")
        return figs
    config = data.experiment.get("config") or {}
    online = (config.get("train") or {}).get("eval_batches")
    figs.weightings_v = v_for_weightings(forks)
    figs.sweep_v, figs.sweep_n = v_for_n_sweep(forks), n_for_v_sweep(forks)
    # the headline's models (test split, chosen on selection) where the figure shows the tables' numbers; the
    # grid figures (heatmap, weightings, sweeps) describe the selection split
    heads = [f.headline for f in forks]
    jobs = {
        "curves": lambda p: plots.plot_curves(data.curves, heads, p, online_batches=online),
        "fork_gains": lambda p: plots.plot_fork_gains(heads, base, p),
        "heatmap": lambda p: plots.plot_heatmaps(forks, base, p),
        "weightings": lambda p: plots.plot_weightings(forks, figs.weightings_v, base, p),
        "sweeps": lambda p: plots.plot_sweeps(
            forks, v_fixed=figs.sweep_v, n_fixed=figs.sweep_n, base=base, path=p
        ),
        "plane": lambda p: plane.draw(data.run_dir, p),
        "spectrum": lambda p: spectrum.draw(data.run_dir, p),
    }
    for name, job in jobs.items():
        path = out / PLOT_FILES[name]
        try:
            drawn = job(path)
        except Exception as e:  # a plot must not take the tables down with it
            log.warning("report: the %s plot failed: %s", name, e, exc_info=True)
            figs.failures.append(f"The {name} plot could not be drawn ({e.__class__.__name__}: {e}).")
            drawn = None
        if drawn is None:
            path.unlink(missing_ok=True)  # no stale plot from an earlier run
        else:
            setattr(figs, name, drawn.relative_to(data.run_dir))
    return figs


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The report's blocks and the plots drawn."""
    data = load_run(run_dir)
    forks = summarize_forks(data)
    base = base_interval(data)
    figs = draw_figures(data, forks, base)
    blocks = document.build(data, forks, stable_points(data), figs, base)
    drawn = [
        run_dir / p
        for p in (
            figs.curves,
            figs.fork_gains,
            figs.heatmap,
            figs.weightings,
            figs.sweeps,
            figs.plane,
            figs.spectrum,
        )
        if p
    ]
    return blocks, drawn


def _row_line(name: str, loss: str, delta: str, z: str, width: int = 38) -> str:
    return f"  {name:<{width}} {loss:>17}  {delta:>17}  {z:>6}"


def _headline_rows(f: ForkSummary, base: int | None) -> list[str]:
    """The final fork's models as summary lines: latest, chosen merges, fixed recipe, tuned merge, anneal."""
    shown = [
        ("latest snapshot", f.latest),
        ("best merge: " + document.describe(f.best_merge, base), f.best_merge),
    ]
    if f.best_sma is not None and f.best_sma is not f.best_merge:
        shown.append(("best SMA: " + document.describe(f.best_sma, base), f.best_sma))
    for role, name in (("fixed", "fixed recipe: "), ("tuned", "tuned: ")):
        row = f.role(role)
        if row is not None:
            # the tuned label names its window; how many trials it beat is in the report, not this line
            label = document.describe(row, base) if role == "fixed" else row.label.split(" (best of ")[0]
            shown.append((name + label, row))
    shown.append(("annealed branch", f.annealed))
    width = max(38, *(len(name) for name, _ in shown))  # a label is never cut
    lines = [_row_line("model", "val loss ± s.e.", "Δ vs latest ± s.e.", "Δ/s.e.", width)]
    for name, row in shown:
        if row is None:
            lines.append(_row_line(name, "not in results", "", "", width))
            continue
        g = None if row is f.latest else f.gain(row)
        lines.append(
            _row_line(
                name,
                fmt.loss_se(row.val_loss, row.val_loss_se),
                document.delta_text(g),
                document.z_text(g),
                width,
            )
        )
    return lines


def _forks_summary(forks: list[ForkSummary], base: int | None) -> list[str]:
    """The final fork's headline and verdict, then the best merge at each of the last six forks."""
    lines: list[str] = []
    f = forks[-1].headline
    split = "test split; merges chosen on the selection split" if forks[-1].test else "one held-out split"
    lines.append(
        f"Final fork F{len(forks)}: forked at {fmt.tokens(f.fork_tokens)}, anneal {fmt.tokens(f.anneal_tokens)}, "
        f"evaluated at {fmt.tokens(f.eval_tokens)} tokens ({split})"
    )
    lines += _headline_rows(f, base)
    g_best = f.gain(f.best_merge)
    if g_best is not None:
        lines.append("  " + verdict(g_best.z, "The best merge") + ".")
    rec = f.recovered(f.best_merge)
    if rec is not None:
        lines.append(
            f"  It recovers {document.recovered_text(rec)} of the anneal's gain over the latest snapshot."
        )
    elif f.annealed is None:
        lines.append("  No annealed branch in the results: nothing to compare the merge with.")
    if len(forks) > 1:
        lines.append("Each fork: best merge Δ ± s.e. (Δ/s.e.), share of the anneal's gain recovered")
        for i, fk in enumerate((f.headline for f in forks[-6:]), start=len(forks) - min(6, len(forks)) + 1):
            g = fk.gain(fk.best_merge)
            lines.append(
                f"  F{i} at {fmt.tokens(fk.fork_tokens):>7}: {document.delta_text(g)} ({document.z_text(g)}), "
                f"recovered {document.recovered_cell(fk, fk.best_merge)}"
            )
    return lines


def summary(run_dir: Path) -> str:
    """The headline numbers and the report's paths, in one terminal screen (about 25 lines at most)."""
    data = load_run(run_dir)
    base = base_interval(data)
    forks = summarize_forks(data)
    exp = data.experiment
    total = exp.get("seconds", {}).get("total") if isinstance(exp.get("seconds"), dict) else None
    head = f"PMA experiment: {run_dir}"
    extras = [f"preset {exp['preset']}" if isinstance(exp.get("preset"), str) else ""]
    extras.append(f"total {fmt.seconds(total)}" if isinstance(total, int | float) else "")
    lines = [head + (f" ({', '.join(e for e in extras if e)})" if any(extras) else "")]
    if forks:
        lines += _forks_summary(forks, base)
    elif data.rows:
        lines.append("No fork comparison in results.csv.")
    for note in data.notes[:3]:
        lines.append(f"Note: {note}")
    md, page = run_dir / "report.md", run_dir / "report.html"
    if page.is_file():
        lines.append(f"Report: {page}")
        lines.append(f"        {md}")
    else:
        lines.append(f"Report: not written yet ({page})")
    pngs = sorted((run_dir / "plots").glob("*.png")) if (run_dir / "plots").is_dir() else []
    if pngs:
        lines.append(f"Plots:  {run_dir / 'plots'}/ ({len(pngs)} figures, embedded in the HTML report)")
    lines += _merged_lines(run_dir / "merged")
    return "\n".join(lines)


def _merged_lines(merged: Path) -> list[str]:
    """Where the headline merge is, and how to load it: the last thing a study's user needs."""
    try:
        manifest = json.loads((merged / "pmakit-merge.json").read_text())
    except (OSError, ValueError):
        return []  # not written (no fork, or the merge failed: the report says why)
    what = manifest.get("experiment_row") if isinstance(manifest, dict) else None
    return [
        f"Merged: {merged}/" + (f" ({what})" if isinstance(what, str) else ""),
        f"        loads with AutoModelForCausalLM.from_pretrained({str(merged)!r})",
    ]
