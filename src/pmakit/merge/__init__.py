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

import contextlib
import logging
import os
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.formats import Reader, is_float
from pmakit.formats.safetensors_io import write_index
from pmakit.guard import guard_output, output_lock
from pmakit.layouts import native_format, open_weights, safetensors_format, writer
from pmakit.layouts.kinds import DEFAULT_BUFFERS, DTYPES, TensorPolicy, output_dtype
from pmakit.merge._faults import Killer as _Killer
from pmakit.merge.incremental import Increment, incremental_methods, plan_increment
from pmakit.merge.output import (
    FP32_DIR,
    INTERRUPTIONS,
    PROGRESS_DIR,
    Ledger,
    finish_output,
    manifest_record,
    merge_fingerprint,
    partial_dir,
    prepare_output,
    run_stage,
    window_inputs,
    write_layout,
    write_pass,
)
from pmakit.merge.plan import MergePlan, MergeResult, plan_merge
from pmakit.merge.url import merge_to_url, refuse_local_only
from pmakit.snapshot import Snapshot
from pmakit.storage.mirror import origin
from pmakit.storage.registry import is_remote
from pmakit.world import World

__all__ = [
    "DTYPES",
    "FP32_DIR",
    "PROGRESS_DIR",
    "Increment",
    "MergePlan",
    "MergeResult",
    "TensorPolicy",
    "average_states",
    "execute",
    "incremental_methods",
    "merge",
    "output_dtype",
    "partial_dir",
    "plan_increment",
    "plan_merge",
]

log = logging.getLogger(__name__)


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
    buffers: str = DEFAULT_BUFFERS,
) -> MergeResult:
    """Merge ``snapshots`` (oldest first) with ``weights`` into a model directory ``out``.

    Args:
        out: a folder, or an ``s3://`` / ``gs://`` prefix: merged in a private staging folder (on ``world``'s
            device), then published, manifest last, under the rules of a folder (``pmakit.merge.url``). The
            snapshots themselves may come from a URL: ``discover("s3://...")``.
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
        buffers: MoE routers' load-balancing biases ``average``-d like the weights or the newest snapshot's
            (``latest``), in fp32 whatever ``dtype``; counters (tokens per expert) are always the newest's. See
            ``pmakit.layouts.kinds``.
    """
    start, world = time.perf_counter(), world or World()
    _check_output(out, snapshots, window, force, keep_fp32, world)  # before any header is read
    plan = plan_merge(
        snapshots,
        weights,
        dtype=dtype,
        max_shard_size=max_shard_size,
        ranks=world.size,
        buffers=buffers,
        window=window[0] if window else None,
    )
    run = _Run(force, resume, out_format, keep_fp32, progress, manifest_extra, threads, fsync)
    return _write(plan, out, run, world, window, start)


def execute(
    plan: MergePlan,
    out: str | os.PathLike[str],
    *,
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
    """Write the merge ``plan_merge`` planned into ``out`` (a folder or a URL, as for ``merge``): ``merge``
    without planning again (the options as for ``merge``; the inputs, weights, dtype, shard size, ranks and
    router-bias rule are the plan's)."""
    world = world or World()
    if plan.ranks != world.size:
        raise PmakitError(
            f"the plan splits the output among {plan.ranks} rank(s); this merge runs on {world.size}"
        )
    run = _Run(force, resume, out_format, keep_fp32, progress, manifest_extra, threads, fsync)
    return _write(plan, out, run, world, window)


def _check_output(
    out: str | os.PathLike[str],
    snapshots: Sequence[Snapshot],
    window: tuple[Sequence[Snapshot], Sequence[float]] | None,
    force: bool,
    keep_fp32: bool,
    world: World,
) -> list[Path]:
    """A folder output's rules (``guard_output``: not an input, not inside or around one, not someone else's
    files without ``force``), or a URL output's local-only options refused; the inputs' paths, for the URL's own
    checks."""
    inputs = [s.path for s in [*snapshots, *(window[0] if window else [])]]
    if is_remote(out):
        refuse_local_only(str(out), keep_fp32, window is not None, world.size)
    else:
        guard_output(Path(out), inputs, force)
    return inputs


def _write(
    plan: MergePlan,
    out: str | os.PathLike[str],
    run: _Run,
    world: World,
    window: tuple[Sequence[Snapshot], Sequence[float]] | None,
    start: float | None = None,
) -> MergeResult:
    """The planned merge into a folder (guarded first), or into a private staging folder published at a URL."""
    inputs = _check_output(out, plan.snapshots, window, run.force, run.keep_fp32, world)
    if not is_remote(out):
        return _execute(plan, Path(out), run, world, window, start)

    def staged(folder: Path, force: bool, extra: dict[str, Any]) -> MergeResult:
        guard_output(folder, inputs, force)
        return _execute(plan, folder, replace(run, force=force, manifest_extra=extra), world, None, start)

    return merge_to_url(
        plan,
        str(out),
        force=run.force,
        resume=run.resume,
        manifest_extra=run.manifest_extra,
        out_format=run.out_format,
        write=staged,
    )


@dataclass(frozen=True)
class _Run:
    """How to run a planned merge (``merge``'s options beyond the plan)."""

    force: bool
    resume: bool
    out_format: str | None
    keep_fp32: bool
    progress: Callable[[int], None] | None
    manifest_extra: dict[str, Any] | None
    threads: int
    fsync: bool


def _execute(
    plan: MergePlan,
    out: Path,
    run: _Run,
    world: World,
    window: tuple[Sequence[Snapshot], Sequence[float]] | None,
    start: float | None = None,
) -> MergeResult:
    """The merge's steps once planned and its output guarded: take the output, write, finish."""
    start = start or time.perf_counter()
    out_format = _output_format(plan, run.out_format)
    _note_device(world, plan.snapshots)
    narrow = any(is_float(d) and d != torch.float32 for _, d in plan.tensors.values())
    fp32 = run.keep_fp32 and narrow
    sums = (
        _fp32_sums(plan.snapshots, plan.weights, plan.max_shard_size, world, plan.buffers) if fp32 else None
    )
    killer = _Killer()
    job = _Job(
        plan,
        sums,
        out,
        partial_dir(out),
        world,
        out_format,
        run.fsync,
        run.progress,
        killer,
        plan.max_shard_size,
    )
    previous_threads = torch.get_num_threads()
    owned = False
    try:
        torch.set_num_threads(run.threads)
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(open_weights(s.path)) for s in plan.snapshots]
            run_stage(
                world, out, lambda: _take_output(job, readers, stack, run.force, run.resume), rank0=True
            )
            owned = True
            # A mapping of dtypes is the cast pass's own plan, not a user's choice.
            asked = None if isinstance(plan.dtype, Mapping) else plan.dtype
            manifest = _manifest_of(job, readers, asked, run.manifest_extra or {}, narrow, window)
            result = _write_and_finish(job, readers, stack, manifest)
    except BaseException as e:
        if owned and world.rank == 0:
            _leave_partial(job.partial, e, world)
        raise
    finally:
        torch.set_num_threads(previous_threads)
    return MergeResult(out, plan, time.perf_counter() - start, result or {})


def device_note(device: str, snapshots: Sequence[Snapshot]) -> str | None:
    """What ``--device cuda`` does not buy where every input is read from disk (not an object store), or None.

    The user's choice stands; this only says what was measured (docs/gpu.md)."""
    if device != "cuda" or any(is_remote(origin(s.path)) for s in snapshots):
        return None
    return (
        "--device cuda: on an H200 node (16 cores) the GPU fold measured within the CPU fold's run-to-run spread "
        "(8 x 1.6 GB bf16 from disk, two runs: CPU 6.6 and 6.7 s, GPU 7.4 and 6.0 s): such a merge is bound by "
        "reading, writing and checksumming, not by the fp32 sums; folding on the GPU as asked (see docs/gpu.md)"
    )


def _note_device(world: World, snapshots: Sequence[Snapshot]) -> None:
    note = device_note(world.device, snapshots)
    if world.rank == 0 and note is not None:
        log.info("%s", note)


def _fp32_sums(
    snapshots: Sequence[Snapshot],
    weights: Sequence[float],
    max_shard_size: int,
    world: World,
    buffers: str,
) -> MergePlan:
    """The plan of the fp32 sums kept beside a narrower output (``keep_fp32``): the same merge, cast to fp32."""
    return plan_merge(
        snapshots,
        weights,
        dtype="fp32",
        max_shard_size=max_shard_size,
        ranks=world.size,
        buffers=buffers,
    )


def _leave_partial(partial: Path, error: BaseException, world: World) -> None:
    """After a merge stopped on ``error``: an interruption's partial output stays for the same command to continue;
    a failure's is removed."""
    if _interrupted(error, world) and partial.exists():
        log.warning(
            "merge interrupted; what it wrote is kept in %s: the same command continues it (--force starts over)",
            partial,
        )
    else:
        shutil.rmtree(partial, ignore_errors=True)


def _interrupted(error: BaseException, world: World) -> bool:
    """Stopped from outside rather than failed: Ctrl-C, SIGTERM (torchrun stopping the group), a lost rank, a store
    that stopped answering (``Interrupted``). Its partial output is kept for the same command to continue; a failure
    (bad input, disk full) removes it."""
    if isinstance(error, INTERRUPTIONS):
        return True
    # A collective other than our agreements (a layout writer's) failing under torchrun: a peer is gone.
    return world.distributed and not isinstance(error, (PmakitError, OSError))


def _output_format(plan: MergePlan, out_format: str | None) -> str:
    """The output layout: as asked, else the newest input's own; an unknown one fails before any work."""
    out_format = out_format or native_format(plan.snapshots[-1])
    if out_format == "safetensors":  # HF names where the trainer ships a converter (torchtitan's adapter)
        out_format = safetensors_format(plan.snapshots[-1])
    if out_format != "safetensors":
        # A writer that needs inputs of its own kind (Lightning's rewrites the newest .ckpt) says so now.
        check = getattr(writer(out_format), "check_inputs", None)
        if callable(check):
            check(plan.snapshots[-1])
    return out_format


def _write_and_finish(
    job: _Job,
    readers: list[Reader],
    stack: contextlib.ExitStack,
    manifest: Callable[[list[dict[str, Any]], list[str]], dict[str, Any]],
) -> dict[str, Any] | None:
    """Once this merge owns its output: the fp32 sums (if kept), the output's shards, the layout's own files,
    then the manifest (``manifest``: its builder) and the rename into place."""
    plan, world, out = job.plan, job.world, job.out
    final, final_readers = _fp32_pass(job, readers, stack) if job.sums is not None else (plan, readers)
    last_progress = None if job.sums is not None else job.progress
    relaid = job.out_format != "safetensors"  # the layout's writer rewrites it next, from the page cache
    run_stage(
        world,
        out,
        lambda: write_pass(
            final, final_readers, job.partial, "", world, last_progress, job.fsync, job.killer, cached=relaid
        ),
    )
    written = _layout_pass(job) if relaid else None
    return run_stage(
        world,
        out,
        lambda: finish_output(plan, readers, job.partial, out, written, job.fsync, manifest, job.killer),
        rank0=True,
    )


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
    fingerprint = merge_fingerprint(job.plan, readers, **options)
    stack.enter_context(output_lock(job.out))
    extra = job.sums.output_bytes if job.sums is not None else 0
    prepare_output(job.out, job.partial, job.plan, fingerprint, force, resume, extra)


def _fp32_pass(
    job: _Job, readers: Sequence[Reader], stack: contextlib.ExitStack
) -> tuple[MergePlan, list[Reader]]:
    """Write the fp32 sums into ``pmakit-fp32/``; the output is then those sums cast once (the same bytes as
    casting the accumulator directly). Returns the cast pass's plan and reader."""
    fp32, world, out = job.sums, job.world, job.out
    assert fp32 is not None
    run_stage(
        world,
        out,
        lambda: write_pass(  # read back at once by the cast pass: through the page cache
            fp32, readers, job.partial, FP32_DIR, world, job.progress, job.fsync, job.killer, cached=True
        ),
    )
    run_stage(world, out, lambda: write_index(job.partial / FP32_DIR, fp32.shards), rank0=True)
    state = Snapshot(job.partial / FP32_DIR, tokens=job.plan.snapshots[-1].tokens, source="merge")
    dtypes = {k: d for k, (_, d) in job.plan.tensors.items()}
    shard_size = job.max_shard_size

    def cast_plan() -> MergePlan:  # a stage of its own: it reads what rank 0 just wrote
        casting = plan_merge([state], [1.0], dtype=dtypes, max_shard_size=shard_size, ranks=world.size)
        if casting.shards != job.plan.shards:
            raise RuntimeError("the cast pass planned other shards than the merge")
        return casting

    return run_stage(world, out, cast_plan), [stack.enter_context(open_weights(state.path))]


def _layout_pass(job: _Job) -> Any:
    """Write the merged weights in the chosen run layout (DCP, OLMo-core, ...) from the staged safetensors."""
    run_stage(job.world, job.out, lambda: write_index(job.partial, job.plan.shards), rank0=True)
    return run_stage(
        job.world, job.out, lambda: write_layout(job.plan, job.partial, job.world, job.fsync, job.out_format)
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
        record = manifest_record(job.plan, readers, files, copied, dtype, extra)
        record["produced_by"] = {
            "mode": "incremental" if window is not None else "full",
            "ranks": job.world.size,
            "format": job.out_format,
            "fp32_sums": FP32_DIR if job.sums is not None else (None if narrow else "."),
        }
        if job.sums is not None:  # what --from-previous checks before trusting the sums
            ledger = Ledger(job.partial)
            record["output"]["fp32_files"] = [
                ledger.recorded(f"{FP32_DIR}/{s.file}") for s in job.sums.shards
            ]
        if window is not None:
            record.pop("precision", None)  # of the terms (the fp32 sums among them), not of the window
            record["terms"] = record["inputs"]
            record["inputs"] = window_inputs(*window)
            record["weights"] = list(window[1])
            record["tokens"] = window[0][-1].tokens
        return record

    return manifest


def average_states(
    states: Iterable[Mapping[str, torch.Tensor]],
    weights: Sequence[float],
    *,
    dtype: str | torch.dtype | None = torch.float32,
    buffers: str = DEFAULT_BUFFERS,
) -> dict[str, torch.Tensor]:
    """The in-memory counterpart of ``merge``: the weighted fp32 sum of the weights, the counters (and other
    non-float tensors) from the newest state (``states`` oldest first), router biases as ``buffers`` says, in fp32.

    The arithmetic is the engine's (``merge.stream._fold``): the first term scaled, the others added with their
    weight, zero weights skipped; with ``dtype="same"`` the result equals, bit for bit, what ``merge`` writes.
    ``states`` may be a generator that reads one snapshot at a time: then only the sums and one state are in
    memory, however many snapshots are averaged.

    Args:
        dtype: of the averaged tensors: fp32 (the sums as they are), ``"same"`` (each tensor in its input's dtype,
            as ``merge`` writes it by default), or bf16 / fp16 as ``merge``'s ``dtype``.
        buffers: as for ``merge``.
    """
    policy = TensorPolicy(buffers, dtype)
    sums: dict[str, torch.Tensor] = {}
    newest: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    remaining = iter(states)  # not zip(): its reused result tuple would keep the previous state alive
    for weight in weights:
        state = next(remaining, None)
        if state is None:
            raise ValueError(f"{len(weights)} weights but fewer states")
        if newest and state.keys() != newest.keys():
            raise PmakitError(
                f"the states to average differ in their tensors: {sorted(state.keys() ^ newest.keys())}"
            )
        kinds = {k: policy.rule(k, t.dtype, t.shape) for k, t in state.items()}
        # Of the newest state only the tensors taken as they are are kept (of the others, shape and dtype).
        newest = {k: t if kinds[k] == "latest" else t.to("meta") for k, t in state.items()}
        if weight != 0:  # as the engine: a zero weight adds nothing (not even a -0.0)
            _fold_state(sums, state, weight, kinds)
        del state  # before the next one is read: one state in memory at a time
    if next(remaining, None) is not None:
        raise ValueError(f"more states than the {len(weights)} weights")
    out: dict[str, torch.Tensor] = {}
    for name, ref in newest.items():
        target = policy.out_dtype(name, ref.dtype, ref.shape)  # router biases in fp32, counters as they are
        if kinds[name] == "latest":
            out[name] = ref.to(target)
            continue
        total = sums[name] if name in sums else torch.zeros(ref.shape, dtype=torch.float32)
        out[name] = total if target == torch.float32 else total.to(target)
    return out


def _fold_state(
    sums: dict[str, torch.Tensor], state: Mapping[str, torch.Tensor], weight: float, rules: Mapping[str, str]
) -> None:
    """``sums += weight * state`` in fp32, tensor by tensor (the first term scaled, as the engine's fold)."""
    for name, t in state.items():
        if rules[name] != "average":
            continue
        if name in sums:
            sums[name].add_(t.float(), alpha=weight)
        else:
            sums[name] = torch.mul(t.float(), weight)


class _CallableModule(types.ModuleType):
    """``pmakit.merge`` is both this package and the function the README shows (``pmakit.merge(snaps, w, out)``):
    once anything imports the package, Python binds the name ``merge`` on ``pmakit`` to the module, hiding the lazy
    function. Calling the module calls the function, so ``pmakit.merge(...)`` works whatever was imported first."""

    def __call__(self, *args: Any, **kwargs: Any) -> MergeResult:
        return merge(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
