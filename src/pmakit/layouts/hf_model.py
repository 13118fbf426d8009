"""A plain model directory (HF ``save_pretrained``, or torch ``*.pt`` state dicts) with no training metadata: the
token count is the step in its name (``step-500``, ``iter_0000500``) x ``--tokens-per-step``."""

from __future__ import annotations

from pathlib import Path

from pmakit.formats import detect_format
from pmakit.layouts.base import Layout, Snapshot, from_name


class HFModelLayout(Layout):
    name = "hf-model"
    generic = True

    def is_snapshot(self, path: Path) -> bool:
        return detect_format(path) is not None

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        return from_name(path, tokens_per_step, self.name)


LAYOUT = HFModelLayout()
