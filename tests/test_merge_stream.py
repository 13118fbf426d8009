"""The streaming engine's performance machinery: cache blocks, worker threads, early writeback."""

import contextlib
import faulthandler
import hashlib
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import pmakit.merge as merge_mod
from conftest import state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.formats import safetensors_io
from pmakit.formats.safetensors_io import OutputTensor, Shard, ShardWriter
from pmakit.layouts import open_weights
from pmakit.merge import merge, plan_merge
from pmakit.merge.stream import stream_average
from pmakit.snapshot import discover
from test_merge import assert_one_ulp, load_dir


@pytest.mark.parametrize("workers", [1, 2])
def test_blocks_and_workers_match_reference(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workers: int
) -> None:
    # embed.weight (1024 elements) -> 11 chunks of 100, each folded in blocks of 7 (a ragged last block), by two
    # workers whose chunks must still reach the writer in order.
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    monkeypatch.setattr(merge_mod.stream, "BLOCK_ELEMS", 7)
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", str(workers))
    snaps = discover(make_run(3))
    weights = [0.2, 0.3, 0.5]
    merge(snaps, weights, tmp_path / "out", fsync=True)
    got = load_dir(tmp_path / "out")
    states = [state(i) for i in range(1, 4)]
    for name in states[0]:
        if name != "step_counter":
            assert_one_ulp(got[name], states, weights, name)
    assert got["step_counter"].tolist() == [3]


# the first chunk's first block, a middle one, the last chunk's last
@pytest.mark.parametrize("where", [3, 507, 1023])
def test_nan_found_in_any_block(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int
) -> None:
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    monkeypatch.setattr(merge_mod.stream, "BLOCK_ELEMS", 7)
    run = make_run(3)
    bad = state(2)
    assert bad["embed.weight"].numel() == 1024  # chunks of 100 elements, the last 1000-1023; blocks of 7
    bad["embed.weight"].view(-1)[where] = float("nan")
    write_snapshot(run / "step-000200", bad, step=200, tokens=2000)
    snaps = discover(run)
    with pytest.raises(PmakitError, match="non-finite values.*embed.weight"):
        merge(snaps, [1 / 3] * 3, tmp_path / "out", fsync=False)
    assert not (tmp_path / "out").exists()


def test_writer_started_writeback_keeps_bytes(tmp_path: Path) -> None:
    values = torch.arange(5000, dtype=torch.float32)
    shard = Shard("model.safetensors", (OutputTensor("x", torch.float32, (5000,)),))
    writer = ShardWriter(tmp_path / "model.safetensors", shard)
    for start in range(0, 5000, 1000):
        writer.write("x", values[start : start + 1000])
        writer.start_writeback(min_bytes=0)
    writer.close(fsync=True)
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("x"), values)


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 5000, 20000])
def test_direct_writer_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    # A stage of two blocks: the bytes cross several O_DIRECT writes and end in a padded, truncated tail.
    monkeypatch.setattr(safetensors_io, "_DIRECT_STAGE", 8192)
    values = torch.arange(n, dtype=torch.int32).to(torch.uint8)
    shard = Shard(
        "model.safetensors", (OutputTensor("x", torch.uint8, (n,)), OutputTensor("y", torch.int64, (3,)))
    )
    writer = ShardWriter(tmp_path / "model.safetensors", shard, direct=True)
    for start in range(0, max(n, 1), 777):  # an empty tensor is one empty chunk
        writer.write("x", values[start : start + 777])
    writer.write("y", torch.tensor([1, 2, 3]))
    digest = writer.close(fsync=True)
    data = (tmp_path / "model.safetensors").read_bytes()
    assert hashlib.sha256(data).hexdigest() == digest
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert torch.equal(f.get_tensor("x"), values)
        assert f.get_tensor("y").tolist() == [1, 2, 3]


def test_timed_merge_writes_the_same_bytes_and_fills_its_breakdown(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)  # many chunks, a few shards: every timer runs
    snaps = discover(make_run(3))
    merge(snaps, [0.2, 0.3, 0.5], tmp_path / "plain", fsync=True, max_shard_size=2000)
    with merge_mod.stream.timed() as stats:
        merge(snaps, [0.2, 0.3, 0.5], tmp_path / "timed", fsync=True, max_shard_size=2000)
    assert merge_mod.stream._STATS is None  # the switch is off again after the block
    files = sorted(p.name for p in (tmp_path / "plain").glob("*.safetensors"))
    assert len(files) > 1
    for name in files:
        assert (tmp_path / "timed" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    s = stats.as_dict()
    # Every float tensor's chunks of 100 were folded and timed (the integer step counter is copied, not folded).
    assert s["chunks"] == sum(-(-t.numel() // 100) for k, t in state(0).items() if k != "step_counter")
    timers = ("wall", "read", "accumulate", "cast", "fold_cpu", "write", "close", "writer_cpu", "sha256")
    for key in (*timers, "hasher_cpu"):  # the checksums on a thread of their own, beside the writes
        assert s[key] > 0, key
    # The writer's own timers and its idle time add up to its life, which is within the pass; so is the hasher's.
    assert s["write"] + s["close"] + s["wait_hash"] + s["wait_chunk"] <= s["wall"] + 0.01
    assert s["sha256"] <= s["wall"] + 0.01


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("values", "fast"),
    [
        ([0.02, -0.01, 1.0], True),  # a model's weights: decided on the fp32 block
        ([40000.0, 1.0], True),  # fp16: squares 1.6e9 under the bound (65504^2 / 2 = 2.1e9), and finite
        ([60000.0, 1.0], False),  # fp16: over the bound, so checked exactly: finite (60000 fits); bf16: fast
        ([70000.0, 1.0], False),  # fp16: Inf once cast; bf16: fast
        ([3.4e38, 0.0], False),  # finite in fp32, beyond bf16's largest value (and fp16's): Inf once cast
        ([float("nan"), 1.0], False),
        ([float("-inf"), 1.0], False),
    ],
)
def test_cast_check_agrees_with_the_cast(dtype: torch.dtype, values: list[float], fast: bool) -> None:
    acc = torch.tensor(values + [0.0] * 1000, dtype=torch.float32)
    out = torch.empty(acc.numel(), dtype=dtype)
    result = merge_mod.stream._cast_checked(acc, out, merge_mod.stream._square_limit(dtype))
    assert torch.equal(out.view(torch.int16), acc.to(dtype).view(torch.int16))
    assert math.isfinite(result) == bool(torch.isfinite(acc.to(dtype)).all())
    # The fast path answers 0.0; the exact one the cast block's (here non-zero) sum.
    fast = fast or (dtype == torch.bfloat16 and values[0] in (60000.0, 70000.0))
    assert (result == 0.0) == fast


def _staged(plan: Any, out: Path, staged: bool) -> dict[str, torch.Tensor]:
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_weights(s.path)) for s in plan.snapshots]
        out.mkdir()
        stream_average(plan, readers, out, None, False, device="cpu", staged=staged)
    return load_dir(out)


@pytest.mark.parametrize("dtype", ["same", "fp32", "fp16"])
def test_the_device_fold_on_the_cpu_writes_the_cpu_folds_bytes(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The `--device cuda` pipeline (staging buffers reused across inputs, chunks and three workers, a device
    accumulator a worker, the cast and NaN/Inf flag) run with plain CPU memory: byte for byte the CPU fold's
    output, with more chunks than staging buffers and a ragged last chunk."""
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", "3")
    snaps = discover(make_run(4))
    plan = plan_merge(snaps, [0.1, 0.2, 0.3, 0.4], dtype=dtype)
    assert plan.fold.workers == 3
    cpu, staged = _staged(plan, tmp_path / "cpu", False), _staged(plan, tmp_path / "staged", True)
    assert cpu and cpu.keys() == staged.keys()
    for name in cpu:
        assert cpu[name].dtype == staged[name].dtype and torch.equal(cpu[name], staged[name]), name


def test_the_device_fold_finds_nan_and_overflow(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(3)
    bad = state(2)
    bad["embed.weight"].view(-1)[5] = float("inf")
    write_snapshot(run / "step-000200", bad, step=200, tokens=2000)
    plan = plan_merge(discover(run), [1 / 3] * 3)
    with pytest.raises(PmakitError, match="non-finite values.*embed.weight"):
        _staged(plan, tmp_path / "nan", True)
    big = {k: v.float() * 0 + 60000 if v.is_floating_point() else v for k, v in state(1).items()}
    write_snapshot(tmp_path / "big" / "step-000100", big, step=100, tokens=1000)
    write_snapshot(tmp_path / "big" / "step-000200", big, step=200, tokens=2000)
    plan = plan_merge(discover(tmp_path / "big"), [1.0, 1.0], dtype="fp16")  # 120000: beyond fp16's range
    with pytest.raises(PmakitError, match="exceeds the range of float16"):
        _staged(plan, tmp_path / "overflow", True)


def test_checksums_beside_the_writes_are_the_one_thread_writers(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hasher thread's sha256 of every shard of a multi-shard merge (chunks of 100 through two workers and more
    chunks than buffers; a copied integer tensor among them) is the file's, and the bytes and sha256 are what a
    writer that hashes each chunk as it writes it (``ShardWriter.close``) gives for the same tensors."""
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", "2")
    snaps = discover(make_run(3))
    weights = [0.2, 0.3, 0.5]
    merge(snaps, weights, tmp_path / "out", dtype="bf16", fsync=True, max_shard_size=1500)
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    files = manifest["output"]["files"]
    plan = plan_merge(snaps, weights, dtype="bf16", max_shard_size=1500)
    assert [f["name"] for f in files] == [s.file for s in plan.shards] and len(files) >= 3
    for record, shard in zip(files, plan.shards):
        data = (tmp_path / "out" / shard.file).read_bytes()
        assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
        with safe_open(tmp_path / "out" / shard.file, framework="pt") as f:
            tensors = {t.name: f.get_tensor(t.name) for t in shard.tensors}
        one_thread = ShardWriter(tmp_path / shard.file, shard)
        for t in shard.tensors:
            one_thread.write(t.name, tensors[t.name].reshape(-1))
        assert one_thread.close(fsync=False) == record["sha256"]
        assert (tmp_path / shard.file).read_bytes() == data


@pytest.mark.parametrize("fault", ["hasher fails", "hashed bytes differ"])
def test_a_failed_checksum_fails_the_merge_and_leaves_nothing(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The hasher thread failing on the second shard, or covering other bytes than the writer wrote: the merge
    stops with that error (no hang on the buffers or the digest) and leaves no output, finished or partial."""
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    real = merge_mod.stream.header_bytes
    shards: list[int] = []

    def header(tensors: Any) -> bytes:
        shards.append(1)
        if fault == "hasher fails" and len(shards) == 2:
            raise OSError("no checksum today")
        return real(tensors) + (b" " if fault == "hashed bytes differ" else b"")

    monkeypatch.setattr(merge_mod.stream, "header_bytes", header)
    snaps = discover(make_run(3))
    expected = "no checksum today" if fault == "hasher fails" else "bytes written, .* checksummed"
    faulthandler.dump_traceback_later(600, exit=True)  # a hang: the stacks, not a suite waiting forever
    try:
        with pytest.raises((OSError, RuntimeError, PmakitError), match=expected):
            merge(snaps, [0.2, 0.3, 0.5], tmp_path / "out", fsync=False, max_shard_size=1500)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_the_device_note_for_a_merge_from_disk(make_run: Callable[..., Path]) -> None:
    """`--device cuda` on inputs read from disk: one line on what the H200 run measured, the choice kept (the
    CLI's line itself runs in tests/test_gpu.py, where there is a GPU); nothing for the CPU fold."""
    snaps = discover(make_run(2))
    note = merge_mod.device_note("cuda", snaps)
    assert note is not None and note.startswith("--device cuda: ") and "\n" not in note
    assert (
        "the GPU fold measured within the CPU fold's run-to-run spread" in note
        and "folding on the GPU as asked" in note
    )
    assert merge_mod.device_note("cpu", snaps) is None


def test_a_stopped_merge_never_leaves_the_writer_waiting_for_a_checksum(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    """The merge stopped (a NaN found, Ctrl-C) while the writer waits for a shard's digest: the hasher drops the
    chunks left, and the wait ends with an error instead of a writer thread polling forever."""
    plan = plan_merge(discover(make_run(2)), [0.5, 0.5], max_shard_size=1500)
    hasher = merge_mod.stream._Hasher(plan)
    hasher.put((0, memoryview(b"x" * 4096), None))
    hasher.aborted = True
    hasher.put(None)
    hasher.join()
    faulthandler.dump_traceback_later(600, exit=True)  # a hang: the stacks, not a suite waiting forever
    try:
        with pytest.raises(RuntimeError, match="stopped before its checksums were complete"):
            hasher.digest(0)
    finally:
        faulthandler.cancel_dump_traceback_later()
