"""A plain torch.distributed.checkpoint directory (``.metadata`` + ``*.distcp``) with no training metadata, such
as ``step-N/`` dirs saved by a custom loop: tokens are the step in its name x ``--tokens-per-step``. The model
state is at the top level or under ``model`` (see ``formats.dcp_io``). Written back (``--format dcp``) with the
model's names at the top level."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from pmakit.formats import dcp_io
from pmakit.layouts.base import Layout, Snapshot, from_name


class DCPLayout(Layout):
    name = "dcp"
    generic = True

    def is_snapshot(self, path: Path) -> bool:
        return (path / dcp_io.METADATA_FILE).is_file()

    def read(self, path: Path, tokens_per_step: int | None) -> Snapshot:
        return from_name(path, tokens_per_step, self.name)

    def write(
        self,
        merged: Mapping[str, torch.Tensor],
        template: Path,
        out: Path,
        *,
        distributed: bool,
        fsync: bool,
    ) -> list[str]:
        dcp_io.save(merged, out, distributed=distributed, fsync=fsync)
        return written_dcp_files(out)


def written_dcp_files(directory: Path) -> list[str]:
    """The DCP files in ``directory`` (``.metadata`` and every rank's ``*.distcp``), relative names."""
    return sorted(
        f.name
        for f in directory.iterdir()
        if f.is_file() and (f.suffix == ".distcp" or f.name == ".metadata")
    )


LAYOUT = DCPLayout()
