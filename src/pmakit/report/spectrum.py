"""Report section and figure of the trajectory's power spectrum with the merge windows' transfer functions.

Reads RUN/spectrum.json (written by ``pmakit.lab.spectrum``) and draws plots/spectrum.png. The sentences are
computed from the file's numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pmakit.report.blocks import Block, FigureBlock, Heading, Paragraph
from pmakit.runs import read_json_object

SPECTRUM_FILE = "spectrum.json"
PLOT_FILE = "spectrum.png"
COLORS = ("#0072B2", "#E69F00", "#CC79A7")


def read_spectrum(run_dir: Path) -> dict[str, Any] | None:
    """RUN/spectrum.json, or None when absent or unreadable."""
    data = read_json_object(run_dir / SPECTRUM_FILE)
    return data if data is not None and isinstance(data.get("filters"), dict) else None


def draw(run_dir: Path, path: Path) -> Path | None:
    """plots/spectrum.png: power per frequency (log-log, left axis) and each window's |H(f)|² (right axis)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import NullFormatter

    from pmakit.report.plots import LATEST, _save

    data = read_spectrum(run_dir)
    if data is None:
        return None
    f, p = np.asarray(data["frequencies"]), np.asarray(data["power"])
    keep = f > 0
    fig = Figure(figsize=(7.2, 4.4), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.loglog(f[keep], p[keep], color=LATEST, lw=1.2, label="trajectory power")
    ax.set_xlabel("frequency (cycles per snapshot interval)")
    ax.set_ylabel("power of the projected weights")
    ax.grid(alpha=0.3, which="both")
    twin = ax.twinx()
    for color, (label, filt) in zip(COLORS, data["filters"].items()):
        twin.semilogx(f[keep], np.asarray(filt["gain"])[keep], color=color, lw=1.4, ls="--", label=label)
    twin.set_ylabel("window gain |H(f)|²")
    for axis in (ax.xaxis, twin.xaxis):  # decade labels only: minor labels of a short range overlap
        axis.set_minor_formatter(NullFormatter())
    twin.set_ylim(0, 1.05)
    lines = [*ax.get_lines(), *twin.get_lines()]
    ax.legend(handles=lines, labels=[str(line.get_label()) for line in lines], fontsize=8, loc="lower left")
    return _save(fig, path)


def blocks(run_dir: Path, figure: Path | None) -> list[Block]:
    """The section: what the spectrum shows and how much of its power each window removes."""
    data = read_spectrum(run_dir)
    if data is None:
        return []
    f, p = np.asarray(data["frequencies"]), np.asarray(data["power"])
    keep = f > 0
    low = float(p[keep][: max(1, keep.sum() // 10)].sum() / p[keep].sum()) if p[keep].sum() > 0 else 0.0
    removed = [
        f"{label} removes {100 * filt['removed_power']:.0f}%"
        for label, filt in data["filters"].items()
        if filt.get("removed_power") is not None
    ]
    n = len(data.get("snapshots", []))
    text = (
        f"The {n} stable-phase snapshots projected on {data.get('directions')} random directions, as time series "
        "sampled once per snapshot interval: their power spectrum (solid) and the gain of each merge window "
        "(dashed; a merge is a linear filter of the series). The paper's reading: a slow drift (low frequencies) "
        "plus fast jitter (a flat floor at high frequencies); a window that cuts the floor and keeps the drift "
        f"averages the jitter out. The lowest tenth of the frequencies holds {100 * low:.0f}% of the power. Of the "
        "power above zero frequency, " + "; ".join(removed) + "."
    )
    out: list[Block] = [
        Heading("The trajectory as a signal: power spectrum and merge windows"),
        Paragraph(text),
    ]
    if figure is not None:
        caption = [
            "Solid: the trajectory's power (left axis); dashed: each window's gain |H(f)|² (right axis)."
        ]
        out.append(FigureBlock(figure, "Power spectrum of the snapshot trajectory", caption))
    return out
