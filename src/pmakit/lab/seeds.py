"""``pmakit experiment --seeds K``: the headline repeated over K training seeds.

The paired s.e. over batches says how sure one run is of its own numbers; it says nothing about how much they move
when the run is trained again. Each extra seed is the whole study again (RUN/seeds/seed-S/, resumable like any
study) with ``train.seed`` = the config's seed + k, which re-draws the initialisation, the data order and the
held-out file division. RUN/seeds.json gathers, per fork and per headline model (best merge, fixed recipe, tuned
merge), merge - anneal on each seed's test split, with the mean, the sample standard deviation and the s.e. over
seeds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pmakit.runs import RESULTS, read_jsonl

ROLES = ("best", "fixed", "tuned")
"""Headline models compared with the anneal across seeds."""


def _paired_mean(a: Sequence[float], b: Sequence[float]) -> float:
    return math.fsum(x - y for x, y in zip(a, b)) / len(a)


def seed_record(run_dir: Path) -> dict[int, dict[str, float]]:
    """One run's test-split merge - anneal per fork (by fork index) and role, from its results.jsonl."""
    rows = [r for r in read_jsonl(run_dir / RESULTS) if r.get("split") == "test"]
    forks = sorted({r["fork_tokens"] for r in rows if r.get("fork_tokens") is not None})
    out: dict[int, dict[str, float]] = {}
    for i, fork in enumerate(forks, start=1):
        at = {r.get("role") or r["model"]: r for r in rows if r["fork_tokens"] == fork}
        anneal = at.get("annealed")
        if anneal is None:
            continue
        out[i] = {
            role: _paired_mean(at[role]["batch_losses"], anneal["batch_losses"])
            for role in ROLES
            if role in at
        }
    return out


def seed_summary(runs: Sequence[tuple[int, Path]]) -> dict[str, Any]:
    """Per fork and role: each seed's merge - anneal (test split), mean, sample s.d. and s.e. over seeds."""
    per_seed = {seed: seed_record(path) for seed, path in runs}
    forks: dict[str, Any] = {}
    for i in sorted({i for rec in per_seed.values() for i in rec}):
        roles: dict[str, Any] = {}
        for role in ROLES:
            values = {s: rec[i][role] for s, rec in per_seed.items() if role in rec.get(i, {})}
            if not values:
                continue
            xs = list(values.values())
            sd = statistics.stdev(xs) if len(xs) > 1 else None
            roles[role] = {
                "per_seed": {str(s): v for s, v in values.items()},
                "mean": statistics.fmean(xs),
                "sd": sd,
                "se": sd / math.sqrt(len(xs)) if sd is not None else None,
                "seeds": len(xs),
            }
        forks[f"F{i}"] = roles
    return {
        "seeds": [s for s, _ in runs],
        "quantity": "merge - anneal, test split (negative: the merge is better)",
        "forks": forks,
    }
