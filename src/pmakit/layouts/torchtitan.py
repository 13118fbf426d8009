"""torchtitan save folders: ``DUMP/checkpoint/step-N/`` torch.distributed.checkpoint directories (``CheckpointManager``).

- Checkpoints: ``step-N`` directories holding DCP files (``.metadata`` + ``__R_I.distcp``) whose ``.metadata`` names
  torchtitan's ``train_state`` entry, and the ``step-N`` next to them (the model-only last save). DCP writes
  ``.metadata`` last, so ``step-N`` with ``.distcp`` files and no ``.metadata`` (an async save in flight, or a job
  killed while saving) is incomplete: reported, not merged.
- Tokens and step: the ``train_state`` entry (``Trainer.state_dict()``: ``step`` and ``ntokens_seen``), two small
  ``torch.save`` records inside the DCP checkpoint, loaded with ``torch.load(weights_only=True)`` (plain ints; nothing
  else can be built). torchtitan counts ``ntokens_seen`` per rank (``labels.numel()`` of that rank's batches), so the
  run's count is ``ntokens_seen`` x the data-parallel degree, which torchtitan's data loader saves beside it
  (``dataloader.world_size``). Under context parallelism each rank counts 1/cp of its sequences; the CP degree is not
  in the checkpoint, so such counts are low by that factor (the same for every checkpoint: the merge weights do not
  change). The model-only last save (``last_save_model_only``, the default) has no ``train_state``: its tokens are
  step x the tokens per step of the other checkpoints of the folder when they all agree (else
  ``--tokens-per-step``). That last save may be in ``--checkpoint.export_dtype`` (fp16 in torchtitan's qwen3
  configs): the merge sums in fp32 and writes the widest input precision (``merge.plan``). With
  ``--checkpoint.last_save_in_hf`` it is HF safetensors (no ``.metadata``), read back under torchtitan's names
  through torchtitan's adapter (``torchtitan_hf.LastSaveReader``: needs torchtitan and the job config) and merged
  with the DCP saves, or refused in one line when it lacks any of their tensors.
- Model weights: the tensor entries at the top level of the checkpoint, named as torchtitan's model names them
  (``tok_embeddings.weight``, ``layers.0.attention.qkv_linear.wq.weight``: canonical names, fused parameters already
  split by torchtitan's state-dict hooks). ``optimizer.*``, ``lr_scheduler.*``, ``dataloader.*`` and
  ``train_state.*`` are never averaged (``Reader.skipped``). Reading needs neither torchtitan nor a process group.
- Written back (the default output for such inputs): ``OUT/`` as a model-only torchtitan checkpoint (the merged
  weights at the top level, as torchtitan's ``ModelWrapper`` flattens them; no optimizer, scheduler, data loader or
  trainer state). torchtitan loads it as the start of a run (PMA-init: a fresh optimizer, step 0)::

      torchrun ... -m torchtitan.train --module llama3 --config CONFIG \\
          --checkpoint.initial_load_path OUT --checkpoint.initial_load_model_only

  (an absolute path; the run's own ``checkpoint/`` folder must hold no ``step-N`` yet, or torchtitan resumes from it
  instead). ``--format safetensors`` writes HF names through torchtitan's own state-dict adapter for the model
  (``ModelSpec.state_dict_adapter.to_hf``) so that ``--checkpoint.initial_load_in_hf`` loads it: that needs
  torchtitan installed and the model's ``--module``/``--config`` (read from the job config torchtitan saves with
  ``--debug.save_config_file``, see ``torchtitan_hf``); otherwise it keeps torchtitan's names and says so.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import Reader, dcp_io
from pmakit.formats.dcp_io import DCPReader
from pmakit.layouts.base import IncompleteSnapshot, Layout, Snapshot, from_name, validate_metadata
from pmakit.layouts.dcp import written_dcp_files

STEP_DIR = re.compile(r"step-(\d+)")
"""torchtitan's ``CheckpointManager._create_checkpoint_id``: ``step-{N}``."""
TRAIN_STATE = ("train_state.step", "train_state.ntokens_seen")
DP_DEGREE = "dataloader.world_size"
EXPORT_NOTE = "a model-only last save: torchtitan's --checkpoint.export_dtype"
"""Why a model-only last save may be in another float precision than the run's checkpoints."""
_MARKER = b"train_state.ntokens_seen"
"""The entry name as it appears in the pickled ``.metadata``: a byte search, so recognising a checkpoint never
unpickles anything."""


@functools.lru_cache(maxsize=4096)
def _has_train_state(metadata: Path, mtime_ns: int) -> bool:
    try:
        return _MARKER in limits.read_regular(metadata, limits.DCP_METADATA_BYTES)
    except PmakitError:
        return False  # not readable as DCP metadata: not a torchtitan checkpoint (read_metadata says why)


def _is_torchtitan_dcp(path: Path) -> bool:
    """``path/.metadata`` names torchtitan's ``train_state`` entry."""
    metadata = path / dcp_io.METADATA_FILE
    try:
        return _has_train_state(metadata, metadata.stat().st_mtime_ns)
    except OSError:
        return False


def _is_hf_save(path: Path) -> bool:
    """torchtitan's last save in HF format (``--checkpoint.last_save_in_hf``): safetensors, no DCP ``.metadata``."""
    return not (path / dcp_io.METADATA_FILE).exists() and (
        (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors"))
    )


def _siblings(path: Path) -> list[Path]:
    """The other ``step-N`` checkpoints of the same save folder, in step order."""
    try:
        children = [c for c in path.parent.iterdir() if c != path and STEP_DIR.fullmatch(c.name)]
    except OSError:
        return []
    return sorted(children, key=lambda c: int(c.name[5:]))


def read_train_state(path: Path) -> dict[str, int]:
    """``step``, ``ntokens_seen`` and the data-parallel degree (``dp``, 1 when the data loader saved none) of a
    torchtitan checkpoint, each a ``torch.save`` record of an int inside the DCP files."""
    metadata = dcp_io.read_metadata(path)
    keys = [k for k in (*TRAIN_STATE, DP_DEGREE) if k in metadata.state_dict_metadata]
    raw = dcp_io.read_bytes(path, keys)
    values: dict[str, Any] = {}
    for key, data in raw.items():
        try:
            values[key] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            first = str(e).strip().splitlines()[0]
            raise IncompleteSnapshot(path, f"{key} refused: not plain data ({first})") from e
        except Exception as e:  # torch raises many types for a damaged record
            raise IncompleteSnapshot(path, f"{key} unreadable ({type(e).__name__}: {e})") from e
    dp = values.get(DP_DEGREE, 1)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise IncompleteSnapshot(path, f"{DP_DEGREE} must be a positive integer, got {dp!r}")
    ntokens, step = values.get("train_state.ntokens_seen"), values.get("train_state.step")
    if ntokens is None or step is None:
        raise IncompleteSnapshot(
            path, "no train_state.step and train_state.ntokens_seen in this torchtitan checkpoint"
        )
    tokens, checked = validate_metadata(
        {"tokens": ntokens, "step": step}, path / dcp_io.METADATA_FILE
    )  # not `True`
    return {"step": checked or 0, "tokens": tokens * dp, "ntokens_seen": tokens, "dp": dp}


class TorchtitanLayout(Layout):
    name = "torchtitan"
    native_format = "torchtitan"

    def is_snapshot(self, path: Path) -> bool:
        if not STEP_DIR.fullmatch(path.name):
            return False
        if (path / dcp_io.METADATA_FILE).is_file():
            # Its own train_state, or a model-only save (the last one) beside torchtitan checkpoints.
            return _is_torchtitan_dcp(path) or any(_is_torchtitan_dcp(s) for s in _siblings(path))
        # The last save in HF format (--checkpoint.last_save_in_hf), or one that never finished: DCP files but no
        # .metadata (written last); either among torchtitan checkpoints.
        return (_is_hf_save(path) or any(path.glob("*.distcp"))) and any(
            _is_torchtitan_dcp(s) for s in _siblings(path)
        )

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        if _is_hf_save(path):
            return self._model_only(path, tokens_per_step, hf=True)
        if not (path / dcp_io.METADATA_FILE).is_file():
            raise IncompleteSnapshot(
                path,
                "no .metadata: DCP writes it last, so this torchtitan save did not finish (async or killed)",
            )
        if not _is_torchtitan_dcp(path):
            return self._model_only(path, tokens_per_step)
        state = read_train_state(path)
        return Snapshot(
            path, tokens=state["tokens"], step=state["step"], source=self.name, meta=state, layout=self.name
        )

    def _model_only(self, path: Path, tokens_per_step: int | None, hf: bool = False) -> Snapshot:
        """A checkpoint without ``train_state`` (torchtitan's model-only last save, ``hf``: in HF format): tokens =
        its step x the tokens per step the folder's other checkpoints agree on (or ``--tokens-per-step``)."""
        step = int(path.name[5:])
        if tokens_per_step:
            snap = from_name(path, tokens_per_step, self.name)
            snap.meta.update(model_only=True, hf=hf, precision_note=EXPORT_NOTE)
            return snap
        rates = set()
        for sibling in _siblings(path):
            if _is_torchtitan_dcp(sibling):
                try:
                    state = read_train_state(sibling)
                except IncompleteSnapshot:
                    continue  # reported on its own
                if state["step"] > 0:
                    rates.add(state["tokens"] / state["step"])
        if len(rates) != 1 or not float(next(iter(rates))).is_integer():
            why = "no other checkpoint to take it from" if not rates else "its other checkpoints disagree"
            raise IncompleteSnapshot(
                path,
                f"a model-only torchtitan save (no train_state) and {why}: pass --tokens-per-step",
            )
        rate = int(next(iter(rates)))
        meta: dict[str, Any] = {"step": step, "tokens": step * rate, "tokens_per_step": rate}
        meta.update(model_only=True, hf=hf, precision_note=EXPORT_NOTE)
        return Snapshot(path, tokens=step * rate, step=step, source=self.name, meta=meta, layout=self.name)

    def safetensors_format(self, snapshot: Snapshot) -> str:
        """``--format safetensors``: HF names through torchtitan's adapter when at hand (see ``torchtitan_hf``)."""
        from pmakit.layouts.torchtitan_hf import export_format

        return export_format(snapshot)

    def open(self, path: Path) -> Reader:
        if _is_hf_save(path):
            from pmakit.layouts.torchtitan_hf import LastSaveReader

            reference = next((s for s in reversed(_siblings(path)) if _is_torchtitan_dcp(s)), None)
            if reference is None:
                raise PmakitError(
                    f"{path}: torchtitan's last save in HF format, and no DCP checkpoint beside it"
                )
            with DCPReader(reference) as names:
                return LastSaveReader(path, names.tensors)
        return DCPReader(path)  # the model's names at the top level; optimizer.* etc. skipped

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        # Top-level names, as torchtitan's ModelWrapper flattens the model into the checkpoint: a model-only load
        # (``initial_load_model_only``) asks for exactly these keys.
        dcp_io.save(merged, out, distributed=distributed, fsync=fsync)
        if distributed and torch.distributed.get_rank() != 0:
            return []
        return written_dcp_files(out)


LAYOUT = TorchtitanLayout()
