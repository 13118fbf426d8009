"""DCP snapshots (torch.distributed.checkpoint.save, 1 and 2 ranks) merge like the equivalent HF snapshots."""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from click.testing import CliRunner

import pmakit.merge as merge_mod
from conftest import SHAPES, state, write_snapshot
from pmakit.cli import cli
from pmakit.formats import open_reader
from pmakit.formats.dcp_io import DCPReader
from pmakit.merge import merge
from pmakit.snapshot import discover, write_metadata
from pmakit.weights import get_weights
from test_merge import load_dir

# Uneven dim-0 sizes so that two ranks save slabs of different sizes, and a 3-d tensor.
DCP_SHAPES = {**SHAPES, "layers.1.experts": (5, 3, 4)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_two(fn: Any, args: tuple[Any, ...], timeout: float = 1800) -> None:
    """torch.multiprocessing.spawn of 2 ranks that fails the test instead of hanging if they deadlock."""
    context = mp.spawn(fn, args=args, nprocs=2, join=False)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"2-rank processes still running after {timeout} s")


def _extras(seed: int) -> dict[str, object]:
    """What trainers save beside the model: optimizer moments, a step counter, RNG bytes."""
    return {
        "optimizer": {
            "state": {"embed.weight": {"exp_avg": torch.full((64, 16), float(seed))}},
            "step": seed,
        },
        "train_state": {"step": seed, "rng": torch.ByteTensor([1, 2, 3])},
    }


def _save_two_ranks(rank: int, port: int, saves: list[tuple[str, int, int]]) -> None:
    """One rank of FSDP-like saves: each tensor a DTensor sharded on dim 0 (or on dim 1 as tensor parallelism
    does, when the last 2-d tensors allow it), under ``model`` (OLMo-core)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for directory, seed, dim in saves:
            model = {
                k: distribute_tensor(v, mesh, [Shard(min(dim, v.dim() - 1))])
                if v.dim() > 0 and v.is_floating_point()
                else v
                for k, v in state(seed, shapes=DCP_SHAPES).items()
            }
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save({"model": model, **_extras(seed)}, checkpoint_id=directory)
    finally:
        dist.destroy_process_group()


def _dcp_snapshot(path: Path, seed: int, *, ranks: int, nested: bool) -> Path:
    """A DCP snapshot directory; ``ranks=2`` expects the checkpoint already saved there by ``_save_two_ranks``."""
    path.mkdir(parents=True, exist_ok=True)
    if ranks == 1:
        model = state(seed, shapes=DCP_SHAPES)
        tree = (
            {"model": model, **_extras(seed)} if nested else {**model, **_extras(seed)}
        )  # torchtitan: top level
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(tree, checkpoint_id=path, no_dist=True)
    (path / "config.json").write_text('{"model_type": "toy"}')
    write_metadata(path, step=seed * 100, tokens=seed * 1000)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same 3 snapshots as HF safetensors, as single-process DCP (top level) and as 2-rank DCP (nested)."""
    root = tmp_path_factory.mktemp("dcp")
    for i in range(1, 4):
        write_snapshot(
            root / "hf" / f"step-{i * 100:04d}", state(i, shapes=DCP_SHAPES), step=i * 100, tokens=i * 1000
        )
        _dcp_snapshot(root / "dcp1" / f"step-{i * 100:04d}", i, ranks=1, nested=False)
    two = [(str(root / "dcp2" / "step-0100"), 1, 0), (str(root / "dcp2" / "step-0300"), 3, 0)]
    two.append((str(root / "tp" / "step-0100"), 1, 1))
    spawn_two(_save_two_ranks, (_free_port(), two))  # one process group for both saves
    _dcp_snapshot(root / "dcp2" / "step-0100", 1, ranks=2, nested=True)
    _dcp_snapshot(root / "dcp2" / "step-0200", 2, ranks=1, nested=True)
    _dcp_snapshot(root / "dcp2" / "step-0300", 3, ranks=2, nested=True)
    return {"hf": root / "hf", "dcp1": root / "dcp1", "dcp2": root / "dcp2", "tp": root / "tp", "root": root}


def test_reader_names_shapes_and_skipped_entries(runs: dict[str, Path]) -> None:
    for run in ("dcp1", "dcp2"):
        with open_reader(runs[run] / "step-0300") as reader:
            assert reader.format == "dcp"
            want = state(3, shapes=DCP_SHAPES)
            assert set(reader.tensors) == set(want)
            for name, t in want.items():
                assert reader.tensors[name].shape == tuple(t.shape) and reader.tensors[name].dtype == t.dtype
                flat = t.reshape(-1)
                for start, stop in [
                    (0, flat.numel()),
                    (3, max(3, flat.numel() - 5)),
                    (flat.numel() - 1, flat.numel()),
                ]:
                    assert torch.equal(reader.read(name, start, stop), flat[start:stop]), (run, name, start)
            assert any("optimizer" in s or "exp_avg" in s for s in reader.skipped)
            assert any("train_state" in s for s in reader.skipped)


def test_two_rank_save_is_read_in_saved_slabs(runs: dict[str, Path]) -> None:
    with open_reader(runs["dcp2"] / "step-0300") as reader:
        units = reader._unit_boxes("layers.1.experts")  # type: ignore[attr-defined]
        assert [(lo, hi) for lo, hi, _ in units] == [(0, 36), (36, 60)]  # 5 rows of 12 split 3 + 2


@pytest.mark.parametrize("run", ["dcp1", "dcp2"])
def test_dcp_merge_equals_hf_merge(
    runs: dict[str, Path], tmp_path: Path, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 100 elements cross the saved slabs' boundaries.
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    w = get_weights("ema", 3)
    merge(discover(runs["hf"]), w, tmp_path / "hf", fsync=False)
    merge(discover(runs[run]), w, tmp_path / "dcp", fsync=False)
    assert load_dir(tmp_path / "hf").keys() == load_dir(tmp_path / "dcp").keys()
    for name, t in load_dir(tmp_path / "hf").items():
        assert torch.equal(t, load_dir(tmp_path / "dcp")[name]), name
    manifest = json.loads((tmp_path / "dcp" / "pmakit-merge.json").read_text())
    assert manifest["inputs"][0]["format"] == "dcp"
    assert any("exp_avg" in s for s in manifest["skipped_entries"])
    assert (tmp_path / "dcp" / "config.json").exists()


def test_merge_chunks_are_cut_at_the_saved_slabs(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merge chunk across two saved slabs is read as a copy joining them (one per input for each chunk in flight):
    the merge cuts its chunks where a reader's pieces begin (``Reader.breaks``), so that each read lies in one slab.
    Pieces under ``MIN_PIECE_ELEMS`` on average are read joined (a chunk each would cost more than the copy)."""
    monkeypatch.setattr(merge_mod.plan, "CHUNK_ELEMS", 100)
    reads: list[tuple[Any, str, int, int]] = []
    real = DCPReader.read

    def spy(
        self: DCPReader, name: str, start: int, stop: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        reads.append((self, name, start, stop))
        return real(self, name, start, stop, out)

    def in_one_slab(reader: Any, name: str, start: int, stop: int) -> bool:
        return any(lo <= start and stop <= hi for lo, hi, _ in reader._unit_boxes(name))

    monkeypatch.setattr(DCPReader, "read", spy)
    w = get_weights("sma", 3)
    merged = {}
    for floor, folder in ((1, "cut"), (10**9, "joined")):
        monkeypatch.setattr(merge_mod.stream, "MIN_PIECE_ELEMS", floor)
        reads.clear()
        merge(discover(runs["dcp2"]), w, tmp_path / folder, fsync=False)
        assert any(r[1] == "embed.weight" for r in reads)
        assert all(in_one_slab(*r) for r in reads) == (folder == "cut"), folder
        merged[folder] = load_dir(tmp_path / folder)
    assert merged["cut"].keys() == merged["joined"].keys()
    for name, t in merged["cut"].items():
        assert torch.equal(t, merged["joined"][name]), name


def test_dcp_output_round_trip(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layout output (DCP here) is the merged shards rewritten by the layout's writer: staged through the page
    cache, so that the rewrite reads them from memory (O_DIRECT put them on storage only, and the rewrite read each
    output byte back from it); a safetensors output is written with O_DIRECT."""
    written: dict[str, list[bool]] = {"hf": [], "dcp": []}
    real = merge_mod.stream.ShardWriter

    def noting(path: Path, *args: Any, direct: bool = False, **kwargs: Any) -> Any:
        written[path.parent.name.split(".")[1]].append(direct)  # .<out>.pmakit-partial
        return real(path, *args, direct=direct, **kwargs)

    monkeypatch.setattr(merge_mod.stream, "ShardWriter", noting)
    w = get_weights("sma", 3)
    merge(discover(runs["hf"]), w, tmp_path / "hf", fsync=False)
    merge(discover(runs["hf"]), w, tmp_path / "dcp", out_format="dcp", fsync=False)
    assert written["hf"] and all(written["hf"]) and written["dcp"] and not any(written["dcp"])
    assert (tmp_path / "dcp" / ".metadata").exists()
    assert not list((tmp_path / "dcp").glob("*.safetensors"))
    want = load_dir(tmp_path / "hf")
    # Back through torch's own loader, into a preallocated state dict.
    got = {k: torch.empty_like(v) for k, v in want.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=tmp_path / "dcp", no_dist=True)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    files = json.loads((tmp_path / "dcp" / "pmakit-merge.json").read_text())["output"]["files"]
    assert {f["name"] for f in files} >= {".metadata"}


def test_inspect_lists_skipped_entries_and_bad_metadata(runs: dict[str, Path], tmp_path: Path) -> None:
    # The real command, in-process (a subprocess costs seconds of torch import on a loaded machine).
    r = CliRunner().invoke(cli, ["inspect", str(runs["dcp1"]), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["snapshots"]
    assert rows[0]["format"] == "dcp" and any("exp_avg" in s for s in rows[0]["skipped_entries"])
    bad = write_snapshot(tmp_path / "run" / "step-1", state(1), step=1, tokens=10)
    (bad / "model.safetensors").unlink()
    (bad / ".metadata").write_bytes(b"not a pickle")
    r = CliRunner().invoke(cli, ["merge", str(bad), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1, r.output
    assert "unreadable DCP metadata" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_plan_counts_the_saved_chunks_dcp_inputs_hold(runs: dict[str, Path]) -> None:
    from pmakit.merge.capacity import plan_report

    snaps = discover(runs["dcp1"])
    report = plan_report(snaps, None, disk_bandwidth=1e9, accumulate_bandwidth=1e9)
    # The largest tensor (64 x 16) is the chunk; a buffer holds a chunk of the widest output dtype (the int64
    # step counter: 8 bytes), one a worker and two for the writer.
    fold = report["fold"]
    buffers = 1024 * 8 * fold["buffers"] + merge_mod.resources.SCRATCH_BYTES * fold["workers"]
    # The saved chunks are mapped from the .distcp files (formats.torch_record): the inputs hold no memory.
    assert report["max_memory_bytes"] == buffers


def test_tensor_parallel_chunks_are_loaded_whole(runs: dict[str, Path]) -> None:
    """Saved chunks split on dim 1 (tensor parallelism) are not flat ranges: the tensor is loaded whole."""
    with open_reader(runs["tp"] / "step-0100") as reader:
        assert [(lo, hi) for lo, hi, _ in reader._unit_boxes("embed.weight")] == [(0, 64 * 16)]  # type: ignore[attr-defined]
        for name, t in state(1, shapes=DCP_SHAPES).items():
            flat = t.reshape(-1)
            assert torch.equal(reader.read(name, 0, flat.numel()), flat), name
            assert torch.equal(reader.read(name, 3, flat.numel() - 2), flat[3:-2]), name
