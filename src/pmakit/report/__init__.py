"""The experiment report: reads RUN/experiment.json, results.csv, curves.csv; writes plots, report.md, report.html.

    from pmakit.report import write_report, summary_text
    paths = write_report(run_dir)      # RUN/plots/*.png, RUN/report.md, RUN/report.html
    print(summary_text(run_dir))       # one terminal screen

Which study's section a run gets: ``sections.SECTIONS``, keyed by experiment.json's ``study`` (pma.py for the PMA
study; a ``pmakit train`` run gets train_run.py). Parts of the PMA study's report: load.py (files -> rows),
analysis.py (rows -> numbers), plots.py (figures), document.py (content and captions); of every report:
markdown.py / html.py (two renderings of the same blocks), fmt.py (number formats), schema.py (the result columns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pmakit.errors import PmakitError
from pmakit.report import document
from pmakit.report.pma import PLOT_FILES, draw_figures
from pmakit.report.sections import section_of
from pmakit.runs import atomic_write_text

__all__ = ["PLOT_FILES", "ReportPaths", "draw_figures", "summary_text", "write_report"]


@dataclass(frozen=True)
class ReportPaths:
    """Where the report was written."""

    markdown: Path
    """RUN/report.md"""
    html: Path
    """RUN/report.html (self-contained)"""
    plots: list[Path] = field(default_factory=list)
    """RUN/plots/*.png that were drawn."""


def _check_dir(run_dir: Path) -> None:
    if not run_dir.is_dir():
        raise PmakitError(
            f"run directory {run_dir} does not exist (run `pmakit experiment -o {run_dir}` first)"
        )


def write_report(run_dir: str | Path) -> ReportPaths:
    """Write RUN/plots/*.png, RUN/report.md and RUN/report.html from the run's experiment outputs.

    Missing or partial inputs (no anneal rows, one fork, no curves) give a shorter report with notes, not an
    error; only a missing run directory is an error.
    """
    run_dir = Path(run_dir)
    _check_dir(run_dir)
    return _render(run_dir, *section_of(run_dir).build(run_dir))


def _render(run_dir: Path, blocks: list[document.Block], drawn: list[Path]) -> ReportPaths:
    """Write report.md and the self-contained report.html from the same blocks."""
    from pmakit.report import html, markdown

    md_path, html_path = run_dir / "report.md", run_dir / "report.html"
    atomic_write_text(md_path, markdown.render(blocks), fsync=False)
    atomic_write_text(html_path, html.render(blocks, run_dir), fsync=False)
    return ReportPaths(markdown=md_path, html=html_path, plots=drawn)


def summary_text(run_dir: str | Path) -> str:
    """The headline numbers and the report's paths, in one terminal screen (about 25 lines at most)."""
    run_dir = Path(run_dir)
    _check_dir(run_dir)
    return str(section_of(run_dir).summary(run_dir))
