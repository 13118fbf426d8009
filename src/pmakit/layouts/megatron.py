"""Megatron save folders: ``iter_000000N/{.metadata, __R_I.distcp, [common.pt,] metadata.json}`` (``torch_dist``).

Written by Megatron-LM's ``save_checkpoint`` (``--ckpt-format torch_dist``, the default) or by megatron-core's own
``dist_checkpointing.save(sharded_state_dict, dir)``, at any tensor/pipeline parallelism.

- Checkpoints: directories holding ``common.pt`` or, from megatron-core 0.19, a ``.metadata`` that names a
  ``common_state`` entry (any name; Megatron-LM's are ``iter_0000500``). ``metadata.json``
  is written last, so a checkpoint without it is incomplete. ``latest_checkpointed_iteration.txt`` beside them is a
  loose file, never a candidate. The legacy ``--ckpt-format torch`` (``mp_rank_XX/model_optim_rng.pt``) is not
  read.
- Tokens, step and lr: from the common state (the non-sharded part of the state dict): ``common.pt`` up to
  megatron-core 0.18; from 0.19 the ``common_state/shard_0_1`` entry inside the DCP files (a ``torch.save`` record
  of ``[common dict]``, read through ``dcp_io``'s record reader). Either is loaded with
  ``torch.load(weights_only=True)``. Megatron-LM stores ``iteration`` and its ``args`` (an ``argparse.Namespace``):
  tokens = ``args.consumed_train_samples`` x ``args.seq_length``. A megatron-core caller stores what it passes: an
  explicit top-level ``tokens`` wins, else ``consumed_train_samples`` x ``seq_length`` at the top level or in
  ``args``; else ``iteration`` (or the step in the name) x ``--tokens-per-step``. The lr is the first parameter
  group's of ``optimizer`` (plain, wrapped, or a ChainedOptimizer's ``{0: ..., 1: ...}``, MoE's). ``argparse.
  Namespace`` and any other class pickled there (Megatron's enums in ``args``) become inert stand-ins that keep
  their attributes: nothing from the file is called, and Megatron need not be installed.
- Model weights: the tensor entries of the DCP checkpoint under their sharded keys, as Megatron's
  ``sharded_state_dict()`` names them: layers stacked on a leading axis (``decoder.layers.self_attention.
  linear_qkv.weight`` of shape ``[num_layers, 3h, h]``), global (unsharded) shapes whatever the TP/PP degree, so
  TP=2 and TP=1 checkpoints merge alike. Optimizer state (``optimizer.state.exp_avg.*``, ``optimizer.state.
  fp32_param.*``, ``chained_N.optimizer.*``) is never averaged; non-tensor entries (``*._extra_state/shard_*``, the
  RNG state ``rng_state/shard_*``) are not weights either. All of them are listed in ``Reader.skipped``.
- Written back (the default output for such inputs), in the layout of the newest input: ``OUT/`` with
  ``.metadata`` and ``*.distcp`` holding the merged weights under the same keys (one unsharded chunk each), the
  newest input's non-tensor entries (``_extra_state``, RNG state, from 0.19 the ``common_state`` entry) copied byte
  for byte, no optimizer state, its ``common.pt`` where it has one, and its ``metadata.json`` last. Megatron loads
  it with its default strictness, at any TP/EP degree: ``dist_checkpointing.load({"model":
  model.sharded_state_dict()}, OUT)["model"]`` into ``model.load_state_dict``; the optimizer starts fresh, as
  PMA-init wants. Megatron-LM's ``--load`` takes a save folder: merge into ``MERGED/iter_0000500``, write ``500`` to
  ``MERGED/latest_checkpointed_iteration.txt`` and pass ``--load MERGED --no-load-optim`` (tested with
  Megatron-LM's own ``load_checkpoint`` of megatron-core 0.19.2). ``--format safetensors`` writes one HF-layout
  directory under these Megatron keys (megatron-core ships no HF converter) and none of Megatron's own files.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import Reader, dcp_io
from pmakit.layouts.base import (
    IncompleteSnapshot,
    Layout,
    Snapshot,
    _count,
    float_or_none,
    load_json,
    step_from_name,
    validate_metadata,
)
from pmakit.layouts.dcp import written_dcp_files
from pmakit.runs import resolves_inside

COMMON_FILE = "common.pt"
"""The non-sharded part of Megatron's state dict (``COMMON_STATE_FNAME``), up to megatron-core 0.18."""
COMMON_ENTRY = "common_state/"
"""From megatron-core 0.19 the common part is a ``ShardedObject`` inside the DCP files: entry
``common_state/shard_0_1``, a ``torch.save`` record of ``[common dict]``."""
_COMMON_MARKER = COMMON_ENTRY.encode() + b"shard_"
"""How that entry's name appears in the pickled ``.metadata``: a byte search, so recognising a checkpoint never
unpickles anything."""
CONFIG_FILE = "metadata.json"
"""Megatron's backend record (``CheckpointingConfig``): written once the checkpoint is complete."""
_OPTIMIZER = re.compile(r"(?:chained_\d+\.)?optim(?:izer)?\.")
"""Optimizer entries: ``optimizer.state.<moment>.<param key>``, ``chained_0.optimizer...`` (ChainedOptimizer)."""


class _StandIn:
    """An inert object in place of any class pickled into ``common.pt`` (``argparse.Namespace``, enums): keeps
    the attributes and arguments it is given, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)
        self._args = args

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state


def _attrs(value: Any) -> dict[str, Any]:
    """The fields of Megatron's ``args`` (the stand-in, or a real ``argparse.Namespace`` where megatron, once
    imported, has allow-listed it for ``weights_only`` loads) or of a plain dict."""
    if isinstance(value, dict):
        return value
    fields = getattr(value, "__dict__", None)
    return fields if isinstance(fields, dict) else {}


def read_common(file: Path, data: bytes | None = None) -> dict[str, Any]:
    """Megatron's common state: ``common.pt``, or (``data``) the ``torch.save`` record of the DCP's
    ``common_state`` entry that ``file`` names. Loaded with ``weights_only=True``; every class it names that
    ``weights_only`` does not allow (found by scanning the pickle, not running it) becomes the inert stand-in."""
    try:
        if data is not None and len(data) > limits.PICKLE_RECORD_BYTES.value:
            raise limits.refuse(limits.PICKLE_RECORD_BYTES, f"{file}'s common state")
        source: Any = io.BytesIO(data) if data is not None else file
        names = torch.serialization.get_unsafe_globals_in_checkpoint(source)
        if data is not None:
            source = io.BytesIO(data)
        with torch.serialization.safe_globals([(_StandIn, name) for name in names]):
            common = torch.load(source, map_location="cpu", weights_only=True)
    except PmakitError as e:
        raise IncompleteSnapshot(file, str(e)) from None
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        raise IncompleteSnapshot(file, f"refused: holds objects other than plain data ({first})") from e
    except Exception as e:  # torch raises many types for a damaged zip or pickle
        raise IncompleteSnapshot(file, f"unreadable ({type(e).__name__}: {e})") from e
    if data is not None and isinstance(common, list) and len(common) == 1:
        common = common[0]  # a ShardedObject's data, as megatron-core 0.19 saves the common state
    if not isinstance(common, dict):
        raise IncompleteSnapshot(
            file, f"expected Megatron's common state (a dict), got {type(common).__name__}"
        )
    return common


def _lr(common: dict[str, Any]) -> float | None:
    """The learning rate of the first parameter group, where Megatron's optimizer keeps it in the common state:
    ``{"optimizer": {"param_groups": ...}}``, wrapped (``{"optimizer": {"optimizer": {...}}}``), or per inner
    optimizer of a ChainedOptimizer (``{0: {...}, 1: {...}}``: MoE's dense and expert optimizers)."""
    optimizer = common.get("optimizer")
    while isinstance(optimizer, dict) and "param_groups" not in optimizer:
        if "optimizer" in optimizer:
            optimizer = optimizer["optimizer"]
        elif 0 in optimizer:  # ChainedOptimizer: the first inner optimizer's groups
            optimizer = optimizer[0]
        else:
            return None
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if isinstance(groups, list) and groups and isinstance(groups[0], dict):
        return float_or_none(groups[0].get("lr"))  # the scheduler's lr at the save
    return None


def counts(common: dict[str, Any], file: Path) -> tuple[int | None, int | None, str]:
    """(tokens, step, where the tokens came from) in Megatron's common state, validated; None where unknown."""
    args = _attrs(common.get("args"))
    fields = {k: common.get(k, args.get(k)) for k in ("iteration", "consumed_train_samples", "seq_length")}
    try:
        step, samples, seq = (_count(fields, k) for k in fields)
    except ValueError as e:
        raise IncompleteSnapshot(file, str(e)) from None
    if common.get("tokens") is not None:
        return validate_metadata({"tokens": common["tokens"]}, file)[0], step, "tokens"
    if samples is not None and seq is not None:
        return samples * seq, step, "consumed_train_samples x seq_length"
    return None, step, ""


class MegatronReader(dcp_io.DCPReader):
    """The model weights of a Megatron checkpoint: tensor entries that are not optimizer state."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        for name in [n for n in self.tensors if _OPTIMIZER.match(n)]:
            del self.tensors[name]
            self.skipped.append(name)
        self.skipped.sort()


class MegatronLayout(Layout):
    name = "megatron"
    native_format = "megatron"

    own_files = (COMMON_FILE, CONFIG_FILE)

    def is_snapshot(self, path: Path) -> bool:
        return (path / COMMON_FILE).is_file() or has_common_entry(path)

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        if (path / CONFIG_FILE).is_file():
            backend = load_json(path / CONFIG_FILE).get("sharded_backend")
            if backend != "torch_dist":
                raise IncompleteSnapshot(path, f"Megatron's {backend!r} format is not read (only torch_dist)")
        if not (path / dcp_io.METADATA_FILE).is_file():
            legacy = " (legacy --ckpt-format torch is not read)" if any(path.glob("mp_rank_*")) else ""
            raise IncompleteSnapshot(
                path, f"no {dcp_io.METADATA_FILE}: Megatron's sharded weights are missing{legacy}"
            )
        if not (path / CONFIG_FILE).is_file():
            raise IncompleteSnapshot(
                path, f"no {CONFIG_FILE}: Megatron writes it last, so this save did not finish"
            )
        common_file, common = load_common(path)
        tokens, step, how = counts(common, common_file)
        step = step if step is not None else step_from_name(path)
        source = self.name
        if tokens is None:
            if step is None or not tokens_per_step:
                hint = (
                    " (pass --tokens-per-step to count tokens from the iteration)" if step is not None else ""
                )
                raise IncompleteSnapshot(
                    common_file,
                    f"no tokens, nor consumed_train_samples and seq_length in it or its args{hint}",
                )
            tokens, source, how = step * tokens_per_step, "name", "iteration x --tokens-per-step"
        record: dict[str, Any] = {"iteration": step, "tokens": tokens, "tokens_from": how}
        record["checkpoint_version"] = float_or_none(common.get("checkpoint_version"))
        return Snapshot(
            path, tokens=tokens, step=step, lr=_lr(common), source=source, meta=record, layout=self.name
        )

    def open(self, path: Path) -> Reader:
        return MegatronReader(path)

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        rank0 = not distributed or torch.distributed.get_rank() == 0
        for name in (COMMON_FILE, CONFIG_FILE):  # carried over below: a link to a file elsewhere is refused
            if (template / name).exists() and not resolves_inside(template / name, template):
                raise PmakitError(
                    f"{template / name}: a link to a file outside the checkpoint; not copying it"
                )
        state: dict[str, Any] = dict(merged)
        if rank0:  # non-tensor entries once, from the newest input, byte for byte
            state.update(
                {k: io.BytesIO(v) for k, v in dcp_io.read_bytes(template, carried(template)).items()}
            )
        dcp_io.save(state, out, distributed=distributed, fsync=fsync)
        if not rank0:
            return []
        # As the newest input was saved: 0.19+ carries the common state as a DCP entry (copied above with the other
        # non-tensor entries), older releases beside it in common.pt.
        common = [COMMON_FILE] if (template / COMMON_FILE).is_file() else []
        for name in common:
            shutil.copy2(template / name, out / name)
        # Last, as Megatron does: it marks the checkpoint complete.
        shutil.copy2(template / CONFIG_FILE, out / CONFIG_FILE)
        return [*written_dcp_files(out), *common, CONFIG_FILE]


@functools.lru_cache(maxsize=4096)
def _names_common_entry(metadata: Path, mtime_ns: int) -> bool:
    try:
        return _COMMON_MARKER in limits.read_regular(metadata, limits.DCP_METADATA_BYTES)
    except PmakitError:
        return False  # not readable as DCP metadata: read_metadata says why where it matters


def has_common_entry(path: Path) -> bool:
    """``path/.metadata`` names megatron-core 0.19's ``common_state`` entry."""
    metadata = path / dcp_io.METADATA_FILE
    try:
        return _names_common_entry(metadata, metadata.stat().st_mtime_ns)
    except OSError:
        return False


def load_common(path: Path) -> tuple[Path, dict[str, Any]]:
    """(where it was read, Megatron's common state) of a checkpoint: ``common.pt``, else the DCP entry."""
    if (path / COMMON_FILE).is_file():
        return path / COMMON_FILE, read_common(path / COMMON_FILE)
    metadata = dcp_io.read_metadata(path)
    keys = [k for k in metadata.state_dict_metadata if k.startswith(COMMON_ENTRY)]
    if len(keys) != 1:
        raise IncompleteSnapshot(
            path, f"no {COMMON_FILE} and no single {COMMON_ENTRY} entry in its DCP files"
        )
    where = path / dcp_io.METADATA_FILE
    return where, read_common(where, dcp_io.read_bytes(path, keys)[keys[0]])


def carried(path: Path) -> list[str]:
    """The non-tensor entries of a Megatron checkpoint a merge carries over: ``_extra_state``, RNG state;
    not the optimizer's."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = dcp_io.read_metadata(path).state_dict_metadata
    return [
        k for k, md in entries.items() if isinstance(md, BytesStorageMetadata) and not _OPTIMIZER.match(k)
    ]


LAYOUT = MegatronLayout()
