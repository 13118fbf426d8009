"""Report section of ``pmakit experiment --seeds K``: merge - anneal on each seed's test split, and its spread.

Reads RUN/seeds.json (written by ``pmakit.lab.seeds``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pmakit.report import fmt
from pmakit.report.blocks import Block, Heading, Paragraph, Table
from pmakit.runs import read_json_object

NAMES = {
    "best": "best merge (chosen on selection)",
    "fixed": "fixed recipe (SMA N=10)",
    "tuned": "tuned merge",
}


def read_seeds(run_dir: Path) -> dict[str, Any] | None:
    """RUN/seeds.json, or None when absent or unreadable."""
    data = read_json_object(run_dir / "seeds.json")
    return data if data is not None and isinstance(data.get("forks"), dict) else None


def blocks(run_dir: Path) -> list[Block]:
    """One row per fork and headline model: each seed's merge - anneal, the mean ± s.d. and the s.e. over seeds."""
    data = read_seeds(run_dir)
    if data is None:
        return []
    seeds = [str(s) for s in data.get("seeds", [])]
    rows = []
    for fork, roles in data["forks"].items():
        for role, r in roles.items():
            per = r.get("per_seed", {})
            rows.append(
                [
                    fork,
                    NAMES.get(role, role),
                    *[fmt.signed(per.get(s)) for s in seeds],
                    fmt.signed(r.get("mean")) + (f" ± {r['sd']:.4f}" if r.get("sd") is not None else ""),
                    fmt.loss(r.get("se")),
                ]
            )
    return [
        Heading("Across training seeds"),
        Paragraph(
            f"The whole study repeated with {len(seeds)} training seeds ({', '.join(seeds)}; each re-draws the "
            "initialisation, the data order and the held-out file division). Each cell: merge − anneal on that "
            "seed's test split (negative: the merge is better); then the mean ± sample s.d. over seeds and the "
            "s.e. of that mean. The paired s.e. over batches in the tables above is one run's; this spread is the "
            "run-to-run one."
        ),
        Table(
            ["fork", "model", *[f"seed {s}" for s in seeds], "mean ± s.d.", "s.e. over seeds"],
            rows,
            "ll" + "r" * (len(seeds) + 2),
        ),
    ]
