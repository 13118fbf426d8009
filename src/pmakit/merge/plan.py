"""What a merge will do, from the inputs' headers alone: tensors, output dtypes, shards, who writes what, memory."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.formats import Reader, TensorInfo, is_float
from pmakit.formats.safetensors_io import OutputTensor, Shard, plan_shards
from pmakit.layouts import open_weights
from pmakit.layouts.kinds import (
    DEFAULT_BUFFERS,
    Kind,
    TensorPolicy,
    classify,
    is_expert_tensor,
)
from pmakit.merge.resources import (
    PREFETCH_AHEAD,
    SCRATCH_BYTES,
    FoldSizing,
    read_node,
    size_fold,
    workers_override,
)
from pmakit.snapshot import Snapshot

log = logging.getLogger(__name__)

CHUNK_ELEMS = 8 * 2**20
"""Elements per chunk: 16 MiB of bf16 input, 32 MiB of fp32 accumulator."""
N_BUFFERS = 4
"""Output chunks in flight with the two fold workers of a two-core machine (see ``resources.size_fold``)."""
_TWO_CORES = FoldSizing(2, N_BUFFERS, PREFETCH_AHEAD, "two workers (a plan made without looking at the node)")


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
    kinds: dict[str, Kind] = field(default_factory=dict)
    """name -> what kind of state the tensor is (``pmakit.layouts.kinds``); absent: a weight."""
    buffers: str = DEFAULT_BUFFERS
    """The rule for router biases: ``average`` or ``latest``."""
    dtype: str | torch.dtype | Mapping[str, torch.dtype] | None = "same"
    """The output dtype asked for (each tensor's own is in ``tensors``), as the manifest records it."""
    max_shard_size: int = 5 * 10**9
    """Bytes per output shard the shards were laid out with."""
    ranks: int = 1
    """The ranks the shards were split among (``owners``)."""
    fold: FoldSizing = _TWO_CORES
    """Fold workers, output buffers and read-ahead, sized from the cores and memory this process may use."""
    precisions: tuple[str, ...] = ()
    """Each input's float dtype(s) (``float32``, ``float16``, ``bfloat16+float32``), oldest first, when the inputs
    differ in float precision (else empty): see ``precision``."""

    def precision(self) -> dict[str, Any]:
        """Which inputs were in which float dtype, the output's dtype and why (empty when they all agree)."""
        if not self.precisions:
            return {}
        out = sorted({str(d).replace("torch.", "") for _, d in self.tensors.values() if d.is_floating_point})
        return {
            "inputs": {str(s.path): p for s, p in zip(self.snapshots, self.precisions)},
            "output": "+".join(out),
            "why": precision_reason(self.snapshots, self.precisions, out),
        }

    def owner(self, shard: int) -> int:
        return self.owners[shard] if self.owners else 0

    @property
    def policy(self) -> TensorPolicy:
        """The tensor policy the plan applies (its output dtypes are already decided, per tensor, in ``tensors``)."""
        return TensorPolicy(self.buffers)

    def kind(self, name: str) -> Kind:
        return self.kinds.get(name, Kind.WEIGHT)

    def rule(self, name: str) -> str:
        """``average`` (weighted fp32 sum of the inputs) or ``latest`` (the newest input's)."""
        return self.policy.rule_of(self.kind(name))

    def sources(self, name: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The inputs ``name`` is read from and their weights: every input with a non-zero weight, or the newest."""
        if self.rule(name) == "latest":
            return (len(self.snapshots) - 1,), (1.0,)
        used = tuple(i for i, w in enumerate(self.weights) if w != 0)
        return used, tuple(self.weights[i] for i in used)

    def shard_input_bytes(self, shard: int) -> int:
        """Bytes read to write one shard."""
        return sum(self._input_bytes(t.name) for t in self.shards[shard].tensors)

    @property
    def input_bytes(self) -> int:
        """Bytes read: every averaged tensor from every input with a non-zero weight, the others once."""
        return sum(self._input_bytes(name) for name in self.tensors)

    def _input_bytes(self, name: str) -> int:
        return self.tensors[name][0].nbytes * len(self.sources(name)[0])

    @property
    def output_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    @property
    def chunk_elems(self) -> int:
        return max(1, min(CHUNK_ELEMS, max((i.numel for i, _ in self.tensors.values()), default=1)))

    @property
    def n_buffers(self) -> int:
        """Output buffers between the fold workers and the writer thread."""
        return self.fold.buffers

    @property
    def buffer_bytes(self) -> int:
        """One output buffer: a chunk of the widest output dtype (fp32 at least)."""
        return self.chunk_elems * max([4] + [dtype.itemsize for _, dtype in self.tensors.values()])

    @property
    def peak_memory(self) -> int:
        """Bytes of work memory the merge allocates (output buffers, the workers' scratch), whatever N and model
        size."""
        return self.buffer_bytes * self.fold.buffers + SCRATCH_BYTES * self.fold.workers


def precision_reason(snapshots: Sequence[Snapshot], precisions: Sequence[str], out: Sequence[str]) -> str:
    """One sentence: the inputs' float precisions, how they were merged and why the output has its dtype."""
    groups: dict[str, list[str]] = {}
    for snap, p in zip(snapshots, precisions):
        note = snap.meta.get("precision_note")  # a layout's word on why (torchtitan: its export_dtype)
        groups.setdefault(p, []).append(snap.path.name + (f" ({note})" if isinstance(note, str) else ""))
    said = "; ".join(f"{p} {', '.join(names)}" for p, names in groups.items())
    return (
        f"the snapshots differ only in float precision ({said}): one run, accumulated in fp32 and written in "
        f"{'+'.join(out)}, the widest precision of the inputs, so that no input loses digits (--dtype chooses "
        "another)"
    )


def _precisions(readers: Sequence[Reader]) -> tuple[str, ...]:
    """Each input's float dtypes, when they are not all the same (else empty)."""
    each = [
        "+".join(
            sorted({str(i.dtype).replace("torch.", "") for i in r.tensors.values() if is_float(i.dtype)})
        )
        for r in readers
    ]
    return tuple(each) if len(set(each)) > 1 else ()


def _widest(readers: Sequence[Reader], name: str) -> torch.dtype:
    """The dtype that holds every input's ``name`` exactly: fp32 for fp32 and fp16 inputs, or fp16 and bf16."""
    dtypes = [r.tensors[name].dtype for r in readers]
    widest = dtypes[-1]
    if is_float(widest):
        for d in dtypes:
            widest = torch.promote_types(widest, d)
    return widest


def _validate(readers: Sequence[Reader], snapshots: Sequence[Snapshot]) -> None:
    """Compare every input's keys, shapes and dtypes with the newest one's; raise listing every difference.
    Float dtypes may differ (a run's checkpoints in fp32 and its export in fp16 or bf16: see ``_widest``)."""
    ref, ref_snap = readers[-1].tensors, snapshots[-1]
    _validate_moe(readers, snapshots)
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
            elif a.dtype != b.dtype and not (is_float(a.dtype) and is_float(b.dtype)):
                problems.append(f"tensor {name!r}: {a.dtype} in {snap.path} but {b.dtype} in {ref_snap.path}")
    if problems:
        head = f"the snapshots do not match ({len(problems)} differences):"
        shown = problems[:50] + ([f"... and {len(problems) - 50} more"] if len(problems) > 50 else [])
        raise PmakitError("\n  ".join([head, *shown]))


def _validate_moe(readers: Sequence[Reader], snapshots: Sequence[Snapshot]) -> None:
    """The two MoE mistakes, each in one line that names its cause: a different number of experts (every expert
    tensor's shape then differs; one of them says why), and a router bias some snapshots lack."""
    ref, ref_snap = readers[-1].tensors, snapshots[-1]
    for reader, snap in zip(readers[:-1], snapshots[:-1]):
        keys = reader.tensors
        _same_experts_naming(keys, snap, ref, ref_snap)
        differ: list[tuple[str, Kind, TensorInfo, TensorInfo]] = []
        for name in [*ref, *(k for k in keys if k not in ref)]:
            a, b = keys.get(name), ref.get(name)
            if a is not None and b is not None and a.shape == b.shape:
                continue  # the common case, without classifying every name of a large model
            info = b or a
            assert info is not None
            kind = classify(name, info.dtype, info.shape)
            if a is None or b is None:
                if kind is Kind.ROUTER_BIAS:
                    has, lacks = (ref_snap, snap) if a is None else (snap, ref_snap)
                    raise PmakitError(
                        f"router bias {name!r} is in {has.path} but missing in {lacks.path}: the snapshots "
                        "come from differently configured models"
                    )
                continue
            if (
                is_expert_tensor(name, kind)
                and len(a.shape) == len(b.shape) >= 1
                and a.shape[0] != b.shape[0]
                and a.shape[1:] == b.shape[1:]
            ):
                differ.append((name, kind, a, b))
        if differ:
            # The first dimension is the number of experts only where the experts are not flattened into it:
            # a router bias (one value an expert) or a grouped [E, ...] tensor; OLMo-core stores its experts as
            # [E * hidden, d_model] and its router as [E * d_model], whose first dimensions are no count.
            exact = [d for d in differ if d[1] is Kind.ROUTER_BIAS] or [
                d for d in differ if len(d[2].shape) >= 3
            ]
            name, _, a, b = (exact or differ)[0]
            count = (
                f"{a.shape[0]} vs {b.shape[0]} experts"
                if exact
                else f"first dimension {a.shape[0]} vs {b.shape[0]}, the experts flattened into it"
            )
            raise PmakitError(
                f"the number of experts differs: tensor {name!r} is {list(a.shape)} in {snap.path} but "
                f"{list(b.shape)} in {ref_snap.path} ({count})"
            )


_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
"""transformers' ``save_pretrained`` (and the HF checkpoints it writes): one tensor per expert,
``mlp.experts.0.gate_proj.weight``."""
_FUSED = re.compile(r"\.experts\.[A-Za-z_]\w*$")
"""The modules' own state dict (transformers 5, torchtitan): the experts fused, ``mlp.experts.gate_up_proj``."""


def _experts_naming(keys: Mapping[str, Any]) -> str | None:
    for name in keys:
        if _PER_EXPERT.search(name):
            return "per-expert"
        if _FUSED.search(name):
            return "fused"
    return None


def _same_experts_naming(
    keys: Mapping[str, Any], snap: Snapshot, ref: Mapping[str, Any], ref_snap: Snapshot
) -> None:
    """Refuse to merge the two names of one HF MoE model: ``save_pretrained`` files (Trainer checkpoints) and the
    module's state dict (pmakit's HF callback snapshots) lay the same weights out differently."""
    mine, theirs = _experts_naming(keys), _experts_naming(ref)
    if mine and theirs and mine != theirs:
        example = {"per-expert": "mlp.experts.0.gate_proj.weight", "fused": "mlp.experts.gate_up_proj"}
        raise PmakitError(
            f"{snap.path} names its experts {mine} ({example[mine]}) but {ref_snap.path} {theirs} "
            f"({example[theirs]}): merge snapshots of one convention (the HF callback's snapshots, or the "
            "Trainer's checkpoint-N directories, not both)"
        )


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def plan_merge(
    snapshots: Sequence[Snapshot],
    weights: Sequence[float],
    *,
    dtype: str | torch.dtype | Mapping[str, torch.dtype] | None = "same",
    max_shard_size: int = 5 * 10**9,
    ranks: int = 1,
    buffers: str = DEFAULT_BUFFERS,
    window: Sequence[Snapshot] | None = None,
) -> MergePlan:
    """Read every input's headers, check they match, and lay out the output. Reads no weights.

    Args:
        dtype: as for ``merge`` (``same``: each tensor in the widest float dtype of the inputs, the newest input's
            when they agree), or a mapping of tensor name to output dtype.
        ranks: split the output into shards owned by this many ranks, balanced by bytes.
        buffers: routers' load-balancing biases averaged (``average``) or the newest input's (``latest``); in
            fp32 either way. Counters are always the newest input's (see ``pmakit.layouts.kinds``).
        window: for an incremental update (``snapshots`` are then its terms), the merge's real window: with
            ``same``, the output keeps the dtypes a full merge of it would write (``window_dtypes``).
    """
    dtype = window_dtypes(dtype, window, buffers)
    policy = TensorPolicy(buffers, None if isinstance(dtype, Mapping) else dtype)
    if len(snapshots) != len(weights):
        raise PmakitError(f"{len(weights)} weights for {len(snapshots)} snapshots")
    if not snapshots:
        raise PmakitError("no snapshots to merge")
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_weights(s.path)) for s in snapshots]
        _validate(readers, snapshots)
        newest = readers[-1]
        if not newest.tensors:  # e.g. a torch file of trainer state only: one line, not a crash further down
            raise PmakitError(
                f"{snapshots[-1].path}: no model weights ({len(newest.skipped)} entries, none a model tensor)"
            )
        order = sorted(newest.tensors, key=lambda k: newest.tensors[k].order)
        kinds = {k: policy.kind(k, newest.tensors[k].dtype, newest.tensors[k].shape) for k in order}
        tensors = {
            k: (
                newest.tensors[k],
                dtype[k]
                if isinstance(dtype, Mapping)
                else policy.out_dtype(k, _widest(readers, k), newest.tensors[k].shape),
            )
            for k in order
        }
        out = [OutputTensor(k, tensors[k][1], tensors[k][0].shape) for k in order]
        skipped = sorted({s for r in readers for s in r.skipped})
    shards, owners = _plan_rank_shards(out, max_shard_size, ranks)
    state: dict[str, Kind] = {k: v for k, v in kinds.items() if v is not Kind.WEIGHT}
    plan = MergePlan(
        list(snapshots),
        list(weights),
        tensors,
        shards,
        skipped,
        owners,
        state,
        buffers,
        dtype=dtype,
        max_shard_size=max_shard_size,
        ranks=ranks,
        precisions=_precisions(readers),
    )
    return replace(plan, fold=fold_sizing(plan))


def window_dtypes(
    dtype: str | torch.dtype | Mapping[str, torch.dtype] | None,
    window: Sequence[Snapshot] | None,
    buffers: str = DEFAULT_BUFFERS,
) -> str | torch.dtype | Mapping[str, torch.dtype] | None:
    """``dtype`` for a plan over an incremental update's terms: with ``same``, the dtypes a full merge of the
    ``window`` would write (its terms mix the previous merge's fp32 sums with snapshots, which must not widen it)."""
    if window is None or dtype not in (None, "same"):
        return dtype
    full = plan_merge(window, [1 / len(window)] * len(window), dtype="same", buffers=buffers)
    return {name: out for name, (_, out) in full.tensors.items()}


def fold_sizing(plan: MergePlan) -> FoldSizing:
    """The fold's workers, buffers and read-ahead for ``plan`` on this process's share of its node."""
    node = read_node()
    inputs = max(1, sum(1 for w in plan.weights if w != 0))
    chunk_read = plan.chunk_elems * inputs * max(i.dtype.itemsize for i, _ in plan.tensors.values())
    sizing = size_fold(node.cores, node.memory, plan.buffer_bytes, chunk_read, workers_override())
    return replace(sizing, why=f"{sizing.why}; {node.describe()}")


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
    url: str | None = None
    """Where a merge into object storage was published (``path`` is then its staging folder, removed since)."""
