"""A run directory: the names of what pmakit writes there, atomic writes, and torn-line-safe JSONL.

The one owner of these names, so that the trainer that writes a run, the lab that studies it, ``pmakit recover``
that rolls it back and the report that reads it agree without importing each other. A leaf: stdlib and
``pmakit.errors`` only.

A training run (``pmakit train``, also each sub-run of a study)::

    RUN/snapshots/step-XXXXXXXX/   the weight snapshots, one every V tokens (``snapshot_name``)
    RUN/checkpoint/                the newest full state (weights, optimizer, trainer.pt)
    RUN/checkpoints/tokens-T/      full states kept at chosen token counts (a study's fork points)
    RUN/metrics.jsonl              train / eval / snapshot / event records
    RUN/replicas/rank-R/snapshots/ with model copies: each copy's own snapshots

A study (``pmakit experiment``) adds its result rows, ``RUN/results.jsonl`` (and ``results.csv`` beside it), and
keeps its training runs inside: the PMA study ``RUN/main/`` (the constant-LR run) and ``RUN/anneal-F/`` (a branch
annealed from F tokens), the scaling study the same per size (``RUN/SIZE/trunk/``, ``RUN/SIZE/anneal-D/``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from pmakit.limits import JSON_DEPTH, json_depth_ok, refuse

SNAPSHOTS = "snapshots"
"""``RUN/snapshots/``: the weight snapshots of a training run."""
CHECKPOINT = "checkpoint"
"""``RUN/checkpoint/``: the newest full state, what ``--resume`` continues from."""
KEPT_CHECKPOINTS = "checkpoints"
"""``RUN/checkpoints/tokens-T/``: full states the trainer keeps at chosen token counts."""
TRAINER_STATE = "trainer.pt"
"""Inside a full state: the trainer, saver, averager and config (plain values, loads with weights_only=True)."""
METRICS = "metrics.jsonl"
"""``RUN/metrics.jsonl``: the run's metrics log, one JSON record a line."""
RESULTS = "results.jsonl"
"""``RUN/results.jsonl``: a study's result rows, one JSON record a line, appended as they are measured."""
RESULTS_CSV = "results.csv"
"""``RUN/results.csv``: the same rows as a table."""
MAIN_RUN = "main"
"""``RUN/main/``: the PMA study's constant-LR run, whose snapshots are merged and whose kept states are forked."""


SNAPSHOT_NAME = re.compile(r"^step-(\d{8,})$")
"""A snapshot the saver wrote (and so may delete under ``keep_last``): ``step-`` and the step, 8 digits or more."""


def snapshots_dir(run: Path) -> Path:
    return Path(run) / SNAPSHOTS


def snapshot_name(step: int) -> str:
    """``step-00000420``: zero-padded, so that names sort by step."""
    return f"step-{step:08d}"


def checkpoint_dir(run: Path) -> Path:
    return Path(run) / CHECKPOINT


def kept_checkpoint_dir(run: Path, tokens: int) -> Path:
    """The full state a run kept at ``tokens`` (its ``keep_checkpoints_at``)."""
    return Path(run) / KEPT_CHECKPOINTS / f"tokens-{tokens}"


def replica_dir(run: Path, rank: int) -> Path:
    """With model copies: what copy ``rank`` writes of its own (its metrics, its snapshots with --save-replicas)."""
    return Path(run) / "replicas" / f"rank-{rank}"


def anneal_run(study: Path, tokens: int) -> Path:
    """A study's branch annealed from ``tokens`` (the PMA study's fork point F, the scaling study's budget D)."""
    return Path(study) / f"anneal-{tokens}"


def trainer_state(checkpoint: Path) -> Path:
    """The trainer's own state inside a full-state directory: present only in a full state, not in a snapshot."""
    return Path(checkpoint) / TRAINER_STATE


# ---------------------------------------------------------------------------------------------- recorded paths


def run_relative(path: str | os.PathLike[str], base: str | os.PathLike[str]) -> str:
    """How a run records ``path``: relative to ``base`` (a folder of the run) when it lies inside, so that the run
    still finds it after being moved, copied or named by another path from another working directory; otherwise
    absolute (a path relative to the working directory of the moment would mean nothing later).

    Lexical, not ``resolve()``: a snapshot that is a symlink inside the run is recorded by its name in the run.
    """
    absolute = Path(os.path.abspath(path))
    try:
        return absolute.relative_to(os.path.abspath(base)).as_posix()
    except ValueError:
        return str(absolute)


def in_run(recorded: str | os.PathLike[str], base: str | os.PathLike[str], *, as_given: bool = False) -> Path:
    """Where a path a run recorded with ``run_relative`` is now: under ``base`` (an absolute one as it is).

    ``as_given``: the run recorded the path as it was given (runs written before paths were run-relative:
    absolute, or relative to the working directory of that time). The entry of that name in ``base`` is taken
    when there is one, as the run may have moved since; else the path as recorded.
    """
    path = Path(recorded)
    if not as_given:
        return Path(base) / path
    here = Path(base) / path.name
    return here if here.exists() else path


# ---------------------------------------------------------------------------------------------- atomic writes


def _temp_sibling(path: Path) -> Path:
    # Same directory: os.replace is atomic only within one file system. Hidden, so no reader lists it.
    return path.with_name(f".{path.name}.tmp")


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", *, fsync: bool = True) -> Iterator[IO[Any]]:
    """A file opened for writing that appears at ``path`` only once the block ends without an error.

    Written to a temporary sibling, flushed (and fsync'ed: survives a power loss, not just a kill), then renamed
    over ``path``: a reader sees the old file or the new one, never half of one. On an error the temporary file is
    removed and ``path`` is untouched. Text mode does no newline translation (what is written is what lands).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files ('w' or 'wb'), not {mode!r}")
    path = Path(path)
    tmp = _temp_sibling(path)
    try:
        f: IO[Any]
        with open(tmp, "wb") if mode == "wb" else open(tmp, "w", encoding="utf-8", newline="") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def atomic_write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically; see ``atomic_open``."""
    with atomic_open(path, "w", fsync=fsync) as f:
        f.write(text)


def atomic_write_bytes(path: Path, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; see ``atomic_open``."""
    with atomic_open(path, "wb", fsync=fsync) as f:
        f.write(data)


def atomic_write_json(path: Path, data: Any, *, indent: int | None = 1, fsync: bool = True) -> None:
    """Replace ``path`` with ``data`` as JSON (and a final newline) atomically; see ``atomic_open``."""
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n", fsync=fsync)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(partial: Path, out: Path) -> None:
    """Move the finished ``partial`` to ``out``; an old ``out`` is removed only after the new one is in place."""
    old = None
    if os.path.lexists(out):
        old = out.parent / f".{out.name}.pmakit-old"
        remove_tree(old)
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        remove_tree(old)


def remove_tree(path: Path) -> None:
    """Remove a directory tree, or a file or symlink (rmtree refuses those, and would leave them behind)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ----------------------------------------------------------------------------------------------- JSON, JSONL


def read_json_object(path: Path) -> dict[str, Any] | None:
    """A JSON object file, or None when it is absent, unreadable or not an object."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, oldest first; [] when it does not exist.

    A line that is not a JSON object is skipped: a kill mid-append leaves a torn last line, and a resumed run
    appends after it, so the torn record can also sit inside the file. The record it held is measured again.
    """
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        except RecursionError:  # not a torn line: a written one, nested past any record pmakit writes
            raise refuse(JSON_DEPTH, f"{path}:{i}") from None
        if isinstance(record, dict):
            if not json_depth_ok(record):
                raise refuse(JSON_DEPTH, f"{path}:{i}")
            records.append(record)
    return records


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as a line (flushed when this returns; a kill can tear only this line)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def resolves_inside(path: Path, root: Path) -> bool:
    """Whether ``path``, every symlink followed, lies inside ``root`` (its own symlinks followed too). Files
    carried from an input into an output must: a symlink in a checkpoint to a file elsewhere (another user's
    tokenizer, ``~/.ssh``) is not part of that checkpoint and is never copied."""
    try:
        return path.resolve(strict=True).is_relative_to(root.resolve(strict=True))
    except (OSError, RuntimeError):  # missing, a loop, a name too long
        return False
