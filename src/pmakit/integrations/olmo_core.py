"""PMA for OLMo-core's ``Trainer``: a callback beside its ``CheckpointerCallback`` and evaluators::

    trainer_config.with_callback("pma", PMACallback(save_dir="runs/x-pma", every_tokens=2_000_000, last=10))

Every ``every_tokens`` training tokens (``trainer.global_train_tokens_seen``) it saves a pmakit snapshot of the
model (full weights, gathered from FSDP shards on rank 0, in OLMo-core's parameter names) into ``save_dir``, and
keeps an online ``method`` average of the last ``last`` snapshots. Whenever the trainer's ``EvaluatorCallback``\\ s
evaluate (every ``eval_every``-th time), the average is loaded into the model, the same evaluators run again with
metric prefix ``eval/pmakit`` (e.g. ``eval/pmakit/lm/CE loss``), and the trained weights are put back. Records
also go to ``save_dir/metrics.jsonl``.

With ``downstream=LoopTasks(tasks, tokenizer, limit=..., every=...)`` (``pmakit.eval.harness``) the loaded average is
also scored on lm-eval tasks, as the HF and Lightning callbacks do: lm-eval's ``HFLM`` sees OLMo-core's
``Transformer`` through a view that gives it ``forward(ids).logits`` and a config with the trainer's
``max_sequence_length``. The scores are recorded as trainer metrics ``eval_merged/<task>/<metric>`` and in the
merged record of metrics.jsonl. Every rank runs the same lm-eval pass (an FSDP model's forward needs them all).

Resume-safe: the callback's state (the saver's token marks and the averager's window) is saved in OLMo-core's
trainer state (``train/rankR.pt``), and on a resume the running sums are rebuilt from the window's snapshots on
disk, so a window interrupted by a restart is completed, not skipped (OLMo-core's ``ModelMergeCallback`` skips
it). Without that state (first resume of an older run) the window is rebuilt from the snapshots in ``save_dir``
up to the resumed token count.

Keep ``save_dir`` outside the trainer's ``save_folder``: a merge of the save folder would otherwise see every
save twice. ``pmakit merge save_dir -o OUT`` merges the snapshots offline; ``pmakit merge save_folder -o OUT``
merges OLMo-core's own checkpoints (see ``pmakit.layouts.olmo_core``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from olmo_core.train.callbacks import Callback, EvaluatorCallback
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from pmakit.errors import PmakitError
from pmakit.integrations import PMACore
from pmakit.layouts.kinds import DEFAULT_BUFFERS

log = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclass
class PMACallback(Callback):
    """Snapshots every ``every_tokens`` tokens into ``save_dir`` and an online average of the last ``last``,
    evaluated with the trainer's evaluators every ``eval_every``-th evaluation (0: never)."""

    # Before the CheckpointerCallback (1), which saves in post_train_batch: a checkpoint of this step then
    # records this step's snapshot, so a resume from it neither saves it again nor loses it from the window.
    priority: ClassVar[int] = 2

    save_dir: str = ""
    """Where the pmakit snapshots go (outside the trainer's save_folder)."""
    every_tokens: int = 0
    """V: training tokens between snapshots."""
    last: int = 10
    """N: snapshots in the online average."""
    method: str = "sma"
    """Weighting of the online average (sma, ema, ...; see pmakit.weights)."""
    eval_every: int = 1
    """Evaluate the average at every eval_every-th evaluation of the trainer's evaluators (0: never)."""
    alpha: float = 0.2
    """EMA factor."""
    keep_last: int | None = None
    """Keep only the newest K snapshots on disk (None: all; at least ``last``)."""
    upload_to: str | None = None
    """An ``s3://`` / ``gs://`` URL every complete snapshot is also uploaded to, off the training thread."""
    buffers: str = DEFAULT_BUFFERS
    """MoE router biases in the average: ``average`` or the newest snapshot's (``latest``), as ``merge --buffers``."""
    prefix: str = "eval/pmakit"
    """Metric prefix of the average's evaluation."""
    downstream: Any = None
    """lm-eval tasks the average is also scored on (``pmakit.eval.harness.LoopTasks``: tasks, tokenizer, limit,
    every); None: none."""
    enabled: bool = True

    _core: PMACore | None = field(default=None, init=False, repr=False)
    _resumed: dict[str, Any] | None = field(default=None, init=False, repr=False)

    def post_attach(self) -> None:
        if not self.enabled:
            return
        if not self.save_dir or self.every_tokens < 1:
            raise PmakitError("PMACallback needs save_dir and every_tokens >= 1")
        self._core = PMACore(
            self.save_dir,
            self.every_tokens,
            last=self.last,
            method=self.method,
            eval_every=self.eval_every,
            alpha=self.alpha,
            keep_last=self.keep_last,
            upload_to=self.upload_to,
            buffers=self.buffers,
        )

    @property
    def core(self) -> PMACore:
        if self._core is None:
            raise PmakitError("PMACallback is not attached to a trainer (or not enabled)")
        return self._core

    # -- OLMo-core hooks ----------------------------------------------------------------------------------------

    def pre_train(self) -> None:
        if not self.enabled or _rank() != 0:
            return
        tokens = self.trainer.global_train_tokens_seen
        resumed = self._resumed
        self.core.start(self._model(), tokens)
        if resumed is not None:
            # The checkpoint's own window, not whatever snapshots a crashed continuation left after it.
            self.core.load_state_dict(resumed)
            log.info("PMA: resumed the online average of %d snapshots", self.core.averager.count)

    def post_train_batch(self) -> None:
        """The snapshot, right after the optimizer step (before the checkpointer's hook: see ``priority``)."""
        if not self.enabled:
            return
        tokens = self.trainer.global_train_tokens_seen
        saver = self.core.saver if _rank() == 0 else None
        due = saver is not None and saver.due(tokens)
        if self._agree(due):
            state = self._full_state()  # a collective: every rank takes part, rank 0 gets the tensors
            if _rank() == 0:
                self.core.step(state, tokens=tokens, step=self.step)

    def post_step(self) -> None:
        """The average's evaluation at the steps the evaluators evaluate (just before they do)."""
        if self.enabled and self._evaluators_ran():
            self._evaluate_average(self.trainer.global_train_tokens_seen)

    def state_dict(self) -> dict[str, Any]:
        if not self.enabled or self._core is None:
            return {}
        # Plain values only (OLMo-core's trainer state is read back with weights_only loads).
        return self._core.state_dict(include_tensors=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._resumed = dict(state_dict) if state_dict else None

    def post_train(self) -> None:
        if self._core is not None:
            self._core.close()

    def close(self) -> None:
        if self._core is not None:
            self._core.close()

    # -- the work -----------------------------------------------------------------------------------------------

    def _model(self) -> torch.nn.Module:
        model = self.trainer.train_module.model  # type: ignore[attr-defined]
        assert isinstance(model, torch.nn.Module)
        return model

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank (only rank 0 runs the saver)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return flag
        box = [flag]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The model's full state dict on rank 0's CPU (FSDP shards gathered), nothing elsewhere."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self._model(), options=options)
        return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}

    def _evaluators_ran(self) -> bool:
        """Whether the trainer's evaluators evaluate at this step (their own condition)."""
        for cb in self._evaluator_callbacks():
            if self.step > 1 and (
                (cb.eval_interval is not None and self.step % cb.eval_interval == 0)
                or (cb.fixed_steps is not None and self.step in cb.fixed_steps)
            ):
                return True
        return False

    def _evaluator_callbacks(self) -> list[EvaluatorCallback]:
        return [cb for cb in self.trainer.callbacks.values() if isinstance(cb, EvaluatorCallback)]

    def _evaluate_average(self, tokens: int) -> None:
        core = self.core
        ready = _rank() == 0 and core.evaluation_due() and core.merge_ready()
        if not self._agree(ready):
            return
        metrics: dict[str, float] = {}
        with self._average_loaded():
            for cb in self._evaluator_callbacks():
                cb.perform_eval(prefix=self.prefix)
            for name in self._metric_names():
                value = self.trainer.get_metric(name)
                if value is not None:
                    metrics[name.removeprefix(self.prefix + "/")] = float(value)
            scores = self._downstream_scores()
        for key, score in scores.items():
            self.trainer.record_metric(key, score)
        if _rank() == 0:
            core.write(core.merged_record(tokens, self.step, {"metrics": metrics, **scores}))

    def _downstream_scores(self) -> dict[str, float]:
        """``eval_merged/<task>/<metric>`` of the model as it is (the average), when the tasks are due."""
        if self.downstream is None or not self.downstream.due():
            return {}
        context = int(getattr(self.trainer.train_module, "max_sequence_length", 0) or 2048)
        box = [dict(self.downstream.scores(CausalLMView(self._model(), context)))]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(box, src=0)  # lm-eval gives the results to rank 0 only
        return box[0]

    def _metric_names(self) -> list[str]:
        names = []
        for cb in self._evaluator_callbacks():
            for evaluator in cb.evaluators:
                for label in getattr(evaluator, "metrics", {}):
                    names.append(f"{self.prefix}/{evaluator.name}/{label}/CE loss")
        return names

    @contextlib.contextmanager
    def _average_loaded(self) -> Iterator[None]:
        """Within the block the model holds the average (sent from rank 0 into every rank's shards); the trained
        weights (each rank's own shards, copied) are put back in ``finally``."""
        model = self._model()
        own = get_model_state_dict(model).items()
        backup: dict[str, Any] = {k: v.detach().clone() for k, v in own if isinstance(v, torch.Tensor)}
        average: dict[str, Any] = self.core.averager.average() if _rank() == 0 else {}
        try:
            full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
            set_model_state_dict(model, average, options=full)
            del average
            yield
        finally:
            set_model_state_dict(model, backup, options=StateDictOptions(strict=False))


class CausalLMView(torch.nn.Module):
    """OLMo-core's ``Transformer`` as lm-eval's ``HFLM`` takes an in-memory model: ``forward(input_ids).logits``,
    a ``config`` whose ``max_position_embeddings`` is the context lm-eval cuts inputs to, and ``tie_weights`` (a
    no-op: the model is used as it is)."""

    def __init__(self, model: torch.nn.Module, context: int) -> None:
        from transformers import PretrainedConfig

        super().__init__()
        self.model = model
        self.config = PretrainedConfig()
        self.config.max_position_embeddings = context

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def tie_weights(self) -> None:
        pass

    def forward(self, input_ids: torch.Tensor, **_: Any) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=self.model(input_ids))
