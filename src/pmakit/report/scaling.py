"""Scaling laws from merges: the fits, their plot, and the report of the ``scaling`` study.

Two users: ``pmakit scaling-fit RESULTS...`` (``fit_files``: any results file, e.g. a user's own runs) and the
report of ``pmakit experiment --preset scaling`` (``build``/``summary``), which reads RUN/results.jsonl and
RUN/experiment.json only (never the lab code), fits the merges and the anneals separately with the largest size
held out, and writes RUN/scaling_fit.json beside the report.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.report import fmt
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.report.scaling_fit import KINDS, PARAMS, Floor, Point, StudyFit, fit_study, read_points, to_json
from pmakit.runs import RESULTS, atomic_write_text, read_jsonl

STUDY = "scaling"
FIT_JSON = "scaling_fit.json"
FIT_PLOT = "scaling_fit.png"
TOLERANCE = 0.01  # the bar: the held-out size's annealed loss predicted within 1% relative


@dataclass(frozen=True)
class FitOutput:
    """What ``fit_files`` wrote."""

    study: StudyFit
    """The fits and the held-out predictions."""
    json_path: Path
    """OUT/scaling_fit.json"""
    plot_path: Path | None
    """OUT/scaling_fit.png (None when matplotlib is missing)."""


def study_settings(paths: Sequence[Path]) -> dict[str, Any]:
    """The fit settings (``holdout``, ``bootstrap``) of the study whose results file is ``paths``' only one: a
    refit of a study's results.jsonl then reproduces the study's own intervals, not 400 refits against its 20."""
    if len(paths) != 1:
        return {}
    try:
        exp = json.loads((Path(paths[0]).parent / "experiment.json").read_text())
        cfg = exp["config"][STUDY]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {k: cfg[k] for k in ("holdout", "bootstrap") if isinstance(cfg, Mapping) and k in cfg}


def fit_files(
    paths: Sequence[Path],
    out: Path,
    *,
    holdout: str | None = None,
    bootstrap: int | None = None,
    seed: int = 0,
) -> FitOutput:
    """``pmakit scaling-fit``: fit the merge and anneal points of ``paths``; write OUT/scaling_fit.json and .png.

    ``holdout`` and ``bootstrap`` default to the study's own (a study's results file) else ``largest`` and 400."""
    if out.exists() and not out.is_dir():  # before minutes of fitting, not after
        raise PmakitError(f"{out}: exists and is not a directory (-o names the directory to write)")
    points = read_points(paths)
    own = study_settings(paths)
    holdout = holdout or str(own.get("holdout", "largest"))
    bootstrap = int(own.get("bootstrap", 400)) if bootstrap is None else bootstrap
    if bootstrap < 0:
        raise PmakitError("--bootstrap must be 0 or more")
    study = fit_study(points, holdout=holdout, bootstrap=bootstrap, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        **to_json(study),
        "inputs": [str(p) for p in paths],
        "holdout": holdout,
        "bootstrap": bootstrap,
        "bootstrap_seed": seed,
    }
    json_path = out / FIT_JSON
    atomic_write_text(json_path, json.dumps(record, indent=1) + "\n")
    try:
        plot_path: Path | None = plot(points, study, out / FIT_PLOT)
    except ImportError:
        plot_path = None
    return FitOutput(study, json_path, plot_path)


# --------------------------------------------------------------------------------------------------- text


def _num(x: float) -> str:
    """Four significant digits, scientific when large (A and B span orders of magnitude)."""
    return f"{x:.4g}"


def _interval(lo: float | None, hi: float | None, form: str = ".4g") -> str:
    """``[lo, hi]``, or ``[no interval]`` without bootstrap refits (NaN in memory, null in scaling_fit.json)."""
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "[no interval]"
    return f"[{lo:{form}}, {hi:{form}}]"


def params_rows(study: StudyFit) -> list[list[str]]:
    """One row per fit: each parameter with its 95% bootstrap interval."""
    rows = []
    for kind, f in study.fits.items():
        cells = [kind, str(f.points)]
        for name in PARAMS:
            cells.append(f"{_num(getattr(f.law, name))} {_interval(*f.ci95[name])}")
        cells.append(f"{f.rms_log_residual:.2%}")
        rows.append(cells)
    return rows


PARAMS_HEADER = ["fit on", "points", *(f"{p} [95% CI]" for p in PARAMS), "rms residual"]


def prediction_rows(study: StudyFit) -> list[list[str]]:
    """The held-out size: measured annealed loss, each fit's prediction with its interval and relative error."""
    rows = []
    for p in study.predictions:
        cells = [fmt.tokens(p.d), fmt.loss(p.anneal), fmt.loss(p.merge)]
        for kind in KINDS:
            if kind not in p.predicted:
                cells += [fmt.MISSING, fmt.MISSING]
                continue
            cells.append(f"{p.predicted[kind]:.4f} {_interval(*p.interval[kind], form='.4f')}")
            err = p.rel_error[kind]
            cells.append(fmt.MISSING if err is None else f"{err:+.2%}")
        rows.append(cells)
    return rows


def backtest_rows(study: StudyFit) -> list[list[str]]:
    """The backtest: each fitted size (fourth smallest on) predicted by the laws fitted on the smaller sizes alone."""
    rows = []
    for p in study.backtest:
        cells = [fmt.tokens(p.n), fmt.tokens(p.d), fmt.loss(p.anneal)]
        for kind in KINDS:
            err = p.rel_error.get(kind)
            cells += [fmt.MISSING, fmt.MISSING] if kind not in p.predicted else [
                f"{p.predicted[kind]:.4f}", fmt.MISSING if err is None else f"{err:+.2%}"]  # fmt: skip
        rows.append(cells)
    return rows


def floor_rows(study: StudyFit) -> list[list[str]]:
    """Per size: the loss fallen per doubling of D (anneals) and the law's floor for each kind."""
    by_n: dict[float, dict[str, Floor]] = {}
    for f in study.floors:
        by_n.setdefault(f.n, {})[f.kind] = f
    rows = []
    for n, kinds in by_n.items():
        shown = kinds.get("anneal") or kinds["merge"]
        cells = [fmt.tokens(n), "held out" if n == study.holdout_n else "fitted",
                 ", ".join(f"{x:.3f}" for x in shown.drops)]  # fmt: skip
        cells += [f"{kinds[k].max_abs_rel_error:.2%}" if k in kinds else fmt.MISSING for k in KINDS]
        rows.append(cells)
    return rows


FLOOR_HEADER = [
    "size N",
    "role",
    "annealed loss fallen per doubling of D (nats)",
    "floor: merges",
    "floor: anneals",
]
BACKTEST_HEADER = ["size N", "tokens", "annealed (measured)", "merge fit", "error", "anneal fit", "error"]
PREDICTION_HEADER = ["tokens", "annealed (measured)", "merged (measured)", "merge fit [95%]", "error",
                     "anneal fit [95%]", "error"]  # fmt: skip


def _floor_verdict(reach: Mapping[str, Any]) -> str:
    """The held-out size's floor (``targets()["heldout_floor"]``) in words: is the target within the law's reach?"""
    drops = ", ".join(f"{x:.2f}" for x in reach["drops"])
    if reach["reachable"]:
        return (
            f"The law's form can come within {reach['max_abs_rel_error']:.2%} of the held-out size's annealed "
            f"losses (its best curve through them): the {TOLERANCE:.0%} target is within the law's reach."
        )
    if any(later > first for first, later in zip(reach["drops"], reach["drops"][1:])):
        why = (
            f"these fall by {drops} nats per doubling: still steepening, so the budgets end before this size's "
            "power-law regime"
        )
    else:
        why = f"these (falling by {drops} nats per doubling) are off its curve"
    return (
        f"No law of this form comes within {reach['max_abs_rel_error']:.2%} of the held-out size's annealed losses, "
        f"however it is fitted: at one N the law falls by less with every doubling of D, and {why}. The "
        f"{TOLERANCE:.0%} target is out of reach of any fit of this law on these runs, merge- or anneal-based."
    )


def verdicts(t: Mapping[str, Any], holdout_n: float | None) -> list[str]:
    """The targets (``StudyFit.targets()``, or as read back from scaling_fit.json) in words, met or missed."""
    out = []
    held = t.get("heldout_within")
    if held:
        word = "meets" if held["met"] else "MISSES"
        out.append(
            f"The merge-based fit predicts the held-out size's annealed loss within {held['max_abs_rel_error']:.2%} "
            f"(worst budget): it {word} the {TOLERANCE:.0%} target."
        )
    elif holdout_n is not None:
        out.append("No annealed loss at the held-out size: the prediction target cannot be checked.")
    back = t.get("backtest_within")
    if back:
        head = (
            "Backtest on the fitted sizes alone (the held-out size not used): the merge law fitted on the smaller "
            f"sizes predicts the annealed loss of N = {', '.join(fmt.tokens(n) for n in back['sizes'])}"
        )
        if back["met"]:
            out.append(f"{head} within {back['max_abs_rel_error']:.2%} at every budget: the law extrapolates in size "
                       "on these runs.")  # fmt: skip
        else:
            out.append(
                f"{head} up to {back['max_abs_rel_error']:.2%} off (N = {fmt.tokens(back['n'])} at "
                f"{fmt.tokens(back['d'])} tokens): on these runs the law does not extrapolate in size within "
                f"{TOLERANCE:.0%}, which the study shows before the held-out size is looked at."
            )
    if t.get("heldout_floor"):
        out.append(_floor_verdict(t["heldout_floor"]))
    anneal = t.get("anneal_fit_within")
    if anneal:
        word = "misses it too" if not anneal["met"] else "meets it"
        out.append(
            f"For comparison, the anneal-based fit (what the merges stand in for) predicts the same losses within "
            f"{anneal['max_abs_rel_error']:.2%}: it {word}."
        )
    agree = t.get("fits_agree_within")
    if agree:
        word = "within" if agree["met"] else "NOT within"
        out.append(
            f"The two fits' predictions for the held-out size differ by at most {agree['max_abs_rel_gap']:.2%} at any "
            f"budget: {word} {TOLERANCE:.0%} of each other."
        )
    for kind, names in t.get("at_bound", {}).items():
        out.append(
            f"The {kind} fit puts {', '.join(names)} on the bound of the search box: the points do not determine "
            f"{'it' if len(names) == 1 else 'them'}; read those values and intervals as unidentified, not measured."
        )
    if t.get("no_intervals"):
        out.append(
            f"No bootstrap refits for the {' and '.join(t['no_intervals'])} "
            f"fit{'s' if len(t['no_intervals']) > 1 else ''} (--bootstrap 0, or every resample failed): no "
            "intervals, so whether the merge fit's exponents fall inside the anneal fit's is not checked."
        )
    for name, v in t.get("exponents_inside_anneal_ci", {}).items():
        lo, hi = v["anneal_ci95"]
        word = "inside" if v["met"] else "OUTSIDE"
        out.append(
            f"The merge fit's {name} = {v['merge']:.3f} is {word} the anneal fit's 95% CI [{lo:.3f}, {hi:.3f}]."
        )
    return out


def fit_text(study: StudyFit) -> str:
    """What ``pmakit scaling-fit`` prints."""
    lines = ["L(N, D) = E + A/N^alpha + B/D^beta (Huber on log L, 95% bootstrap CIs)"]
    for row in params_rows(study):
        lines.append(f"  {row[0]:<6} ({row[1]} points): " + ", ".join(
            f"{name} {cell}" for name, cell in zip(PARAMS, row[2:7])) + f"; rms residual {row[7]}")  # fmt: skip
    if study.holdout_n is not None:
        lines.append(f"Held out: N = {study.holdout_n:,.0f}")
        for row in prediction_rows(study):
            lines.append(
                f"  D {row[0]:>7}: annealed {row[1]}, merge fit {row[3]} ({row[4]}), anneal fit {row[5]} ({row[6]})"
            )
    if study.backtest:
        lines.append("Backtest (each fitted size from the smaller ones):")
        for row in backtest_rows(study):
            lines.append(
                f"  N {row[0]:>7}, D {row[1]:>7}: annealed {row[2]}, merge fit {row[3]} ({row[4]}), "
                f"anneal fit {row[5]} ({row[6]})"
            )
    if study.floors:
        lines.append(
            "The law's floor (the least worst error any law of this form can have at a size; merges, anneals):"
        )
        for row in floor_rows(study):
            lines.append(
                f"  N {row[0]:>7} ({row[1]}): {row[3]}, {row[4]}; annealed loss fallen per doubling {row[2]}"
            )
    return "\n".join(lines + verdicts(study.targets(TOLERANCE), study.holdout_n))


# --------------------------------------------------------------------------------------------------- plot


def plot(points: Sequence[Point], study: StudyFit, path: Path) -> Path:
    """Loss vs compute (6ND): every point (o merge, x anneal, one colour per size, the held-out size ringed) and
    each fit's compute-optimal frontier (solid: merges, dashed: anneals)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = sorted({p.n for p in points})
    colors = {n: plt.get_cmap("viridis")(i / max(1, len(sizes) - 1)) for i, n in enumerate(sizes)}
    fig, ax = plt.subplots(figsize=(7.5, 4.8), constrained_layout=True)
    for p in points:
        marker = "o" if p.kind == "merge" else "x"
        ax.plot([6 * p.n * p.d], [p.loss], marker, mfc="none", color=colors[p.n], ms=6)
        if p.n == study.holdout_n and p.kind == "anneal":
            ax.plot([6 * p.n * p.d], [p.loss], "o", mfc="none", mec="red", ms=12, lw=1)
    budgets = np.array(sorted({p.d for p in points}))
    d_line = np.geomspace(budgets.min(), budgets.max(), 60)
    styles = {"merge": "-", "anneal": "--"}
    for kind, f in study.fits.items():
        for n in sizes:  # each size's fitted curve over the measured budgets (the held-out one: a prediction)
            ax.plot(6 * n * d_line, f.law(n, d_line), styles[kind], color=colors[n], lw=0.8, alpha=0.8)
        # the envelope over the measured size range only: no extrapolation to sizes nobody trained
        c = np.geomspace(6 * sizes[0] * budgets.min(), 6 * sizes[-1] * budgets.max(), 200)
        n_grid = np.geomspace(sizes[0], sizes[-1], 200)
        ax.plot(c, f.law.frontier(c, n_grid), styles[kind], color="k", lw=1.6,
                label=f"{kind} fit: compute-optimal frontier (thin: per size)")  # fmt: skip
    for n in sizes:
        ax.plot([], [], "s", color=colors[n], label=f"N = {fmt.tokens(n)}")
    ax.plot([], [], "o", mfc="none", color="gray", label="merge (measured)")
    ax.plot([], [], "x", color="gray", label="anneal (measured)")
    if study.holdout_n is not None:
        ax.plot(
            [], [], "o", mfc="none", mec="red", ms=10, label="held-out size's anneals (predicted by the fits)"
        )
    # log compute, linear loss: the losses span a narrow range, where a log axis only hides the tick labels
    ax.set(
        xscale="log",
        xlabel="training compute C = 6ND (FLOPs, N non-embedding)",
        ylabel="held-out loss (test split)",
    )
    ax.legend(fontsize=7, ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------------- the study


def _load(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    exp = json.loads((run_dir / "experiment.json").read_text())
    return exp, read_jsonl(run_dir / RESULTS)


def _paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    var = sum((x - mean) ** 2 for x in d) / max(1, len(d) - 1)
    return mean, math.sqrt(var / len(d))


def gap_rows(rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Merge - anneal at every (size, budget), with the paired s.e. over the test batches."""
    by = {(r["size"], r["tokens"], r["kind"]): r for r in rows}
    out = []
    for size, tokens, kind in sorted(by, key=lambda k: (by[k]["params"], k[1])):
        if kind != "anneal" or (size, tokens, "merge") not in by:
            continue
        a, m = by[(size, tokens, "anneal")], by[(size, tokens, "merge")]
        d, se = _paired(m["batch_losses"], a["batch_losses"])
        latest = by.get((size, tokens, "latest"))
        out.append([size, fmt.tokens(m["params"]), fmt.tokens(tokens), fmt.loss_se(a["val_loss"], a["val_loss_se"]),
                    fmt.loss(m["val_loss"]), f"{d:+.4f} ± {se:.4f}", f"{m['val_loss'] / a['val_loss'] - 1:+.2%}",
                    fmt.MISSING if latest is None else fmt.loss(latest["val_loss"])])  # fmt: skip
    return out


GAP_HEADER = ["size", "N", "tokens", "annealed ± s.e.", "merged", "merged − annealed ± paired s.e.", "relative",
              "latest snapshot"]  # fmt: skip


def bill(exp: Mapping[str, Any]) -> tuple[list[list[str]], list[str]]:
    """The compute of each way to get every (size, budget) point: FLOPs (6ND, N non-embedding) and wall time."""
    rows, totals = [], {"merge": [0.0, 0.0], "anneal": [0.0, 0.0], "cosine": [0.0, 0.0]}
    for s in exp.get("sizes", []):
        n, budgets, sec = s["params"], s["budgets"], s["seconds"]
        trunk_tokens = max(budgets)
        anneal_tokens = sum(s["anneal_tokens"])
        per = {
            "merge": (trunk_tokens, sec["trunk"] + sec["merges"]),
            "anneal": (trunk_tokens + anneal_tokens, sec["trunk"] + sec["anneals"]),
            # Not run: a separate run per budget, timed at the trunk's measured throughput.
            "cosine": (sum(budgets), sum(budgets) * sec["trunk"] / trunk_tokens),
        }
        cells = [s["name"], fmt.tokens(n)]
        for way, (tokens, wall) in per.items():
            totals[way][0] += 6 * n * tokens
            totals[way][1] += wall
            cells += [f"{6 * n * tokens:.3g}", f"{wall:.0f} s"]
        rows.append(cells)
    rows.append(
        ["all", ""] + [x for way in totals for x in (f"{totals[way][0]:.3g}", f"{totals[way][1]:.0f} s")]
    )
    m, a, c = (totals[w] for w in ("merge", "anneal", "cosine"))
    words = []
    if a[0] and c[0]:
        words.append(
            f"Merges instead of anneals save {1 - m[0] / a[0]:.0%} of the FLOPs ({1 - m[1] / a[1]:.0%} of the measured "
            f"wall time); instead of a cosine run per budget, {1 - m[0] / c[0]:.0%} of the FLOPs "
            f"({1 - m[1] / c[1]:.0%} of the wall time, cosine runs timed at the trunks' measured throughput, not run)."
        )
    return rows, words


BILL_HEADER = ["size", "N", "trunk + merges: FLOPs", "wall", "trunk + anneals: FLOPs", "wall",
               "cosine per budget: FLOPs", "wall (estimated)"]  # fmt: skip


def _points(rows: Sequence[Mapping[str, Any]]) -> list[Point]:
    return [Point(r["params"], r["tokens"], r["val_loss"], r["kind"]) for r in rows if r["kind"] in KINDS]


def _intro(exp: Mapping[str, Any]) -> str:
    sizes = exp.get("sizes", [])
    cfg = exp.get("config", {}).get(STUDY, {})
    described = ", ".join(
        f"{s['name']} ({fmt.tokens(s['params'])} non-embedding, V = {fmt.tokens(s['every_tokens'])})"
        for s in sizes
    )
    recipe = exp.get("recipe", {})
    return (
        f"{len(sizes)} model sizes: {described}. One constant-LR trunk per size with a snapshot every V; at each "
        f"budget D a merge of the trunk's snapshots ending at D ({recipe.get('label', 'recipe')}, chosen on the "
        f"selection split of the sizes fitted, never on the test split) and, as ground truth, an anneal branched off "
        f"the trunk at {1 - cfg.get('anneal_fraction', 0.2):.0%} of D, LR to 0 over the last "
        f"{cfg.get('anneal_fraction', 0.2):.0%} ({cfg.get('anneal_shape', '1sqrt')}). Every number is on the test "
        f"split: {cfg.get('test_batches')} held-out batches disjoint from the {cfg.get('selection_batches')} "
        "selection batches."
    )


def _run_text(exp: Mapping[str, Any]) -> str:
    """When, how long, on how loaded a machine (the time target is stated for 2 idle cores)."""
    import datetime

    try:
        start, end = (datetime.datetime.fromisoformat(exp[k]) for k in ("started", "finished"))
        minutes = (end - start).total_seconds() / 60
        wall = f"{minutes:.1f} min from first start to last finish (a resumed study includes its pauses)"
    except (KeyError, TypeError, ValueError):
        wall = "an unknown time"
    load = exp.get("load_average")
    loaded = f"; load average at the end {', '.join(f'{x:.1f}' for x in load)} (1, 5, 15 min)" if load else ""
    train = sum(s["seconds"]["trunk"] + s["seconds"]["anneals"] for s in exp.get("sizes", []))
    return (
        f"The study took {wall}, of which training {train / 60:.1f} min, on {exp.get('threads', '?')} threads"
        f"{loaded}. The target is at most 40 minutes on 2 idle cores."
    )


def _selection_rows(exp: Mapping[str, Any]) -> list[list[str]]:
    chosen = exp.get("recipe", {}).get("label")
    return [
        [
            r["recipe"] + (" (chosen)" if r["recipe"] == chosen else ""),
            str(r["points"]),
            fmt.loss(r["mean_loss"]),
        ]
        for r in exp.get("selection", [])
    ]


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The study's report blocks and the figures drawn; writes RUN/scaling_fit.json."""
    exp, rows = _load(run_dir)
    cfg = exp.get("config", {}).get(STUDY, {})
    points = _points(rows)
    study = fit_study(points, holdout=cfg.get("holdout", "largest"), bootstrap=int(cfg.get("bootstrap", 400)))
    atomic_write_text(run_dir / FIT_JSON, json.dumps(to_json(study), indent=1) + "\n")
    drawn: list[Path] = []
    blocks: list[Block] = [
        Heading("Scaling laws from merges instead of annealed runs", 1),
        Paragraph(_intro(exp)),
    ]
    blocks.append(Paragraph(_run_text(exp)))
    blocks += [
        Heading("Targets", 2),
        Bullets(verdicts(study.targets(TOLERANCE), study.holdout_n) + bill(exp)[1]),
    ]
    blocks += [Heading("Fits", 2), Paragraph(
        f"L(N, D) = E + A/N^alpha + B/D^beta, Huber loss (delta 1e-3) on log L from a grid of starts, 95% intervals "
        f"from {cfg.get('bootstrap', 400)} bootstrap refits over resampled points; N = non-embedding parameters. "
        + ("" if study.holdout_n is None else f"Both fits leave out the largest size (N = {fmt.tokens(study.holdout_n)}).")
    ), Table(PARAMS_HEADER, params_rows(study))]  # fmt: skip
    if study.predictions:
        blocks += [
            Heading("The held-out size, predicted", 2),
            Table(PREDICTION_HEADER, prediction_rows(study)),
        ]
    if study.backtest:
        blocks += [
            Heading("Backtest: each fitted size predicted from the smaller ones", 2),
            Paragraph(
                "What the held-out prediction does, rehearsed on the sizes both fits use: each size from the fourth "
                "smallest on, predicted by the laws fitted (the same way, without bootstrap) on the smaller sizes "
                "alone, against its measured annealed loss. It needs no held-out data: a law that misses here is not "
                "to be trusted further out."
            ),
            Table(BACKTEST_HEADER, backtest_rows(study)),
        ]
    if study.floors:
        blocks += [
            Heading("What the law's form can reach at each size", 2),
            Paragraph(
                "At one model size the law is c + B/D^beta: a curve that falls by less with every doubling of D. The "
                "floor is the least worst-case error of such a curve through a size's measured losses (a linear "
                "programme over c and B at each beta in the fit's range): no fit of the law, on any points, can "
                "predict that size better. A floor above the target's tolerance at the held-out size puts the target "
                "out of reach; growing drops per doubling are one cause (a curve still steepening in log D, before "
                "the power-law regime)."
            ),
            Table(FLOOR_HEADER, floor_rows(study)),
        ]
    blocks += [Heading("Merge − anneal at every point (test split)", 2), Table(GAP_HEADER, gap_rows(rows))]
    blocks += [Heading("Merge recipe, chosen on the selection split", 2),
               Table(["candidate", "points", "mean selection loss"], _selection_rows(exp))]  # fmt: skip
    bill_rows, _ = bill(exp)
    blocks += [Heading("Compute bill", 2), Paragraph(
        "FLOPs = 6 N D with N non-embedding parameters; wall time measured on this machine (merges: the averaging "
        "only; evaluation is the same for every way and left out)."), Table(BILL_HEADER, bill_rows)]  # fmt: skip
    try:
        figure = plot(points, study, run_dir / "plots" / FIT_PLOT)
        drawn.append(figure)
        blocks.append(FigureBlock(figure.relative_to(run_dir), "Loss vs compute with both fitted frontiers"))
    except ImportError as e:
        blocks.append(Paragraph(f"matplotlib is not available ({e}): no plot.", note=True))
    return blocks, drawn


def summary(run_dir: Path) -> str:
    """A terminal screen: the fits, the verdicts and the compute saved (read from RUN/scaling_fit.json)."""
    exp, _ = _load(run_dir)
    lines = [f"Scaling study: {run_dir}"]
    try:
        record = json.loads((run_dir / FIT_JSON).read_text())
    except (OSError, ValueError):
        return "\n".join([*lines, "  no fit yet: run `pmakit report` on it"])
    for kind, f in record["fits"].items():
        law, ci = f["law"], f["ci95"]
        lines.append(f"  {kind} fit ({f['points']} points): " + ", ".join(
            f"{p} {_num(law[p])} {_interval(*ci[p])}" for p in PARAMS))  # fmt: skip
    lines += verdicts(record["targets"], record["holdout_n"]) + bill(exp)[1]
    if (run_dir / "report.html").is_file():
        lines.append(f"Report: {run_dir / 'report.html'}")
    return "\n".join(lines)
