"""DCP metadata is read with an allow-list: a pickle that would run code is refused, data paths stay inside."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pmakit.errors import PmakitError
from pmakit.formats.dcp_io import DCPReader, read_metadata


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, ("touch pwned",))


def _checkpoint(path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.arange(6.0).reshape(3, 2)}, checkpoint_id=path, no_dist=True)
    return path


def test_code_in_metadata_is_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(PmakitError, match="refused to unpickle posix.system|refused to unpickle os.system"):
        read_metadata(ckpt)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_data_files_outside_the_checkpoint_are_refused(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    assert torch.equal(DCPReader(ckpt).read("w", 0, 6), torch.arange(6.0))  # mapped from the .distcp file
    metadata = read_metadata(ckpt)
    for info in metadata.storage_data.values():
        info.relative_path = "../../secret.distcp"
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(PmakitError, match="outside"):
        DCPReader(ckpt)
