"""No pickle pmakit reads can change a class or an object it did not build (formats/safe_pickle.py).

The attacks are written as raw opcode streams: BUILD, SETITEM, APPEND and ``__setstate__`` aimed at every global
the DCP ``.metadata`` and ``.distcp`` record readers allow, and at the class objects themselves. After each, every
allowed class's ``__dict__`` must be what it was; the only outcome besides a clean result is a ``PmakitError``.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import io
import pathlib
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import run_cli, state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.formats import dcp_io, safe_pickle, torch_record
from pmakit.formats.dcp_io import read_metadata


def _allowed_classes() -> dict[tuple[str, str], Any]:
    """Every global either unpickler names, resolved to the real object it stands for."""
    import importlib

    refs = set(dcp_io._metadata_pickles().constructors) | set(torch_record._record_pickles().constructors)
    refs |= set(dcp_io._object_pickles().constructors)
    refs |= set(dcp_io._metadata_pickles().constants) | {("pathlib", "PosixPath"), ("builtins", "object")}
    found = {}
    for module, name in sorted(refs):
        try:
            found[(module, name)] = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    return found


def _snapshot(classes: dict[tuple[str, str], Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {ref: dict(getattr(obj, "__dict__", {})) for ref, obj in classes.items() if isinstance(obj, type)}


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _attacks(module: str, name: str) -> list[bytes]:
    """Opcode streams that try to write into the global itself or into an object it makes."""
    g = _global(module, name)
    state = b"}" + _unicode("is_file") + _unicode("pwned") + b"s"  # {"is_file": "pwned"}
    slot_state = b"N" + state + b"\x86"  # (None, {...}): BUILD's setattr path
    return [
        b"\x80\x02" + g + slot_state + b"b.",  # BUILD on the class: setattr(cls, "is_file", ...)
        b"\x80\x02" + g + state + b"b.",  # BUILD with a dict state on the class
        b"\x80\x02" + g + _unicode("parts") + _unicode("x") + b"s.",  # SETITEM on the class
        b"\x80\x02" + g + _unicode("x") + b"a.",  # APPEND on the class
        b"\x80\x02" + g + b")\x81" + slot_state + b"b.",  # NEWOBJ, then BUILD on the instance
        b"\x80\x02" + g + b")R" + slot_state + b"b.",  # a call, then BUILD on what it returned
        b"\x80\x02" + g + b")\x81" + _unicode("k") + _unicode("v") + b"s.",  # SETITEM on an instance
        b"\x80\x02"
        + _global("builtins", "setattr")
        + g
        + _unicode("parts")
        + b")\x87R.",  # setattr(cls, ...)
        b"\x80\x02"
        + _global("builtins", "getattr")
        + g
        + _unicode("__setstate__")
        + b"\x86R"
        + state
        + b"\x85R.",
    ]


def _assert_refused_or_plain(data: bytes, allowed: safe_pickle.Allowed, persistent: bool = False) -> None:
    with contextlib.suppress(PmakitError):
        safe_pickle.loads(data, allowed, persistent_ids=persistent)


_READERS = {
    "metadata": dcp_io._metadata_pickles,
    "record": torch_record._record_pickles,
    "object": dcp_io._object_pickles,
}


@pytest.mark.parametrize("reader", sorted(_READERS))
def test_no_opcode_stream_touches_an_allowed_class(reader: str) -> None:
    allowed = _READERS[reader]()
    classes = _allowed_classes()
    before = _snapshot(classes)
    for module, name in classes:
        for attack in _attacks(module, name):
            _assert_refused_or_plain(attack, allowed, persistent=reader != "metadata")
    assert _snapshot(classes) == before
    assert pathlib.PosixPath("/a/b").is_file is not None and pathlib.PosixPath("/a/b").parts == (
        "/",
        "a",
        "b",
    )


def _path_attack(parts: bool) -> bytes:
    """The audit's pickle: BUILD on the class pathlib.PosixPath itself, setting ``parents = ()``, ``is_file =
    PosixPath`` and (``parts``) ``parts = ()``."""
    items = _unicode("parents") + b")" + _unicode("is_file") + _global("pathlib", "PosixPath")
    if parts:
        items += _unicode("parts") + b")"
    return b"\x80\x02" + _global("pathlib", "PosixPath") + b"N}(" + items + b"u\x86b."


def test_the_path_attacks_change_nothing(tmp_path: Path) -> None:
    """The audit's pickle: a .metadata naming only pathlib.PosixPath, setting PosixPath.parents and .is_file."""
    attack = _path_attack(parts=True)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(attack)
    with pytest.raises(PmakitError, match="unreadable DCP metadata"):
        read_metadata(ckpt)
    assert pathlib.PosixPath("/a/b").parts == ("/", "a", "b")
    assert pathlib.PosixPath("/a/b").parents[0] == pathlib.PosixPath("/a")
    assert not isinstance(pathlib.PosixPath.__dict__.get("is_file"), type)


def test_the_path_attack_through_the_cli_deletes_nothing(tmp_path: Path) -> None:
    """With the attack in place, ``merge RUN/checkpoint -o RUN/checkpoint --force`` is still refused and loses
    nothing (the audit saw exit 0 and three inputs and a user's file deleted)."""
    import torch.distributed.checkpoint as dcp

    run = tmp_path / "run" / "checkpoint"
    for step in (1, 2, 3):
        dcp.save({"w": torch.full((4,), float(step))}, checkpoint_id=run / f"step-{step}", no_dist=True)
        (run / f"step-{step}" / "pmakit.json").write_text(f'{{"step": {step}, "tokens": {step * 100}}}')
    user_file = run / "notes.txt"
    user_file.write_text("mine")
    attack = _path_attack(parts=False)
    (run / "step-3" / ".metadata").write_bytes(attack)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = run_cli("merge", run, "--last", "3", "-o", run, "--force")
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert user_file.read_text() == "mine"


def test_a_data_file_outside_the_checkpoint_is_refused_whatever_the_pickle_says(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "a" / "b" / "ckpt"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=ckpt, no_dist=True)
    text = (ckpt / ".metadata").read_bytes()
    name = next(f.name for f in ckpt.glob("*.distcp")).encode()
    evil = b"../../../outside.distcp"
    # a SHORT_BINUNICODE of the data file's name becomes one that leaves the directory
    patched = text.replace(bytes([0x8C, len(name)]) + name, bytes([0x8C, len(evil)]) + evil)
    assert patched != text
    (ckpt / ".metadata").write_bytes(patched)
    with pytest.raises(PmakitError, match="outside the checkpoint"):
        read_metadata(ckpt)


def test_real_metadata_reads_the_same(tmp_path: Path) -> None:
    """What torch's own reader makes of a real .metadata, pmakit's makes too (field by field)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    ckpt = tmp_path / "ckpt"
    sd = {"model": {"w": torch.randn(4, 3), "b": torch.randn(3).bfloat16()}, "extra": io.BytesIO(b"abc")}
    dcp.save(sd, checkpoint_id=ckpt, no_dist=True)
    ours, theirs = read_metadata(ckpt), FileSystemReader(ckpt).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data
    assert ours.planner_data == theirs.planner_data


def test_nesting_sharing_and_cycles_are_bounded() -> None:
    allowed = dcp_io._metadata_pickles()
    deep = b"\x80\x02" + b"]" * 5000 + b"a" * 4999 + b"."
    with pytest.raises(PmakitError, match="depth"):
        safe_pickle.loads(deep, allowed)
    # a list that holds itself
    cycle = b"\x80\x02]q\x00h\x00a."
    with pytest.raises(PmakitError, match="cycle"):
        safe_pickle.loads(cycle, allowed)
    # 40 levels of [x, x] sharing: 2**40 paths, 40 objects; rebuilt once each
    shared = b"\x80\x02N" + b"q\x00h\x00h\x00\x86" * 40 + b"."
    value = safe_pickle.loads(shared, allowed)
    assert value[0] is value[1]


def _real_metadata() -> bytes:
    import tempfile

    import torch.distributed.checkpoint as dcp

    with tempfile.TemporaryDirectory() as d:
        dcp.save({"model": {"w": torch.randn(2, 3)}, "x": io.BytesIO(b"1")}, checkpoint_id=d, no_dist=True)
        return (Path(d) / ".metadata").read_bytes()


def _real_record() -> bytes:
    buffer = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.float32), buffer)
    import zipfile

    with zipfile.ZipFile(buffer) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


_OPCODES = [op.code.encode("latin-1") for op in pickletools.opcodes]
_SEEDS = [_real_metadata(), _real_record()]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.sampled_from(_SEEDS),
    cuts=st.lists(st.tuples(st.integers(0, 4000), st.integers(0, 40)), max_size=4),
    inserts=st.lists(
        st.tuples(st.integers(0, 4000), st.sampled_from(_OPCODES), st.binary(max_size=8)), max_size=6
    ),
    raw=st.binary(max_size=200),
)
def test_random_opcode_streams_never_change_a_class_nor_raise_anything_else(
    seed: bytes, cuts: list[tuple[int, int]], inserts: list[tuple[int, bytes, bytes]], raw: bytes
) -> None:
    classes = _allowed_classes()
    before = _snapshot(classes)
    data = bytearray(seed)
    for at, n in cuts:
        del data[at % (len(data) + 1) : at % (len(data) + 1) + n]
    for at, op, arg in inserts:
        data[at % (len(data) + 1) : at % (len(data) + 1)] = op + arg
    for stream in (bytes(data), raw, b"\x80\x02" + raw):
        _assert_refused_or_plain(stream, dcp_io._metadata_pickles())
        _assert_refused_or_plain(stream, torch_record._record_pickles(), persistent=True)
        _assert_refused_or_plain(stream, dcp_io._object_pickles(), persistent=True)
        with contextlib.suppress(PmakitError):
            dcp_io.loads_object(stream)
    assert _snapshot(classes) == before


def test_trainer_classes_become_inert_records() -> None:
    data = pickle.dumps(None)
    assert safe_pickle.loads(data, dcp_io._metadata_pickles()) is None
    stream = b"\x80\x02" + _global("olmo_core.foo", "Bar") + b")\x81}" + _unicode("a") + b"K\x01sb."
    value = safe_pickle.loads(stream, dcp_io._metadata_pickles())
    assert value == safe_pickle.StandIn(("olmo_core.foo", "Bar"), (), {"a": 1})


def test_a_fifo_named_as_the_metadata_is_refused_without_blocking(tmp_path: Path) -> None:
    import os

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.mkfifo(ckpt / ".metadata")
    with pytest.raises(PmakitError, match="not a regular file"):
        read_metadata(ckpt)


def test_safetensors_snapshot_still_merges(tmp_path: Path) -> None:
    """The hardening is DCP-only: an ordinary run merges as before (guards against a broken import)."""
    for i in range(2):
        write_snapshot(tmp_path / "run" / f"step-{i}", state(i), step=i, tokens=100 * (i + 1))
    result = run_cli("merge", tmp_path / "run", "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr


def test_claims_the_vm_would_allocate_before_checking_are_refused_first() -> None:
    """A 10-byte pickle asking for a memo slot at index 4e9 (the VM grows its memo to 32 GB): refused by the scan
    before the VM runs; a BYTEARRAY8 of a terabyte: refused by the VM, which checks the length against the bytes
    left before it allocates. One error each, never a MemoryError."""
    allowed = dcp_io._metadata_pickles()
    memo = b"\x80\x04N" + b"r" + struct.pack("<I", 4_000_000_000) + b"."
    buffer = b"\x80\x05\x96" + struct.pack("<Q", 2**40) + b"."
    for data, words in ((memo, "refused"), (buffer, "bytes in a bytearray8, but only 1 remain")):
        with pytest.raises(PmakitError, match=words) as refused:
            safe_pickle.loads(data, allowed)
        assert "MemoryError" not in str(refused.value)


class _Kind(enum.Enum):
    A = 1


def test_loads_object_reads_a_common_state_as_plain_data() -> None:
    """What Megatron saves as its common state (a ``torch.save`` of a dict with ``args``, an enum, a set, an
    OrderedDict): read without calling anything; the Namespace fresh, the enum an inert record."""
    import argparse

    args = argparse.Namespace(seq_length=8, consumed_train_samples=3, kind=_Kind.A, ranks={1, 2})
    buffer = io.BytesIO()
    torch.save({"args": args, "iteration": 5, "groups": collections.OrderedDict(lr=0.1)}, buffer)
    before = dict(vars(argparse.Namespace))
    common = dcp_io.loads_object(buffer.getvalue())
    assert dict(vars(argparse.Namespace)) == before
    assert common["iteration"] == 5 and common["groups"] == {"lr": 0.1}
    assert common["args"].seq_length == 8 and common["args"].ranks == {1, 2}
    assert common["args"].kind == safe_pickle.StandIn((_Kind.__module__, "_Kind"), (1,), None)
    assert dcp_io.loads_object(pickle.dumps([1, "a"])) == [1, "a"]
    # a call of any global stays a record: nothing runs
    evil = b"\x80\x02" + _global("os", "system") + _unicode("touch /tmp/pwned") + b"\x85R."
    assert dcp_io.loads_object(evil) == safe_pickle.StandIn(("os", "system"), ("touch /tmp/pwned",), None)
    for bad in (b"PK\x03\x04garbage", b"", b"\x80\x02" + _global("argparse", "Namespace") + b")\x81K\x01b."):
        with pytest.raises(PmakitError):
            dcp_io.loads_object(bad)
