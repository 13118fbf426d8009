"""Snapshots: a directory of weights plus ``pmakit.json`` (step, tokens, lr, loss), written last.

A directory counts as a complete snapshot only when its token count is known: from ``pmakit.json``, from an HF
Trainer ``trainer_state.json`` (``num_input_tokens_seen``, or ``global_step`` x ``tokens_per_step``), or from a step
number in the directory's name (``checkpoint-500``, ``step-500``, ``step_500``, ``iter_0000500``) x
``tokens_per_step``. Anything else is incomplete and never merged.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.formats import detect_format

log = logging.getLogger(__name__)

METADATA_FILE = "pmakit.json"
MERGE_MANIFEST = "pmakit-merge.json"
FORMAT_VERSION = 1
_STEP_IN_NAME = re.compile(r"(?:checkpoint|step|iter|global_step)[-_]?0*(\d+)$")


class IncompleteSnapshot(PmakitError):
    """A directory that holds (or was meant to hold) a snapshot but whose tokens or weights are unknown."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path


@dataclass(frozen=True)
class Snapshot:
    """One saved point of a training run."""

    path: Path
    """The snapshot directory."""
    tokens: int
    """Training tokens seen when the weights were saved."""
    step: int | None = None
    """Optimizer step, when known."""
    lr: float | None = None
    """Learning rate at the save, when known."""
    loss: float | None = None
    """Training loss near the save, when known."""
    source: str = "pmakit"
    """Where the token count came from: pmakit, hf-trainer, or name (step in the name x tokens_per_step)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The whole metadata record."""

    @property
    def name(self) -> str:
        return self.path.name


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
    tmp = directory / f".{METADATA_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def looks_like_snapshot(path: Path) -> bool:
    """True if ``path`` is a directory with snapshot metadata or weights at its top level."""
    if not path.is_dir():
        return False
    if (path / METADATA_FILE).exists() or (path / "trainer_state.json").exists():
        return True
    return detect_format(path) is not None


def read_snapshot(path: str | os.PathLike[str], tokens_per_step: int | None = None) -> Snapshot:
    """Read a snapshot directory's metadata (not its weights).

    Raises:
        IncompleteSnapshot: the directory has no weights or no way to learn its token count.
    """
    path = Path(path)
    if not path.is_dir():
        raise PmakitError(f"{path}: no such snapshot directory")
    if (path / MERGE_MANIFEST).exists() and not (path / METADATA_FILE).exists():
        raise IncompleteSnapshot(path, f"a merged model (has {MERGE_MANIFEST}), not a training snapshot")
    if detect_format(path) is None:
        raise IncompleteSnapshot(path, "no weights (model.safetensors, shards + index, *.pt/*.bin, or DCP)")
    meta_file = path / METADATA_FILE
    if meta_file.exists():
        return _from_pmakit_json(path, meta_file)
    trainer_state = path / "trainer_state.json"
    if trainer_state.exists():
        return _from_trainer_state(path, trainer_state, tokens_per_step)
    match = _STEP_IN_NAME.search(path.name)
    if match and tokens_per_step:
        step = int(match.group(1))
        return Snapshot(path, tokens=step * tokens_per_step, step=step, source="name")
    hint = " (pass --tokens-per-step to count tokens from the step in its name)" if match else ""
    raise IncompleteSnapshot(path, f"no {METADATA_FILE}, so its token count is unknown{hint}")


def _load_json(file: Path) -> dict[str, Any]:
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise IncompleteSnapshot(file, f"unreadable ({e})") from e
    if not isinstance(data, dict):
        raise IncompleteSnapshot(file, "expected a JSON object")
    return data


def _from_pmakit_json(path: Path, meta_file: Path) -> Snapshot:
    meta = _load_json(meta_file)
    tokens = meta.get("tokens")
    if not isinstance(tokens, int) or tokens < 0:
        raise IncompleteSnapshot(meta_file, f"'tokens' must be a non-negative integer, got {tokens!r}")
    step = meta.get("step")
    return Snapshot(
        path,
        tokens=tokens,
        step=step if isinstance(step, int) else None,
        lr=_float_or_none(meta.get("lr")),
        loss=_float_or_none(meta.get("loss")),
        meta=meta,
    )


def _from_trainer_state(path: Path, state_file: Path, tokens_per_step: int | None) -> Snapshot:
    state = _load_json(state_file)
    step = state.get("global_step")
    if not isinstance(step, int):
        raise IncompleteSnapshot(state_file, "no integer global_step")
    seen = state.get("num_input_tokens_seen") or 0
    history = [h for h in state.get("log_history", []) if isinstance(h, dict)]
    lr = next((h["learning_rate"] for h in reversed(history) if "learning_rate" in h), None)
    loss = next((h["loss"] for h in reversed(history) if "loss" in h), None)
    if seen > 0:
        tokens, source = int(seen), "hf-trainer"
    elif tokens_per_step:
        tokens, source = step * tokens_per_step, "name"
    else:
        raise IncompleteSnapshot(
            state_file,
            "no num_input_tokens_seen (set include_num_input_tokens_seen=True "
            "in TrainingArguments, or pass --tokens-per-step)",
        )
    return Snapshot(
        path,
        tokens=tokens,
        step=step,
        lr=_float_or_none(lr),
        loss=_float_or_none(loss),
        source=source,
        meta=state,
    )


def _float_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) else None


def scan(
    run_dir: str | os.PathLike[str], tokens_per_step: int | None = None
) -> list[Snapshot | IncompleteSnapshot]:
    """Every snapshot-like directory of a run: a ``Snapshot`` when complete, else the reason it is not.

    A run directory is a folder of snapshot directories; they may also sit one level down (``RUN/snapshots/``).
    Hidden directories (a merge's temporary output), merged models (``pmakit-merge.json``) and full training
    checkpoints (``"kind": "checkpoint"`` in ``pmakit.json``) are ignored.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise PmakitError(f"{run_dir}: no such directory")
    found: list[Snapshot | IncompleteSnapshot] = []
    for candidate in _candidates(run_dir, depth=2):
        if (candidate / MERGE_MANIFEST).exists() and not (candidate / METADATA_FILE).exists():
            continue
        try:
            snap = read_snapshot(candidate, tokens_per_step)
        except IncompleteSnapshot as e:
            found.append(e)
            continue
        # A trainer's full resume state (``"kind": "checkpoint"``) duplicates a snapshot of the series.
        if snap.meta.get("kind") != "checkpoint":
            found.append(snap)
    return found


def discover(run_dir: str | os.PathLike[str], tokens_per_step: int | None = None) -> list[Snapshot]:
    """The complete snapshots of a run directory, oldest first; incomplete ones are skipped with a warning."""
    complete = []
    for item in scan(run_dir, tokens_per_step):
        if isinstance(item, Snapshot):
            complete.append(item)
        else:
            log.warning("skipping %s", item)
    return sort_snapshots(complete)


def _candidates(directory: Path, depth: int) -> Iterable[Path]:
    for child in sorted(directory.iterdir()):
        if not child.is_dir() or child.name.startswith("."):
            continue
        if looks_like_snapshot(child):
            yield child
        elif depth > 1:
            yield from _candidates(child, depth - 1)


def sort_snapshots(snapshots: Iterable[Snapshot]) -> list[Snapshot]:
    """Order by tokens; two snapshots at the same token count are ambiguous and refused."""
    ordered = sorted(snapshots, key=lambda s: s.tokens)
    for a, b in zip(ordered, ordered[1:]):
        if a.tokens == b.tokens and a.path.resolve() != b.path.resolve():
            raise PmakitError(f"two snapshots at {a.tokens} tokens: {a.path} and {b.path}")
    return [s for i, s in enumerate(ordered) if i == 0 or s.path.resolve() != ordered[i - 1].path.resolve()]


def gather(
    paths: Iterable[str | os.PathLike[str]],
    tokens_per_step: int | None = None,
    exclude: Iterable[str | os.PathLike[str]] = (),
) -> tuple[list[Snapshot], bool]:
    """Snapshots named on a command line: each path is a snapshot directory or a run directory.

    Returns the snapshots oldest first, and whether any came from a run directory (then the caller's default
    window applies; snapshots named one by one are all used). An explicitly named incomplete snapshot is an error.
    """
    skip = {Path(p).resolve() for p in exclude}
    snapshots: list[Snapshot] = []
    from_run = False
    for p in map(Path, paths):
        if not p.exists():
            raise PmakitError(f"{p}: no such snapshot or run directory")
        if looks_like_snapshot(p):
            snapshots.append(read_snapshot(p, tokens_per_step))
            continue
        found = discover(p, tokens_per_step)
        if not found:
            raise PmakitError(
                f"{p}: no complete snapshots found (a run directory holds snapshot directories, "
                f"each with weights and {METADATA_FILE})"
            )
        snapshots += found
        from_run = True
    return sort_snapshots(s for s in snapshots if s.path.resolve() not in skip), from_run
