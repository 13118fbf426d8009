"""Crafted DCP checkpoints: damaged ``.distcp`` records and chunk metadata that lies about the tensor it tiles.

Each must end in one ``Error:`` line that names the file at fault, with nothing written; never a traceback.
"""

from __future__ import annotations

import io
import mmap
import pickle
import random
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from pmakit.errors import PmakitError
from pmakit.formats import dcp_io
from pmakit.formats.torch_record import record_view


def _run(tmp_path: Path) -> tuple[Path, Path]:
    """Two DCP snapshots of one [4, 3] tensor: (run dir, the newest snapshot)."""
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run"
    for step in (1, 2):
        ckpt = run / f"step-{step}"
        dcp.save({"w": torch.full((4, 3), float(step))}, checkpoint_id=ckpt, no_dist=True)
        (ckpt / "pmakit.json").write_text(f'{{"step": {step}, "tokens": {step * 100}}}')
    return run, run / "step-2"


def _rewrite_record(ckpt: Path, edit: dict[str, bytes]) -> Path:
    """Replace members of the snapshot's one ``torch.save`` record (stored, uncompressed); fix up .metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(ckpt).read_metadata()
    (info,) = metadata.storage_data.values()
    file = ckpt / info.relative_path
    blob = file.read_bytes()
    old = zipfile.ZipFile(io.BytesIO(blob[info.offset : info.offset + info.length]))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for name in old.namelist():
            key = next((k for k in edit if name.endswith(k)), None)
            new.writestr(zipfile.ZipInfo(name), edit[key] if key else old.read(name))
    record = out.getvalue()
    file.write_bytes(blob[: info.offset] + record + blob[info.offset + info.length :])
    info.length = len(record)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    return file


def _one_error_line(result, *, names: str) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert names in lines[0], lines[0]


@pytest.mark.parametrize(
    "pkl",
    [
        b"",  # empty: the audit saw only "Aborted!" (an EOFError reaching click)
        b"\x80\x02ccollections\nOrderedDict\n)R}X\x04\x00\x00\x00sizeK\x01sb.",  # BUILD on an OrderedDict
        b"\x80\x02X\x01\x00\x00\x00a}X\x01\x00\x00\x00bK\x01sb.",  # BUILD on a str
    ],
)
def test_a_damaged_record_names_its_file(tmp_path: Path, pkl: bytes) -> None:
    run, ckpt = _run(tmp_path)
    file = _rewrite_record(ckpt, {"data.pkl": pkl})
    result = run_cli("merge", run, "-o", tmp_path / "out")
    _one_error_line(result, names=str(file))
    assert not (tmp_path / "out").exists()


def test_chunks_covering_half_a_tensor_are_refused(tmp_path: Path) -> None:
    """A .metadata whose one chunk of a [4, 3] tensor is [2, 3]: the merge read 6 values for 12 (a RuntimeError
    traceback in the accumulator)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    run, ckpt = _run(tmp_path)
    metadata = FileSystemReader(ckpt).read_metadata()
    entry = metadata.state_dict_metadata["w"]
    assert isinstance(entry, TensorStorageMetadata)
    entry.chunks[0].sizes = torch.Size([2, 3])
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    result = run_cli("merge", run, "-o", tmp_path / "out")
    _one_error_line(result, names=str(ckpt / ".metadata"))
    assert "6 elements" in result.stderr
    assert not (tmp_path / "out").exists()


def _md(size: list[int], chunks: list[tuple[list[int], list[int]]]):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    boxes = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    return TensorStorageMetadata(TensorProperties(torch.float32), torch.Size(size), boxes)


@pytest.mark.parametrize(
    ("size", "chunks", "match"),
    [
        ([4, 3], [([0, 0], [2, 3]), ([1, 0], [3, 3])], "outside|overlap|elements"),  # overlap + too many
        ([4, 3], [([0, 0], [2, 3]), ([3, 0], [2, 3])], "outside"),  # past the end
        (
            [4, 3],
            [([0, 0], [4, 2]), ([0, 1], [4, 1]), ([0, 2], [4, 0])],
            "overlap",
        ),  # right count, overlapping
        ([4, 3], [([0, 0], [2, 3])], "elements"),  # a gap
        ([4, 3], [([0, 0, 0], [4, 3, 1])], "dims"),
        ([], [([], []), ([], [])], "elements|overlap"),
    ],
)
def test_check_chunks_refuses_what_does_not_tile(size, chunks, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PmakitError, match=match):
        dcp_io.check_chunks("w", _md(size, chunks))


@pytest.mark.parametrize(
    ("size", "chunks"),
    [
        ([4, 3], [([0, 0], [4, 3])]),
        ([4, 3], [([2, 0], [2, 3]), ([0, 0], [2, 3])]),  # dim-0 shards, out of order
        ([2, 4, 6], [([i, 0, j], [1, 4, 3]) for i in range(2) for j in (0, 3)]),  # TP on the last dim
        ([], [([], [])]),
        ([0, 3], [([0, 0], [0, 3])]),
    ],
)
def test_check_chunks_accepts_real_tilings(size, chunks) -> None:  # type: ignore[no-untyped-def]
    dcp_io.check_chunks("w", _md(size, chunks))


def test_record_view_returns_none_for_any_damaged_record() -> None:
    """Bytes of a record mutated at random: the mapped reader either maps it or declines (None), whatever zipfile
    makes of them (NotImplementedError for a forged version, RuntimeError for an 'encrypted' member, EOFError)."""
    buffer = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.float32), buffer)
    record = buffer.getvalue()
    rng = random.Random(0)
    for _ in range(1500):
        data = bytearray(record)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        mm = mmap.mmap(-1, len(data))
        mm.write(bytes(data))
        view = record_view(mm, 0, len(data), torch.float32, (6,))
        assert view is None or view.numel() == 6


@pytest.mark.parametrize(
    "ref",
    [
        ("argparse", "Namespace"),  # becomes pmakit's stand-in
        ("collections", "OrderedDict"),
        ("torch", "Size"),
        ("torch._utils", "_rebuild_tensor_v2"),
        ("torch", "float32"),
    ],
)
def test_common_pt_cannot_build_on_a_class(tmp_path: Path, ref: tuple[str, str]) -> None:
    """Megatron's ``common.pt`` goes through ``torch.load(weights_only=True)`` with a stand-in class: its
    unpickler refuses BUILD/SETITEM/APPEND on a class object (checked here on the real reader), so a pickle cannot
    change the stand-in or a class torch allows."""
    import importlib

    from pmakit.layouts import megatron
    from pmakit.layouts.base import IncompleteSnapshot

    module, name = ref
    target = (
        megatron._StandIn
        if ref == ("argparse", "Namespace")
        else getattr(importlib.import_module(module), name)
    )
    before = _observable(target)
    g = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    state = b"}X\x07\x00\x00\x00is_fileX\x05\x00\x00\x00pwneds"
    for body, op in (
        (b"N" + state + b"\x86b", "build"),  # BUILD with (None, {is_file: pwned}): setattr
        (state + b"b", "build"),  # BUILD with {is_file: pwned}: __dict__.update
        (b"X\x01\x00\x00\x00kK\x01s", "SETITEM"),
        (b"K\x01a", "append"),
    ):
        buffer = io.BytesIO()
        torch.save({"iteration": 1}, buffer)
        file = tmp_path / "common.pt"
        file.write_bytes(buffer.getvalue())
        _rewrite_zip(file, b"\x80\x02" + g + body + b".")
        with pytest.raises(
            IncompleteSnapshot, match="refused: holds objects other than plain data"
        ) as caught:
            megatron.read_common(file)
        # refused by the weights_only unpickler at that very opcode, not an error of another kind on the way
        assert f"Can only {op}" in str(caught.value.__cause__), caught.value.__cause__
    assert _observable(target) == before and not hasattr(target, "is_file")


def _observable(target: object) -> dict[str, object]:
    """What a pickle could change on ``target``: its ``__dict__`` or, for an object without one (torch.float32, a
    dtype), the values of its attributes (not an empty dict to compare with an empty dict)."""
    own = getattr(target, "__dict__", None)
    return dict(own) if own is not None else {name: getattr(target, name) for name in dir(target)}


def _rewrite_zip(file: Path, pkl: bytes) -> None:
    old = zipfile.ZipFile(io.BytesIO(file.read_bytes()))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as new:
        for name in old.namelist():
            new.writestr(zipfile.ZipInfo(name), pkl if name.endswith("data.pkl") else old.read(name))
    file.write_bytes(out.getvalue())
