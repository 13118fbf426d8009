"""Report section and figure of the loss plane and cross terms (paper findings 9 and 10, experiments E11, E12).

Reads RUN/plane.json (written by ``pmakit.lab.plane.loss_plane``, from ``pmakit experiment`` when
``experiment.plane_grid`` > 0, or by ``pmakit analyze``) and draws plots/loss_plane.png. Sentences that judge are
computed from the numbers in the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pmakit.report import fmt
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import read_json_object

PLANE_FILE = "plane.json"
PLOT_FILE = "loss_plane.png"


def read_plane(run_dir: Path) -> dict[str, Any] | None:
    """RUN/plane.json, or None when absent or unreadable."""
    data = read_json_object(run_dir / PLANE_FILE)
    return data if data is not None and data.get("kind") == "loss_plane" else None


def plot_plane(result: dict[str, Any], path: Path) -> Path:
    """Contour plot of the loss on the plane: snapshots as numbered dots, the SMA merge as a star."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from pmakit.report.plots import LATEST, MERGE, _save

    xs, ys, z = np.asarray(result["x"]), np.asarray(result["y"]), np.asarray(result["loss"])
    fig = Figure(figsize=(6.6, 5.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    # Equal loss steps (equal colour steps mean equal loss steps) up to the grid's 85th percentile; the few very
    # high losses at the corners share the top colour instead of flattening the basin into one.
    top = float(np.quantile(z, 0.85))
    levels = np.linspace(float(z.min()), top, 15) if top > z.min() else np.array([z.min(), z.min() + 1e-6])
    filled = ax.contourf(xs, ys, z, levels=levels, cmap="viridis", extend="max")
    ax.contour(xs, ys, z, levels=levels, colors="white", linewidths=0.4, alpha=0.6)
    fig.colorbar(filled, ax=ax, label="held-out loss (nats/token)", format="%.3f")
    snaps = result["snapshots"]
    sx, sy = [s["x"] for s in snaps], [s["y"] for s in snaps]
    ax.plot(sx, sy, color="white", lw=0.8, alpha=0.8, zorder=2)
    ax.scatter(sx, sy, s=90, c="white", edgecolors=LATEST, linewidths=1.0, zorder=3)
    for s in snaps:
        ax.annotate(str(s["index"]), (s["x"], s["y"]), ha="center", va="center", fontsize=7, zorder=4)
    m = result["merge"]
    ax.scatter([m["x"]], [m["y"]], marker="*", s=260, c=MERGE, edgecolors="white", linewidths=1.0, zorder=5)
    ax.set_xlabel("distance along u: oldest → newest snapshot (weight-space L2)")
    ax.set_ylabel("distance along v (orthogonal to u), towards the middle snapshot")
    x_extent, y_extent = np.ptp(xs), np.ptp(ys)
    if y_extent > 0 and 1 / 4 <= x_extent / y_extent <= 4:
        ax.set_aspect("equal")
    far = max(s["distance"] for s in snaps)
    ax.set_title(
        f"Loss on the plane of snapshots {snaps[result['anchors']['origin']]['index']}, "
        f"{snaps[result['anchors']['x']]['index']}, {snaps[result['anchors']['y']]['index']} "
        f"(★ SMA merge; off-plane ≤ {far:.3g})\n{plane_split(result)}",
        fontsize=9,
    )
    return _save(fig, path)


def plane_split(result: Mapping[str, Any]) -> str:
    """Where the plane's losses come from: few batches, so its numbers are not the tables'."""
    split = f"{result['split']} split" if result.get("split") else "held-out set"
    return f"{split}, {result['batches']} batches (a subset: its losses are not the tables')"


def _fmt_se(d: dict[str, Any], digits: int = 4) -> str:
    se = d.get("se")
    return f"{d['mean']:+.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """A short plain-text reading of a ``loss_plane`` result; every judgement is computed from its numbers."""
    snaps, merge = result["snapshots"], result["merge"]
    best = min(snaps, key=lambda s: s["loss"])
    grid_min = min(min(row) for row in result["loss"])
    lines = [
        f"Loss plane through snapshots {snaps[result['anchors']['origin']]['label']}, "
        f"{snaps[result['anchors']['x']]['label']}, {snaps[result['anchors']['y']]['label']} "
        f"({result['parameters']:,} parameters, {result['batches']} held-out batches, "
        f"{result['grid']}x{result['grid']} grid).",
        f"Window span (newest - oldest): {result['window_span']:.4g}; snapshots off the plane by at most "
        f"{max(s['distance'] for s in snaps):.4g}; the merge by {merge['distance']:.4g}.",
        f"Merge (SMA of {len(snaps)}): loss {merge['loss']:.4f}; best snapshot {best['label']}: {best['loss']:.4f}; "
        f"newest snapshot: {snaps[-1]['loss']:.4f}; lowest loss on the grid: {grid_min:.4f}.",
    ]
    lower = merge["loss"] < best["loss"]
    lines.append(
        "The merge is lower than every snapshot of the window."
        if lower
        else f"The merge is not lower than every snapshot (best snapshot {best['label']} is lower by "
        f"{merge['loss'] - best['loss']:.4f})."
    )
    e11 = result.get("e11")
    if e11:
        body = e11_lines(e11)
        lines += body[:1] + ["  " + line for line in body[1:]]
    return lines


def e11_lines(e11: Mapping[str, Any]) -> list[str]:
    """Finding 9 in words, from ``cross_terms``' numbers (first line the verdict, then the details)."""
    k, gap = e11["k"], e11["gap"]
    z = gap["mean"] / gap["se"] if gap.get("se") else None
    if z is None:
        ztext = " (no standard error: one batch)"
    elif abs(z) < 2:
        ztext = f" (within noise: {abs(z):.1f} s.e.)"
    else:
        ztext = f" ({abs(z):.1f} s.e. {'below' if z < 0 else 'above'} zero)"
    m, e = e11["merge_reference"], e11["end_reference"]
    holds = "holds" if e11["condition_holds"] else "does not hold"
    lines = [
        f"Finding 9 (k={k}): L(merge) - mean L(members) = {gap['mean']:+.4f}"
        + (f" ± {gap['se']:.4f}" if gap.get("se") else "")
        + f"{ztext}, so C - (k-1)D = {e11['invariant']['mean']:+.4g} and the condition C < (k-1)D {holds}.",
        f"Around the merge: D = {m['D']['mean']:.4g} (C = -D by construction, the deviations sum to zero); the "
        f"quadratic model predicts L(merge) - mean L(members) = {m['predicted_gap']['mean']:+.4f}, measured "
        f"{gap['mean']:+.4f}.",
    ]
    if e["ratio"] is not None:
        r = e["ratio"]
        if r < 0:
            kind = "negative: the deviations are complementary (negatively correlated in the H metric)"
        elif r < 1:
            kind = (
                "between 0 and 1: the deviations are positively correlated in the H metric, not complementary, "
                "but not fully aligned, so the condition holds"
            )
        else:
            kind = "at least 1: the deviations are aligned and the condition fails"
        lines.append(
            f"Around the newest snapshot: C = {e['C']['mean']:.4g}, (k-1)D = {(k - 1) * e['D']['mean']:.4g}, "
            f"C/((k-1)D) = {r:.2f}, {kind}."
        )
    step = e11.get("mean_step_cosine")
    if step is not None:
        trend = "steps persist (drift)" if step > 0 else "steps reverse (jitter)"
        lines.append(
            f"Euclidean cosines: successive steps {step:+.3f} on average, {trend}; deviations from the newest "
            f"snapshot {e['mean_cosine']:+.3f}."
        )
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Loading a run: model, batches, window


def blocks(run_dir: Path, figure: Path | None) -> list[Block]:
    """The section: what the plane shows, the E11 table, the figure. Empty when RUN/plane.json is absent."""
    result = read_plane(run_dir)
    if result is None:
        return []
    out: list[Block] = [
        Heading("Why the merge works: loss plane and cross terms (E11, E12)"),
        Paragraph(
            "The held-out loss on the 2-D plane through three snapshots of the merged window (oldest, newest, "
            "middle), with every snapshot of the window and the SMA merge projected onto it (Garipov et al. / "
            "Izmailov et al. style). Coordinates are Euclidean distances in weight space. The snapshots other than "
            "the three defining ones, and the merge, lie off the plane by the distance given in the table; their "
            f"loss is their own, not the plane's. Evaluated on {result['batches']} held-out batches."
        ),
    ]
    window = result.get("window", {})
    if isinstance(window, dict) and window.get("reason"):
        out.append(Paragraph(f"Window: {window['reason']}."))
    out += [_points_table(result), Bullets(summary_lines(result)[1:4])]
    e11 = result.get("e11")
    if isinstance(e11, dict):
        out += _cross_terms(e11)
    if figure is not None:
        out.append(
            FigureBlock(
                figure,
                "Loss on a plane through the window's snapshots",
                [
                    "Filled contours: held-out loss on the plane, in equal loss steps up to the grid's 85th "
                    "percentile (higher losses share the top colour). Numbered dots: the window's snapshots, oldest (1) to newest, projected onto the plane; "
                    "star: the SMA merge, projected. Axes in weight-space Euclidean distance.",
                    "Paper (finding 10): snapshots sit around a basin and their average lands near its centre.",
                    summary_lines(result)[3],
                ],
            )
        )
    return out


def _points_table(result: dict[str, Any]) -> Table:
    """Every snapshot of the window and the merge: plane coordinates, distance off the plane, loss."""
    span = float(result.get("window_span") or 1.0)

    def coord(v: float) -> str:
        return "0" if abs(v) < 1e-9 * span else f"{v:.4g}"  # float64 round-off of the defining points

    rows = [
        [str(s["index"]), fmt.tokens(s.get("tokens")), coord(s["x"]), coord(s["y"]), coord(s["distance"]),
         f"{s['loss']:.4f}"]
        for s in result["snapshots"]
    ]  # fmt: skip
    m = result["merge"]
    rows.append(["SMA merge", "", coord(m["x"]), coord(m["y"]), coord(m["distance"]), f"{m['loss']:.4f}"])
    return Table(["snapshot", "tokens", "x", "y", "off-plane", "loss"], rows, align="rrrrrr")


def _cross_terms(e11: dict[str, Any]) -> list[Block]:
    """Paper finding 9: C against (k-1)D around the merge and around the newest snapshot."""
    mr, er = e11["merge_reference"], e11["end_reference"]

    def signed(x: float | None) -> str:
        return "–" if x is None else f"{x:+.3f}"

    rows = [
        ["L(merge) − mean L(members)", _fmt_se(e11["gap"])],
        ["C − (k−1)D (any reference)", _fmt_se(e11["invariant"], 3)],
        ["D, reference merge", _fmt_se(mr["D"], 3)],
        ["quadratic prediction −D/(2k) of the gap, reference merge", _fmt_se(mr["predicted_gap"])],
        ["D, reference newest", _fmt_se(er["D"], 3)],
        ["C, reference newest", _fmt_se(er["C"], 3)],
        ["C / ((k−1)D), reference newest", "–" if er["ratio"] is None else f"{er['ratio']:.2f}"],
        ["mean cosine of deviations from the newest", signed(er["mean_cosine"])],
        ["mean cosine of successive steps", signed(e11["mean_step_cosine"])],
    ]
    return [
        Heading("Cross terms (paper finding 9)", 3),
        Paragraph(
            "With deviations d_i from a reference and Hessian H, the merge beats the mean of its k members iff "
            "C = Σ_{i≠j} d_iᵀHd_j < (k−1) D, D = Σ_i d_iᵀHd_i. For a quadratic loss C − (k−1)D = "
            "2k²·(L(merge) − mean L(members)) for any reference, so the gap below decides the condition. Each "
            "dᵀHd is a central second difference of held-out losses, L(ref+d) + L(ref−d) − 2L(ref): exact for "
            "a quadratic, the segment-averaged curvature otherwise. Reference 'merge': the SMA itself "
            "(Σd_i = 0, so C = −D by construction). Reference 'newest': the window's newest snapshot. "
            "Values are means ± s.e. over held-out batches."
        ),
        Table(["quantity", "value"], rows, align="lr"),
        Bullets(e11_lines(e11)),
    ]


def draw(run_dir: Path, path: Path) -> Path | None:
    """plots/loss_plane.png from RUN/plane.json; None when the run has no plane."""
    result = read_plane(run_dir)
    return None if result is None else plot_plane(result, path)
