"""How ``pmakit train --replicas R`` starts its copies: under torchrun, by launching R processes of its own
(torch's ``elastic_launch``), or on torchft (``--backend torchft``: a lighthouse and R restartable copies)."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any

from pmakit.errors import PmakitError
from pmakit.train import fault_tolerant
from pmakit.train.replicas import ReplicaConfig, Replicas, SingleCopy, from_env

BACKENDS = ("torch", "torchft")


def start_copies(
    train_config: Any,
    replicas: int | None,
    prepare: Callable[[], object],
    *,
    backend: str = "torch",
    max_restarts: int = 3,
    **options: Any,
) -> SingleCopy | None:
    """The copies of a ``pmakit train --replicas R`` process, with ``prepare`` (tokenizing the corpus into the
    cache) run once before the others read it.

    Without torchrun, ``--replicas R`` launches R worker processes of this same command and returns None once they
    finished: the caller has nothing left to do. Under torchrun (or as such a worker) R must equal the world size.
    With ``backend="torchft"`` this process becomes the launcher (lighthouse and supervisor) of R copies, each a
    process of its own. Options are checked before anything starts.
    """
    if backend not in BACKENDS:
        raise PmakitError(f"unknown backend {backend!r}; use {' or '.join(BACKENDS)}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if replicas is None or (replicas == 1 and world == 1 and backend == "torch"):
        return SingleCopy()
    config = ReplicaConfig(**options)
    _check_config(config, replicas, train_config)
    if backend == "torchft":
        return _start_torchft(config, replicas, prepare, max_restarts)
    if world == 1:
        _launch(replicas)
        return None
    if replicas != world:
        raise PmakitError(f"--replicas {replicas} needs {replicas} processes; this is one of {world}")
    copies = from_env(config)
    import torch.distributed as dist

    if copies.rank == 0:
        prepare()
    dist.barrier()
    return copies


def _start_torchft(
    config: ReplicaConfig, replicas: int, prepare: Callable[[], object], max_restarts: int
) -> SingleCopy | None:
    if not fault_tolerant.available():
        raise PmakitError("--backend torchft needs torchft: pip install torchft==0.2.0")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise PmakitError("--backend torchft starts its own processes: run it without torchrun")
    if os.environ.get(fault_tolerant.REPLICA_ENV) is not None:
        return fault_tolerant.from_env(config)
    fault_tolerant.FaultTolerantCopies(
        config, 0, replicas
    )  # refuses what torchft cannot do, before any start
    prepare()  # the corpus cache, once, before the copies read it
    fault_tolerant.launch(replicas, max_restarts=max_restarts)
    return None


def _check_config(config: ReplicaConfig, replicas: int, train_config: Any) -> None:
    """The interval checks ``Replicas`` makes, done before any process starts."""
    probe = Replicas.__new__(Replicas)
    probe.config, probe.size = config, replicas
    for interval in (
        train_config.every_tokens,
        train_config.checkpoint_every_tokens,
        *train_config.keep_checkpoints_at,
    ):
        if interval:
            probe.check_interval(interval, train_config.tokens_per_step)


def _launch(replicas: int) -> None:
    """Run this command again as ``replicas`` worker processes on this machine (a torchrun of our own)."""
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # torch's agent keeps a folder per run (each copy's error file); by default a torchelastic_* temporary folder
    # that nothing removes, one a run: here one that goes when the copies have ended (the failure's line is made
    # from their exit codes)
    with tempfile.TemporaryDirectory(prefix="pmakit-copies-", ignore_cleanup_errors=True) as logs:
        launch = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=replicas,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )
        logging.getLogger("torch.distributed.elastic").setLevel(
            logging.CRITICAL
        )  # the copies say what failed
        os.environ["PMAKIT_COPIES"] = str(replicas)
        try:
            elastic_launch(launch, entrypoint=sys.executable)("-m", "pmakit", *sys.argv[1:])
        except ChildFailedError as e:
            raise PmakitError(failure_line(e.failures, replicas)) from None
        except SignalException as e:  # Ctrl-C or a SIGTERM to this launcher: torch's agent stopped the copies
            print(f"stopped by {e.sigval.name}: the model copies were stopped", file=sys.stderr)
            raise SystemExit(128 + int(e.sigval)) from None


PEER_FAILED_EXIT = 3
"""How a copy under pmakit's own launcher ends when a collective with the other copies failed (another copy failed
or is gone): quietly, leaving the one line to the launcher, which knows which copy failed first. Without it each
surviving copy's traceback reached the console whenever it noticed the loss before the launcher stopped it."""

_STOPPED = (-int(signal.SIGTERM), 128 + int(signal.SIGTERM), PEER_FAILED_EXIT)
"""How a copy ends that another one's failure stopped: the launcher's SIGTERM, our handler's exit 143, or a failed
collective."""


def collective_failed(error: BaseException) -> bool:
    """Whether ``error`` came out of a ``torch.distributed`` call (its innermost frame is there, or it is one of
    torch's distributed errors): in a process of a distributed job, a peer failed or is gone."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and str(tb.tb_frame.f_globals.get("__name__", "")).startswith("torch.distributed")


def failure_line(failures: Mapping[int, Any], replicas: int) -> str:
    """The one line for copies that failed: the copy that failed first, not one the launcher stopped after it
    (every other copy then ends with SIGTERM); a copy killed by a signal has no error of its own to point to."""

    def first(rank: int) -> int:
        # a copy's own failure (an error exit, or SIGKILL: from outside, the OOM killer or a user, never a
        # consequence of the others), then another signal (SIGABRT: a copy whose peer vanished can die in C++,
        # "terminate called without an active exception", before the launcher stops it), then a stop by the
        # launcher, then the loss of the others
        code = failures[rank].exitcode
        if code == PEER_FAILED_EXIT:
            return 3
        if code in _STOPPED:
            return 2
        return 1 if code < 0 and code != -int(signal.SIGKILL) else 0

    rank = min(sorted(failures), key=first)
    code = failures[rank].exitcode
    if code == PEER_FAILED_EXIT:  # every copy lost the others (the network, or a failure the launcher missed)
        return f"model copy {rank} of {replicas} stopped: a collective with the other copies failed"
    if code == 128 + int(signal.SIGTERM):  # pmakit's handler: SIGTERM unwinds like Ctrl-C
        return f"model copy {rank} of {replicas} was stopped by SIGTERM"
    if code < 0:
        return f"model copy {rank} of {replicas} was killed by {signal.Signals(-code).name}"
    return f"model copy {rank} of {replicas} failed (exit {code}); its error is printed above"
