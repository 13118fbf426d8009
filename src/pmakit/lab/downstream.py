"""The PMA study's downstream table: its headline models scored on pmakit's offline lm-eval tasks, test items only.

At the final fork (the headline's; the earlier forks are not scored: the report's table is the final fork's, and
they took half the stage) the models of the headline (the latest snapshot, the best grid merge and the tuner's pick,
both chosen on the selection split, the fixed recipe, the anneal) and the noise band's raw snapshots (the K - 1
saves before the latest) are swapped into the study's model one after the other and run through
lm-evaluation-harness on the TEST items of ``pmakit_next_line`` (cloze multiple choice) and ``pmakit_bpb`` (rolling
bits per byte), built from the corpus's held-out test files (``pmakit.eval.tasks``). Nothing is chosen here: the
table reports, per task and metric, each model's score with its s.e. over items, its paired difference to the latest
snapshot and to the anneal (paired s.e. and a 95% bootstrap interval over the same items), and the raw snapshots'
spread. Rows go to
``downstream.jsonl`` as each (model, task) finishes, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from pmakit.formats import read_state
from pmakit.lab.context import StudyProgress
from pmakit.runs import append_jsonl, read_jsonl
from pmakit.units import format_tokens
from pmakit.weights import get_weights

log = logging.getLogger(__name__)

DOWNSTREAM = "downstream.jsonl"
TASKS = ("pmakit_next_line", "pmakit_bpb")
NOISE_K = 4
"""Raw snapshots in the noise band: the latest and the K - 1 saves before it."""
ROLES = ("", "best", "fixed", "tuned")
"""The test-split headline rows scored downstream ("" is the latest snapshot and the anneal)."""
BATCH_SIZE = 32
"""lm-eval's batch for the study's small models: 4x fewer forward calls than ``pmakit eval``'s default 8 (which
suits a user's large model on a GPU), the same scores to the last bit (the demo's and the smoke study's
downstream.jsonl byte-identical at 8 and 32); the 6M-token demo's 16 models 195 s instead of 215 s on 2 cores."""


def models_at(grid: Any, fork: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """``(row, state)`` for each model of ``fork``'s downstream table; states are built one at a time."""
    for key, source in model_keys(grid, fork):
        yield key, _state(grid, key, source)


def model_keys(grid: Any, fork: Any) -> list[tuple[dict[str, Any], Mapping[str, Any]]]:
    """``(row, source)`` for each model of ``fork``'s downstream table, no state built: ``source`` is the results
    row it comes from (a raw snapshot's: its tokens)."""
    rows = [
        r
        for r in grid.rows
        if r["split"] == "test" and r["fork_tokens"] == fork.fork_tokens and r.get("role", "") in ROLES
    ]
    out: list[tuple[dict[str, Any], Mapping[str, Any]]] = []
    for r in rows:
        key = {
            "fork_tokens": fork.fork_tokens,
            "model": r["model"],
            "role": r.get("role", ""),
            "label": r["label"],
        }
        out.append(({**key, "raw_back": 0} if r["model"] == "latest" else key, r))
    v0 = grid.study.train.every_tokens
    for k in range(1, NOISE_K):
        tokens = fork.eval_tokens - k * v0
        if tokens in grid.snapshots:
            label = f"raw snapshot ({format_tokens(tokens)}, {k} save{'s' * (k > 1)} before the latest)"
            key = {
                "fork_tokens": fork.fork_tokens,
                "model": "raw",
                "role": "noise",
                "label": label,
                "raw_back": k,
            }
            out.append((key, {"tokens": tokens}))
    return out


def _state(grid: Any, key: Mapping[str, Any], source: Mapping[str, Any]) -> Any:
    from pmakit.runs import anneal_run, checkpoint_dir

    if key["model"] in ("latest", "raw"):
        return grid.state(grid.snapshot_at(source["tokens"]))
    if key["model"] == "annealed":
        return read_state(checkpoint_dir(anneal_run(grid.run_dir, key["fork_tokens"])))
    if source["method"] == "tuned":
        return grid.average(
            [grid.snapshot_at(t) for t in source["tune"]["tokens"]], source["tune"]["weights"]
        )
    chosen = grid.window(source["tokens"], source["n"], source["v_tokens"])
    return grid.average(chosen, get_weights(source["method"], len(chosen), alpha=source.get("alpha") or 0.2))


def run_downstream(
    grid: Any, run_dir: Path, corpus_cache: Path, meter: StudyProgress | None = None, units: float = 0.0
) -> None:
    """Score the final fork's models on ``TASKS`` (test items) into ``run_dir/downstream.jsonl``, skipping those done.
    ``meter``: the study's progress, ``units`` of work a model (the note ending each model's line)."""
    from pmakit.eval import harness
    from pmakit.eval.model import load_tokenizer
    from pmakit.eval.tasks import build_tasks
    from pmakit.train.loop import swapped

    harness.require_lm_eval()
    path = run_dir / DOWNSTREAM
    done = {(r["fork_tokens"], r["label"], r["task"]) for r in read_jsonl(path)}
    tasks = build_tasks(corpus_cache)
    manager = harness.task_manager([tasks.include("test")], TASKS)
    tokenizer = load_tokenizer(grid.trainer.corpus.tokenizer_dir)
    model = grid.trainer.model
    meter = meter or StudyProgress({})
    forks = grid.study.forks[-1:]
    left = [
        key
        for fork in forks
        for key, _ in model_keys(grid, fork)
        if any((fork.fork_tokens, key["label"], t) not in done for t in TASKS)
    ]
    meter.resize("downstream", len(left) * units)
    scored = 0
    for fork in forks:
        for key, state in models_at(grid, fork):
            todo = [t for t in TASKS if (fork.fork_tokens, key["label"], t) not in done]
            if not todo:
                continue
            log.info(
                "downstream (test items): %s at %s; %s",
                key["label"],
                format_tokens(fork.fork_tokens),
                meter.at("downstream", scored * units),
            )
            scored += 1
            with swapped(model, state), torch.no_grad():
                scores = harness.run_tasks(
                    harness.hflm(model, tokenizer, batch_size=BATCH_SIZE), todo, manager
                )
            for task in todo:
                rows = [
                    {
                        **key,
                        "task": task,
                        "metric": metric,
                        "value": s.value,
                        "items": s.items,
                        "doc_ids": s.doc_ids,
                    }
                    for metric, s in sorted(scores.get(task, {}).items())
                ]
                for row in rows:
                    append_jsonl(path, row)
    meter.end("downstream")
    meta = tasks.meta["splits"]["test"]
    log.info("downstream tasks (test items): %s", {t: meta.get(t) for t in TASKS})
