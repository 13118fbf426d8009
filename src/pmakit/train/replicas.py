"""Training across model copies: synchronous data parallel, local SGD and DiLoCo, with PMA on top.

R copies of the model train in one process each (gloo: pmakit's trainer runs on the CPU), each on its own data
shard (``get_batch(..., shard=rank)``), counted together: a step of R copies is R x batch x seq_len tokens.

- ``sync="gradients"``: the gradients are all-reduced every step (DDP's arithmetic); the baseline.
- ``sync="weights"`` with ``outer="average"``: local SGD. Each copy takes H inner steps alone, then the copies'
  weights are averaged (torch's ``model_averaging.utils.average_parameters``, what ``PeriodicModelAverager`` calls).
- ``sync="weights"`` with ``outer="sgd"`` or ``"nesterov"``: DiLoCo (Douillard et al. 2023). Every H inner steps
  the averaged pseudo-gradient ``global - local`` is the gradient of an outer ``torch.optim.SGD`` (Nesterov momentum
  for ``nesterov``) on the global weights; every copy restarts from the new global weights. Outer SGD with lr 1 and
  no momentum is local SGD.

Right after a sync all copies hold the same weights, which is what rank 0 snapshots every V tokens (V must be a
multiple of H steps) and what the online merge (PMA) averages over time. With ``save_replicas`` every copy also
snapshots its own weights just before the sync (``RUN/replicas/rank-R/``), for merges across copies or across
copies and time. Each copy keeps its own inner optimizer state; a checkpoint gathers them on rank 0 so that a
crashed run resumes exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pmakit.errors import PmakitError

SYNC_MODES = ("gradients", "weights")
OUTER = ("average", "sgd", "nesterov")


@dataclass(frozen=True)
class ReplicaConfig:
    """How R model copies are kept together."""

    sync: str = "weights"
    """``gradients``: all-reduce gradients every step (synchronous data parallel); ``weights``: local SGD/DiLoCo."""
    sync_every: int = 1
    """H: inner steps between weight syncs (``sync="weights"``)."""
    outer: str = "average"
    """``average`` (local SGD), ``sgd`` or ``nesterov`` (DiLoCo's outer optimizer on the pseudo-gradient)."""
    outer_lr: float = 0.7
    """Outer learning rate (DiLoCo uses 0.7 with Nesterov momentum 0.9)."""
    outer_momentum: float = 0.9
    """Outer momentum (``sgd`` and ``nesterov``)."""
    save_replicas: bool = False
    """Also snapshot every copy's own weights just before a sync, under RUN/replicas/rank-R/."""

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise PmakitError(f"unknown sync {self.sync!r}; use {' or '.join(SYNC_MODES)}")
        if self.outer not in OUTER:
            raise PmakitError(f"unknown outer optimizer {self.outer!r}; use {', '.join(OUTER)}")
        if self.sync_every < 1:
            raise PmakitError(f"sync_every must be at least 1, got {self.sync_every}")
        if self.sync == "gradients" and (self.outer != "average" or self.sync_every != 1):
            raise PmakitError(
                "sync=gradients syncs every step; --sync-every and --outer are for sync=weights"
            )
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise PmakitError("outer_lr must be positive and outer_momentum in [0, 1)")

    @property
    def label(self) -> str:
        if self.sync == "gradients":
            return "sync"
        return f"local-H{self.sync_every}" if self.outer == "average" else f"diloco-H{self.sync_every}"


class SingleCopy:
    """One model copy: every hook is a no-op (the plain trainer)."""

    rank = 0
    size = 1
    all_reduces = 0
    save_replicas = False
    restarted = False
    """A process restarted after its copy was killed (torchft): it resumes and heals, never starts over."""

    @property
    def is_writer(self) -> bool:
        return True

    def attach(self, model: nn.Module) -> None:
        """Called once the model's starting weights are in place."""

    def join(self, trainer: Any) -> None:
        """Called when training starts, after any resume: a fault-tolerant copy joins the others here."""

    def close(self) -> None:
        """Called when the trainer closes."""

    def finish(self) -> None:
        """Called once the run has finished without error: every copy is done with the others."""

    def reduce_gradients(self, model: nn.Module) -> None:
        """After backward, before clipping."""

    def due(self, step: int) -> bool:
        """Whether the copies sync after optimizer step ``step``."""
        return False

    def in_sync(self, step: int) -> bool:
        """Whether every copy holds the same weights after step ``step`` (when snapshots and checkpoints are due)."""
        return True

    def sync(self, model: nn.Module) -> None:
        """Bring the copies together after an optimizer step that is ``due``."""

    def gather_state(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]] | None:
        """Every copy's inner optimizer state, on rank 0 (a collective: every rank calls it)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        """Restore what ``state_dict`` and ``gather_state`` saved."""

    def check_interval(self, every_tokens: int, tokens_per_step: int) -> None:
        """Snapshots and checkpoints must fall on sync points."""


class Replicas(SingleCopy):
    """R copies in a torch.distributed process group (this process is one of them)."""

    def __init__(self, config: ReplicaConfig, group: Any = None, *, owns_group: bool = False) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise PmakitError("replicas need torch.distributed: run under torchrun --nproc-per-node R")
        self.config = config
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.save_replicas = config.save_replicas
        self.all_reduces = 0
        self._global: list[torch.Tensor] = []
        self._outer: torch.optim.Optimizer | None = None
        self.owns_group = owns_group
        """Whether this process started the process group for the copies (then ``finish`` tears it down)."""

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def finish(self) -> None:
        if self.owns_group:
            from pmakit.world import teardown_process_group

            teardown_process_group()

    def attach(self, model: nn.Module) -> None:
        """Start every copy from rank 0's weights; DiLoCo keeps the global weights and their outer optimizer."""
        import torch.distributed as dist

        with torch.no_grad():
            for p in trainable(model):
                dist.broadcast(
                    p.data, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group
                )
        if self.config.sync == "weights":
            self._global, self._outer = outer_optimizer(self.config, trainable(model))

    def reduce_gradients(self, model: nn.Module) -> None:
        if self.config.sync != "gradients":
            return
        grads = [p.grad for p in trainable(model) if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce_mean(flat)
        unflatten(flat, grads)

    def due(self, step: int) -> bool:
        return self.config.sync == "weights" and step % self.config.sync_every == 0

    def in_sync(self, step: int) -> bool:
        return self.config.sync == "gradients" or self.due(step)

    def sync(self, model: nn.Module) -> None:
        params = trainable(model)
        with torch.no_grad():
            if self._outer is None:
                from torch.distributed.algorithms.model_averaging.utils import average_parameters

                average_parameters(iter(params), self.group)
                self.all_reduces += 1
                return
            # DiLoCo: the outer gradient is the copies' mean displacement from the global weights.
            deltas = torch.cat([(g - p.detach()).reshape(-1) for g, p in zip(self._global, params)])
            self._all_reduce_mean(deltas)
            offset = 0
            for g in self._global:
                g.grad = deltas[offset : offset + g.numel()].view_as(g).clone()
                offset += g.numel()
            self._outer.step()
            self._outer.zero_grad(set_to_none=True)
            for g, p in zip(self._global, params):
                p.copy_(g)

    def _all_reduce_mean(self, flat: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(flat, group=self.group)
        flat /= self.size
        self.all_reduces += 1

    def gather_state(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]] | None:
        import torch.distributed as dist

        mine = {"optimizer": optimizer.state_dict(), "rank": self.rank}
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        dst = dist.get_global_rank(self.group, 0) if self.group else 0
        dist.gather_object(mine, out, dst=dst, group=self.group)
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "all_reduces": self.all_reduces,
            "label": self.config.label,
            "size": self.size,
        }
        return {**state, **outer_state(self._global, self._outer)}

    def load_state_dict(self, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
        check_same_copies(state, self.size, self.config)
        self.all_reduces = int(state["all_reduces"])
        copies = state.get("copies") or []
        if len(copies) == self.size:
            optimizer.load_state_dict(copies[self.rank]["optimizer"])
        load_outer(self._global, self._outer, state)

    def check_interval(self, every_tokens: int, tokens_per_step: int) -> None:
        if self.config.sync == "weights":
            check_sync_interval(self.config, self.size, every_tokens, tokens_per_step)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the copies train and sync."""
    return [p for p in model.parameters() if p.requires_grad]


def unflatten(flat: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
    """Copy a flat buffer (an all-reduced ``cat`` of ``into``) back into ``into``'s tensors."""
    offset = 0
    for t in into:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def check_same_copies(state: dict[str, Any], copies: int, config: ReplicaConfig) -> None:
    """A checkpoint's copies resume only with as many copies and the same sync options."""
    if state.get("size") != copies or state.get("label") != config.label:
        raise PmakitError(
            f"the checkpoint was written by {state.get('size')} copies ({state.get('label')}), "
            f"this run has {copies} ({config.label}): resume with the same --replicas and sync options"
        )


def outer_optimizer(
    config: ReplicaConfig, params: list[nn.Parameter]
) -> tuple[list[torch.Tensor], torch.optim.Optimizer | None]:
    """DiLoCo's global weights and their outer SGD (Nesterov for ``nesterov``); none for local SGD."""
    if config.outer == "average":
        return [], None
    weights = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(
        weights, lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer == "nesterov"
    )
    return weights, outer


def outer_state(weights: list[torch.Tensor], outer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The checkpoint entries of ``outer_optimizer``'s state (none for local SGD)."""
    if outer is None:
        return {}
    return {"global": [g.detach().clone() for g in weights], "outer": outer.state_dict()}


def load_outer(
    weights: list[torch.Tensor], outer: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Restore what ``outer_state`` saved."""
    if outer is None or "outer" not in state:
        return
    with torch.no_grad():
        for g, saved in zip(weights, state["global"]):
            g.copy_(saved)
    outer.load_state_dict(state["outer"])


def check_sync_interval(config: ReplicaConfig, copies: int, every_tokens: int, tokens_per_step: int) -> None:
    """Snapshot and checkpoint intervals must fall on syncs, so that every snapshot is of the synced model."""
    per_sync = config.sync_every * tokens_per_step * copies
    if every_tokens % per_sync:
        raise PmakitError(
            f"snapshot and checkpoint intervals ({every_tokens:,} tokens) must be multiples of the tokens between syncs ({per_sync:,} = "
            f"sync_every {config.sync_every} x {copies} copies x {tokens_per_step:,} tokens per step), "
            f"so that every snapshot is of the synced model; {_what_fits(config, copies, every_tokens, tokens_per_step)}"
        )


def _what_fits(config: ReplicaConfig, copies: int, every_tokens: int, tokens_per_step: int) -> str:
    """The --sync-every values this interval allows, or what to change when none does."""
    step = tokens_per_step * copies  # all copies' tokens in one step
    if every_tokens % step == 0:
        fits = [h for h in range(1, every_tokens // step + 1) if every_tokens % (h * step) == 0]
        return f"--sync-every {', '.join(map(str, fits[:8]))} fit{'s' if len(fits) == 1 else ''}"
    return (
        f"no --sync-every fits: with {copies} copies a step is {step:,} tokens, so every_tokens must be a "
        f"multiple of {step:,} (e.g. {every_tokens // step * step or step:,}; or --preset replicas-smoke)"
    )


def from_env(config: ReplicaConfig | None) -> SingleCopy:
    """The copies this process belongs to: ``Replicas`` under torchrun with a config, else ``SingleCopy``."""
    if config is None:
        return SingleCopy()
    if int(os.environ.get("WORLD_SIZE", "1")) < 2:
        raise PmakitError(
            "--replicas needs one process per copy: torchrun --nproc-per-node R -m pmakit train ... --replicas R"
        )
    import torch.distributed as dist

    from pmakit.world import start_process_group

    started = not dist.is_initialized()
    if started:
        start_process_group("gloo")  # pmakit's trainer keeps its model on the CPU
    return Replicas(config, owns_group=started)
