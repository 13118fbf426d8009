"""torch.distributed.checkpoint (DCP) directories: ``.metadata`` + ``__<rank>_<i>.distcp`` files.

Everything goes through torch's own DCP API: ``FileSystemReader.read_metadata`` gives the keys, shapes, dtypes and
the saved chunk layout; ``torch.distributed.checkpoint.load`` (``no_dist=True``, so no process group is needed even
inside a distributed merge) fills preallocated tensors through a small ``LoadPlanner`` that asks for one region of
one tensor at a time.

The unit of reading is a saved chunk: DCP stores each rank's piece of a tensor as one ``torch.save`` record.
Such a record is mapped, not loaded (``torch_record``): the reader returns views of the page cache, so a DCP input
costs no memory, whatever N and the tensor sizes, like a safetensors input. A record it cannot map (compressed or
re-encoded by newer torch writers, a view of a larger storage) is loaded whole through ``dcp.load``, kept while the
merge walks through it and dropped once the merge has moved past. A tensor whose saved chunks split an inner dim
(tensor parallelism) is loaded through ``dcp.load`` by dim-0 bands of its chunks (one layer of Megatron's
layer-stacked weights at a time), or whole when its chunks do not partition dim 0.

The model state may be at the top level (torchtitan) or under a top-level ``model`` key (OLMo-core); either way the
merged names are the model's own. Optimizer, scheduler, data loader, RNG and other non-tensor entries are skipped
and listed in ``Reader.skipped``.

``.metadata`` is a pickle. It is read by a restricted unpickler that builds only torch's DCP metadata classes,
``torch.Size``, dtypes and paths: nothing else in it can run. Trainers that save through their own storage writer
pickle their own storage-info class (OLMo-core's ``olmo_core...filesystem._StorageInfo``, without the
``transform_descriptors`` torch 2.13 reads): any ``*.filesystem._StorageInfo`` becomes torch's, and other classes
of a trainer's checkpoint package (``olmo_core.*``) become inert stand-ins, so such checkpoints are read without
the trainer installed. Any failure inside DCP (including its ``CheckpointException``, a ``BaseException``) is one
``PmakitError``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import FileInfo, Format, Reader, TensorInfo, safe_pickle
from pmakit.formats.torch_record import record_view
from pmakit.storage.source import ByteSource, open_source

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

METADATA_FILE = ".metadata"
MODEL_KEY = "model"
# Top-level entries that trainers save beside the model (torchtitan, OLMo-core, torch's Stateful helpers).
NOT_MODEL = (
    "optimizer",
    "optim",
    "lr_scheduler",
    "lr_schedulers",
    "scheduler",
    "dataloader",
    "data_loader",
    "train_state",
    "trainer",
    "rng",
    "rng_state",
    "rng_states",
    "scaler",
    "extra_state",
)


@functools.cache
def _dcp() -> Any:
    """torch's DCP modules and our small extensions of them, imported on first use (the import costs seconds
    and only DCP inputs and outputs need it)."""
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    return types.SimpleNamespace(
        dcp=dcp,
        FileSystemReader=FileSystemReader,
        FileSystemWriter=FileSystemWriter,
        ChunkStorageMetadata=ChunkStorageMetadata,
        CheckpointException=CheckpointException,
        Metadata=Metadata,
        MetadataIndex=MetadataIndex,
        TensorStorageMetadata=TensorStorageMetadata,
        **_region_loading(),
        **_raw_bytes_planners(),
    )


def _region_loading() -> dict[str, type]:
    """``CachedMetadataReader`` and ``RegionPlanner``: the reader's one-region-at-a-time ``dcp.load``."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.planner import LoadPlan, ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    class CachedMetadataReader(FileSystemReader):
        """A FileSystemReader that unpickles ``.metadata`` once, not once per ``dcp.load`` call."""

        def __init__(self, path: Path, metadata: Metadata) -> None:
            super().__init__(path)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            return self._metadata

    class RegionPlanner(DefaultLoadPlanner):
        """Loads one region (a box of offsets and sizes) of one checkpoint entry into a preallocated tensor."""

        def __init__(
            self, key: str, md: TensorStorageMetadata, box: ChunkStorageMetadata, dest: torch.Tensor
        ) -> None:
            super().__init__(flatten_state_dict=False)
            self._key, self._md, self._box, self._dest = key, md, box, dest

        def create_local_plan(self) -> LoadPlan:
            return LoadPlan(create_read_items_for_chunk_list(self._key, self._md, [self._box]))

        def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
            out = self._dest
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                out = out.narrow(dim, offset, length)
            return out

    return {"CachedMetadataReader": CachedMetadataReader, "RegionPlanner": RegionPlanner}


def _raw_bytes_planners() -> dict[str, type]:
    """``RawBytesSavePlanner`` and ``RawBytesLoadPlanner``: non-tensor entries passed through as stored bytes."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
    from torch.distributed.checkpoint.planner import ReadItem

    class RawBytesSavePlanner(DefaultSavePlanner):
        """Writes ``io.BytesIO`` values as they are (bytes already serialized, such as Megatron's
        ``_extra_state`` read back from a checkpoint), where torch's planner would pickle them again."""

        def transform_object(self, write_item: Any, object: Any) -> Any:
            return object if isinstance(object, io.BytesIO) else super().transform_object(write_item, object)

    class RawBytesLoadPlanner(DefaultLoadPlanner):
        """Keeps the stored bytes of non-tensor entries as they are (torch's planner would unpickle them)."""

        def __init__(self) -> None:
            super().__init__(flatten_state_dict=False)
            self.raw: dict[str, bytes] = {}

        def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
            self.raw[read_item.dest_index.fqn] = value.read()

    return {"RawBytesSavePlanner": RawBytesSavePlanner, "RawBytesLoadPlanner": RawBytesLoadPlanner}


TRAINER_PACKAGES = ("olmo_core.",)
"""Packages whose classes in ``.metadata`` become stand-ins (see the module docstring)."""


def _relative_path(value: Any) -> str:
    """A data file named in ``.metadata``: a plain relative path that stays inside the checkpoint directory."""
    path = safe_pickle.expect(value, str, "a data file's relative_path")
    if not path or "\0" in path or os.path.isabs(path) or ".." in path.replace("\\", "/").split("/"):
        raise PmakitError(f"refusing data file {path[:200]!r} outside the checkpoint directory")
    return path


def _optional(kind: type | tuple[type, ...], what: str) -> Any:
    return lambda v: v if v is None else safe_pickle.expect(v, kind, what)


def _list_of(kind: type, what: str) -> Any:
    return lambda v: [safe_pickle.expect(x, kind, what) for x in safe_pickle.expect(v, list, what)]


@functools.cache
def _metadata_pickles() -> safe_pickle.Allowed:
    """What a DCP ``.metadata`` may build: torch's metadata records, checked field by field (see safe_pickle)."""
    import dataclasses
    import enum
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata, planner

    sp = safe_pickle
    md = metadata
    size = lambda what: lambda v: sp.expect(v, torch.Size, what)  # noqa: E731
    checks: dict[type, dict[str, Any]] = {
        md.ChunkStorageMetadata: {"offsets": size("chunk offsets"), "sizes": size("chunk sizes")},
        md.TensorStorageMetadata: {
            "properties": lambda v: sp.expect(v, md.TensorProperties, "tensor properties"),
            "size": size("a tensor size"),
            "chunks": _list_of(md.ChunkStorageMetadata, "a tensor's chunks"),
        },
        md.Metadata: {
            "state_dict_metadata": lambda v: {
                sp.expect(k, str, "a key"): sp.expect(
                    x, (md.TensorStorageMetadata, md.BytesStorageMetadata), f"entry {str(k)[:80]!r}"
                )
                for k, x in sp.expect(v, dict, "state_dict_metadata").items()
            },
            "storage_data": _optional(dict, "storage_data"),
            "storage_meta": _optional(md.StorageMeta, "storage_meta"),
            "version": _optional(str, "version"),
        },
        md.MetadataIndex: {
            "fqn": lambda v: sp.expect(v, str, "an index's key"),
            "offset": _optional(torch.Size, "an index's offset"),
            "index": _optional(int, "an index's position"),
        },
        filesystem._StorageInfo: {
            "relative_path": _relative_path,
            "offset": lambda v: sp.count(v, "a record's offset"),
            "length": lambda v: sp.count(v, "a record's length"),
            "transform_descriptors": lambda v: (
                v
                if v is None
                else [sp.expect(x, str, "a transform") for x in sp.expect(v, (list, tuple), "transforms")]
            ),
        },
    }
    constructors: dict[safe_pickle.Global, safe_pickle.Constructor] = {
        ("torch", "Size"): sp.make_size,
        ("torch.serialization", "_get_layout"): sp.make_layout,
        ("collections", "OrderedDict"): sp.make_ordered_dict,
        ("torch.distributed.checkpoint.metadata", "TensorProperties"): _tensor_properties,
    }
    for name in ("Path", "PosixPath", "PurePosixPath", "PurePath"):
        for module_name in ("pathlib", "pathlib._local"):  # Python 3.13 moved the classes
            constructors[(module_name, name)] = sp.make_path(pathlib.PurePosixPath)
    # Megatron keeps its global save plan in .metadata: torch's plan records (dataclasses and enums), inert data.
    for module in (metadata, planner, filesystem):
        for name, value in vars(module).items():
            if not isinstance(value, type) or value.__module__ != module.__name__:
                continue
            ref = (module.__name__, name)
            if issubclass(value, enum.Enum):
                constructors.setdefault(ref, sp.make_enum(value))
            elif dataclasses.is_dataclass(value) and (module is not filesystem or name == "_StorageInfo"):
                constructors.setdefault(
                    ref, sp.make_dataclass(value, checks.get(value), value is md.Metadata)
                )

    def alias(ref: safe_pickle.Global) -> safe_pickle.Global | None:
        # OLMo-core pickles its own copy of the storage-info record (see the module docstring)
        if ref[1] == "_StorageInfo" and ref[0].endswith(".filesystem"):
            return ("torch.distributed.checkpoint.filesystem", "_StorageInfo")
        return None

    return sp.Allowed(constructors, sp.dtypes(), TRAINER_PACKAGES, alias)


def _tensor_properties(made: safe_pickle.Made) -> Any:
    """torch pickles ``TensorProperties`` as a 5-tuple (``__getstate__``): checked, then its own ``__setstate__``
    on a fresh instance."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    sp = safe_pickle
    made.no_items()
    state = made.state
    if made.args or not isinstance(state, tuple) or len(state) != 5:
        raise PmakitError("refused: TensorProperties takes its 5-field state")
    dtype, layout, requires_grad, encoding, pin_memory = state
    sp.expect(dtype, torch.dtype, "a dtype")
    sp.expect(layout, torch.layout, "a layout")
    sp.expect(encoding, _MEM_FORMAT_ENCODING, "a memory format")
    for flag in (requires_grad, pin_memory):
        sp.expect(flag, bool, "a flag")
    properties = TensorProperties.__new__(TensorProperties)
    properties.__setstate__(state)
    return properties


def read_metadata(path: Path) -> Metadata:
    """The checkpoint's metadata, unpickled with an allow-list; a damaged or foreign file is one clear error."""
    file = path / METADATA_FILE
    try:
        data = limits.read_regular(file, limits.DCP_METADATA_BYTES)
        metadata = safe_pickle.loads(data, _metadata_pickles())
    except PmakitError as e:
        raise PmakitError(f"{file}: unreadable DCP metadata ({e})") from None
    if not isinstance(metadata, _dcp().Metadata):
        raise PmakitError(f"{file}: unreadable DCP metadata (holds a {type(metadata).__name__})")
    return metadata


def _paths(metadata: Metadata) -> dict[str, tuple[str, ...]]:
    """Flattened key -> its path in the nested state dict that was saved (``planner_data`` when present)."""
    data = metadata.planner_data if isinstance(metadata.planner_data, Mapping) else {}
    out = {}
    for key in metadata.state_dict_metadata:
        path = data.get(key)
        out[key] = tuple(str(p) for p in path) if isinstance(path, (tuple, list)) and path else (key,)
    return out


def model_entries(metadata: Metadata, model_key: str | None = None) -> tuple[dict[str, str], list[str]]:
    """(model name -> checkpoint key, skipped keys). Under ``model`` when there is one, else the top level.

    ``model_key``: the model is exactly the entries under this key, saved nested (``{"model": {...}}``) or as flat
    keys ``model.<name>`` (as a trainer's own layout guarantees, e.g. OLMo-core's).
    """
    paths = _paths(metadata)
    if model_key is not None:
        prefix = model_key + "."
        for key, path in paths.items():
            if len(path) == 1 and path[0].startswith(prefix):
                paths[key] = (model_key, path[0][len(prefix) :])
    entries = metadata.state_dict_metadata
    nested = model_key is not None or any(p[0] == MODEL_KEY and len(p) > 1 for p in paths.values())
    model_key = model_key or MODEL_KEY
    names: dict[str, str] = {}
    skipped: list[str] = []
    for key, path in paths.items():
        if nested:
            name = ".".join(path[1:]) if path[0] == model_key and len(path) > 1 else None
        else:
            # Flat keys count too: Megatron saves its optimizer moments as ``optimizer.state.exp_avg.<param>``.
            trainer_state = path[0] in NOT_MODEL or path[0].split(".", 1)[0] in NOT_MODEL
            name = None if trainer_state or len(path) > 1 else key
        if name is None or not isinstance(entries[key], _dcp().TensorStorageMetadata):
            skipped.append(key)
        else:
            names[name] = key
    return names, skipped


def _is_slab(chunk: ChunkStorageMetadata, size: torch.Size) -> bool:
    """A saved chunk that is a contiguous flat range: split on dim 0 only."""
    return all(o == 0 and s == d for o, s, d in zip(chunk.offsets[1:], chunk.sizes[1:], size[1:]))


def _dim0_bands(chunks: list[ChunkStorageMetadata], size: torch.Size) -> list[tuple[int, int]]:
    """The distinct dim-0 ranges of the saved chunks when they partition dim 0, else none."""
    if len(size) < 2 or not chunks:
        return []
    bands = sorted({(c.offsets[0], c.offsets[0] + c.sizes[0]) for c in chunks})
    edge = 0
    for lo, hi in bands:
        if lo != edge:  # ranges that overlap or leave a gap: no partition
            return []
        edge = hi
    return bands if edge == size[0] else []


def _dim0_overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    if len(a.sizes) == 0:
        return True
    return a.offsets[0] < b.offsets[0] + b.sizes[0] and b.offsets[0] < a.offsets[0] + a.sizes[0]


def check_chunks(key: str, md: TensorStorageMetadata) -> None:
    """Refuse a tensor whose saved chunks do not tile it exactly: each inside the tensor, none overlapping, and
    together as many elements as the tensor (the merge would otherwise read past a chunk or leave a gap)."""
    size = tuple(md.size)
    total = 0
    boxes = []
    for chunk in md.chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise PmakitError(
                f"entry {key!r}: a saved chunk of {len(sizes)} dims for a tensor of {len(size)}"
            )
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, size)):
            raise PmakitError(
                f"entry {key!r}: a saved chunk at {list(offsets)} of {list(sizes)} lies outside its size "
                f"{list(size)}"
            )
        volume = 1
        for s in sizes:
            volume *= s
        total += volume
        if volume:
            boxes.append((offsets, sizes))
    numel = 1
    for d in size:
        numel *= d
    if total != numel:
        raise PmakitError(
            f"entry {key!r}: its saved chunks hold {total:,} elements, the tensor {list(size)} has {numel:,}"
        )
    # With the volumes equal, no overlap means an exact tiling. A sweep on dim 0 compares only chunks whose
    # dim-0 ranges meet (a handful per chunk in any real layout).
    boxes.sort()
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in boxes:
        active = [a for a in active if not size or a[0][0] + a[1][0] > box[0][0]]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(*box, *other)):
                raise PmakitError(
                    f"entry {key!r}: saved chunks at {list(other[0])} and {list(box[0])} overlap"
                )
        active.append(box)


class DCPReader(Reader):
    format = "dcp"

    def __init__(self, path: Path, model_key: str | None = None) -> None:
        super().__init__(path)
        self.metadata = read_metadata(path)
        self._storage = _dcp().CachedMetadataReader(path, self.metadata)
        names, self.skipped = model_entries(self.metadata, model_key)
        storage = self.metadata.storage_data if isinstance(self.metadata.storage_data, Mapping) else {}
        for (
            info
        ) in storage.values():  # the data files named in .metadata never leave the checkpoint directory
            relative = str(getattr(info, "relative_path", ""))
            if os.path.isabs(relative) or ".." in Path(relative).parts:
                raise PmakitError(f"{path / METADATA_FILE}: refusing data file {relative!r} outside {path}")
        files = sorted(f.name for f in path.glob("*.distcp"))
        named = {str(getattr(info, "relative_path", "")) for info in storage.values()}
        for name in sorted(set(files) | named):
            limits.check_regular(path / name)  # a FIFO would block the merge forever; a missing file is named
        self.files = [
            FileInfo(METADATA_FILE, (path / METADATA_FILE).stat().st_size, _sha256(path / METADATA_FILE))
        ]
        self.files += [FileInfo(f, (path / f).stat().st_size, "") for f in files]
        self._sources = {f: open_source(path / f) for f in files}
        self.watch([open_source(path / METADATA_FILE), *self._sources.values()])
        self._keys: dict[str, str] = {}
        self._md: dict[str, TensorStorageMetadata] = {}
        self.tensors = {}
        for name, key in names.items():
            md = cast("TensorStorageMetadata", self.metadata.state_dict_metadata[key])  # a tensor: see above
            try:
                check_chunks(key, md)
            except PmakitError as e:
                raise PmakitError(f"{path / METADATA_FILE}: {e}") from None
            info = storage.get(_dcp().MetadataIndex(key, md.chunks[0].offsets)) if md.chunks else None
            where = getattr(info, "relative_path", "")
            order = (files.index(where) if where in files else len(files), int(getattr(info, "offset", 0)))
            self.tensors[name] = TensorInfo(md.properties.dtype, tuple(md.size), order)
            self._keys[name] = key
            self._md[name] = md
        # Loaded units of the tensor being read: (flat start, flat stop, values). See the module docstring.
        self._units: list[tuple[int, int, torch.Tensor]] = []
        self._current = ""
        self._storage_data = storage
        self._hinted: set[tuple[str, int]] = set()
        self._fetching: dict[tuple[str, int], Future[bytes]] = {}  # (file, offset): a remote record's GET

    def _unit_boxes(self, name: str) -> list[tuple[int, int, ChunkStorageMetadata]]:
        """The flat ranges the tensor is loaded in: its saved dim-0 slabs; else dim-0 bands of the saved chunks
        (tensor parallelism splitting an inner dim: Megatron's layer-stacked weights at TP>1 load a layer at a
        time); else the whole tensor."""
        md = self._md[name]
        size = md.size
        inner = 1
        for d in size[1:]:
            inner *= d
        if len(size) > 0 and md.chunks and all(_is_slab(c, size) for c in md.chunks):
            slabs = sorted(md.chunks, key=lambda c: c.offsets[0])
            return [(c.offsets[0] * inner, (c.offsets[0] + c.sizes[0]) * inner, c) for c in slabs]
        bands = _dim0_bands(md.chunks, size)
        if len(bands) > 1:
            box = _dcp().ChunkStorageMetadata
            rest = len(size) - 1
            return [
                (lo * inner, hi * inner, box(torch.Size([lo] + [0] * rest), torch.Size([hi - lo, *size[1:]])))
                for lo, hi in bands
            ]
        numel = self.tensors[name].numel
        return [(0, numel, _dcp().ChunkStorageMetadata(torch.Size([0] * len(size)), torch.Size(size)))]

    def breaks(self, name: str) -> list[int]:
        """Where the tensor's units begin (``_unit_boxes``): its saved slabs, or its dim-0 bands."""
        return [lo for lo, _, _ in self._unit_boxes(name) if lo > 0]

    def _mapped(self, name: str, box: ChunkStorageMetadata) -> torch.Tensor | None:
        """A saved chunk as a view of the mapped file (see ``torch_record``), or None to load it through DCP."""
        if box not in self._md[name].chunks:
            return None
        info = self._storage_data.get(_dcp().MetadataIndex(self._keys[name], box.offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None  # torch's newer writers may compress or re-encode a record: DCP knows how to read it
        relative = str(info.relative_path)
        offset, length = int(info.offset), int(info.length)
        pending = self._fetching.pop(
            (relative, offset), None
        )  # a remote record's GET, started by ``prefetch``
        data = (
            pending.result() if pending is not None else self._source(relative).read(offset, offset + length)
        )
        return record_view(data, 0, length, self.tensors[name].dtype, tuple(box.sizes))

    def _source(self, relative: str) -> ByteSource:
        """The bytes of a data file the metadata names (checked in ``__init__``: inside the directory)."""
        if relative not in self._sources:
            self._sources[relative] = open_source(self.path / relative)
        return self._sources[relative]

    def _load(self, name: str, box: ChunkStorageMetadata) -> torch.Tensor:
        mapped = self._mapped(name, box)
        if mapped is not None:
            return mapped
        self._fill_remote(name, box)
        dest = torch.empty(tuple(box.sizes), dtype=self.tensors[name].dtype)
        planner = _dcp().RegionPlanner(self._keys[name], self._md[name], box, dest)
        try:
            with warnings.catch_warnings():
                # dcp.load warns that it runs without a process group: that is the intent here.
                warnings.simplefilter("ignore", UserWarning)
                _dcp().dcp.load({}, storage_reader=self._storage, planner=planner, no_dist=True)
        except (Exception, _dcp().CheckpointException) as e:  # the latter is a BaseException
            raise PmakitError(
                f"{self._files_of(name, box)}: reading tensor {name!r} failed ({_brief(e)})"
            ) from e
        return dest.reshape(-1)

    def _fill_remote(self, name: str, box: ChunkStorageMetadata) -> None:
        """Saved records that ``dcp.load`` reads from the files itself, written into an object-store mirror's
        placeholders first (records it must decode: rare)."""
        for chunk in self._md[name].chunks:
            info = self._storage_data.get(_dcp().MetadataIndex(self._keys[name], chunk.offsets))
            if info is not None and _dim0_overlap(chunk, box):
                self._source(str(info.relative_path)).fill(
                    int(info.offset), int(info.offset) + int(info.length)
                )

    def _files_of(self, name: str, box: ChunkStorageMetadata) -> str:
        """The data file(s) holding the saved chunks of ``name`` that ``box`` reads, for an error message."""
        key, files = self._keys[name], []
        for chunk in self._md[name].chunks:
            info = self._storage_data.get(_dcp().MetadataIndex(key, chunk.offsets))
            relative = str(getattr(info, "relative_path", ""))
            if info is not None and _dim0_overlap(chunk, box) and relative not in files:
                files.append(relative)
        if not files:
            return str(self.path)
        more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
        return f"{self.path / files[0]}{more}"

    def read(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if name != self._current:
            self._units, self._current = [], name
        self._units = [u for u in self._units if u[1] > start]  # the merge reads forward: drop what it passed
        for lo, hi, box in self._unit_boxes(name):
            if lo < stop and hi > start and not any(u[0] == lo for u in self._units):
                self._units.append((lo, hi, self._load(name, box)))
        self._units.sort(key=lambda u: u[0])
        parts = [
            v[max(start, lo) - lo : min(stop, hi) - lo]
            for lo, hi, v in self._units
            if lo < stop and hi > start
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=self.tensors[name].dtype)

    def prefetch(self, name: str, start: int, stop: int) -> None:
        """Ask the kernel to start reading the saved records that hold this range (page cache only, no memory):
        ``dcp.load`` then finds them there instead of waiting on the disk while the merge waits on it."""
        key, md = self._keys[name], self._md[name]
        for lo, hi, box in self._unit_boxes(name):
            if not (lo < stop and hi > start) or (name, lo) in self._hinted:
                continue
            self._hinted.add((name, lo))
            for chunk in md.chunks:
                if not _dim0_overlap(chunk, box):
                    continue  # only the saved chunks that hold this unit
                info = self._storage_data.get(_dcp().MetadataIndex(key, chunk.offsets))
                if info is None:
                    continue
                relative = str(info.relative_path)
                offset, length = int(info.offset), int(info.length)
                if (relative, offset) not in self._fetching:
                    pending = self._source(relative).fetch(offset, offset + length)  # local: read-ahead only
                    if pending is not None:
                        self._fetching[relative, offset] = pending

    def close(self) -> None:
        self._units, self._current = [], ""
        for pending in self._fetching.values():
            pending.cancel()
        self._fetching = {}
        for source in self._sources.values():
            source.close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _detect(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


FORMAT = Format("dcp", _detect, DCPReader)


def save(
    tensors: Mapping[str, Any],
    directory: str | os.PathLike[str],
    *,
    distributed: bool = False,
    fsync: bool = True,
) -> None:
    """Write ``tensors`` as a DCP checkpoint, the model's names at the top level (as torchtitan saves them), or
    nested as given (``{"model": tensors}``: keys ``model.<name>``, as OLMo-core saves them).

    With ``distributed``, every rank of the default process group calls this with its own disjoint tensors and
    torch writes one ``.metadata`` for all of them (a collective). ``io.BytesIO`` values are non-tensor entries
    already serialized (see ``read_bytes``): written as they are.
    """
    writer = _dcp().FileSystemWriter(Path(directory), sync_files=fsync, thread_count=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _dcp().dcp.save(
                dict(tensors),
                storage_writer=writer,
                planner=_dcp().RawBytesSavePlanner(),
                no_dist=not distributed,
            )
    except _dcp().CheckpointException as e:  # a BaseException: would escape every ``except Exception``
        raise PmakitError(f"{directory}: writing the DCP checkpoint failed ({_brief(e)})") from e


def read_bytes(path: Path, keys: list[str]) -> dict[str, bytes]:
    """The stored bytes of the non-tensor entries ``keys`` of a DCP checkpoint, as saved (a pickle: not
    unpickled here), for a writer that carries them into its output unchanged."""
    if not keys:
        return {}
    planner = _dcp().RawBytesLoadPlanner()
    metadata = read_metadata(path)
    storage = metadata.storage_data if isinstance(metadata.storage_data, Mapping) else {}
    for index, info in storage.items():  # an object-store mirror: dcp.load reads these records from the files
        if getattr(index, "fqn", None) in keys:
            open_source(path / str(getattr(info, "relative_path", ""))).fill(
                int(info.offset), int(info.offset) + int(info.length)
            )
    reader = _dcp().CachedMetadataReader(path, metadata)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _dcp().dcp.load(dict.fromkeys(keys), storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, _dcp().CheckpointException) as e:  # the latter is a BaseException
        raise PmakitError(f"{path}: reading {len(keys)} non-tensor entries failed ({_brief(e)})") from e
    return planner.raw


def _brief(e: BaseException) -> str:
    """One line for an error; a CheckpointException's per-rank failures reduced to the first one's message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, inner = next(iter(failures.items()))
        if isinstance(inner, tuple) and inner:  # torch's (exception, stack frames)
            inner = inner[0]
        return f"rank {rank}: {_brief(inner) if isinstance(inner, BaseException) else inner}"
    text = str(e).strip().splitlines()
    hint = " (truncated or damaged file)" if isinstance(e, EOFError) else ""
    return f"{type(e).__name__}: {text[0]}{hint}" if text else f"{type(e).__name__}{hint}"


def _make_namespace(made: safe_pickle.Made) -> Any:
    """``argparse.Namespace`` (Megatron's ``args``): a fresh one holding the state's plain-named fields."""
    import argparse

    made.no_items()
    state = made.state
    if isinstance(state, tuple) and len(state) == 2 and state[1] is None:
        state = state[0]
    fields = safe_pickle.expect({} if state is None else state, dict, "a Namespace's state")
    if made.args or not all(
        isinstance(k, str) and k.isidentifier() and not k.startswith("__") for k in fields
    ):
        raise PmakitError("refused: argparse.Namespace takes only named fields")
    return argparse.Namespace(**fields)


def _make_collection(kind: type) -> safe_pickle.Constructor:
    def build(made: safe_pickle.Made) -> Any:
        made.no_items()
        if made.state is not None or len(made.args) > 1:
            raise PmakitError(f"refused: {kind.__name__} takes one list")
        return kind(safe_pickle.expect(made.args[0], (list, tuple), kind.__name__) if made.args else ())

    return build


@functools.cache
def _object_pickles() -> safe_pickle.Allowed:
    """What a pickled non-tensor entry may build: containers, ``argparse.Namespace``, torch's scalar types;
    any other class (a trainer's enums, even ``builtins.eval``) becomes an inert ``safe_pickle.StandIn``."""
    sp = safe_pickle
    constructors: dict[safe_pickle.Global, safe_pickle.Constructor] = {
        ("argparse", "Namespace"): _make_namespace,
        ("collections", "OrderedDict"): sp.make_ordered_dict,
        ("torch", "Size"): sp.make_size,
        ("torch.serialization", "_get_layout"): sp.make_layout,
    }
    for module in ("builtins", "__builtin__"):  # protocol 2 names Python 2's module (torch.save writes it)
        constructors[(module, "set")] = _make_collection(set)
        constructors[(module, "frozenset")] = _make_collection(frozenset)
    storages = {("torch", name): name for name in dir(torch) if name.endswith("Storage")}
    return sp.Allowed(constructors, {**storages, **sp.dtypes()}, stand_in_packages=("",))


def loads_object(data: bytes) -> Any:
    """The plain data of one pickled object from an untrusted file: the bytes DCP stores for a non-tensor entry
    (a ``torch.save`` archive: Megatron 0.19's ``common_state``, torchtitan's ``train_state``), a ``common.pt``'s
    bytes, or a bare pickle. Read through ``safe_pickle``: nothing in it is called and no class is touched;
    ``argparse.Namespace`` comes back as a fresh Namespace, other classes as ``safe_pickle.StandIn`` records,
    tensors' storages as ``safe_pickle.PersistentId``. Every failure is one ``PmakitError`` (callers add the
    file's name)."""
    import zipfile

    if len(data) > limits.PICKLE_RECORD_BYTES.value and not data.startswith(b"PK"):
        raise limits.refuse(limits.PICKLE_RECORD_BYTES, f"a pickle of {len(data):,} bytes")
    if data.startswith(b"PK"):
        try:
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                name = next((n for n in archive.namelist() if n.endswith("data.pkl")), None)
                if name is None:
                    raise PmakitError("a torch.save archive without its data.pkl")
                size = archive.getinfo(name).file_size
                if size > limits.PICKLE_RECORD_BYTES.value:
                    raise limits.refuse(limits.PICKLE_RECORD_BYTES, f"its data.pkl ({size:,} bytes)")
                data = archive.read(name)
        except PmakitError:
            raise
        except Exception as e:  # zipfile raises a dozen types on damaged bytes
            raise PmakitError(f"not a readable torch.save archive ({type(e).__name__}: {e})") from None
    return safe_pickle.loads(data, _object_pickles(), persistent_ids=True)
