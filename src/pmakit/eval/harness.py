"""The lm-evaluation-harness bridge: an in-memory model through ``lm_eval.evaluator.evaluate``, per-item scores out.

lm-eval runs offline here (``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` are set before it is imported): tasks are
lm-eval's own (``hellaswag``... when their data is in the local HF cache) or local YAML tasks found through
``TaskManager(include_path=...)``, such as the ones ``pmakit.eval.tasks`` builds. Every task is run with
``log_samples=True`` and each metric's per-item values are kept: a mean metric's 0/1 or score per item, or a
(log-likelihood, units) pair for the corpus-level ratios (``bits_per_byte``, ``byte_perplexity``,
``word_perplexity``), from which ``pmakit.eval.stats`` computes standard errors and paired differences.
"""

from __future__ import annotations

import difflib
import logging
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError, first_line

log = logging.getLogger(__name__)

INSTALL_HINT = (
    'lm-evaluation-harness is not installed: pip install -e ".[eval]" (or pip install "lm-eval[hf]")'
)
RATIO_METRICS = ("bits_per_byte", "byte_perplexity", "word_perplexity")
"""Corpus-level metrics whose per-item values are (log-likelihood, units) pairs."""


@dataclass
class MetricScores:
    """One metric of one task for one model."""

    value: float
    """lm-eval's aggregate."""
    stderr: float | None
    """lm-eval's own standard error (None where it gives none)."""
    items: list[Any]
    """Per item, in lm-eval's doc order: a number, or [log-likelihood, units] for ``RATIO_METRICS``."""
    doc_ids: list[int]


def offline() -> None:
    """Nothing is downloaded: lm-eval and ``datasets`` read local files and caches only."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def require_lm_eval() -> str:
    """lm-eval's version; one error line when it is not installed."""
    offline()
    try:
        import lm_eval
    except ImportError:
        raise PmakitError(INSTALL_HINT) from None
    for name in ("lm_eval", "lm-eval", "datasets"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return str(lm_eval.__version__)


def task_manager(include: Sequence[Path] = (), tasks: Sequence[str] | None = None) -> Any:
    """lm-eval's task index over the ``include`` folders, and over lm-eval's own ~14,000 task YAMLs only when
    ``tasks`` names one the folders lack (or ``tasks`` is None): indexing those takes 10-25 s on 2 cores, each time,
    and pmakit's own tasks never need them."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [str(p) for p in include]
    if paths and tasks is not None:
        local = TaskManager(include_path=paths, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=paths or None)


def check_tasks(names: Sequence[str], manager: Any) -> None:
    """An unknown task is one error line, with the nearest names lm-eval knows."""
    known = set(manager.all_tasks)
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, sorted(known), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise PmakitError(f"unknown task {name!r} (not an lm-eval task nor a local task YAML){hint}")


def hflm(model: Any, tokenizer: Any, *, batch_size: int = 8, device: str | None = "best") -> Any:
    """lm-eval's ``HFLM`` around an in-memory model (nothing is loaded from disk); a continuation longer than the
    model's context is scored in windows (``pmakit.eval.lm``), not refused.

    ``device``: ``best`` moves the model to the GPU when there is one (a model built to be evaluated); None leaves
    it where it is (a trainer's model, evaluated in the loop)."""
    require_lm_eval()
    import torch

    from pmakit.eval.lm import WindowedHFLM

    if device == "best":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = model.to(device)
    elif device is None:
        device = str(next(model.parameters()).device)
    return WindowedHFLM(pretrained=model, tokenizer=tokenizer, device=device, batch_size=batch_size)


@contextmanager
def quiet_bars() -> Iterator[None]:
    """No tqdm bar inside the block (lm-eval's per-request and task-building bars, ``datasets``' split bars: one
    per task and model would flood a study's output), each bar as before after it. The environment is not touched
    (``TQDM_DISABLE`` would silence every later tqdm of the process, and tqdm reads it only at import); pmakit's own
    progress is rich's, not tqdm's."""
    from tqdm import std

    original = std.tqdm.__init__

    def disabled(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    std.tqdm.__init__ = disabled
    try:
        yield
    finally:
        std.tqdm.__init__ = original


def run_tasks(
    lm: Any, tasks: Sequence[str], manager: Any, *, limit: int | None = None
) -> dict[str, dict[str, MetricScores]]:
    """lm-eval's ``evaluate`` of ``tasks`` on ``lm``: ``{task: {metric: MetricScores}}``.

    What ``simple_evaluate`` adds around ``evaluate`` is left out, on purpose: it rebuilds the tasks (their data
    read again) for each call, runs ``torch.utils.collect_env`` (a ``pip list`` subprocess: 1.7 s a call here, paid
    for every model a study or a tuner scores), and reseeds Python's, NumPy's and torch's global generators, which
    would change a training run's random stream each time a callback evaluates in the loop. The tasks are loaded
    once per task manager and given what ``simple_evaluate`` gives them (zero-shot unless their config says
    otherwise, lm-eval's fewshot seed); their requests are built anew by each ``evaluate``.
    """
    from lm_eval.evaluator import evaluate

    try:
        with quiet_bars():
            loaded = _loaded(manager, tuple(tasks))
            out = evaluate(lm=lm, task_dict=loaded, limit=limit, log_samples=True, fewshot_as_multiturn=True)
    except PmakitError:
        raise
    except Exception as exc:  # a task whose data is missing offline, a malformed YAML
        raise PmakitError(f"lm-eval could not run {', '.join(tasks)}: {first_line(exc)}") from None
    if out is None:  # lm-eval returns the results on rank 0 only (the other ranks of a torchrun job)
        return {}
    return {task: scores_of(out, task) for task in tasks if task in out["samples"]}


_LOADED: weakref.WeakKeyDictionary[Any, dict[tuple[str, ...], Any]] = weakref.WeakKeyDictionary()
FEWSHOT_SEED = 1234
"""``simple_evaluate``'s default ``fewshot_random_seed``."""


def _loaded(manager: Any, tasks: tuple[str, ...]) -> Any:
    """``manager.load(tasks)``, once per manager and task list, prepared as ``simple_evaluate`` prepares them."""
    cache = _LOADED.setdefault(manager, {})
    if tasks not in cache:
        try:
            loaded = manager.load(list(tasks))
        except Exception as exc:  # a task whose data is missing offline, a malformed YAML
            raise PmakitError(f"lm-eval could not load {', '.join(tasks)}: {first_line(exc)}") from None
        for task in loaded["tasks"].values():
            if task.get_config("num_fewshot") is None:
                task.set_config(key="num_fewshot", value=0)
            task.set_fewshot_seed(seed=FEWSHOT_SEED)
        cache[tasks] = loaded
    return cache[tasks]


def scores_of(out: Mapping[str, Any], task: str) -> dict[str, MetricScores]:
    """Per metric of ``task``: lm-eval's aggregate and stderr, and the per-item values of its samples."""
    results, samples = out["results"][task], out["samples"][task]
    scores: dict[str, MetricScores] = {}
    for key, value in results.items():
        metric, _, filt = key.partition(",")
        if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
            continue
        stderr = results.get(f"{metric}_stderr,{filt}")
        rows = [s for s in samples if s.get("filter", filt) == filt and metric in s]
        items = [list(s[metric]) if isinstance(s[metric], (list, tuple)) else float(s[metric]) for s in rows]
        scores[metric] = MetricScores(
            float(value),
            float(stderr) if isinstance(stderr, (int, float)) else None,
            items,
            [int(s["doc_id"]) for s in rows],
        )
    return scores


@dataclass
class LoopTasks:
    """lm-eval tasks a training callback scores the online merge on when the trainer evaluates.

    The scores go into the merged ``eval`` record of metrics.jsonl and the trainer's logs as
    ``eval_merged/<task>/<metric>``. The model must be an HF causal LM (the HF Trainer's, or the one inside a
    LightningModule).
    """

    tasks: Sequence[str]
    """lm-eval task names (a built ``pmakit.eval.tasks`` split folder in ``include`` gives pmakit's own)."""
    tokenizer: Any
    """The model's tokenizer, or a folder ``AutoTokenizer`` loads it from."""
    limit: int | None = 100
    """Items per task (the first N)."""
    every: int = 1
    """Score at every ``every``-th evaluation of the merge."""
    include: Sequence[Path] = ()
    """Folders of task YAMLs."""
    batch_size: int = 8

    def __post_init__(self) -> None:
        if not self.tasks or self.every < 1 or (self.limit is not None and self.limit < 1):
            raise PmakitError("LoopTasks needs tasks, every >= 1 and limit >= 1 (or None)")
        self._manager: Any = None
        self._calls = 0

    def due(self) -> bool:
        self._calls += 1
        return self._calls % self.every == 0

    def scores(self, model: Any) -> dict[str, float]:
        """``{"eval_merged/<task>/<metric>": value}`` of ``model`` as it is (its training mode restored)."""
        if self._manager is None:
            self._manager = task_manager(self.include, self.tasks)
            check_tasks(self.tasks, self._manager)
            if isinstance(self.tokenizer, (str, os.PathLike)):
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        training = model.training
        try:
            lm = hflm(model, self.tokenizer, batch_size=self.batch_size, device=None)
            found = run_tasks(lm, self.tasks, self._manager, limit=self.limit)
        finally:
            model.train(training)
        return {f"eval_merged/{t}/{m}": s.value for t, scores in found.items() for m, s in scores.items()}
