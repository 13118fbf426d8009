"""``pmakit tune``: search the merge of a run's snapshots on a selection split, confirm it on a disjoint test split.

The search space (one optuna TPE study, seeded): the window's end (how many snapshots back from the newest), the
spacing V (a multiple of the run's snapshot interval), the count N, and the weighting: ``sma``, ``wma``, ``ema`` and
``ema-normalized`` with a searched alpha, the WSM decay shapes (``wsm-cosine``, ``wsm-1sqrt``; ``wsm-linear`` is
``sma``), and ``free`` per-snapshot weights on the simplex (N uniforms u_i, w_i = -log u_i / sum: a uniform draw on
the simplex, the "checkpoint merging via Bayesian optimisation" idea of Liu et al. 2024, arXiv 2403.19390).

Every trial is scored on the selection split only. The first two trials are the baselines (the newest snapshot,
and the fixed recipe: SMA of the last 10 snapshots at the run's interval), so the search never returns a merge
that is worse on selection than either. The other trials race (``race``): each is scored against the best trial so
far on the same batches, and dropped once it is worse beyond doubt (paired t over the batches seen, one-sided p <
0.001, looked at after a quarter, a half and three quarters of them), so a bad trial costs a fraction of an
evaluation (the "racing" of Maron & Moore 1994 and irace; optuna records it as pruned). Last, the weights over the
window of the best trial that merges are fitted by gradient descent on the selection split (``learn_weights``: the
"learned soup" of Wortsman et al. 2022, w = softmax(z), ``learn_steps`` Adam steps from the trial's own weights),
scored in full on selection and kept as one more trial: chosen only if better there. The chosen merge and both
baselines are then scored once on the test split, with paired standard errors over the test batches, and the chosen
merge is written by the streaming engine (``pmakit.merge.merge``) into OUT, which loads like any merge;
OUT/tune.json records every trial.

Models are evaluated in memory (built from the newest snapshot's config.json, weights swapped in per trial). For
a model too big for that, ``eval_cmd`` runs a user command on each candidate merge written to disk.
"""

from __future__ import annotations

import logging
import math
import re
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, batch_loss, batch_losses, paired_difference, result_of
from pmakit.lab.evaldata import load_eval_data
from pmakit.runs import MAIN_RUN, atomic_write_json, snapshots_dir
from pmakit.snapshot import Snapshot
from pmakit.weights import get_weights, tune_families, uses_alpha

log = logging.getLogger(__name__)

FREE = "free"
"""The family of per-snapshot weights on the simplex."""


def searched_families() -> tuple[str, ...]:
    """Weightings searched: the registry's ``tune`` weightings, then ``free``."""
    return (*tune_families(), FREE)


FIXED_N = 10
"""N of the fixed recipe (the paper's default SMA), at the run's own snapshot interval."""
SPLITS = ("selection", "test")


@dataclass(frozen=True)
class TuneConfig:
    """What ``pmakit tune`` searches and how long."""

    budget_evals: int | None = 40
    """Trials (selection-split evaluations), the two baselines included; None: until ``budget_seconds``."""
    budget_seconds: float | None = None
    """Stop starting new trials after this many seconds (with ``budget_evals``: whichever comes first)."""
    seed: int = 0
    """Seed of the TPE sampler (and of the file order of a text corpus)."""
    batches: int = 16
    """Held-out batches per split."""
    batch_size: int | None = None
    """Sequences per batch (default: the run's, else 8)."""
    seq_len: int | None = None
    """Tokens per sequence (default: the run's, else the model's context up to 256)."""
    max_n: int = 16
    """Largest N searched."""
    v_multiples: tuple[int, ...] = (1, 2, 4)
    """Spacings searched, as multiples of the run's snapshot interval."""
    families: tuple[str, ...] = field(default_factory=searched_families)
    """Weightings searched."""
    eval_cmd: str | None = None
    """Evaluate with this command instead of in memory: ``{model}`` is a merged model directory, ``{split}`` is
    selection or test; it prints the loss as the last number on stdout."""
    force: bool = False
    """Replace OUT if it is a previous merge."""
    learn_steps: int = 20
    """Steps of the learned weights over the best merging trial's window (``learn_weights``; 0: none), after the
    search and outside its budget. In memory only."""
    race: bool = True
    """Stop a trial once it is clearly worse than the best so far (``Scorer.race``); False: every trial in full."""
    compile: bool = False
    """Evaluate in memory through ``torch.compile`` (compiled once, ~20 s; each batch then ~0.8x as long on CPU)."""
    metric: str | None = None
    """Choose by a downstream metric, TASK/METRIC of pmakit's held-out tasks through lm-eval
    (``pmakit_next_line/acc``), instead of the held-out loss: each item's value is a "batch" (negated where higher
    is better), selection items to choose, test items to report."""

    def __post_init__(self) -> None:
        if self.budget_evals is None and self.budget_seconds is None:
            raise PmakitError("give a budget: --budget-evals N or --budget-seconds S")
        if self.budget_evals is not None and self.budget_evals < 2:
            raise PmakitError(
                f"--budget-evals must be at least 2 (the two baselines), got {self.budget_evals}"
            )
        if self.budget_seconds is not None and not 0 < self.budget_seconds < math.inf:  # NaN: never stops
            raise PmakitError(
                f"--budget-seconds must be a positive number of seconds, got {self.budget_seconds}"
            )
        if not 0 <= self.seed < 2**32:  # optuna's TPE sampler seeds numpy's legacy RandomState
            raise PmakitError(f"--seed must be in 0 .. 2^32 - 1, got {self.seed}")
        if self.batches < 2:
            raise PmakitError(
                f"--batches must be at least 2 (a standard error needs two), got {self.batches}"
            )
        if self.learn_steps < 0:
            raise PmakitError(f"--learn-steps must be 0 (none) or positive, got {self.learn_steps}")
        if self.max_n < 1 or min(self.v_multiples, default=0) < 1:
            raise PmakitError("max_n and the V multiples must be positive")
        unknown = sorted(set(self.families) - set(searched_families()))
        if unknown or not self.families:
            raise PmakitError(
                f"unknown weighting families {unknown}; known: {', '.join(searched_families())}"
            )
        if self.metric is not None and self.eval_cmd is not None:
            raise PmakitError("--metric evaluates in memory through lm-eval; it does not go with --eval-cmd")
        if self.eval_cmd is not None and "{model}" not in self.eval_cmd:
            raise PmakitError("--eval-cmd must contain {model} (the merged model directory to evaluate)")


@dataclass(frozen=True)
class Candidate:
    """One merge: which snapshots, with which weights, and the parameters that gave them."""

    snapshots: tuple[Snapshot, ...]
    weights: tuple[float, ...]
    params: dict[str, Any] = field(hash=False, compare=False)

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(s.tokens for s in self.snapshots), tuple(round(w, 9) for w in self.weights)

    def record(self) -> dict[str, Any]:
        """The merge as tune.json and the study's rows keep it: the weights whole (JSON gives them back exactly), so
        that the merge rebuilt from a record (``chosen_candidate``), scored on the test split and written, is the
        one the trial scored (rounded, it was another merge, scored again on selection)."""
        return {**self.params, "tokens": [s.tokens for s in self.snapshots], "weights": list(self.weights)}


# --------------------------------------------------------------------------------------------------- the space


@dataclass(frozen=True)
class Space:
    """The run's snapshots (oldest first) and what may be searched over them."""

    snapshots: list[Snapshot]
    interval: int
    """The run's snapshot interval V (median gap in tokens)."""
    config: TuneConfig

    @classmethod
    def of(cls, snapshots: Sequence[Snapshot], config: TuneConfig) -> Space:
        gaps = [b.tokens - a.tokens for a, b in zip(snapshots, snapshots[1:])]
        return cls(list(snapshots), int(statistics.median(gaps)) if gaps else 0, config)

    def window(self, end_back: int, n: int, v_mult: int) -> list[Snapshot]:
        """Up to ``n`` snapshots ``v_mult`` apart ending ``end_back`` snapshots before the newest, oldest first."""
        end = len(self.snapshots) - 1 - end_back
        fit = end // v_mult + 1
        return [self.snapshots[end - k * v_mult] for k in range(min(n, fit))][::-1]

    def candidate(self, params: Mapping[str, Any], free: Sequence[float] = ()) -> Candidate:
        chosen = self.window(params["end_back"], params["n"], params["v_mult"])
        n, family = len(chosen), params["family"]
        if family == FREE:
            raw = [-math.log(max(u, 1e-12)) for u in free[:n]]
            weights = [r / sum(raw) for r in raw] if n > 1 else [1.0]
        else:
            weights = get_weights(family, n, alpha=params.get("alpha") or 0.2)
        effective = {
            "end_tokens": chosen[-1].tokens,
            "n": n,
            "v_tokens": params["v_mult"] * self.interval,
            "family": family,
            "alpha": params.get("alpha") if uses_alpha(family) else None,
        }
        return Candidate(tuple(chosen), tuple(weights), effective)

    def baselines(self) -> dict[str, Candidate]:
        """The newest snapshot alone, and the fixed recipe (SMA of the last 10 at the run's interval)."""
        last = {"end_back": 0, "n": 1, "v_mult": 1, "family": "sma"}
        fixed = {"end_back": 0, "n": FIXED_N, "v_mult": 1, "family": "sma"}
        return {"last": self.candidate(last), "fixed": self.candidate(fixed)}

    def lattice(self) -> list[dict[str, Any]]:
        """A coarse SMA grid ending at the newest snapshot (N doubling up to ``max_n``, every V multiple): the
        search's start, so TPE refines from the shape of the loss over N and V instead of from random draws."""
        cfg = self.config
        if "sma" not in cfg.families:
            return []
        ns = sorted({*(2**k for k in range(1, cfg.max_n.bit_length()) if 2**k <= cfg.max_n), cfg.max_n} - {1})
        return [
            {"end_back": 0, "v_mult": v, "n": n, "family": "sma"}
            for v in cfg.v_multiples
            for n in ns
            if len(self.window(0, n, v)) == n  # a window cut short would repeat a smaller one
        ]

    def suggest(self, trial: Any) -> Candidate:
        """The trial's candidate; conditional parameters (alpha, free weights) only where they mean something."""
        cfg = self.config
        params: dict[str, Any] = {
            "end_back": trial.suggest_int("end_back", 0, len(self.snapshots) - 1),
            "v_mult": trial.suggest_categorical("v_mult", list(cfg.v_multiples)),
            "n": trial.suggest_int("n", 1, cfg.max_n),
            "family": trial.suggest_categorical("family", list(cfg.families)),
        }
        if uses_alpha(params["family"]):
            params["alpha"] = trial.suggest_float("alpha", 0.02, 0.8, log=True)
        free: list[float] = []
        if params["family"] == FREE:
            n = len(self.window(params["end_back"], params["n"], params["v_mult"]))
            free = [trial.suggest_float(f"u{i}", 1e-6, 1.0) for i in range(n)]
        return self.candidate(params, free)


# --------------------------------------------------------------------------------------------------- scoring


Losses = Callable[[Candidate, str], Generator[float, None, None]]
"""A candidate's loss on each batch of a split in turn (a user command's one loss counts as one batch)."""


@dataclass(frozen=True)
class Stopped:
    """A trial dropped part way: on the batches seen it is worse than the best trial so far beyond doubt."""

    batches: int
    """Batches scored before stopping."""
    of: int
    """Batches in the split."""
    loss: float
    """Its mean loss on those batches."""
    delta: float
    """Mean paired difference to the best trial on those batches (positive: worse)."""
    delta_se: float

    def record(self) -> dict[str, Any]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


RACE_LEVEL = 1e-3
"""A racing trial stops when it is worse than the best so far at one-sided p below this (paired t over the batches
seen; looked at after a quarter, a half and three quarters of the split, from 4 batches on)."""


class Scorer:
    """Scores candidates on the two splits; each distinct candidate is evaluated once per split.

    ``race`` scores a trial against the best so far and stops it as soon as it is clearly worse (``Stopped``): the
    search's bad trials cost a quarter or half of an evaluation. A stopped candidate stays stopped if suggested again.
    """

    def __init__(self, losses: Losses, *, bytes_per_token: float | None = None) -> None:
        self._losses = losses
        self._bytes_per_token = bytes_per_token
        self._cache: dict[tuple[Any, ...], EvalResult | Stopped] = {}
        self.evaluations = {split: 0 for split in SPLITS}
        """Candidates scored per split (stopped ones included); primed scores are not counted."""
        self.batches = {split: 0 for split in SPLITS}
        """Batches scored per split: the search's cost."""
        self.stopped = 0

    def prime(self, candidate: Candidate, split: str, result: EvalResult) -> None:
        """Record a score already measured on the same batches (the experiment's grid), so it is not recomputed."""
        self._cache.setdefault((split, *candidate.key), result)

    def __call__(self, candidate: Candidate, split: str) -> EvalResult:
        """The candidate's full score (a stopped candidate is now scored on every batch)."""
        found = self._cache.get((split, *candidate.key))
        if isinstance(found, EvalResult):
            return found
        result = self.race(candidate, split, None)
        assert isinstance(result, EvalResult)
        return result

    def race(self, candidate: Candidate, split: str, best: EvalResult | None) -> EvalResult | Stopped:
        """The candidate's score, or ``Stopped`` once it is worse than ``best`` beyond doubt (no ``best``, or too
        few batches to judge: scored in full)."""
        key = (split, *candidate.key)
        if key in self._cache and (best is not None or isinstance(self._cache[key], EvalResult)):
            return self._cache[key]
        total = len(best.batch_losses) if best is not None else 0
        looks = {k for k in (total // 4, total // 2, 3 * total // 4) if k >= 4}  # 4+: a t-test worth its name
        losses: list[float] = []
        self.evaluations[split] += 1
        with closing(self._losses(candidate, split)) as scores:
            for loss in scores:
                losses.append(loss)
                self.batches[split] += 1
                if len(losses) in looks and best is not None:
                    stopped = _clearly_worse(losses, best.batch_losses[: len(losses)], total)
                    if stopped is not None:
                        self.stopped += 1
                        self._cache[key] = stopped
                        return stopped
        result = result_of(losses, self._bytes_per_token)
        self._cache[key] = result
        return result


def _clearly_worse(losses: Sequence[float], best: Sequence[float], total: int) -> Stopped | None:
    """``Stopped`` when ``losses`` are worse than ``best`` on the same batches at one-sided p < ``RACE_LEVEL``."""
    from scipy.stats import t

    k = len(losses)
    diffs = [a - b for a, b in zip(losses, best)]
    mean = math.fsum(diffs) / k
    se = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (k - 1) / k)
    if mean <= 0 or mean - float(t.ppf(1 - RACE_LEVEL, k - 1)) * se <= 0:
        return None
    return Stopped(k, total, math.fsum(losses) / k, mean, se)


class InMemory:
    """The model built from the newest snapshot's config.json; states averaged in memory and swapped in."""

    def __init__(
        self, snapshot_dir: Path, batches: Mapping[str, Sequence[Any]], *, compiled: bool = False
    ) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if not (snapshot_dir / "config.json").is_file():
            raise PmakitError(
                f"{snapshot_dir} has no config.json to build the model from; pass --eval-cmd to evaluate with "
                "your own command"
            )
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(snapshot_dir))
        self.batches = batches
        self.compiled = compiled
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def _state(self, snap: Snapshot) -> dict[str, torch.Tensor]:
        from pmakit.formats import read_state

        if snap.tokens not in self._states:
            self._states[snap.tokens] = read_state(snap.path)
        return self._states[snap.tokens]

    def __call__(self, candidate: Candidate, split: str) -> Generator[float, None, None]:
        from pmakit.merge import average_states
        from pmakit.train.loop import swapped

        state = average_states([self._state(s) for s in candidate.snapshots], list(candidate.weights))
        with swapped(self.model, state):
            yield from batch_losses(self.model, self.batches[split], compiled=self.compiled)

    def learn(self, candidate: Candidate, steps: int) -> tuple[list[float], int]:
        """``learn_weights`` over the candidate's snapshots on the selection split."""
        states = [self._state(s) for s in candidate.snapshots]
        return learn_weights(self.model, states, candidate.weights, self.batches["selection"], steps=steps)


Learn = Callable[[Candidate, int], tuple[list[float], int]]
"""Fits a candidate's weights on the selection split: (weights, forward-backward batches it took)."""
LEARN_LR = 0.1
LEARN_BATCHES = 8
"""Selection batches per step of ``learn_weights`` (taken in turn)."""


def learn_weights(
    model: torch.nn.Module,
    states: Sequence[Mapping[str, torch.Tensor]],
    start: Sequence[float],
    batches: Sequence[Any],
    *,
    steps: int,
) -> tuple[list[float], int]:
    """Merge weights fitted by gradient descent (the "learned soup" of Wortsman et al. 2022, arXiv 2203.05482):
    w = softmax(z) over the snapshots, z from ``start``; Adam on the mean loss of ``LEARN_BATCHES`` batches of the
    given split a step, taken in turn. Weights stay on the simplex; the model's own weights are untouched.
    Returns the weights and the forward-backward batches spent."""
    names = [k for k, v in states[0].items() if v.is_floating_point()]
    z = torch.tensor([math.log(max(w, 1e-4)) for w in start], requires_grad=True)
    optimizer = torch.optim.Adam([z], lr=LEARN_LR)
    was_training, spent = model.training, 0
    model.eval()
    try:
        for step in range(steps):
            optimizer.zero_grad(set_to_none=True)
            w = torch.softmax(z, 0)
            # a sum over the snapshots' own tensors (fp32 ones are not copied), not a stacked copy of the window
            merged = {k: _weighted(w, [s[k] for s in states]) for k in names}
            chunk = [batches[(step * LEARN_BATCHES + i) % len(batches)] for i in range(LEARN_BATCHES)]
            for x, y in chunk:
                loss = batch_loss(_with_params(model, merged), x, y)
                (loss / len(chunk)).backward(retain_graph=True)
            spent += len(chunk)
            optimizer.step()
    finally:
        model.train(was_training)
    return torch.softmax(z.detach(), 0).tolist(), spent


class Command:
    """A user command scores each candidate merge, written to a scratch directory by the streaming engine."""

    def __init__(self, template: str, scratch: Path) -> None:
        self.template = template
        self.scratch = scratch

    def __call__(self, candidate: Candidate, split: str) -> Generator[float, None, None]:
        from pmakit.merge import merge

        model = self.scratch / "candidate"
        merge(list(candidate.snapshots), list(candidate.weights), model, force=True, fsync=False)
        command = self.template.replace("{model}", shlex.quote(str(model))).replace("{split}", split)
        proc = subprocess.run(command, shell=True, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            raise PmakitError(f"--eval-cmd failed with exit code {proc.returncode}: {tail}")
        numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|inf", proc.stdout)
        if not numbers:
            raise PmakitError(f"--eval-cmd printed no loss (its stdout: {proc.stdout.strip()[:200]!r})")
        loss = float(numbers[-1])
        if not math.isfinite(loss):
            raise PmakitError(f"--eval-cmd printed a non-finite loss ({loss}) for {model}")
        yield loss


# --------------------------------------------------------------------------------------------------- search


def tune(run: str | Path, out: str | Path, *, data: str | None = None, config: TuneConfig) -> dict[str, Any]:
    """Search, confirm on the test split, write the merge into ``out`` and ``out/tune.json``; returns the record."""
    from pmakit.guard import guard_output

    run, out = Path(run), Path(out)
    t0 = time.perf_counter()
    snapshots = _run_snapshots(run)
    guard_output(out, [s.path for s in snapshots], config.force)
    space = Space.of(snapshots, config)
    evaluator, source, scratch = _evaluator(run, out, snapshots, data, config)
    try:
        scorer = Scorer(evaluator)
        hint = spectrum_hint(snapshots, config) if config.eval_cmd is None else None
        trials = search(space, scorer, config, [hint["params"]] if hint else [])
        learned = add_learned_trial(space, scorer, trials, getattr(evaluator, "learn", None), config)
        record = _confirm(space, scorer, trials, config)
        record["learned"] = learned and learned["learn"]
        record["spectrum_hint"] = hint
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    record.update(run=str(run), data=source, seconds=round(time.perf_counter() - t0, 2))
    _write(out, record, config.force)
    return record


def spectrum_hint(snapshots: Sequence[Snapshot], config: TuneConfig) -> dict[str, Any] | None:
    """The SMA window the trajectory's power spectrum suggests (``pmakit.lab.spectrum``), as a first guess."""
    from pmakit.lab.spectrum import power_spectrum, trajectory, window_from_spectrum

    if len(snapshots) < 8 or "sma" not in config.families or 1 not in config.v_multiples:
        return None
    freqs, power = power_spectrum(trajectory(snapshots, seed=config.seed))
    found = window_from_spectrum(freqs, power, min(config.max_n, len(snapshots)))
    return {**found, "params": {"end_back": 0, "v_mult": 1, "n": found["n"], "family": "sma"}}


def _run_snapshots(run: Path) -> list[Snapshot]:
    from pmakit.snapshot import gather

    experiment_run = snapshots_dir(run / MAIN_RUN)
    snapshots, _ = gather([experiment_run if experiment_run.is_dir() else run])
    if len(snapshots) < 2:
        raise PmakitError(f"{run}: tuning a merge needs at least 2 snapshots, found {len(snapshots)}")
    return snapshots


def _evaluator(
    run: Path, out: Path, snapshots: Sequence[Snapshot], data: str | None, config: TuneConfig
) -> tuple[Losses, dict[str, Any], Path | None]:
    from pmakit.train.data import split_batches

    newest = snapshots[-1]
    if config.eval_cmd is not None:
        scratch = out.parent / f".{out.name}.tune-scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        return Command(config.eval_cmd, scratch), {"eval_cmd": config.eval_cmd}, scratch
    if config.metric is not None:
        return _downstream(run, newest, data, config)
    found = load_eval_data(data, run, newest, config)
    batches = split_batches(
        found.held, batch_size=found.batch_size, seq_len=found.seq_len, max_batches=config.batches
    )
    source = {
        "source": found.source,
        **found.held.describe(),
        "batches": {k: len(v) for k, v in batches.items()},
        "batch_size": found.batch_size,
        "seq_len": found.seq_len,
    }
    _check_memory(snapshots)
    return InMemory(newest.path, batches, compiled=config.compile), source, None


class DownstreamLosses:
    """Per-item losses of a downstream metric (``pmakit.eval.objective``) on the run's held-out tasks, and the
    learned-weights family for it: an accuracy has no gradient, so ``learn`` fits the weights on the held-out
    next-token loss of the selection split (``learn_weights``, the selection side of the same held-out documents);
    the learned trial is then scored by the metric on the selection items and kept only if it is better there."""

    def __init__(self, objective: Any, learner: InMemory) -> None:
        self.objective = objective
        self.learner = learner

    def __call__(self, candidate: Candidate, split: str) -> Generator[float, None, None]:
        from pmakit.merge import average_states

        states = [self.learner._state(s) for s in candidate.snapshots]  # one cache for scoring and learning
        yield from self.objective.losses(average_states(states, list(candidate.weights)), split)

    def learn(self, candidate: Candidate, steps: int) -> tuple[list[float], int]:
        return self.learner.learn(candidate, steps)


def _downstream(
    run: Path, newest: Snapshot, data: str | None, config: TuneConfig
) -> tuple[Losses, dict[str, Any], None]:
    """The downstream metric's losses, with held-out batches of the selection split to learn weights on."""
    from pmakit.eval.objective import Downstream, describe
    from pmakit.eval.run import corpus_entry
    from pmakit.train.data import split_batches

    assert config.metric is not None
    objective = Downstream(config.metric, newest.path, corpus_entry([run]))
    batches: dict[str, Any] = {}
    source = {"source": "the run's held-out tasks (lm-eval)", **describe(objective)}
    if config.learn_steps:
        found = load_eval_data(data, run, newest, config)
        held = split_batches(
            found.held, batch_size=found.batch_size, seq_len=found.seq_len, max_batches=config.batches
        )
        batches = {"selection": held["selection"]}
        source["learned_weights"] = "fitted on the held-out loss of the selection split, kept by the metric"
    learner = InMemory(newest.path, batches)
    return DownstreamLosses(objective, learner), source, None


def _check_memory(snapshots: Sequence[Snapshot]) -> None:
    """In-memory search keeps every snapshot's weights: refuse when that would not fit (use --eval-cmd)."""
    import psutil

    weight_files = (".safetensors", ".pt", ".bin", ".pth", ".distcp")
    need = sum(
        f.stat().st_size
        for s in snapshots
        for f in s.path.rglob("*")
        if f.suffix in weight_files and f.is_file()
    )
    available = psutil.virtual_memory().available
    if need > available // 2:
        raise PmakitError(
            f"evaluating in memory would hold {len(snapshots)} snapshots ({need / 1e9:.1f} GB) with "
            f"{available / 1e9:.1f} GB available; pass --eval-cmd 'CMD {{model}} {{split}}' to evaluate merges "
            "written to disk instead"
        )


def search(
    space: Space, scorer: Scorer, config: TuneConfig, hints: Sequence[Mapping[str, Any]] = ()
) -> list[dict[str, Any]]:
    """Run the TPE study on the selection split; every trial's record, in order (a trial stopped early by racing
    has ``selection_loss`` None and a ``stopped`` record: batches seen, its paired difference to the best).

    The first trials are fixed: both baselines (so what the search returns is never worse than them on selection),
    the ``hints`` (the window the trajectory's spectrum suggests, the experiment's best grid cells) and then the
    coarse SMA ``lattice``, up to half the trial budget; TPE samples from there on."""
    import optuna

    # ERROR, not WARNING: optuna logs a trial that raised (a failing --eval-cmd: our one-line PmakitError) as a
    # warning with its traceback, before the error itself reaches the command line.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    startup = max(2, min(10, (config.budget_evals or 40) // 3))
    sampler = optuna.samplers.TPESampler(seed=config.seed, n_startup_trials=startup)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    first: list[dict[str, Any]] = []
    if 1 in config.v_multiples and "sma" in config.families:
        for base in space.baselines().values():
            n = min(base.params["n"], config.max_n)
            first.append({"end_back": 0, "v_mult": 1, "n": n, "family": "sma"})
    baselines = len(first)  # scored in full: what the search returns is never worse than them on selection
    first += [dict(h) for h in hints]
    room = max(len(first), (config.budget_evals or 10**9) // 2)
    first += space.lattice()
    for params in [p for i, p in enumerate(first) if p not in first[:i]][:room]:
        study.enqueue_trial(params)
    records: list[dict[str, Any]] = []
    best: list[EvalResult] = []  # the best complete trial so far, which the others race against

    def objective(trial: Any) -> float:
        t = time.perf_counter()
        candidate = space.suggest(trial)
        racing = config.race and trial.number >= baselines and best
        result = scorer.race(candidate, "selection", best[0] if racing else None)
        record = {"number": trial.number, "params": dict(trial.params), "merge": candidate.record()}
        if isinstance(result, Stopped):
            records.append(
                {**record, "selection_loss": None, "stopped": result.record(), "seconds": _since(t)}
            )
            trial.report(result.loss, result.batches)
            raise optuna.TrialPruned()
        if not best or result.loss < best[0].loss:
            best[:] = [result]
        records.append(
            {
                **record,
                "selection_loss": result.loss,
                "selection_loss_se": _finite(result.loss_se),
                "seconds": _since(t),
            }
        )
        return result.loss

    with _progress(config) as advance:
        study.optimize(
            objective,
            n_trials=config.budget_evals,
            timeout=config.budget_seconds,
            callbacks=[lambda *_: advance()],
            catch=(),
        )
    return records


def _weighted(w: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_i w_i t_i in fp32, differentiable in ``w``."""
    out = w[0] * tensors[0].float()
    for i in range(1, len(tensors)):
        out = out + w[i] * tensors[i].float()
    return out


def _with_params(model: torch.nn.Module, params: Mapping[str, torch.Tensor]) -> Callable[..., Any]:
    """``model``'s forward with ``params`` in place of its own (``torch.func.functional_call``: differentiable in
    them, the module untouched)."""
    from torch.func import functional_call

    return lambda **inputs: functional_call(model, dict(params), (), inputs)


def add_learned_trial(
    space: Space, scorer: Scorer, trials: list[dict[str, Any]], learn: Learn | None, config: TuneConfig
) -> dict[str, Any] | None:
    """Weights learned over the window of the best trial that merges (``learn_weights``, on the selection split),
    scored in full on selection and appended as one more trial: the choice (lowest selection loss) takes it only if
    it is better there. Returns its record with what the fit cost (None: no learning asked, or no merge scored)."""
    merges = [r for r in scored(trials) if len(r["merge"]["tokens"]) > 1]
    if learn is None or not config.learn_steps or not merges:
        return None
    best = min(merges, key=lambda r: r["selection_loss"])
    base = chosen_candidate(space, [best])
    t = time.perf_counter()
    weights, spent = learn(base, config.learn_steps)
    learned = Candidate(base.snapshots, tuple(weights), {**base.params, "family": "learned", "alpha": None})
    result = scorer(learned, "selection")
    record = {
        "number": len(trials),
        "params": {"learned_from": best["number"], "steps": config.learn_steps},
        "merge": learned.record(),
        "selection_loss": result.loss,
        "selection_loss_se": _finite(result.loss_se),
        "seconds": _since(t),
        "learn": {"steps": config.learn_steps, "batches": spent, "from_trial": best["number"]},
    }
    trials.append(record)
    return record


def _since(t: float) -> float:
    return round(time.perf_counter() - t, 3)


def scored(trials: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The trials scored on every batch of the selection split (not stopped early)."""
    return [r for r in trials if r["selection_loss"] is not None]


def chosen_candidate(space: Space, trials: Sequence[Mapping[str, Any]]) -> Candidate:
    """The trial with the lowest selection loss, as a candidate (the first of equals: the baselines come first)."""
    merge = min(scored(trials), key=lambda r: r["selection_loss"])["merge"]
    by_tokens = {s.tokens: s for s in space.snapshots}
    return Candidate(
        tuple(by_tokens[t] for t in merge["tokens"]),
        tuple(merge["weights"]),
        {k: v for k, v in merge.items() if k not in ("tokens", "weights")},
    )


def _confirm(
    space: Space, scorer: Scorer, trials: list[dict[str, Any]], config: TuneConfig
) -> dict[str, Any]:
    """The best trial on selection, scored with both baselines on the test split (paired s.e.)."""
    best = min(scored(trials), key=lambda r: r["selection_loss"])
    chosen = chosen_candidate(space, trials)
    models = {"tuned": chosen, **space.baselines()}
    results = {name: {s: scorer(c, s) for s in SPLITS} for name, c in models.items()}
    comparisons = {}
    for a, b in (("tuned", "last"), ("tuned", "fixed"), ("fixed", "last")):
        delta, se = paired_difference(results[a]["test"], results[b]["test"])
        comparisons[f"{a} - {b}"] = {"delta": delta, "delta_se": _finite(se), "split": "test"}
    return {
        "config": {k: v for k, v in asdict(config).items() if k != "force"},
        "interval_tokens": space.interval,
        "snapshots": [s.tokens for s in space.snapshots],
        "trials": trials,
        "best_trial": best["number"],
        "models": {
            name: {
                "merge": models[name].record(),
                **{f"{s}_loss": results[name][s].loss for s in SPLITS},
                **{f"{s}_loss_se": _finite(results[name][s].loss_se) for s in SPLITS},
            }
            for name in models
        },
        "comparisons": comparisons,
        "evaluations": dict(scorer.evaluations),
        "batches_scored": dict(scorer.batches),
        "stopped_early": scorer.stopped,
        "note": "chosen on the selection split; every test_* number is on the disjoint test split",
        "_chosen": chosen,
    }


def _finite(x: float) -> float | None:
    return None if x is None or not math.isfinite(x) else x


def _write(out: Path, record: dict[str, Any], force: bool) -> None:
    """The tuned merge by the streaming engine into ``out``, then ``out/tune.json`` (atomically)."""
    from pmakit.merge import merge

    chosen: Candidate = record.pop("_chosen")
    summary = {k: record[k] for k in ("best_trial", "comparisons", "evaluations")}
    merge(
        list(chosen.snapshots),
        list(chosen.weights),
        out,
        force=force,
        manifest_extra={"method": "tune", "tune": {**summary, "merge": chosen.record()}},
    )
    record["merged"] = str(out)
    atomic_write_json(out / "tune.json", record)


@contextmanager
def _progress(config: TuneConfig) -> Iterator[Callable[[], None]]:
    """A rich bar with ETA over the trials (or the seconds of a time budget), on a terminal only."""
    import sys

    if not (sys.stderr.isatty() and log.isEnabledFor(logging.INFO)):
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    by_time = config.budget_evals is None
    total = config.budget_seconds if by_time else config.budget_evals
    start = time.perf_counter()
    with Progress(
        TextColumn("tuning (selection split)"),
        BarColumn(),
        *([] if by_time else [MofNCompleteColumn()]),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task("tune", total=total)

        def advance() -> None:
            if by_time:
                bar.update(task, completed=min(time.perf_counter() - start, total or 0))
            else:
                bar.advance(task)

        yield advance


def render(record: Mapping[str, Any]) -> str:
    """The summary ``pmakit tune`` prints: the choice, then the test split against both baselines."""
    from pmakit.units import format_tokens

    models, lines = record["models"], []
    m = models["tuned"]["merge"]
    alpha = f"({m['alpha']:.3g})" if m.get("alpha") else ""
    lines.append(
        f"tuned: {m['family']}{alpha} N={m['n']} V={format_tokens(m['v_tokens'])} ending at "
        f"{format_tokens(m['end_tokens'])} (trial {record['best_trial']} of {len(record['trials'])}, "
        "chosen on the selection split)"
    )
    data = record.get("data") or {}
    batches = data.get("batches") if isinstance(data.get("batches"), Mapping) else None
    if batches:  # a loss on 16 batches is not the experiment's on 23: say which
        lines.append(
            f"  held-out loss: mean over {batches.get('selection')} selection and {batches.get('test')} test "
            f"batches of {data.get('source')} ({data.get('batch_size')} x {data.get('seq_len')} tokens each)"
        )
    if data.get("metric"):
        lines.append(
            f"  chosen by {data['metric']} per item (loss: {data['loss']}), selection items; test items below"
        )
    for name, label in (
        ("tuned", "tuned"),
        ("fixed", "fixed recipe (SMA N=10)"),
        ("last", "newest snapshot"),
    ):
        lines.append(
            f"  {label:<26} selection {models[name]['selection_loss']:.4f}   test {models[name]['test_loss']:.4f}"
        )
    for key, c in record["comparisons"].items():
        se = f" ± {c['delta_se']:.4f} (paired s.e.)" if c["delta_se"] is not None else " (no s.e.)"
        lines.append(f"  test: {key} = {c['delta']:+.4f}{se}")
    if record.get("learned"):
        learned = record["learned"]
        kept = "kept: better on selection" if m["family"] == "learned" else "not kept: no better on selection"
        lines.append(
            f"  learned weights over trial {learned['from_trial']}'s window ({learned['steps']} steps, "
            f"{learned['batches']} batches): {kept}"
        )
    if record.get("stopped_early"):
        lines.append(
            f"  {record['stopped_early']} of {len(record['trials'])} trials stopped early, clearly worse than the "
            f"best so far ({record['batches_scored']['selection']} selection batches scored in all)"
        )
    lines.append(f"wrote {record['merged']} and tune.json ({record['seconds']:.0f} s)")
    return "\n".join(lines)
