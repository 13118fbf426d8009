"""``pmakit inspect`` (the survey of a run): what snapshots there are, whether they can be merged, and what a merge would need."""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pmakit.errors import PmakitError
from pmakit.layouts import open_weights
from pmakit.layouts.kinds import describe, listing
from pmakit.snapshot import (
    IncompleteSnapshot,
    Snapshot,
    looks_like_snapshot,
    read_snapshot,
    runs_hint,
    scan,
    sort_snapshots,
    study_main_run,
    why_incomplete,
)
from pmakit.storage import canonical, local, origin
from pmakit.units import format_bytes, format_tokens

if TYPE_CHECKING:
    from rich.table import Table


def _rows(
    inputs: Sequence[Path], tokens_per_step: int | None
) -> tuple[list[Snapshot | IncompleteSnapshot], bool]:
    rows: list[Snapshot | IncompleteSnapshot] = []
    from_run = False
    for p in inputs:
        if not p.exists():
            raise PmakitError(f"{p}: no such snapshot or run directory")
        if looks_like_snapshot(p):
            try:
                rows.append(read_snapshot(p, tokens_per_step))
            except IncompleteSnapshot as e:
                rows.append(e)
        else:
            rows += scan(study_main_run(p), tokens_per_step)
            from_run = True
    return rows, from_run


def _snapshot_row(snap: Snapshot) -> dict[str, Any]:
    """What ``pmakit inspect`` shows of one complete snapshot (its weights' format, bytes and tensors)."""
    with open_weights(snap.path) as reader:
        return {
            "path": str(snap.path),
            "layout": snap.layout,
            "complete": True,
            "step": snap.step,
            "tokens": snap.tokens,
            "lr": snap.lr,
            "loss": snap.loss,
            "format": reader.format,
            "bytes": sum(f.size for f in reader.files),
            "model_bytes": sum(info.nbytes for info in reader.tensors.values()),
            "tensors": len(reader.tensors),
            "skipped_entries": reader.skipped,
        }


def inspect_inputs(
    inputs: Sequence[str | os.PathLike[str]],
    *,
    last: int | None = None,
    every: int | None = None,
    until: int | None = None,
    tokens_per_step: int | None = None,
    exclude: Sequence[str | os.PathLike[str]] = (),
    dtype: str = "same",
) -> dict[str, Any]:
    """A JSON-able report: snapshots (complete or not), compatibility, and the default merge's needs."""
    from pmakit.merge import plan_merge
    from pmakit.selection import select_window

    skip = {canonical(p) for p in exclude}
    rows, from_run = _rows([local(p) for p in inputs], tokens_per_step)
    complete = sort_snapshots(r for r in rows if isinstance(r, Snapshot) and origin(r.path) not in skip)
    table, refused = [], []
    for snap in complete:
        try:
            table.append(_snapshot_row(snap))
        except PmakitError as e:  # e.g. torchtitan's HF last save lacking tensors: named, not merged short
            table.append({"path": str(snap.path), "complete": False, "reason": str(e)})
            refused.append(str(e))
    table += [
        {"path": str(r.path), "complete": False, "reason": str(r)}
        for r in rows
        if isinstance(r, IncompleteSnapshot)
    ]
    report: dict[str, Any] = {"snapshots": table}
    if not complete:
        report["compatible"] = False
        hints = "".join(runs_hint(Path(p)) for p in inputs)
        incomplete = [r for r in rows if isinstance(r, IncompleteSnapshot)]
        why = f" ({why_incomplete(incomplete)})" if incomplete else ""
        report["problems"] = [f"no complete snapshots{why}{hints}"]
        return report
    if refused:
        report["compatible"] = False
        report["problems"] = refused
        return report
    try:
        every_plan = plan_merge(complete, [1 / len(complete)] * len(complete), dtype=dtype)
    except PmakitError as e:
        report["compatible"] = False
        report["problems"] = str(e).split("\n  ")[1:] or [str(e)]
        return report
    # Inputs that differ in float precision: the dtypes the merge writes (see "precision"), not the newest's.
    dtypes = Counter(
        str(out if every_plan.precisions else info.dtype).replace("torch.", "")
        for info, out in every_plan.tensors.values()
    )
    report["compatible"] = True
    report["model"] = {
        "tensors": len(every_plan.tensors),
        "parameters": sum(info.numel for info, _ in every_plan.tensors.values()),
        "dtypes": dict(dtypes),
        "largest_tensor_bytes": max(info.nbytes for info, _ in every_plan.tensors.values()),
    }
    report["state"] = listing(every_plan.kinds, every_plan.buffers)
    if every_plan.precisions:
        report["precision"] = every_plan.precision()
    try:
        chosen = select_window(complete, from_run, last=last, every=every, until=until)
    except PmakitError as e:
        report["merge"] = {"error": str(e)}
        return report
    plan = plan_merge(chosen, [1 / len(chosen)] * len(chosen), dtype=dtype)
    report["merge"] = {
        "snapshots": [str(s.path) for s in chosen],
        "tokens": [s.tokens for s in chosen],
        "read_bytes": plan.input_bytes,
        "write_bytes": plan.output_bytes,
        "memory_bytes": plan.peak_memory,
        "output_files": len(plan.shards),
    }
    return report


def _summary(rows: list[dict[str, Any]]) -> str:
    """One line for the whole series: count, layouts, format, token range and spacing, then the checkpoints' size on
    disk and the model's size (its weights alone) each under its own name: a trainer's checkpoint holds optimizer
    and trainer state too (torchtitan's full saves are 3x its model-only last save), so neither stands for the
    other."""
    done = [r for r in rows if r["complete"]]
    if not done:
        return f"{len(rows)} checkpoints, none complete"
    tokens = [r["tokens"] for r in done]
    gaps = sorted(b - a for a, b in zip(tokens, tokens[1:]))
    spacing = f", every ~{format_tokens(gaps[len(gaps) // 2])}" if gaps else ""
    layouts = ", ".join(sorted({r["layout"] for r in done}))
    sizes = sorted({r["bytes"] for r in done})
    disk = format_bytes(sizes[0]) + (f" .. {format_bytes(sizes[-1])}" if len(sizes) > 1 else "")
    return (
        f"{len(done)} complete snapshots ({layouts}, {done[0]['format']}): {format_tokens(tokens[0])} .. "
        f"{format_tokens(tokens[-1])} tokens{spacing}; checkpoint {disk} on disk, model "
        f"{format_bytes(done[-1]['model_bytes'])}"
        + (f"; {len(rows) - len(done)} incomplete" if len(rows) > len(done) else "")
    )


def render(report: dict[str, Any], *, show_all: bool = False) -> None:
    """Print the report: a summary line, then the snapshots the default merge takes (``show_all``: every one),
    named relative to their run directory so the table fits 80 columns."""
    from rich.console import Console

    console = Console()
    rows = report["snapshots"]
    console.print(_summary(rows), highlight=False)
    window = set(report.get("merge", {}).get("snapshots", []))
    shown = rows if show_all or not window else [r for r in rows if r["path"] in window or not r["complete"]]
    if rows:  # nothing found: the summary line and the problem say it, not an empty table
        console.print(_snapshot_table(rows, shown, window))
    for row in report["snapshots"]:
        if not row["complete"]:
            console.print(f"[yellow]incomplete:[/yellow] {row['reason']}", highlight=False)
        elif row["skipped_entries"]:
            with contextlib.suppress(IndexError):
                console.print(
                    f"not weights, skipped in {row['path']}: {len(row['skipped_entries'])} entries "
                    f"({', '.join(row['skipped_entries'][:4])}...)",
                    highlight=False,
                )
    if not report["compatible"]:
        console.print("[red]not mergeable:[/red]", highlight=False)
        for p in report["problems"]:
            console.print(f"  {p}", highlight=False)
        return
    m = report["model"]
    dtypes = ", ".join(f"{k} x{v}" for k, v in m["dtypes"].items())
    console.print(
        f"compatible: {m['tensors']} tensors, {m['parameters']:,} parameters ({dtypes}); largest "
        f"tensor {format_bytes(m['largest_tensor_bytes'])}",
        highlight=False,
    )
    for line in describe(report.get("state", {})):
        console.print(line, highlight=False)
    if "precision" in report:
        console.print(f"precision: {report['precision']['why']}", highlight=False)
    merge = report.get("merge", {})
    if "error" in merge:
        console.print(f"default merge: {merge['error']}", highlight=False)
    elif merge:
        console.print(
            f"merge of {len(merge['snapshots'])} snapshots ({format_tokens(merge['tokens'][0])} .. "
            f"{format_tokens(merge['tokens'][-1])} tokens): reads {format_bytes(merge['read_bytes'])}, "
            f"needs {format_bytes(merge['write_bytes'])} of disk and "
            f"{format_bytes(merge['memory_bytes'])} of work memory",
            highlight=False,
        )


def _snapshot_table(rows: list[dict[str, Any]], shown: list[dict[str, Any]], window: set[str]) -> Table:
    """The complete snapshots of ``shown``, named relative to the run directory they share."""
    from rich.table import Table

    paths = [r["path"] for r in rows] or ["."]
    base = os.path.commonpath(paths) if len(paths) > 1 else str(Path(paths[0]).parent)
    title = (
        "snapshots" if shown is rows else f"the default merge's {len(window)} snapshots (--all: every one)"
    )
    table = Table(title=f"{title}, in {base}", title_justify="left")
    for col in ("snapshot", "layout", "step", "tokens", "lr", "loss", "size"):
        table.add_column(col, justify="left" if col in ("snapshot", "layout") else "right", no_wrap=True)
    for row in shown:
        if row["complete"]:  # incomplete ones are listed with their reason below
            table.add_row(
                os.path.relpath(row["path"], base),
                row["layout"],
                _s(row["step"]),
                format_tokens(row["tokens"]),
                _g(row["lr"]),
                _g(row["loss"]),
                format_bytes(row["bytes"]),
            )
    return table


def _s(x: Any) -> str:
    return "" if x is None else str(x)


def _g(x: Any) -> str:
    return "" if x is None else f"{x:.4g}"
