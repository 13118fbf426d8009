"""What every run layout returns and implements: the ``Snapshot`` record and the ``Layout`` interface.

A leaf module (it imports only ``formats`` and ``errors``): ``pmakit.snapshot`` finds snapshots through the
layouts, and the layouts build ``Snapshot`` records, so the record lives below both.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import Reader, open_reader

METADATA_FILE = "pmakit.json"
MERGE_MANIFEST = "pmakit-merge.json"
STEP_IN_NAME = re.compile(r"(?:checkpoint|step|iter|global_step)[-_]?0*(\d+)$")
"""A step number at the end of a directory name: checkpoint-500, step-500, step_500, step500, iter_0000500."""


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
    """Where the token count came from: a layout's name (pmakit, hf-trainer, olmo-core, ...), or ``name`` (the
    step in the directory's name x tokens_per_step)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The whole metadata record."""
    layout: str = "pmakit"
    """The run layout that recognised the directory (``pmakit.layouts``)."""

    @property
    def name(self) -> str:
        return self.path.name


class Layout(ABC):
    """How one trainer lays out its checkpoints. See ``pmakit.layouts`` for the contract."""

    name: str = ""
    """Shown by ``pmakit inspect``; also ``Snapshot.layout``."""
    own_files: tuple[str, ...] = ()
    """Files that mark a checkpoint of this layout (Megatron's ``metadata.json``): never copied into the output of
    a merge as extras; ``write`` writes them where the output is in this layout."""
    generic: bool = False
    """Claims any directory with weights at its top level (plain model or DCP dirs, no trainer metadata): a folder
    it claims that also holds checkpoints is a save folder, not one checkpoint."""
    single_file: bool = False
    """Each checkpoint is one file (Lightning's ``.ckpt``), not a directory: ``is_snapshot`` and ``read`` are
    then asked about files, and ``snapshots`` lists files."""
    native_format: str = "safetensors"
    """What ``pmakit merge`` writes by default for inputs of this layout: ``safetensors`` (HF layout, written by
    the merge itself) or this layout's own name (then ``write`` writes it)."""

    @abstractmethod
    def is_snapshot(self, path: Path) -> bool:
        """``path`` is one checkpoint of this layout (complete or not: ``read`` says which). Cheap: file names."""

    def ignore(self, path: Path) -> bool:
        """``path`` belongs to this layout but is not a checkpoint to merge, nor a folder to search (a merged
        output the trainer wrote, say). Default: nothing is ignored."""
        return False

    def snapshots(self, save_folder: Path) -> list[Path]:
        """Candidate checkpoints directly inside ``save_folder``, in name order (hidden directories never)."""
        return [
            child
            for child in sorted(save_folder.iterdir())
            if child.is_dir()
            and not child.name.startswith(".")
            and not self.ignore(child)
            and self.is_snapshot(child)
        ]

    @abstractmethod
    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        """Step, tokens, lr and loss of one checkpoint, from metadata only (JSON, or allow-listed
        ``weights_only`` loads: never arbitrary unpickling). ``source`` and ``layout`` name this layout.

        Raises:
            IncompleteSnapshot: no weights, or no way to know the token count.
        """

    def open(self, path: Path) -> Reader:
        """A reader over the model weights only, named as the framework's model names them (optimizer,
        scheduler, RNG, data loader and trainer state are left out and listed in ``Reader.skipped``)."""
        return open_reader(path)

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        """Write merged model weights into ``out`` in this layout, so the framework's own loader loads it.

        Args:
            merged: this rank's merged tensors, under the names ``open`` gives: views of memory-mapped staged
                files, so writing them tensor by tensor (or shard by shard) keeps memory bounded. Never
                materialise them all.
            template: the newest input checkpoint: copy what is not averaged (configs, non-tensor extra state)
                from it.
            out: the (partial) output directory; the merge renames it into place once complete.
            distributed: every rank of the default process group calls this with its own disjoint tensors
                (a collective); else one process writes everything.
            fsync: make the files durable before returning.

        Returns:
            The files written, relative to ``out`` (for the merge manifest).
        """
        raise PmakitError(f"pmakit cannot write the {self.name} layout; use --format safetensors")


def load_json(file: Path) -> dict[str, Any]:
    """A JSON object from a metadata file; anything else is an ``IncompleteSnapshot``."""
    try:
        data = limits.read_json(file)
    except PmakitError as e:
        raise IncompleteSnapshot(file, f"unreadable ({str(e).removeprefix(f'{file}: ')})") from None
    if not isinstance(data, dict):
        raise IncompleteSnapshot(file, "expected a JSON object")
    return data


def _count(meta: dict[str, Any], key: str) -> int | None:
    """``meta[key]`` as a non-negative integer count, None when absent; anything else (``true``, ``-5``, ``1.5``,
    ``"10"``) is refused: JSON ``true`` is an int to Python, and a wrong count silently reorders a merge."""
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key!r} must be a non-negative integer, got {json.dumps(value)}")
    return value


def validate_metadata(meta: dict[str, Any], file: Path) -> tuple[int, int | None]:
    """(tokens, step) of a snapshot's metadata record, validated: the one check every layout's metadata goes
    through. A missing or malformed count is an ``IncompleteSnapshot`` naming ``file``."""
    try:
        tokens, step = _count(meta, "tokens"), _count(meta, "step")
    except ValueError as e:
        raise IncompleteSnapshot(file, str(e)) from None
    if tokens is None:
        raise IncompleteSnapshot(file, "'tokens' is missing")
    return tokens, step


def float_or_none(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def step_from_name(path: Path) -> int | None:
    match = STEP_IN_NAME.search(path.name)
    return int(match.group(1)) if match else None


def from_name(path: Path, tokens_per_step: int | None, layout: str) -> Snapshot:
    """A checkpoint whose only metadata is the step in its name: tokens = step x ``tokens_per_step``."""
    step = step_from_name(path)
    if step is not None and tokens_per_step:
        return Snapshot(path, tokens=step * tokens_per_step, step=step, source="name", layout=layout)
    hint = " (pass --tokens-per-step to count tokens from the step in its name)" if step is not None else ""
    raise IncompleteSnapshot(path, f"no {METADATA_FILE}, so its token count is unknown{hint}")


def is_merge_output(path: Path) -> bool:
    """A model pmakit merged (it has a merge manifest and is not itself a training snapshot)."""
    return (path / MERGE_MANIFEST).exists() and not (path / METADATA_FILE).exists()
