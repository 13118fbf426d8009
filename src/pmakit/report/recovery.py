"""Report sections of the spike-recovery (E10) and PMA-init (E9) studies (``pmakit.lab.recovery``).

Reads RUN/experiment.json (``"study": "spike" | "init"``), RUN/results.jsonl (rows with the batch losses),
RUN/curves.csv and RUN/train_curves.csv; draws RUN/plots/*.png and returns the report's blocks, rendered by the
same markdown/html renderers as the main study. Every sentence that judges an effect is computed from the numbers:
means over seeds with their standard error over seeds (seeds are the unit of replication), and per seed the paired
difference over the fixed held-out batches.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit.report import fmt
from pmakit.report.analysis import NOISE_Z
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import RESULTS, atomic_open, read_jsonl

log = logging.getLogger(__name__)

STUDIES = ("spike", "init")
NO_INTERVENTION = "no-intervention"
PLOTS = {
    "spike_val": "spike_val_loss.png",
    "spike_train": "spike_train_loss.png",
    "init_val": "init_val_loss.png",
    "init_grad": "init_grad_norm.png",
}
COLORS = {"no-intervention": "#D55E00", "latest": "#000000", "merge": "#0072B2", "run": "#999999"}


@dataclass
class StudyData:
    """A study run's files, loaded."""

    run_dir: Path
    experiment: dict[str, Any]
    rows: list[dict[str, Any]]
    curves: list[dict[str, Any]]
    steps: list[dict[str, Any]]

    @property
    def kind(self) -> str:
        return str(self.experiment.get("study"))

    @property
    def seeds(self) -> list[int]:
        return sorted({int(r["seed"]) for r in self.rows})

    def row(self, seed: int, stage: str, model: str) -> dict[str, Any] | None:
        return next(
            (r for r in self.rows if (r["seed"], r["stage"], r["model"]) == (seed, stage, model)), None
        )


def _read_csv(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            out.append({k: _num(v) for k, v in r.items()})
    return out


def _num(v: str) -> Any:
    if v == "":
        return None
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v and "e" not in v.lower() else f


def load_study(run_dir: Path) -> StudyData:
    experiment = json.loads((run_dir / "experiment.json").read_text())
    rows = read_jsonl(run_dir / RESULTS)
    return StudyData(
        run_dir, experiment, rows, _read_csv(run_dir / "curves.csv"), _read_csv(run_dir / "train_curves.csv")
    )


# ------------------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Spread:
    """A mean over seeds and its standard error over seeds (None with one seed)."""

    mean: float
    se: float | None
    n: int

    @property
    def z(self) -> float | None:
        if self.se is None:
            return None
        return (
            math.inf * (1 if self.mean > 0 else -1)
            if self.se == 0 and self.mean
            else (self.mean / self.se if self.se else 0.0)
        )


def spread(values: Sequence[float | None]) -> Spread | None:
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None
    se = statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None
    return Spread(statistics.fmean(xs), se, len(xs))


def spread_text(s: Spread | None, *, signed: bool = False) -> str:
    if s is None:
        return fmt.MISSING
    value = f"{s.mean:+.4f}" if signed else f"{s.mean:.4f}"
    return value + (f" ± {s.se:.4f}" if s.se is not None else " (1 seed)")


T_975 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
"""Two-sided 95% critical values of Student's t by degrees of freedom (seeds - 1); 2.0 beyond 10 (the report's
usual noise bar). Few seeds make the seed-to-seed s.e. itself uncertain, so the bar is higher."""


def t_critical(n: int) -> float:
    return T_975.get(n - 1, max(2.0, NOISE_Z))


def judge_lower(s: Spread | None, subject: str, reference: str, unit: str = "nats") -> str:
    """A clause judging a difference X - Y over seeds by its t statistic (mean / s.e. over seeds)."""
    if s is None:
        return f"{subject} vs {reference}: no data"
    if s.se is None:
        return (
            f"{subject} minus {reference} is {s.mean:+.4f} {unit} on one seed only, so seed-to-seed noise cannot "
            "be judged"
        )
    t = s.mean / s.se if s.se > 0 else (math.inf if s.mean > 0 else -math.inf if s.mean < 0 else 0.0)
    crit = t_critical(s.n)
    text = f"{subject} minus {reference}: {s.mean:+.4f} ± {s.se:.4f}{' ' + unit if unit else ''} over {s.n} seeds"
    bar = f"95% two-sided needs |t| > {crit:.2f} with {s.n - 1} df"
    if t <= -crit:
        return f"{text}, so {subject} is lower (t = {t:.1f}; {bar})"
    if t >= crit:
        return f"{text}, so {subject} is higher (t = {t:+.1f}; {bar})"
    return f"{text}: not distinguishable from 0 over seeds (t = {t:+.1f}; {bar})"


def gap_along_the_way(data: StudyData, merge_arm: str, latest_arm: str) -> list[tuple[int, Spread | None]]:
    """merge minus latest held-out loss at each evaluation point both arms have in every seed (from curves.csv)."""
    by: dict[tuple[str, int], dict[int, float]] = {}
    for p in data.curves:
        if p["arm"] in (merge_arm, latest_arm) and p.get("val_loss") is not None:
            by.setdefault((str(p["arm"]), int(p["seed"])), {})[int(p["tokens"])] = float(p["val_loss"])
    seeds = data.seeds
    common: set[int] | None = None
    for s in seeds:
        pts = set(by.get((merge_arm, s), {})) & set(by.get((latest_arm, s), {}))
        common = pts if common is None else common & pts
    out = []
    for t in sorted(common or ()):
        out.append((t, spread([by[(merge_arm, s)][t] - by[(latest_arm, s)][t] for s in seeds])))
    return out


def _paired_cell(r: dict[str, Any] | None, key: str = "delta_vs_latest", se_key: str = "delta_se") -> str:
    if r is None or r.get(key) is None:
        return fmt.MISSING
    d, se = r[key], r.get(se_key)
    z = f" (z={d / se:+.1f})" if se else ""
    return f"{d:+.4f} ± {se:.4f}{z}" if se is not None else f"{d:+.4f}"


# ----------------------------------------------------------------------------------------------------- plots


def _seed_grid(n: int, per_seed: int = 1) -> tuple[Any, list[Any], list[Any]]:
    """A figure with one panel per seed (``per_seed`` stacked panels each), at most 3 seeds per row."""
    from matplotlib.figure import Figure

    cols = min(3, n)
    blocks = math.ceil(n / cols)
    rows = blocks * per_seed
    fig = Figure(figsize=(4.3 * cols + 0.6, 3.7 * rows + 0.3), layout="constrained")
    main, extra = [], []
    for i in range(n):
        b, c = divmod(i, cols)
        main.append(fig.add_subplot(rows, cols, b * per_seed * cols + c + 1))
        if per_seed > 1:
            extra.append(fig.add_subplot(rows, cols, (b * per_seed + 1) * cols + c + 1))
    return fig, main, extra


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    with atomic_open(path, "wb", fsync=False) as f:  # a figure is drawn again from the result files
        fig.savefig(f, dpi=110, format="png", facecolor="white")
    return path


def _arm_style(arm: str) -> tuple[str, str]:
    """(colour, line style): merges blue, latest black, no intervention vermillion; keep dashed, reset solid."""
    if arm == NO_INTERVENTION:
        return COLORS["no-intervention"], "-"
    if arm == "run":
        return COLORS["run"], "-"
    family, _, opt = arm.partition("/")
    color = COLORS["latest"] if family == "latest" else COLORS["merge"]
    return color, "--" if opt == "keep" else "-"


def _series(points: list[dict[str, Any]], seed: int, arm: str, y: str) -> tuple[list[float], list[float]]:
    pts = [p for p in points if p["seed"] == seed and p["arm"] == arm and p.get(y) is not None]
    pts.sort(key=lambda p: p["tokens"])
    return [p["tokens"] for p in pts], [float(p[y]) for p in pts]


def _arms_in(points: list[dict[str, Any]]) -> list[str]:
    order = {NO_INTERVENTION: 0, "run": 0}
    return sorted({str(p["arm"]) for p in points}, key=lambda a: (order.get(a, 1), a.split("/")[-1], a))


def _mark_spike(ax: Any, seed_info: dict[str, Any]) -> None:
    push = seed_info.get("push") or {}
    if push:
        ax.axvspan(push["at"], push["at"] + push["tokens"], color="#E69F00", alpha=0.15, lw=0)
    spike = seed_info.get("spike")
    if spike:
        ax.axvline(spike["start_tokens"], color="#CC79A7", lw=1.0, ls=":")
    if seed_info.get("resume_tokens") is not None:
        ax.axvline(seed_info["resume_tokens"], color="#555555", lw=0.8, ls="-.")


def _plotted(data: StudyData, key: str, train_column: str) -> tuple[list[dict[str, Any]], str, list[int]]:
    """What a plot of ``key`` ("val" or "train") draws: its points, their column, and the seeds among them."""
    points = data.curves if key == "val" else data.steps
    y = "val_loss" if key == "val" else train_column
    return points, y, sorted({int(p["seed"]) for p in points})


def plot_spike(data: StudyData, key: str, path: Path) -> Path | None:
    points, y, seeds = _plotted(data, key, "loss")
    if not points:
        return None
    zoom = key == "val"  # a second row: the arms after the resume point, on their own scale
    fig, axes, zooms = _seed_grid(len(seeds), 2 if zoom else 1)
    infos = data.experiment.get("seeds", {})
    if zoom:
        for ax, seed in zip(zooms, seeds):
            info = infos.get(str(seed), {})
            ys_all: list[float] = []
            for arm in _arms_in(points):
                if arm == NO_INTERVENTION:
                    continue
                xs, ys = _series(points, seed, arm, y)
                color, ls = _arm_style(arm)
                ax.plot(xs, ys, color=color, ls=ls, lw=1.4, marker="o", ms=2.5, label=arm)
                ys_all += ys
            _mark_spike(ax, info)
            if ys_all:
                pad = 0.05 * (max(ys_all) - min(ys_all) or 1.0)
                ax.set_ylim(min(ys_all) - pad, max(ys_all) + pad)
            if info.get("resume_tokens") is not None:
                ax.set_xlim(left=info["resume_tokens"] - 2 * (data.experiment.get("base_every_tokens") or 0))
            ax.set_title(f"seed {seed}: resumed arms only", fontsize=10)
            ax.set_xlabel("training tokens")
            ax.grid(alpha=0.3)
        zooms[0].set_ylabel("held-out loss (zoom)")
    for ax, seed in zip(axes, seeds):
        info = infos.get(str(seed), {})
        for arm in _arms_in(points):
            xs, ys = _series(points, seed, arm, y)
            if not xs:
                continue
            color, ls = _arm_style(arm)
            lw = 0.7 if key == "train" else 1.4
            ax.plot(xs, ys, color=color, ls=ls, lw=lw, label=arm, alpha=0.9 if key == "val" else 0.6)
        _mark_spike(ax, info)
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
        if key == "train":
            push = info.get("push") or {}
            if push:  # the interesting part: from a little before the push to the end
                lo = max(0, push["at"] - 2 * push["tokens"])
                ax.set_xlim(left=lo)
                finite = [float(p["loss"]) for p in points if p["seed"] == seed and p["tokens"] >= lo
                          and p.get("loss") is not None and math.isfinite(float(p["loss"]))]  # fmt: skip
                if finite:
                    ax.set_ylim(min(finite) - 0.1, min(max(finite), 12) + 0.1)
    axes[0].set_ylabel("held-out loss (nats/token)" if key == "val" else "training loss per step")
    axes[0].legend(fontsize=8, loc="upper left")
    return _save(fig, path)


def plot_init(data: StudyData, key: str, path: Path) -> Path | None:
    points, y, seeds = _plotted(data, key, "grad_norm")
    if not points:
        return None
    fig, axes, _ = _seed_grid(len(seeds))
    init = data.experiment.get("config", {}).get("init", {})
    start = init.get("init_at")
    for ax, seed in zip(axes, seeds):
        for arm in _arms_in(points):
            xs, ys = _series(points, seed, arm, y)
            if start is not None:
                keep = [i for i, x in enumerate(xs) if x >= start - 4 * (init.get("warmup_tokens") or 0)]
                xs, ys = [xs[i] for i in keep], [ys[i] for i in keep]
            if not xs:
                continue
            color = (
                COLORS["run"] if arm == "run" else COLORS["latest"] if arm == "latest" else COLORS["merge"]
            )
            ax.plot(xs, ys, color=color, lw=1.3 if key == "val" else 0.9, label=arm)
        if start is not None:
            ax.axvline(start, color="#555555", lw=0.8, ls="-.")
        ax.set_title(f"seed {seed}")
        ax.set_xlabel("training tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss (nats/token)" if key == "val" else "gradient norm (before clipping)")
    axes[0].legend(fontsize=8)
    return _save(fig, path)


def _draw(data: StudyData, jobs: dict[str, Any]) -> tuple[dict[str, Path], list[str]]:
    drawn: dict[str, Path] = {}
    failures: list[str] = []
    for name, job in jobs.items():
        path = data.run_dir / "plots" / PLOTS[name]
        try:
            out = job(path)
        except Exception as e:  # a plot must not take the tables down with it
            log.warning("report: the %s plot failed: %s", name, e, exc_info=True)
            failures.append(f"The {name} plot could not be drawn ({e.__class__.__name__}: {e}).")
            out = None
        if out is None:
            path.unlink(missing_ok=True)
        else:
            drawn[name] = out.relative_to(data.run_dir)
    return drawn, failures


# ----------------------------------------------------------------------------------------------- spike study


def _spike_arms(data: StudyData) -> list[str]:
    finals = {r["model"] for r in data.rows if r["stage"] == "final"}
    rest = sorted(finals - {NO_INTERVENTION}, key=lambda a: (a.split("/")[-1], not a.startswith("latest")))
    return ([NO_INTERVENTION] if NO_INTERVENTION in finals else []) + rest


def _merge_family(data: StudyData) -> str | None:
    for r in data.rows:
        if r["stage"] == "final" and "/" in r["model"] and not r["model"].startswith("latest"):
            return str(r["model"].split("/")[0])
    return None


def spike_blocks(data: StudyData) -> tuple[list[Block], list[Path]]:
    """The spike study's section: the setup, the detected spikes, final losses, the paired merge-vs-latest
    differences, optimizer reset vs kept, the findings, the figures and the run facts."""
    spec = data.experiment.get("config", {}).get("spike", {})
    fam = _merge_family(data) or f"{spec.get('method', 'sma')}{spec.get('last', 3)}"
    blocks = [Heading("Loss-spike recovery (paper E10)", 1), _spike_setup(data), *_spike_detections(data)]
    finals, final_findings = _spike_finals(data)
    paired, (start_finding, *paired_findings) = _spike_paired(data, fam)
    findings = [start_finding, *final_findings, *paired_findings]
    blocks += [
        *finals,
        *paired,
        *_reset_vs_keep(data, fam, findings),
        Heading("What the numbers say"),
        Bullets(findings),
    ]
    figures, drawn = _spike_figures(data)
    return [*blocks, *figures, *_run_facts(data.experiment)], drawn


def _spike_setup(data: StudyData) -> Paragraph:
    exp = data.experiment
    cfg = exp.get("config", {})
    spec, train, model = cfg.get("spike", {}), cfg.get("train", {}), exp.get("model", {})
    return Paragraph(
        f"A {model.get('parameters', 0) / 1e6:.2f}M-parameter Llama ({model.get('layers')} layers, hidden "
        f"{model.get('hidden')}) trained at a constant LR of {train.get('lr')} with a snapshot every "
        f"{fmt.tokens(train.get('every_tokens'))} tokens. At {fmt.tokens(spec.get('push_at'))} tokens the LR is "
        f"multiplied by {spec.get('push_factor')} for {fmt.tokens(spec.get('push_tokens'))} tokens (the induced "
        f"instability), then set back to the stable LR: that run, continued to "
        f"{fmt.tokens(train.get('total_tokens'))} tokens, is the **no-intervention** arm. The spike detector "
        "reads its per-step training loss; the last "
        f"{spec.get('last')} snapshots saved before the detected start are merged ({spec.get('method', '').upper()})"
        " and the arms resume at the newest of them. "
        f"**LR of the resumed arms: {exp.get('resume_lr', fmt.MISSING)}.** "
        "Optimizer: `reset` = fresh AdamW moments; `keep` = the moments saved in the full checkpoint at the "
        "resume point (the newest pre-spike snapshot). Seeds change the initialisation and the data order; "
        f"every arm of every seed is scored on the same {exp.get('eval_batches', '?')} held-out batches."
    )


def _spike_detections(data: StudyData) -> list[Block]:
    """One row per seed: where the spike started and was detected, the boundary, what was merged."""
    spec = data.experiment.get("config", {}).get("spike", {})
    infos = data.experiment.get("seeds", {})
    rows = []
    for seed in data.seeds:
        info = infos.get(str(seed), {})
        spike = info.get("spike")
        if not spike:
            rows.append([str(seed), info.get("error", "no spike"), *[fmt.MISSING] * 6])
            continue
        merged = ", ".join(fmt.tokens(m["tokens"]) for m in info.get("merged", []))
        rows.append(
            [
                str(seed),
                f"{fmt.tokens(spike['start_tokens'])} (step {spike.get('start_step')})",
                f"{fmt.tokens(spike['detected_tokens'])} (step {spike.get('detected_step')})",
                f"{spike['reason']}, loss {float(spike['loss']):.3f} vs baseline "
                f"{fmt.loss(spike.get('baseline'))}",
                fmt.tokens(info.get("boundary_tokens")),
                merged,
                fmt.tokens(info.get("resume_tokens")),
                str(info.get("false_alarms", 0)),
            ]
        )
    header = ["seed", "spike start", "detected at", "what", "boundary", "merged snapshots", "resume at"]
    return [
        Heading("The detected spike and what was merged"),
        Paragraph(
            "Snapshots strictly before the boundary (the spike's first out-of-line step minus one step, since a "
            "step's loss is measured on the weights before its update) are eligible; the merge takes the last "
            f"{spec.get('last')} of them and both families resume at the newest one. False alarms: spikes the "
            "detector reported before the push (none were acted on)."
        ),
        Table([*header, "false alarms"], rows, "lllllllr"),
    ]


def _spike_finals(data: StudyData) -> tuple[list[Block], list[str]]:
    """Every arm's final held-out loss per seed and over seeds; each arm against no intervention."""
    seeds, arms = data.seeds, _spike_arms(data)
    table = []
    controls: dict[str, Spread | None] = {}
    for arm in arms:
        rows = [data.row(s, "final", arm) for s in seeds]
        cells = [fmt.loss_se(r["val_loss"], r["val_loss_se"]) if r else fmt.MISSING for r in rows]
        final = spread([(r or {}).get("val_loss") for r in rows])
        controls[arm] = spread([(r or {}).get("delta_vs_control") for r in rows])
        delta = spread_text(controls[arm], signed=True) if arm != NO_INTERVENTION else ""
        table.append([arm, *cells, spread_text(final), delta])
    findings = []
    if NO_INTERVENTION in arms:
        findings = [judge_lower(controls[arm], f"`{arm}`", "no intervention") + "." for arm in arms[1:]]
    tokens = data.experiment.get("config", {}).get("train", {}).get("total_tokens")
    header = ["arm", *[f"seed {s}" for s in seeds], "mean ± s.e. (seeds)", "Δ vs no intervention"]
    blocks: list[Block] = [
        Heading("Final validation loss"),
        Paragraph(
            f"Held-out loss at {fmt.tokens(tokens)} tokens (per seed: ± s.e. over batches; mean: ± s.e. over "
            "seeds; Δ: arm minus the no-intervention run of the same seed, averaged over seeds)."
        ),
        Table(header, table),
    ]
    return blocks, findings


def _paired_row(data: StudyData, kind: str, arm: str, label: str) -> tuple[list[str], Spread | None]:
    """``arm`` minus the latest arm per seed (paired over batches), over seeds, and the seeds it wins."""
    seeds = data.seeds
    deltas = [(data.row(s, kind, arm) or {}).get("delta_vs_latest") for s in seeds]
    sp = spread(deltas)
    wins = sum(1 for d in deltas if (d or 0) < 0)
    cells = [_paired_cell(data.row(s, kind, arm)) for s in seeds]
    return [label, *cells, spread_text(sp, signed=True), f"{wins}/{len(seeds)}"], sp


def _spike_paired(data: StudyData, fam: str) -> tuple[list[Block], list[str]]:
    """The merge family minus the latest-snapshot family: at the start, at the end, and along the way. The first
    finding is the one about the starting weights."""
    arms, seeds = _spike_arms(data), data.seeds
    opts = sorted({a.split("/")[1] for a in arms if "/" in a})
    rows, findings = [], []
    for opt in opts:
        row, sp = _paired_row(data, "final", f"{fam}/{opt}", f"{fam} − latest, optimizer {opt}")
        rows.append(row)
        findings.append(judge_lower(sp, f"`{fam}/{opt}`", f"`latest/{opt}`") + ".")
    row, start = _paired_row(data, "start", fam, f"{fam} − latest: the starting weights")
    rows.append(row)
    findings.insert(
        0,
        judge_lower(start, f"the {fam} weights", "the latest pre-spike snapshot")
        + " (at the resume point, before any training).",
    )
    way_rows = [
        [f"optimizer {opt}", fmt.tokens(t), spread_text(sp, signed=True), _t_cell(sp)]
        for opt in opts
        for t, sp in gap_along_the_way(data, f"{fam}/{opt}", f"latest/{opt}")
    ]
    way: list[Block] = []
    if way_rows:
        way = [
            Heading(f"{fam} − latest along the way", 3),
            Paragraph(
                "The same difference at every evaluation point after the resume (held-out loss of the merge arm minus "
                "the latest arm, mean over seeds ± s.e. over seeds; t = mean / s.e.): how long the merge's head start "
                "lasts."
            ),
            Table(["optimizer", "tokens", "mean ± s.e. (seeds)", "t"], way_rows),
        ]
    blocks: list[Block] = [
        Heading(f"Paired difference: {fam} vs the latest pre-spike snapshot"),
        Paragraph(
            "Per seed: merge arm minus latest arm with the same optimizer policy, at the same tokens, paired over "
            "the held-out batches (± paired s.e., z = Δ/s.e.). Mean: over seeds ± s.e. over seeds. Negative = "
            "the merge is better. 'wins' counts the seeds where the merge arm ended lower."
        ),
        Table(["comparison", *[f"seed {s}" for s in seeds], "mean ± s.e. (seeds)", "wins"], rows),
        *way,
    ]
    return blocks, findings


def _t_cell(sp: Spread | None) -> str:
    return fmt.MISSING if sp is None or not sp.se else f"{sp.mean / sp.se:+.1f}"


def _spike_figures(data: StudyData) -> tuple[list[Block], list[Path]]:
    figs, failures = _draw(
        data,
        {
            "spike_val": lambda p: plot_spike(data, "val", p),
            "spike_train": lambda p: plot_spike(data, "train", p),
        },
    )
    marks = (
        "Shaded: the LR push; dotted: the detected spike start; dash-dot: the resume point (newest merged "
        "snapshot). Blue: the merge arms, black: the latest-snapshot arms, vermillion: no intervention; solid = "
        "optimizer reset, dashed = optimizer kept."
    )
    blocks: list[Block] = []
    if "spike_val" in figs:
        blocks.append(
            FigureBlock(
                figs["spike_val"],
                "Held-out loss of every arm, per seed",
                ["Top: the whole run; bottom: the resumed arms only, on their own scale.", marks],
            )
        )
    if "spike_train" in figs:
        blocks.append(
            FigureBlock(figs["spike_train"], "Training loss per step around the spike, per seed", [marks])
        )
    blocks += [Paragraph(f, note=True) for f in failures]
    return blocks, [data.run_dir / p for p in figs.values()]


def _reset_vs_keep(data: StudyData, fam: str, findings: list[str]) -> list[Block]:
    """Optimizer reset minus kept, per family, along the way; the last point's verdict goes to ``findings``."""
    rows = []
    for family in ("latest", fam):
        gaps = gap_along_the_way(data, f"{family}/reset", f"{family}/keep")
        for t, sp in gaps:
            rows.append([family, fmt.tokens(t), spread_text(sp, signed=True), _t_cell(sp)])
        if gaps:
            t, sp = gaps[-1]
            findings.append(
                judge_lower(sp, f"`{family}/reset`", f"`{family}/keep`")
                + f" (at {fmt.tokens(t)} tokens, from curves.csv)."
            )
    if not rows:
        return []
    return [
        Heading("Optimizer reset − kept along the way", 3),
        Paragraph(
            "Held-out loss of the reset arm minus the kept arm of the same starting weights (mean over seeds ± s.e. "
            "over seeds; t = mean / s.e.). The reset arms restart AdamW at the full LR without a warmup."
        ),
        Table(["weights", "tokens", "mean ± s.e. (seeds)", "t"], rows),
    ]


# ------------------------------------------------------------------------------------------------ init study


def init_blocks(data: StudyData) -> tuple[list[Block], list[Path]]:
    """The PMA-init study's section: the setup, held-out losses at each stage, the gap along the way, the
    findings, gradient norms, the figures and the run facts."""
    exp = data.experiment
    spec, train = exp.get("config", {}).get("init", {}), exp.get("config", {}).get("train", {})
    fam = next(
        (r["model"] for r in data.rows if r["model"] != "latest"), f"{spec.get('method')}{spec.get('n')}"
    )
    info0: dict[str, Any] = next(iter(exp.get("seeds", {}).values()), {})
    model = exp.get("model", {})
    blocks: list[Block] = [
        Heading("PMA-init: continued training from a merge (paper E9)", 1),
        Paragraph(
            f"A {model.get('parameters', 0) / 1e6:.2f}M-parameter Llama trained at a constant LR of "
            f"{train.get('lr')} to {fmt.tokens(spec.get('init_at'))} tokens (a snapshot every "
            f"{fmt.tokens(train.get('every_tokens'))}). Continued training then runs for "
            f"{fmt.tokens(spec.get('continue_tokens'))} tokens with a new schedule ({info0.get('schedule', '?')}) "
            f"and a fresh AdamW for both arms: `latest` starts from the snapshot at "
            f"{fmt.tokens(spec.get('init_at'))}, `{fam}` from the {str(spec.get('method')).upper()} of the last "
            f"{spec.get('n')} snapshots. Both see the same data. 'early' = after the first "
            f"{fmt.tokens(spec.get('early_tokens'))} tokens."
        ),
        *_init_losses(data, fam, spec.get("init_at") or 0),
        *_init_gradients(data, fam, spec.get("early_tokens")),
    ]
    figs, failures = _draw(
        data,
        {"init_val": lambda p: plot_init(data, "val", p), "init_grad": lambda p: plot_init(data, "grad", p)},
    )
    cap = (
        "Dash-dot: the start of continued training. Grey: the constant-LR run before it; black: from the "
        f"latest snapshot; blue: from {fam}."
    )
    if "init_val" in figs:
        blocks.append(
            FigureBlock(figs["init_val"], "Held-out loss during continued training, per seed", [cap])
        )
    if "init_grad" in figs:
        blocks.append(FigureBlock(figs["init_grad"], "Gradient norm per step, per seed", [cap]))
    blocks += [Paragraph(f, note=True) for f in failures]
    blocks += _run_facts(exp)
    return blocks, [data.run_dir / p for p in figs.values()]


def _init_losses(data: StudyData, fam: str, init_at: int) -> list[Block]:
    """Held-out loss of both arms at the start, early and at the end; the gap along the way; the findings."""
    seeds = data.seeds
    header = ["stage", "arm", *[f"seed {s}" for s in seeds], "mean ± s.e. (seeds)", "Δ vs latest (paired, per seed)",
              "Δ mean ± s.e. (seeds)"]  # fmt: skip
    table, findings = [], []
    for stage in ("start", "early", "final"):
        for arm in ("latest", fam):
            rows = [data.row(s, stage, arm) for s in seeds]
            cells = [fmt.loss_se(r["val_loss"], r["val_loss_se"]) if r else fmt.MISSING for r in rows]
            sp = spread([(r or {}).get("val_loss") for r in rows])
            dsp = spread([(r or {}).get("delta_vs_latest") for r in rows])
            merged = arm != "latest"
            paired = "; ".join(_paired_cell(r) for r in rows) if merged else ""
            table.append(
                [stage, arm, *cells, spread_text(sp), paired, spread_text(dsp, signed=True) if merged else ""]
            )
            if merged:
                findings.append(f"{stage}: " + judge_lower(dsp, f"`{fam}`", "`latest`") + ".")
    way_rows = [
        [fmt.tokens(t), fmt.tokens(t - init_at), spread_text(sp, signed=True), _t_cell(sp)]
        for t, sp in gap_along_the_way(data, fam, "latest")
    ]
    blocks: list[Block] = [Heading("Held-out loss"), Table(header, table)]
    if way_rows:
        blocks += [
            Heading(f"{fam} − latest along the way", 3),
            Paragraph(
                "Held-out loss of the merge arm minus the latest arm at every evaluation point of the continued "
                "training (mean over seeds ± s.e. over seeds; t = mean / s.e.): how long the merge's head start lasts."
            ),
            Table(["tokens", "into continued training", "mean ± s.e. (seeds)", "t"], way_rows),
        ]
    return [*blocks, Heading("What the numbers say"), Bullets(findings)]


def _init_gradients(data: StudyData, fam: str, early_tokens: int | None) -> list[Block]:
    """Gradient-norm mean, max and roughness per arm, early and over the whole continued training."""
    seeds = data.seeds
    rows = []
    for arm in ("latest", fam):
        for stage in ("early", "final"):
            cells = [
                spread_text(spread([(data.row(s, stage, arm) or {}).get(key) for s in seeds]))
                for key in ("grad_norm_mean", "grad_norm_max", "grad_norm_tv")
            ]
            rows.append([arm, "first " + fmt.tokens(early_tokens) if stage == "early" else "all", *cells])
    findings = []
    for key, what in (("grad_norm_mean", "mean gradient norm"), ("grad_norm_tv", "step-to-step change")):
        diffs = []
        for s in seeds:
            a, b = data.row(s, "early", fam), data.row(s, "early", "latest")
            if a and b and a.get(key) is not None and b.get(key) is not None:
                diffs.append(a[key] - b[key])
        findings.append(
            judge_lower(spread(diffs), f"the {what} of `{fam}` (early)", "`latest`", unit="") + "."
        )
    return [
        Heading("Gradient norm"),
        Paragraph(
            "Per-step gradient norm before clipping: mean, maximum, and mean absolute step-to-step change (a "
            "roughness measure), averaged over seeds ± s.e. over seeds."
        ),
        Table(["arm", "steps", "mean", "max", "step-to-step change"], rows),
        Bullets(findings),
    ]


def _total_seconds(exp: dict[str, Any]) -> float | None:
    calls = exp.get("invocations") or []
    return sum(c.get("seconds") or 0 for c in calls) or exp.get("seconds", {}).get("total")


def _run_facts(exp: dict[str, Any]) -> list[Block]:
    sec = exp.get("seconds", {})
    load = exp.get("load_average", {})
    calls = exp.get("invocations") or []
    wall = sum(c.get("seconds") or 0 for c in calls) or sec.get("total")
    cpu = sum(c.get("cpu_seconds") or 0 for c in calls) or sec.get("cpu")
    items = [
        f"Wall time {fmt.seconds(wall)}, CPU time {fmt.seconds(cpu)} (process user + system) over "
        f"{max(1, len(calls))} invocation(s); {exp.get('cpus')} CPUs, {exp.get('threads')} torch threads.",
        *[
            f"Invocation {i}: seeds {c.get('seeds')}, {fmt.seconds(c.get('seconds'))} wall, "
            f"{fmt.seconds(c.get('cpu_seconds'))} CPU, load average {c.get('load_average_before')} -> "
            f"{c.get('load_average_after')}."
            for i, c in enumerate(calls, start=1)
            if len(calls) > 1
        ],
        f"Load average (1/5/15 min) before: {load.get('before')}, after: {load.get('after')} (other processes "
        "on the machine slow the wall time down).",
        f"pmakit {exp.get('pmakit_version')}, torch {exp.get('torch_version')}; started {exp.get('started')}, "
        f"finished {exp.get('finished')}.",
    ]
    return [Heading("Run"), Bullets(items)]


# ----------------------------------------------------------------------------------------------- entry points


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    data = load_study(run_dir)
    if data.kind == "spike":
        return spike_blocks(data)
    return init_blocks(data)


def _short(sp: Spread | None) -> str:
    """'+0.0058 ± 0.0030 (t=+1.9, 5 seeds; 95% needs |t|>2.78)'"""
    if sp is None:
        return fmt.MISSING
    if not sp.se:
        return f"{sp.mean:+.4f} ({sp.n} seed)"
    return f"{sp.mean:+.4f} ± {sp.se:.4f} (t={sp.mean / sp.se:+.1f}, {sp.n} seeds; 95% needs |t|>{t_critical(sp.n):.2f})"


def summary(run_dir: Path) -> str:
    """One terminal screen: the final losses per arm and the paired merge-vs-latest verdicts."""
    data = load_study(run_dir)
    exp, seeds = data.experiment, data.seeds
    lines = [f"{'Spike-recovery' if data.kind == 'spike' else 'PMA-init'} study: {run_dir} "
             f"(preset {exp.get('preset')}, {len(seeds)} seeds, {fmt.seconds(_total_seconds(exp))} wall)"]  # fmt: skip
    if data.kind == "spike":
        lines.append(f"Resumed arms' LR: {exp.get('resume_lr')}")
        for s in seeds:
            info = exp.get("seeds", {}).get(str(s), {})
            spike = info.get("spike")
            lines.append(
                f"  seed {s}: spike from {fmt.tokens(spike['start_tokens'])} tokens (z={float(spike['z']):.0f}), "
                f"merged {', '.join(fmt.tokens(m['tokens']) for m in info.get('merged', []))}"
                if spike
                else f"  seed {s}: {info.get('error', 'no spike')}"
            )
        for arm in _spike_arms(data):
            sp = spread([(data.row(s, "final", arm) or {}).get("val_loss") for s in seeds])
            lines.append(f"  {arm:<18} final val loss {spread_text(sp)}")
        fam = _merge_family(data)
        for opt in sorted({a.split("/")[1] for a in _spike_arms(data) if "/" in a}):
            sp = spread([(data.row(s, "final", f"{fam}/{opt}") or {}).get("delta_vs_latest") for s in seeds])
            lines.append(f"  {fam}/{opt} − latest/{opt}: {_short(sp)}")
    else:
        fam = next((r["model"] for r in data.rows if r["model"] != "latest"), "merge")
        for stage in ("start", "early", "final"):
            a = spread([(data.row(s, stage, "latest") or {}).get("val_loss") for s in seeds])
            b = spread([(data.row(s, stage, fam) or {}).get("val_loss") for s in seeds])
            d = spread([(data.row(s, stage, fam) or {}).get("delta_vs_latest") for s in seeds])
            lines.append(
                f"  {stage:<6} latest {spread_text(a)}  {fam} {spread_text(b)}  Δ {spread_text(d, signed=True)}"
            )
    page = run_dir / "report.html"
    lines.append(f"Report: {page}" if page.is_file() else f"Report: not written yet ({page})")
    return "\n".join(lines)
