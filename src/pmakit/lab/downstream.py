"""The PMA study's downstream table: its headline models scored on pmakit's offline lm-eval tasks, test items only.

At each fork the models of the headline (the latest snapshot, the best grid merge and the tuner's pick, both chosen
on the selection split, the fixed recipe, the anneal) and the noise band's raw snapshots (the K - 1 saves before the
latest) are swapped into the study's model one after the other and run through lm-evaluation-harness on the TEST
items of ``pmakit_next_line`` (cloze multiple choice) and ``pmakit_bpb`` (rolling bits per byte), built from the
corpus's held-out test files (``pmakit.eval.tasks``). Nothing is chosen here: the table reports, per task and
metric, each model's score with its s.e. over items, its paired difference to the latest snapshot and to the anneal
(paired s.e. and a 95% bootstrap interval over the same items), and the raw snapshots' spread. Rows go to
``downstream.jsonl`` as each (model, task) finishes, so an interrupted study resumes where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pmakit.formats import read_state
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


def models_at(grid: Any, fork: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    """``(row, state)`` for each model of ``fork``'s downstream table; states are built one at a time."""
    from pmakit.runs import anneal_run, checkpoint_dir

    rows = [
        r
        for r in grid.rows
        if r["split"] == "test" and r["fork_tokens"] == fork.fork_tokens and r.get("role", "") in ROLES
    ]
    v0 = grid.study.train.every_tokens
    for r in rows:
        key = {
            "fork_tokens": fork.fork_tokens,
            "model": r["model"],
            "role": r.get("role", ""),
            "label": r["label"],
        }
        if r["model"] == "latest":
            yield {**key, "raw_back": 0}, grid.state(grid.snapshot_at(r["tokens"]))
        elif r["model"] == "annealed":
            yield key, read_state(checkpoint_dir(anneal_run(grid.run_dir, fork.fork_tokens)))
        elif r["method"] == "tuned":
            record = r["tune"]
            chosen = [grid.snapshot_at(t) for t in record["tokens"]]
            yield key, grid.average(chosen, record["weights"])
        else:
            chosen = grid.window(r["tokens"], r["n"], r["v_tokens"])
            weights = get_weights(r["method"], len(chosen), alpha=r.get("alpha") or 0.2)
            yield key, grid.average(chosen, weights)
    for k in range(1, NOISE_K):
        tokens = fork.eval_tokens - k * v0
        if tokens in grid.snapshots:
            label = f"raw snapshot ({format_tokens(tokens)}, {k} save{'s' * (k > 1)} before the latest)"
            yield (
                {
                    "fork_tokens": fork.fork_tokens,
                    "model": "raw",
                    "role": "noise",
                    "label": label,
                    "raw_back": k,
                },
                (grid.state(grid.snapshots[tokens])),
            )


def run_downstream(grid: Any, run_dir: Path, corpus_cache: Path) -> None:
    """Score every fork's models on ``TASKS`` (test items) into ``run_dir/downstream.jsonl``, skipping those done."""
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
    for fork in grid.study.forks:
        for key, state in models_at(grid, fork):
            todo = [t for t in TASKS if (fork.fork_tokens, key["label"], t) not in done]
            if not todo:
                continue
            log.info("downstream (test items): %s at %s", key["label"], format_tokens(fork.fork_tokens))
            with swapped(model, state), torch.no_grad():
                scores = harness.run_tasks(harness.hflm(model, tokenizer), todo, manager)
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
    meta = tasks.meta["splits"]["test"]
    log.info("downstream tasks (test items): %s", {t: meta.get(t) for t in TASKS})
