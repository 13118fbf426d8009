"""The report's content as a list of neutral blocks (headings, paragraphs, tables, figures).

Markdown and HTML are two renderings of the same blocks (markdown.py, html.py), so both say exactly the same
thing. Every number comes from the run's files through analysis.py; every sentence that judges an outcome is
chosen by a computed z-score, never written in advance.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmakit.report import fmt
from pmakit.report.analysis import (
    ForkSummary,
    Gain,
    Ratio,
    StablePoint,
    compare,
    difference,
    gain_over_latest,
    judge,
    sweep,
    verdict,
    weighting_key,
    weighting_label,
    weighting_rows,
    weighting_sort_key,
)
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.report.load import Row, RunData
from pmakit.weights import uses_alpha


@dataclass
class Figures:
    """Relative paths of the plots that were drawn (None = not drawn) and the settings they used."""

    curves: Path | None = None
    """Loss vs tokens."""
    fork_gains: Path | None = None
    """Best merges and anneal vs latest at each fork."""
    heatmap: Path | None = None
    """SMA N x V per fork."""
    weightings: Path | None = None
    """Weightings side by side."""
    sweeps: Path | None = None
    """N and V sweeps."""
    plane: Path | None = None
    """Loss on a plane through the snapshots (report/plane.py)."""
    spectrum: Path | None = None
    """Power spectrum of the snapshot trajectory with the merge windows' gains (report/spectrum.py)."""
    weightings_v: int | None = None
    """The interval V of the weightings plot."""
    sweep_v: int | None = None
    """The V held fixed in the N sweep."""
    sweep_n: int | None = None
    """The N held fixed in the V sweep."""
    failures: list[str] = field(default_factory=list)
    """Plots that could not be drawn, for the notes."""


def describe(row: Row | None, base: int | None) -> str:
    """The model's label for tables and sentences."""
    if row is None:
        return fmt.MISSING
    return fmt.merge_label(row.label, row.method, row.n, row.v_tokens, base)


def delta_text(g: Gain | None) -> str:
    """Δ vs latest ± paired s.e."""
    return fmt.signed_se(None if g is None else -g.value, None if g is None else g.se)


def z_text(g: Gain | None) -> str:
    """Δ / paired s.e."""
    return fmt.z(None if g is None or g.z is None else -g.z)


def with_z(g: Gain | None) -> str:
    """-0.0123 ± 0.0010 (-12.3)"""
    return delta_text(g) + (f" ({z_text(g)})" if g is not None and g.z is not None else "")


def gap_text(r: Ratio | None) -> str:
    """merge − anneal ± its paired s.e., or ± ≤ an upper bound of it."""
    if r is None:
        return fmt.MISSING
    return fmt.signed_se(r.value, r.se_bound, bound=not r.exact)


def recovered_text(r: Ratio | None) -> str:
    """88% (s.e. 3%), or (s.e. ≤ 3%) when only bounded."""
    if r is None:
        return fmt.MISSING
    return fmt.percent(r.value, r.se_bound, bound=not r.exact)


def recovered_cell(fork: ForkSummary, row: Row | None) -> str:
    """The share of the anneal's gain ``row`` recovers, or why it is not given."""
    if fork.anneal_within_noise:
        return f"{fmt.MISSING} (anneal within noise)"
    return recovered_text(fork.recovered(row))


# --- headline --------------------------------------------------------------------------------------------


def headline(fork: ForkSummary, index: int, base: int | None) -> list[Block]:
    """Latest vs the chosen merges vs the fixed recipe vs annealed at the final fork, with sentences computed from
    the z-scores; on the test split when the run has one."""
    t = fork.headline
    where = (
        "on the TEST split (held-out text disjoint from the selection split on which every choice below was "
        "made)"
        if fork.test is not None
        else "on the same held-out batches, which also chose the best merges (an older run: no test split)"
    )
    blocks: list[Block] = [
        Heading(f"Headline: final fork F{index}"),
        Paragraph(
            f"The constant-LR run was forked at {fmt.tokens(fork.fork_tokens)} tokens: one branch kept the LR, "
            f"one annealed it for {fmt.tokens(fork.anneal_tokens)} tokens. Every model below is evaluated at "
            f"{fmt.tokens(fork.eval_tokens)} tokens {where}; Δ = model − latest snapshot (negative = better), "
            "with the paired standard error of that difference over the same batches."
        ),
    ]
    rows = []
    for name, row in headline_models(t, base):
        if row is None:
            rows.append([name, "not in results", "", "", "", "", "", ""])
            continue
        g = None if row is t.latest else t.gain(row)
        merged = row is not t.latest and row is not t.annealed
        rows.append(
            [
                name,
                fmt.tokens(row.tokens),
                fmt.loss_se(row.val_loss, row.val_loss_se),
                fmt.loss(row.bpb),
                delta_text(g),
                z_text(g),
                gap_text(t.gap_to_anneal(row)) if merged and t.annealed is not None else "",
                recovered_cell(t, row) if merged else "",
            ]
        )
    header = [
        "model",
        "tokens",
        "loss ± s.e.",
        "bits/byte",
        "Δ vs latest ± paired s.e.",
        "Δ / s.e.",
        "merge − anneal ± paired s.e.",
        "recovered",
    ]
    blocks.append(Table(header, rows))
    blocks.append(Bullets(headline_sentences(fork, base)))
    return blocks


def headline_models(t: ForkSummary, base: int | None) -> list[tuple[str, Row | None]]:
    """The headline's rows: latest, the chosen merges, the fixed recipe, the tuned merge, the anneal."""
    chosen = " (chosen on selection)" if t.role("best") is not None else ""  # else: the lowest of these rows
    out: list[tuple[str, Row | None]] = [("latest snapshot", t.latest)]
    best, best_sma = t.best_merge, t.best_sma
    if best is not None:
        out.append((f"best merge{chosen}: {describe(best, base)}", best))
    if best_sma is not None and best_sma is not best:
        out.append((f"best SMA{chosen}: {describe(best_sma, base)}", best_sma))
    for role, name in (
        ("fixed", "fixed recipe, no selection"),
        ("tuned", "pmakit tune, chosen on selection"),
    ):
        row = t.role(role)
        if row is not None:
            out.append((f"{name}: {describe(row, base) if role == 'fixed' else row.label}", row))
    if t.oracle is not None:
        out.append(
            (f"best SMA on this split itself (oracle, not a choice): {describe(t.oracle, base)}", t.oracle)
        )
    out.append(("annealed branch", t.annealed))
    return out


def headline_sentences(fork: ForkSummary, base: int | None) -> list[str]:
    """The computed verdicts under the headline table."""
    out: list[str] = []
    t = fork.headline
    best, anneal = t.best_merge, t.annealed
    g_best, g_anneal = t.gain(best), t.gain(anneal)
    if t.latest is None:
        out.append("The latest snapshot at this fork is not in results.csv, so no gain can be shown.")
    if best is not None and g_best is not None:
        if fork.test is not None:
            how = (
                f"It was chosen as the lowest of {len(fork.merges)} merges on the selection split and is scored "
                "here on the disjoint test split, so the choice does not flatter it."
            )
        else:
            how = (
                f"It is the lowest of {len(fork.merges)} merges evaluated here; picking the minimum after the "
                "fact flatters it slightly when many merges are within noise of each other."
            )
        out.append(
            f"The best merge ({describe(best, base)}) changes the loss by {delta_text(g_best)} (paired s.e.): "
            + verdict(g_best.z, "it")
            + f". {how}"
        )
    elif best is None:
        out.append("No merged model was evaluated at this fork.")
    sma = t.best_sma
    if sma is not None and sma is not best:
        g = t.gain(sma)
        if g is not None:
            text = f"The best SMA ({describe(sma, base)}): Δ {delta_text(g)}; " + verdict(g.z, "it")
            rec = t.recovered(sma)
            if rec is not None:
                text += f"; it recovers {recovered_text(rec)} of the anneal's gain"
            out.append(text + ".")
    for role, subject in (("fixed", "The fixed recipe (no selection)"), ("tuned", "The tuned merge")):
        row = t.role(role)
        g = t.gain(row)
        if row is not None and g is not None:
            text = f"{subject}: Δ {delta_text(g)}; " + verdict(g.z, "it")
            gap = t.gap_to_anneal(row)
            if gap is not None and anneal is not None:
                text += f"; − annealed: {gap_text(gap)} ({gap_verdict(gap)})"
            out.append(text + ".")
    oracle = t.oracle
    gap = t.gap_to_anneal(oracle)
    if oracle is not None and gap is not None and anneal is not None:
        cells = sum(r.role == "oracle" for r in t.merges)
        out.append(
            f"For scale, not a choice: the best of {cells} SMA windows scored on this split itself "
            f"({describe(oracle, base)}) − annealed: {gap_text(gap)} ({gap_verdict(gap)}); no choice among those "
            "windows, however made, does better here."
        )
    if anneal is None:
        out.append(
            "No annealed branch is in results.csv for this fork, so the merge cannot be compared to it."
        )
        return out
    if g_anneal is not None:
        out.append(f"The annealed branch: Δ {delta_text(g_anneal)}; " + verdict(g_anneal.z, "it") + ".")
    out.extend(_anneal_sentences(t, best, g_anneal))
    return out


def _anneal_sentences(fork: ForkSummary, best: Row | None, g_anneal: Gain | None) -> list[str]:
    out = []
    rec = fork.recovered(best)
    if rec is not None:
        text = (
            "Share of the anneal's gain recovered by the best merge, (latest − merged) / (latest − annealed): "
            f"{recovered_text(rec)}"
        )
        out.append(text + ".")
    elif best is not None and fork.anneal_within_noise and g_anneal is not None:
        out.append(
            f"The anneal's own gain over the latest snapshot is within noise ({g_anneal.z:.1f} paired standard "
            "errors), so the share of it a merge recovers is not given: a ratio over a denominator that may be zero."
        )
    elif best is not None and g_anneal is not None:
        out.append(
            "The anneal did not lower the loss below the latest snapshot, so the share of its gain a merge "
            "recovers is undefined."
        )
    g = fork.gap_to_anneal(best)
    if g is not None:
        out.append(f"Best merge − annealed: {gap_text(g)} ({gap_verdict(g)}).")
    return out


def gap_verdict(g: Ratio) -> str:
    """Judge merge − anneal (paired over batches when the results carry batch losses, else bounded)."""
    return judge(g, "the anneal is better", "the merge is better")


# --- per-fork table --------------------------------------------------------------------------------------


def fork_table(forks: Sequence[ForkSummary], base: int | None) -> list[Block]:
    """One row per fork: gain of the best merge over latest and its gap to the anneal."""
    rows = []
    tested = all(f.test is not None for f in forks)
    for i, f in enumerate(forks, start=1):
        f = f.headline  # the test split's rows and the merges chosen on the selection split, when there are
        best = f.best_merge
        latest = f.latest
        rows.append(
            [
                f"F{i} at {fmt.tokens(f.fork_tokens)}",
                fmt.tokens(f.anneal_tokens),
                fmt.tokens(f.eval_tokens),
                fmt.loss_se(latest.val_loss, latest.val_loss_se) if latest else fmt.MISSING,
                describe(best, base),
                with_z(f.gain(best)),
                with_z(f.gain(f.annealed)),
                gap_text(f.gap_to_anneal(best)),
                recovered_cell(f, best),
            ]
        )
    header = [
        "fork",
        "anneal D",
        "eval at",
        "latest ± s.e.",
        "best merge",
        "merge Δ ± s.e. (Δ/s.e.)",
        "anneal Δ ± s.e. (Δ/s.e.)",
        "merge − anneal ± s.e.",
        "recovered",
    ]
    blocks: list[Block] = [
        Heading("At each fork"),
        Paragraph(
            (
                "Every number is on the TEST split; the best merge was chosen on the selection split. "
                if tested
                else ""
            )
            + "Δ is the model's val loss minus the latest snapshot's at the same tokens, ± its paired s.e. over the "
            "same validation batches. 'recovered' = (latest − merged) / (latest − annealed), with its "
            "first-order s.e.; not given where the anneal's own gain is within noise (under two of its paired "
            "s.e.). The s.e. of merge − anneal and of 'recovered' are paired over the batches when "
            "results.jsonl has the per-batch losses; otherwise only an upper bound is known (shown as ≤, valid "
            "for any correlation)."
        ),
        Table(header, rows, align="lrrrlrrrr"),
    ]
    sentences = []
    for i, f in enumerate(forks, start=1):
        g = f.headline.gain(f.headline.best_merge)
        if g is not None:
            sentences.append(f"F{i}: " + verdict(g.z, "the best merge") + ".")
    if sentences:
        blocks.append(Bullets(sentences))
    return blocks


def stable_table(points: Sequence[StablePoint], base: int | None) -> list[Block]:
    """Latest vs the best merge at points of the stable phase outside the forks (paper E1)."""
    rows = []
    for p in points:
        best = p.best_merge
        g = gain_over_latest(best, p.latest)
        rows.append(
            [
                fmt.tokens(p.tokens),
                fmt.loss_se(p.latest.val_loss, p.latest.val_loss_se) if p.latest else fmt.MISSING,
                describe(best, base),
                fmt.loss_se(best.val_loss, best.val_loss_se) if best else fmt.MISSING,
                delta_text(g),
                z_text(g),
            ]
        )
    return [
        Heading("Along the stable phase (E1)"),
        Paragraph(
            "Merges of the snapshots ending at points of the constant-LR phase, against the latest snapshot "
            "there. The paper finds merged stable-phase snapshots beat the latest one."
        ),
        Table(
            ["tokens", "latest ± s.e.", "best merge", "merged ± s.e.", "Δ ± paired s.e.", "Δ / s.e."],
            rows,
            align="rrlrrr",
        ),
    ]


# --- figures ---------------------------------------------------------------------------------------------


def figure_blocks(forks: Sequence[ForkSummary], figs: Figures, base: int | None) -> list[Block]:
    """Each drawn plot with its caption."""
    out: list[Block] = []
    if figs.curves:
        out.append(
            FigureBlock(
                figs.curves,
                "Validation loss vs tokens",
                [
                    "Left: the online evaluations made during training, on the trainer's few held-out "
                    "batches. Black: the latest snapshot of the constant-LR run. Blue: the online merge of its "
                    "recent snapshots. Vermillion: each anneal branch, forked at a dotted line (F1, F2, ...) and "
                    "decayed to LR ≈ 0. Right, one panel per fork: the latest snapshot (dot), the best merge (star) "
                    "and the anneal (diamond) at F + D, exactly the tables' numbers (the final evaluation, on more "
                    "batches). The two are drawn apart because the online and final evaluations use different "
                    "batches: the same model at the same tokens differs between them by sampling noise. Per-model "
                    "s.e. bands are left out: the models are compared on the same batches, so the paired s.e. in "
                    "the tables is the right yardstick.",
                    "Paper (findings 1, 2): the merge sits below the constant-LR curve and close to the anneal; "
                    "early in a fork it is clearly better, late the anneal catches up or edges ahead slightly.",
                ],
            )
        )
    if figs.fork_gains:
        out.append(
            FigureBlock(
                figs.fork_gains,
                "Gain over the latest snapshot at each fork",
                [
                    "Bars: Δ vs the latest snapshot (below zero = better) of the best SMA, of the best merge of "
                    "any weighting when that is not SMA (hatched), and of the anneal branch; error bars are paired "
                    "s.e.",
                    *[s for s in (_fork_gap_sentence(i, f) for i, f in enumerate(forks, start=1)) if s],
                ],
            )
        )
    if figs.heatmap:
        out.append(FigureBlock(figs.heatmap, "SMA over N and V", _heatmap_caption(forks, base)))
    if figs.weightings:
        out.append(
            FigureBlock(
                figs.weightings,
                "Weightings side by side",
                _weightings_caption(forks, figs.weightings_v, base),
            )
        )
    if figs.sweeps:
        out.append(FigureBlock(figs.sweeps, "N sweep and V sweep", _sweeps_caption(forks, figs, base)))
    return out


def _fork_gap_sentence(i: int, f: ForkSummary) -> str:
    f = f.headline
    g = f.gap_to_anneal(f.best_merge)
    if g is None:
        return ""
    return f"F{i}: best merge − annealed = {gap_text(g)}, {gap_verdict(g)}."


def _heatmap_caption(forks: Sequence[ForkSummary], base: int | None) -> list[str]:
    lines = [
        "Each cell: Δ val loss of an SMA merge vs the latest snapshot (blue = better, red = worse) and its z-score "
        "(Δ / paired s.e.), for N snapshots spaced V apart; one panel per fork.",
        "Paper (findings 5, 6): early in training a large V or N pulls in stale weights and can be worse than no "
        "merge; later, larger N helps.",
    ]
    for i, f in enumerate(forks, start=1):
        cells = [(r, f.gain(r)) for r in f.merges if r.method == "sma" and r.n and r.v_tokens]
        scored = [(r, g) for r, g in cells if g is not None]
        if len(scored) < 2:
            continue
        best = max(scored, key=lambda c: c[1].value)
        worst = min(scored, key=lambda c: c[1].value)
        lines.append(
            f"F{i}: best cell N={best[0].n}, V={fmt.interval(best[0].v_tokens, base)} (Δ {delta_text(best[1])}); "
            f"worst N={worst[0].n}, V={fmt.interval(worst[0].v_tokens, base)} (Δ {delta_text(worst[1])}), "
            + verdict(worst[1].z, "which")
            + "."
        )
    return lines


def _weightings_caption(forks: Sequence[ForkSummary], v: int | None, base: int | None) -> list[str]:
    lines = [
        f"Bars: Δ vs the latest snapshot for each weighting at V = {fmt.interval(v, base)} (the interval with "
        "the most weightings evaluated), grouped by the N values where two or more weightings were evaluated; "
        "error bars are paired s.e.",
        "Paper (finding 4): early in training WMA and EMA with the larger α, which weight recent snapshots more, are best; "
        "later the differences between weightings shrink to noise.",
    ]
    for i, f in enumerate(forks, start=1):
        rows = [(r, f.gain(r)) for r in weighting_rows(f, v)]
        scored = [(r, g) for r, g in rows if g is not None]
        if len({weighting_key(r) for r, _ in scored}) < 2:
            continue
        best_r, best_g = max(scored, key=lambda c: c[1].value)
        same_n = [(r, g) for r, g in scored if r.n == best_r.n and r is not best_r]
        text = f"F{i}: best is {weighting_label(weighting_key(best_r))} N={best_r.n} (Δ {delta_text(best_g)})"
        if same_n:
            runner, g2 = max(same_n, key=lambda c: c[1].value)
            d = compare(runner, best_r, f.latest) or difference(best_g, g2)
            best_name = weighting_label(weighting_key(best_r))
            text += (
                f"; next at the same N, {weighting_label(weighting_key(runner))} has a loss higher by "
                f"{gap_text(d)}: " + judge(d, f"{best_name} is ahead", f"{best_name} is behind")
            )
        lines.append(text + ".")
    verdict_line = _finding_4_verdict(forks, v)
    return lines + ([verdict_line] if verdict_line else [])


def _finding_4_verdict(forks: Sequence[ForkSummary], v: int | None) -> str | None:
    """Whether the earliest fork agrees with finding 4 (a recency-weighted merge best early), from its numbers."""
    scored = (
        [(r, f_g) for r in weighting_rows(forks[0], v) if (f_g := forks[0].gain(r)) is not None]
        if forks
        else []
    )
    if len({weighting_key(r) for r, _ in scored}) < 2:
        return None
    best = max(scored, key=lambda c: c[1].value)[0]
    key = weighting_key(best)
    head = "the paper's finding 4 (early in training, WMA and EMA with the larger α are best) at its earliest fork"
    if key == "wma":
        return f"This run agrees with {head}: the best weighting there is WMA."
    if not uses_alpha(best.method) or best.alpha is None:
        return (
            f"This run does not agree with {head}: the best weighting there is {weighting_label(key)}, which "
            "does not weight recent snapshots more."
        )
    # EMA with a smaller α weights recent snapshots less: the finding is about the larger α
    alphas = sorted({r.alpha for r, _ in scored if r.method == best.method and r.alpha is not None})
    if best.alpha < alphas[-1]:
        return (
            f"This run does not agree with {head}: the best weighting there is {weighting_label(key)}, the "
            f"smaller α of those evaluated ({', '.join(f'{a:g}' for a in alphas)}), which weights recent "
            "snapshots less."
        )
    return f"This run agrees with {head}: the best weighting there is {weighting_label(key)}."


def _sweeps_caption(forks: Sequence[ForkSummary], figs: Figures, base: int | None) -> list[str]:
    lines = [
        f"Left: SMA with N snapshots at V = {fmt.interval(figs.sweep_v, base)}. Right: SMA with N = "
        f"{figs.sweep_n if figs.sweep_n is not None else fmt.MISSING} at increasing V (the N evaluated at the "
        "most V). One line per fork, light = early, dark = late; error bars are paired s.e.; the dashed line is "
        "the latest snapshot.",
        "Paper (findings 5, 6): too large V early is worse than no merge; large N hurts early and helps late.",
    ]
    for i, f in enumerate(forks, start=1):
        parts = []
        for name, pts, shown in (
            ("N", sweep(f, method="sma", v=figs.sweep_v) if figs.sweep_v else [], lambda x: str(x)),
            (
                "V",
                sweep(f, method="sma", n=figs.sweep_n) if figs.sweep_n else [],
                lambda x: fmt.interval(x, base),
            ),
        ):
            if len(pts) < 2:
                continue
            x_best, g_best = max(pts, key=lambda p: p[1].value)
            x_last, g_last = pts[-1]
            text = f"best {name} = {shown(x_best)} (Δ {delta_text(g_best)})"
            if x_last != x_best:
                text += f", largest {name} = {shown(x_last)}: " + verdict(g_last.z, "it")
            parts.append(text)
        if parts:
            lines.append(f"F{i}: " + "; ".join(parts) + ".")
    return lines


# --- run description -------------------------------------------------------------------------------------


def _value(v: Any) -> str:
    if isinstance(v, float | int) and not isinstance(v, bool):
        return repr(v)
    if isinstance(v, str):
        return v
    return json.dumps(v, ensure_ascii=False)


def flatten(d: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    """{'a': {'b': 1}} -> [('a.b', '1')], keeping the file's order."""
    out: list[tuple[str, str]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.extend(flatten(v, key + "."))
        else:
            out.append((key, _value(v)))
    return out


_SECTIONS = (("model", "Model"), ("corpus", "Corpus"), ("seconds", "Time (seconds)"))
_FACTS = ("preset", "pmakit_version", "started", "finished")
_TOKEN_FACTS = ("tokens_per_step", "base_every_tokens")


def _section_rows(key: str, part: dict[str, Any]) -> list[list[str]]:
    rows = []
    for k, v in flatten(part):
        raw = part.get(k)
        if key == "seconds" and isinstance(raw, int | float):
            v = fmt.seconds(float(raw))
        elif key == "model" and k == "parameters" and isinstance(raw, int | float):
            v = f"{v} ({fmt.tokens(raw)})"
        rows.append([k, v])
    return rows


def _headline_merge(info: Any, run_dir: Path) -> list[Block]:
    """The merged model the experiment wrote to disk, if it says so."""
    if not isinstance(info, dict) or not isinstance(info.get("path"), str):
        return []
    # Relative to the study; older studies recorded it as they were named (absolute or cwd-relative).
    recorded = Path(info["path"])
    inside = run_dir / recorded
    path = inside if not recorded.is_absolute() and inside.exists() else recorded
    shown = path.relative_to(run_dir) if path.is_relative_to(run_dir) else path
    label = f" ({info['label']})" if isinstance(info.get("label"), str) else ""
    return [Paragraph(f"Merged model written by the experiment{label}: `{shown.as_posix()}`.")]


def compute_blocks(experiment: dict[str, Any], rows: Sequence[Row] = ()) -> list[Block]:
    """What each way to the annealed quality costs: the anneal's extra training tokens against reading N snapshots
    and the tuner's forward-only evaluations, in training-token equivalents (a forward pass is about a third of a
    training step's compute, 2N vs 6N FLOPs per token). A tuned row's evaluations (trials the grid had not already
    scored) are what the search cost; without that record, every trial counts."""
    forks = [f for f in experiment.get("forks") or [] if isinstance(f, dict)]
    config = experiment.get("config") or {}
    train, exp = config.get("train") or {}, config.get("experiment") or {}
    params = (experiment.get("model") or {}).get("parameters")
    seq = (train.get("model") or {}).get("seq_len")
    held = experiment.get("heldout") if isinstance(experiment.get("heldout"), dict) else None
    batches = (held or {}).get("batches", {}).get("selection") or exp.get(
        "eval_batches"
    )  # as scored, else asked
    per_eval = _product(batches, train.get("batch_size"), seq)
    if not forks or not params or per_eval is None:
        return []
    per_batch = per_eval // int(batches or 1)  # per_eval is a product of positive ints, batches one of them
    budget = int(exp.get("tune_evals") or 0)
    tuned = {r.fork_tokens: r for r in rows if r.tune_trials is not None}
    table = []
    for i, f in enumerate(forks, start=1):
        d, e = f.get("anneal_tokens"), f.get("eval_tokens")
        if not isinstance(d, int) or not isinstance(e, int) or d <= 0:
            continue
        row = tuned.get(f.get("fork_tokens"))
        table.append(
            [
                f"F{i}",
                fmt.tokens(d),
                f"{100 * d / e:.1f}%",
                f"{10 * params * 4 / 1e6:.1f} MB",
                _tuner_cost(row, budget, per_eval, per_batch, d),
            ]
        )
    seconds: dict[str, Any] = experiment["seconds"] if isinstance(experiment.get("seconds"), dict) else {}
    timing = (
        f" Measured here: the anneal branches took {fmt.seconds(seconds['anneal'])} of training; every merge "
        f"evaluation of the study (grid, test split and tuner) {fmt.seconds(seconds['merge_eval'])}."
        if isinstance(seconds.get("anneal"), int | float)
        and isinstance(seconds.get("merge_eval"), int | float)
        else ""
    )
    return [
        Heading("Compute: anneal vs merge"),
        Paragraph(
            "The anneal costs D more training tokens per fork point (its share of the run at F + D below). The "
            "fixed recipe costs reading 10 snapshots (fp32 size shown) and no training; the tuner costs its "
            "trials' forward-only evaluations on the selection split (a trial stopped early, clearly worse than "
            "the best so far, counts the batches it scored), in training-token equivalents (a forward pass is "
            "about a third of a training step), plus the forward and backward passes that fit its learned "
            "weights (a training step each)." + timing
        ),
        # the tuner's cell is a sentence: left-aligned so that it wraps (a right-aligned cell does not)
        Table(["fork", "anneal D", "D / run", "fixed recipe reads", "tuner evaluations"], table, "lrrrl"),
    ]


def _tuner_cost(row: Row | None, budget: int, per_eval: int, per_batch: int, anneal: int) -> str:
    """The tuner's forward-only tokens at one fork, in training-token equivalents (a third of a training token)."""
    trials = (row and row.tune_trials) or budget
    if not trials:
        return "–"
    evals = row.tune_evaluations if row and row.tune_evaluations is not None else trials
    notes = [f"{trials - evals} of {trials} trials reused the grid's scores"] if evals < trials else []
    if row and row.tune_batches is not None:  # racing: trials stopped early scored fewer batches
        scored = f"{row.tune_batches} batches x {fmt.tokens(per_batch)}"
        tuner = row.tune_batches * per_batch / 3
        if row.tune_stopped:
            notes.append(f"{row.tune_stopped} stopped early, clearly worse")
    else:
        scored, tuner = f"{evals} x {fmt.tokens(per_eval)}", evals * per_eval / 3
    scored = f"{scored} tokens / 3"
    if row and row.tune_learned:  # forward and backward: a training step's tokens each
        scored += f" + learned weights {row.tune_learned} x {fmt.tokens(per_batch)}"
        tuner += row.tune_learned * per_batch
    tail = f" ({'; '.join(notes)})" if notes else ""
    return f"{scored} = {fmt.tokens(tuner)} ({100 * tuner / anneal:.0f}% of D){tail}"


def _product(*xs: Any) -> int | None:
    if not all(isinstance(x, int) and x > 0 for x in xs):
        return None
    out = 1
    for x in xs:
        out *= x
    return out


def run_blocks(experiment: dict[str, Any], run_dir: Path) -> list[Block]:
    """Model, corpus, timings, fork plan and every configuration knob, from experiment.json as written."""
    if not experiment:
        return []
    blocks: list[Block] = [Heading("The run")]
    known = {*_FACTS, *_TOKEN_FACTS, *(k for k, _ in _SECTIONS), "forks", "config", "headline_merge"}
    scalars = [k for k, v in experiment.items() if k not in known and not isinstance(v, dict | list)]
    labels = {"started": "first started", "finished": "last finished"}  # a resumed study spans several runs
    facts = [[labels.get(k, k), _value(experiment[k])] for k in (*_FACTS, *scalars) if k in experiment]
    spent = (
        (experiment.get("seconds") or {}).get("total")
        if isinstance(experiment.get("seconds"), dict)
        else None
    )
    if isinstance(spent, int | float):
        facts.insert(1, ["time spent (all invocations)", fmt.seconds(float(spent))])
    for k in _TOKEN_FACTS:
        if isinstance(experiment.get(k), int | float):
            facts.append([k, f"{_value(experiment[k])} ({fmt.tokens(experiment[k])})"])
    if facts:
        blocks.append(Table(["", "value"], facts, align="ll"))
    blocks += _headline_merge(experiment.get("headline_merge"), run_dir)
    sections = [
        *_SECTIONS,
        *((k, k) for k, v in experiment.items() if k not in known and isinstance(v, dict)),
    ]
    for key, title in sections:
        part = experiment.get(key)
        if isinstance(part, dict) and part:
            blocks += [Heading(title, 3), Table(["", "value"], _section_rows(key, part), align="ll")]
    forks = experiment.get("forks")
    if isinstance(forks, list) and forks:
        cols = ("fork_tokens", "anneal_tokens", "eval_tokens")
        rows = [[_value(f.get(k)) if isinstance(f, dict) else "" for k in cols] for f in forks]
        blocks += [Heading("Fork plan", 3), Table(list(cols), rows, "rrr")]
    config = experiment.get("config")
    if isinstance(config, dict) and config:
        blocks += [
            Heading("Configuration", 3),
            Table(["knob", "value"], [list(kv) for kv in flatten(config)], "ll"),
        ]
    return blocks


# --- the whole document ----------------------------------------------------------------------------------


def _intro(exp: dict[str, Any], forks: Sequence[ForkSummary]) -> str:
    """The opening paragraph: what is compared, the preset, and which held-out split each part describes."""
    intro = (
        "Pre-trained Model Averaging: snapshots of a constant-LR run are merged and compared with the latest "
        "snapshot and with a real anneal of the LR, all evaluated on the same held-out batches."
    )
    if isinstance(exp.get("preset"), str):
        intro += f" Preset: `{exp['preset']}`."
    if any(f.test is not None for f in forks):
        held: dict[str, Any] = exp["heldout"] if isinstance(exp.get("heldout"), dict) else {}
        split_files = {
            "by-file": f" ({held.get('selection_documents')} and {held.get('test_documents')} files)",
            "halves": f" (the first and the second half of each of {held.get('selection_documents')} files, "
            "which were too unequal in size to divide whole)",
        }.get(str(held.get("mode")), "")
        intro += (
            " The held-out files are divided into a selection split and a disjoint test split"
            + split_files
            + ": "
            "every choice (best merge, best SMA, tuned weights) is made on the selection split; the headline, "
            "the per-fork table, the gain bars and the final markers of the loss-vs-tokens figure are on the "
            "test split; the grid figures (N × V heatmap, weightings, sweeps) and the stable-phase table "
            "describe the selection split. The fixed recipe (SMA of 10 snapshots at the configured V) involves "
            "no choice at all."
        )
    return intro


def build(
    data: RunData,
    forks: Sequence[ForkSummary],
    stable: Sequence[StablePoint],
    figs: Figures,
    base: int | None,
) -> list[Block]:
    """All blocks of the report, in reading order."""
    exp = data.experiment
    blocks: list[Block] = [Heading(f"PMA experiment report: {data.run_dir.name}", 1)]
    blocks.append(Paragraph(_intro(exp, forks)))
    for note in [*data.notes, *figs.failures]:
        blocks.append(Paragraph(note, note=True))
    if forks:
        blocks += headline(forks[-1], len(forks), base)
        blocks += fork_table(forks, base)
        from pmakit.report import seeds

        blocks += seeds.blocks(data.run_dir)
        blocks += compute_blocks(exp, data.rows)
    elif data.rows:
        blocks.append(Paragraph("No result row has a fork point, so there is no fork comparison.", note=True))
    if stable:
        blocks += stable_table(stable, base)
    figure_list = figure_blocks(forks, figs, base)
    if figure_list:
        blocks.append(Heading("Figures"))
        blocks += figure_list
    from pmakit.report import plane

    blocks += plane.blocks(data.run_dir, figs.plane)
    from pmakit.report import spectrum

    blocks += spectrum.blocks(data.run_dir, figs.spectrum)
    from pmakit.report import downstream, evals, moe

    blocks += downstream.blocks(data.run_dir)
    blocks += evals.blocks(data.run_dir)
    blocks += moe.blocks(data.run_dir)
    blocks += run_blocks(exp, data.run_dir)
    blocks.append(Heading("Files"))
    files = [
        f"`{name}`"
        for name in ("experiment.json", "results.csv", "curves.csv")
        if (data.run_dir / name).is_file()
    ]
    blocks.append(Paragraph("Inputs: " + (", ".join(files) or "none found") + ". Plots: `plots/`."))
    return blocks


def weighting_keys(forks: Sequence[ForkSummary]) -> list[str]:
    """Every weighting evaluated, in display order."""
    return sorted({weighting_key(r) for f in forks for r in f.merges if r.method}, key=weighting_sort_key)
