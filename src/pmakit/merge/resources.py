"""What this process may use of its node, and the fold's parallelism sized from it.

Cores: the CPUs the process may run on (``os.sched_getaffinity``: taskset, cpusets) and its cgroup's CPU quota
(``cpu.max``, or ``cpu.cfs_quota_us`` under cgroup v1: what a container's ``--cpus`` sets), shared among the ranks
torchrun started on the node. Memory: MemAvailable, and the cgroup's limit less what it uses (``memory.max`` and
``memory.current``, or v1's ``memory.limit_in_bytes``). The sizing itself (``size_fold``) is a pure function of
those numbers.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pmakit.errors import PmakitError
from pmakit.units import format_bytes

MAX_WORKERS = 32
"""Fold threads of one process at most: beyond this the interpreter's lock (held while each torch op is
dispatched) and the node's memory bandwidth stop more threads from helping; ranks (torchrun) scale past it."""
PREFETCH_AHEAD = 4
"""Chunks ahead of the fold whose input ranges the kernel is asked to read, at least (more with more workers)."""
SCRATCH_BYTES = 2 * 2**20
"""Each fold worker's cache-sized fp32 block accumulator and conversion buffer (``stream.BLOCK_ELEMS`` fp32 each)."""
MEMORY_SHARE = 4
"""The fold's buffers take at most 1/4 of the memory the process may use: the page cache needs the rest to read
the inputs ahead and to stage the output."""
WORKERS_ENV = "PMAKIT_FOLD_WORKERS"
"""Set to a number: that many fold workers, whatever the cores (still bounded by memory)."""
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
MEMINFO = Path("/proc/meminfo")


@dataclass(frozen=True)
class Node:
    """What this process may use."""

    affinity: int
    """CPUs it may run on."""
    quota: float | None
    """Its cgroup's CPU quota in cores (None: no quota)."""
    local_ranks: int
    """Processes of this merge on the node (torchrun's LOCAL_WORLD_SIZE), sharing the cores."""
    memory: int
    """Bytes it may still allocate: MemAvailable, or its cgroup's limit less its use where that is smaller."""
    memory_limit: str
    """Which bound ``memory`` is: ``MemAvailable`` or ``cgroup``."""

    @property
    def cores(self) -> int:
        """Cores one rank may keep busy."""
        return usable_cores(self.affinity, self.quota, self.local_ranks)

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup CPU quota {self.quota:g}"
        ranks = f", shared by {self.local_ranks} ranks" if self.local_ranks > 1 else ""
        return (
            f"{self.cores} usable core(s) (affinity {self.affinity}, {quota}{ranks}), "
            f"{format_bytes(self.memory)} of memory ({self.memory_limit})"
        )


@dataclass(frozen=True)
class FoldSizing:
    """How one process runs the fold."""

    workers: int
    """Threads folding chunks side by side."""
    buffers: int
    """Output chunks in flight: one a worker, two for the writer thread."""
    read_ahead: int
    """Chunks the kernel is asked to read ahead of the fold."""
    why: str
    """What bounded ``workers``, in words."""


def usable_cores(affinity: int, quota: float | None, local_ranks: int = 1) -> int:
    """Cores one of ``local_ranks`` processes may keep busy: the affinity mask bounded by the CPU quota (a
    fraction of a core counts as one), shared evenly; at least 1."""
    cores = float(affinity) if quota is None else min(float(affinity), quota)
    return max(1, math.ceil(cores / max(1, local_ranks) - 1e-9))


def size_fold(
    cores: int,
    memory: int,
    buffer_bytes: int,
    chunk_read_bytes: int,
    override: int | None = None,
) -> FoldSizing:
    """Workers, buffers and read-ahead for a process with ``cores`` cores and ``memory`` bytes.

    One worker a core, less one core for the calling thread's reads and the writer thread's checksums and writes
    where there are more than two (on two cores both fold: the other threads mostly wait on the disk), at most
    ``MAX_WORKERS``; and no more than 1/``MEMORY_SHARE`` of ``memory`` holds their buffers (``buffer_bytes`` each,
    one a worker and two for the writer) and scratch. The kernel reads ahead one chunk a worker, at least
    ``PREFETCH_AHEAD``, within half of ``memory`` (``chunk_read_bytes``: one chunk of every input).
    """
    budget = memory // MEMORY_SHARE
    by_memory = max(1, (budget - 2 * buffer_bytes) // (buffer_bytes + SCRATCH_BYTES))
    if override is not None:
        wanted, why = override, f"{WORKERS_ENV}={override}"
    elif cores <= 2:
        wanted, why = cores, "one a usable core"
    else:
        wanted, why = cores - 1, "one a usable core, less one for the reader and writer threads"
    if wanted > MAX_WORKERS:
        wanted, why = MAX_WORKERS, f"at most {MAX_WORKERS} in one process (more cores: torchrun ranks)"
    workers = max(1, min(wanted, by_memory))
    if workers < wanted:
        why = (
            f"bounded by memory: 1/{MEMORY_SHARE} of {format_bytes(memory)} holds {workers + 2} buffers of "
            f"{format_bytes(buffer_bytes)}"
        )
    ahead = max(PREFETCH_AHEAD, workers + 1)
    ahead = max(1, min(ahead, memory // 2 // max(1, chunk_read_bytes)))
    return FoldSizing(workers, workers + 2, ahead, why)


def workers_override(environ: dict[str, str] | None = None) -> int | None:
    """The fold workers asked for in ``PMAKIT_FOLD_WORKERS``, if set."""
    value = (os.environ if environ is None else environ).get(WORKERS_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise PmakitError(f"{WORKERS_ENV}={value!r}: give a number of fold threads, 1 or more")
    return int(value)


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"200000 100000"``: 2 cores; ``"max 100000"``: no quota) in cores."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = float(parts[1]) if len(parts) > 1 else 100000.0
    return float(parts[0]) / period if period > 0 else None


def parse_cfs_quota(quota: str, period: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` in cores (-1: no quota)."""
    q, p = int(quota), int(period)
    return q / p if q > 0 and p > 0 else None


def parse_memory_limit(text: str) -> int | None:
    """A cgroup memory limit (``memory.max``'s ``max`` or v1's page-rounded 2^63: none) in bytes."""
    text = text.strip()
    if not text or text == "max" or int(text) >= 2**62:
        return None
    return int(text)


def read_node(environ: dict[str, str] | None = None) -> Node:
    """This process's cores and memory (see ``Node``)."""
    env = os.environ if environ is None else environ
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = int(env["LOCAL_WORLD_SIZE"]) if env.get("LOCAL_WORLD_SIZE", "").isdigit() else 1
    available = _meminfo_available()
    memory, which = available, "MemAvailable"
    limit = _cgroup_memory_left()
    if limit is not None and limit < memory:
        memory, which = limit, "cgroup"
    return Node(affinity, _cgroup_quota(), max(1, ranks), memory, which)


def _meminfo_available() -> int:
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30  # no /proc (not Linux): a modest guess rather than none


def _cgroup_dirs(controller: str) -> list[Path]:
    """This process's cgroup directories for ``controller``, innermost first up to the hierarchy's root (cgroup v2,
    or the v1 hierarchy that holds the controller)."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root = CGROUP_ROOT if (CGROUP_ROOT / "cgroup.controllers").exists() else CGROUP_ROOT / "unified"
        elif controller in controllers.split(","):
            root = CGROUP_ROOT / controllers
            if not root.is_dir():
                root = CGROUP_ROOT / controller
        else:
            continue
        leaf = root / path.lstrip("/")
        dirs = [leaf, *leaf.parents] if leaf.is_dir() else [root]
        found = [d for d in dirs if d == root or root in d.parents]
        if any((d / f).exists() for d in found for f in ("cpu.max", "memory.max", "cpu.cfs_quota_us",
                                                          "memory.limit_in_bytes")):  # fmt: skip
            return found
    return []


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


def _cgroup_quota() -> float | None:
    """The tightest CPU quota from this process's cgroup up to the root, in cores."""
    quotas = []
    for d in _cgroup_dirs("cpu"):
        v2, quota, period = (
            _read(d / "cpu.max"),
            _read(d / "cpu.cfs_quota_us"),
            _read(d / "cpu.cfs_period_us"),
        )
        with contextlib.suppress(ValueError, IndexError):
            q = parse_cpu_max(v2) if v2 is not None else None
            if q is None and quota is not None and period is not None:
                q = parse_cfs_quota(quota, period)
            if q is not None:
                quotas.append(q)
    return min(quotas, default=None)


def _cgroup_memory_left() -> int | None:
    """The least memory left under any cgroup limit from this process's cgroup up to the root: the limit less the
    group's anonymous memory (its page cache is reclaimed when the limit is near, so it does not count)."""
    left = []
    for d in _cgroup_dirs("memory"):
        limit_text = _read(d / "memory.max") or _read(d / "memory.limit_in_bytes")
        with contextlib.suppress(ValueError, IndexError):
            limit = parse_memory_limit(limit_text) if limit_text is not None else None
            if limit is not None:
                left.append(max(0, limit - _cgroup_anon(d)))
    return min(left, default=None)


def _cgroup_anon(d: Path) -> int:
    """A cgroup's anonymous memory (v2 ``anon``, v1 ``total_rss``), else all its use."""
    for line in (_read(d / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if key in ("anon", "total_rss"):
            return int(value)
    return int(_read(d / "memory.current") or _read(d / "memory.usage_in_bytes") or 0)
