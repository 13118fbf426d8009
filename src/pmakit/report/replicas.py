"""The report of the ``replicas`` study: model copies (sync data parallel, local SGD, DiLoCo) with PMA on top.

Reads RUN/results.jsonl, RUN/curves.csv and RUN/experiment.json only (never the lab code).
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.report import fmt
from pmakit.report.blocks import Block, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import RESULTS, read_jsonl

STUDY = "replicas"
DILOCO_TARGET = 0.02  # the bar: DiLoCo with H=100 within 2% of synchronous training's loss


def _load(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, str]]]:
    exp = json.loads((run_dir / "experiment.json").read_text())
    if not (run_dir / RESULTS).is_file() or not (run_dir / "curves.csv").is_file():
        raise PmakitError(
            f"{run_dir} has no scores yet (results.jsonl, curves.csv): run the study to its end first"
        )
    rows = read_jsonl(run_dir / RESULTS)
    with open(run_dir / "curves.csv", newline="") as f:
        curves = list(csv.DictReader(f))
    return exp, rows, curves


def _paired(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [x - y for x, y in zip(a, b)]
    mean = sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d)) if len(d) > 1 else 0.0
    return mean, se


def _diff(d: float, se: float) -> str:
    return f"{d:+.4f} ± {se:.4f}" + (f" ({d / se:+.1f} s.e.)" if se else "")


def _table(rows: list[dict[str, Any]]) -> Table:
    by = {(r["arm"], r["model"]): r for r in rows}
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    pma = next(m for (_, m) in by if m.startswith("pma") and not m.endswith("copies"))
    body = []
    for arm in arms:
        latest, merged = by[(arm, "latest")], by[(arm, pma)]
        gain = _paired(merged["batch_losses"], latest["batch_losses"])
        copies = by.get((arm, f"{pma}-copies"))
        body.append(
            [
                arm,
                f"{latest['all_reduces']:,}",
                f"{latest['val_loss']:.4f} ± {latest['val_loss_se']:.4f}",
                "" if arm == "sync" else _diff(latest["delta_vs_sync"], latest["delta_vs_sync_se"]),
                f"{merged['val_loss']:.4f}",
                _diff(*gain),
                "" if arm == "single" else _diff(merged["delta_vs_single"], merged["delta_vs_single_se"]),
                fmt.MISSING if copies is None else f"{copies['val_loss']:.4f}",
            ]
        )
    header = ["arm", "all-reduces", "latest ± s.e.", "latest − sync", pma.upper(), f"{pma.upper()} − latest",
              f"{pma.upper()} − single's {pma.upper()}", f"{pma.upper()} across copies"]  # fmt: skip
    return Table(header, body, align="lrrrrrrr")


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, stated as met or missed from the numbers."""
    out = []
    by = {(r["arm"], r["model"]): r for r in rows}
    sync = by[("sync", "latest")]
    for (arm, model), r in by.items():
        if model != "latest" or not arm.startswith("diloco") or arm == "sync":
            continue
        rel = r["val_loss"] / sync["val_loss"] - 1
        fewer = sync["all_reduces"] / max(r["all_reduces"], 1)
        verdict = "within" if rel <= DILOCO_TARGET else "MISSES"
        out.append(
            f"{arm}: latest loss {rel:+.2%} vs synchronous training (paired "
            f"{_diff(r['delta_vs_sync'], r['delta_vs_sync_se'])}) with {fewer:.0f}x fewer all-reduces: "
            f"{verdict} the 2% target."
        )
    pma = [r for r in rows if r["model"].startswith("pma") and r["arm"] not in ("single",)]
    for r in pma:
        d, se = r["delta_vs_single"], r["delta_vs_single_se"]
        word = "better than" if d < -2 * se else "worse than" if d > 2 * se else "not distinguishable from"
        out.append(f"{r['arm']} {r['model']}: {word} the single copy's PMA ({_diff(d, se)}).")
    return out


def _plot(run_dir: Path, curves: list[dict[str, str]], rows: list[dict[str, Any]]) -> Path:
    """Left: the online evaluations (latest) vs tokens. Right: the final scores (latest and PMA, the table's
    numbers) vs all-reduces. The two kinds of evaluation are never on one axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in curves:
        if c["model"] == "latest":
            series[c["arm"]].append((float(c["tokens"]), float(c["val_loss"])))
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    colors = {arm: f"C{i}" for i, arm in enumerate(arms)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for arm in arms:
        pts = sorted(series.get(arm, []))
        left.plot([p[0] for p in pts], [p[1] for p in pts], color=colors[arm], lw=1.2, label=arm)
    for r in rows:
        x = max(r["all_reduces"], 1)  # the single copy (0 all-reduces) sits at 1 on the log axis
        marker = "o" if r["model"] == "latest" else "^" if r["model"].endswith("copies") else "*"
        right.errorbar(
            [x], [r["val_loss"]], yerr=[r["val_loss_se"]], fmt=marker, color=colors[r["arm"]], ms=7
        )
    left.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt.tokens(v)))
    left.set(xlabel="tokens (all copies)", ylabel="held-out loss")
    left.set_title("online evaluations of the latest weights while training", fontsize=9)
    right.set(xscale="log", xlabel="all-reduces (log; single copy at 1)", ylabel="held-out loss")
    right.set_title("final scores (the table): o latest, * PMA, ^ PMA across copies", fontsize=9)
    left.legend(fontsize=8)
    path = run_dir / "plots" / "replicas.png"
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The report's blocks and the figures drawn."""
    exp, rows, curves = _load(run_dir)
    cfg = exp.get("config", {})
    train, study = cfg.get("train", {}), cfg.get(STUDY, {})
    plot = _plot(run_dir, curves, rows)
    intro = (
        f"{study.get('replicas')} model copies, each on its own data shard, {fmt.tokens(train.get('total_tokens'))} "
        f"tokens in all per arm, a snapshot of the synced model every {fmt.tokens(train.get('every_tokens'))} "
        f"tokens; PMA is the SMA of each arm's last {study.get('last')} snapshots. Every model is scored at the "
        f"end on the same {study.get('eval_batches')} held-out batches (files never trained on); differences are "
        "paired over those batches. 'single' is one copy with all copies' sequences in each batch (the same tokens "
        "per step)."
    )
    blocks: list[Block] = [
        Heading("Model copies: synchronous data parallel, local SGD and DiLoCo, with PMA on top", 1),
        Paragraph(intro),
        _table(rows),
        Heading("Targets", 2),
        Paragraph(" ".join(_verdicts(rows))),
        FigureBlock(plot.relative_to(run_dir), "Held-out loss vs tokens and vs all-reduces"),
    ]
    return blocks, [plot]


def summary(run_dir: Path) -> str:
    """A terminal screen: the table's rows and the verdicts."""
    _, rows, _ = _load(run_dir)
    lines = [f"Replicas study: {run_dir}"]
    lines += [f"  {r['arm']:<14} {r['model']:<14} {r['val_loss']:.4f} ± {r['val_loss_se']:.4f}" for r in rows]
    return "\n".join(lines + [f"  {v}" for v in _verdicts(rows)])
