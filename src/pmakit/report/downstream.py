"""Report section: the study's headline models on downstream tasks (lm-eval, test items), with paired errors and the
raw snapshots' noise band. Reads RUN/downstream.jsonl (written by ``pmakit.lab.downstream``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pmakit.report import fmt
from pmakit.report.blocks import Block, Heading, Paragraph, Table
from pmakit.runs import read_jsonl

DOWNSTREAM = "downstream.jsonl"
HIGHER_IS_BETTER = {"acc", "acc_norm"}
SHOWN = {"acc", "acc_norm", "bits_per_byte"}
"""Metrics in the tables (perplexities restate bits per byte)."""


def summarize(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per fork, task and metric: each model's score ± s.e. over items, its paired difference to the latest
    snapshot and to the anneal (paired s.e. and 95% bootstrap interval over the same items), and the noise band
    (the spread of the latest and the raw snapshots saved just before it)."""
    from pmakit.eval import stats

    groups: dict[tuple[int, str, str], list[Mapping[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["fork_tokens"], r["task"], r["metric"]), []).append(r)
    out: list[dict[str, Any]] = []
    for (fork, task, metric), members in sorted(groups.items()):
        latest = next((m for m in members if m["model"] == "latest"), None)
        anneal = next((m for m in members if m["model"] == "annealed"), None)
        raw = [m for m in members if m.get("raw_back") is not None]
        band = stats.noise_band([stats.score(metric, m["items"])[0] for m in raw]) if len(raw) > 1 else None
        for m in members:
            if m["model"] == "raw":
                continue
            value, se = stats.score(metric, m["items"])
            row: dict[str, Any] = {"fork_tokens": fork, "task": task, "metric": metric, "label": m["label"],
                                   "model": m["model"], "role": m.get("role", ""), "value": value, "se": se,
                                   "items": len(m["items"]), "noise": band}  # fmt: skip
            for name, ref in (("vs_latest", latest), ("vs_anneal", anneal)):
                if ref is not None and ref is not m:
                    p = stats.paired(metric, *stats.aligned(dict(m), dict(ref)))
                    row[name] = {"delta": p.delta, "se": p.se, "low": p.low, "high": p.high}
            out.append(row)
    return out


def _diff(d: Mapping[str, Any] | None, digits: int) -> str:
    """``+0.0135 ± 0.0026 (5.3 s.e.)``: short enough for a right-aligned cell."""
    if not d:
        return ""
    if not d["se"] and not d["delta"]:
        return "same on every item"
    z = abs(d["delta"] / d["se"]) if d["se"] else math.nan
    return f"{d['delta']:+.{digits}f} ± {d['se']:.{digits}f} ({z:.1f} s.e.)"


def _interval(d: Mapping[str, Any] | None, digits: int) -> str:
    return f"[{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]" if d else ""


def blocks(run_dir: Path) -> list[Block]:
    """The downstream table of each task and metric at the last fork (the fork table's models), and a verdict."""
    path = run_dir / DOWNSTREAM
    rows = read_jsonl(path) if path.is_file() else []
    if not rows:
        return []
    summary = summarize(rows)
    last = max(r["fork_tokens"] for r in summary)
    out: list[Block] = [
        Heading("Downstream tasks (lm-evaluation-harness, test items)"),
        Paragraph(
            "The headline models scored by lm-evaluation-harness on pmakit's offline tasks, built from the held-out "
            "TEST files (never training files, never the selection files the choices were made on): "
            "`pmakit_next_line` (the true next line of a function among 4 lines of other held-out files; accuracy, "
            "chance 25%; acc_norm normalises by length) and `pmakit_bpb` (rolling bits per byte of whole held-out "
            "documents). Differences are paired over the same items (s.e. and 95% bootstrap interval); the noise "
            "band is the standard deviation of the latest snapshot and the raw snapshots saved just before it: what "
            "one checkpoint's score moves from save to save."
        ),
    ]
    for fork in sorted({r["fork_tokens"] for r in summary}):
        if fork != last:
            continue
        shown = {
            (r["task"], r["metric"]) for r in summary if r["fork_tokens"] == fork and r["metric"] in SHOWN
        }
        for task, metric in sorted(shown):
            group = [
                r for r in summary if r["fork_tokens"] == fork and r["task"] == task and r["metric"] == metric
            ]
            digits = 4 if metric not in HIGHER_IS_BETTER else 3
            band = group[0]["noise"]
            noise = (
                f"noise sd {band['sd']:.{digits}f} over {band['k']} raw snapshots"
                if band
                else "no noise band"
            )
            out.append(
                Paragraph(
                    f"**{task} / {metric}** at the fork at {fmt.tokens(fork)} tokens ({group[0]['items']} test "
                    f"items; {'higher' if metric in HIGHER_IS_BETTER else 'lower'} is better; {noise})."
                )
            )
            out.append(
                Table(
                    [
                        "model",
                        "score ± s.e.",
                        "Δ vs latest ± paired s.e.",
                        "95% interval",
                        "Δ vs anneal ± paired s.e.",
                    ],
                    [
                        [
                            r["label"],
                            f"{r['value']:.{digits}f} ± {r['se']:.{digits}f}",
                            _diff(r.get("vs_latest"), digits),
                            _interval(r.get("vs_latest"), digits),
                            _diff(r.get("vs_anneal"), digits),
                        ]
                        for r in group
                    ],
                )
            )
    return out
