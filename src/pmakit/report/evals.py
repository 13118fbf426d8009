"""Report section: the rows of ``pmakit eval`` (``evals.jsonl``) as tables, with paired errors and the noise band.

A folder that holds an ``evals.jsonl`` and no study gets a report of its own; a run or study folder that holds one
(``pmakit eval RUN`` writes RUN/evals.jsonl) gets this section after its own. Per target, task and metric: each
model's score with its s.e. over items, its paired difference to the latest snapshot and to the reference that
``pmakit eval --reference`` named (recorded beside the rows), each with its paired s.e. and 95% bootstrap interval
over the same items, and the raw snapshots' noise band. Rows of different item sets (split, limit, task build,
lm-eval version) are never paired: each set is its own table.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pmakit.report.blocks import Block, Heading, Paragraph, Table
from pmakit.runs import read_jsonl

EVALS = "evals.jsonl"
REFERENCE = "evals.reference.json"
"""``{"reference": RECIPE_OR_TARGET}``: what the last ``pmakit eval --reference`` compared every model with."""
LOWER_IS_BETTER = {"bits_per_byte", "byte_perplexity", "word_perplexity", "loss", "perplexity"}
ITEM_SET = ("split", "limit", "build", "lm_eval")


def has_evals(run_dir: Path) -> bool:
    return (run_dir / EVALS).is_file()


def is_evals_only(run_dir: Path) -> bool:
    """A folder ``pmakit eval -o`` wrote: evals.jsonl and no study or training run around it."""
    return has_evals(run_dir) and not any(
        (run_dir / name).exists()
        for name in ("experiment.json", "results.csv", "results.jsonl", "metrics.jsonl")
    )


def reference_of(run_dir: Path) -> str | None:
    try:
        found = json.loads((run_dir / REFERENCE).read_text()).get("reference")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def summaries(run_dir: Path) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(item set, ``pmakit.eval.run.summarize`` lines) per set of items the rows were scored on."""
    from pmakit.eval.run import summarize

    rows = [r for r in read_jsonl(run_dir / EVALS) if isinstance(r.get("items"), list) and "metric" in r]
    sets: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        sets.setdefault(json.dumps([r.get(k) for k in ITEM_SET]), []).append(r)
    reference = reference_of(run_dir)
    return [({k: group[0].get(k) for k in ITEM_SET}, summarize(group, reference)) for group in sets.values()]


def _diff(d: Mapping[str, Any] | None) -> tuple[str, str]:
    """``+0.0135 ± 0.0026 (5.3 s.e.)`` and ``[+0.0083, +0.0188]``."""
    if not d:
        return "", ""
    if not d["se"] and not d["delta"]:
        return "same on every item", ""
    z = abs(d["delta"] / d["se"]) if d["se"] else math.nan
    return f"{d['delta']:+.4f} ± {d['se']:.4f} ({z:.1f} s.e.)", f"[{d['low']:+.4f}, {d['high']:+.4f}]"


def _table(lines: Sequence[dict[str, Any]], reference: bool) -> Table:
    header = ["model", "score ± s.e.", "Δ vs latest ± paired s.e.", "95% interval"]
    header += ["Δ vs reference ± paired s.e.", "95% interval (ref)"] if reference else []
    rows = []
    for line in lines:
        cells = [line["recipe"], f"{line['value']:.4f} ± {line['se']:.4f}", *_diff(line.get("vs_latest"))]
        cells += list(_diff(line.get("vs_reference"))) if reference else []
        rows.append(cells)
    return Table(header, rows)


def _caption(first: Mapping[str, Any], items: Mapping[str, Any]) -> str:
    metric = first["metric"]
    band = first["noise"]
    noise = (
        f"noise sd {band['sd']:.4f} over the {band['k']} newest raw snapshots" if band else "no noise band"
    )
    chance = f", chance {first['chance']:.2f}" if first.get("chance") else ""
    split = f"{items['split']} items" if items.get("split") else "items"
    limit = f", the first {items['limit']}" if items.get("limit") else ""
    better = "lower" if metric in LOWER_IS_BETTER else "higher"
    return (
        f"**{Path(first['target']).name}: {first['task']} / {metric}** ({first['items']} {split}{limit}{chance}; "
        f"{better} is better; {noise}; lm-eval {items.get('lm_eval')})."
    )


def blocks(run_dir: Path, *, level: int = 2) -> list[Block]:
    """The eval tables of ``run_dir/evals.jsonl`` (nothing when there is none)."""
    if not has_evals(run_dir):
        return []
    found = summaries(run_dir)
    if not found:
        return []
    reference = reference_of(run_dir)
    out: list[Block] = [
        Heading("Downstream evaluation (pmakit eval)", level),
        Paragraph(
            "Models scored by lm-evaluation-harness (`pmakit eval`, rows in `evals.jsonl`). Each score has its "
            "standard error over items; each difference is paired over the same items (a paired s.e. and a 95% "
            "bootstrap interval that resamples the items) and taken to the latest snapshot of the same run"
            + (f" and to the reference `{reference}`" if reference else "")
            + ". The noise band is the standard deviation of the newest raw snapshots' scores: what one "
            "checkpoint's score moves from save to save, against which a merge's gain is read."
        ),
    ]
    for items, lines in found:
        groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for line in lines:
            groups.setdefault((line["target"], line["task"], line["metric"]), []).append(line)
        for group in groups.values():
            out.append(Paragraph(_caption(group[0], items)))
            out.append(_table(group, any("vs_reference" in g for g in group)))
    return out


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The report of a folder that holds only ``evals.jsonl``."""
    return [Heading(f"Evaluations in {run_dir.name}", 1), *blocks(run_dir)], []


def summary(run_dir: Path) -> str:
    """A terminal screen: each model's score and its difference to the latest snapshot."""
    lines = [f"Evaluations: {run_dir / EVALS}"]
    for _, found in summaries(run_dir):
        for line in found:
            delta = line.get("vs_latest")
            vs = f"  Δ vs latest {delta['delta']:+.4f} ± {delta['se']:.4f}" if delta else ""
            lines.append(
                f"  {Path(line['target']).name} {line['recipe']:<12} {line['task']}/{line['metric']}: "
                f"{line['value']:.4f} ± {line['se']:.4f}{vs}"
            )
    return "\n".join(lines[:40])
