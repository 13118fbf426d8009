"""The streaming kernel: fold each chunk of every input into an fp32 accumulator and hand it to a writer thread.

Inputs are memory-mapped and the kernel is asked to read a couple of chunks ahead; the calling thread converts each
input chunk straight from the page cache to fp32 and folds it into an accumulator, checks the sum is finite, casts it
once into an output buffer; a writer thread appends it to the output shard while a hasher thread checksums it.
Peak memory is a few chunk-sized buffers (the mapped input pages belong to the page cache): independent of the
number of snapshots and of the model's size."""

from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import itertools
import logging
import math
import queue
import resource
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.formats import Reader, is_float
from pmakit.formats.safetensors_io import ShardWriter, header_bytes
from pmakit.merge.plan import MergePlan

log = logging.getLogger(__name__)

BLOCK_ELEMS = 256 * 2**10
"""Elements folded at a time: a block's fp32 sum and conversion buffer (2 MiB together) stay in cache (L2, or the
core's share of L3) while every input folds in, and each of the block's 2N small torch ops is long enough that
their dispatch (microseconds each) is noise. On this machine (1 MiB L2 a core, 32 MiB L3; 8 bf16 inputs, six
interleaved rounds): streaming 1.53 s at 128K, 1.24 s at 256K, 1.21 s at 512K, 1.25 s at 1M; 256K keeps the
buffers at 2 MiB a worker."""


@dataclass
class MergeStats:
    """Where a merge's time goes, thread by thread (seconds, summed over the merge's shards); see ``timed``.

    Wall times, except ``*_cpu`` (the thread's own CPU time): on a shared or small machine a thread's wall time
    beyond its CPU time is time it was ready but had no core (or waited on a page read from disk).
    """

    wall: float = 0.0
    """The streaming passes, end to end."""
    read: float = 0.0
    """Calling thread: the inputs' views and the read-ahead hints (mapped inputs are read when first touched)."""
    wait_buffer: float = 0.0
    """Calling thread: waiting for the writer to free an output buffer (the writer is behind)."""
    wait_fold: float = 0.0
    """Calling thread: waiting for a worker's fold of the oldest chunk (the workers are behind)."""
    accumulate: float = 0.0
    """Workers, summed: inputs converted to fp32 and added with their weights (includes faulting in the mapped
    input pages: a page-cache hit when warm, a disk read when cold)."""
    cast: float = 0.0
    """Workers, summed: the fp32 sum cast into the output buffer and checked for NaN/Inf."""
    fold_cpu: float = 0.0
    """Workers, summed: their CPU time for the two above."""
    minor_faults: int = 0
    """Workers: page faults served from the page cache (mapping input pages in)."""
    major_faults: int = 0
    """Workers: page faults that read from disk."""
    write: float = 0.0
    """Writer thread: bytes staged and written out (O_DIRECT)."""
    close: float = 0.0
    """Writer thread: a shard's staged tail written and the file fsynced."""
    wait_hash: float = 0.0
    """Writer thread: at a shard's end, waiting for the hasher thread's checksum of it (the hasher is behind)."""
    wait_chunk: float = 0.0
    """Writer thread: idle, waiting for the next chunk."""
    writer_cpu: float = 0.0
    """Writer thread: its CPU time."""
    sha256: float = 0.0
    """Hasher thread: the output's bytes checksummed for the manifest, beside the writes."""
    hasher_cpu: float = 0.0
    """Hasher thread: its CPU time."""
    chunks: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        """Add to several counters at once (from any thread)."""
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


_STATS: MergeStats | None = None
"""Set by ``timed``: the merges running meanwhile time their threads into it (None: no timers, the default)."""


@contextlib.contextmanager
def timed() -> Iterator[MergeStats]:
    """Within the block, merges record where their time goes (``MergeStats``); for benchmarks, off by default.

    The timers are per chunk, and per 128K-element block in the fold (a few perf_counter calls against ~1 ms of
    arithmetic): the merge's output is the same bytes with or without them.
    """
    global _STATS
    stats = _STATS = MergeStats()
    try:
        yield stats
    finally:
        _STATS = None


class _Clock:
    """``with _Clock("read"):`` adds the block's wall time to that counter of the running ``timed`` (if any)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._stats = _STATS
        self._start = 0.0

    def __enter__(self) -> None:
        if self._stats is not None:
            self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        if self._stats is not None:
            self._stats.add(**{self._name: time.perf_counter() - self._start})


@dataclass(frozen=True)
class _Chunk:
    shard: int
    name: str
    start: int
    stop: int
    sources: tuple[int, ...]
    weights: tuple[float, ...]
    average: bool
    """Folded into the output dtype (False: the newest input's bytes, written as they are)."""


def _chunks(plan: MergePlan, readers: Sequence[Reader]) -> Iterator[_Chunk]:
    """Each tensor in chunks of at most ``plan.chunk_elems``, cut also where an input holds it in pieces of its own
    (``Reader.breaks``: a DCP checkpoint's saved slabs, or its layers): a chunk across two pieces is read as a copy
    joining them, one per input for each chunk in flight (measured on Megatron's layer-stacked checkpoints: peak
    RssAnon 399 -> 296 MiB a process at TP1, ~465 -> 309 at TP2). Pieces under ``MIN_PIECE_ELEMS`` on average are
    not cut at (joining them is cheap, a chunk each would not be)."""
    step = plan.chunk_elems
    for s, shard in enumerate(plan.shards):
        for t in shard.tensors:
            info, out_dtype = plan.tensors[t.name]
            sources, weights = plan.sources(t.name)
            # A tensor taken from the newest input is still folded (weight 1) when its dtype changes: a router
            # bias written in fp32 from a bf16 input.
            fold = is_float(info.dtype) and (plan.rule(t.name) == "average" or out_dtype != info.dtype)
            cuts = {c for i in sources for c in readers[i].breaks(t.name) if 0 < c < info.numel}
            if info.numel < MIN_PIECE_ELEMS * (len(cuts) + 1):
                cuts = set()
            edges = [0, *sorted(cuts), max(info.numel, 1)]
            for lo, hi in itertools.pairwise(edges):
                for start in range(lo, hi, step):
                    yield _Chunk(s, t.name, start, min(start + step, hi, info.numel), sources, weights, fold)


MIN_PIECE_ELEMS = 2**18
"""Pieces of an input's tensor (``Reader.breaks``) smaller than this on average are read joined (see ``_chunks``)."""


class _Release:
    """An output buffer that the writer and the hasher thread both read: back to the pool once both are done."""

    def __init__(self, buf: torch.Tensor, pool: queue.Queue[torch.Tensor], users: int = 2) -> None:
        self._buf = buf
        self._pool = pool
        self._users = users
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self._pool.put(self._buf)


_Hashed = tuple[int, memoryview, _Release | None]
"""For the hasher: a chunk's shard (its index in the plan), its bytes, and the buffer to release after them."""

_Item = tuple[int, str, torch.Tensor, _Release | None]
"""For the writer: a chunk's shard (its index in the plan), its tensor's name, its values and its buffer."""


class _Hasher:
    """Checksums the output shards on a thread of its own, beside the writer thread rather than after each write.

    hashlib lets go of the GIL while it hashes a large buffer, so the writer's time per chunk is the longer of
    writing and hashing it rather than their sum (on a 16-core node the writer thread was the merge's bottleneck:
    write 1.29 s + sha256 1.45 s). Chunks come in file order, the very bytes the writer appends; a shard's digest
    covers its header (``header_bytes``, as ``ShardWriter`` writes it) and then its chunks.
    """

    def __init__(self, plan: MergePlan) -> None:
        self._plan = plan
        self._todo: queue.Queue[_Hashed | None] = queue.Queue()
        self._digests: dict[int, Future[tuple[str, int]]] = {}
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.aborted = False
        self._thread = threading.Thread(target=self._run, name="pmakit-sha256", daemon=True)
        self._thread.start()

    def put(self, item: _Hashed | None) -> None:
        """The next chunk (None: the end)."""
        self._todo.put(item)

    def digest(self, shard: int) -> tuple[str, int]:
        """Shard ``shard``'s sha256 and the bytes it covers, once every chunk of it is hashed (waits)."""
        future = self._future(shard)
        while True:
            if self.error is not None:
                raise self.error
            if self.aborted and not future.done():  # the merge stopped: no more chunks are hashed
                raise RuntimeError("the merge was stopped before its checksums were complete")
            with contextlib.suppress(FutureTimeout):
                return future.result(timeout=0.1)

    def join(self) -> None:
        self._thread.join(timeout=30)

    def _future(self, shard: int) -> Future[tuple[str, int]]:
        with self._lock:
            return self._digests.setdefault(shard, Future())

    def _run(self) -> None:
        stats, cpu = _STATS, time.thread_time()
        busy = [0.0]
        item: _Hashed | None = None
        try:
            self._hash_all(busy)
        except BaseException as e:
            self.error = e
            while (item := self._todo.get()) is not None:  # the buffers still go back: nothing blocks on them
                if item[2] is not None:
                    item[2].done()
        finally:
            if stats is not None:
                stats.add(sha256=busy[0], hasher_cpu=time.thread_time() - cpu)

    def _hash_all(self, busy: list[float]) -> None:
        shard, h, size = -1, hashlib.sha256(), 0
        while (item := self._todo.get()) is not None:
            index, data, release = item
            try:
                if self.aborted:
                    continue
                if index != shard:
                    if shard >= 0:
                        self._future(shard).set_result((h.hexdigest(), size))
                    header = header_bytes(self._plan.shards[index].tensors)
                    shard, h, size = index, hashlib.sha256(header), len(header)
                start = time.perf_counter()
                h.update(data)
                busy[0] += time.perf_counter() - start
                size += len(data)
            finally:
                if release is not None:
                    release.done()
        if shard >= 0 and not self.aborted:
            self._future(shard).set_result((h.hexdigest(), size))


class _Writer:
    """Writes output chunks on a background thread, so that the accumulation never waits on it, and has them
    checksummed on another (``_Hasher``) at the same time.

    Chunks are handed over in plan order with the buffer they live in; the buffer goes back to the pool once its
    bytes are in the file and hashed. At most ``len(pool)`` chunks are in flight.
    """

    def __init__(
        self,
        plan: MergePlan,
        directory: Path,
        buffer_bytes: int,
        n_buffers: int,
        fsync: bool,
        pin: bool = False,
        cached: bool = False,
    ) -> None:
        self._plan = plan
        self._directory = directory
        self._fsync = fsync
        self._direct = not cached
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        for _ in range(n_buffers):  # pinned: the GPU copies the sums back into them without a staging copy
            self.free.put(torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin))
        self._todo: queue.Queue[_Item | None] = queue.Queue()
        self.files: list[dict[str, Any]] = []
        self._error: BaseException | None = None
        self._aborted = False
        self._busy = 0.0  # writing, closing, waiting for checksums: seconds (for MergeStats.wait_chunk)
        self._hasher = _Hasher(plan)
        self._thread = threading.Thread(target=self._run, name="pmakit-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        stats, start, cpu = _STATS, time.perf_counter(), time.thread_time()
        try:
            self._write_all()
        finally:
            if stats is not None:  # idle: the thread's life minus its work (timed in _close)
                idle = time.perf_counter() - start - self._busy
                stats.add(wait_chunk=idle, writer_cpu=time.thread_time() - cpu)

    def _write_all(self) -> None:
        writer: ShardWriter | None = None
        item: _Item | None = None
        index = -1
        try:
            while (item := self._todo.get()) is not None:
                if self._aborted:
                    continue
                shard_index, name, chunk, release = item
                shard = self._plan.shards[shard_index]
                if writer is None or writer.shard is not shard:
                    if writer is not None:
                        self.files.append(self._close(writer, index))
                    writer = ShardWriter(
                        self._directory / shard.file, shard, direct=self._direct, checksum=False
                    )
                    index = shard_index
                writer.write(name, chunk)
                if release is not None:
                    release.done()
                if self._fsync:
                    writer.start_writeback()  # overlap the disk writes with the merge, not after it
            if writer is not None and self._aborted:
                writer.abort()
            elif writer is not None:
                self.files.append(self._close(writer, index))
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
                    item[3].done()

    def _close(self, writer: ShardWriter, index: int) -> dict[str, Any]:
        """Finish shard ``index``: its name, size and sha256 (the hasher's, of as many bytes as the file has)."""
        start = time.perf_counter()
        writer.finish(self._fsync)  # first: the size is only final once the file is flushed
        closed = time.perf_counter()
        sha256, hashed = self._hasher.digest(index)
        waited = time.perf_counter() - closed
        size = writer.path.stat().st_size
        if hashed != size:
            raise RuntimeError(f"{writer.path}: {size} bytes written, {hashed} checksummed")
        self._busy += closed - start + writer.write_seconds + waited
        if _STATS is not None:
            _STATS.add(write=writer.write_seconds, close=closed - start, wait_hash=waited)
        return {"name": writer.path.name, "size": size, "sha256": sha256}

    def buffer(self) -> torch.Tensor:
        """A free output buffer (waits for the writer to finish one); raises the writer's error if it failed."""
        while True:
            self.check()
            with contextlib.suppress(queue.Empty):
                return self.free.get(timeout=0.1)

    def put(self, shard: int, name: str, chunk: torch.Tensor, buf: torch.Tensor | None) -> None:
        """Chunk ``chunk`` of tensor ``name`` next into shard ``shard``; ``buf`` (the buffer it lives in, if one
        of the pool's) goes back to the pool once the chunk is written and hashed."""
        self.check()
        release = _Release(buf, self.free) if buf is not None else None
        # The hasher first: a shard's last chunk is queued for it before the writer can wait for its digest.
        data = memoryview(chunk.contiguous().view(torch.uint8).numpy())  # type: ignore[arg-type]
        self._hasher.put((shard, data, release))
        self._todo.put((shard, name, chunk, release))

    def check(self) -> None:
        if self._error is not None:
            raise self._error
        if self._hasher.error is not None:
            raise self._hasher.error

    def finish(self) -> list[dict[str, Any]]:
        """Wait for every chunk to be written and hashed; the output files' names, sizes and sha256."""
        self._hasher.put(None)
        self._todo.put(None)
        self._thread.join()
        self._hasher.join()
        self.check()
        return self.files

    def abort(self) -> None:
        """Stop writing: chunks still queued are dropped and the open shard is closed unfinished. Both threads are
        done with the chunks' bytes when this returns (some are views of the inputs, unmapped next)."""
        self._aborted = True
        self._hasher.aborted = True
        self._hasher.put(None)
        self._todo.put(None)
        self._thread.join(timeout=30)
        self._hasher.join()


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


def _fold(
    views: Sequence[torch.Tensor],
    weights: Sequence[float],
    out: torch.Tensor,
    scratch: tuple[torch.Tensor, torch.Tensor],
    seconds: list[float] | None = None,
) -> bool:
    """``out = sum(w * v)`` with fp32 accumulation, one cache-sized block at a time; False if it is not finite.

    A block's accumulator and conversion buffer stay in the core's cache while all N inputs fold into it, so memory
    traffic is just each input read once and the output written once (a whole chunk's fp32 sum would instead go to
    memory and back N times). A NaN or Inf in any input makes the sum non-finite: summing each block while it is
    in cache is one cheap reduction instead of N checks. ``seconds`` (when timed): [accumulating, casting] are
    added to.
    """
    acc, tmp = scratch
    fp32_out = out.dtype == torch.float32
    limit = _square_limit(out.dtype)
    total = 0.0
    clock = time.perf_counter if seconds is not None else _no_clock
    for start in range(0, out.numel(), BLOCK_ELEMS):
        stop = min(start + BLOCK_ELEMS, out.numel())
        began = clock()
        a = out[start:stop] if fp32_out else acc[: stop - start]
        for k, (view, weight) in enumerate(zip(views, weights)):
            values = view[start:stop]
            if values.dtype != torch.float32:
                values = tmp[: stop - start].copy_(values)
            if k == 0:
                torch.mul(values, weight, out=a)
            else:
                a.add_(values, alpha=weight)
        folded = clock()
        if fp32_out:
            total += a.sum().item()
        else:
            total += _cast_checked(a, out[start:stop], limit)
        if seconds is not None:
            seconds[0] += folded - began
            seconds[1] += clock() - folded
    return math.isfinite(total)


def _square_limit(dtype: torch.dtype) -> float:
    """Half the square of ``dtype``'s largest value (inf where that exceeds a float): see ``_cast_checked``."""
    biggest = torch.finfo(dtype).max
    return biggest * biggest / 2


def _cast_checked(acc: torch.Tensor, out: torch.Tensor, limit: float) -> float:
    """Cast the fp32 block ``acc`` into ``out``; a number that is finite iff ``out`` is.

    Usually decided on ``acc`` while it is in cache: a sum of squares below ``limit`` (half the output dtype's
    largest value squared: a margin far above fp32 rounding) bounds every value below that largest value, so the
    cast is finite, and a NaN or Inf would have made the sum NaN or Inf. That fp32 dot product costs a third of
    summing the cast block; the exact check (a value beyond fp16's range becomes Inf only in the cast) runs when
    the bound does not hold.
    """
    out.copy_(acc)
    if acc.dot(acc).item() < limit:
        return 0.0
    return out.sum(dtype=torch.float32).item()


def _no_clock() -> float:
    return 0.0


class _Ready:
    """Stands in for a CUDA event where the staged fold runs on the CPU: everything is done when it is issued."""

    def record(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None


@dataclass
class _Slot:
    """One input chunk's way to the device: a (pinned) host buffer, its device twin, and when each is free."""

    host: torch.Tensor
    device: torch.Tensor
    copied: Any
    """Recorded on the copy stream after the host buffer's bytes went over: the host buffer may be refilled."""
    folded: Any
    """Recorded on the fold stream after the device buffer was folded: the device buffer may be overwritten."""


class _DeviceFold:
    """``--device cuda``: the fp32 sum on the accelerator, fed so that reading, copying and folding overlap.

    A worker thread copies each input chunk from the page cache into a pinned, reused host buffer (the only CPU
    work), queues its copy to the device on a side stream (``non_blocking``), and queues the fold of it on the
    fold stream behind that copy; meanwhile it fills the next free buffer. Twice as many buffers as workers: a
    worker always has one to fill while its last one is on its way. The cast sum goes back into the writer's
    pinned buffer, and the worker waits only for that. On the CPU (tests) the same steps run with plain memory and
    no streams, so that the logic is checked where there is no GPU.
    """

    def __init__(self, device: torch.device, slot_bytes: int, out_bytes: int, slots: int) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._out_bytes = out_bytes
        self._copy = torch.cuda.Stream(device) if self.cuda else None
        self._fold = torch.cuda.Stream(device) if self.cuda else None
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(slots):
            host = torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=self.cuda)
            dev = torch.empty(slot_bytes, dtype=torch.uint8, device=device)
            self._free.put(_Slot(host, dev, self._event(blocking=True), self._event()))
        self._local = threading.local()

    def _event(self, blocking: bool = False) -> Any:
        """A CUDA event; ``blocking``: a thread that waits for it sleeps rather than spins (the cores it would
        spin on copy other workers' chunks)."""
        return torch.cuda.Event(blocking=blocking) if self.cuda else _Ready()

    def _on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def _worker(self) -> threading.local:
        """This thread's device accumulator, cast output and NaN/Inf flag (made on first use)."""
        local = self._local
        if not hasattr(local, "acc"):
            if self.cuda:
                torch.cuda.set_device(self.device)  # the current device is per thread
            elems = self._out_bytes // 4
            local.acc = torch.empty(elems, dtype=torch.float32, device=self.device)
            local.out = torch.empty(self._out_bytes, dtype=torch.uint8, device=self.device)
            local.flag = torch.empty(1, dtype=torch.bool, pin_memory=self.cuda)
            local.done = self._event(blocking=True)
        return local

    def fold(self, views: Sequence[torch.Tensor], weights: Sequence[float], out: torch.Tensor) -> bool:
        """``out = sum(w * v)`` in fp32 on the device, cast to ``out``'s dtype; whether it is finite."""
        n = out.numel()
        if n == 0:
            return True
        local = self._worker()
        acc = local.acc[:n]
        with self._on(self._fold):
            acc.zero_()
        for view, weight in zip(views, weights):
            self._fold_one(view, weight, acc)
        with self._on(self._fold):
            cast = acc if out.dtype == torch.float32 else local.out[: out.nbytes].view(out.dtype).copy_(acc)
            finite = torch.isfinite(cast).all()  # after the cast: a sum beyond fp16's range is Inf only there
            local.flag.copy_(finite.reshape(1), non_blocking=True)
            out.copy_(cast, non_blocking=True)
            local.done.record()
        local.done.synchronize()
        return bool(local.flag.item())

    def _fold_one(self, view: torch.Tensor, weight: float, acc: torch.Tensor) -> None:
        slot = self._free.get()
        try:
            nbytes = view.numel() * view.element_size()
            slot.copied.synchronize()  # the buffer's last bytes are on the device
            host = slot.host[:nbytes].view(view.dtype).copy_(view)  # page cache -> pinned: the CPU's share
            dev = slot.device[:nbytes].view(view.dtype)
            with self._on(self._copy):
                if self._copy is not None:
                    self._copy.wait_event(slot.folded)  # the device buffer's last chunk is folded
                dev.copy_(host, non_blocking=True)
                slot.copied.record()
            with self._on(self._fold):
                if self._fold is not None:
                    self._fold.wait_event(slot.copied)
                acc.add_(dev, alpha=weight)  # in fp32: the accumulator's dtype wins
                slot.folded.record()
        finally:
            self._free.put(slot)


def stream_average(
    plan: MergePlan,
    readers: Sequence[Reader],
    directory: Path,
    progress: Callable[[int], None] | None,
    fsync: bool,
    device: str = "cpu",
    staged: bool | None = None,
    cached: bool = False,
) -> list[dict[str, Any]]:
    """Write every shard of ``plan`` into ``directory``; returns the output files' names, sizes and sha256.

    The shards are written with O_DIRECT (a merge's output is not read again by it: the page cache stays the
    inputs'), or through the page cache with ``cached``: files read back at once (the staged shards a framework
    layout's writer rewrites), which then come from memory rather than from storage.

    Worker threads fold chunks side by side (torch releases the GIL in its kernels): every input's bytes (views of
    the page cache) are converted to fp32 and added with their weight block by block, cast once into an output
    buffer, and the chunk is checked for NaN/Inf. This thread asks the kernel to read ahead of the workers and hands
    finished chunks, in order, to the writer thread. Threads of our own rather than torch's intra-op pool: its
    threads wait for each other at every op and stall whenever another process holds a core.

    On another ``device`` (``cuda``) the workers feed the device instead (``_DeviceFold``). ``staged`` runs that
    path on the CPU too, with plain memory (for tests; default: for every device but the CPU).
    """
    folder = None
    if staged or (staged is None and device != "cpu"):
        folder = _device_fold(plan, readers, torch.device(device))
    with _Clock("wall"):  # the pass, from the writer thread's start to its end
        return _stream(plan, readers, directory, progress, fsync, folder, cached)


def _device_fold(plan: MergePlan, readers: Sequence[Reader], device: torch.device) -> _DeviceFold:
    """Two staging buffers a worker, each a chunk of the widest input dtype."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    widest = max([2] + [i.dtype.itemsize for r in readers for i in r.tensors.values() if is_float(i.dtype)])
    return _DeviceFold(device, plan.chunk_elems * widest, plan.buffer_bytes, 2 * plan.fold.workers)


def _stream(
    plan: MergePlan,
    readers: Sequence[Reader],
    directory: Path,
    progress: Callable[[int], None] | None,
    fsync: bool,
    folder: _DeviceFold | None,
    cached: bool,
) -> list[dict[str, Any]]:
    chunks = list(_chunks(plan, readers))
    pin = folder is not None and folder.cuda
    writer = _Writer(plan, directory, plan.buffer_bytes, plan.n_buffers, fsync, pin, cached)
    local = threading.local()

    def work(chunk: _Chunk, views: list[torch.Tensor], buf: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return _fold_chunk(plan, chunk, views, buf, folder, local)

    workers = plan.fold.workers
    pool = ThreadPoolExecutor(workers, thread_name_prefix="pmakit-fold")
    pending: collections.deque[_Pending] = collections.deque()

    def hand_over() -> None:
        _hand_over(pending.popleft(), plan, readers, writer, progress)

    # Each chunk makes thousands of short-lived tensor views; reference counting frees them, but their allocations
    # would trigger collections that walk every object torch created at import (5% of a merge's CPU).
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i, chunk in enumerate(chunks):
            with _Clock("read"):
                _prefetch(readers, chunks, i, plan.fold.read_ahead)
            while len(pending) >= workers:
                hand_over()
            # Reads stay on this thread and in order: a reader may load (not map) and expect to move forward.
            with _Clock("read"):
                views = [readers[src].read(chunk.name, chunk.start, chunk.stop) for src in chunk.sources]
            if not chunk.average:
                done: Future[tuple[torch.Tensor, bool]] = Future()
                done.set_result((views[0], True))
                pending.append((chunk, done, None))
            else:
                with _Clock("wait_buffer"):
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


_Pending = tuple[_Chunk, Future[tuple[torch.Tensor, bool]], torch.Tensor | None]
"""A chunk handed to the workers: its (output, finite) result and the output buffer it holds (None: passed as
read)."""


def _prefetch(readers: Sequence[Reader], chunks: Sequence[_Chunk], i: int, distance: int) -> None:
    """Keep the disk ``distance`` chunks ahead of the workers (at chunk ``i``: hint the one coming in)."""
    for ahead in chunks[: 1 + distance] if i == 0 else chunks[i + distance :][:1]:
        for src in ahead.sources:
            readers[src].prefetch(ahead.name, ahead.start, ahead.stop)


def _fold_chunk(
    plan: MergePlan,
    chunk: _Chunk,
    views: list[torch.Tensor],
    buf: torch.Tensor,
    folder: _DeviceFold | None,
    local: threading.local,
) -> tuple[torch.Tensor, bool]:
    """A worker's job: the weighted sum of ``chunk``'s input ``views`` into ``buf`` (as the output dtype), and
    whether it is finite. ``local`` holds the worker thread's own cache-sized scratch buffers."""
    if not hasattr(local, "scratch"):
        local.scratch = (torch.empty(BLOCK_ELEMS), torch.empty(BLOCK_ELEMS))
    out_dtype = plan.tensors[chunk.name][1]
    out = buf[: (chunk.stop - chunk.start) * out_dtype.itemsize].view(out_dtype)
    weights = chunk.weights
    if folder is not None:
        return out, folder.fold(views, weights, out)
    stats = _STATS
    if stats is None:
        return out, _fold(views, weights, out, local.scratch)
    seconds, cpu, faults = [0.0, 0.0], time.thread_time(), _faults()
    finite = _fold(views, weights, out, local.scratch, seconds)
    minor, major = (after - before for after, before in zip(_faults(), faults))
    stats.add(
        accumulate=seconds[0], cast=seconds[1], fold_cpu=time.thread_time() - cpu, minor_faults=minor,
        major_faults=major, chunks=1,
    )  # fmt: skip
    return out, finite


def _faults() -> tuple[int, int]:
    """This thread's page faults so far: (minor, major); zeros where the OS does not count them per thread."""
    if not hasattr(resource, "RUSAGE_THREAD"):
        return 0, 0
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_minflt, usage.ru_majflt


def _hand_over(
    pending: _Pending,
    plan: MergePlan,
    readers: Sequence[Reader],
    writer: _Writer,
    progress: Callable[[int], None] | None,
) -> None:
    """The oldest chunk's result, checked for NaN/Inf (naming the input that has them), to the writer thread."""
    chunk, result, buf = pending
    with _Clock("wait_fold"):
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
