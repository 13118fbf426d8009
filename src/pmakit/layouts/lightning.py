"""Lightning's own checkpoints: the ``.ckpt`` files ``ModelCheckpoint`` writes (``epoch=0-step=500.ckpt``).

Each ``.ckpt`` file is one checkpoint (a file, not a directory): ``pmakit inspect DIR`` lists the ``.ckpt`` files
in ``DIR`` (or one level down: ``lightning_logs/version_0/checkpoints/``), and a ``.ckpt`` path is an input of its
own. ``last.ckpt`` (``save_last``) is a copy of, or a link to, the newest save: listed only when no other file has
its step.

- Read with ``torch.load(weights_only=True)`` (plain containers and tensors only; a file that pickles anything else
  is refused, nothing in it is run): the model weights are its ``state_dict`` (the LightningModule's names);
  ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks`` and the rest are never averaged (listed in
  ``Reader.skipped``).
- Tokens: what pmakit's Lightning ``PMACallback`` recorded in the file (its callback state, ``tokens``), else
  ``global_step`` x ``--tokens-per-step``. The lr is the first optimizer's first parameter group's.
- Written back (the default output for such inputs): ``OUT/model.ckpt``, the newest input's checkpoint with its
  ``state_dict`` replaced by the merged weights. Everything else is the newest input's, unchanged: optimizer and
  lr-scheduler state, loop progress (``global_step``, epoch), callback states, hyper-parameters. So
  ``Trainer.fit(model, ckpt_path="OUT/model.ckpt")`` resumes from the newest snapshot's step with its optimizer
  moments on the merged weights, and ``Model.load_from_checkpoint`` loads the merged model. The file is written
  by one process, with the model's merged weights in memory once (as Lightning itself saves and loads it).
"""

from __future__ import annotations

import collections
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.formats import Reader
from pmakit.formats.torch_io import TorchReader, load
from pmakit.layouts.base import IncompleteSnapshot, Layout, Snapshot, _count, float_or_none
from pmakit.runs import atomic_open

SUFFIX = ".ckpt"
OUT_FILE = "model.ckpt"
_LAST = re.compile(r"last(?:-v\d+)?\.ckpt")
"""``ModelCheckpoint``'s ``save_last`` copy of the newest checkpoint (``-vN`` when the name was taken)."""
_CALLBACK = "PMACallback"
"""pmakit's Lightning callback's state key in a checkpoint's ``callbacks`` (its class name)."""


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint loaded with ``weights_only=True`` and memory-mapped (no tensor is read)."""
    try:
        ckpt = load(path)
    except PmakitError as e:
        raise IncompleteSnapshot(path, str(e).removeprefix(f"{path}: ")) from None
    if not isinstance(ckpt.get("state_dict"), Mapping):
        raise IncompleteSnapshot(path, "no state_dict: not a Lightning checkpoint")
    return ckpt


def _tokens_recorded(ckpt: dict[str, Any], path: Path) -> int | None:
    callbacks = ckpt.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return None
    for key, state in callbacks.items():
        if str(key).split("{")[0] == _CALLBACK and isinstance(state, Mapping) and "tokens" in state:
            try:
                return _count(dict(state), "tokens")
            except ValueError as e:
                raise IncompleteSnapshot(path, f"{_CALLBACK}'s state: {e}") from None
    return None


def _lr(ckpt: dict[str, Any]) -> float | None:
    optimizers = ckpt.get("optimizer_states")
    if isinstance(optimizers, list) and optimizers and isinstance(optimizers[0], Mapping):
        groups = optimizers[0].get("param_groups")
        if isinstance(groups, list) and groups and isinstance(groups[0], Mapping):
            return float_or_none(groups[0].get("lr"))
    return None


def _step(path: Path) -> int | None:
    """The checkpoint's ``global_step`` (None where unreadable: ``read`` says why, where it is listed)."""
    try:
        step = read_checkpoint(path).get("global_step")
    except IncompleteSnapshot:
        return None
    return step if isinstance(step, int) else None


class LightningLayout(Layout):
    name = "lightning"
    native_format = "lightning"
    single_file = True

    def is_snapshot(self, path: Path) -> bool:
        return path.suffix == SUFFIX and path.is_file()

    def snapshots(self, save_folder: Path) -> list[Path]:
        files = [
            f for f in sorted(save_folder.iterdir()) if not f.name.startswith(".") and self.is_snapshot(f)
        ]
        saves = [f for f in files if not _LAST.fullmatch(f.name)]
        lasts = [f for f in files if _LAST.fullmatch(f.name)]
        if not lasts:
            return files
        paths, steps = {f.resolve() for f in saves}, {_step(f) for f in saves} - {None}
        return sorted([*saves, *(f for f in lasts if f.resolve() not in paths and _step(f) not in steps)])

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        ckpt = read_checkpoint(path)
        try:
            step = _count(ckpt, "global_step")
        except ValueError as e:
            raise IncompleteSnapshot(path, str(e)) from None
        tokens, source = _tokens_recorded(ckpt, path), self.name
        if tokens is None:
            if step is None:
                raise IncompleteSnapshot(
                    path, "no global_step and no token count: not a Lightning checkpoint"
                )
            if not tokens_per_step:
                raise IncompleteSnapshot(
                    path,
                    "no token count: pass --tokens-per-step N (tokens per optimizer step), "
                    "or train with pmakit's Lightning PMACallback, which records the tokens in the checkpoint",
                )
            tokens, source = step * tokens_per_step, "name"
        record = {"global_step": step, "epoch": ckpt.get("epoch"), "tokens": tokens}
        record["lightning_version"] = ckpt.get("pytorch-lightning_version")
        return Snapshot(
            path, tokens=tokens, step=step, lr=_lr(ckpt), source=source, meta=record, layout=self.name
        )

    def open(self, path: Path) -> Reader:
        if not self.is_snapshot(path):
            raise PmakitError(f"{path}: not a Lightning {SUFFIX} file")
        return TorchReader(path, files=[path], wrappers=("state_dict",))  # never a "model" entry a hook added

    def check_inputs(self, newest: Snapshot) -> None:
        """Before any work: the output is the newest input's Lightning checkpoint with the merged weights, so the
        newest input must be one."""
        if newest.layout != self.name:
            raise PmakitError(
                f"--format {self.name} rewrites the newest input's Lightning {SUFFIX} with the merged weights, "
                f"but the newest input ({newest.path}) is a {newest.layout} checkpoint; use --format safetensors"
            )

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        if distributed:
            raise PmakitError(
                f"a Lightning {SUFFIX} is one file, written by one process: merge without torchrun, "
                "or pass --format safetensors"
            )
        ckpt = read_checkpoint(template)
        weights = ckpt["state_dict"]
        # The template's order; an entry that is not a tensor (extra state) stays the newest input's.
        ckpt["state_dict"] = collections.OrderedDict(
            (k, merged[k].clone() if k in merged else v) for k, v in weights.items()
        )
        missing = sorted(merged.keys() - weights.keys())
        if missing:
            raise PmakitError(f"{template}: has no state_dict entry {missing[0]!r} of the merged weights")
        with atomic_open(out / OUT_FILE, "wb", fsync=fsync) as f:
            torch.save(ckpt, f)
        return [OUT_FILE]


LAYOUT = LightningLayout()
