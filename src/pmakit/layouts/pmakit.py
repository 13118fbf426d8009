"""pmakit's own snapshots: weights in any supported format plus ``pmakit.json`` (step, tokens, lr, loss), written
last, so a directory without it is incomplete."""

from __future__ import annotations

from pathlib import Path

from pmakit.formats import detect_format
from pmakit.layouts.base import (
    METADATA_FILE,
    IncompleteSnapshot,
    Layout,
    Snapshot,
    float_or_none,
    load_json,
    validate_metadata,
)


class PmakitLayout(Layout):
    name = "pmakit"

    def is_snapshot(self, path: Path) -> bool:
        return (path / METADATA_FILE).is_file()

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        require_weights(path)
        meta_file = path / METADATA_FILE
        meta = load_json(meta_file)
        tokens, step = validate_metadata(meta, meta_file)
        return Snapshot(
            path,
            tokens=tokens,
            step=step,
            lr=float_or_none(meta.get("lr")),
            loss=float_or_none(meta.get("loss")),
            source=self.name,
            meta=meta,
            layout=self.name,
        )


def require_weights(path: Path) -> None:
    """Weights at the top level of ``path`` in a format pmakit reads, or an ``IncompleteSnapshot``."""
    if detect_format(path) is None:
        raise IncompleteSnapshot(path, "no weights (model.safetensors, shards + index, *.pt/*.bin, or DCP)")


LAYOUT = PmakitLayout()
