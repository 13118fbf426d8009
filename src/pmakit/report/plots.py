"""The report's figures (matplotlib, Agg canvas, no pyplot: nothing global is touched in the caller's process).

Each function draws one PNG from analysed data and returns its path, or None when there is nothing to draw.
Colours are colour-blind safe (Okabe-Ito) and fixed per series across figures: latest black, merges by weighting
(SMA blue), anneal vermillion; fork points from light (early) to dark (late).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

from pmakit.report import fmt
from pmakit.report.analysis import (
    ForkSummary,
    Gain,
    split_note,
    sweep,
    weighting_key,
    weighting_label,
    weighting_rows,
    weighting_sort_key,
)
from pmakit.report.load import CurvePoint
from pmakit.runs import atomic_open

LATEST = "#000000"
ANNEAL = "#D55E00"
MERGE = "#0072B2"
WEIGHTING_COLORS = {
    "sma": MERGE,
    "wma": "#009E73",
    "ema@0.1": "#56B4E9",
    "ema@0.2": "#E69F00",
    "wsm-1sqrt": "#CC79A7",
    "wsm-linear": "#999999",
    "wsm-cosine": "#882255",
    "ema-normalized@0.1": "#44AA99",
    "ema-normalized@0.2": "#AA4499",
}
_SPARE = ("#332288", "#117733", "#DDCC77", "#661100", "#6699CC", "#888888")
DPI = 110


def weighting_color(key: str) -> str:
    """A fixed colour per weighting; unknown ones get a spare colour chosen by their name."""
    if key in WEIGHTING_COLORS:
        return WEIGHTING_COLORS[key]
    return _SPARE[sum(map(ord, key)) % len(_SPARE)]


def fork_colors(k: int) -> list[tuple[float, float, float, float]]:
    """k colours from light green (early fork) to dark purple (late fork), viridis being colour-blind safe."""
    from matplotlib import colormaps

    cmap = colormaps["viridis"]
    stops = [0.45] if k == 1 else list(np.linspace(0.78, 0.05, k))
    return [tuple(cmap(s)) for s in stops]


def _new(width: float, height: float, ncols: int = 1) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig: Figure, path: Path) -> Path:
    """Write to a temporary sibling and rename, so a reader never sees half a PNG."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb", fsync=False) as f:  # a figure is drawn again from the result files
        fig.savefig(f, dpi=DPI, format="png", facecolor="white")
    return path


def _token_axis(ax: Axes, axis: str = "x") -> None:
    formatter = FuncFormatter(lambda x, _: fmt.tokens(x) if x > 0 else "0")
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(formatter)


def _zero_line(ax: Axes) -> None:
    ax.axhline(0, color=LATEST, lw=1.0, ls="--", zorder=1)


def _zoom(ax: Axes, spans: Sequence[tuple[float, float]]) -> None:
    """The y axis from the lowest to the highest error bar, with a margin; the zero line (the latest snapshot)
    only when it falls inside."""
    if not spans:
        return
    lo, hi = min(s[0] for s in spans), max(s[1] for s in spans)
    pad = 0.08 * (hi - lo) or 0.01 * max(abs(lo), abs(hi), 1e-3)
    ax.set_ylim(lo - pad, hi + pad)
    if lo - pad < 0 < hi + pad:
        _zero_line(ax)


def _log2_axis(ax: Axes, values: Sequence[int], labels: Sequence[str]) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(list(values)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: dict(zip(values, labels)).get(round(x), "")))
    ax.xaxis.set_minor_locator(NullLocator())
    lo, hi = min(values), max(values)
    ax.set_xlim(lo / 2**0.35, hi * 2**0.35)


DELTA_LABEL = "Δ val loss vs latest (nats/token)\n< 0: better than the latest snapshot"


# --- (2) loss vs tokens ----------------------------------------------------------------------------------


def _series_style(name: str) -> tuple[str, str, float, str]:
    """(label, colour, line width, line style) of a curves.csv series."""
    if name == "latest":
        return "latest snapshot (constant LR)", LATEST, 1.4, "-"
    if name.startswith("merged"):
        parts = name.split(":")
        desc = " ".join(p.upper() if i == 0 else f"N={p}" for i, p in enumerate(parts[1:3]))
        return f"online merge ({desc})" if desc else "online merge", MERGE, 1.6, "-"
    if name.startswith("anneal"):
        return "anneal branches (LR → 0)", ANNEAL, 1.8, "-"
    return name, "#999999", 1.0, ":"


def plot_curves(
    curves: dict[str, list[CurvePoint]],
    forks: Sequence[ForkSummary],
    path: Path,
    *,
    online_batches: int | None = None,
) -> Path | None:
    """Validation loss vs tokens. Left: the online evaluations during training (the constant-LR run, its online
    merge, each anneal branch; forks marked). Right, one small panel per fork: the three models each fork's table
    compares at F + D (latest, best merge, anneal), with exactly the table's numbers.

    The two sides are kept apart on purpose: the online evaluations use fewer held-out batches (``online_batches``)
    than the final ones (the split and batch count of the fork's rows, named in each panel), so an online curve and a final number for the same model and tokens
    differ by sampling noise, and one axis holding both would contradict the tables.
    """
    if not curves:
        return None  # the fork panels alone would repeat the gains figure
    marked = [f for f in forks if f.eval_tokens and _fork_marks(f)]
    ratios = [3.0] + [1.0] * len(marked)
    fig = Figure(figsize=(8.0 + 2.6 * len(marked), 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, len(ratios), squeeze=False, width_ratios=ratios)[0])
    _online_panel(axes.pop(0), curves, forks, online_batches)
    for i, (ax, f) in enumerate(zip(axes, marked), start=1):
        _fork_panel(ax, f, forks.index(f) + 1, first=i == 1)
    return _save(fig, path)


def _online_panel(
    ax: Axes, curves: dict[str, list[CurvePoint]], forks: Sequence[ForkSummary], batches: int | None
) -> None:
    order = sorted(curves, key=lambda s: (not s.startswith("anneal"), s != "latest", s))
    seen: set[str] = set()
    for name in order:
        pts = curves[name]
        label, color, lw, ls = _series_style(name)
        marker = "o" if len(pts) <= 2 else None
        ax.plot(
            [p.tokens for p in pts],
            [p.val_loss for p in pts],
            color=color,
            lw=lw,
            ls=ls,
            marker=marker,
            ms=3,
            label=None if label in seen else label,
        )
        seen.add(label)
    for i, f in enumerate(forks, start=1):
        ax.axvline(f.fork_tokens, color="#666666", lw=0.9, ls=":", zorder=0)
        ax.annotate(
            f"F{i}",
            (f.fork_tokens, 0.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, 4),
            textcoords="offset points",
            fontsize=9,
            color="#444444",
        )
    _token_axis(ax)
    ax.set_xlabel("training tokens")
    ax.grid(alpha=0.3)
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    on = f" on {batches} batches" if batches else ""
    ax.set_title(f"online evaluations during training{on} (log axis)", fontsize=10)
    ax.legend(loc="upper right", fontsize=9, framealpha=0.9)


FORK_MARKS = (
    ("latest", "o", 7, LATEST, "latest"),
    ("best_merge", "*", 15, MERGE, "best merge"),
    ("annealed", "D", 7, ANNEAL, "anneal"),
)
"""What each fork's panel shows: (ForkSummary attribute, marker, size, colour, label)."""


def _fork_marks(fork: ForkSummary) -> list[tuple[str, str, int, str, float]]:
    """(label, marker, size, colour, val_loss) of the models a fork's table compares at F + D."""
    out = []
    for attr, marker, size, color, label in FORK_MARKS:
        row = getattr(fork, attr)
        if row is not None and row.val_loss is not None:
            out.append((label, marker, size, color, row.val_loss))
    return out


def _fork_panel(ax: Axes, fork: ForkSummary, index: int, *, first: bool) -> None:
    """One fork's three models at F + D: a marker and its value each, as the tables print it."""
    marks = _fork_marks(fork)
    for x, (label, marker, size, color, loss) in enumerate(marks):
        ax.plot([x], [loss], marker=marker, ms=size, color=color, mec="white", ls="none", label=label)
        ax.annotate(
            fmt.loss(loss),
            (x, loss),
            xytext=(0, 9),
            textcoords="offset points",
            ha="center",
            fontsize=8,
            color=color,
        )
    ax.set_xticks(range(len(marks)), [m[0] for m in marks], fontsize=8)
    ax.set_xlim(-0.6, len(marks) - 0.4)
    losses = [m[4] for m in marks]
    pad = 0.25 * (max(losses) - min(losses)) or 0.01
    ax.set_ylim(min(losses) - pad, max(losses) + 1.4 * pad)
    ax.grid(alpha=0.3, axis="y")
    split = split_note(getattr(fork, attr) for attr, *_ in FORK_MARKS)
    ax.set_title(
        f"F{index} at F + D = {fmt.tokens(fork.eval_tokens)}\n(the tables' numbers:\n{split})", fontsize=9
    )
    if first:
        ax.set_ylabel("final validation loss (nats/token)")


# --- (1)/(6) gains at each fork --------------------------------------------------------------------------


def _fork_names(forks: Sequence[ForkSummary]) -> list[str]:
    return [
        f"F{i}: fork {fmt.tokens(f.fork_tokens)}\neval {fmt.tokens(f.eval_tokens)}"
        for i, f in enumerate(forks, start=1)
    ]


_GainBar = tuple[int, str, str, str, float, float | None]  # fork idx, kind, colour, note, Δ, se


def _fork_gain_bars(forks: Sequence[ForkSummary], base: int | None) -> list[_GainBar]:
    """One bar per fork and candidate (best SMA, best other merge, anneal) that has a gain over the latest."""
    bars: list[_GainBar] = []
    for i, f in enumerate(forks):
        candidates = [("best SMA", f.best_sma)]
        if f.best_merge is not None and f.best_merge.method != "sma":
            candidates.append(("best merge", f.best_merge))
        candidates.append(("annealed", f.annealed))
        for kind, row in candidates:
            g = f.gain(row)
            if row is None or g is None:
                continue
            if kind == "annealed":
                color, note = ANNEAL, "anneal"
            else:
                color = weighting_color(weighting_key(row))
                # one short word per line: side by side, two bars' labels must fit in a bar's spacing
                note = "\n".join(
                    [
                        *weighting_label(weighting_key(row)).split(" "),
                        f"N={row.n}",
                        f"V={fmt.interval(row.v_tokens, base)}",
                    ]
                )
            bars.append((i, kind, color, note, -g.value, g.se))
    return bars


def _fork_gain_legend(ax: Axes, kinds: set[str]) -> None:
    """A legend entry for each kind of bar that is drawn."""
    from matplotlib.patches import Patch

    legend = [
        Patch(facecolor=MERGE, edgecolor="black", label="best SMA merge"),
        Patch(facecolor="white", edgecolor="black", hatch="//", label="best merge, other weighting"),
        Patch(facecolor=ANNEAL, edgecolor="black", label="annealed branch"),
    ]
    shown = [h for h, kind in zip(legend, ("best SMA", "best merge", "annealed")) if kind in kinds]
    ax.legend(handles=shown, loc="best", fontsize=9)


def plot_fork_gains(forks: Sequence[ForkSummary], base: int | None, path: Path) -> Path | None:
    """At each fork: best SMA, best merge of any weighting (when it is not SMA) and the anneal, Δ ± paired s.e."""
    bars = _fork_gain_bars(forks, base)
    if not bars:
        return None
    fig, (ax,) = _new(max(7.0, 3.4 * len(forks) + 1.5), 5.2)
    width = 0.26
    for i in range(len(forks)):
        group = [b for b in bars if b[0] == i]
        for j, (_, kind, color, note, delta, se) in enumerate(group):
            x = i + (j - (len(group) - 1) / 2) * width * 1.1
            ax.bar(
                x,
                delta,
                width,
                color=color,
                yerr=se,
                capsize=4,
                edgecolor="black",
                lw=0.5,
                hatch="//" if kind == "best merge" else None,
            )
            tip = delta - (se or 0.0) if delta < 0 else delta + (se or 0.0)  # below the error bar
            ax.annotate(
                note,
                (x, tip),
                xytext=(0, -3 if delta < 0 else 3),
                textcoords="offset points",
                ha="center",
                va="top" if delta < 0 else "bottom",
                fontsize=7.5,
            )
    _zero_line(ax)
    ax.set_xticks(range(len(forks)), _fork_names(forks))
    ax.set_xlim(-0.75, len(forks) - 0.25)
    ax.set_ylabel(DELTA_LABEL)
    ax.margins(y=0.25)
    ax.grid(axis="y", alpha=0.3)
    _fork_gain_legend(ax, {b[1] for b in bars})
    split = split_note(r for f in forks for r in (f.latest, f.best_sma, f.best_merge, f.annealed))
    ax.set_title(
        "Gain over the latest snapshot at each fork\n"
        f"({split}; merges chosen on the selection split; error bars: paired s.e.)",
        fontsize=11,
    )
    return _save(fig, path)


# --- (3) N x V heat map ----------------------------------------------------------------------------------


def plot_heatmaps(
    forks: Sequence[ForkSummary], base: int | None, path: Path, method: str = "sma"
) -> Path | None:
    """One N x V panel of Δ vs latest per fork, for one weighting; cells: Δ and its z-score."""
    panels = []
    for i, f in enumerate(forks, start=1):
        cells: dict[tuple[int, int], Gain] = {}
        for r in f.merges:
            g = f.gain(r)
            if r.method == method and r.n and r.v_tokens and g is not None:
                cells[(r.n, r.v_tokens)] = g
        if cells:
            panels.append((i, f, cells))
    if not panels:
        return None
    fig, axes = _new(4.6 * len(panels) + 0.6, 4.2, len(panels))
    for ax, (i, f, cells) in zip(axes, panels):
        ns = sorted({k[0] for k in cells})
        vs = sorted({k[1] for k in cells})
        grid = np.full((len(ns), len(vs)), np.nan)
        for (n, v), g in cells.items():
            grid[ns.index(n), vs.index(v)] = -g.value
        extent = float(np.nanmax(np.abs(grid))) or 1e-9
        norm = TwoSlopeNorm(vcenter=0.0, vmin=-extent, vmax=extent)
        ax.set_facecolor("#DDDDDD")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap="RdBu_r", norm=norm, aspect="auto", origin="lower")
        for (n, v), g in cells.items():
            y, x = ns.index(n), vs.index(v)
            delta = -g.value
            text = fmt.signed(delta) + (f"\nz = {-g.z:+.1f}" if g.z is not None else "")
            dark = abs(delta) > 0.6 * extent
            ax.text(x, y, text, ha="center", va="center", fontsize=8.5, color="white" if dark else "black")
        for y, n in enumerate(ns):
            for x, v in enumerate(vs):
                if (n, v) not in cells:
                    ax.text(x, y, "not run", ha="center", va="center", fontsize=8, color="#555555")
        ax.set_xticks(range(len(vs)), [f"{fmt.interval(v, base)}\n({fmt.tokens(v)})" for v in vs])
        ax.set_yticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel("interval V between merged snapshots")
        ax.set_ylabel("N snapshots merged")
        final = " (final fork)" if f is forks[-1] else ""
        ax.set_title(f"F{i}{final}: eval at {fmt.tokens(f.eval_tokens)}", fontsize=10)
        bar = fig.colorbar(im, ax=ax, shrink=0.85)
        bar.set_label("Δ val loss vs latest (< 0 better)", fontsize=8)
    _weighting_title(fig, forks, method, "Δ vs the latest snapshot over N and V (blue = better)")
    return _save(fig, path)


def _weighting_title(
    fig: Figure, forks: Sequence[ForkSummary], method: str, what: str, note: str = ""
) -> None:
    """The title of a figure of one weighting's merges: the weighting, and the split its rows were scored on."""
    split = split_note(
        r for f in forks for r in [f.latest, *f.merges] if r is None or r.method in ("", method)
    )
    fig.suptitle(f"{weighting_label(method)} merges: {what}\n({split}{note})", fontsize=11)


# --- (4) weightings side by side -------------------------------------------------------------------------


def plot_weightings(forks: Sequence[ForkSummary], v: int | None, base: int | None, path: Path) -> Path | None:
    """Per fork, grouped by N: one bar per weighting at interval ``v``, Δ vs latest ± paired s.e."""
    panels = []
    for i, f in enumerate(forks, start=1):
        rows = weighting_rows(f, v)
        if rows:
            panels.append((i, f, rows))
    keys = sorted({weighting_key(r) for _, _, rows in panels for r in rows}, key=weighting_sort_key)
    if not panels or len(keys) < 2:
        return None
    fig, axes = _new(max(6.0, 5.2 * len(panels)), 4.6, len(panels))
    width = 0.8 / len(keys)
    for ax, (i, f, rows) in zip(axes, panels):
        spans: list[tuple[float, float]] = []
        ns = sorted({r.n for r in rows if r.n})
        for k, key in enumerate(keys):
            xs, ys, es = [], [], []
            for r in rows:
                g = f.gain(r)
                if weighting_key(r) == key and r.n in ns and g is not None:
                    xs.append(ns.index(r.n) + (k - (len(keys) - 1) / 2) * width)
                    ys.append(-g.value)
                    es.append(g.se if g.se is not None else 0.0)
            # points, not bars: the axis is zoomed to the data (gaps of a few s.e. between weightings are
            # invisible on an axis from 0), and a bar cut off by the axis would misstate its length
            ax.errorbar(
                xs,
                ys,
                yerr=es,
                fmt="o",
                ms=6,
                capsize=3,
                color=weighting_color(key),
                mec="black",
                mew=0.4,
                label=weighting_label(key),
                elinewidth=0.9,
            )
            spans += [(y - e, y + e) for y, e in zip(ys, es)]
        _zoom(ax, spans)
        ax.set_xticks(range(len(ns)), [f"N={n}" for n in ns])
        ax.set_title(f"F{i}: fork {fmt.tokens(f.fork_tokens)}, eval {fmt.tokens(f.eval_tokens)}", fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(DELTA_LABEL)
    fig.legend(
        *axes[0].get_legend_handles_labels(),
        loc="outside lower center",
        ncols=min(len(keys), 7),
        fontsize=9,
        frameon=False,
    )
    split = split_note(r for _, f, rows in panels for r in [f.latest, *rows])
    fig.suptitle(
        f"Weightings side by side at V = {fmt.interval(v, base)}\n({split}; error bars: paired s.e.; the axis is "
        "zoomed to the data)",
        fontsize=11,
    )
    return _save(fig, path)


# --- (5) N and V sweeps ----------------------------------------------------------------------------------


def plot_sweeps(
    forks: Sequence[ForkSummary],
    *,
    v_fixed: int | None,
    n_fixed: int | None,
    base: int | None,
    path: Path,
    method: str = "sma",
) -> Path | None:
    """Left: Δ vs N at V = v_fixed; right: Δ vs V at N = n_fixed; one line per fork."""
    colors = fork_colors(len(forks))
    specs = [
        ("N", v_fixed, lambda f: sweep(f, method=method, v=v_fixed) if v_fixed else []),
        ("V", n_fixed, lambda f: sweep(f, method=method, n=n_fixed) if n_fixed else []),
    ]
    data = [(axis, fixed, [(f, c, get(f)) for f, c in zip(forks, colors)]) for axis, fixed, get in specs]
    data = [d for d in data if any(len(pts) >= 2 for _, _, pts in d[2])]
    if not data:
        return None
    fig, axes = _new(5.6 * len(data), 4.4, len(data))
    for ax, (axis, fixed, lines) in zip(axes, data):
        xs_all: set[int] = set()
        for i, (f, color, pts) in enumerate(lines, start=1):
            if not pts:
                continue
            xs = [x for x, _ in pts]
            xs_all.update(xs)
            ys = [-g.value for _, g in pts]
            es = [g.se if g.se is not None else 0.0 for _, g in pts]
            final = ", final" if f is forks[-1] else ""
            ax.errorbar(
                xs,
                ys,
                yerr=es,
                color=color,
                marker="o",
                ms=5,
                lw=1.8,
                capsize=3,
                label=f"F{i}: fork {fmt.tokens(f.fork_tokens)}{final}",
            )
        _zero_line(ax)
        ticks = sorted(xs_all)
        if axis == "N":
            _log2_axis(ax, ticks, [str(t) for t in ticks])
            ax.set_xlabel("N snapshots merged (log scale)")
            ax.set_title(f"N sweep at V = {fmt.interval(fixed, base)}", fontsize=10)
        else:
            _log2_axis(ax, ticks, [fmt.interval(t, base) for t in ticks])
            ax.set_xlabel("interval V between merged snapshots (log scale)")
            ax.set_title(f"V sweep at N = {fixed}", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9)
    axes[0].set_ylabel(DELTA_LABEL)
    _weighting_title(fig, forks, method, "how N and V change the gain", "; error bars: paired s.e.")
    return _save(fig, path)
