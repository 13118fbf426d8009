"""A tensor saved by ``torch.save`` inside a bigger file, mapped instead of loaded.

DCP's file writers (torch's and OLMo-core's) store each saved chunk of a tensor as one ``torch.save`` record, a
zip archive, at an offset in a ``.distcp`` file. Such an archive stores the tensor's bytes uncompressed
(``archive/data/<key>``) beside a small pickle that says how to view them. ``record_view`` finds those bytes
and returns a tensor view of the memory-mapped file: no copy, no memory but the page cache, and the merge reads a
chunk of it at a time, as it does a safetensors file. The pickle is read by a restricted unpickler that only
notes the arguments of torch's tensor rebuild function (``safe_pickle``: nothing in it can touch a class); anything it does not recognise (another layout, a view
of a larger storage, a big-endian record, compression) returns None and the caller loads the record through DCP.
"""

from __future__ import annotations

import functools
import io
import mmap
import struct
import sys
import warnings
import zipfile
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import safe_pickle

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

    def __init__(
        self, storage: tuple[Any, ...], offset: int, size: tuple[int, ...], stride: tuple[int, ...]
    ) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild(made: safe_pickle.Made) -> _Rebuild:
    made.no_items()
    if made.state is not None or len(made.args) < 4:
        raise PmakitError("refused: _rebuild_tensor_v2 takes (storage, offset, size, stride, ...)")
    storage, offset, size, stride = made.args[:4]
    if not isinstance(storage, safe_pickle.PersistentId):
        raise PmakitError("refused: a tensor record without its storage")
    pid = safe_pickle.expect(storage[0], tuple, "a storage reference")
    dims = [safe_pickle.count(d, "a tensor dim") for d in safe_pickle.expect(size, (tuple, list), "a size")]
    steps = [safe_pickle.count(d, "a stride") for d in safe_pickle.expect(stride, (tuple, list), "a stride")]
    return _Rebuild(pid, safe_pickle.count(offset, "a storage offset"), tuple(dims), tuple(steps))


@functools.cache
def _record_pickles() -> safe_pickle.Allowed:
    """What a record's ``data.pkl`` may build: one tensor rebuild (its backward hooks an empty OrderedDict)."""
    storages = {("torch", name): name for name in dir(torch) if name.endswith("Storage")}
    return safe_pickle.Allowed(
        {
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild,
            ("collections", "OrderedDict"): safe_pickle.make_ordered_dict,
        },
        # only the storage's key matters: the dtype comes from the checkpoint's metadata
        {**storages, **{ref: ref[1] for ref in safe_pickle.dtypes()}},
    )


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def record_view(
    mm: mmap.mmap | bytes | memoryview, offset: int, length: int, dtype: torch.dtype, shape: tuple[int, ...]
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
            if order is not None and (
                archive.getinfo(order).file_size > 16 or archive.read(order) != sys.byteorder.encode()
            ):
                return None
            info = archive.getinfo(pkl)
            if info.file_size > limits.PICKLE_RECORD_BYTES.value:
                return None
            rebuild = safe_pickle.loads(archive.read(pkl), _record_pickles(), persistent_ids=True)
            if not isinstance(rebuild, _Rebuild) or rebuild.offset != 0 or rebuild.size != tuple(shape):
                return None
            storage = rebuild.storage  # ("storage", storage type, key, location, numel)
            if len(storage) != 5 or not isinstance(storage[2], str) or storage[4] != numel:
                return None
            if rebuild.stride != _contiguous_strides(shape):
                return None
            info = archive.getinfo(pkl[: -len("data.pkl")] + f"data/{storage[2]}")
    except Exception:
        # Bytes from the file: zipfile alone raises a dozen types on damage (NotImplementedError for a forged
        # version or method, RuntimeError for an "encrypted" member, EOFError, zlib.error...). None hands the
        # record to DCP's loader, which reports it in one line naming the file.
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
