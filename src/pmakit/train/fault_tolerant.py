"""Model copies that survive one of them dying: local SGD and DiLoCo on torchft (``--backend torchft``).

With ``--backend torch`` the R copies are one torch.distributed job: when one dies, the job dies. With torchft each
copy is a replica group of its own (world size 1) with a ``torchft.Manager``; a lighthouse (started by the launcher
below) forms a quorum of the live copies at every sync. A sync is one fault-tolerant all-reduce of the copies'
weights (local SGD) or pseudo-gradients (DiLoCo) among the copies in that quorum, committed only if every one of them
got through it; a sync that fails is retried with the copies still alive. The launcher restarts a copy killed by a
signal; the new process asks to join, and torchft *heals* it: a live copy sends it its model, inner optimizer, outer
state and the trainer's step and token count (``_state``), after which it trains on as if it had never left.

Tokens count what the merged model was trained on: a sync adds ``contributors x inner steps x tokens per step``,
where a contributor is a copy that trained the whole interval (a copy healed in the sync contributes nothing: it
brings no training of its own). So a run that loses a copy for a while trains a few more steps to reach its token
budget. Copy 0 writes the run (snapshots of the synced model, the online merge, checkpoints), as with torch.

Left out on purpose: ``sync=gradients`` (every step would be a quorum; torchft's DDP does that, pmakit's baseline
runs on torch), and more than one process per copy (a copy here is one CPU process).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError
from pmakit.train.replicas import (
    ReplicaConfig,
    SingleCopy,
    check_same_copies,
    check_sync_interval,
    load_outer,
    outer_optimizer,
    outer_state,
    trainable,
    unflatten,
)

log = logging.getLogger(__name__)

REPLICA_ENV = "PMAKIT_FT_REPLICA"
"""Which copy this process is (set by the launcher)."""
REPLICAS_ENV = "PMAKIT_FT_REPLICAS"
RESTART_ENV = "PMAKIT_FT_RESTART"
"""Set on a process the launcher restarted: it always resumes (never ``--fresh``) and heals from a live copy."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own variable for the lighthouse address
STORE_ENV = "PMAKIT_FT_STORE"
"""The launcher's TCPStore port: the copies of a fresh start wait there for each other."""

MAX_SYNC_ATTEMPTS = 5


def available() -> bool:
    os.environ.setdefault("RUST_LOG", "error")  # torchft's native side logs every quorum at INFO otherwise
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


class FaultTolerantCopies(SingleCopy):
    """This process's copy among R, kept together by a torchft Manager (see the module docstring)."""

    def __init__(
        self, config: ReplicaConfig, replica: int, replicas: int, *, timeout_s: float = 30.0
    ) -> None:
        if config.sync != "weights":
            raise PmakitError(
                "--backend torchft syncs weights (local SGD / DiLoCo); --sync gradients runs on --backend torch"
            )
        self.config = config
        self.rank = replica
        self.replicas = replicas
        self.size = replicas  # copies training this interval: the quorum's size once one has formed
        self.save_replicas = config.save_replicas
        self.all_reduces = 0
        self.restarted = bool(os.environ.get(RESTART_ENV))
        self.timeout = timedelta(seconds=timeout_s)
        self._model: nn.Module | None = None
        self._trainer: Any = None
        self._manager: Any = None
        self._store: Any = None
        self._global: list[torch.Tensor] = []
        self._outer: torch.optim.Optimizer | None = None
        self._synced = (0, 0)  # (step, tokens) of the last committed sync
        self._healed = False

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ set-up

    def attach(self, model: nn.Module) -> None:
        """Keep the model; every copy starts from the same seeded weights (and torchft syncs step 0 anyway)."""
        self._model = model
        self._global, self._outer = outer_optimizer(self.config, trainable(model))

    def join(self, trainer: Any) -> None:
        """Join the other copies: start the Manager and take part in their next sync, healing if behind."""
        if self._manager is not None:
            return
        from torch.distributed import TCPStore

        _quiet_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self._trainer = trainer
        self._synced = (trainer.step, trainer.tokens)
        # A replica group of one process: its own store, on a free port.
        self._store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        self._manager = Manager(
            pg=ProcessGroupGloo(timeout=self.timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=1,
            use_async_quorum=False,  # heal before going on, never train on stale weights
            rank=0,
            world_size=1,
            store_addr="localhost",
            store_port=self._store.port,
            lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
            replica_id=f"pmakit-copy-{self.rank}",
            timeout=self.timeout,
            quorum_timeout=timedelta(seconds=max(600.0, self.timeout.total_seconds())),
        )
        if not self.restarted:
            _wait_for_all(self.replicas)
        # A first sync in which this copy brings nothing: a newcomer is healed here; a fresh start agrees on step 0.
        self._sync_round(contributes=False)

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # ------------------------------------------------------------------ the sync

    def due(self, step: int) -> bool:
        return step % self.config.sync_every == 0

    def in_sync(self, step: int) -> bool:
        return self.due(step)

    def sync(self, model: nn.Module) -> None:
        for _ in range(MAX_SYNC_ATTEMPTS):
            if self._sync_round(contributes=True):
                return
            log.warning(
                "copy %d: a sync failed (a copy left); retrying with the copies still alive", self.rank
            )
        raise PmakitError(
            f"copy {self.rank}: {MAX_SYNC_ATTEMPTS} syncs in a row failed; is the lighthouse alive?"
        )

    def _sync_round(self, *, contributes: bool) -> bool:
        """One quorum and one all-reduce; True once every copy in the quorum committed it."""
        import torch.distributed as dist

        assert self._model is not None and self._manager is not None
        self._healed = False
        self._manager.start_quorum()  # may call self._load (healing) before it returns
        weight = 1.0 if contributes and not self._healed else 0.0
        params = trainable(self._model)
        if self._outer is None:
            vectors = [p.detach().reshape(-1) for p in params]
        else:  # DiLoCo: the pseudo-gradient, how far this copy moved from the global weights
            vectors = [(g - p.detach()).reshape(-1) for g, p in zip(self._global, params)]
        flat = torch.cat([*vectors, torch.ones(1)]) * weight
        self._manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        if not self._manager.should_commit():
            return False
        self.size = self._manager.num_participants()
        contributors = round(float(flat[-1]))
        if contributors:
            self._apply(flat[:-1] / contributors)
            self.all_reduces += 1
        self._count_tokens(contributors)
        return True

    def _apply(self, mean: torch.Tensor) -> None:
        assert self._model is not None
        params = trainable(self._model)
        with torch.no_grad():
            if self._outer is None:
                unflatten(mean, params)
                return
            unflatten(mean, [g.grad if g.grad is not None else _zero_grad(g) for g in self._global])
            self._outer.step()
            self._outer.zero_grad(set_to_none=True)
            for g, p in zip(self._global, params):
                p.copy_(g)

    def _count_tokens(self, contributors: int) -> None:
        """The merged model saw ``contributors`` copies' batches since the last sync (see the module docstring)."""
        trainer = self._trainer
        step, tokens = self._synced
        trainer.state.tokens = tokens + contributors * (trainer.step - step) * trainer.config.tokens_per_step
        self._synced = (trainer.step, trainer.state.tokens)

    # ------------------------------------------------------------------ what a live copy sends a newcomer

    def _state(self) -> dict[str, Any]:
        trainer = self._trainer
        state: dict[str, Any] = {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "step": trainer.step,
            "tokens": trainer.tokens,
            "synced": list(self._synced),
            "all_reduces": self.all_reduces,
        }
        return {**state, **outer_state(self._global, self._outer)}

    def _load(self, state: dict[str, Any]) -> None:
        trainer = self._trainer
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        trainer.state = dataclasses.replace(
            trainer.state, step=int(state["step"]), tokens=int(state["tokens"])
        )
        self._synced = (int(state["synced"][0]), int(state["synced"][1]))
        self.all_reduces = int(state["all_reduces"])
        load_outer(self._global, self._outer, state)
        self._healed = True
        if trainer.step == 0:
            return  # the first quorum of a fresh start: every copy takes copy 0's (identical) weights
        log.info(
            "copy %d healed from a live copy: step %d, %d tokens", self.rank, trainer.step, trainer.tokens
        )

    # ------------------------------------------------------------------ checkpoints (copy 0 writes them)

    def gather_state(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]] | None:
        """Copy 0's own inner optimizer state: no collective, since a copy may be gone. A whole-job resume gives it
        to every copy (the copies' inner states differ only by their last H steps)."""
        return [{"optimizer": optimizer.state_dict(), "rank": self.rank}] if self.is_writer else None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "all_reduces": self.all_reduces,
            "label": self.config.label,
            "size": self.replicas,
            "backend": "torchft",
        }
        return {**state, **outer_state(self._global, self._outer)}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        check_same_copies(state, self.replicas, self.config)
        self.all_reduces = int(state["all_reduces"])
        copies = state.get("copies") or []
        if copies:
            optimizer.load_state_dict(copies[0]["optimizer"])
        load_outer(self._global, self._outer, state)

    def check_interval(self, every_tokens: int, tokens_per_step: int) -> None:
        check_sync_interval(self.config, self.replicas, every_tokens, tokens_per_step)


def _zero_grad(t: torch.Tensor) -> torch.Tensor:
    t.grad = torch.zeros_like(t)
    return t.grad


def _quiet_torchft() -> None:
    """torchft logs every quorum, commit and failed all-reduce (with its traceback); pmakit's own log says what
    matters in one line: a failed sync, a restart, a heal."""
    import warnings

    from torchft.checkpointing import http_transport

    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    os.environ.setdefault("RUST_LOG", "error")
    # torch warns once that the received checkpoint's buffer is read-only; the heal copies out of it
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    http_transport.BaseHTTPRequestHandler.log_message = lambda *args: None


def _wait_for_all(replicas: int, timeout_s: float = 120.0) -> None:
    """A fresh start waits until every copy is up, so that the first quorum has them all (the lighthouse only waits
    for copies it has heard of); a restarted copy does not wait, the others are already training."""
    from torch.distributed import TCPStore

    store = TCPStore("localhost", int(os.environ[STORE_ENV]), is_master=False, wait_for_workers=False)
    store.add("up", 1)
    deadline = time.monotonic() + timeout_s
    while store.add("up", 0) < replicas:
        if time.monotonic() > deadline:
            log.warning("not every copy started within %.0f s; going on with those that did", timeout_s)
            return
        time.sleep(0.05)


def from_env(config: ReplicaConfig) -> FaultTolerantCopies:
    """The copy this launcher-started process is."""
    return FaultTolerantCopies(config, int(os.environ[REPLICA_ENV]), int(os.environ[REPLICAS_ENV]))


# ---------------------------------------------------------------------- the launcher


def launch(replicas: int, *, max_restarts: int = 3, heartbeat_timeout_s: float = 5.0) -> None:
    """Run this command again as ``replicas`` copies, with a torchft lighthouse in this process; restart a copy that
    a signal killed (at most ``max_restarts`` times in all). Returns when every copy finished."""
    os.environ.setdefault("RUST_LOG", "error")  # before torchft's native module reads it
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,  # the run goes on with whichever copies are alive
        join_timeout_ms=10_000,  # how long a first quorum waits for copies still starting
        heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
    )
    from torch.distributed import TCPStore

    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    env = {
        **os.environ,
        LIGHTHOUSE_ENV: lighthouse.address(),
        REPLICAS_ENV: str(replicas),
        STORE_ENV: str(store.port),
    }
    argv = [sys.executable, "-m", "pmakit", *sys.argv[1:]]
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(replicas):
            procs[r] = subprocess.Popen(argv, env={**env, REPLICA_ENV: str(r)})
        _supervise(procs, argv, env, max_restarts)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        lighthouse.shutdown()


def _supervise(
    procs: dict[int, subprocess.Popen[bytes]], argv: list[str], env: dict[str, str], max_restarts: int
) -> None:
    restarts = 0
    running = set(procs)
    while running:
        time.sleep(0.2)
        for r in sorted(running):
            code = procs[r].poll()
            if code is None:
                continue
            if code == 0:
                running.discard(r)
            elif code < 0 and r != 0 and 0 not in running:
                # copy 0 has written the whole run: a copy killed after that had nothing left to add
                log.warning("copy %d was killed (%s) after the run finished", r, signal.Signals(-code).name)
                running.discard(r)
            elif code < 0 and restarts < max_restarts:
                restarts += 1
                log.warning(
                    "copy %d was killed (%s); restarting it (restart %d of at most %d): it heals from a live copy",
                    r,
                    signal.Signals(-code).name,
                    restarts,
                    max_restarts,
                )
                procs[r] = subprocess.Popen(argv, env={**env, REPLICA_ENV: str(r), RESTART_ENV: "1"})
            else:
                why = f"was killed ({signal.Signals(-code).name})" if code < 0 else f"failed (exit {code})"
                raise PmakitError(f"model copy {r} {why}; its error, if any, is printed above")
