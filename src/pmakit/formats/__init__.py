"""Weight readers and writers. A reader exposes names, shapes and dtypes from headers, then flat element ranges.

Formats register themselves in ``FORMATS`` (first match wins): HF safetensors (single file or shards + index),
torch state dicts (``*.pt``/``*.bin``, read with ``weights_only=True``), and torch DCP.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pmakit.errors import PmakitError
from pmakit.storage.source import ByteSource


@dataclass(frozen=True)
class TensorInfo:
    """What a header says about one tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    order: tuple[int, int] = (0, 0)
    """(file index, byte offset): reading in this order is sequential on disk."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class FileInfo:
    """An input file, for the merge manifest."""

    name: str
    size: int
    header_sha256: str


class Reader(ABC):
    """Reads one snapshot's tensors. ``tensors`` comes from headers only; no weight is read until ``read``."""

    format: str = ""
    tensors: dict[str, TensorInfo]
    files: list[FileInfo]
    skipped: list[str]
    """Entries of the checkpoint that are not model weights (optimizer state, RNG) and were left out."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.skipped = []

    @abstractmethod
    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``name`` flattened, in its own dtype. Callers must not modify it.

        It may be a view of a memory-mapped file (valid until ``close``). ``out``, when given, is a uint8 buffer of
        at least the chunk's bytes that a reader which must copy may fill and return a view of.
        """

    def breaks(self, name: str) -> Sequence[int]:
        """Flat offsets inside tensor ``name`` where this reader's own pieces of it begin (past 0): a ``read`` across
        one joins two pieces in a copy, a read within one may be a view. The merge cuts its chunks there."""
        return ()

    def watch(self, sources: Iterable[ByteSource]) -> None:
        """Check ``sources`` (the files read, as opened) in ``verify``."""
        self._watched = list(sources)

    def verify(self) -> None:
        """Fail with one line if a watched file was truncated, replaced or rewritten since it was opened: the bytes
        merged would then be neither version (call it once every byte has been read, before publishing). A file of
        an object store was read pinned to the version listed, so that a rewrite failed the read itself."""
        for source in getattr(self, "_watched", []):
            source.verify()

    def prefetch(self, name: str, start: int, stop: int) -> None:  # noqa: B027 - optional hook
        """Hint that ``read(name, start, stop)`` comes soon (start the disk read early)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release files."""

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Format:
    name: str
    detect: Callable[[Path], bool]
    open: Callable[[Path], Reader]


FORMATS: list[Format] = []


def detect_format(directory: Path) -> Format | None:
    """The format of the weights in ``directory``, or None if it holds none."""
    _load_builtin_formats()
    for fmt in FORMATS:
        if fmt.detect(directory):
            return fmt
    return None


def open_reader(directory: str | os.PathLike[str]) -> Reader:
    """Open the weights of a snapshot directory (headers only)."""
    directory = Path(directory)
    fmt = detect_format(directory)
    if fmt is None:
        raise PmakitError(
            f"{directory}: no weights found (model.safetensors, shards + index, *.pt/*.bin, or DCP)"
        )
    return fmt.open(directory)


def read_state(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A snapshot's whole state dict in memory (any format pmakit reads), each tensor an owned copy."""
    with open_reader(directory) as reader:
        return {k: reader.read(k, 0, i.numel).clone().reshape(i.shape) for k, i in reader.tensors.items()}


def _load_builtin_formats() -> None:
    if FORMATS:
        return
    from pmakit.formats import safetensors_io, torch_io

    FORMATS.extend([safetensors_io.FORMAT, torch_io.FORMAT])
    try:
        from pmakit.formats import dcp_io  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return
    FORMATS.append(dcp_io.FORMAT)


FLOAT_DTYPES = {torch.float64, torch.float32, torch.float16, torch.bfloat16}


def is_float(dtype: torch.dtype) -> bool:
    """Averaged (floating point) rather than copied from the newest snapshot (ints, bools, fp8)."""
    return dtype in FLOAT_DTYPES
