"""Planning merges too big for this machine (``pmakit inspect --plan``).

Turns a merge plan (or a layout file of names, shapes and dtypes) into bytes read and written per rank, work memory
per rank, and an expected time from measured disk and accumulation bandwidths.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.layouts.kinds import DTYPES
from pmakit.merge.plan import CHUNK_ELEMS, N_BUFFERS
from pmakit.world import split_by_bytes


@dataclass(frozen=True)
class LayoutTensor:
    """One tensor of a model layout."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "f16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "f32": torch.float32,
    "int64": torch.int64,
    "i64": torch.int64,
    "int32": torch.int32,
    "fp8": torch.float8_e4m3fn,
}


def load_layout(path: str | os.PathLike[str]) -> list[LayoutTensor]:
    """A layout file: JSON ``{name: {"shape": [...], "dtype": "bf16"}}`` (or ``{name: [shape]}``, bf16 assumed),
    optionally wrapped as ``{"tensors": {...}}``."""
    path = Path(path)
    try:
        data = limits.read_json(path)
    except PmakitError as e:
        raise PmakitError(f"unreadable layout file ({e})") from None
    if isinstance(data, Mapping) and isinstance(data.get("tensors"), Mapping):
        data = data["tensors"]
    if not isinstance(data, Mapping) or not data:
        raise PmakitError(f"{path}: a layout file maps tensor names to shapes and dtypes")
    out = []
    for name, entry in data.items():
        shape, dtype = (entry, "bf16") if isinstance(entry, list) else (None, None)
        if isinstance(entry, Mapping):
            shape, dtype = entry.get("shape"), str(entry.get("dtype", "bf16")).replace("torch.", "")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise PmakitError(f"{path}: tensor {name!r} has no valid shape (a list of sizes)")
        if dtype not in _DTYPE_NAMES:
            raise PmakitError(
                f"{path}: tensor {name!r} has unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)}"
            )
        out.append(LayoutTensor(str(name), tuple(shape), _DTYPE_NAMES[dtype]))
    return out


def layout_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """A layout file's content for a state dict (meta tensors work: nothing is allocated)."""
    return {
        k: {"shape": list(v.shape), "dtype": str(v.dtype).replace("torch.", "")} for k, v in tensors.items()
    }


@dataclass(frozen=True)
class Bandwidth:
    """Measured (or given) rates in bytes per second."""

    read: float
    """Sequential read from the disk, page cache dropped."""
    write: float
    """Sequential write to the disk, flushed."""
    accumulate: float
    """Input bytes per second one rank converts to fp32 and adds (bf16 input)."""
    source: str = "measured"


def measure_bandwidth(directory: Path, sample_bytes: int = 128 * 2**20) -> Bandwidth:
    """Write, flush, drop from the page cache and read back ``sample_bytes`` in ``directory``; time an fp32
    accumulation of bf16 chunks. Short and rough: a 128 MB sample, one pass."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".pmakit-bandwidth-{os.getpid()}"
    block = os.urandom(2**20) * 16
    try:
        t0 = time.perf_counter()
        with open(probe, "wb") as f:
            for _ in range(max(1, sample_bytes // len(block))):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        write = probe.stat().st_size / (time.perf_counter() - t0)
        fd = os.open(probe, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.read(fd, 8 * 2**20):
                pass
            read = probe.stat().st_size / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    finally:
        probe.unlink(missing_ok=True)
    x = torch.randn(8 * 2**20).bfloat16()
    acc, tmp = torch.zeros(x.numel()), torch.empty(x.numel())
    t0 = time.perf_counter()
    for _ in range(4):
        acc.add_(tmp.copy_(x), alpha=0.25)
    accumulate = 4 * x.numel() * 2 / (time.perf_counter() - t0)
    return Bandwidth(read, write, accumulate)


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a merge."""

    rank: int
    read_bytes: int
    write_bytes: int
    memory_bytes: int
    seconds: float


def plan_scale(
    tensors: Sequence[LayoutTensor],
    *,
    snapshots: int,
    ranks: int,
    bandwidth: Bandwidth,
    nodes: int = 1,
    out_dtype: torch.dtype | None = None,
    chunk_elems: int | None = None,
    unit_bytes: int = 0,
) -> dict[str, Any]:
    """Bytes, memory and time of merging ``snapshots`` inputs of this layout on ``ranks`` ranks over ``nodes``.

    Time per rank is the larger of its I/O (reads + writes through its node's disk, shared by the node's ranks)
    and its accumulation; the merge takes as long as its slowest rank. ``unit_bytes`` is memory each input holds
    beyond the merge's chunks (DCP inputs: one saved chunk, see formats/dcp_io.py). Memory counts pmakit's own
    buffers; the Python process with torch imported adds its own baseline (about 150 MB of anonymous memory).
    """
    from pmakit.formats import is_float

    if snapshots < 1 or ranks < 1 or nodes < 1:
        raise PmakitError("--snapshots, --ranks and --nodes must be at least 1")
    out_sizes = [
        t.nbytes
        if out_dtype is None or not is_float(t.dtype)
        else t.nbytes // t.dtype.itemsize * out_dtype.itemsize
        for t in tensors
    ]
    groups = split_by_bytes(out_sizes, ranks)
    n = chunk_elems or max(
        1, min(CHUNK_ELEMS, max((t.nbytes // t.dtype.itemsize for t in tensors), default=1))
    )
    per_node = -(-ranks // nodes)  # ranks sharing one node's disk
    plans = []
    for r in range(ranks):
        mine = [i for i, g in enumerate(groups) if g == r]
        read = sum(tensors[i].nbytes * (snapshots if is_float(tensors[i].dtype) else 1) for i in mine)
        write = sum(out_sizes[i] for i in mine)
        io = (read / bandwidth.read + write / bandwidth.write) * per_node
        compute = (
            sum(tensors[i].nbytes * snapshots for i in mine if is_float(tensors[i].dtype))
            / bandwidth.accumulate
        )
        # DCP: each input holds a saved chunk, and torch's loader briefly holds one more while it copies it.
        memory = (
            n * 4 * (N_BUFFERS + 2) + (snapshots + 1) * unit_bytes if unit_bytes else n * 4 * (N_BUFFERS + 2)
        )
        plans.append(RankPlan(r, read, write, memory, max(io, compute)))
    return {
        "tensors": len(tensors),
        "parameters": sum(t.nbytes // t.dtype.itemsize for t in tensors),
        "snapshots": snapshots,
        "ranks": ranks,
        "nodes": nodes,
        "read_bytes": sum(p.read_bytes for p in plans),
        "write_bytes": sum(p.write_bytes for p in plans),
        "largest_tensor_bytes": max((t.nbytes for t in tensors), default=0),
        "bandwidth": vars(bandwidth),
        "per_rank": [vars(p) for p in plans],
        "max_memory_bytes": max(p.memory_bytes for p in plans),
        "seconds": max(p.seconds for p in plans),
    }


def plan_report(
    chosen: Sequence[Any] | None,
    layout: Path | None,
    *,
    snapshots: int = 10,
    ranks: int = 1,
    nodes: int = 1,
    dtype: str = "same",
    disk_bandwidth: float | None = None,
    accumulate_bandwidth: float | None = None,
) -> dict[str, Any]:
    """``pmakit inspect --plan``: plan the merge of ``chosen`` snapshots, or of ``snapshots`` inputs of a layout.

    Rates not given are measured here (a short disk probe in the inputs' directory, or the current one).
    """
    from pmakit.layouts import open_weights

    unit_bytes = 0
    if layout is not None:
        tensors = load_layout(layout)
        where = Path.cwd()
        source = str(layout)
    else:
        if not chosen:
            raise PmakitError("--plan needs snapshots or a --layout file")
        snapshots = len(chosen)
        with open_weights(chosen[-1].path) as reader:  # a trainer's layout: its model weights only
            order = sorted(reader.tensors, key=lambda k: reader.tensors[k].order)
            tensors = [LayoutTensor(k, reader.tensors[k].shape, reader.tensors[k].dtype) for k in order]
            unit_bytes = _unit_bytes(reader)
        where = Path(chosen[-1].path).parent
        source = ", ".join(str(s.path) for s in chosen)
    if disk_bandwidth is None or accumulate_bandwidth is None:
        measured = measure_bandwidth(where)
        bandwidth = Bandwidth(
            disk_bandwidth or measured.read,
            disk_bandwidth or measured.write,
            accumulate_bandwidth or measured.accumulate,
            "measured" if disk_bandwidth is None and accumulate_bandwidth is None else "given and measured",
        )
    else:
        bandwidth = Bandwidth(disk_bandwidth, disk_bandwidth, accumulate_bandwidth, "given")
    out_dtype = None if dtype == "same" else DTYPES[dtype]
    report = plan_scale(
        tensors,
        snapshots=snapshots,
        ranks=ranks,
        bandwidth=bandwidth,
        nodes=nodes,
        out_dtype=out_dtype,
        unit_bytes=unit_bytes,
    )
    report["source"] = source
    return report


def _unit_bytes(reader: Any) -> int:
    """What a DCP input holds in memory beyond the merge's chunks: its largest saved chunk that cannot be mapped
    from the file (0 for mapped files, and for DCP records ``torch_record`` maps)."""
    md = getattr(reader, "_md", None)
    if not md:
        return 0
    best = 0
    for name, tensor_md in md.items():
        itemsize = reader.tensors[name].dtype.itemsize
        for c in tensor_md.chunks:
            if reader._mapped(name, c) is not None:
                continue
            n = itemsize
            for d in c.sizes:
                n *= d
            best = max(best, n)
    return best


def render_plan(report: Mapping[str, Any]) -> str:
    """The plan as a few lines of text."""
    from pmakit.units import format_bytes

    bw = report["bandwidth"]
    lines = [
        f"plan: {report['snapshots']} inputs of {report['tensors']} tensors, {report['parameters']:,} parameters "
        f"(largest tensor {format_bytes(report['largest_tensor_bytes'])}) from {report['source']}",
        f"reads {format_bytes(report['read_bytes'])}, writes {format_bytes(report['write_bytes'])}; "
        f"{report['ranks']} rank(s) on {report['nodes']} node(s)",
        f"rates ({bw['source']}): disk read {format_bytes(bw['read'])}/s, write {format_bytes(bw['write'])}/s "
        f"per node; accumulate {format_bytes(bw['accumulate'])}/s per rank",
    ]
    for r in report["per_rank"]:
        lines.append(
            f"  rank {r['rank']:>3}: reads {format_bytes(r['read_bytes']):>10}, writes "
            f"{format_bytes(r['write_bytes']):>10}, memory {format_bytes(r['memory_bytes']):>10}, "
            f"{_duration(r['seconds'])}"
        )
    idle = [r["rank"] for r in report["per_rank"] if not r["write_bytes"]]
    if idle:
        lines.append(
            f"  rank(s) {', '.join(map(str, idle))} have no work: each tensor is written whole by one rank, in "
            f"order, and the largest ({format_bytes(report['largest_tensor_bytes'])}) alone outweighs "
            f"1/{report['ranks']} of the {format_bytes(report['write_bytes'])} written; fewer ranks do as well"
        )
    lines.append(
        f"expected time {_duration(report['seconds'])}; peak work memory per rank "
        f"{format_bytes(report['max_memory_bytes'])}"
    )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
