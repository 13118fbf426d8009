"""Where a study or a command over a user's runs gets its held-out batches: the run's own corpus, a token file or
text files, divided into a selection split (where choices are made) and a disjoint test split (where they are
reported).

``load_eval_data`` serves ``pmakit tune`` and ``pmakit sweep-rank``; ``study_batches`` the scaling and sweep
studies (fixed selection and test batches, both spread over the whole held-out set).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pmakit.errors import PmakitError
from pmakit.snapshot import Snapshot
from pmakit.train.data import HeldOut


class EvalSizes(Protocol):
    """What ``load_eval_data`` reads of a search's config (``pmakit.lab.tune.TuneConfig``)."""

    @property
    def seed(self) -> int: ...
    @property
    def batch_size(self) -> int | None: ...
    @property
    def seq_len(self) -> int | None: ...


def split_batches(batches: Sequence[Any], selection: int, test: int) -> tuple[list[Any], list[Any]]:
    """Disjoint (selection, test) batches, both spread over the whole held-out set (every held-out file has a say
    in both)."""
    total = selection + test
    if len(batches) < total:
        raise PmakitError(
            f"the held-out split has {len(batches)} batches, fewer than selection_batches + test_batches = {total}; "
            "lower them or raise train.val_fraction"
        )
    test_idx = {k * total // test for k in range(test)}
    return [b for i, b in enumerate(batches[:total]) if i not in test_idx], [
        batches[i] for i in sorted(test_idx)
    ]


def study_batches(
    corpus: Any, batch_size: int, seq_len: int, selection: int, test: int
) -> dict[str, list[Any]]:
    """A study's fixed ``selection`` and ``test`` batches of ``corpus``'s held-out tokens (``split_batches``)."""
    from pmakit.train.data import val_batches

    batches = val_batches(corpus.val, batch_size=batch_size, seq_len=seq_len, max_batches=selection + test)
    sel, tst = split_batches(batches, selection, test)
    return {"selection": sel, "test": tst}


@dataclass
class EvalData:
    """The two held-out splits and where they came from."""

    held: HeldOut
    source: str
    batch_size: int
    seq_len: int


def load_eval_data(data: str | None, run: Path, newest: Snapshot, config: EvalSizes) -> EvalData:
    """The selection/test splits of ``data``: None or ``corpus`` for the run's own corpus, a token file, or text."""
    from pmakit.lab.plane import find_train_config
    from pmakit.train.data import corpus_heldout, heldout_splits, read_token_file
    from pmakit.train.loop import TrainConfig, load_corpus

    raw = find_train_config(run)
    model_ctx = _model_context(newest.path)
    if data is None or data == "corpus":
        if raw is None:
            raise PmakitError(
                f"no run config found in or above {run} to rebuild its corpus; pass --eval TOKENS.npy|TEXT_GLOB"
            )
        cfg = TrainConfig.from_dict(raw)
        corpus = load_corpus(cfg)
        held = corpus_heldout(corpus)
        source = f"the run's held-out split ({corpus.files.get('source')})"
        batch_size, seq_len = cfg.batch_size, cfg.model.seq_len
    else:
        path = Path(data).expanduser()
        if path.is_file() and path.suffix in (".npy", ".bin"):
            tokens = read_token_file(path)
            _check_vocabulary(tokens, newest.path, path)
            held, source = heldout_splits(tokens, eot=None), f"token file {path}"
        else:
            held, source = _text_heldout(data, newest.path, config.seed), f"text {data}"
        batch_size, seq_len = 8, min(256, model_ctx)
        if raw is not None:
            batch_size, seq_len = (
                int(raw.get("batch_size", 8)),
                int(raw.get("model", {}).get("seq_len", seq_len)),
            )
    return EvalData(held, source, config.batch_size or batch_size, min(config.seq_len or seq_len, model_ctx))


def _check_vocabulary(tokens: Any, snapshot_dir: Path, path: Path) -> None:
    """Token ids the model cannot embed are one error line here, not an IndexError inside its forward."""
    config = snapshot_dir / "config.json"
    vocab = json.loads(config.read_text()).get("vocab_size") if config.is_file() else None
    if isinstance(vocab, int) and len(tokens) and int(tokens.max()) >= vocab:
        raise PmakitError(
            f"{path}: token id {int(tokens.max())} is outside the model's vocabulary of {vocab} "
            f"({config}): the ids must come from the run's own tokenizer"
        )


def _model_context(snapshot_dir: Path) -> int:
    path = snapshot_dir / "config.json"
    if not path.is_file():
        return 1 << 30
    config = json.loads(path.read_text())
    return int(config.get("max_position_embeddings") or config.get("n_positions") or 1 << 30)


def _text_heldout(source: str, snapshot_dir: Path, seed: int) -> HeldOut:
    """Text files tokenized with the snapshot's tokenizer, divided by file (or in halves of a single file)."""
    from pmakit.train.data import _read_text, heldout_of_documents, resolve_source

    if not (snapshot_dir / "tokenizer.json").is_file():
        raise PmakitError(
            f"{snapshot_dir} has no tokenizer.json to tokenize {source} with; give a token file"
        )
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(snapshot_dir / "tokenizer.json"))
    _, paths = resolve_source(source)
    order = np.random.default_rng(seed).permutation(len(paths))
    docs = []
    for i in order:
        text, _ = _read_text(paths[i])
        if text:
            docs.append(np.asarray(tokenizer.encode(text).ids, dtype=np.int64))
    if not docs:
        raise PmakitError(f"{source}: no UTF-8 text to evaluate on")
    return heldout_of_documents(docs)
