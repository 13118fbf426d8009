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
from pmakit.formats.safetensors_io import OutputTensor
from pmakit.layouts.kinds import DTYPES
from pmakit.merge.plan import CHUNK_ELEMS
from pmakit.merge.resources import (
    SCRATCH_BYTES,
    FoldSizing,
    Node,
    read_node,
    size_fold,
    usable_cores,
    workers_override,
)
from pmakit.world import split_by_bytes

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


def load_layout(path: str | os.PathLike[str]) -> list[OutputTensor]:
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
        out.append(OutputTensor(str(name), _DTYPE_NAMES[dtype], tuple(shape)))
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
    """Input bytes per second one rank converts to fp32 and adds (bf16 input), all its fold workers together."""
    source: str = "measured"
    checksum: float = 0.0
    """Output bytes per second one rank's hasher thread checksums (sha256; 0: not measured, not counted)."""
    workers: int = 1
    """Fold workers ``accumulate`` was measured with (given rates: the plan's)."""


def measure_bandwidth(directory: Path, sample_bytes: int = 128 * 2**20, workers: int = 1) -> Bandwidth:
    """Write, flush, drop from the page cache and read back ``sample_bytes`` in ``directory``; time the fold of
    bf16 chunks on ``workers`` threads, and a sha256. Short and rough: a 128 MB sample, one pass."""
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
    checksum = _checksum_rate()
    return Bandwidth(read, write, _accumulate_rate(workers), checksum=checksum, workers=workers)


def _accumulate_rate(workers: int, elems: int = 2 * 2**20, inputs: int = 4, passes: int = 8) -> float:
    """Input bytes a second that ``workers`` threads fold together with the merge's own kernel (bf16 inputs of
    ``elems`` each, their own per thread)."""
    import threading

    from pmakit.merge.stream import BLOCK_ELEMS, _fold

    def fold() -> None:
        views = [torch.randn(elems).bfloat16() for _ in range(inputs)]
        out = torch.empty(elems, dtype=torch.bfloat16)
        scratch = (torch.empty(BLOCK_ELEMS), torch.empty(BLOCK_ELEMS))
        ready.wait()
        for _ in range(passes):
            _fold(views, [1 / inputs] * inputs, out, scratch)

    ready = threading.Barrier(workers + 1)
    threads = [threading.Thread(target=fold) for _ in range(workers)]
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a merge: the workers are the parallelism
    try:
        for t in threads:
            t.start()
        ready.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(previous)
    return workers * passes * inputs * elems * 2 / seconds


def _checksum_rate(sample_bytes: int = 64 * 2**20) -> float:
    """Bytes a second one thread checksums (the hasher thread's sha256 of the output)."""
    import hashlib

    block = bytes(sample_bytes)
    t0 = time.perf_counter()
    hashlib.sha256(block).digest()
    return sample_bytes / (time.perf_counter() - t0)


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a merge."""

    rank: int
    read_bytes: int
    write_bytes: int
    memory_bytes: int
    seconds: float


def plan_scale(
    tensors: Sequence[OutputTensor],
    *,
    snapshots: int,
    ranks: int,
    bandwidth: Bandwidth,
    nodes: int = 1,
    out_dtype: torch.dtype | None = None,
    chunk_elems: int | None = None,
    unit_bytes: int = 0,
    node: Node | None = None,
) -> dict[str, Any]:
    """Bytes, memory and time of merging ``snapshots`` inputs of this layout on ``ranks`` ranks over ``nodes``.

    Time per rank is the largest of its I/O (reads + writes through its node's disk, shared by the node's ranks),
    its fold (its workers together) and its hasher thread's checksum; the merge takes as long as its slowest rank.
    Each rank's fold is sized for its share of a ``node`` like this one (default: this process's). ``unit_bytes``
    is memory each input holds beyond the merge's chunks (DCP inputs: one saved chunk, see formats/dcp_io.py).
    Memory counts pmakit's own buffers; the Python process with torch imported adds its own baseline (about 150 MB
    of anonymous memory).
    """
    from pmakit.formats import is_float

    if snapshots < 1 or ranks < 1 or nodes < 1:
        raise PmakitError("--snapshots, --ranks and --nodes must be at least 1")
    out_sizes = [t.nbytes // t.dtype.itemsize * _out_itemsize(t, out_dtype) for t in tensors]
    groups = split_by_bytes(out_sizes, ranks)
    n = chunk_elems or max(
        1, min(CHUNK_ELEMS, max((t.nbytes // t.dtype.itemsize for t in tensors), default=1))
    )
    per_node = -(-ranks // nodes)  # ranks sharing one node's disk
    node = node or read_node()
    widest_out = max([4] + [_out_itemsize(t, out_dtype) for t in tensors])
    fold = _rank_fold(node, per_node, n, widest_out, snapshots)
    # DCP: each input holds a saved chunk, and torch's loader briefly holds one more while it copies it.
    memory = n * widest_out * fold.buffers + SCRATCH_BYTES * fold.workers + (snapshots + 1) * unit_bytes
    plans = []
    for r in range(ranks):
        mine = [i for i, g in enumerate(groups) if g == r]
        read = sum(tensors[i].nbytes * (snapshots if is_float(tensors[i].dtype) else 1) for i in mine)
        write = sum(out_sizes[i] for i in mine)
        folded = sum(tensors[i].nbytes * snapshots for i in mine if is_float(tensors[i].dtype))
        parts = _rank_seconds(read, write, folded, bandwidth, per_node)
        plans.append(RankPlan(r, read, write, memory, max(parts.values())))
    fold_bytes = sum(t.nbytes * snapshots for t in tensors if is_float(t.dtype))
    read_total, write_total = sum(p.read_bytes for p in plans), sum(p.write_bytes for p in plans)
    return {
        "tensors": len(tensors),
        "parameters": sum(t.nbytes // t.dtype.itemsize for t in tensors),
        "snapshots": snapshots,
        "ranks": ranks,
        "nodes": nodes,
        "read_bytes": read_total,
        "write_bytes": write_total,
        "largest_tensor_bytes": max((t.nbytes for t in tensors), default=0),
        "bandwidth": vars(bandwidth),
        "node": {**vars(node), "cores": node.cores, "describe": node.describe()},
        "fold": vars(fold),
        "per_rank": [vars(p) for p in plans],
        "max_memory_bytes": max(p.memory_bytes for p in plans),
        "seconds": max(p.seconds for p in plans),
        "bound": _bound(plans, groups, tensors, out_sizes, snapshots, bandwidth, per_node),
        "more_ranks": more_ranks(
            fold_bytes,
            read_total,
            write_total,
            bandwidth,
            node,
            per_node,
            nodes,
            n * widest_out,
            fold.workers,
        ),
    }


def _out_itemsize(t: OutputTensor, out_dtype: torch.dtype | None) -> int:
    from pmakit.formats import is_float

    return out_dtype.itemsize if out_dtype is not None and is_float(t.dtype) else t.dtype.itemsize


def _rank_fold(node: Node, per_node: int, chunk_elems: int, widest_out: int, snapshots: int) -> FoldSizing:
    """One rank's fold on a node like ``node`` shared by ``per_node`` ranks."""
    cores = usable_cores(node.affinity, node.quota, per_node)
    memory = node.memory // per_node
    return size_fold(cores, memory, chunk_elems * widest_out, chunk_elems * 2 * snapshots, workers_override())


def _rank_seconds(read: int, write: int, folded: int, bw: Bandwidth, per_node: int) -> dict[str, float]:
    """A rank's time by what bounds it: its node's disk (shared), its fold, its hasher thread's checksum."""
    return {
        "the disk": (read / bw.read + write / bw.write) * per_node,
        "the fold": folded / bw.accumulate,
        "the output's sha256 (one thread)": write / bw.checksum if bw.checksum else 0.0,
    }


def _bound(
    plans: Sequence[RankPlan],
    groups: Sequence[int],
    tensors: Sequence[OutputTensor],
    out_sizes: Sequence[int],
    snapshots: int,
    bw: Bandwidth,
    per_node: int,
) -> str:
    """What bounds the slowest rank."""
    from pmakit.formats import is_float

    slowest = max(plans, key=lambda p: p.seconds)
    mine = [i for i, g in enumerate(groups) if g == slowest.rank]
    folded = sum(tensors[i].nbytes * snapshots for i in mine if is_float(tensors[i].dtype))
    parts = _rank_seconds(slowest.read_bytes, slowest.write_bytes, folded, bw, per_node)
    return max(parts, key=lambda k: parts[k])


def more_ranks(
    fold_bytes: int,
    read_bytes: int,
    write_bytes: int,
    bw: Bandwidth,
    node: Node,
    per_node: int,
    nodes: int,
    buffer_bytes: int,
    workers: int,
) -> dict[str, Any] | None:
    """Where one process (or ``per_node``) cannot keep a node's disk busy (its fold, or its one writer thread's
    sha256, is slower), the ranks per node that would and the time they take; None where more ranks do not help.

    The model: each rank's workers fold at the measured rate per worker; K ranks on a node share its cores
    (``usable_cores``) and its disk, and each has its own writer thread.
    """
    per_worker = bw.accumulate / max(1, bw.workers or workers)
    read, write, fold = read_bytes / nodes, write_bytes / nodes, fold_bytes / nodes
    io = read / bw.read + write / bw.write

    def seconds(k: int) -> float:
        cores = usable_cores(node.affinity, node.quota, k)
        w = size_fold(cores, node.memory // k, buffer_bytes, buffer_bytes, workers_override()).workers
        check = write / (k * bw.checksum) if bw.checksum else 0.0
        return max(io, fold / (k * w * per_worker), check)

    now = seconds(per_node)
    top = max(per_node, usable_cores(node.affinity, node.quota) // 2)
    best = min(range(per_node, top + 1), key=lambda k: (round(seconds(k) / now, 2), k))
    if best == per_node or seconds(best) > 0.9 * now:
        return None
    return {"ranks_per_node": best, "seconds": seconds(best), "now": now}


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
            tensors = [OutputTensor(k, reader.tensors[k].dtype, reader.tensors[k].shape) for k in order]
            unit_bytes = _unit_bytes(reader)
        where = Path(chosen[-1].path).parent
        source = ", ".join(str(s.path) for s in chosen)
    node = read_node()
    workers = _rank_fold(node, -(-ranks // nodes), CHUNK_ELEMS, 4, snapshots).workers
    if disk_bandwidth is None or accumulate_bandwidth is None:
        measured = measure_bandwidth(where, workers=workers)
        bandwidth = Bandwidth(
            disk_bandwidth or measured.read,
            disk_bandwidth or measured.write,
            accumulate_bandwidth or measured.accumulate,
            "measured" if disk_bandwidth is None and accumulate_bandwidth is None else "given and measured",
            measured.checksum,
            workers,
        )
    else:
        bandwidth = Bandwidth(disk_bandwidth, disk_bandwidth, accumulate_bandwidth, "given", workers=workers)
    out_dtype = None if dtype == "same" else DTYPES[dtype]
    report = plan_scale(
        tensors,
        snapshots=snapshots,
        ranks=ranks,
        bandwidth=bandwidth,
        nodes=nodes,
        out_dtype=out_dtype,
        unit_bytes=unit_bytes,
        node=node,
    )
    report["source"] = source
    return report


def _unit_bytes(reader: Any) -> int:
    """What a DCP input holds in memory beyond the merge's chunks: its largest unit (``DCPReader._unit_boxes``: a
    saved slab, or a dim-0 band of chunks split on an inner dim) that is not a view of a mapped record (0 where
    every unit is one)."""
    md = getattr(reader, "_md", None)
    if not md:
        return 0
    best = 0
    for name in md:
        itemsize = reader.tensors[name].dtype.itemsize
        for lo, hi, box in reader._unit_boxes(name):
            if reader._mapped(name, box) is None:
                best = max(best, (hi - lo) * itemsize)
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
        f"expected time {_duration(report['seconds'])} (bound by {report['bound']}); peak work memory per rank "
        f"{format_bytes(report['max_memory_bytes'])}"
    )
    lines += _fold_lines(report)
    return "\n".join(lines)


def _fold_lines(report: Mapping[str, Any]) -> list[str]:
    """How each rank folds (workers and why), and where more ranks a node would keep its disk busier."""
    from pmakit.units import format_bytes

    fold, bw = report["fold"], report["bandwidth"]
    lines = [
        f"fold per rank: {fold['workers']} worker thread(s), {fold['buffers']} output buffers, read-ahead "
        f"{fold['read_ahead']} chunks ({fold['why']}; this node: {report['node']['describe']})"
    ]
    more = report.get("more_ranks")
    if more:
        check = (
            f", its one hasher thread checksums {format_bytes(bw['checksum'])}/s" if bw["checksum"] else ""
        )
        lines.append(
            f"one process cannot keep this disk busy (its fold runs {format_bytes(bw['accumulate'])}/s{check}; the "
            f"disk reads {format_bytes(bw['read'])}/s): run `torchrun --nproc-per-node {more['ranks_per_node']} -m "
            f"pmakit merge ...` ({more['ranks_per_node']} ranks a node split the tensors): about "
            f"{_duration(more['seconds'])} instead of {_duration(more['now'])}"
        )
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
