"""Merges split across 2 ranks (gloo on CPU): same values as one process, one output, failures and resume."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from conftest import SRC, state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.merge import merge, partial_dir, plan_merge
from pmakit.merge._faults import KILL_ENV
from pmakit.snapshot import discover
from pmakit.weights import get_weights
from pmakit.world import init_from_env, shutdown, split_by_bytes
from test_merge import load_dir

SHARD = 2048  # a shard per 64x16 bf16 tensor


def test_split_by_bytes_is_contiguous_and_balanced() -> None:
    assert split_by_bytes([1] * 8, 2) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert split_by_bytes([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [0] + [1] * 10
    assert split_by_bytes([5, 5, 5], 1) == [0, 0, 0]
    groups = split_by_bytes([3, 9, 2, 7, 7, 1, 4, 8], 3)
    assert groups == sorted(groups) and set(groups) == {0, 1, 2}
    assert split_by_bytes([], 4) == [] and split_by_bytes([0, 0], 2) == [0, 0]


def test_plan_for_two_ranks(make_run: Any) -> None:
    snaps = discover(make_run(3))
    plan = plan_merge(snaps, get_weights("sma", 3), max_shard_size=10**9, ranks=2)
    # One 5 GB shard would leave rank 1 idle: each rank gets shards of its own.
    assert [s.file for s in plan.shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert plan.owners == (0, 1)
    names = [t.name for s in plan.shards for t in s.tensors]
    assert names == list(plan.tensors)
    sizes = [sum(t.nbytes for t in s.tensors) for s in plan.shards]
    assert abs(sizes[0] - sizes[1]) <= max(t.nbytes for s in plan.shards for t in s.tensors)


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


def _rank_main(rank: int, port: int, jobs: list[dict[str, Any]], report: str) -> None:
    """One rank: run each job (a merge) in one process group; record what happened for the parent."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    warnings.simplefilter("ignore")
    world = init_from_env("cpu")
    results = []
    for job in jobs:
        if job.get("kill_rank") == rank:
            os.environ[KILL_ENV] = job["kill"]
        snaps = discover(Path(job["run"]))
        try:
            merge(
                snaps,
                get_weights("sma", len(snaps)),
                job["out"],
                max_shard_size=SHARD,
                fsync=False,
                world=world,
                **job.get("options", {}),
            )
            results.append("ok")
        except PmakitError as e:
            results.append(str(e))
        Path(f"{report}.{rank}.tmp").write_text(json.dumps(results))
        os.replace(f"{report}.{rank}.tmp", f"{report}.{rank}")
        # Both ranks' records of this job are on disk before either starts the next: a job that kills a rank
        # (the last) makes spawn SIGTERM the other, which must not catch it still writing the job before.
        torch.distributed.barrier()
    shutdown(world)


def _spawn(jobs: list[dict[str, Any]], report: Path) -> None:
    spawn_two(_rank_main, (_free_port(), jobs, str(report)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dist")
    for i in range(1, 5):
        write_snapshot(root / "run" / f"step-{i:03d}", state(i), step=i, tokens=i * 100)
        bad = state(i)
        if i == 3:
            bad["head.weight"][5, 5] = float("nan")  # head.weight is the last tensor: rank 1's part
        write_snapshot(root / "nan" / f"step-{i:03d}", bad, step=i, tokens=i * 100)
    return {"root": root, "run": root / "run", "nan": root / "nan"}


def _torchrun_merge(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The real entry point under torchrun: `torchrun --nproc-per-node 2 -m pmakit merge ...`."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(_free_port()),
    ]
    cmd += ["-m", "pmakit", "merge", *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)


def test_two_ranks_merge_fail_and_resume(runs: dict[str, Path], tmp_path: Path) -> None:
    run, nan = str(runs["run"]), str(runs["nan"])
    jobs = [
        {"run": run, "out": str(tmp_path / "two")},
        {"run": run, "out": str(tmp_path / "dcp"), "options": {"out_format": "dcp"}},
        {"run": nan, "out": str(tmp_path / "failed")},
        {"run": run, "out": str(tmp_path / "killed"), "kill": "after-shard:1", "kill_rank": 1},
    ]
    with pytest.raises(mp.ProcessExitedException):  # rank 1 SIGKILLs itself; spawn then stops rank 0
        _spawn(jobs, tmp_path / "report")
    snaps = discover(runs["run"])
    merge(snaps, get_weights("sma", 4), tmp_path / "one", max_shard_size=SHARD, fsync=False)

    # 1. Same values as one process; each rank wrote its own shards of one output with one index and manifest.
    one, two = load_dir(tmp_path / "one"), load_dir(tmp_path / "two")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    manifest = json.loads((tmp_path / "two" / "pmakit-merge.json").read_text())
    assert manifest["produced_by"]["ranks"] == 2
    index = json.loads((tmp_path / "two" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(f["name"] for f in manifest["output"]["files"])
    assert not list(tmp_path.glob(".two.*"))

    # 2. DCP output: one checkpoint, a file from each rank, torch's loader reads the merged values.
    assert sorted(f.name for f in (tmp_path / "dcp").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    got = {k: torch.empty_like(v) for k, v in one.items()}
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(got, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert all(torch.equal(got[k], one[k]) for k in one)

    # 3. A NaN in rank 1's part: rank 1 names it, rank 0 points to it, nothing is left behind.
    reports = [json.loads((tmp_path / f"report.{r}").read_text()) for r in (0, 1)]
    assert "non-finite" in reports[1][2] and "head.weight" in reports[1][2]
    assert "another rank" in reports[0][2]
    assert not (tmp_path / "failed").exists() and not partial_dir(tmp_path / "failed").exists()

    # 4. Killed mid-merge: `torchrun ... -m pmakit merge --resume` finishes with the uninterrupted merge's bytes.
    assert partial_dir(tmp_path / "killed").exists() and not (tmp_path / "killed").exists()
    r = _torchrun_merge(run, "--last", "4", "-o", tmp_path / "killed", "--max-shard-size", SHARD, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("wrote ") == 1  # rank 0 reports, rank 1 is quiet
    for f in (tmp_path / "two").iterdir():
        if f.name != "pmakit-merge.json":
            assert f.read_bytes() == (tmp_path / "killed" / f.name).read_bytes(), f.name


def test_device_fold_matches_the_cpu_fold() -> None:
    """The --device cuda accumulation, run on the CPU (no GPU here): same values as the CPU path."""
    from pmakit.merge.stream import BLOCK_ELEMS, _DeviceFold, _fold

    g = torch.Generator().manual_seed(0)
    views = [torch.randn(1000, generator=g).bfloat16() for _ in range(3)] + [torch.randn(1000, generator=g)]
    weights = [0.1, 0.2, 0.3, 0.4]
    keep = [v.clone() for v in views]
    a, b = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.bfloat16)
    device = _DeviceFold(
        torch.device("cpu"), slot_bytes=4000, out_bytes=4000, slots=2
    )  # fewer slots than inputs
    assert device.fold(views, weights, a)
    _fold(views, weights, b, (torch.empty(BLOCK_ELEMS), torch.empty(BLOCK_ELEMS)))
    assert torch.equal(a, b) and all(torch.equal(v, k) for v, k in zip(views, keep))  # inputs untouched
    views[0][3] = float("nan")
    assert not device.fold(views, weights, a)


def test_a_lost_rank_is_one_line_and_an_interruption_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer gone mid-merge (gloo: "Connection closed by peer") reaches the user as one line naming what happened,
    and the merge treats it like Ctrl-C or SIGTERM (the partial output is kept), not like a bad input."""
    import torch.distributed as dist

    from pmakit.merge import _interrupted
    from pmakit.world import RankLost, World

    def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError(
            "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234\nmore"
        )

    monkeypatch.setattr(dist, "all_reduce", closed)
    two = World(0, 2)
    with pytest.raises(
        RankLost, match=r"^another rank stopped while rank 0 waited for it \(RuntimeError: \[gloo.*peer"
    ) as lost:
        two.least(1)
    assert "\n" not in str(lost.value) and isinstance(lost.value, PmakitError)
    one = World()
    assert _interrupted(lost.value, two) and _interrupted(KeyboardInterrupt(), one)
    assert _interrupted(SystemExit(143), one) and _interrupted(RuntimeError("a layout's collective"), two)
    assert not _interrupted(PmakitError("non-finite values"), two) and not _interrupted(
        OSError(28, "full"), one
    )
    assert not _interrupted(RuntimeError("a bug"), one)


@pytest.mark.parametrize(("peer", "outcome"), [(0, "failed"), (1, "cut"), (2, "done")])
def test_a_stage_cut_on_another_rank_is_an_interruption_there_too(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, peer: int, outcome: str
) -> None:
    """A stage that another rank left because its store stopped answering (or Ctrl-C) ends this rank as an
    interruption too, so rank 0 keeps the partial output for the same command; a failure there (a bad input) is
    a failure here. The other rank's word comes through the MIN all-reduce, stubbed here (torchrun runs it in the
    merge tests)."""
    import torch.distributed as dist

    from pmakit.errors import Interrupted
    from pmakit.merge import _interrupted
    from pmakit.merge.output import run_stage
    from pmakit.storage.base import StoreUnreachable
    from pmakit.world import World

    def with_peer(flag: torch.Tensor, op: object = None, **_: object) -> None:
        assert op == dist.ReduceOp.MIN
        flag.clamp_(max=peer)

    monkeypatch.setattr(dist, "all_reduce", with_peer)
    two = World(0, 2)
    if outcome == "done":
        assert run_stage(two, tmp_path, lambda: "written") == "written"
        return
    with pytest.raises(PmakitError, match="on another rank") as raised:
        run_stage(two, tmp_path, lambda: "written")
    assert isinstance(raised.value, Interrupted) == (outcome == "cut")
    assert _interrupted(raised.value, two) == (outcome == "cut")

    def gone() -> None:
        raise StoreUnreachable("s3://b/r/x.safetensors: reading bytes 0-16: failed 5 times (ConnectionError)")

    with pytest.raises(StoreUnreachable):  # this rank's own error, whatever the others said
        run_stage(two, tmp_path, gone)
    assert _interrupted(StoreUnreachable("gone"), World())


GROUP_LEFT_SCRIPT = """
import os, sys
import torch
from pmakit.world import init_from_env, shutdown
assert "torch.distributed.checkpoint" not in sys.modules  # imported late, by the DCP writer, as in a merge
world = init_from_env("cpu")
from pmakit.formats import dcp_io
dcp_io.save({f"rank{world.rank}": torch.ones(4)}, sys.argv[1], distributed=True, fsync=False)
shutdown(world)
threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
with open(f"{sys.argv[1]}.threads.{world.rank}", "w") as f:
    f.write(" ".join(threads))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from /proc")
def test_a_rank_that_wrote_dcp_leaves_no_gloo_thread_behind(tmp_path: Path) -> None:
    """After ``shutdown`` no gloo thread is left: torch.distributed.nn.functional, imported by DCP after the group
    was up, used to hold the default group, and its threads then ran on into interpreter exit, where a rank now
    and then aborted ("terminate called without an active exception")."""
    script = tmp_path / "rank.py"
    script.write_text(GROUP_LEFT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-port", str(_free_port()), str(script), str(tmp_path / "out")]
    ran = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0, ran.stderr[-3000:]
    threads = [(tmp_path / f"out.threads.{rank}").read_text() for rank in (0, 1)]
    assert all("python" in x for x in threads), threads  # the main thread read as such
    assert not any("gloo" in x for x in threads), threads
