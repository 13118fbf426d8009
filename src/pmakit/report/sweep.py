"""Rankings of a sweep's candidates, how well an early estimate agrees with the truth, and the ``sweep`` report.

Two users: ``pmakit sweep-rank`` (``rank_table``: a user's runs ranked by one number each, with bootstrap
uncertainty over the held-out batches) and the report of ``pmakit experiment --preset sweep`` (``build`` /
``summary``), which reads RUN/results.jsonl and RUN/experiment.json only (never the lab code) and writes
RUN/sweep_ranking.json beside the report.

Agreement of an estimate with the truth (each candidate's anneal at the full budget), on the test split:
Kendall's tau-b of the two rankings (``scipy.stats.kendalltau``), top-1 (the estimate's best is the truth's best)
and regret (the truth's loss of the estimate's pick minus the truth's best loss). The 95% intervals come from
resampling the test batches with replacement (the same resample for every candidate and for the truth, so the
paired structure of the batches is kept).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pmakit.errors import PmakitError
from pmakit.report import fmt
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import RESULTS, atomic_write_text, read_jsonl

STUDY = "sweep"
RANKING_JSON = "sweep_ranking.json"
FIGURE = "plots/sweep_rank_vs_compute.png"
ESTIMATES = ("latest", "fixed", "tuned", "anneal")
NAMES = {
    "latest": "latest snapshot",
    "fixed": "fixed merge (SMA)",
    "tuned": "tuned merge",
    "anneal": "short anneal",
}
COLORS = {"latest": "#888888", "fixed": "#1f77b4", "tuned": "#2ca02c", "anneal": "#d62728"}


# --------------------------------------------------------------------------------------------------- statistics


def _resamples(batches: int, bootstrap: int, seed: int) -> np.ndarray:
    """Row 0: the batches as measured; then ``bootstrap`` resamples with replacement."""
    rng = np.random.default_rng(seed)
    return np.vstack([np.arange(batches)[None, :], rng.integers(0, batches, size=(bootstrap, batches))])


def _losses(by_name: Mapping[str, Sequence[float]], names: Sequence[str]) -> np.ndarray:
    matrix = [list(by_name[n]) for n in names]
    if len({len(r) for r in matrix}) != 1:
        raise PmakitError("every candidate must be scored on the same held-out batches")
    return np.asarray(matrix, dtype=np.float64)


def _interval(xs: np.ndarray) -> list[float]:
    return [float(np.quantile(xs, 0.025)), float(np.quantile(xs, 0.975))]


def agreement(estimate: Mapping[str, Sequence[float]], truth: Mapping[str, Sequence[float]], *,
              bootstrap: int = 1000, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Kendall tau, top-1 and regret of ``estimate``'s ranking against ``truth``'s (per-batch losses of each
    candidate on the same batches), measured and over ``bootstrap`` resamples of the batches."""
    from scipy.stats import kendalltau

    names = sorted(truth)
    est, tru = _losses(estimate, names), _losses(truth, names)
    taus, hits, regrets = [], [], []
    for idx in _resamples(est.shape[1], bootstrap, seed):
        e, t = est[:, idx].mean(1), tru[:, idx].mean(1)
        tau = kendalltau(e, t).statistic
        taus.append(float(tau) if np.isfinite(tau) else 0.0)
        hits.append(int(np.argmin(e) == np.argmin(t)))
        regrets.append(float(t[np.argmin(e)] - t.min()))
    out = {"tau": taus[0], "top1": bool(hits[0]), "regret": regrets[0], "pick": names[int(np.argmin(est.mean(1)))],
           "best": names[int(np.argmin(tru.mean(1)))], "bootstrap": bootstrap}  # fmt: skip
    if bootstrap:
        out |= {"tau_ci": _interval(np.array(taus[1:])), "top1_rate": float(np.mean(hits[1:])),
                "regret_ci": _interval(np.array(regrets[1:])), "taus": taus[1:]}  # fmt: skip
    return out


def rank_table(
    losses: Mapping[str, Sequence[float]], *, bootstrap: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """Runs ranked by mean loss over the same batches: each with its s.e., its paired difference to the best and
    that difference's s.e., the share of bootstrap resamples in which it is the best, and its rank's 95% range."""
    names = list(losses)
    matrix = _losses(losses, names)
    n = matrix.shape[1]
    means = matrix.mean(1)
    best = int(np.argmin(means))
    ranks = np.argsort(np.argsort(matrix[:, _resamples(n, bootstrap, seed)].mean(2), axis=0), axis=0) + 1
    out = []
    for i in np.argsort(means):
        diff = matrix[i] - matrix[best]
        out.append({
            "name": names[i], "loss": float(means[i]), "loss_se": float(matrix[i].std(ddof=1) / np.sqrt(n)),
            "minus_best": float(diff.mean()), "minus_best_se": float(diff.std(ddof=1) / np.sqrt(n)),
            "p_best": float(np.mean(ranks[i, 1:] == 1)) if bootstrap else None,
            "rank_range": [int(np.quantile(ranks[i, 1:], 0.025)), int(np.quantile(ranks[i, 1:], 0.975))]
            if bootstrap else None,
        })  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------------- the study


def _costs(exp: Mapping[str, Any], budget: int, kind: str) -> tuple[float, float]:
    """(tokens trained by every candidate, wall seconds) for an estimate at ``budget``: the trunks to it; a short
    anneal also its branches; a merge also the merging. Against the truth: every candidate a WSD run of D."""
    sec = exp.get("seconds", {})
    d = max(exp["budgets"])
    tokens = wall = 0.0
    for c in exp["candidates"]:
        name, fork = c["name"], dict(zip(c["budgets"], c["forks"]))
        trunk = sec.get(f"{name}/trunk", 0.0) / d
        if kind == "truth":
            tokens += d
            wall += trunk * fork[d] + sec.get(f"{name}/anneal-{d}", 0.0)
            continue
        tokens += budget + (budget - fork[budget] if kind == "anneal" else 0)
        wall += trunk * budget + (sec.get(f"{name}/anneal-{budget}", 0.0) if kind == "anneal" else 0.0)
        wall += sec.get(f"{name}/{kind}-{budget}", 0.0) if kind in ("fixed", "tuned") else 0.0
    return tokens, wall


def analyse(exp: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every (point, estimate)'s agreement with the truth and its cost as a share of annealing every candidate."""
    cfg = exp.get("config", {}).get(STUDY, {})
    budget = max(exp["budgets"])
    by = {(r["candidate"], r["tokens"], r["kind"]): r["batch_losses"] for r in rows}
    names = [c["name"] for c in exp["candidates"]]
    truth = {n: by[(n, budget, "anneal")] for n in names if (n, budget, "anneal") in by}
    if len(truth) < len(names):
        raise PmakitError("the sweep has no annealed truth for every candidate yet: finish the study first")
    full_tokens, full_wall = _costs(exp, budget, "truth")
    out = []
    for b in exp["budgets"]:
        for kind in ESTIMATES:
            if b == budget and kind == "anneal":
                continue  # the truth itself
            if any((n, b, kind) not in by for n in names):
                continue
            est = {n: by[(n, b, kind)] for n in names}
            tokens, wall = _costs(exp, b, kind)
            found = agreement(est, truth, bootstrap=int(cfg.get("bootstrap", 1000)))
            out.append({"tokens": b, "point": b / budget, "kind": kind, "compute": tokens / full_tokens,
                        "wall_share": wall / full_wall if full_wall else None, **found})  # fmt: skip
    return {"budget": budget, "truth_tokens": full_tokens, "truth_wall": full_wall, "rows": out,
            "truth": {n: float(np.mean(v)) for n, v in truth.items()}, "differences": differences(out)}  # fmt: skip


def _row(r: Mapping[str, Any]) -> list[str]:
    tau = f"{r['tau']:+.2f}" + (f" [{r['tau_ci'][0]:+.2f}, {r['tau_ci'][1]:+.2f}]" if "tau_ci" in r else "")
    top1 = ("yes" if r["top1"] else "no") + (f" ({r['top1_rate']:.0%})" if "top1_rate" in r else "")
    regret = fmt.loss(r["regret"]) + (
        f" [{r['regret_ci'][0]:.4f}, {r['regret_ci'][1]:.4f}]" if "regret_ci" in r else ""
    )
    return [f"{r['point']:.0%} ({fmt.tokens(r['tokens'])})", NAMES[r["kind"]], f"{r['compute']:.0%}",
            fmt.MISSING if r["wall_share"] is None else f"{r['wall_share']:.0%}", tau, top1, regret, r["pick"]]  # fmt: skip


AGREEMENT_HEADER = ["point", "estimate", "compute (tokens)", "compute (wall)", "Kendall tau [95%]",
                    "top-1 (bootstrap rate)", "regret [95%]", "picks"]  # fmt: skip


PAIRS = (("fixed", "latest"), ("tuned", "latest"), ("tuned", "anneal"))
"""The tau differences the report gives: does a merge rank better than the latest snapshot, or than a short anneal?"""


def differences(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per early point and pair (a, b) of ``PAIRS``: tau(a) - tau(b) as measured, and its 95% interval over the
    same resamples of the test batches."""
    out = []
    for p in sorted({r["tokens"] for r in rows if r["point"] < 1}):
        by = {r["kind"]: r for r in rows if r["tokens"] == p}
        for a, b in PAIRS:
            if "taus" in by.get(a, {}) and "taus" in by.get(b, {}):
                d = np.array(by[a]["taus"]) - np.array(by[b]["taus"])
                out.append({"tokens": p, "point": by[a]["point"], "a": a, "b": b, "tau_a": by[a]["tau"],
                            "tau_b": by[b]["tau"], "diff": by[a]["tau"] - by[b]["tau"], "ci": _interval(d)})  # fmt: skip
    return out


def _compare(ci: Sequence[float]) -> str:
    lo, hi = ci
    return (
        "ahead of"
        if lo > 0
        else "behind"
        if hi < 0
        else "level with"
        if lo == hi == 0
        else "not distinguishable from"
    )


def difference_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """Per early point, each pair's tau difference with its interval and the word for it."""
    by = {(d["tokens"], d["a"], d["b"]): d for d in result.get("differences", [])}
    out = []
    for p in sorted({t for t, _, _ in by}):
        cells = [f"{by[next(k for k in by if k[0] == p)]['point']:.0%} ({fmt.tokens(p)})"]
        for a, b in PAIRS:
            d = by.get((p, a, b))
            cells.append(
                fmt.MISSING
                if d is None
                else f"{d['diff']:+.2f} [{d['ci'][0]:+.2f}, {d['ci'][1]:+.2f}]: {_compare(d['ci'])}"
            )
        out.append(cells)
    return out


DIFFERENCE_HEADER = ["point", *(f"tau: {NAMES[a]} − {NAMES[b]}" for a, b in PAIRS)]


def verdicts(result: Mapping[str, Any]) -> list[str]:
    """From which point each estimate picks the truth's best candidate, what deciding there saves, and whether the
    tuned merge ranks better than the latest snapshot."""
    rows = [r for r in result["rows"] if r["point"] < 1]
    points = sorted({r["tokens"] for r in rows})
    k = len(result["truth"])
    out = []
    for kind in ESTIMATES:
        mine = {r["tokens"]: r for r in rows if r["kind"] == kind}
        settled = next(
            (p for p in points if all(mine[q]["top1"] for q in points if q >= p and q in mine)), None
        )
        first = mine.get(settled) if settled is not None else None
        if first is None:
            last = mine[points[-1]]
            out.append(f"The {NAMES[kind]} does not pick the truth's best candidate at the last early point, "
                       f"{last['point']:.0%} (it picks {last['pick']}, the truth {last['best']}; regret "
                       f"{last['regret']:.4f}).")  # fmt: skip
            continue
        finish = (
            first["compute"] * k + 1 - first["point"]
        ) / k  # then only the pick goes on to D (and anneals)
        out.append(f"The {NAMES[kind]} picks the truth's best candidate from {first['point']:.0%} of the budget on "
                   f"(Kendall tau there {first['tau']:+.2f}): {first['compute']:.0%} of the compute of annealing every "
                   f"candidate; deciding there and training only the pick on to D: {finish:.0%}, "
                   f"{1 - finish:.0%} saved.")  # fmt: skip
    for d in result.get("differences", []):
        if (d["a"], d["b"]) == ("tuned", "latest"):
            out.append(f"At {d['point']:.0%}, the tuned merge's ranking is {_compare(d['ci'])} the latest "
                       f"snapshot's (tau {d['tau_a']:+.2f} vs {d['tau_b']:+.2f}, difference [{d['ci'][0]:+.2f}, "
                       f"{d['ci'][1]:+.2f}] over test-batch resamples).")  # fmt: skip
    return out


def loss_rows(exp: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> list[list[str]]:
    """Every candidate's test loss at every point, each estimate, and its truth."""
    by = {(r["candidate"], r["tokens"], r["kind"]): r for r in rows}
    out = []
    for c in exp["candidates"]:
        for b in exp["budgets"]:
            cells = [c["name"], f"{c['lr']:g}", f"{c['weight_decay']:g}", str(c["batch_size"]), fmt.tokens(b)]
            for kind in ESTIMATES:
                r = by.get((c["name"], b, kind))
                cells.append(fmt.MISSING if r is None else fmt.loss_se(r["val_loss"], r["val_loss_se"]))
            out.append(cells)
    return out


LOSS_HEADER = ["candidate", "lr", "wd", "batch", "tokens", "latest", "fixed merge", "tuned merge",
               "anneal (at the last row: the truth)"]  # fmt: skip


def draw(result: Mapping[str, Any], path: Path) -> Path:
    """Rank agreement (Kendall tau, 95% interval) and regret vs the share of compute spent, one line per estimate;
    the truth (tau 1 at 100%) marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.6), layout="constrained")
    FigureCanvasAgg(fig)
    ax_tau, ax_regret = fig.subplots(1, 2)
    low = min([0.0, *(r.get("tau_ci", [r["tau"]])[0] for r in result["rows"])])
    for i, kind in enumerate(ESTIMATES):
        rows = sorted((r for r in result["rows"] if r["kind"] == kind), key=lambda r: r["compute"])
        if not rows:
            continue
        x = [
            100 * r["compute"] * 1.03 ** (i - 1.5) for r in rows
        ]  # side by side where estimates share a cost
        for ax, key in ((ax_tau, "tau"), (ax_regret, "regret")):
            y = np.array([r[key] for r in rows])
            if all(f"{key}_ci" in r for r in rows):
                ci = np.array([r[f"{key}_ci"] for r in rows]).T
                ax.errorbar(
                    x, y, yerr=np.abs(ci - y), fmt="o-", color=COLORS[kind], capsize=3, label=NAMES[kind]
                )
            else:
                ax.plot(x, y, "o-", color=COLORS[kind], label=NAMES[kind])
    ax_tau.plot([100], [1.0], "k*", ms=10, label="annealed truth (every candidate to D)")
    xlabel = "compute, % of annealing every candidate"
    ax_tau.set(xlabel=xlabel, ylabel="Kendall tau vs the truth", ylim=(low - 0.1, 1.05), xscale="log")
    ax_regret.set(xlabel=xlabel, ylabel="regret (truth loss of the pick − best)", xscale="log")
    ax_regret.axhline(0, color="k", lw=0.6)
    ax_tau.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _load(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    exp = json.loads((run_dir / "experiment.json").read_text())
    return exp, read_jsonl(run_dir / RESULTS)


def _intro(exp: Mapping[str, Any]) -> str:
    cfg = exp.get("config", {}).get(STUDY, {})
    cands = exp["candidates"]
    d = max(exp["budgets"])
    points = ", ".join(f"{b / d:.0%}" for b in exp["budgets"] if b < d)
    return (
        f"{len(cands)} candidates ({', '.join(c['name'] for c in cands)}), each one constant-LR run to "
        f"D = {fmt.tokens(d)} tokens with a snapshot every {fmt.tokens(cfg.get('every_tokens'))}, all on the same "
        f"data order. The truth: each candidate annealed to D (branched off at {1 - cfg.get('anneal_fraction', 0.2):.0%}"
        f" of D, LR to 0, {cfg.get('anneal_shape', '1sqrt')}). At {points} of D the candidates are ranked by their "
        f"latest snapshot, the fixed merge (SMA of the last {cfg.get('fixed_n')} snapshots), the tuned merge (recipe "
        "chosen per candidate on the selection split, never on the test split) and a short anneal ending there. "
        f"Every loss is on the test split ({cfg.get('test_batches')} held-out batches, disjoint from the "
        f"{cfg.get('selection_batches')} selection batches); intervals from {cfg.get('bootstrap')} resamples of the "
        "test batches. Compute: tokens trained by all candidates up to the estimate (a short anneal adds its branch) "
        "over K x D, the cost of one WSD run to D per candidate."
    )


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The study's report blocks and the figure drawn; writes RUN/sweep_ranking.json."""
    exp, rows = _load(run_dir)
    result = analyse(exp, rows)
    stored = {**result, "rows": [{k: v for k, v in r.items() if k != "taus"} for r in result["rows"]]}
    atomic_write_text(run_dir / RANKING_JSON, json.dumps(stored, indent=1) + "\n")
    blocks: list[Block] = [Heading("Hyper-parameter sweep decided early by merges", 1), Paragraph(_intro(exp)),
                           Heading("Verdicts", 2), Bullets(verdicts(result))]  # fmt: skip
    drawn: list[Path] = []
    try:
        figure = draw(result, run_dir / FIGURE)
        drawn.append(figure)
        blocks.append(FigureBlock(figure.relative_to(run_dir), "Rank agreement vs compute spent", [
            "Left: Kendall tau of each estimate's ranking of the candidates against the annealed truth; right: the "
            "regret of its pick. Bars: 95% intervals over resamples of the test batches. x: tokens trained by all "
            "candidates up to the estimate, as a share of annealing every candidate to the full budget."]))  # fmt: skip
    except ImportError as e:
        blocks.append(Paragraph(f"matplotlib is not available ({e}): no plot.", note=True))
    blocks += [Heading("Rank agreement with the truth (test split)", 2),
               Table(AGREEMENT_HEADER, [_row(r) for r in result["rows"]]),
               Heading("Do merges rank better than the latest snapshot, or than a short anneal?", 2),
               Paragraph("Differences of Kendall tau at each early point, with 95% intervals over the same resamples "
                         "of the test batches (paired: every estimate and the truth resampled together)."),
               Table(DIFFERENCE_HEADER, difference_rows(result)),
               Heading("Every candidate's test loss", 2), Table(LOSS_HEADER, loss_rows(exp, rows))]  # fmt: skip
    return blocks, drawn


def summary(run_dir: Path) -> str:
    """A terminal screen: the verdicts (read from RUN/sweep_ranking.json) and where the report is."""
    lines = [f"Sweep study: {run_dir}"]
    try:
        result = json.loads((run_dir / RANKING_JSON).read_text())
    except (OSError, ValueError):
        return "\n".join([*lines, "  no ranking yet: run `pmakit report` on it"])
    truth = sorted(result["truth"].items(), key=lambda kv: kv[1])
    lines.append("  truth (annealed at D, test loss): " + ", ".join(f"{n} {v:.4f}" for n, v in truth))
    lines += ["  " + v for v in verdicts(result)]
    if (run_dir / "report.html").is_file():
        lines.append(f"Report: {run_dir / 'report.html'}")
    return "\n".join(lines)
