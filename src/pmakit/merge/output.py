"""Where a merge is written and how it becomes final: the hidden partial directory, the resume ledger (each finished
shard recorded with its sha256 in ``.pmakit-progress/``), rank staging, the layout writers, the manifest, and the
rename into place once everything is on disk."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import pmakit
from pmakit.checksums import sha256_file
from pmakit.errors import Interrupted, PmakitError, redact
from pmakit.formats import Reader
from pmakit.formats.safetensors_io import write_index
from pmakit.layouts import layout_of, open_weights, writer
from pmakit.layouts.kinds import listing
from pmakit.merge._faults import Killer
from pmakit.merge.plan import MergePlan
from pmakit.merge.stream import stream_average
from pmakit.runs import atomic_write_text, fsync_dir, replace_dir, resolves_inside
from pmakit.snapshot import MERGE_MANIFEST, METADATA_FILE, Snapshot
from pmakit.storage.mirror import origin
from pmakit.units import format_bytes
from pmakit.world import World

log = logging.getLogger(__name__)

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


def partial_dir(out: Path) -> Path:
    """Where a merge into ``out`` is built before it is renamed into place."""
    return out.parent / f".{out.name}.pmakit-partial"


def copy_extras(source: Path, target: Path) -> list[str]:
    """Config, tokenizer and other small non-weight files of the newest snapshot.

    Never copied: weights and trainer state, the files that mark a checkpoint of the input's layout (its
    ``own_files``: Megatron's ``metadata.json`` beside HF safetensors would claim a format the output is not; a
    layout that writes itself back writes them), and links that lead out of the snapshot (a ``tokenizer.json``
    linked to a file elsewhere would carry that file into the output): those are named in a warning.
    """
    if not source.is_dir():
        return []  # a checkpoint that is one file (Lightning's .ckpt): nothing beside it is its own
    layout = layout_of(source)
    own = layout.own_files if layout is not None else ()
    copied = []
    for f in sorted(source.iterdir()):
        if (
            not f.is_file()
            or f.name.startswith(".")
            or f.name.startswith(_NOT_COPIED_NAMES)
            or f.suffix in _NOT_COPIED_SUFFIXES
            or f.name in own
        ):
            continue
        if not resolves_inside(f, source):  # a link, or a link to a directory on the way
            log.warning("not copying %s: a link to %s, outside the snapshot", f, f.resolve())
            continue
        shutil.copy2(f, target / f.name)
        copied.append(f.name)
    return copied


def manifest_record(
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
        "inputs": input_records(plan.snapshots, plan.weights, readers),
        "skipped_entries": plan.skipped,
        "buffers": plan.buffers,
        "tensor_kinds": listing(plan.kinds, plan.buffers),
        **({"precision": plan.precision()} if plan.precisions else {}),
        "output": {"files": files, "copied": copied, "total_bytes": plan.output_bytes},
    }


FP32_DIR = "pmakit-fp32"
"""Inside a merge made with ``keep_fp32``: the fp32 sums (HF layout) that an incremental update starts from."""
PROGRESS_DIR = ".pmakit-progress"
"""Inside the partial directory: the plan's fingerprint and one checksum record per finished shard."""


class Ledger:
    """What an interrupted merge finished: one checksum record per shard, written once the shard is on disk."""

    def __init__(self, partial: Path) -> None:
        self.partial = partial
        self.dir = partial / PROGRESS_DIR

    def _file(self, rel: str) -> Path:
        return self.dir / (rel.replace("/", "__") + ".json")

    def start(self, fingerprint: str) -> None:
        self.dir.mkdir(parents=True)
        atomic_write_text(self.dir / "plan.json", json.dumps({"fingerprint": fingerprint}))

    def begun(self) -> bool:
        """Whether the merge recorded its plan or wrote anything: a partial directory without either was stopped as
        it began (killed between making the directory and recording the plan), and holds no work to keep."""
        if (self.dir / "plan.json").exists():
            return True
        return any(p.name != PROGRESS_DIR for p in self.partial.iterdir())

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
        atomic_write_text(self._file(rel), json.dumps(info))

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
            and sha256_file(path) == record["sha256"]
        ):
            return True
        log.warning("%s was recorded as finished but does not match its checksum; writing it again", path)
        return False


def write_pass(
    plan: MergePlan,
    readers: Sequence[Reader],
    partial: Path,
    sub: str,
    world: World,
    progress: Callable[[int], None] | None,
    fsync: bool,
    killer: Killer,
    cached: bool = False,
) -> None:
    """Write the shards of ``plan`` this rank owns into ``partial/sub``, skipping those already finished.
    ``cached``: they are read back at once (a layout's writer or the cast pass rewrites them): written through the
    page cache, so that the rewrite reads them from memory, not again from storage."""
    directory = partial / sub
    directory.mkdir(exist_ok=True)
    prog = Ledger(partial)
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

        files = stream_average(
            replace(plan, shards=[shard]), readers, directory, report, fsync, world.device, cached=cached
        )
        prog.record(rel, files[0])
        killer.shards += 1
        killer.at("after-shard")


def merge_fingerprint(plan: MergePlan, readers: Sequence[Reader], **options: Any) -> str:
    """Identifies a merge: its inputs (paths and header checksums), weights, output layout and options."""
    record = {
        "inputs": [origin(s.path) for s in plan.snapshots],
        "files": [[vars(f) for f in r.files] for r in readers],
        "weights": plan.weights,
        "shards": [[s.file, [(t.name, str(t.dtype), list(t.shape)) for t in s.tensors]] for s in plan.shards],
        "owners": list(plan.owners),
        "buffers": plan.buffers,
        **options,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def prepare_output(
    out: Path, partial: Path, plan: MergePlan, fingerprint: str, force: bool, resume: bool, extra: int = 0
) -> None:
    """Rank 0: check the target, then create the partial directory or take over an interrupted one.

    An interrupted merge of the very same inputs and options is continued without being asked (the same command
    run again after a kill); ``--force`` starts over. ``extra``: bytes written beside the output (fp32 sums)."""
    if out.exists() and not force:
        raise PmakitError(f"{out} exists; pass --force to replace it")
    if partial.exists():
        ledger = Ledger(partial)
        if (resume or not force) and ledger.begun():
            ledger.check(fingerprint)
            log.warning("continuing the interrupted merge in %s (same inputs and options)", partial)
            return
        if not force:
            log.info("%s was stopped before it recorded its plan (nothing to keep); starting again", partial)
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
    Ledger(partial).start(fingerprint)


def run_stage(world: World, out: Path, fn: Callable[[], Any], rank0: bool = False) -> Any:
    """Run ``fn`` on every rank (or on rank 0 only), then agree: if any rank failed, every rank raises (its own
    error, or a pointer to the rank that has it), an ``Interrupted`` one where no rank failed but one was cut (a
    store that stopped answering: the merge's finished work is kept). Every rank passes the same stages in the
    same order."""
    error: BaseException | None = None
    result = None
    try:
        if world.rank == 0 or not rank0:
            result = fn()
    except BaseException as e:
        error = e
    least = world.least(_DONE if error is None else _CUT if isinstance(error, INTERRUPTIONS) else _FAILED)
    if isinstance(error, OSError):
        where = f" ({error.filename})" if error.filename else ""  # which file: one an input lacks, say
        raise PmakitError(
            f"writing {out} failed: {error.strerror or error}{where}"
            + (" (disk full)" if error.errno == 28 else "")
        ) from error
    if error is not None:
        raise error
    if least == _CUT:
        raise Interrupted("the merge was cut on another rank (its error is in that rank's output)")
    if least == _FAILED:
        raise PmakitError("the merge failed on another rank (its error is in that rank's output)")
    return result


INTERRUPTIONS = (KeyboardInterrupt, SystemExit, Interrupted)
"""Stops from outside (Ctrl-C, SIGTERM, a lost rank, a store that stopped answering): a merge keeps its work."""
_FAILED, _CUT, _DONE = 0, 1, 2
"""What a rank says of a stage (``run_stage``): the least of them over the ranks is the stage's outcome."""


def write_layout(plan: MergePlan, partial: Path, world: World, fsync: bool, out_format: str) -> list[str]:
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


def finish_output(
    plan: MergePlan,
    readers: Sequence[Reader],
    partial: Path,
    out: Path,
    written: list[str] | None,
    fsync: bool,
    manifest: Callable[[list[dict[str, Any]], list[str]], dict[str, Any]],
    killer: Killer,
) -> dict[str, Any]:
    """Rank 0, once every shard is written: drop staged files, copy extras, write the manifest, rename.

    ``written``: the files a layout's writer made from the staged safetensors shards (None: the shards are the
    output)."""
    for reader in readers:  # every input byte is read: the inputs must still be what was opened
        reader.verify()
    prog = Ledger(partial)
    if written is not None:
        for s in plan.shards:
            (partial / s.file).unlink(missing_ok=True)
        (partial / "model.safetensors.index.json").unlink(missing_ok=True)
        files = [
            {"name": f, "size": (partial / f).stat().st_size, "sha256": sha256_file(partial / f)}
            for f in written
        ]
    else:
        write_index(partial, plan.shards)
        files = [prog.recorded(s.file) for s in plan.shards]
    copied = copy_extras(plan.snapshots[-1].path, partial)
    record = manifest(files, copied)
    (partial / MERGE_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
    if fsync:
        fsync_dir(partial)
    killer.at("before-rename")
    replace_dir(partial, out)
    # Only now: a kill before the rename must still find the progress record to resume from.
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    return record


def window_inputs(snapshots: Sequence[Snapshot], weights: Sequence[float]) -> list[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        return input_records(
            snapshots, weights, [stack.enter_context(open_weights(s.path)) for s in snapshots]
        )


def input_records(
    snapshots: Sequence[Snapshot], weights: Sequence[float], readers: Sequence[Reader]
) -> list[dict[str, Any]]:
    """A manifest's record of each input: where it is (credentials redacted), its step, tokens, weight, layout and
    files (the checksums a later ``--from-previous`` or ``verify`` compares)."""
    return [
        {
            "path": redact(origin(s.path)),
            "step": s.step,
            "tokens": s.tokens,
            "weight": w,
            "layout": s.layout,
            "format": r.format,
            "files": [vars(f) for f in r.files],
        }
        for s, w, r in zip(snapshots, weights, readers)
    ]


# ---------------------------------------------------------------------------------------------------------------
# Incremental updates: the merge of a moved window from the previous merge's fp32 sums
