"""Offline downstream tasks from a corpus's HELD-OUT files, in lm-eval's own YAML format.

Built deterministically from the validation files of the run's corpus (``pmakit.train.data``: whole files held
out from training and from the tokenizer), divided into the same selection and test documents as ``pmakit tune``
(``document_sides``), so a choice made on selection items is reported on test items of other files:

- ``pmakit_next_line`` (multiple choice, ``acc`` and ``acc_norm``): a function's lines so far, then the true next
  line among 4 candidates; the 3 others are lines with the same indentation from OTHER held-out files of the split
  (from the same file, over 40 lines away, only where the split has too few files).
  Chance is 1/4 for a random guess; a model that knows nothing (uniform next-token distribution) prefers the
  candidate of fewest tokens, and its exact score, ``uniform_acc`` / ``uniform_acc_norm``, is recorded in
  ``tasks.json``: the floor a model must beat.
- ``pmakit_bpb`` (rolling log-likelihood): pieces of held-out files (whole lines, up to ``PIECE_CHARS``),
  ``bits_per_byte`` and ``byte_perplexity``, as lm-eval scores wikitext.
- ``pmakit_loss``: the same pieces, mean next-token loss in nats per token of the run's tokenizer (pmakit's
  held-out loss), through the task's own ``process_results``.

A build lives in ``CACHE/eval-tasks-<key>/{selection,test}/`` (YAMLs, JSONL data, ``tasks.json``), keyed by the
corpus entry and the options, written in a hidden folder and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pmakit.errors import PmakitError
from pmakit.runs import atomic_write_text

VERSION = 2
TASKS = ("pmakit_next_line", "pmakit_bpb", "pmakit_loss")
SPLITS = ("selection", "test")
PIECE_CHARS = 1200
CONTEXT_CHARS = 1000
CHOICES = 4
MAX_LINE = 100
"""Longest line (stripped, characters) to predict or offer: a continuation must fit a small model's context."""
_DEF = re.compile(r"^(\s*)(async\s+)?def\s")


@dataclass(frozen=True)
class TaskSet:
    """A built set of tasks: one include path per split, and what was built."""

    root: Path
    meta: dict[str, Any]

    def include(self, split: str) -> Path:
        if split not in SPLITS:
            raise PmakitError(f"unknown item split {split!r}; known: {', '.join(SPLITS)}")
        return self.root / split


def held_out_documents(entry: Path) -> tuple[list[str], list[int]]:
    """The held-out documents of a corpus cache entry as text, and the split (0 selection, 1 test) of each piece.

    Documents are decoded from the cached validation tokens (every one ends with EOT), exactly the text the run
    was validated on. When whole documents would divide too unevenly, each document's halves go to the two splits,
    as ``heldout_of_documents`` does.
    """
    from tokenizers import Tokenizer

    from pmakit.train.data import document_sides

    val = np.load(entry / "val.npy")
    ends = np.flatnonzero(val == 0) + 1
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    docs = [val[a : b - 1] for a, b in zip(starts, ends)]
    if len(docs) < 2:
        raise PmakitError(f"{entry}: the held-out text has {len(docs)} file(s); the tasks need at least two")
    tokenizer = Tokenizer.from_file(str(entry / "tokenizer" / "tokenizer.json"))
    sides, held = document_sides([len(d) + 1 for d in docs])
    if 3 * min(held) < sum(held):
        halves = [(d[: (len(d) + 1) // 2], d[(len(d) + 1) // 2 :]) for d in docs]
        pieces = [piece for pair in halves for piece in pair]
        sides = [k for _ in docs for k in (0, 1)]
    else:
        pieces = docs
    return [tokenizer.decode([int(t) for t in p]) for p in pieces], sides


def build_tasks(entry: Path, *, items: int = 500, seed: int = 0) -> TaskSet:
    """The tasks of corpus cache entry ``entry`` (built once, then reused)."""
    entry = Path(entry)
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        raise PmakitError(f"{entry}: not a tokenized corpus (no meta.json)")
    key = hashlib.sha256(json.dumps([str(entry.resolve()), VERSION, items, seed]).encode()).hexdigest()[:16]
    root = entry.parent / f"eval-tasks-{key}"
    if (root / "tasks.json").is_file():
        _refresh_yamls(root)
        return TaskSet(root, json.loads((root / "tasks.json").read_text()))
    texts, sides = held_out_documents(entry)
    tmp = entry.parent / f".tmp-eval-tasks-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        splits: dict[str, Any] = {}
        meta = {"version": VERSION, "corpus": str(entry), "seed": seed, "splits": splits}
        for k, split in enumerate(SPLITS):
            docs = [t for t, s in zip(texts, sides) if s == k]
            splits[split] = _write_split(tmp / split, root / split, docs, entry, items=items, seed=seed)
        (tmp / "tasks.json").write_text(json.dumps(meta, indent=1) + "\n")
        try:
            tmp.rename(root)
        except OSError:
            if not (root / "tasks.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return TaskSet(root, json.loads((root / "tasks.json").read_text()))


def _write_split(
    folder: Path, final: Path, docs: Sequence[str], entry: Path, *, items: int, seed: int
) -> dict[str, Any]:
    """One split's data and YAMLs into ``folder``, naming their data files where they will be, in ``final``."""
    folder.mkdir(parents=True)
    choice = next_line_items(docs, items=items, seed=seed)
    pieces = text_pieces(docs, items=items)
    if not choice or not pieces:
        raise PmakitError(f"{entry}: too little held-out text to build tasks ({len(docs)} document(s))")
    tokenizer = _hf_tokenizer(entry)
    for piece in pieces:
        piece["tokens"] = len(tokenizer(piece["text"], add_special_tokens=False)["input_ids"])
    _jsonl(folder / "next_line.jsonl", choice)
    _jsonl(folder / "pieces.jsonl", pieces)
    (folder / "pmakit_eval_utils.py").write_text(UTILS)
    for name, text in _yamls(final).items():
        (folder / f"{name}.yaml").write_text(text)
    uniform = uniform_scores(
        choice, tokenizer, vocab=int(json.loads((entry / "meta.json").read_text())["vocab_size"])
    )
    return {
        "documents": len(docs),
        "pmakit_next_line": {"items": len(choice), "chance": 1 / CHOICES, **uniform},
        "pmakit_bpb": {"items": len(pieces), "bytes": sum(len(p["text"].encode()) for p in pieces)},
        "pmakit_loss": {"items": len(pieces), "tokens": sum(p["tokens"] for p in pieces)},
    }


def _refresh_yamls(root: Path) -> None:
    """A task set built by an earlier pmakit gets this one's YAMLs: the items (what a build names) are the same,
    how lm-eval reads them may have changed (fields named directly, not through a Jinja template that lm-eval
    compiled again for every document of every model: 13% of a small model's scoring)."""
    for split in SPLITS:
        if not (root / split).is_dir():
            continue
        for name, text in _yamls(root / split).items():
            path = root / split / f"{name}.yaml"
            if not path.is_file() or path.read_text() != text:
                atomic_write_text(path, text, fsync=False)


def _hf_tokenizer(entry: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(entry / "tokenizer")


def _jsonl(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _positions(lines: Sequence[str]) -> list[tuple[int, int]]:
    """(context start, target line) of every line worth predicting: a non-blank line of 6+ characters after at
    least one line of its function (the context starts at the nearest ``def`` above within 40 lines, else 10
    lines back)."""
    out = []
    for j in range(1, len(lines)):
        if not 6 <= len(lines[j].strip()) <= MAX_LINE:
            continue
        start = max(0, j - 10)
        for i in range(j - 1, max(-1, j - 41), -1):
            found = _DEF.match(lines[i])
            if found:
                start = i if len(_indent(lines[j])) > len(found.group(1)) else start
                break
        out.append((start, j))
    return out


def next_line_items(docs: Sequence[str], *, items: int, seed: int) -> list[dict[str, Any]]:
    """Up to ``items`` cloze items spread evenly over the documents' eligible lines (deterministic in ``seed``)."""
    lines = [d.splitlines(keepends=True) for d in docs]
    by_indent: dict[str, list[tuple[int, int, str]]] = {}
    for k, doc in enumerate(lines):
        for i, line in enumerate(doc):
            if 6 <= len(line.strip()) <= MAX_LINE:
                by_indent.setdefault(_indent(line), []).append((k, i, line))
    candidates = [(k, a, j) for k, doc in enumerate(lines) for a, j in _positions(doc)]
    picks = np.unique(np.linspace(0, len(candidates) - 1, num=min(items, len(candidates))).astype(int))
    out = []
    for n, c in enumerate(picks.tolist()):
        k, a, j = candidates[c]
        target = lines[k][j]
        rng = np.random.default_rng([seed, n])
        pool = [
            (d != k, line) for d, i, line in by_indent.get(_indent(target), []) if d != k or abs(i - j) > 40
        ]
        shuffled = [pool[i] for i in rng.permutation(len(pool))]
        others = [line for other, line in shuffled if other] + [line for other, line in shuffled if not other]
        distinct = [x for x in dict.fromkeys(others) if x.strip() != target.strip()][: CHOICES - 1]
        if len(distinct) < CHOICES - 1:
            continue
        label = int(rng.integers(CHOICES))
        choices = [*distinct[:label], target, *distinct[label:]]
        context = "".join(lines[k][a:j])[-CONTEXT_CHARS:]
        if not context.strip():  # lm-eval needs a context that is more than whitespace
            continue
        out.append({"context": context, "choices": choices, "label": label, "doc": k, "line": j})
    return out


def text_pieces(docs: Sequence[str], *, items: int) -> list[dict[str, Any]]:
    """Up to ``items`` pieces of whole lines (at most ``PIECE_CHARS`` each), spread evenly over the documents."""
    pieces: list[dict[str, Any]] = []
    for k, doc in enumerate(docs):
        piece = ""
        for line in doc.splitlines(keepends=True):
            if piece and len(piece) + len(line) > PIECE_CHARS:
                pieces.append({"text": piece, "doc": k})
                piece = ""
            piece += line[:PIECE_CHARS]
        if piece.strip():
            pieces.append({"text": piece, "doc": k})
    pieces = [p for p in pieces if p["text"].strip()]
    picks = np.unique(np.linspace(0, len(pieces) - 1, num=min(items, len(pieces))).astype(int))
    return [pieces[i] for i in picks.tolist()] if pieces else []


def uniform_scores(choice: Sequence[dict[str, Any]], tokenizer: Any, *, vocab: int) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of a model whose next-token distribution is uniform, computed as lm-eval's ``HFLM``
    scores it: the context's trailing whitespace moves into the continuation, each continuation's log-likelihood
    is its token count times log(1/vocab) summed in fp32, ``acc_norm`` divides by the choice's characters, and the
    first of equal scores wins."""
    import torch

    per_token = torch.log_softmax(torch.zeros(vocab), dim=-1)[0]
    acc = norm = 0
    for item in choice:
        context = item["context"]
        stripped = context.rstrip()
        head = len(tokenizer(stripped, add_special_tokens=False)["input_ids"])
        lls = []
        for c in item["choices"]:
            whole = len(
                tokenizer(stripped + context[len(stripped) :] + c, add_special_tokens=False)["input_ids"]
            )
            lls.append(float(per_token.expand(1, whole - head).sum()))
        acc += int(np.argmax(lls)) == item["label"]
        norm += (
            int(np.argmax(np.array(lls) / np.array([float(len(c)) for c in item["choices"]])))
            == item["label"]
        )
    return {"uniform_acc": acc / len(choice), "uniform_acc_norm": norm / len(choice)}


_HEAD = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"


def choice_task_yaml(name: str, data: Path) -> str:
    """An lm-eval multiple-choice task over a JSONL of {context, choices, label}: the choice follows the context
    directly (no delimiter), scored by ``acc`` and ``acc_norm`` (log-likelihood per character)."""
    return (
        f"task: {name}\n{_HEAD.format(path=data)}output_type: multiple_choice\n"
        'doc_to_text: context\ntarget_delimiter: ""\ndoc_to_choice: choices\ndoc_to_target: label\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\nmetadata:\n  version: 1\n"
    )


def _yamls(folder: Path) -> dict[str, str]:
    pieces = _HEAD.format(path=folder / "pieces.jsonl")
    rolling = 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: text\n'
    return {
        "pmakit_next_line": choice_task_yaml("pmakit_next_line", folder / "next_line.jsonl"),
        "pmakit_bpb": f"task: pmakit_bpb\n{pieces}{rolling}metric_list:\n"
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"
        "  - metric: byte_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
        "metadata:\n  version: 1\n",
        "pmakit_loss": f"task: pmakit_loss\n{pieces}{rolling}"
        "process_results: !function pmakit_eval_utils.process_results\nmetric_list:\n"
        "  - metric: loss\n    aggregation: !function pmakit_eval_utils.loss\n    higher_is_better: false\n"
        "metadata:\n  version: 1\n",
    }


UTILS = '''"""pmakit_loss: mean next-token loss (nats per token of the run's tokenizer) of a rolling log-likelihood."""


def process_results(doc, results):
    (loglikelihood,) = results
    return {"loss": (loglikelihood, doc["tokens"])}


def loss(items):
    lls, tokens = zip(*items)
    return -sum(lls) / sum(tokens)
'''
