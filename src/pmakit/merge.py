"""Stream-average snapshots into one model: validate headers, then fp32-accumulate chunk by chunk, write atomically.

The shape of the work: inputs are memory-mapped and the kernel is asked to read a couple of chunks ahead; the
calling thread converts each input chunk straight from the page cache to fp32 and folds it into an accumulator,
checks the sum is finite, casts it once into an output buffer; a writer thread appends it to the output shard and
checksums it. Peak memory is a few chunk-sized buffers (the mapped input pages belong to the page cache):
independent of the number of snapshots and of the model's size.

Output goes to a hidden sibling ``.OUT.pmakit-partial`` and is renamed into place only when every shard, the index,
the copied config/tokenizer files and the manifest are on disk. Any failure removes the partial directory.

At scale (issue #6): each finished shard is recorded with its sha256 in ``.pmakit-progress/`` inside the partial
directory, so that a merge killed where it cannot clean up (SIGKILL, OOM, a lost node) resumes with ``resume=True``,
writing only the shards it had not finished. Under torch.distributed every rank writes the shards it owns (tensors
split by bytes, see ``pmakit.world``) and the ranks agree after each stage, so that one rank's failure fails all.
``plan_increment`` turns a previous SMA/EMA merge plus the snapshots that entered and left the window into the merge
of the new window (``keep_fp32`` keeps the fp32 sums it needs).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import hashlib
import json
import logging
import math
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import pmakit
from pmakit.errors import PmakitError
from pmakit.formats import Reader, TensorInfo, is_float
from pmakit.formats.safetensors_io import OutputTensor, Shard, ShardWriter, plan_shards, write_index
from pmakit.guard import guard_output, output_lock
from pmakit.layouts import native_format, open_weights, writer
from pmakit.snapshot import MERGE_MANIFEST, METADATA_FILE, Snapshot
from pmakit.units import format_bytes
from pmakit.world import World

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
    owners: tuple[int, ...] = ()
    """The rank that writes each shard (empty: rank 0 writes them all)."""

    def owner(self, shard: int) -> int:
        return self.owners[shard] if self.owners else 0

    def shard_input_bytes(self, shard: int) -> int:
        """Bytes read to write one shard."""
        readers = sum(1 for w in self.weights if w != 0)
        return sum(
            self.tensors[t.name][0].nbytes * (readers if is_float(self.tensors[t.name][0].dtype) else 1)
            for t in self.shards[shard].tensors
        )

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
    dtype: str | torch.dtype | Mapping[str, torch.dtype] | None = "same",
    max_shard_size: int = 5 * 10**9,
    ranks: int = 1,
    cast: bool | None = None,
) -> MergePlan:
    """Read every input's headers, check they match, and lay out the output. Reads no weights.

    Args:
        dtype: as for ``merge``, or a mapping of tensor name to output dtype.
        ranks: split the output into shards owned by this many ranks, balanced by bytes.
        cast: inputs may differ in float dtype (default: only when ``dtype`` is not ``same``).
    """
    if len(snapshots) != len(weights):
        raise PmakitError(f"{len(weights)} weights for {len(snapshots)} snapshots")
    if not snapshots:
        raise PmakitError("no snapshots to merge")
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_weights(s.path)) for s in snapshots]
        _validate(readers, snapshots, cast=dtype not in (None, "same") if cast is None else cast)
        newest = readers[-1]
        if not newest.tensors:  # e.g. a torch file of trainer state only: one line, not a crash further down
            raise PmakitError(
                f"{snapshots[-1].path}: no model weights ({len(newest.skipped)} entries, none a model tensor)"
            )
        order = sorted(newest.tensors, key=lambda k: newest.tensors[k].order)
        tensors = {
            k: (
                newest.tensors[k],
                dtype[k] if isinstance(dtype, Mapping) else output_dtype(dtype, newest.tensors[k].dtype),
            )
            for k in order
        }
        out = [OutputTensor(k, tensors[k][1], tensors[k][0].shape) for k in order]
        skipped = sorted({s for r in readers for s in r.skipped})
    shards, owners = _plan_rank_shards(out, max_shard_size, ranks)
    return MergePlan(list(snapshots), list(weights), tensors, shards, skipped, owners)


def _plan_rank_shards(
    out: Sequence[OutputTensor], max_shard_size: int, ranks: int
) -> tuple[list[Shard], tuple[int, ...]]:
    """Shards for ``ranks`` writers: the tensors split into contiguous groups by bytes, each group sharded."""
    if ranks <= 1:
        return plan_shards(out, max_shard_size), ()
    from pmakit.world import split_by_bytes

    groups = split_by_bytes([t.nbytes for t in out], ranks)
    parts = [
        (r, plan_shards([t for t, g in zip(out, groups) if g == r], max_shard_size)) for r in range(ranks)
    ]
    flat = [(r, s) for r, shards in parts for s in shards if s.tensors]
    if len(flat) <= 1:
        return [s for _, s in flat] or plan_shards(out, max_shard_size), ()
    n = len(flat)
    shards = [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", s.tensors) for i, (_, s) in enumerate(flat)]
    return shards, tuple(r for r, _ in flat)


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
        item: tuple[int, str, torch.Tensor, torch.Tensor | None] | None = None
        try:
            while (item := self._todo.get()) is not None:
                if self._aborted:
                    continue
                shard_index, name, chunk, buf = item
                shard = self._plan.shards[shard_index]
                if writer is None or writer.shard is not shard:
                    if writer is not None:
                        self.files.append(_close(writer, self._fsync))
                    writer = ShardWriter(self._directory / shard.file, shard, direct=True)
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
            # The last shard's close (its staged tail, the fsync) fails after the end marker was taken: then
            # nothing more comes, and waiting for another marker would hang finish() for good (disk full).
            while (
                item is not None
            ):  # keep releasing buffers so that the producer never blocks on a dead writer
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
        if fp32_out:
            total += a.sum().item()
        else:  # summed after the cast: a value beyond fp16's range becomes Inf there, not in the fp32 sum
            total += out[start:stop].copy_(a).sum(dtype=torch.float32).item()
    return math.isfinite(total)


def _fold_on(device: str, views: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> bool:
    """``--device cuda``: the weighted fp32 sum on the accelerator (inputs copied over, the cast sum copied back);
    whether it is finite. Tested here only with device="cpu" (no GPU on the development machine)."""
    acc: torch.Tensor | None = None
    for view, weight in zip(views, weights):
        values = view.to(device=device, dtype=torch.float32, copy=True)
        acc = values.mul_(weight) if acc is None else acc.add_(values, alpha=weight)
    assert acc is not None
    out.copy_(acc.to(out.dtype))
    return bool(torch.isfinite(out).all())  # after the cast: fp16 overflows to Inf


def _stream(
    plan: MergePlan,
    readers: Sequence[Reader],
    directory: Path,
    progress: Callable[[int], None] | None,
    fsync: bool,
    device: str = "cpu",
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
        if device != "cpu":
            return out, _fold_on(device, views, [weights[src] for src in chunk.sources], out)
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
            dtype = str(plan.tensors[chunk.name][1]).replace("torch.", "")
            raise PmakitError(
                f"tensor {chunk.name!r}: the average exceeds the range of {dtype} (it would be written as Inf); "
                "merge with --dtype fp32 or bf16"
            )
        writer.put(chunk.shard, chunk.name, values, buf)
        if progress is not None:
            readers_used = len(chunk.sources)
            progress((chunk.stop - chunk.start) * plan.tensors[chunk.name][0].dtype.itemsize * readers_used)

    # Each chunk makes thousands of short-lived tensor views; reference counting frees them, but their allocations
    # would trigger collections that walk every object torch created at import (5% of a merge's CPU).
    gc_was_enabled = gc.isenabled()
    gc.disable()
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
        if gc_was_enabled:
            gc.enable()


def _close(writer: ShardWriter, fsync: bool) -> dict[str, Any]:
    sha256 = writer.close(fsync)  # first: the size is only final once the file is flushed
    return {"name": writer.path.name, "size": writer.path.stat().st_size, "sha256": sha256}


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
                "layout": s.layout,
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


FP32_DIR = "pmakit-fp32"
"""Inside a merge made with ``keep_fp32``: the fp32 sums (HF layout) that an incremental update starts from."""
PROGRESS_DIR = ".pmakit-progress"
"""Inside the partial directory: the plan's fingerprint and one checksum record per finished shard."""
KILL_ENV = "PMAKIT_TEST_KILL"
"""Test hook: ``after-shard:K``, ``in-shard:K`` or ``before-rename`` makes the process SIGKILL itself there."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 * 2**20):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, record: dict[str, Any]) -> None:
    """Atomically (a kill leaves the old file or the new one, never half of one)."""
    tmp = path.parent / f".{path.name}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class _Progress:
    """What an interrupted merge finished: one checksum record per shard, written once the shard is on disk."""

    def __init__(self, partial: Path) -> None:
        self.partial = partial
        self.dir = partial / PROGRESS_DIR

    def _file(self, rel: str) -> Path:
        return self.dir / (rel.replace("/", "__") + ".json")

    def start(self, fingerprint: str) -> None:
        self.dir.mkdir(parents=True)
        _write_json(self.dir / "plan.json", {"fingerprint": fingerprint})

    def check(self, fingerprint: str) -> None:
        try:
            recorded = json.loads((self.dir / "plan.json").read_text()).get("fingerprint")
        except (OSError, ValueError, AttributeError):
            raise PmakitError(
                f"{self.partial} has no readable progress record, so it cannot be resumed; "
                "pass --force to start over"
            ) from None
        if recorded != fingerprint:
            raise PmakitError(
                f"{self.partial} holds an interrupted merge with other inputs or options (snapshots, weights, "
                "dtype, shard size, ranks, format or --keep-fp32 differ); pass --force to start over"
            )

    def record(self, rel: str, info: dict[str, Any]) -> None:
        _write_json(self._file(rel), info)

    def recorded(self, rel: str) -> dict[str, Any]:
        return dict(json.loads(self._file(rel).read_text()))

    def finished(self, rel: str) -> bool:
        """The shard is recorded and the file on disk still has the recorded size and sha256."""
        try:
            record = self.recorded(rel)
        except (OSError, ValueError):
            return False
        path = self.partial / rel
        if (
            path.is_file()
            and path.stat().st_size == record.get("size")
            and _sha256_file(path) == record["sha256"]
        ):
            return True
        log.warning("%s was recorded as finished but does not match its checksum; writing it again", path)
        return False


class _Killer:
    """The ``PMAKIT_TEST_KILL`` hook: dies like a kill -9 at a chosen point, so that tests can resume from it."""

    def __init__(self) -> None:
        point, _, k = os.environ.get(KILL_ENV, "").partition(":")
        self.point, self.k, self.shards = point, int(k or 0), 0

    def at(self, point: str) -> None:
        if point == self.point and (point == "before-rename" or self.shards == self.k):
            os.kill(os.getpid(), signal.SIGKILL)


def _write_pass(
    plan: MergePlan,
    readers: Sequence[Reader],
    partial: Path,
    sub: str,
    world: World,
    progress: Callable[[int], None] | None,
    fsync: bool,
    killer: _Killer,
) -> None:
    """Write the shards of ``plan`` this rank owns into ``partial/sub``, skipping those already finished."""
    directory = partial / sub
    directory.mkdir(exist_ok=True)
    prog = _Progress(partial)
    for i, shard in enumerate(plan.shards):
        if plan.owner(i) != world.rank:
            continue
        rel = f"{sub}/{shard.file}" if sub else shard.file
        if prog.finished(rel):
            continue

        def report(n: int) -> None:
            killer.at("in-shard")
            if progress is not None:
                progress(n)

        files = _stream(replace(plan, shards=[shard]), readers, directory, report, fsync, world.device)
        prog.record(rel, files[0])
        killer.shards += 1
        killer.at("after-shard")


def _fingerprint(plan: MergePlan, readers: Sequence[Reader], **options: Any) -> str:
    """Identifies a merge: its inputs (paths and header checksums), weights, output layout and options."""
    record = {
        "inputs": [str(s.path.resolve()) for s in plan.snapshots],
        "files": [[vars(f) for f in r.files] for r in readers],
        "weights": plan.weights,
        "shards": [[s.file, [(t.name, str(t.dtype), list(t.shape)) for t in s.tensors]] for s in plan.shards],
        "owners": list(plan.owners),
        **options,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _prepare(
    out: Path, partial: Path, plan: MergePlan, fingerprint: str, force: bool, resume: bool, extra: int = 0
) -> None:
    """Rank 0: check the target, then create the partial directory or take over an interrupted one.

    An interrupted merge of the very same inputs and options is continued without being asked (the same command
    run again after a kill); ``--force`` starts over. ``extra``: bytes written beside the output (fp32 sums)."""
    if out.exists() and not force:
        raise PmakitError(f"{out} exists; pass --force to replace it")
    if partial.exists():
        if resume or not force:
            _Progress(partial).check(fingerprint)
            log.warning("continuing the interrupted merge in %s (same inputs and options)", partial)
            return
        shutil.rmtree(partial)
    elif resume:
        log.info("no interrupted merge in %s; starting from the beginning", partial)
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if plan.output_bytes + extra > free:
        raise PmakitError(
            f"not enough disk space in {out.parent}: the merge writes "
            f"{format_bytes(plan.output_bytes + extra)}, {format_bytes(free)} free"
        )
    partial.mkdir()
    _Progress(partial).start(fingerprint)


def _stage(world: World, out: Path, fn: Callable[[], Any], rank0: bool = False) -> Any:
    """Run ``fn`` on every rank (or on rank 0 only), then agree: if any rank failed, every rank raises (its own
    error, or a pointer to the rank that has it). Every rank passes the same stages in the same order."""
    error: BaseException | None = None
    result = None
    try:
        if world.rank == 0 or not rank0:
            result = fn()
    except BaseException as e:
        error = e
    everyone = world.agree(error is None)
    if isinstance(error, OSError):
        raise PmakitError(
            f"writing {out} failed: {error.strerror or error}" + (" (disk full)" if error.errno == 28 else "")
        ) from error
    if error is not None:
        raise error
    if not everyone:
        raise PmakitError("the merge failed on another rank (its error is in that rank's output)")
    return result


def _write_layout(plan: MergePlan, partial: Path, world: World, fsync: bool, out_format: str) -> list[str]:
    """Rewrite this rank's finished safetensors shards in the ``out_format`` layout inside ``partial`` (a
    collective under torch.distributed); the files it wrote. The tensors handed over are views of the mapped
    shards, so the layout's writer streams them from the page cache."""
    from pmakit.formats.safetensors_io import SafetensorsReader

    with SafetensorsReader(partial) as staged:
        mine = {
            t.name: staged.read(t.name, 0, staged.tensors[t.name].numel).view(t.shape)
            for i, s in enumerate(plan.shards)
            if plan.owner(i) == world.rank
            for t in s.tensors
        }
        template = plan.snapshots[-1].path
        files = writer(out_format).write(mine, template, partial, distributed=world.distributed, fsync=fsync)
        mine.clear()
    return files


def _finish(
    plan: MergePlan,
    readers: Sequence[Reader],
    partial: Path,
    out: Path,
    written: list[str] | None,
    fsync: bool,
    manifest: Callable[[list[dict[str, Any]], list[str]], dict[str, Any]],
    killer: _Killer,
) -> dict[str, Any]:
    """Rank 0, once every shard is written: drop staged files, copy extras, write the manifest, rename.

    ``written``: the files a layout's writer made from the staged safetensors shards (None: the shards are the
    output)."""
    for reader in readers:  # every input byte is read: the inputs must still be what was opened
        reader.verify()
    prog = _Progress(partial)
    if written is not None:
        for s in plan.shards:
            (partial / s.file).unlink(missing_ok=True)
        (partial / "model.safetensors.index.json").unlink(missing_ok=True)
        files = [
            {"name": f, "size": (partial / f).stat().st_size, "sha256": _sha256_file(partial / f)}
            for f in written
        ]
    else:
        write_index(partial, plan.shards)
        files = [prog.recorded(s.file) for s in plan.shards]
    copied = _copy_extras(plan.snapshots[-1].path, partial)
    record = manifest(files, copied)
    (partial / MERGE_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    if fsync:
        _fsync_dir(partial)
    killer.at("before-rename")
    replace_dir(partial, out)
    # Only now: a kill before the rename must still find the progress record to resume from.
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    return record


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
    resume: bool = False,
    out_format: str | None = "safetensors",
    keep_fp32: bool = False,
    world: World | None = None,
    window: tuple[Sequence[Snapshot], Sequence[float]] | None = None,
) -> MergeResult:
    """Merge ``snapshots`` (oldest first) with ``weights`` into a model directory ``out``.

    Args:
        dtype: ``same`` (each tensor keeps its input dtype), ``bf16``, ``fp16``, ``fp32`` or a torch dtype.
        max_shard_size: bytes per output shard; a larger tensor gets a shard of its own.
        force: replace an existing ``out`` (only once the new merge is complete), or a partial one.
        progress: called with the number of input bytes consumed after each chunk.
        manifest_extra: recorded in ``pmakit-merge.json`` (e.g. the method and the selection flags).
        threads: torch intra-op threads for the accumulation (the reader thread runs beside them).
        fsync: flush the output to disk before renaming it into place.
        resume: continue an interrupted merge into ``out`` (same inputs and options) from its partial directory,
            writing only the shards it had not finished; without one, start from the beginning.
        out_format: ``safetensors`` (HF layout), a run layout that writes itself back (``dcp``: names at the top
            level; ``olmo-core``, ...: see ``pmakit.layouts``), or None for the newest input's own layout.
        keep_fp32: also keep the fp32 sums in ``out/pmakit-fp32/`` when the output is cast to a narrower dtype
            (what ``incremental_terms`` needs to update this merge exactly).
        world: this process's rank among the ranks sharing the merge (default: a single process).
        window: for an incremental update (``snapshots``/``weights`` are then its terms), the merge's real
            window and weights, recorded in the manifest as its inputs.
    """
    start = time.perf_counter()
    out = Path(out)
    world = world or World()
    guard_output(out, [s.path for s in [*snapshots, *(window[0] if window else [])]], force)
    plan = plan_merge(
        snapshots,
        weights,
        dtype=dtype,
        max_shard_size=max_shard_size,
        ranks=world.size,
        cast=window is not None or None,
    )
    out_format = out_format or native_format(plan.snapshots[-1])
    if out_format != "safetensors":
        writer(out_format)  # an unknown format fails before any work
    narrow = any(is_float(d) and d != torch.float32 for _, d in plan.tensors.values())
    sums = None
    if keep_fp32 and narrow:
        sums = plan_merge(
            snapshots, weights, dtype="fp32", max_shard_size=max_shard_size, ranks=world.size, cast=True
        )
    job = _Job(
        plan, sums, out, partial_dir(out), world, out_format, fsync, progress, _Killer(), max_shard_size
    )
    previous_threads = torch.get_num_threads()
    owned = False
    try:
        torch.set_num_threads(threads)
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(open_weights(s.path)) for s in plan.snapshots]
            _stage(world, out, lambda: _take_output(job, readers, stack, force, resume), rank0=True)
            owned = True
            final, final_readers = _fp32_pass(job, readers, stack) if sums is not None else (plan, readers)
            last_progress = None if sums is not None else progress
            _stage(
                world,
                out,
                lambda: _write_pass(
                    final, final_readers, job.partial, "", world, last_progress, fsync, job.killer
                ),
            )
            written = _layout_pass(job) if out_format != "safetensors" else None
            record = _manifest_of(job, readers, dtype, manifest_extra or {}, narrow, window)
            finish = lambda: _finish(plan, readers, job.partial, out, written, fsync, record, job.killer)  # noqa: E731
            result = _stage(world, out, finish, rank0=True)
    except BaseException:
        if owned and world.rank == 0:
            shutil.rmtree(job.partial, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(previous_threads)
    return MergeResult(out, plan, time.perf_counter() - start, result or {})


@dataclass(frozen=True)
class _Job:
    """What every step of one ``merge`` call shares."""

    plan: MergePlan
    sums: MergePlan | None
    """The fp32 sums' plan (``keep_fp32`` with a narrower output), written first and cast once."""
    out: Path
    partial: Path
    world: World
    out_format: str
    fsync: bool
    progress: Callable[[int], None] | None
    killer: _Killer
    max_shard_size: int


def _take_output(
    job: _Job, readers: Sequence[Reader], stack: contextlib.ExitStack, force: bool, resume: bool
) -> None:
    """Rank 0: lock the output (held until the merge ends) and make or check its partial directory."""
    options = {"format": job.out_format, "keep_fp32": job.sums is not None, "ranks": job.world.size}
    fingerprint = _fingerprint(job.plan, readers, **options)
    stack.enter_context(output_lock(job.out))
    extra = job.sums.output_bytes if job.sums is not None else 0
    _prepare(job.out, job.partial, job.plan, fingerprint, force, resume, extra)


def _fp32_pass(
    job: _Job, readers: Sequence[Reader], stack: contextlib.ExitStack
) -> tuple[MergePlan, list[Reader]]:
    """Write the fp32 sums into ``pmakit-fp32/``; the output is then those sums cast once (the same bytes as
    casting the accumulator directly). Returns the cast pass's plan and reader."""
    fp32, world, out = job.sums, job.world, job.out
    assert fp32 is not None
    _stage(
        world,
        out,
        lambda: _write_pass(fp32, readers, job.partial, FP32_DIR, world, job.progress, job.fsync, job.killer),
    )
    _stage(world, out, lambda: write_index(job.partial / FP32_DIR, fp32.shards), rank0=True)
    state = Snapshot(job.partial / FP32_DIR, tokens=job.plan.snapshots[-1].tokens, source="merge")
    dtypes = {k: d for k, (_, d) in job.plan.tensors.items()}
    shard_size = job.max_shard_size

    def cast_plan() -> MergePlan:  # a stage of its own: it reads what rank 0 just wrote
        casting = plan_merge(
            [state], [1.0], dtype=dtypes, max_shard_size=shard_size, ranks=world.size, cast=True
        )
        if casting.shards != job.plan.shards:
            raise RuntimeError("the cast pass planned other shards than the merge")
        return casting

    return _stage(world, out, cast_plan), [stack.enter_context(open_weights(state.path))]


def _layout_pass(job: _Job) -> Any:
    """Write the merged weights in the chosen run layout (DCP, OLMo-core, ...) from the staged safetensors."""
    _stage(job.world, job.out, lambda: write_index(job.partial, job.plan.shards), rank0=True)
    return _stage(
        job.world, job.out, lambda: _write_layout(job.plan, job.partial, job.world, job.fsync, job.out_format)
    )


def _manifest_of(
    job: _Job,
    readers: Sequence[Reader],
    dtype: str | torch.dtype | None,
    extra: dict[str, Any],
    narrow: bool,
    window: tuple[Sequence[Snapshot], Sequence[float]] | None,
) -> Callable[[list[dict[str, Any]], list[str]], dict[str, Any]]:
    """The manifest, built once the output files exist: inputs, weights, how it was produced."""

    def manifest(files: list[dict[str, Any]], copied: list[str]) -> dict[str, Any]:
        record = _manifest(job.plan, readers, files, copied, dtype, extra)
        record["produced_by"] = {
            "mode": "incremental" if window is not None else "full",
            "ranks": job.world.size,
            "format": job.out_format,
            "fp32_sums": FP32_DIR if job.sums is not None else (None if narrow else "."),
        }
        if job.sums is not None:  # what --from-previous checks before trusting the sums
            ledger = _Progress(job.partial)
            record["output"]["fp32_files"] = [
                ledger.recorded(f"{FP32_DIR}/{s.file}") for s in job.sums.shards
            ]
        if window is not None:
            record["terms"] = record["inputs"]
            record["inputs"] = _window_inputs(*window)
            record["weights"] = list(window[1])
            record["tokens"] = window[0][-1].tokens
        return record

    return manifest


def _window_inputs(snapshots: Sequence[Snapshot], weights: Sequence[float]) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_weights(s.path)) for s in snapshots]
        return [
            {
                "path": str(s.path.resolve()),
                "step": s.step,
                "tokens": s.tokens,
                "weight": w,
                "layout": s.layout,
                "format": r.format,
                "files": [vars(f) for f in r.files],
            }
            for s, w, r in zip(snapshots, weights, readers)
        ]


def average_states(
    states: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
) -> dict[str, torch.Tensor]:
    """The in-memory counterpart of ``merge`` for small models: fp32 weighted sum of float tensors, non-float
    tensors from the newest state (``states`` oldest first)."""
    out: dict[str, torch.Tensor] = {}
    for name, ref in states[-1].items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float32)
            for state, w in zip(states, weights):
                acc.add_(state[name].float(), alpha=w)
            out[name] = acc
        else:
            out[name] = ref
    return out


def replace_dir(partial: Path, out: Path) -> None:
    """Move the finished ``partial`` to ``out``; an old ``out`` is removed only after the new one is in place."""
    old = None
    if os.path.lexists(out):
        old = out.parent / f".{out.name}.pmakit-old"
        _remove(old)
        os.replace(out, old)
    os.replace(partial, out)
    if old is not None:
        _remove(old)


def _remove(path: Path) -> None:
    """Remove a directory tree, or a file or symlink (rmtree refuses those, and would leave them behind)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


# ---------------------------------------------------------------------------------------------------------------
# Incremental updates: the merge of a moved window from the previous merge's fp32 sums

INCREMENTAL_METHODS = ("sma", "ema", "ema-normalized")
"""Weightings whose weights, when the window moves, keep their ratios on the snapshots that stay."""


@dataclass(frozen=True)
class Increment:
    """How to get the merge of a new window from a previous merge: ``sum(weights[i] * terms[i])``."""

    terms: list[Snapshot]
    """The previous merge's fp32 sums first, then the snapshots to add or subtract, the window's newest last."""
    weights: list[float]
    """One per term; the first is the scale applied to the previous sums."""
    previous: Path
    """The previous merge directory."""

    @property
    def reads(self) -> int:
        return sum(1 for w in self.weights if w != 0)


def _same_files(snapshot: Path, recorded: Any) -> bool:
    """The snapshot's header checksums still match what the previous merge recorded."""
    if not isinstance(recorded, list):
        return False
    with open_weights(snapshot) as reader:
        return [f.header_sha256 for f in reader.files] == [r.get("header_sha256") for r in recorded]


def _verify_previous(previous: Path, state: Path, manifest: dict[str, Any]) -> None:
    """The sums an update builds on still have the sha256 their merge recorded: an edited or damaged previous merge
    would otherwise pass its error on to every later merge (one read of the sums, which the update reads anyway)."""
    output = manifest.get("output")
    recorded = (output if isinstance(output, dict) else {}).get(
        "fp32_files" if state != previous else "files"
    )
    if not isinstance(recorded, list) or not recorded:
        raise PmakitError(f"{previous}: its manifest records no checksums of its sums; run a full merge")
    for entry in recorded:
        try:
            file, sha = state / str(entry["name"]), str(entry["sha256"])
        except (KeyError, TypeError):
            raise PmakitError(f"{previous}: unreadable file record {entry!r} in its manifest") from None
        if "/" in str(entry["name"]) or not file.is_file() or _sha256_file(file) != sha:
            raise PmakitError(
                f"{file}: does not match the sha256 its merge recorded (edited or damaged); run a full merge"
            )


def _scale(old: dict[str, float], new: dict[str, float]) -> float:
    """The factor on the previous merge that makes the most shared snapshots' weights right as they are."""
    ratios = [new[p] / old[p] for p in new.keys() & old.keys() if old[p] != 0]
    if not ratios:
        return 0.0
    votes: dict[float, list[float]] = {}
    for r in ratios:
        votes.setdefault(float(f"{r:.10g}"), []).append(r)
    return max(votes.values(), key=len)[0]


def plan_increment(
    previous: str | os.PathLike[str],
    window: Sequence[Snapshot],
    weights: Sequence[float],
    *,
    method: str,
    alpha: float,
) -> Increment:
    """Terms that turn the merge in ``previous`` into the merge of ``window`` with ``weights``.

    With the previous weights w and the new ones w', the new merge is c * previous + sum_p (w'_p - c * w_p) * p
    over the snapshots p of both windows, c chosen so that the snapshots in both need no term: for SMA and EMA a
    moved window then reads only the added and the dropped snapshots (and, for EMA, the new oldest one, which takes
    the seed's weight). The sums are fp32: a previous merge written in bf16 or fp16 must have kept its fp32 sums
    (``--keep-fp32``), or every update would add that rounding for good.
    """
    previous = Path(previous)
    manifest_file = previous / MERGE_MANIFEST
    try:
        manifest = json.loads(manifest_file.read_text())
        prior = {str(Path(i["path"])): (float(i["weight"]), i) for i in manifest["inputs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PmakitError(f"{previous}: not a pmakit merge with a readable {MERGE_MANIFEST} ({e})") from e
    if method not in INCREMENTAL_METHODS:
        raise PmakitError(
            f"--from-previous updates {', '.join(INCREMENTAL_METHODS)} merges: with {method} the weight of "
            "every snapshot changes when the window moves, so run a full merge"
        )
    if manifest.get("method") != method:
        raise PmakitError(
            f"{previous} is a {manifest.get('method')} merge; --from-previous cannot turn it into {method}"
        )
    if method.startswith("ema") and manifest.get("alpha") != alpha:
        raise PmakitError(f"{previous} used --alpha {manifest.get('alpha')}, not {alpha}; run a full merge")
    state = previous / FP32_DIR
    if not state.is_dir():
        state = previous
        with open_weights(previous) as reader:
            narrow = sorted(
                {
                    str(i.dtype)
                    for i in reader.tensors.values()
                    if is_float(i.dtype) and i.dtype != torch.float32
                }
            )
        if narrow:
            raise PmakitError(
                f"{previous} holds {', '.join(narrow).replace('torch.', '')} weights and no fp32 sums ({FP32_DIR}/): "
                "updating it would keep that rounding in every later merge; run the full merge once with "
                "--keep-fp32 (or --dtype fp32)"
            )
    _verify_previous(previous, state, manifest)
    new = {str(s.path.resolve()): w for s, w in zip(window, weights)}
    old = {p: w for p, (w, _) in prior.items()}
    if not new.keys() & old.keys():
        raise PmakitError(
            f"the new window shares no snapshot with {previous}: nothing to reuse, run a full merge"
        )
    scale = _scale(old, new)
    biggest = max(abs(w) for w in [*old.values(), *new.values()])
    by_path = {str(s.path.resolve()): s for s in window}
    terms: list[tuple[Snapshot, float]] = []
    for p in sorted(new.keys() | old.keys()):
        d = new.get(p, 0.0) - scale * old.get(p, 0.0)
        if abs(d) <= 1e-12 * biggest:
            continue
        entry = prior[p][1] if p in prior else None
        if p in by_path:
            snap = by_path[p]
        elif not Path(p).is_dir():
            raise PmakitError(
                f"{p} left the window but is gone: an incremental update subtracts it; run a full merge"
            )
        else:
            assert entry is not None  # it left the window, so the previous merge had it
            snap = Snapshot(Path(p), tokens=int(entry["tokens"]), step=entry.get("step"), source="merge")
        if entry is not None and not _same_files(snap.path, entry.get("files")):
            raise PmakitError(
                f"{p} changed since {previous} was merged (its headers differ); run a full merge"
            )
        terms.append((snap, d))
    terms.sort(key=lambda t: t[0].tokens)
    newest = window[-1]
    if not terms or terms[-1][0].path.resolve() != newest.path.resolve():
        terms.append(
            (newest, 0.0)
        )  # read only for its integer tensors and config files, as a full merge would
    if len(terms) + 1 > len(window):
        log.warning(
            "this update reads %d inputs, a full merge of the window %d: the window moved too far to save reads",
            len(terms) + 1,
            len(window),
        )
    previous_tokens = int(manifest.get("tokens", 0))
    sums = Snapshot(state, tokens=previous_tokens, source="merge")
    return Increment([sums, *(s for s, _ in terms)], [scale, *(w for _, w in terms)], previous)
