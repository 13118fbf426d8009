"""OLMo-core save folders: ``stepN/{model_and_optim/, train/rankR.pt, .metadata.json}`` (``Checkpointer.save``).

- Checkpoints: ``stepN`` directories with OLMo-core's files. ``.metadata.json`` is written last, so a checkpoint
  without it is incomplete. ``stepN-merged`` (OLMo-core's ``ModelMergeCallback`` output) and ``stepN-tmp`` (a save
  in progress) are ignored.
- Tokens and step: ``global_train_tokens_seen`` and ``global_step`` of the trainer state ``train/rank0.pt``, loaded
  with ``torch.load(weights_only=True)`` and an allow-list of numpy's array classes (its RNG state), nothing else.
  OLMo-core keeps no lr or loss there.
- Model weights: the ``model.*`` entries of the DCP checkpoint ``model_and_optim/``, named as OLMo-core's
  ``Transformer`` names its parameters (``embeddings.weight``, ``blocks.0.attention.w_q.weight``, ...); the
  ``optim.*`` entries are never averaged. OLMo-core pickles its own classes into ``.metadata``; ``formats.dcp_io``
  reads them without olmo_core installed.
- Written back (the default output for such inputs): ``OUT/model_and_optim/`` with the merged weights under
  ``model.`` and no optimizer state, plus the newest input's ``train/`` and ``.metadata.json``. OLMo-core's
  ``Checkpointer.load`` / ``Trainer.load_checkpoint`` then load it as a checkpoint of that step (warning that there
  is no optimizer state: the optimizer starts fresh, as PMA-init wants); pass ``load_trainer_state=False`` to start
  a new run from the merged weights instead. ``load_model_and_optim_state(OUT/model_and_optim, model)`` loads the
  weights alone. ``--format safetensors`` writes one HF-layout directory under OLMo-core's parameter names (OLMo-core
  3.0.0 ships no converter to HF names in its package; its ``convert_checkpoint_to_hf`` script does that).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit.formats import Reader
from pmakit.formats.dcp_io import DCPReader
from pmakit.layouts.base import (
    IncompleteSnapshot,
    Layout,
    Snapshot,
    from_name,
    load_json,
    validate_metadata,
)
from pmakit.runs import resolves_inside

log = logging.getLogger(__name__)

MODEL_DIR = "model_and_optim"
TRAIN_DIR = "train"
CHECKPOINT_METADATA = ".metadata.json"
"""OLMo-core's ``Checkpointer.METADATA_FNAME``: written once the checkpoint is complete."""
_IGNORED = re.compile(r"step\d+-.+")


@functools.cache
def _numpy_globals() -> list[Any]:
    """numpy's array classes, which OLMo-core's trainer state holds (the numpy RNG state); none if no numpy."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_train_state(file: Path) -> dict[str, Any]:
    """OLMo-core's trainer state (``Trainer.state_dict()``), loaded with ``weights_only=True`` + numpy arrays."""
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0]
        raise IncompleteSnapshot(file, f"refused: holds objects other than plain data ({first})") from e
    except Exception as e:  # torch raises many types for a damaged zip or pickle
        raise IncompleteSnapshot(file, f"unreadable trainer state ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict):
        raise IncompleteSnapshot(
            file, f"expected OLMo-core's trainer state (a dict), got {type(state).__name__}"
        )
    return state


class OLMoCoreLayout(Layout):
    name = "olmo-core"
    native_format = "olmo-core"

    def is_snapshot(self, path: Path) -> bool:
        if path.name == MODEL_DIR and self._is_checkpoint(path.parent):
            return True  # claimed only to point at the checkpoint itself (see read)
        return self._is_checkpoint(path)

    @staticmethod
    def _is_checkpoint(path: Path) -> bool:
        return (path / MODEL_DIR).is_dir() or (path / TRAIN_DIR / "rank0.pt").is_file()

    def ignore(self, path: Path) -> bool:
        return _IGNORED.fullmatch(path.name) is not None and self.is_snapshot(path)

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        if path.name == MODEL_DIR and not self._is_checkpoint(path):
            raise IncompleteSnapshot(
                path, f"OLMo-core's model and optimizer state; name the checkpoint {path.parent} instead"
            )
        if not (path / MODEL_DIR / ".metadata").is_file():
            raise IncompleteSnapshot(path, f"no {MODEL_DIR}/.metadata: OLMo-core's model weights are missing")
        if not (path / CHECKPOINT_METADATA).is_file():
            raise IncompleteSnapshot(
                path, f"no {CHECKPOINT_METADATA}: OLMo-core writes it last, so this save did not finish"
            )
        meta = load_json(path / CHECKPOINT_METADATA)
        state_file = path / TRAIN_DIR / "rank0.pt"
        if not state_file.is_file():  # model weights saved alone: only the step in the name is known
            return dataclasses.replace(from_name(path, tokens_per_step, self.name), meta=meta)
        state = read_train_state(state_file)
        step, tokens = state.get("global_step"), state.get("global_train_tokens_seen")
        if step is None or tokens is None:
            raise IncompleteSnapshot(state_file, "no integer global_step and global_train_tokens_seen")
        tokens, step = validate_metadata({"tokens": tokens, "step": step}, state_file)  # `True` is not 1
        record = {"global_step": step, "global_train_tokens_seen": tokens, **meta}
        record["world_size"] = state.get("world_size")
        return Snapshot(path, tokens=tokens, step=step, source=self.name, meta=record, layout=self.name)

    def open(self, path: Path) -> Reader:
        return DCPReader(path / MODEL_DIR, model_key="model")  # nested or flat model.* keys both load

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        from pmakit.formats import dcp_io

        # Under ``model`` as OLMo-core saves it: ``state_dict_to_load`` asks for ``model.<name>`` keys.
        dcp_io.save({"model": merged}, out / MODEL_DIR, distributed=distributed, fsync=fsync)
        if distributed and torch.distributed.get_rank() != 0:
            return []
        files = [f"{MODEL_DIR}/{f.name}" for f in sorted((out / MODEL_DIR).iterdir()) if f.is_file()]
        if (template / TRAIN_DIR).is_dir():
            shutil.copytree(template / TRAIN_DIR, out / TRAIN_DIR, ignore=_outside(template))
            files += [f"{TRAIN_DIR}/{f.name}" for f in sorted((out / TRAIN_DIR).iterdir()) if f.is_file()]
        # Last, as OLMo-core does: it marks the checkpoint complete.
        shutil.copy2(template / CHECKPOINT_METADATA, out / CHECKPOINT_METADATA)
        return [*files, CHECKPOINT_METADATA]


def _outside(template: Path) -> Callable[[str, list[str]], set[str]]:
    """For ``copytree``: the entries that resolve outside the checkpoint (symlinks to elsewhere), with a warning."""

    def ignore(directory: str, names: list[str]) -> set[str]:
        skipped = {n for n in names if not resolves_inside(Path(directory) / n, template)}
        for name in sorted(skipped):
            log.warning("not copying %s: it resolves outside %s", Path(directory) / name, template)
        return skipped

    return ignore


LAYOUT = OLMoCoreLayout()
