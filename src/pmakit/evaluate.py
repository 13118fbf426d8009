"""Validation loss, its standard error and bits per byte of a model on fixed held-out batches.

Every model of a comparison (latest, merged, annealed) is scored on the same batches, so differences between two
models can be given a paired standard error over batches: the batch-to-batch variation of the text cancels.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pmakit.errors import PmakitError, first_line

Batch = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalResult:
    """Mean next-token loss (nats) over held-out batches."""

    loss: float
    """Mean loss over the batches (each batch weighs the same: they all have the same number of tokens)."""
    loss_se: float
    """Standard error of ``loss`` over batches."""
    bpb: float | None
    """Bits per UTF-8 byte of the held-out text, when the bytes per token are known."""
    batch_losses: list[float] = field(repr=False)
    """Per-batch mean losses, for paired comparisons (``paired_difference``)."""

    def as_record(self) -> dict[str, float | None]:
        return {"val_loss": self.loss, "val_loss_se": self.loss_se, "bpb": self.bpb}


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    n = len(xs)
    mean = math.fsum(xs) / n
    if n < 2:
        return mean, float("nan")
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1)
    return mean, math.sqrt(var / n)


def batch_loss(model: Callable[..., Any], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of next-token predictions; ``y`` is ``x`` shifted by one (no shift happens here).
    ``model``: a causal LM, or any callable taking ``input_ids=`` and returning an output with ``.logits``."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


def evaluate(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    *,
    bytes_per_token: float | None = None,
    compiled: bool = False,
) -> EvalResult:
    """Score ``model`` on ``batches`` in eval mode (restoring its training mode after).

    ``compiled``: run the forward through ``torch.compile`` (built once per model on the first call, then reused:
    weights swapped in place are the graph's inputs, so a new state does not recompile). It pays when a process
    scores many states of one model (the experiment's grid and tuner); if the compiler fails, a warning and the
    eager forward from then on.
    """
    return result_of(list(batch_losses(model, batches, compiled=compiled)), bytes_per_token)


def batch_losses(
    model: torch.nn.Module, batches: Sequence[Batch], *, compiled: bool = False
) -> Generator[float, None, None]:
    """``model``'s loss on each of ``batches`` in turn (eval mode, no grad), so a caller can stop after any of them
    (``pmakit tune`` drops a trial once it is clearly worse than the best). Close the iterator when stopping early:
    that restores the model's training mode. ``compiled``: as in ``evaluate``."""
    was_training = model.training
    model.eval()
    try:
        forward = _eval_forward(model) if compiled else model
        for x, y in batches:
            with torch.no_grad():
                try:
                    loss = batch_loss(forward, x, y).item()
                except Exception as exc:  # any compiler failure: the eager forward from then on
                    if forward is model:
                        raise
                    log.warning("torch.compile failed (%s): evaluating without it", first_line(exc))
                    forward = model.__dict__[_COMPILED] = model
                    loss = batch_loss(model, x, y).item()
            yield loss
    finally:
        model.train(was_training)


def result_of(losses: Sequence[float], bytes_per_token: float | None = None) -> EvalResult:
    """The ``EvalResult`` of per-batch losses (equal-sized batches: each weighs the same)."""
    if not losses:
        raise PmakitError("no validation batches to evaluate on")
    mean, se = _mean_se(losses)
    bpb = mean / (math.log(2) * bytes_per_token) if bytes_per_token else None
    return EvalResult(mean, se, bpb, list(losses))


_COMPILED = "_pmakit_eval_forward"


def _eval_forward(model: torch.nn.Module) -> Any:
    """The model's compiled forward for evaluation, kept on the model (outside its submodules and state dict)."""
    forward = model.__dict__.get(_COMPILED)
    if forward is None:
        forward = torch.compile(model, dynamic=False)
        model.__dict__[_COMPILED] = forward
    return forward


def can_compile() -> bool:
    """Whether ``torch.compile`` can build kernels here: on CPU its inductor backend needs a C++ compiler."""
    if torch.cuda.is_available():
        import importlib.util

        return importlib.util.find_spec("triton") is not None
    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def paired_difference(a: EvalResult, b: EvalResult) -> tuple[float, float]:
    """(mean of a - b, its paired standard error over batches). Both must be scored on the same batches."""
    if len(a.batch_losses) != len(b.batch_losses):
        raise PmakitError("paired comparison needs results on the same batches")
    return _mean_se([x - y for x, y in zip(a.batch_losses, b.batch_losses)])


def native_bf16() -> bool:
    """Whether this machine multiplies bf16 natively: a CUDA device with bf16, or a CPU with AVX512-BF16 or AMX-BF16
    (the flags of Linux's /proc/cpuinfo; elsewhere False). Without it, bf16 autocast on CPU is slower than fp32."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cpu_threads(threads: int | None) -> None:
    """Use ``threads`` intra-op threads (default: ``OMP_NUM_THREADS`` where it is set, as torchrun sets it to 1 for
    each of several processes on a node, else the cores this process may run on)."""
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS", "").strip().isdigit():
            threads = int(os.environ["OMP_NUM_THREADS"])
        else:
            threads = (
                len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            )
    torch.set_num_threads(max(1, threads))
