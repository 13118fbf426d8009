"""Ranks of a distributed merge: a leaf module (it imports nothing of pmakit's merge).

Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank computes the same plan from the headers, streams the output
shards it owns (tensors split into contiguous groups balanced by bytes) into the shared partial directory, and
reports whether it succeeded; rank 0 writes the index and the manifest once every rank has, and renames the whole
output into place. The process group only carries these few agreements (gloo on CPU, NCCL with ``--device cuda``),
never tensor data: each rank reads its own inputs from the (shared) file system.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pmakit.errors import Interrupted, PmakitError, first_line

log = logging.getLogger(__name__)

TIMEOUT = datetime.timedelta(hours=12)
"""How long a rank waits for the others at an agreement point (a rank's share of a 70B merge takes hours)."""


class RankLost(Interrupted):
    """Another rank stopped (killed, out of memory, its node gone) while this one waited for it at an agreement."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks of a merge."""

    rank: int = 0
    """This process's rank."""
    size: int = 1
    """Number of ranks."""
    device: str = "cpu"
    """Where the accumulation runs: ``cpu`` or ``cuda`` (then the process group is NCCL)."""

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def least(self, value: int) -> int:
        """The smallest ``value`` any rank gives (a collective: every rank must call it at the same point)."""
        if not self.distributed:
            return value
        import torch.distributed as dist

        flag = torch.tensor([value], device=self._collective_device())
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        except Exception as e:  # gloo / NCCL: a peer's process is gone
            raise RankLost(
                f"another rank stopped while rank {self.rank} waited for it ({first_line(e)})"
            ) from e
        return int(flag.item())

    def _collective_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def init_from_env(device: str = "cpu") -> World:
    """The world torchrun describes (``RANK``, ``WORLD_SIZE``), with its process group up; one rank otherwise."""
    if device not in ("cpu", "cuda"):
        raise PmakitError(f"unknown --device {device!r}; use cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise PmakitError("--device cuda: no CUDA device is available")
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(0, 1, device)
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    if device == "cuda":
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:  # NCCL also refuses two ranks on one GPU
            raise PmakitError(
                f"--device cuda: local rank {local} needs GPU {local}, but this machine has {count}; start one "
                f"rank per GPU (torchrun --nproc-per-node {count})"
            )
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        start_process_group("nccl" if device == "cuda" else "gloo", timeout=TIMEOUT)
    return World(rank, size, device)


def start_process_group(backend: str, **options: Any) -> None:
    """``dist.init_process_group``, with ``torch.distributed.nn.functional`` imported first.

    That module binds ``group.WORLD`` as the default argument of its functions when it is imported; imported after
    the group is up (DCP imports it, and a merge that writes DCP imports DCP late), it holds the default group for
    the rest of the process: ``destroy_process_group`` then leaves gloo's threads running, and a rank could abort
    at interpreter exit ("terminate called without an active exception", SIGABRT): once in 98 two-rank merges of
    a Megatron checkpoint on a busy 2-core machine, none in 100 with it imported first, when it binds ``None``
    instead (the default group, looked up at each call; 3 ms).
    """
    import torch.distributed as dist
    import torch.distributed.nn.functional  # noqa: F401  (see above)

    dist.init_process_group(backend, **options)


def shutdown(world: World) -> None:
    """Tear the merge's process group down."""
    if world.distributed:
        teardown_process_group()


def teardown_process_group() -> None:
    """Every process past its last collective, then the default process group down, after a run that succeeded.

    A rank that tears down while a peer still finishes an all-reduce makes gloo abort that peer; a process that
    exits with a gloo group up can abort at interpreter exit ("terminate called without an active exception",
    SIGABRT: its worker threads outlive the interpreter), which is why groups are started by
    ``start_process_group``.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def split_by_bytes(sizes: Sequence[int], parts: int) -> list[int]:
    """Group index for each item, in order: ``parts`` contiguous groups with as equal byte totals as possible.

    Item i goes to the group its midpoint falls in, on a line where every group owns total/parts bytes: contiguous,
    deterministic, and no group is off by more than one item's bytes.
    """
    total = sum(sizes)
    if parts <= 1 or total == 0:
        return [0] * len(sizes)
    groups, seen = [], 0
    for s in sizes:
        groups.append(min(parts - 1, int((seen + s / 2) * parts // total)))
        seen += s
    return groups
