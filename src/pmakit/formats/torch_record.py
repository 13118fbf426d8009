"""A tensor saved by ``torch.save`` inside a bigger file, mapped instead of loaded.

DCP's file writers (torch's and OLMo-core's) store each saved chunk of a tensor as one ``torch.save`` record, a
zip archive, at an offset in a ``.distcp`` file. Such an archive stores the tensor's bytes uncompressed
(``archive/data/<key>``) beside a small pickle that says how to view them. ``record_view`` finds those bytes
and returns a tensor view of the memory-mapped file: no copy, no memory but the page cache, and the merge reads a
chunk of it at a time, as it does a safetensors file. The pickle is read by a restricted unpickler that only
notes the arguments of torch's tensor rebuild function; anything it does not recognise (another layout, a view
of a larger storage, a big-endian record, compression) returns None and the caller loads the record through DCP.
"""

from __future__ import annotations

import collections
import io
import mmap
import pickle
import struct
import sys
import warnings
import zipfile
from typing import Any

import torch

_LOCAL_HEADER = struct.Struct("<4s5H3I2H")  # zip local file header: 30 bytes, then name and extra field


class _Window(io.RawIOBase):
    """A read-only, seekable file over ``view`` (a slice of a mapped file), for ``zipfile``."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        data = self._view[self._pos : self._pos + len(buffer)]
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class _Rebuild:
    """What ``torch._utils._rebuild_tensor_v2`` was pickled with."""

    def __init__(self, storage: Any, offset: int, size: Any, stride: Any, *rest: Any) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


class _RecordUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and (
            name.endswith("Storage") or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return name  # only the storage's key matters: the dtype comes from the checkpoint's metadata
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return pid  # ("storage", storage type, key, location, numel)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def record_view(
    mm: mmap.mmap, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor | None:
    """The flat tensor of the ``torch.save`` record at ``mm[offset : offset + length]``, or None."""
    numel = 1
    for d in shape:
        numel *= d
    try:
        with zipfile.ZipFile(_Window(memoryview(mm)[offset : offset + length])) as archive:
            names = archive.namelist()
            pkl = next(n for n in names if n.endswith("data.pkl"))
            order = next((n for n in names if n.endswith("/byteorder")), None)
            if order is not None and archive.read(order).decode() != sys.byteorder:
                return None
            rebuild = _RecordUnpickler(io.BytesIO(archive.read(pkl))).load()
            if not isinstance(rebuild, _Rebuild) or rebuild.offset != 0 or rebuild.size != tuple(shape):
                return None
            if rebuild.stride != _contiguous_strides(shape) or int(rebuild.storage[4]) != numel:
                return None
            info = archive.getinfo(pkl[: -len("data.pkl")] + f"data/{rebuild.storage[2]}")
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, StopIteration, IndexError, ValueError):
        return None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != numel * dtype.itemsize:
        return None
    try:
        header = _LOCAL_HEADER.unpack_from(mm, offset + info.header_offset)
    except struct.error:
        return None
    start = offset + info.header_offset + _LOCAL_HEADER.size + header[9] + header[10]  # name, extra field
    if header[0] != b"PK\x03\x04" or start + numel * dtype.itemsize > offset + length:
        return None  # a damaged record: let DCP's loader report it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only buffer: the Reader contract forbids writes
        return (
            torch.frombuffer(mm, dtype=dtype, count=numel, offset=start)
            if numel
            else torch.empty(0, dtype=dtype)
        )
