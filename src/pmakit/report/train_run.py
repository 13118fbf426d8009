"""The report of a ``pmakit train`` run (no study around it): its curves, its online merge, its snapshots.

Reads only the run's own files: ``metrics.jsonl`` (train, eval, event records) and each ``snapshots/*/pmakit.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.limits import loads_json
from pmakit.report import fmt
from pmakit.report.blocks import Block, Bullets, FigureBlock, Heading, Paragraph, Table
from pmakit.runs import METRICS, read_jsonl

PLOT = "plots/train_curves.png"


def is_train_run(run_dir: Path) -> bool:
    """A run directory ``pmakit train`` wrote: a metrics log and no experiment around it."""
    return (run_dir / "metrics.jsonl").is_file() and not (run_dir / "experiment.json").exists()


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records, read as every reader of that file does (``pmakit.runs.read_jsonl``): a torn or
    damaged line (a killed run) is skipped; a line nested past the json-depth limit is one error naming it."""
    return read_jsonl(run_dir / METRICS)


def _snapshots(run_dir: Path) -> list[dict[str, Any]]:
    found = []
    for meta in sorted((run_dir / "snapshots").glob("*/pmakit.json")):
        try:
            record = loads_json(meta.read_bytes(), str(meta))
        except (PmakitError, OSError):
            continue
        if isinstance(record, dict) and isinstance(record.get("tokens"), int):
            found.append({**record, "path": meta.parent.name})
    return sorted(found, key=lambda r: r["tokens"])


def _evals(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """(latest, merged or None) per evaluation, in token order."""
    latest = {r["tokens"]: r for r in records if r.get("kind") == "eval" and r.get("model") == "latest"}
    merged = {
        r["tokens"]: r
        for r in records
        if r.get("kind") == "eval" and str(r.get("model", "")).startswith("merged")
    }
    return [(latest[t], merged.get(t)) for t in sorted(latest)]


def _eval_rows(evals: list[tuple[dict[str, Any], dict[str, Any] | None]]) -> list[list[str]]:
    rows = []
    for latest, merged in evals:
        row = [
            fmt.tokens(latest["tokens"]),
            f"{latest['val_loss']:.4f} ± {latest.get('val_loss_se') or 0:.4f}",
        ]
        if merged is None:
            row += ["–", "–", "–"]
        else:
            row += [
                str(merged.get("model", "")).removeprefix("merged:"),
                f"{merged['val_loss']:.4f} ± {merged.get('val_loss_se') or 0:.4f}",
                f"{merged.get('delta_vs_latest', float('nan')):+.4f} ± {merged.get('delta_se') or 0:.4f}",
            ]
        rows.append(row)
    return rows


def _plot(run_dir: Path, records: list[dict[str, Any]], evals: list[Any]) -> Path | None:
    """Training loss (every logged step) and the held-out loss of the latest weights and the online merge."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    train = [(r["tokens"], r["loss"]) for r in records if r.get("kind") == "train" and "loss" in r]
    fig, ax = plt.subplots(figsize=(8, 4.5), constrained_layout=True)
    if train:
        ax.plot(
            [t for t, _ in train], [v for _, v in train], color="0.7", lw=0.8, label="training loss (batch)"
        )
    ax.plot(
        [a["tokens"] for a, _ in evals],
        [a["val_loss"] for a, _ in evals],
        "o-",
        ms=3,
        label="held-out: latest",
    )
    merged = [m for _, m in evals if m is not None]
    if merged:
        ax.plot(
            [m["tokens"] for m in merged],
            [m["val_loss"] for m in merged],
            "s-",
            ms=3,
            label="held-out: online merge",
        )
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt.tokens(v)))
    ax.set(xlabel="tokens", ylabel="loss")
    ax.legend(fontsize=8)
    path = run_dir / PLOT
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def build(run_dir: Path) -> tuple[list[Block], list[Path]]:
    """The report's blocks and the figures drawn."""
    records = _records(run_dir)
    snaps = _snapshots(run_dir)
    evals = _evals(records)
    trained = [r for r in records if r.get("kind") == "train"]
    last = trained[-1] if trained else {}
    blocks: list[Block] = [Heading(f"Training run {run_dir.name}", 1)]
    facts = [
        f"{fmt.tokens(last.get('tokens'))} tokens trained in {last.get('step', '–')} steps (the last log)."
    ]
    if snaps:
        gaps = {b["tokens"] - a["tokens"] for a, b in zip(snaps, snaps[1:])}
        every = f", every {fmt.tokens(gaps.pop())} tokens" if len(gaps) == 1 else ""
        facts.append(
            f"{len(snaps)} snapshots in `snapshots/`{every}, from {fmt.tokens(snaps[0]['tokens'])} to "
            f"{fmt.tokens(snaps[-1]['tokens'])} tokens (merge them: `pmakit merge {run_dir} -o merged/`)."
        )
    else:
        facts.append("No snapshots yet.")
    blocks.append(Bullets(facts))
    if evals:
        blocks += [
            Heading("Held-out loss while training", 2),
            Paragraph(
                "Each evaluation scores the latest weights and the online merge on the same held-out batches; "
                "the difference is paired over those batches (negative: the merge is better)."
            ),
            Table(["tokens", "latest", "merge", "merge loss", "merge - latest"], _eval_rows(evals)),
        ]
    else:
        blocks.append(
            Paragraph("No evaluations in metrics.jsonl (eval_every: 0, or the run stopped early).", note=True)
        )
    events = [r for r in records if r.get("kind") == "event"]
    if events:
        blocks += [
            Heading("Events", 2),
            Bullets(
                [
                    f"{fmt.tokens(e.get('tokens'))} tokens: {e.get('event')} {e.get('reason', '')}".rstrip()
                    for e in events
                ]
            ),
        ]
    plot = _plot(run_dir, records, evals) if evals or trained else None
    if plot is not None:
        blocks.append(FigureBlock(plot.relative_to(run_dir), "Loss vs tokens"))
    from pmakit.report import evals as downstream_evals  # `pmakit eval RUN` wrote RUN/evals.jsonl

    return blocks + downstream_evals.blocks(run_dir), [plot] if plot else []


def summary(run_dir: Path) -> str:
    """A terminal screen: what was trained and the last evaluation."""
    records = _records(run_dir)
    evals = _evals(records)
    trained = [r for r in records if r.get("kind") == "train"]
    lines = [f"Training run: {run_dir}"]
    if trained:
        lines.append(f"  {fmt.tokens(trained[-1]['tokens'])} tokens, {trained[-1]['step']} steps")
    lines.append(f"  {len(_snapshots(run_dir))} snapshots in {run_dir / 'snapshots'}")
    if evals:
        latest, merged = evals[-1]
        lines.append(f"  at {fmt.tokens(latest['tokens'])} tokens: latest {latest['val_loss']:.4f}")
        if merged is not None:
            lines[-1] += (
                f", online merge ({str(merged.get('model', '')).removeprefix('merged:')}) {merged['val_loss']:.4f}"
                f" ({merged.get('delta_vs_latest', float('nan')):+.4f} ± {merged.get('delta_se') or 0:.4f})"
            )
    return "\n".join(lines)
