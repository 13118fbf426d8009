"""The fold's parallelism from what the process may use: affinity and cgroup values in, workers out."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import fake_node, run_cli
from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.merge import plan_merge
from pmakit.merge.capacity import Bandwidth, more_ranks
from pmakit.merge.resources import (
    MAX_WORKERS,
    SCRATCH_BYTES,
    Node,
    parse_cfs_quota,
    parse_cpu_max,
    parse_memory_limit,
    read_node,
    size_fold,
    usable_cores,
    workers_override,
)
from pmakit.snapshot import discover
from pmakit.weights import get_weights

MiB, GiB = 2**20, 2**30
BUF = 32 * MiB  # an output buffer: 8M elements of fp32
READ = 8 * 16 * MiB  # one chunk of 8 bf16 inputs


@pytest.mark.parametrize(
    ("affinity", "quota", "ranks", "cores"),
    [
        (16, None, 1, 16),
        (16, 2.5, 1, 3),  # a fraction of a core is a thread that runs part of the time
        (4, 8.0, 1, 4),  # the quota is no more cores than the mask allows
        (16, None, 4, 4),  # torchrun's 4 ranks on the node share its cores
        (16, 6.0, 4, 2),
        (1, None, 2, 1),  # never none
    ],
)
def test_usable_cores(affinity: int, quota: float | None, ranks: int, cores: int) -> None:
    assert usable_cores(affinity, quota, ranks) == cores


def test_cgroup_files_parse() -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("200000 100000\n") == 2.0
    assert parse_cpu_max("150000 100000") == 1.5
    assert parse_cfs_quota("-1\n", "100000\n") is None  # v1: no quota
    assert parse_cfs_quota("400000", "100000") == 4.0
    assert parse_memory_limit("max\n") is None
    assert parse_memory_limit("9223372036854771712\n") is None  # v1's "no limit", page-rounded 2^63
    assert parse_memory_limit("1073741824") == GiB


def test_two_cores_keep_the_fixed_sizing_they_had() -> None:
    # Before sizing followed the node: 2 workers, 4 buffers, 4 chunks read ahead. On two cores nothing changes.
    s = size_fold(2, 16 * GiB, BUF, READ)
    assert (s.workers, s.buffers, s.read_ahead) == (2, 4, 4)
    assert size_fold(1, 16 * GiB, BUF, READ).workers == 1


def test_a_big_node_gets_a_worker_a_core_but_one() -> None:
    s = size_fold(16, 120 * GiB, BUF, READ)
    assert (s.workers, s.buffers, s.read_ahead) == (15, 17, 16)
    assert "less one for the reader and writer threads" in s.why


def test_one_process_stops_at_max_workers_and_says_ranks_go_further() -> None:
    s = size_fold(128, 1024 * GiB, BUF, READ)
    assert s.workers == MAX_WORKERS and "torchrun" in s.why


def test_memory_bounds_the_workers_and_the_read_ahead() -> None:
    # 1 GiB may be used: a quarter (256 MiB) holds the buffers: 2 for the writer + w * (32 MiB + 2 MiB scratch).
    s = size_fold(16, GiB, BUF, READ)
    assert s.workers == (GiB // 4 - 2 * BUF) // (BUF + SCRATCH_BYTES) == 5
    assert s.buffers * BUF + s.workers * SCRATCH_BYTES <= GiB // 4
    assert "bounded by memory" in s.why
    assert s.read_ahead == 4 and s.read_ahead * READ <= GiB // 2
    tiny = size_fold(16, 64 * MiB, BUF, READ)  # less than a buffer: still one worker, reading one chunk ahead
    assert (tiny.workers, tiny.read_ahead) == (1, 1)


def test_the_environment_overrides_the_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert size_fold(16, 120 * GiB, BUF, READ, override=3).workers == 3
    assert workers_override({}) is None and workers_override({"PMAKIT_FOLD_WORKERS": "6"}) == 6
    for bad in ("0", "two", "-1"):
        with pytest.raises(PmakitError, match="PMAKIT_FOLD_WORKERS"):
            workers_override({"PMAKIT_FOLD_WORKERS": bad})
    # torchrun's LOCAL_WORLD_SIZE=2: the two ranks share this machine's cores, each half of one process's (rounded
    # up), and the CPUs it may run on are the affinity mask's
    node = read_node({"LOCAL_WORLD_SIZE": "2"})
    assert node.local_ranks == 2 and node.cores == math.ceil(read_node({}).cores / 2)
    assert node.affinity == len(os.sched_getaffinity(0))
    # and on a node whose numbers are known (that one may have one core, where halving changes nothing): 16 CPUs
    # and a cgroup quota of 6 cores give one process 6, each of 2 ranks 3, each of 4 ranks 2 (1.5 rounded up)
    fake_node(tmp_path, monkeypatch, {
        "cg/cgroup.controllers": "cpu",
        "cg/job/cpu.max": "600000 100000\n",
        "proc-cgroup": "0::/job\n",
    }, cpus=16)  # fmt: skip
    node = read_node({"LOCAL_WORLD_SIZE": "2"})
    assert (node.affinity, node.quota, node.local_ranks, node.cores) == (16, 6.0, 2, 3)
    assert read_node({}).cores == 6 and read_node({"LOCAL_WORLD_SIZE": "4"}).cores == 2


def test_the_merge_plan_carries_the_sizing_and_its_memory(
    make_run: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = discover(make_run(3))
    monkeypatch.setenv("PMAKIT_FOLD_WORKERS", "3")
    plan = plan_merge(snaps, get_weights("sma", 3))
    assert (plan.fold.workers, plan.n_buffers) == (3, 5)
    assert plan.peak_memory == plan.buffer_bytes * 5 + SCRATCH_BYTES * 3
    assert "PMAKIT_FOLD_WORKERS=3" in plan.fold.why and "usable core" in plan.fold.why


def test_a_bad_worker_count_is_one_line(make_run: Callable[..., Path], tmp_path: Path) -> None:
    r = run_cli("merge", make_run(2), "-o", tmp_path / "out", env={"PMAKIT_FOLD_WORKERS": "many"})
    assert r.returncode != 0 and not (tmp_path / "out").exists()
    errors = [x for x in r.stderr.splitlines() if not x.startswith("info: ")]
    assert errors == ["Error: PMAKIT_FOLD_WORKERS='many': give a number of fold threads, 1 or more"]


def test_more_ranks_where_one_writer_thread_cannot_keep_up() -> None:
    # 64 cores, one process: 32 workers fold 100 GB at 1 GB/s each (3.1 s), but its one writer thread checksums
    # the 12.5 GB output at 1 GB/s (12.5 s) while the disk needs 100/20 + 12.5/10 = 6.25 s. Two ranks: two writer
    # threads (6.25 s each), so the disk bounds them; more ranks gain nothing on it.
    node = Node(affinity=64, quota=None, local_ranks=1, memory=512 * GiB, memory_limit="MemAvailable")
    bw = Bandwidth(20e9, 10e9, 32e9, checksum=1e9, workers=32)
    more = more_ranks(100 * 10**9, 100 * 10**9, 12_500_000_000, bw, node, 1, 1, BUF, 32)
    assert more is not None and more["ranks_per_node"] == 2
    assert more["now"] == pytest.approx(12.5) and more["seconds"] == pytest.approx(6.25)
    # the same merge with a fast checksum: the disk bounds one process already
    fast = Bandwidth(20e9, 10e9, 32e9, checksum=10e9, workers=32)
    assert more_ranks(100 * 10**9, 100 * 10**9, 12_500_000_000, fast, node, 1, 1, BUF, 32) is None
    two = Node(affinity=2, quota=None, local_ranks=1, memory=16 * GiB, memory_limit="MemAvailable")
    assert more_ranks(100 * 10**9, 100 * 10**9, 12_500_000_000, bw, two, 1, 1, BUF, 2) is None


def test_inspect_plan_states_the_workers_and_why(make_run: Callable[..., Path]) -> None:
    run = make_run(4)
    args = ["inspect", "--plan", str(run), "--disk-bandwidth", "1GB", "--accumulate-bandwidth", "1GB"]
    r = CliRunner().invoke(cli, args, env={"PMAKIT_FOLD_WORKERS": "3"})
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("fold per rank"))
    assert "3 worker thread(s), 5 output buffers" in line and "PMAKIT_FOLD_WORKERS=3" in line
    assert "usable core" in line and "bound by" in r.output


def test_read_node_takes_the_tightest_cgroup_limits_v2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job's group allows 2 GiB (1 GiB of it anonymous already) and no CPU quota; its task's group 1.5 cores.
    fake_node(tmp_path, monkeypatch, {
        "cg/cgroup.controllers": "cpu memory",
        "cg/job/cpu.max": "max 100000\n",
        "cg/job/memory.max": "2147483648\n",
        "cg/job/memory.stat": "anon 1073741824\nfile 999999999\n",
        "cg/job/task/cpu.max": "150000 100000\n",
        "cg/job/task/memory.max": "max\n",
        "proc-cgroup": "0::/job/task\n",
        "meminfo": "MemTotal: 67108864 kB\nMemAvailable:    8388608 kB\n",
    })  # fmt: skip
    node = read_node({})
    assert node.quota == 1.5 and node.cores == min(node.affinity, 2)
    assert (node.memory, node.memory_limit) == (GiB, "cgroup")  # the limit less the anonymous use
    (tmp_path / "cg/job/memory.max").write_text("max\n")
    node = read_node({"LOCAL_WORLD_SIZE": "2"})
    assert (node.memory, node.memory_limit) == (8 * GiB, "MemAvailable") and node.local_ranks == 2


def test_read_node_under_cgroup_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_node(tmp_path, monkeypatch, {
        "cg/cpu,cpuacct/x/cpu.cfs_quota_us": "400000\n",
        "cg/cpu,cpuacct/x/cpu.cfs_period_us": "100000\n",
        "cg/memory/x/memory.limit_in_bytes": "4294967296\n",
        "cg/memory/x/memory.stat": "cache 5\nrss 7\ntotal_rss 1073741824\n",
        "cg/memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: no limit
        "proc-cgroup": "12:memory:/x\n3:cpu,cpuacct:/x\n0::/\n",
        "meminfo": "MemAvailable:    8388608 kB\n",
    })  # fmt: skip
    node = read_node({})
    assert node.quota == 4.0 and (node.memory, node.memory_limit) == (3 * GiB, "cgroup")
    (tmp_path / "proc-cgroup").write_text("garbage\n")  # nothing understood: no limits, never a crash
    node = read_node({})
    assert node.quota is None and node.memory_limit == "MemAvailable"
