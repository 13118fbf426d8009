"""``pmakit experiment --preset moe``: the PMA study on a mixture of experts, then what merging does to its routing.

1. The PMA study (``pmakit.lab.pma``) unchanged, on the MoE model (``model.experts`` > 0: transformers' OLMoE with
   the biased router of ``pmakit.train.model``): merges vs anneal vs latest, choices on the selection split, the
   headline on the test split with paired standard errors.
2. At the last fork's end, four models: the latest snapshot, the anneal, and the best SMA window of the grid
   (chosen on the selection split) merged twice, its routers' load-balancing bias averaged like the weights
   (``bias: average``) or taken from the window's newest snapshot (``bias: latest``): the engine's rule
   (``average_states(buffers=...)``, ``pmakit merge --buffers``), the bias found by ``pmakit.layouts.kinds``.
   Each is scored on both splits with its routing health on the same tokens: per layer, the share of the top-k slots each expert received (sums
   to 1), max/mean load, dead experts (share below ``DEAD_SHARE`` / E), dropped tokens (none: OLMoE has no
   capacity factor, every token reaches its k experts) and the router entropy (mean over tokens of the entropy of
   the unbiased softmax; at most log E).
3. The bias rule is chosen on the selection split; both rules' test-split losses are reported with the paired s.e.
   of their difference.
4. The compute of a merge against the anneal: 6 x active parameters x D tokens of training vs one evaluation of
   the merge (2 x active parameters x the held-out tokens) and reading N snapshots.

Writes RUN/moe.json (every row names its split and batch count) and adds a section to the report.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, batch_losses, paired_difference, result_of
from pmakit.formats import read_state
from pmakit.merge import average_states
from pmakit.runs import (
    MAIN_RUN,
    RESULTS,
    anneal_run,
    atomic_write_json,
    checkpoint_dir,
    read_jsonl,
    snapshots_dir,
)
from pmakit.snapshot import discover
from pmakit.train.model import active_parameters, build_model, count_parameters, routers
from pmakit.weights import get_weights

log = logging.getLogger(__name__)

MOE_JSON = "moe.json"
DEAD_SHARE = 0.1
"""An expert is dead on a held-out set when it gets less than this fraction of the uniform share 1/E of the slots."""
RULES = ("average", "latest")
"""The merge's rules for router biases (``pmakit.layouts.kinds``, ``pmakit merge --buffers``)."""


def resolve(data: Mapping[str, Any]) -> Any:
    """The config ``data`` checked whole: the PMA study's, on a mixture-of-experts model."""
    from pmakit.lab import pma

    study = pma.resolve(data)
    if not study.train.model.moe:
        raise PmakitError("the moe study needs a mixture-of-experts model: set train.model.experts")
    return study


def run_study(
    data: Mapping[str, Any], run_dir: str | Path, *, fresh: bool = False, progress: bool = True
) -> Path:
    """The PMA study on the MoE model, then the MoE tables and the report; returns the report's path."""
    from pmakit.lab import pma
    from pmakit.report import write_report
    from pmakit.train.loop import load_corpus

    study = resolve(data)
    run_dir = Path(run_dir)
    pma.run_study(data, run_dir, fresh=fresh, progress=progress)
    if not (run_dir / MOE_JSON).is_file():
        atomic_write_json(run_dir / MOE_JSON, moe_tables(study, run_dir, load_corpus(study.train)))
    paths = write_report(run_dir)
    return Path(getattr(paths, "html", run_dir / "report.html"))


def routing_health(
    model: torch.nn.Module, batches: Sequence[Any]
) -> tuple[list[float], list[dict[str, Any]]]:
    """``model``'s loss per batch and, per MoE layer, its routing on the same tokens (see the module docstring)."""
    rs = routers(model)
    seen: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rs]
    for r, s in zip(rs, seen):
        r.observe = s
    try:
        losses = list(batch_losses(model, batches))
    finally:
        for r in rs:
            r.observe = None
    layers = []
    for i, (r, s) in enumerate(zip(rs, seen)):
        probs = torch.cat([p for p, _ in s])
        chosen = torch.cat([c for _, c in s])
        e = r.num_experts
        load = torch.bincount(chosen.reshape(-1), minlength=e).double()
        load = load / load.sum()
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()
        layers.append(
            {
                "layer": i,
                "tokens": int(probs.shape[0]),
                "load": [round(float(x), 6) for x in load],
                "max_load": float(load.max()),
                "mean_load": 1.0 / e,
                "max_over_mean": float(load.max() * e),
                "dead_experts": int((load < DEAD_SHARE / e).sum()),
                "dropped_tokens": 0,
                "entropy": float(entropy),
                "entropy_max": math.log(e),
            }
        )
    return losses, layers


def moe_tables(study: Any, run_dir: Path, corpus: Any) -> dict[str, Any]:
    """Losses and routing health of latest / anneal / merge (both bias rules) at the last fork's end."""
    from pmakit.train.data import corpus_heldout, split_batches
    from pmakit.train.loop import swapped

    cfg, last = study.train, study.forks[-1]
    batches = split_batches(
        corpus_heldout(corpus),
        batch_size=cfg.batch_size,
        seq_len=cfg.model.seq_len,
        max_batches=study.exp.eval_batches,
    )
    snaps = {s.tokens: s for s in discover(snapshots_dir(run_dir / MAIN_RUN))}
    best = _best_sma(run_dir, last.fork_tokens)
    window = [snaps[best["tokens"] - k * best["v_tokens"]] for k in range(best["n"])][::-1]
    states = [read_state(s.path) for s in window]
    weights = get_weights("sma", len(states))
    models = {
        "latest": read_state(snaps[last.eval_tokens].path),
        "annealed": read_state(checkpoint_dir(anneal_run(run_dir, last.fork_tokens))),
        **{f"merged, bias {rule}": average_states(states, weights, buffers=rule) for rule in RULES},
    }
    model = build_model(cfg.model, corpus.vocab_size, seed=cfg.seed)
    results: dict[tuple[str, str], EvalResult] = {}
    routing: list[dict[str, Any]] = []
    for name, state in models.items():
        for split, split_batches_ in batches.items():
            log.info("moe: %s on the %s split (%d batches)", name, split, len(split_batches_))
            with swapped(model, state):
                per_batch, layers = routing_health(model, split_batches_)
            results[name, split] = result_of(per_batch, corpus.bytes_per_token)
            base = {"model": name, "split": split, "batches": len(split_batches_), "tokens": last.eval_tokens}
            routing += [{**base, **layer} for layer in layers]
    losses = _loss_rows(results, {split: len(b) for split, b in batches.items()})
    a, b = (f"merged, bias {rule}" for rule in RULES)
    chosen = min(RULES, key=lambda rule: results[f"merged, bias {rule}", "selection"].loss)
    diff, diff_se = paired_difference(results[b, "test"], results[a, "test"])
    active, total = active_parameters(model), count_parameters(model)
    eval_tokens = sum(x.numel() for x, _ in batches["selection"])
    return {
        "fork_tokens": last.fork_tokens,
        "tokens": last.eval_tokens,
        "merge": {
            "label": best["label"],
            "n": best["n"],
            "v_tokens": best["v_tokens"],
            "chosen_on": "selection",
        },
        "batches": {k: len(v) for k, v in batches.items()},
        "tokens_per_batch": cfg.tokens_per_step,
        "dead_share": DEAD_SHARE,
        "capacity_factor": None,
        "experts": cfg.model.experts,
        "top_k": cfg.model.top_k,
        "router_aux_coef": cfg.router_aux_coef,
        "router_bias_rate": cfg.router_bias_rate,
        "losses": losses,
        "routing": routing,
        "bias_rule": {
            "chosen_on_selection": chosen,
            "latest_minus_average_test": diff,
            "se": diff_se,
            "batches": len(batches["test"]),
            "split": "test",
        },
        "compute": _compute(active, total, last.anneal_tokens, eval_tokens, best["n"]),
    }


def _loss_rows(results: dict[tuple[str, str], EvalResult], batches: dict[str, int]) -> list[dict[str, Any]]:
    """One row per (model, split): its loss and its paired difference to the latest snapshot on that split."""
    rows = []
    for (name, split), r in results.items():
        delta, se = paired_difference(r, results["latest", split]) if name != "latest" else (0.0, 0.0)
        rows.append(
            {
                "model": name,
                "split": split,
                "batches": batches[split],
                "val_loss": r.loss,
                "val_loss_se": r.loss_se,
                "delta_vs_latest": delta,
                "delta_se": se,
                "batch_losses": r.batch_losses,
            }
        )
    return rows


def _compute(active: int, total: int, anneal_tokens: int, eval_tokens: int, n: int) -> dict[str, int]:
    """What the anneal costs (6 x active parameters x its tokens) against scoring the merge once (2 x active
    parameters x the held-out tokens) and reading its N fp32 snapshots."""
    return {
        "active_parameters": active,
        "parameters": total,
        "anneal_tokens": anneal_tokens,
        "anneal_flops": 6 * active * anneal_tokens,
        "merge_eval_tokens": eval_tokens,
        "merge_flops": 2 * active * eval_tokens,
        "merge_snapshots_read": n,
        "merge_bytes_read": n * 4 * total,
    }


def _best_sma(run_dir: Path, fork_tokens: int) -> dict[str, Any]:
    """The best SMA cell of the grid at ``fork_tokens`` on the selection split (the headline merge's choice)."""
    rows = [
        r
        for r in read_jsonl(run_dir / RESULTS)
        if r.get("model") == "merged"
        and r.get("method") == "sma"
        and r.get("fork_tokens") == fork_tokens
        and r.get("split") == "selection"
    ]
    if not rows:
        raise PmakitError(
            f"{run_dir / RESULTS} has no SMA merge on the selection split at {fork_tokens} tokens"
        )
    return min(rows, key=lambda r: r["val_loss"])
