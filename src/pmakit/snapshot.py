"""Snapshots: a directory of weights plus ``pmakit.json`` (step, tokens, lr, loss), written last.

Other trainers' checkpoints count too: each run layout (``pmakit.layouts``: HF Trainer ``checkpoint-N``, plain
HF model and DCP dirs, OLMo-core, torchtitan, Megatron save folders) says where its checkpoints are, where their
token count comes from and which entries are model weights. A directory counts as a complete snapshot only when
its token count is known (from the trainer's metadata, or the step in its name x ``tokens_per_step``); anything
else is incomplete and never merged.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.layouts import candidates, layout_of
from pmakit.layouts.base import MERGE_MANIFEST, METADATA_FILE, IncompleteSnapshot, Snapshot, is_merge_output
from pmakit.runs import atomic_write_text, resolves_inside
from pmakit.storage import canonical, local, origin

__all__ = [
    "MERGE_MANIFEST",
    "METADATA_FILE",
    "IncompleteSnapshot",
    "Snapshot",
    "discover",
    "gather",
    "looks_like_snapshot",
    "read_snapshot",
    "scan",
    "sort_snapshots",
    "write_metadata",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def write_metadata(
    directory: str | os.PathLike[str],
    *,
    step: int,
    tokens: int,
    lr: float | None = None,
    loss: float | None = None,
    **extra: Any,
) -> Path:
    """Write ``pmakit.json`` atomically. Call it after the weights are on disk: it marks the snapshot complete."""
    directory = Path(directory)
    record = {
        "format_version": FORMAT_VERSION,
        "step": step,
        "tokens": tokens,
        "lr": lr,
        "loss": loss,
        "time": time.time(),
        **extra,
    }
    target = directory / METADATA_FILE
    atomic_write_text(target, json.dumps(record, indent=1))
    return target


def looks_like_snapshot(path: Path) -> bool:
    """True if some run layout recognises ``path`` as one of its checkpoints (complete or not).

    A directory that only a generic layout claims (weights at its top level, no trainer metadata) but that holds
    checkpoints is their save folder: the HF Trainer's ``output_dir`` after ``save_model()``, the final model beside
    ``checkpoint-N`` (the Trainer's last checkpoint holds the same weights, with its step)."""
    layout = layout_of(path)
    if layout is None:
        return False
    if layout.generic and path.is_dir() and not is_merge_output(path) and candidates(path, depth=1):
        log.info(
            "%s holds checkpoints and a model with no token count at its top level: merging the checkpoints",
            path,
        )
        return False
    return True


def read_snapshot(path: str | os.PathLike[str], tokens_per_step: int | None = None) -> Snapshot:
    """Read a snapshot directory's metadata (not its weights), through the layout that recognises it.

    ``path``: a folder, or an ``s3://`` / ``gs://`` URL (read through a local mirror, ``pmakit.storage``).

    Raises:
        IncompleteSnapshot: the directory has no weights or no way to learn its token count.
    """
    path = local(path)
    if not path.is_dir() and layout_of(path) is None:
        raise PmakitError(f"{path}: no such snapshot directory")
    if is_merge_output(path):
        raise IncompleteSnapshot(path, f"a merged model (has {MERGE_MANIFEST}), not a training snapshot")
    layout = layout_of(path)
    if layout is None:
        raise IncompleteSnapshot(
            path, "no weights (model.safetensors, shards + index, *.pt/*.bin, DCP, or a trainer's checkpoint)"
        )
    return layout.read(path, tokens_per_step)


def scan(
    run_dir: str | os.PathLike[str], tokens_per_step: int | None = None
) -> list[Snapshot | IncompleteSnapshot]:
    """Every snapshot-like directory of a run: a ``Snapshot`` when complete, else the reason it is not.

    A run directory is a folder of snapshot directories, or an ``s3://`` / ``gs://`` URL of one (read through a
    local mirror, ``pmakit.storage``); they may also sit one level down (``RUN/snapshots/``).
    Hidden directories (a merge's temporary output), merged models (``pmakit-merge.json``) and full training
    checkpoints (``"kind": "checkpoint"`` in ``pmakit.json``) are ignored. A snapshot directory that is a symlink
    to somewhere outside the run is part of it (runs are assembled from links), with a warning naming where it
    points; the merge manifest records every input's resolved path.
    """
    run_dir = local(run_dir)
    if not run_dir.is_dir():
        raise PmakitError(f"{run_dir}: no such directory")
    found: list[Snapshot | IncompleteSnapshot] = []
    for candidate, layout in candidates(run_dir):
        if not resolves_inside(candidate, run_dir):
            # Runs assembled from links (checkpoints on another volume linked into the run folder) are common:
            # merged, but never silently, and the manifest keeps where each input really is.
            log.warning(
                "%s is a symlink to %s, outside the run: merged as part of it (the manifest records where it is)",
                candidate,
                candidate.resolve(),
            )
        try:
            snap = layout.read(candidate, tokens_per_step)
        except IncompleteSnapshot as e:
            found.append(e)
            continue
        # A trainer's full resume state (``"kind": "checkpoint"``) duplicates a snapshot of the series.
        if snap.meta.get("kind") != "checkpoint":
            found.append(snap)
    return found


def study_main_run(path: Path) -> Path:
    """A study directory (``pmakit experiment -o STUDY``) stands for its main run, ``STUDY/main``: the run whose
    snapshots every arm of the study merges (said on the console). Any other path is itself."""
    from pmakit.layouts import candidates
    from pmakit.runs import MAIN_RUN

    main = path / MAIN_RUN
    if path.is_dir() and main.is_dir() and not candidates(path) and candidates(main):
        log.info("%s is a study: using its main run, %s", path, main)
        return main
    return path


def runs_hint(path: Path) -> str:
    """``'; runs with snapshots under it: A, B'`` naming the sub-runs of a study directory, or ``''``."""
    if not path.is_dir():
        return ""
    runs = sorted(str(d.parent) for d in path.glob("**/snapshots") if d.is_dir() and any(d.iterdir()))
    if not runs:
        return ""
    shown = ", ".join(runs[:6]) + (f" and {len(runs) - 6} more" if len(runs) > 6 else "")
    return f"; runs with snapshots under it: {shown}"


def discover(run_dir: str | os.PathLike[str], tokens_per_step: int | None = None) -> list[Snapshot]:
    """The complete snapshots of a run directory, oldest first; incomplete ones are skipped with a warning."""
    complete = []
    for item in scan(run_dir, tokens_per_step):
        if isinstance(item, Snapshot):
            complete.append(item)
        else:
            log.warning("skipping %s", item)
    return sort_snapshots(complete)


def why_incomplete(incomplete: Sequence[IncompleteSnapshot]) -> str:
    """Why none of a run's checkpoints can be merged, in one line that ends with what to do: the most common
    reason (a trainer's checkpoints without a token count all say the same)."""
    reasons = Counter(str(e).removeprefix(f"{e.path}: ") for e in incomplete)
    reason, _ = reasons.most_common(1)[0]
    others = f" ({len(reasons) - 1} other reason(s): pmakit inspect lists each)" if len(reasons) > 1 else ""
    n = len(incomplete)
    return f"none of its {n} checkpoint{'s' if n > 1 else ''} can be merged{others}: {reason}"


def _replica(snapshot: Snapshot) -> int:
    """The model copy a snapshot belongs to (-1: not a copy's own snapshot)."""
    replica = snapshot.meta.get("replica")
    return replica if isinstance(replica, int) and not isinstance(replica, bool) else -1


def sort_snapshots(snapshots: Iterable[Snapshot]) -> list[Snapshot]:
    """Order by tokens; two snapshots at the same token count are ambiguous and refused, unless they are two model
    copies' own snapshots (``replica`` in their metadata, ``pmakit train --replicas --save-replicas``), which are
    ordered by copy so that ``--last 2K`` takes K points in time of 2 copies."""
    ordered = sorted(snapshots, key=lambda s: (s.tokens, _replica(s)))
    for a, b in zip(ordered, ordered[1:]):
        copies = _replica(a) != _replica(b)
        if a.tokens == b.tokens and a.path.resolve() != b.path.resolve() and not copies:
            raise PmakitError(f"two snapshots at {a.tokens} tokens: {a.path} and {b.path}")
        if a.step is not None and b.step is not None and a.step > b.step:
            log.warning(
                "step and token order disagree: %s (step %d, %d tokens) comes before %s (step %d, %d tokens); "
                "merging in token order",
                a.path,
                a.step,
                a.tokens,
                b.path,
                b.step,
                b.tokens,
            )
    return [s for i, s in enumerate(ordered) if i == 0 or s.path.resolve() != ordered[i - 1].path.resolve()]


def gather(
    paths: Iterable[str | os.PathLike[str]],
    tokens_per_step: int | None = None,
    exclude: Iterable[str | os.PathLike[str]] = (),
) -> tuple[list[Snapshot], bool]:
    """Snapshots named on a command line: each path is a snapshot directory or a run directory (a folder or an
    ``s3://`` / ``gs://`` URL); ``exclude`` names snapshots the same way.

    Returns the snapshots oldest first, and whether any came from a run directory (then the caller's default
    window applies; snapshots named one by one are all used). An explicitly named incomplete snapshot is an error.
    """
    skip = {canonical(p) for p in exclude}
    snapshots: list[Snapshot] = []
    from_run = False
    for p in map(local, paths):
        if not p.exists():
            raise PmakitError(f"{p}: no such snapshot or run directory")
        if looks_like_snapshot(p):
            if p.is_symlink():
                log.info("%s is a symlink to %s: merging it, as named", p, p.resolve())
            snapshots.append(read_snapshot(p, tokens_per_step))
            continue
        p = study_main_run(p)
        found = scan(p, tokens_per_step)
        complete = [s for s in found if isinstance(s, Snapshot)]
        incomplete = [e for e in found if isinstance(e, IncompleteSnapshot)]
        for e in incomplete:
            log.warning("skipping %s", e)
        if not complete:
            if incomplete:
                raise PmakitError(f"{p}: {why_incomplete(incomplete)}")
            raise PmakitError(
                f"{p}: no complete snapshots found (a run directory holds snapshot directories, "
                f"each with weights and {METADATA_FILE}){runs_hint(p)}"
            )
        snapshots += sort_snapshots(complete)
        from_run = True
    unmatched = skip - {origin(s.path) for s in snapshots}
    if unmatched:
        raise PmakitError(f"--exclude {sorted(unmatched)[0]} names none of the snapshots found")
    return sort_snapshots(s for s in snapshots if origin(s.path) not in skip), from_run
