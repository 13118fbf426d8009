"""Run layouts: how each trainer lays out its checkpoints, one small module per layout behind one interface.

A layout (``base.Layout``) answers five questions about a trainer's save folder:

- ``is_snapshot(path)``: is this directory one checkpoint of mine? Cheap (file names only), complete or not.
  ``ignore(path)``: is it mine but not to merge nor to search (OLMo-core's ``stepN-merged``)?
- ``snapshots(save_folder)``: my candidate checkpoints directly in a save folder (default: the children for which
  ``is_snapshot`` holds; hidden directories never). Loose files (Megatron's ``latest_checkpointed_iteration.txt``)
  are never candidates.
- ``read(path, tokens_per_step) -> Snapshot``: step, tokens, lr, loss from the trainer's own metadata, read
  safely (JSON, or ``torch.load(weights_only=True)`` with an allow-list; never arbitrary unpickling). ``source``
  and ``layout`` are the layout's name (``source`` is ``name`` when tokens = step in the name x tokens_per_step).
  Raise ``IncompleteSnapshot`` when there are no weights or no token count: the scan reports it and moves on.
- ``open(path) -> formats.Reader``: the MODEL WEIGHTS only, named as the framework's model names them. Optimizer,
  scheduler, RNG, data loader and trainer state are never averaged (list them in ``Reader.skipped``). What kind
  of state each tensor is (a weight, a router's load-balancing bias, a counter) is decided by ``kinds.classify``
  from its name and dtype (add a framework's names to ``kinds.PATTERNS``); the merge applies the kind's rule.
  Non-tensor extra state is the writer's business.
- ``write(merged, template, out, distributed=, fsync=) -> files``: write the merged weights back in this layout
  so that the framework's own loader loads ``out``. ``merged`` holds this rank's tensors as views of
  memory-mapped staged files: write tensor by tensor or shard by shard, never all of it in memory (no fp32 copy
  of the model). Copy what is not averaged (configs, ``common.pt``, ``_extra_state``) from ``template``, the
  newest input. ``native_format = name`` makes this the default output of ``pmakit merge`` for such inputs;
  ``--format safetensors`` still writes HF safetensors under ``open``'s names, or HF names where the layout has a
  ``safetensors_format(snapshot)`` naming a writer that converts them (torchtitan's state-dict adapter).

Registration: ``LAYOUTS`` is ordered and the first layout whose ``is_snapshot`` holds wins, so framework layouts
come before the generic ones (``dcp`` and ``hf-model`` match any directory with top-level weights). A module
defines ``LAYOUT = MyLayout()`` and is listed in ``_BUILTIN``. Reading a framework's checkpoints must not need the
framework installed. Tests go in ``tests/layouts/``, with checkpoints written by the framework's own code.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from pmakit.errors import PmakitError
from pmakit.formats import Reader, open_reader
from pmakit.layouts.base import IncompleteSnapshot, Layout, Snapshot, is_merge_output

__all__ = [
    "LAYOUTS",
    "IncompleteSnapshot",
    "Layout",
    "Snapshot",
    "candidates",
    "get_layout",
    "layout_of",
    "open_weights",
    "out_formats",
]

_BUILTIN = (
    "pmakit",
    # Framework layouts go here, before the generic ones below.
    "olmo_core",
    "megatron",
    "lightning",  # .ckpt files
    "torchtitan",
    "torchtitan_hf",  # an output format only (--format safetensors of torchtitan inputs: HF names)
    "hf_trainer",
    "dcp",
    "hf_model",
)
LAYOUTS: list[Layout] = []


def _layouts() -> list[Layout]:
    if not LAYOUTS:
        LAYOUTS.extend(importlib.import_module(f"pmakit.layouts.{m}").LAYOUT for m in _BUILTIN)
    return LAYOUTS


def get_layout(name: str) -> Layout:
    """The layout called ``name``; an unknown name lists the known ones."""
    for layout in _layouts():
        if layout.name == name:
            return layout
    raise PmakitError(f"unknown layout {name!r}; known: {', '.join(x.name for x in _layouts())}")


def layout_of(path: str | os.PathLike[str]) -> Layout | None:
    """The first layout that recognises ``path`` as one of its checkpoints (None for an ignored directory or
    one no layout knows). A file is a checkpoint only of a ``single_file`` layout (Lightning's ``.ckpt``)."""
    path = Path(path)
    if path.is_file():
        return next((x for x in _layouts() if x.single_file and x.is_snapshot(path)), None)
    if not path.is_dir():
        return None
    for layout in _layouts():
        if layout.ignore(path):
            return None
        if layout.is_snapshot(path):
            return layout
    return None


def open_weights(path: str | os.PathLike[str]) -> Reader:
    """The model weights of a checkpoint directory of any layout (headers only)."""
    layout = layout_of(path)
    return layout.open(Path(path)) if layout is not None else open_reader(path)


def candidates(folder: Path, depth: int = 2) -> list[tuple[Path, Layout]]:
    """Checkpoint directories in a save folder with the layout that claims each, in path order.

    Each layout lists its own candidates; a directory claimed by an earlier layout, ignored by any layout, hidden,
    or a merged output is not offered again. Folders no layout claims are searched ``depth - 1`` levels further
    (``RUN/snapshots/``, torchtitan's ``checkpoint/``).
    """
    layouts = _layouts()
    claimed: dict[Path, Layout] = {}
    ignored = {c for c in folder.iterdir() if c.is_dir() and any(x.ignore(c) for x in layouts)}
    for layout in layouts:
        for path in layout.snapshots(folder):
            if path not in claimed and path not in ignored and not is_merge_output(path):
                claimed.setdefault(path, layout)
    found = list(claimed.items())
    if depth > 1:
        for child in sorted(folder.iterdir()):
            if (
                child.is_dir()
                and not child.name.startswith(".")
                and child not in claimed
                and child not in ignored
                and not is_merge_output(child)
            ):
                found += candidates(child, depth - 1)
    return sorted(found, key=lambda item: item[0])


def out_formats() -> list[str]:
    """``--format`` choices: HF safetensors, and every layout that writes itself back."""
    return ["safetensors", *(x.name for x in _layouts() if type(x).write is not Layout.write)]


def writer(out_format: str) -> Layout:
    """The layout that writes ``out_format`` (anything but safetensors)."""
    layout = next((x for x in _layouts() if x.name == out_format), None)
    if layout is None or type(layout).write is Layout.write:
        raise PmakitError(f"unknown output format {out_format!r}; use {' or '.join(out_formats())}")
    return layout


def native_format(snapshot: Snapshot) -> str:
    """What a merge whose newest input is ``snapshot`` writes by default: that input's own layout."""
    try:
        return get_layout(snapshot.layout).native_format
    except PmakitError:
        return "safetensors"  # a Snapshot made by hand (fp32 sums of a merge)


def safetensors_format(snapshot: Snapshot) -> str:
    """What ``--format safetensors`` writes for inputs like ``snapshot``: HF names through the trainer's own
    converter where its layout has one that applies (``safetensors_format`` of the layout: torchtitan's state-dict
    adapter), else HF safetensors under the inputs' names."""
    try:
        layout = get_layout(snapshot.layout)
    except PmakitError:
        return "safetensors"
    export = getattr(layout, "safetensors_format", None)
    return export(snapshot) if callable(export) else "safetensors"
