"""Save a weights snapshot every V training tokens, off the training thread, in pmakit's snapshot format.

At the call the weights are copied to CPU (so training can go on and change them); a background thread writes them
into a hidden sibling ``.step-XXXXXXXX.pmakit-partial``: the safetensors file(s), the extra files (config,
tokenizer), then ``pmakit.json`` last, and renames the directory into place. A crash mid-write therefore leaves
only a hidden directory that ``pmakit merge`` never looks at; a visible ``step-XXXXXXXX`` is always complete.
With ``upload_to`` (an ``s3://`` or ``gs://`` URL), the same thread then uploads the complete snapshot there,
``pmakit.json`` last (``pmakit.storage.publish``), so that ``pmakit merge URL`` finds only complete snapshots.
Then the ``on_save`` callbacks run (e.g. ``OnlineAverager.update``), then retention deletes the oldest snapshots
(local copies only: the bucket keeps every snapshot).

At most one snapshot is in flight: a save waits for the previous write to finish before copying (the CPU copy is
the memory a save costs). An error of the background thread is raised by the next ``maybe_save``/``save``/
``wait``/``close``.

Tied weights (two names for one tensor, as HF's ``tie_word_embeddings`` makes them) are saved once, under the first
name of the state dict, the way ``save_pretrained`` does; ``pmakit.json`` lists the dropped aliases under "tied".
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.formats.safetensors_io import OutputTensor, ShardWriter, plan_shards, write_index
from pmakit.runs import SNAPSHOT_NAME, fsync_dir, replace_dir, snapshot_name
from pmakit.snapshot import METADATA_FILE, Snapshot, write_metadata

log = logging.getLogger(__name__)

PARTIAL_SUFFIX = ".pmakit-partial"
_ALIGN = 64
OnSave = Callable[[Snapshot, dict[str, torch.Tensor]], None]


def alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Equal for two tensors that are the same view of the same storage (tied weights)."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def drop_aliases(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The entries of ``state`` without aliases: (tensors, {dropped alias: kept name}).

    Two entries are aliases when they are the same view of the same storage (tied embeddings); the first name in
    state-dict order is kept, as ``torch.nn.Module.named_parameters`` and HF ``save_pretrained`` do.
    """
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            raise PmakitError(f"state entry {name!r} is a {type(t).__name__}, not a tensor")
        key = alias_key(t)
        if t.numel() > 0 and key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        out[name] = t
    return out, tied


def cpu_copy(
    state: nn.Module | Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A detached CPU copy of a model's state dict without aliases: (tensors, {dropped alias: kept name}).

    ``dtype`` casts floating-point tensors (e.g. to save bf16 snapshots of fp32 weights).
    """
    if isinstance(state, nn.Module):
        state = state.state_dict()
    kept, tied = drop_aliases(state)
    targets = {k: dtype if dtype is not None and t.is_floating_point() else t.dtype for k, t in kept.items()}
    offsets, total = {}, 0
    for name, t in kept.items():
        offsets[name] = total
        total += -(-t.numel() * targets[name].itemsize // _ALIGN) * _ALIGN
    # One allocation for the whole copy: a block that large is mmapped by malloc and goes back to the OS when the
    # snapshot is freed, where thousands of tensor-sized blocks would stay in the heap (glibc's adaptive mmap
    # threshold) and grow the process by a snapshot or two.
    # From a GPU the block is pinned and the copies are asynchronous on a side stream that first waits for the
    # compute stream: the training thread only enqueues them, and ``ready`` (a CUDA event) tells the writer thread
    # when the bytes are on the host.
    on_gpu = any(t.is_cuda for t in kept.values())
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=on_gpu)
    out = {}
    with _copy_stream(on_gpu) as stream:
        for name, t in kept.items():
            nbytes = t.numel() * targets[name].itemsize
            view = buffer[offsets[name] : offsets[name] + nbytes].view(targets[name]).view(t.shape)
            out[name] = view.copy_(t.detach(), non_blocking=on_gpu)
    if stream is not None:
        ready = torch.cuda.Event()
        ready.record(stream)
        # The next optimizer step must not overwrite weights the copy has not read yet: the compute stream waits
        # for it on the device (the training thread does not block).
        torch.cuda.current_stream().wait_event(ready)
        _READY[buffer.data_ptr()] = ready
    return out, tied


# Host buffers still being filled by an asynchronous device-to-host copy, by address: the writer thread waits on
# the event before it reads (``wait_until_on_host``).
_READY: dict[int, Any] = {}


@contextmanager
def _copy_stream(on_gpu: bool) -> Iterator[Any]:
    """A CUDA side stream ordered after the current one, made current for the copies (None on the CPU)."""
    if not on_gpu:
        yield None
        return
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield stream


def wait_until_on_host(state: Mapping[str, torch.Tensor]) -> None:
    """Block until an asynchronous GPU-to-host ``cpu_copy`` of ``state`` has landed (no-op for CPU copies)."""
    for t in state.values():
        ready = _READY.pop(t.untyped_storage().data_ptr(), None)
        if ready is not None:
            ready.synchronize()


def write_safetensors(
    directory: Path, tensors: Mapping[str, torch.Tensor], *, max_shard_size: int, fsync: bool
) -> None:
    """``model.safetensors`` (or HF shards + index) with ``{"format": "pt"}`` metadata, as ``from_pretrained`` wants."""
    items = [OutputTensor(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    shards = plan_shards(items, max_shard_size)
    for shard in shards:
        writer = ShardWriter(directory / shard.file, shard)
        try:
            for t in shard.tensors:
                writer.write(t.name, tensors[t.name].reshape(-1))
        except BaseException:
            writer.abort()
            raise
        writer.close(fsync=fsync)
    write_index(directory, shards)


def is_saver_snapshot(path: Path) -> bool:
    """A complete snapshot this saver may delete: named ``step-XXXXXXXX`` and with a readable ``pmakit.json``."""
    if not (path.is_dir() and not path.is_symlink() and SNAPSHOT_NAME.match(path.name)):
        return False
    try:
        meta = json.loads((path / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and isinstance(meta.get("tokens"), int)


@dataclass
class SaverTimings:
    """In-process timers of a ``SnapshotSaver`` (seconds, summed over its saves).

    ``caller_seconds`` is what training waits for: wall time inside ``maybe_save`` when a save is due. Of it,
    ``copy_seconds`` is the copy off the model (from a GPU: enqueueing the asynchronous copies) and
    ``wait_seconds`` the wait for a previous write still in flight (non-zero when V is shorter than a write).
    ``writer_cpu_seconds`` is the writer thread's own CPU time (serialising, writing, fsync, and the ``on_save``
    callbacks such as the online averager's update), which competes with training for cores;
    ``callback_cpu_seconds`` is the callbacks' part of it. Without a background thread the write is in the call.
    """

    caller_seconds: float = 0.0
    copy_seconds: float = 0.0
    wait_seconds: float = 0.0
    writer_cpu_seconds: float = 0.0
    callback_cpu_seconds: float = 0.0
    saves: int = 0


class SnapshotSaver:
    """Writes ``directory/step-XXXXXXXX/`` snapshots every ``every_tokens`` training tokens.

    Args:
        directory: where the snapshot directories go (created if needed).
        every_tokens: V, the spacing in tokens. A save is due when a multiple of V has been crossed since the last
            save; a step that crosses several multiples saves once.
        keep_last: keep only the newest K snapshots of ``directory`` (None keeps all). Only complete
            ``step-XXXXXXXX`` directories with ``pmakit.json`` are ever deleted, after the new one is complete and
            after the ``on_save`` callbacks ran. An ``OnlineAverager`` that reads back from disk needs K >= its N.
        background: write on a background thread (False: write in the call).
        extra_files: files copied into every snapshot (config.json, tokenizer files), so that it loads with
            ``from_pretrained``.
        start_tokens: tokens already trained when resuming; the next save is at the next multiple of V above it.
        on_save: called with (snapshot, the CPU state dict that was written) once the snapshot is complete, on the
            writer thread. The state dict must not be modified.
        extra_text: files written into every snapshot from text, name -> content (e.g. an HF model's config.json).
        dtype: cast floating-point weights to this dtype in the snapshot (None: as they are).
        max_shard_size: bytes per safetensors file; larger states are sharded with an HF index.
        fsync: flush each snapshot to disk before it is renamed into place (survives power loss, not just crashes).
        tidy: remove the hidden leftovers of an interrupted save at start. False in a process that shares the
            directory with the one that writes (a model copy that is not the writer): a leftover there may be the
            writer's save in flight.
        upload_to: an ``s3://`` / ``gs://`` URL that every complete snapshot is also uploaded to (on the writer
            thread, ``pmakit.json`` last), as ``URL/step-XXXXXXXX``. Credentials and endpoint as for
            ``pmakit merge`` (see ``pmakit.storage``); an upload failure is raised like a write failure.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        every_tokens: int,
        *,
        keep_last: int | None = None,
        background: bool = True,
        extra_files: Sequence[str | os.PathLike[str]] = (),
        start_tokens: int = 0,
        on_save: Sequence[OnSave] = (),
        extra_text: Mapping[str, str] | None = None,
        dtype: torch.dtype | None = None,
        max_shard_size: int = 5 * 10**9,
        fsync: bool = True,
        tidy: bool = True,
        upload_to: str | None = None,
    ) -> None:
        from pmakit._env import warn_if_spinning

        warn_if_spinning()  # at the user's first call, where torch was imported before pmakit
        if every_tokens < 1:
            raise PmakitError(f"every_tokens must be a positive number of tokens, got {every_tokens}")
        if keep_last is not None and keep_last < 1:
            raise PmakitError(f"keep_last must be at least 1 (or None to keep all), got {keep_last}")
        if start_tokens < 0:
            raise PmakitError(f"start_tokens must be >= 0, got {start_tokens}")
        self.directory = Path(directory)
        self.every_tokens = every_tokens
        self.keep_last = keep_last
        self.background = background
        self.extra_files = [Path(f) for f in extra_files]
        for f in self.extra_files:
            if not f.is_file():
                raise PmakitError(
                    f"extra file {f} does not exist (extra_files are copied into every snapshot)"
                )
        self.extra_text = dict(extra_text or {})
        self.on_save = list(on_save)
        self.dtype = dtype
        self.max_shard_size = max_shard_size
        self.fsync = fsync
        self.upload_to = upload_to.rstrip("/") if upload_to else None
        if self.upload_to is not None:
            from pmakit.storage.registry import parse

            parse(self.upload_to)  # a malformed URL fails now, not in the first save
        self.last_mark = start_tokens // every_tokens
        """How many multiples of V had been crossed at the last save (or at the start)."""
        self.last_saved: Snapshot | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._error_path: Path | None = None
        self.timings = SaverTimings()
        """Where the saving time goes: the training thread's share and the writer thread's CPU."""
        self.directory.mkdir(parents=True, exist_ok=True)
        if tidy:
            self._remove_stale_partials()

    # -- when -------------------------------------------------------------------------------------------------

    def due(self, tokens: int) -> bool:
        """True when a multiple of ``every_tokens`` has been crossed since the last save."""
        return tokens // self.every_tokens > self.last_mark

    def maybe_save(
        self,
        model_or_state: nn.Module | Mapping[str, torch.Tensor],
        *,
        tokens: int,
        step: int,
        lr: float | None = None,
        loss: float | None = None,
        **meta: Any,
    ) -> Snapshot | None:
        """Save if ``due(tokens)``; the snapshot (complete once ``wait()`` returns or ``on_save`` fires), or None."""
        self._raise_error()
        if not self.due(tokens):
            return None
        start = time.perf_counter()
        try:
            return self.save(model_or_state, tokens=tokens, step=step, lr=lr, loss=loss, **meta)
        finally:
            self.timings.caller_seconds += time.perf_counter() - start

    def save(
        self,
        model_or_state: nn.Module | Mapping[str, torch.Tensor],
        *,
        tokens: int,
        step: int,
        lr: float | None = None,
        loss: float | None = None,
        **meta: Any,
    ) -> Snapshot:
        """Save now. The weights are copied before this returns; the write may still be running."""
        start = time.perf_counter()
        self.wait()  # one snapshot in flight at most; also raises the previous write's error
        copied = time.perf_counter()
        state, tied = cpu_copy(model_or_state, self.dtype)
        self.timings.wait_seconds += copied - start
        self.timings.copy_seconds += time.perf_counter() - copied
        path = self.directory / snapshot_name(step)
        if path.exists() and not is_saver_snapshot(path):
            raise PmakitError(f"{path} exists and is not a pmakit snapshot; refusing to replace it")
        record: dict[str, Any] = {**meta, "every_tokens": self.every_tokens}
        if tied:
            record["tied"] = tied
        snapshot = Snapshot(path, tokens=tokens, step=step, lr=lr, loss=loss, meta=record)
        self.last_mark = max(self.last_mark, tokens // self.every_tokens)
        self.last_saved = snapshot
        if self.background:
            thread = threading.Thread(target=self._write_guarded, args=(snapshot, state), name="pmakit-saver")
            thread.start()  # kept once started: a signal's SystemExit inside start() left a thread join() refused
            self._thread = thread
        else:
            wait_until_on_host(state)
            self._write(snapshot, state)
        return snapshot

    # -- how --------------------------------------------------------------------------------------------------

    def _write_guarded(self, snapshot: Snapshot, state: dict[str, torch.Tensor]) -> None:
        start = time.thread_time()
        try:
            wait_until_on_host(state)
            self._write(snapshot, state)
        except BaseException as e:
            self._error, self._error_path = e, snapshot.path
        finally:
            self.timings.writer_cpu_seconds += time.thread_time() - start

    def _write(self, snapshot: Snapshot, state: dict[str, torch.Tensor]) -> None:
        path = snapshot.path
        partial = path.parent / f".{path.name}{PARTIAL_SUFFIX}"
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        try:
            write_safetensors(partial, state, max_shard_size=self.max_shard_size, fsync=self.fsync)
            for f in self.extra_files:
                shutil.copy2(f, partial / f.name)
            for name, text in self.extra_text.items():
                (partial / name).write_text(text)
            assert snapshot.step is not None
            write_metadata(
                partial,
                step=snapshot.step,
                tokens=snapshot.tokens,
                lr=snapshot.lr,
                loss=snapshot.loss,
                **snapshot.meta,
            )
            if self.fsync:
                fsync_dir(partial)
            self._move_into_place(partial, path)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if self.upload_to is not None:
            from pmakit.storage.publish import publish

            publish(path, f"{self.upload_to}/{path.name}", METADATA_FILE, resume=False)
        start = time.thread_time()
        for callback in self.on_save:
            callback(snapshot, state)
        self.timings.callback_cpu_seconds += time.thread_time() - start
        self.timings.saves += 1
        self._apply_retention(keep=path)

    def _move_into_place(self, partial: Path, path: Path) -> None:
        """Rename ``partial`` to ``path``; an existing snapshot there (a re-run of that step) is replaced."""
        if path.exists():
            if not is_saver_snapshot(path):
                raise PmakitError(f"{path} exists and is not a pmakit snapshot; refusing to replace it")
            log.warning("replacing snapshot %s (the run went through this step again)", path)
        replace_dir(partial, path)
        if self.fsync:
            fsync_dir(path.parent)

    def _apply_retention(self, keep: Path) -> None:
        if self.keep_last is None:
            return
        mine = []
        for child in self.directory.iterdir():
            if is_saver_snapshot(child):
                tokens = json.loads((child / METADATA_FILE).read_text())["tokens"]
                mine.append((tokens, child.name, child))
        mine.sort()
        for _, _, child in mine[: max(0, len(mine) - self.keep_last)]:
            if child != keep:
                log.info("retention: removing %s", child)
                shutil.rmtree(child)

    def _remove_stale_partials(self) -> None:
        """Hidden leftovers of a crashed save (only names this saver makes)."""
        for child in self.directory.iterdir():
            name = child.name
            if (
                child.is_dir()
                and name.startswith(".step-")
                and (name.endswith(PARTIAL_SUFFIX) or name.endswith(".pmakit-old"))
            ):
                log.warning("removing %s, left by an interrupted save", child)
                shutil.rmtree(child, ignore_errors=True)

    # -- flushing and state ------------------------------------------------------------------------------------

    def _raise_error(self) -> None:
        if self._error is not None:
            error, path = self._error, self._error_path
            self._error = self._error_path = None
            if isinstance(error, PmakitError):
                raise error
            raise PmakitError(f"saving snapshot {path} failed: {type(error).__name__}: {error}") from error

    def wait(self) -> None:
        """Wait for the snapshot being written (and its callbacks); raise the error of a failed write."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def close(self) -> None:
        """Flush; the saver can still be used afterwards (there is no thread to stop between saves)."""
        self.wait()

    def __enter__(self) -> SnapshotSaver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to save at the same token counts (plain JSON-able values).

        Waits for the write in flight first, so that a checkpoint taken now never records a save whose snapshot
        (and ``on_save`` callbacks, e.g. the averager's update) might not have happened.
        """
        self.wait()
        last = self.last_saved
        return {
            "every_tokens": self.every_tokens,
            "last_mark": self.last_mark,
            "last_saved": None
            if last is None
            else {"path": str(last.path), "tokens": last.tokens, "step": last.step},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("every_tokens") != self.every_tokens:
            log.warning(
                "resuming with every_tokens=%s, the saved run used %s; the next save is at the next multiple",
                self.every_tokens,
                state.get("every_tokens"),
            )
            last = state.get("last_saved")
            self.last_mark = (last["tokens"] if last else 0) // self.every_tokens
        else:
            self.last_mark = int(state["last_mark"])
        last = state.get("last_saved")
        if last:
            self.last_saved = Snapshot(Path(last["path"]), tokens=last["tokens"], step=last["step"])
