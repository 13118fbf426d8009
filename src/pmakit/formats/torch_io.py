"""torch state dicts: ``*.pt`` / ``*.pth`` / ``*.bin`` (HF ``pytorch_model.bin`` and its sharded index).

Files are loaded with ``weights_only=True`` (anything that is not tensors and plain containers is refused) and
``mmap=True``, so opening costs no memory and a chunk is paged in only when it is read. A checkpoint that wraps the
weights (``{"model": ..., "optimizer": ...}`` as nanoGPT saves it, or ``{"state_dict": ...}``) is unwrapped; the
other entries are reported as skipped.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import zipfile
import zlib
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.formats import FileInfo, Format, Reader, TensorInfo
from pmakit.storage.source import open_source

INDEX_FILE = "pytorch_model.bin.index.json"
SUFFIXES = (".pt", ".pth", ".bin")
# Files an HF Trainer or a training loop writes beside the weights.
NOT_WEIGHTS = ("optimizer", "scheduler", "rng_state", "training_args", "scaler", "trainer_state")
WRAPPER_KEYS = ("model", "state_dict", "module", "model_state_dict")


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX_FILE
    if index.exists():
        from pmakit.formats.safetensors_io import _inside, _weight_map

        names = dict.fromkeys(_weight_map(index).values())

        return [_inside(path, n) for n in names]
    return sorted(
        f
        for f in path.iterdir()
        if f.suffix in SUFFIXES and f.is_file() and not f.name.startswith(NOT_WEIGHTS)
    )


def load(file: Path) -> dict[str, Any]:
    try:
        try:
            obj = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(file, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except pickle.UnpicklingError as e:
        raise PmakitError(
            f"{file}: refused: holds pickled objects other than tensors (loaded with "
            "weights_only=True); re-save it as a plain state dict or safetensors"
        ) from e
    except FileNotFoundError as e:
        raise PmakitError(f"{file}: missing") from e
    except Exception as e:  # torch raises many types for a damaged zip or pickle
        raise PmakitError(f"{file}: corrupt or unreadable torch file ({type(e).__name__}: {e})") from e
    if not isinstance(obj, dict):
        raise PmakitError(f"{file}: expected a state dict, got {type(obj).__name__}")
    return obj


def _check_crc(file: Path) -> None:
    """Refuse a zip whose members fail their CRC-32 (bit rot, a torn copy): torch itself never checks it, so a
    damaged storage would merge silently. One sequential read of the file, usually from the page cache."""
    try:
        with zipfile.ZipFile(file) as z:
            bad = z.testzip()
    except zipfile.BadZipFile:
        return  # the legacy (non-zip) format, or a damaged zip that torch.load already refused
    except (OSError, EOFError, ValueError, zlib.error) as e:
        raise PmakitError(f"{file}: corrupt torch file ({e})") from e
    if bad is not None:
        raise PmakitError(f"{file}: corrupt torch file (member {bad} fails its CRC check)")


def _header_sha256(file: Path) -> str:
    """sha256 of the pickled structure (names, shapes, storage keys): cheap, and changes when the tensors do."""
    try:
        with zipfile.ZipFile(file) as z:
            pkl = next(n for n in z.namelist() if n.endswith("data.pkl"))
            return hashlib.sha256(z.read(pkl)).hexdigest()
    except (zipfile.BadZipFile, StopIteration, OSError):
        return ""


class TorchReader(Reader):
    format = "torch"

    def __init__(
        self, path: Path, files: list[Path] | None = None, wrappers: tuple[str, ...] = WRAPPER_KEYS
    ) -> None:
        """``files``: the weight files to read (default: those of the directory ``path``); ``wrappers``: the
        entries that may hold the weights (the first that holds tensors does)."""
        super().__init__(path)
        self.tensors = {}
        self.files = []
        self._tensors: dict[str, torch.Tensor] = {}
        files = weight_files(path) if files is None else files
        if not files:
            raise PmakitError(f"{path}: no torch weight files")
        self._files = files
        sources = [open_source(file) for file in files]
        for source in sources:  # an object-store mirror's placeholder: torch.load reads the whole file
            source.fill()
        for i, file in enumerate(files):
            state = load(file)
            _check_crc(file)
            for key in wrappers:
                if isinstance(state.get(key), dict) and any(
                    isinstance(v, torch.Tensor) for v in state[key].values()
                ):
                    self.skipped += [f"{file.name}:{k}" for k in state if k != key]
                    state = state[key]
                    break
            for offset, (name, value) in enumerate(state.items()):
                if not isinstance(value, torch.Tensor):
                    self.skipped.append(f"{file.name}:{name}")
                    continue
                if name in self.tensors:
                    raise PmakitError(f"{file}: tensor {name!r} appears in two files")
                self._tensors[name] = value
                self.tensors[name] = TensorInfo(value.dtype, tuple(value.shape), (i, offset))
            self.files.append(FileInfo(file.name, file.stat().st_size, _header_sha256(file)))
        self.watch(sources)

    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A view of the memory-mapped tensor (read-only by contract)."""
        # A mapped page past the end of a truncated file is a SIGBUS: check the size has not changed first.
        index = self.tensors[name].order[0]
        if os.stat(self._files[index]).st_size != self.files[index].size:
            raise PmakitError(f"{self._files[index]}: truncated or rewritten while being merged; merge again")
        return self._tensors[name].reshape(-1)[start:stop]

    def close(self) -> None:
        self._tensors.clear()


def _detect(path: Path) -> bool:
    return (path / INDEX_FILE).exists() or any(
        f.suffix in SUFFIXES and not f.name.startswith(NOT_WEIGHTS) for f in path.iterdir() if f.is_file()
    )


FORMAT = Format("torch", _detect, TorchReader)
