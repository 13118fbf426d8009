"""HF safetensors: ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.

The reader parses headers itself (8-byte length + JSON) and maps the files: a chunk is a tensor view of the page
cache, converted to fp32 by the merge without any intermediate copy (a ``read()`` into a buffer would add a memcpy
of every input byte, the largest CPU cost of a merge after the accumulation itself). ``prefetch`` asks the kernel
to start reading a range early. The writer knows every tensor's shape and dtype before the first byte, so it
writes each shard's header first and then streams chunks.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import mmap
import os
import struct
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import FileInfo, Format, Reader, TensorInfo
from pmakit.storage.source import ByteSource, open_source

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a sharded checkpoint's index (bounded in size and nesting)."""
    try:
        data = limits.read_json(index)
    except PmakitError as e:
        raise PmakitError(f"{index}: unreadable index ({str(e).removeprefix(f'{index}: ')})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise PmakitError(f"{index}: unreadable index (no weight_map of tensor names to file names)")
    if len(weight_map) > limits.TENSORS_PER_FILE.value:
        raise limits.refuse(limits.TENSORS_PER_FILE, str(index))
    return weight_map


def read_header(path: Path) -> tuple[dict[str, Any], int, bytes]:
    """(header dict, byte offset of the data section, raw header bytes). Checks the header against the file size."""
    limits.check_regular(path)  # a FIFO would block the read forever
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise PmakitError(f"{path}: corrupt safetensors file (shorter than its 8-byte header length)")
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise PmakitError(
                    f"{path}: corrupt safetensors file (header length {n} for a {size}-byte file)"
                )
            if n > limits.SAFETENSORS_HEADER_BYTES.value:
                raise limits.refuse(limits.SAFETENSORS_HEADER_BYTES, f"{path}'s header ({n:,} bytes)")
            raw = f.read(n)
    except PmakitError:
        raise
    except OSError as e:
        raise PmakitError(f"{path}: cannot read ({e.strerror or e})") from e
    # Counted before parsing: a header of a million one-element tensors parses into gigabytes.
    if raw.count(b'"dtype"') > limits.TENSORS_PER_FILE.value:
        raise limits.refuse(limits.TENSORS_PER_FILE, str(path))
    try:
        header = json.loads(raw, object_pairs_hook=_no_duplicates)
    except ValueError as e:
        raise PmakitError(f"{path}: corrupt safetensors header ({e})") from e
    except RecursionError:
        raise PmakitError(f"{path}: corrupt safetensors header (nested too deep)") from None
    if not isinstance(header, dict):
        raise PmakitError(f"{path}: corrupt safetensors header (not a JSON object)")
    data_start = 8 + n
    ranges: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            begin, end = (int(x) for x in entry["data_offsets"])
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
        except (KeyError, TypeError, ValueError) as e:
            raise PmakitError(f"{path}: tensor {name!r} has a bad header entry {entry!r}") from e
        if end - begin != numel * dtype.itemsize or begin < 0 or data_start + end > size:
            raise PmakitError(
                f"{path}: tensor {name!r} lies outside the file or has the wrong byte length "
                "(truncated or corrupt file)"
            )
        ranges.append((begin, end, name))
    _check_contiguous(path, ranges, size - data_start)
    return header, data_start, raw


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are unique: a second entry of one tensor would silently replace the first."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"tensor {key!r} appears twice")
        out[key] = value
    return out


def _check_contiguous(path: Path, ranges: list[tuple[int, int, str]], data_bytes: int) -> None:
    """Tensors tile the data section back to back from 0 to the end of the file, as the safetensors library
    requires ("invalid offset", "incomplete metadata"): overlapping ranges would make two tensors share bytes, a gap
    or trailing bytes mean data no tensor owns (bytes inserted into a file shift every later tensor)."""
    expected = 0
    for begin, end, name in sorted(ranges):
        if begin != expected:
            raise PmakitError(
                f"{path}: tensor {name!r} has invalid data_offsets [{begin}, {end}] "
                f"(overlaps another tensor or leaves a gap; expected to start at {expected})"
            )
        expected = end
    if expected != data_bytes:
        raise PmakitError(
            f"{path}: the tensors cover {expected} bytes of a {data_bytes}-byte data section "
            "(bytes inserted or appended: corrupt file)"
        )


def _inside(directory: Path, name: str) -> Path:
    """``directory/name``, refusing names that are absolute or climb out (symlinked files are fine)."""
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise PmakitError(
            f"{directory / INDEX_FILE}: refusing shard path {name!r} outside the snapshot directory"
        )
    return directory / name


class SafetensorsReader(Reader):
    format = "safetensors"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._files = self._shard_files(path)
        self._sources: list[ByteSource] = []
        self._where: dict[str, tuple[int, int]] = {}  # name -> (file index, absolute byte offset)
        self.tensors = {}
        self.files = []
        try:
            for i, file in enumerate(self._files):
                header, data_start, raw = read_header(file)
                self.files.append(FileInfo(file.name, file.stat().st_size, hashlib.sha256(raw).hexdigest()))
                # An object-store mirror's placeholder holds only the header: its bytes are ranged GETs of
                # aligned blocks, fetched ahead as the merge moves through the file.
                self._sources.append(open_source(file, sequential=True))
                for name, entry in header.items():
                    if name == "__metadata__":
                        continue
                    if name in self.tensors:
                        raise PmakitError(f"{file}: tensor {name!r} appears in two shards")
                    begin = int(entry["data_offsets"][0])
                    self.tensors[name] = TensorInfo(
                        DTYPES[entry["dtype"]], tuple(int(d) for d in entry["shape"]), (i, begin)
                    )
                    self._where[name] = (i, data_start + begin)
            self.watch(self._sources)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _shard_files(path: Path) -> list[Path]:
        index = path / INDEX_FILE
        if index.exists():
            weight_map = _weight_map(index)
            files = [_inside(path, n) for n in dict.fromkeys(weight_map.values())]
            for f in files:
                if not f.exists():
                    raise PmakitError(f"{index}: names shard {f.name}, which is missing")
            return files
        if (path / SINGLE_FILE).exists():
            return [path / SINGLE_FILE]
        found = sorted(path.glob("*.safetensors"))
        if len(found) == 1:
            return found
        raise PmakitError(
            f"{path}: {len(found)} .safetensors files and no {INDEX_FILE} to say which are the model"
        )

    def _range(self, name: str, start: int, stop: int) -> tuple[int, int, int]:
        """(file index, byte offset, byte length) of elements [start, stop) of ``name``."""
        info = self.tensors[name]
        index, offset = self._where[name]
        size = info.dtype.itemsize
        return index, offset + start * size, (stop - start) * size

    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """A read-only view of the mapped file (valid until ``close``), or the bytes fetched; ``out`` is not
        needed."""
        index, offset, nbytes = self._range(name, start, stop)
        if nbytes == 0:
            return torch.empty(0, dtype=self.tensors[name].dtype)
        data = self._sources[index].read(offset, offset + nbytes)
        with warnings.catch_warnings():
            # torch warns that the buffer is read-only; the view is read-only by the Reader contract. (A writable
            # private mapping would instead be charged in full against the overcommit limit.)
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(data, dtype=self.tensors[name].dtype)

    def prefetch(self, name: str, start: int, stop: int) -> None:
        index, offset, nbytes = self._range(name, start, stop)
        self._sources[index].hint(offset, offset + nbytes)

    def close(self) -> None:
        for source in self._sources:
            source.close()
        self._sources = []


def _detect(path: Path) -> bool:
    return (path / INDEX_FILE).exists() or any(path.glob("*.safetensors"))


FORMAT = Format("safetensors", _detect, SafetensorsReader)


# ---------------------------------------------------------------------------------------------------------------
# Writing


@dataclass(frozen=True)
class OutputTensor:
    """One tensor to write, or of a model layout being planned (``merge/capacity``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Shard:
    """One output file and the tensors it holds, in write order."""

    file: str
    tensors: tuple[OutputTensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def plan_shards(tensors: Sequence[OutputTensor], max_shard_size: int) -> list[Shard]:
    """Group tensors, in order, into shards of at most ``max_shard_size`` bytes (HF names).

    A tensor larger than the limit gets a shard of its own. One shard is named ``model.safetensors``.
    """
    groups: list[list[OutputTensor]] = []
    size = 0
    for t in tensors:
        if not groups or (size + t.nbytes > max_shard_size and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    if len(groups) <= 1:
        return [Shard(SINGLE_FILE, tuple(groups[0] if groups else ()))]
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", tuple(g)) for i, g in enumerate(groups)]


def header_bytes(tensors: Iterable[OutputTensor], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + JSON header for tensors stored back to back in this order (padded to 8 bytes)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": DTYPE_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _libc_sync_file_range() -> Any:
    """Linux's ``sync_file_range`` (not in Python's os module), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


_DIRECT_ALIGN = 4096
"""O_DIRECT transfers: buffer address, file offset and length are multiples of this (any block size divides it)."""
_DIRECT_STAGE = 8 * 2**20
"""Bytes staged before each O_DIRECT write."""


class _DirectFile:
    """Appends to a file through O_DIRECT, bypassing the page cache.

    A buffered write() copies every byte into freshly allocated page-cache pages and leaves them for the kernel to
    flush (on this 2-core VM that copy was a quarter of a merge's CPU time). Here bytes are staged in a reused,
    page-aligned buffer and written in whole aligned blocks straight to the disk; the tail is padded and the file
    truncated to its length at the end. Where the file system refuses O_DIRECT, it falls back to buffered writes.
    """

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        self._stage = mmap.mmap(-1, _DIRECT_STAGE)  # anonymous maps are page aligned
        self._view = memoryview(self._stage)
        self._fill = 0  # staged bytes
        self._size = 0  # bytes in the file

    @staticmethod
    def open(path: Path) -> _DirectFile | None:
        """A direct writer, or None where the OS has no O_DIRECT or the file system refuses it."""
        if not hasattr(os, "O_DIRECT"):
            return None
        try:
            return _DirectFile(path)
        except OSError:
            return None

    def fileno(self) -> int:
        return self._fd

    def write(self, data: bytes | memoryview) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = min(len(data), _DIRECT_STAGE - self._fill)
            self._view[self._fill : self._fill + n] = data[:n]
            self._fill += n
            data = data[n:]
            if self._fill == _DIRECT_STAGE:
                self._write_staged(_DIRECT_STAGE)
                self._fill = 0

    def _write_staged(self, n: int) -> None:
        done = 0
        while done < n:
            try:
                done += os.write(self._fd, self._view[done:n])
            except OSError as e:
                if e.errno != 22:  # EINVAL: O_DIRECT refused after all; write through the page cache instead
                    raise
                import fcntl  # Unix only, like O_DIRECT itself

                fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self._size += n

    def finish(self) -> None:
        """Write the staged tail (padded to a whole block) and cut the file to its real length."""
        tail = self._fill
        if tail:
            padded = -(-tail // _DIRECT_ALIGN) * _DIRECT_ALIGN
            self._write_staged(padded)
            self._size -= padded - tail
            os.ftruncate(self._fd, self._size)
        self._fill = 0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._view.release()
        self._stage.close()


class ShardWriter:
    """Streams one shard: header first, then each tensor's bytes in order, chunk by chunk.

    ``direct=True`` writes through O_DIRECT (see ``_DirectFile``): for large outputs written once, like a merge's.
    ``checksum=False``: no sha256 on the way (the caller hashes the same bytes elsewhere, e.g. on a thread of its
    own); such a writer ends with ``finish``, not ``close``.
    """

    def __init__(
        self,
        path: Path,
        shard: Shard,
        metadata: dict[str, str] | None = None,
        *,
        direct: bool = False,
        checksum: bool = True,
    ) -> None:
        self.path = path
        self.shard = shard
        self._expected = [(t.name, t.nbytes) for t in shard.tensors]
        self._pos = 0  # index of the tensor being written
        self._written = 0  # bytes of it written so far
        self._hash = hashlib.sha256() if checksum else None
        self._direct = _DirectFile.open(path) if direct else None
        self._f = self._direct or open(path, "wb")  # noqa: SIM115 - closed in close()
        self._size = 0  # bytes written
        self._flushed = 0  # bytes whose writeback has been started
        self.write_seconds = 0.0
        """Wall time in the file's write calls (a chunk at a time: two clock reads per chunk)."""
        self.hash_seconds = 0.0
        """Wall time checksumming."""
        self._emit(header_bytes(shard.tensors, metadata))

    def _emit(self, data: bytes | memoryview) -> None:
        start = time.perf_counter()
        self._f.write(data)
        written = time.perf_counter()
        self.write_seconds += written - start
        if self._hash is not None:
            self._hash.update(data)
            self.hash_seconds += time.perf_counter() - written
        self._size += len(data)

    def start_writeback(self, min_bytes: int = 32 * 2**20) -> None:
        """Start writing to disk what was written so far (without waiting), so that ``close``'s fsync has little
        left to wait for. Does nothing until ``min_bytes`` are pending, or where the OS has no sync_file_range."""
        if _SYNC_FILE_RANGE is None or self._direct is not None or self._size - self._flushed < min_bytes:
            return
        assert not isinstance(self._f, _DirectFile)
        self._f.flush()
        if _SYNC_FILE_RANGE(
            self._f.fileno(), self._flushed, self._size - self._flushed, _SYNC_FILE_RANGE_WRITE
        ):
            return  # only a hint: the fsync in close() still makes the file durable
        self._flushed = self._size

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append the next chunk (flat, contiguous, in the planned dtype) of tensor ``name``."""
        expected_name, expected_bytes = self._expected[self._pos]
        if name != expected_name:
            raise RuntimeError(f"writer expected {expected_name!r}, got {name!r}")
        data = memoryview(chunk.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]
        self._emit(data)
        self._written += len(data)
        if self._written > expected_bytes:
            raise RuntimeError(f"too many bytes for {name!r}")
        if self._written == expected_bytes:
            self._pos += 1
            self._written = 0

    def close(self, fsync: bool = True) -> str:
        """Finish the file (checks every tensor was written) and return its sha256."""
        if self._hash is None:
            raise RuntimeError(f"{self.path}: written without a checksum; end it with finish()")
        self.finish(fsync)
        return self._hash.hexdigest()

    def finish(self, fsync: bool = True) -> None:
        """Finish the file: checks every tensor was written, writes what is staged, fsyncs it (``fsync``)."""
        if self._pos != len(self._expected):
            self._f.close()
            raise RuntimeError(f"{self.path}: closed before all tensors were written")
        if isinstance(self._f, _DirectFile):
            self._f.finish()
        else:
            self._f.flush()
        if fsync:
            os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


def write_index(directory: Path, shards: Sequence[Shard]) -> None:
    """``model.safetensors.index.json`` for a sharded output (nothing for a single file)."""
    if len(shards) <= 1:
        return
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in shards)},
        "weight_map": {t.name: s.file for s in shards for t in s.tensors},
    }
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def save_file(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str]) -> None:
    """Write a dict of tensors as one safetensors file (small helper for snapshots and tests)."""
    items = [(k, v.detach().cpu().contiguous()) for k, v in tensors.items()]
    shard = Shard(Path(path).name, tuple(OutputTensor(k, v.dtype, tuple(v.shape)) for k, v in items))
    writer = ShardWriter(Path(path), shard)
    for k, v in items:
        writer.write(k, v.reshape(-1))
    writer.close(fsync=False)
