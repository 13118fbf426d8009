"""Stream-average snapshots into one model: validate headers, then fp32-accumulate chunk by chunk, write atomically.

The shape of the work: inputs are memory-mapped and the kernel is asked to read a couple of chunks ahead; the
calling thread converts each input chunk straight from the page cache to fp32 and folds it into an accumulator,
checks the sum is finite, casts it once into an output buffer; a writer thread appends it to the output shard and
checksums it. Peak memory is a few chunk-sized buffers (the mapped input pages belong to the page cache):
independent of the number of snapshots and of the model's size.

Output goes to a hidden sibling ``.OUT.pmakit-partial`` and is renamed into place only when every shard, the index,
the copied config/tokenizer files and the manifest are on disk. Any failure removes the partial directory.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import math
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import pmakit
from pmakit.errors import PmakitError
from pmakit.formats import Reader, TensorInfo, is_float, open_reader
from pmakit.formats.safetensors_io import OutputTensor, Shard, ShardWriter, plan_shards, write_index
from pmakit.snapshot import MERGE_MANIFEST, METADATA_FILE, Snapshot
from pmakit.units import format_bytes

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
CHUNK_ELEMS = 8 * 2**20
"""Elements per chunk: 16 MiB of bf16 input, 32 MiB of fp32 accumulator."""
N_BUFFERS = 4
"""Output chunks that may wait for the writer thread."""
BLOCK_ELEMS = 128 * 2**10
"""Elements folded at a time: a block's fp32 sum and conversion buffer (1 MiB) stay in a core's L2 cache."""
_NOT_COPIED_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".distcp", ".metadata")
_NOT_COPIED_NAMES = (
    "optimizer",
    "scheduler",
    "rng_state",
    "training_args",
    "trainer_state",
    "scaler",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    METADATA_FILE,
    MERGE_MANIFEST,
)


@dataclass(frozen=True)
class MergePlan:
    """Everything about a merge that the headers tell, before any weight is read."""

    snapshots: list[Snapshot]
    """Inputs, oldest first."""
    weights: list[float]
    """One weight per input, oldest first, summing to 1."""
    tensors: dict[str, tuple[TensorInfo, torch.dtype]]
    """name -> (the newest input's header entry, output dtype), in the newest input's on-disk order."""
    shards: list[Shard]
    skipped: list[str] = field(default_factory=list)
    """Entries of the inputs that are not model weights (optimizer, RNG) and are not merged."""

    @property
    def input_bytes(self) -> int:
        """Bytes read: every averaged tensor from every input with a non-zero weight, copied ones once."""
        readers = sum(1 for w in self.weights if w != 0)
        return sum(i.nbytes * (readers if is_float(i.dtype) else 1) for i, _ in self.tensors.values())

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def chunk_elems(self) -> int:
        return max(1, min(CHUNK_ELEMS, max((i.numel for i, _ in self.tensors.values()), default=1)))

    @property
    def peak_memory(self) -> int:
        """Bytes of work memory the merge allocates (buffers + accumulator + cast), whatever N and model size."""
        return self.chunk_elems * 4 * (N_BUFFERS + 2)  # output buffers, accumulator, conversion buffer


def output_dtype(dtype: str | torch.dtype | None, source: torch.dtype) -> torch.dtype:
    """The dtype a tensor is written in: ``same`` keeps the input's; non-float tensors always keep theirs."""
    if not is_float(source) or dtype in (None, "same"):
        return source
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise PmakitError(f"unknown --dtype {dtype!r}; use same, bf16, fp16 or fp32")
    return DTYPES[dtype]


def _validate(readers: Sequence[Reader], snapshots: Sequence[Snapshot], cast: bool) -> None:
    """Compare every input's keys, shapes and dtypes with the newest one's; raise listing every difference."""
    ref, ref_snap = readers[-1].tensors, snapshots[-1]
    problems: list[str] = []
    for name, info in ref.items():
        if info.dtype.is_floating_point and not is_float(info.dtype):
            problems.append(
                f"tensor {name!r} is {info.dtype}: averaging quantized weights needs their scales; "
                "dequantize first"
            )
    for reader, snap in zip(readers[:-1], snapshots[:-1]):
        keys = reader.tensors
        missing = [k for k in ref if k not in keys]
        extra = [k for k in keys if k not in ref]
        if missing:
            problems.append(
                f"{snap.path} lacks {len(missing)} tensors of {ref_snap.path.name}: {_few(missing)}"
            )
        if extra:
            problems.append(f"{snap.path} has {len(extra)} tensors {ref_snap.path.name} lacks: {_few(extra)}")
        for name in ref.keys() & keys.keys():
            a, b = keys[name], ref[name]
            if a.shape != b.shape:
                problems.append(
                    f"tensor {name!r}: shape {list(a.shape)} in {snap.path} but {list(b.shape)} in "
                    f"{ref_snap.path}"
                )
            elif a.dtype != b.dtype and not (cast and is_float(a.dtype) and is_float(b.dtype)):
                problems.append(
                    f"tensor {name!r}: {a.dtype} in {snap.path} but {b.dtype} in {ref_snap.path}"
                    + ("" if cast else " (pass --dtype to cast)")
                )
    if problems:
        head = f"the snapshots do not match ({len(problems)} differences):"
        shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
        raise PmakitError("\n  ".join([head, *shown]))


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def plan_merge(
    snapshots: Sequence[Snapshot],
    weights: Sequence[float],
    *,
    dtype: str | torch.dtype | None = "same",
    max_shard_size: int = 5 * 10**9,
) -> MergePlan:
    """Read every input's headers, check they match, and lay out the output. Reads no weights."""
    if len(snapshots) != len(weights):
        raise PmakitError(f"{len(weights)} weights for {len(snapshots)} snapshots")
    if not snapshots:
        raise PmakitError("no snapshots to merge")
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_reader(s.path)) for s in snapshots]
        _validate(readers, snapshots, cast=dtype not in (None, "same"))
        newest = readers[-1]
        order = sorted(newest.tensors, key=lambda k: newest.tensors[k].order)
        tensors = {k: (newest.tensors[k], output_dtype(dtype, newest.tensors[k].dtype)) for k in order}
        out = [OutputTensor(k, tensors[k][1], tensors[k][0].shape) for k in order]
        skipped = sorted({s for r in readers for s in r.skipped})
    return MergePlan(list(snapshots), list(weights), tensors, plan_shards(out, max_shard_size), skipped)


@dataclass(frozen=True)
class MergeResult:
    """A finished merge."""

    path: Path
    plan: MergePlan
    seconds: float
    manifest: dict[str, Any]


@dataclass(frozen=True)
class _Chunk:
    shard: int
    name: str
    start: int
    stop: int
    sources: tuple[int, ...]
    average: bool


def _chunks(plan: MergePlan) -> Iterator[_Chunk]:
    averaged = tuple(i for i, w in enumerate(plan.weights) if w != 0)
    newest = (len(plan.snapshots) - 1,)
    step = plan.chunk_elems
    for s, shard in enumerate(plan.shards):
        for t in shard.tensors:
            info = plan.tensors[t.name][0]
            average = is_float(info.dtype)
            for start in range(0, max(info.numel, 1), step):
                yield _Chunk(
                    s, t.name, start, min(start + step, info.numel), averaged if average else newest, average
                )


class _Writer:
    """Writes (and checksums) output chunks on a background thread, so that the accumulation never waits on it.

    Chunks are handed over in plan order with the buffer they live in; the buffer goes back to the pool once its
    bytes are in the file. At most ``len(pool)`` chunks are in flight.
    """

    def __init__(
        self, plan: MergePlan, directory: Path, buffer_bytes: int, n_buffers: int, fsync: bool
    ) -> None:
        self._plan = plan
        self._directory = directory
        self._fsync = fsync
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(n_buffers):
            self.free.put(torch.empty(buffer_bytes, dtype=torch.uint8))
        self._todo: queue.Queue[tuple[int, str, torch.Tensor, torch.Tensor | None] | None] = queue.Queue()
        self.files: list[dict[str, Any]] = []
        self._error: BaseException | None = None
        self._aborted = False
        self._thread = threading.Thread(target=self._run, name="pmakit-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        writer: ShardWriter | None = None
        try:
            while (item := self._todo.get()) is not None:
                if self._aborted:
                    continue
                shard_index, name, chunk, buf = item
                shard = self._plan.shards[shard_index]
                if writer is None or writer.shard is not shard:
                    if writer is not None:
                        self.files.append(_close(writer, self._fsync))
                    writer = ShardWriter(self._directory / shard.file, shard)
                writer.write(name, chunk)
                if buf is not None:
                    self.free.put(buf)
                if self._fsync:
                    writer.start_writeback()  # overlap the disk writes with the merge, not after it
            if writer is not None and self._aborted:
                writer.abort()
            elif writer is not None:
                self.files.append(_close(writer, self._fsync))
            writer = None
        except BaseException as e:
            self._error = e
            if writer is not None:
                writer.abort()
            while True:  # keep releasing buffers so that the producer never blocks on a dead writer
                item = self._todo.get()
                if item is None:
                    return
                if item[3] is not None:
                    self.free.put(item[3])

    def buffer(self) -> torch.Tensor:
        """A free output buffer (waits for the writer to finish one); raises the writer's error if it failed."""
        while True:
            self.check()
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=0.1)

    def put(self, shard: int, name: str, chunk: torch.Tensor, buf: torch.Tensor | None) -> None:
        self.check()
        self._todo.put((shard, name, chunk, buf))

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> list[dict[str, Any]]:
        """Wait for every chunk to be written; the output files' names, sizes and sha256."""
        self._todo.put(None)
        self._thread.join()
        self.check()
        return self.files

    def abort(self) -> None:
        """Stop writing: chunks still queued are dropped and the open shard is closed unfinished."""
        self._aborted = True
        self._todo.put(None)
        self._thread.join(timeout=30)


def _find_nonfinite(readers: Sequence[Reader], plan: MergePlan, chunk: _Chunk) -> None:
    for src in chunk.sources:
        values = readers[src].read(chunk.name, chunk.start, chunk.stop)
        if not torch.isfinite(values).all():
            snap = plan.snapshots[src]
            raise PmakitError(
                f"non-finite values (NaN/Inf) in tensor {chunk.name!r} of {snap.path} "
                f"(step {snap.step}, {snap.tokens} tokens); pass --exclude {snap.path} to merge "
                "without it"
            )


PREFETCH_AHEAD = 4
"""Chunks ahead of the accumulator whose input ranges the kernel is asked to read (posix_fadvise WILLNEED)."""
WORKERS = 2
"""Threads that accumulate chunks side by side (at most the cores this process may run on)."""


def _workers() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    # Each worker holds one output buffer and the writer needs one: never more workers than that allows.
    return max(1, min(WORKERS, cores, N_BUFFERS - 1))


def _fold(
    views: Sequence[torch.Tensor],
    weights: Sequence[float],
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
) -> bool:
    """``out = sum(w * v)`` with fp32 accumulation, one cache-sized block at a time; False if it is not finite.

    A block's accumulator and conversion buffer stay in the core's cache while all N inputs fold into it, so memory
    traffic is just each input read once and the output written once (a whole chunk's fp32 sum would instead go to
    memory and back N times). A NaN or Inf in any input makes the sum non-finite: summing each block while it is
    in cache is one cheap reduction instead of N checks.
    """
    acc, tmp = scratch
    fp32_out = out.dtype == torch.float32
    total = 0.0
    for start in range(0, out.numel(), BLOCK_ELEMS):
        stop = min(start + BLOCK_ELEMS, out.numel())
        a = out[start:stop] if fp32_out else acc[: stop - start]
        for k, (view, weight) in enumerate(zip(views, weights)):
            values = view[start:stop]
            if values.dtype != torch.float32:
                values = tmp[: stop - start].copy_(values)
            if k == 0:
                torch.mul(values, weight, out=a)
            else:
                a.add_(values, alpha=weight)
        total += a.sum().item()
        if not fp32_out:
            out[start:stop].copy_(a)
    return math.isfinite(total)


def _stream(
    plan: MergePlan,
    readers: Sequence[Reader],
    directory: Path,
    progress: Callable[[int], None] | None,
    fsync: bool,
) -> list[dict[str, Any]]:
    """Write every shard of ``plan`` into ``directory``; returns the output files' names, sizes and sha256.

    Worker threads fold chunks side by side (torch releases the GIL in its kernels): every input's bytes (views of
    the page cache) are converted to fp32 and added with their weight block by block, cast once into an output
    buffer, and the chunk is checked for NaN/Inf. This thread asks the kernel to read ahead of the workers and hands
    finished chunks, in order, to the writer thread. Threads of our own rather than torch's intra-op pool: its
    threads wait for each other at every op and stall whenever another process holds a core.
    """
    chunks = list(_chunks(plan))
    n = plan.chunk_elems
    weights = plan.weights
    itemsize = max([4] + [dtype.itemsize for _, dtype in plan.tensors.values()])
    writer = _Writer(plan, directory, n * itemsize, N_BUFFERS, fsync)
    local = threading.local()

    def work(chunk: _Chunk, views: list[torch.Tensor], buf: torch.Tensor) -> tuple[torch.Tensor, bool]:
        if not hasattr(local, "scratch"):
            local.scratch = (torch.empty(BLOCK_ELEMS), torch.empty(BLOCK_ELEMS))
        out_dtype = plan.tensors[chunk.name][1]
        out = buf[: (chunk.stop - chunk.start) * out_dtype.itemsize].view(out_dtype)
        return out, _fold(views, [weights[src] for src in chunk.sources], out, local.scratch)

    workers = _workers()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="pmakit-fold")
    pending: collections.deque[tuple[_Chunk, Future[tuple[torch.Tensor, bool]], torch.Tensor | None]]
    pending = collections.deque()

    def hand_over() -> None:
        chunk, result, buf = pending.popleft()
        values, finite = result.result()
        if not finite:
            _find_nonfinite(readers, plan, chunk)
        writer.put(chunk.shard, chunk.name, values, buf)
        if progress is not None:
            readers_used = len(chunk.sources)
            progress((chunk.stop - chunk.start) * plan.tensors[chunk.name][0].dtype.itemsize * readers_used)

    try:
        for i, chunk in enumerate(chunks):
            for ahead in chunks[: 1 + PREFETCH_AHEAD] if i == 0 else chunks[i + PREFETCH_AHEAD :][:1]:
                for src in ahead.sources:  # keep the disk PREFETCH_AHEAD chunks ahead of the workers
                    readers[src].prefetch(ahead.name, ahead.start, ahead.stop)
            while len(pending) >= workers:
                hand_over()
            # Reads stay on this thread and in order: a reader may load (not map) and expect to move forward.
            views = [readers[src].read(chunk.name, chunk.start, chunk.stop) for src in chunk.sources]
            if not chunk.average:
                done: Future[tuple[torch.Tensor, bool]] = Future()
                done.set_result((views[0], True))
                pending.append((chunk, done, None))
            else:
                buf = writer.buffer()
                pending.append((chunk, pool.submit(work, chunk, views, buf), buf))
        while pending:
            hand_over()
        return writer.finish()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True)


def _close(writer: ShardWriter, fsync: bool) -> dict[str, Any]:
    return {"name": writer.path.name, "size": writer.path.stat().st_size, "sha256": writer.close(fsync)}


def partial_dir(out: Path) -> Path:
    """Where a merge into ``out`` is built before it is renamed into place."""
    return out.parent / f".{out.name}.pmakit-partial"


def _copy_extras(source: Path, target: Path) -> list[str]:
    """Config, tokenizer and other small non-weight files of the newest snapshot."""
    copied = []
    for f in sorted(source.iterdir()):
        if (
            f.is_file()
            and not f.name.startswith(".")
            and not f.name.startswith(_NOT_COPIED_NAMES)
            and f.suffix not in _NOT_COPIED_SUFFIXES
        ):
            shutil.copy2(f, target / f.name)
            copied.append(f.name)
    return copied


def _manifest(
    plan: MergePlan,
    readers: Sequence[Reader],
    files: list[dict[str, Any]],
    copied: list[str],
    dtype: str | torch.dtype | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    return {
        "tool": "pmakit",
        "version": pmakit.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
        "weights": plan.weights,
        "dtype": str(dtype if dtype is not None else "same").replace("torch.", ""),
        "accumulate": "float32",
        "tokens": plan.snapshots[-1].tokens,
        "inputs": [
            {
                "path": str(s.path.resolve()),
                "step": s.step,
                "tokens": s.tokens,
                "weight": w,
                "format": r.format,
                "files": [vars(f) for f in r.files],
            }
            for s, w, r in zip(plan.snapshots, plan.weights, readers)
        ],
        "skipped_entries": plan.skipped,
        "output": {"files": files, "copied": copied, "total_bytes": plan.output_bytes},
    }


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def merge(
    snapshots: Sequence[Snapshot],
    weights: Sequence[float],
    out: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = "same",
    max_shard_size: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[int], None] | None = None,
    manifest_extra: dict[str, Any] | None = None,
    threads: int = 1,
    fsync: bool = True,
) -> MergeResult:
    """Merge ``snapshots`` (oldest first) with ``weights`` into an HF-layout model directory ``out``.

    Args:
        dtype: ``same`` (each tensor keeps its input dtype), ``bf16``, ``fp16``, ``fp32`` or a torch dtype.
        max_shard_size: bytes per output shard; a larger tensor gets a shard of its own.
        force: replace an existing ``out`` (only once the new merge is complete).
        progress: called with the number of input bytes consumed after each chunk.
        manifest_extra: recorded in ``pmakit-merge.json`` (e.g. the method and the selection flags).
        threads: torch intra-op threads for the accumulation (the reader thread runs beside them).
        fsync: flush the output to disk before renaming it into place.
    """
    start = time.perf_counter()
    out = Path(out)
    plan = plan_merge(snapshots, weights, dtype=dtype, max_shard_size=max_shard_size)
    if out.exists() and not force:
        raise PmakitError(f"{out} exists; pass --force to replace it")
    partial = partial_dir(out)
    if partial.exists():
        if not force:
            raise PmakitError(f"{partial} is left from an interrupted merge; remove it or pass --force")
        shutil.rmtree(partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if plan.output_bytes > free:
        raise PmakitError(
            f"not enough disk space in {out.parent}: the merge writes "
            f"{format_bytes(plan.output_bytes)}, {format_bytes(free)} free"
        )
    previous_threads = torch.get_num_threads()
    try:
        partial.mkdir()
        torch.set_num_threads(threads)
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(open_reader(s.path)) for s in plan.snapshots]
            files = _stream(plan, readers, partial, progress, fsync)
            write_index(partial, plan.shards)
            copied = _copy_extras(plan.snapshots[-1].path, partial)
            manifest = _manifest(plan, readers, files, copied, dtype, manifest_extra or {})
        (partial / MERGE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if fsync:
            _fsync_dir(partial)
        _replace(partial, out)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise PmakitError(
            f"writing {out} failed: {e.strerror or e}" + (" (disk full)" if e.errno == 28 else "")
        ) from e
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(previous_threads)
    return MergeResult(out, plan, time.perf_counter() - start, manifest)


def _replace(partial: Path, out: Path) -> None:
    """Move the finished ``partial`` to ``out``; an old ``out`` is removed only after the new one is in place."""
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.pmakit-old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
