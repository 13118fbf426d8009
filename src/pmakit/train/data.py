"""Training data: a corpus -> a byte-level BPE tokenizer + train/val token arrays (cached) -> batches.

Corpus sources (``prepare_corpus(source, ...)``):

- ``None``: the ``.py`` files of the installed ``torch`` package (~50 MB of Python). pmakit pins torch, so every
  machine that runs the README's commands reads the same bytes, whatever its Python (the standard library, the
  corpus before, differs between Python releases, and with it every number of the demo). ``torch/version.py``, the
  one file a build writes (CUDA version, git hash), is left out. The files are ordered by their path relative to the
  package, and ``source_digest`` (sha256 over those paths and bytes) is recorded, so that a run can tell whether it
  read the text a published result was measured on.
- ``"stdlib"``: the ``.py`` files of the Python standard library on this machine (``sysconfig`` ``stdlib`` path),
  minus ``site-packages``/``dist-packages`` (different on each Python release).
- a text file: split into train and a contiguous tail for validation.
- a directory: every text file below it (hidden files and directories skipped; binary or non-UTF-8 files skipped).
  A directory holding nanoGPT's ``train.bin`` and ``val.bin`` is read as those two token files instead.
- a glob (``"data/**/*.txt"``): the text files it matches.
- a pre-tokenized ``.npy`` (1-D integer array) or ``.bin`` (raw little-endian uint16 token ids, as nanoGPT's
  ``prepare.py`` writes them) of token ids: split by contiguous tail; no tokenizer, no byte count.

Text is split into train and validation BY FILE, so validation measures held-out text, not a neighbour of a training
window: the sorted file list is shuffled with ``seed`` and whole files go to validation until they hold
``val_fraction`` of the bytes (at least one file, and at least one left for training). ``max_bytes``
caps the corpus: files are taken in the permuted order until the cap (the last one cut at a line end), then split.

The tokenizer is a byte-level BPE (GPT-2's pre-tokenizer and decoder, any UTF-8 text encodes) trained with
``tokenizers`` on the train files only, with ``<|endoftext|>`` (id 0) appended after every document, and saved
as an HF fast tokenizer that ``transformers.AutoTokenizer.from_pretrained(corpus.tokenizer_dir)`` loads.

The validation split is divided once more BY FILE into two disjoint held-out splits (``heldout_splits``): a
*selection* split, on which every choice is made (best merge cell, best weighting, ``pmakit tune``'s search), and a
*test* split, on which the chosen model is reported. Every document of the cached validation tokens ends with EOT
(id 0, and a literal ``<|endoftext|>`` in the text is encoded as text), so the files are found again from the cached
tokens alone: the cache entry keeps exactly its meaning and key, and the division is a pure function of it. Input
without document boundaries (pre-tokenized files, the tail of a single text file) is divided into two contiguous
halves instead.

Tokenizer and token arrays are cached under ``cache_dir/corpus-<key>/``, the key hashing the file list (paths,
sizes, mtimes) and every option; an entry is built in a hidden temporary directory and renamed into place, so an
interrupted run never leaves an entry that looks complete.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import sysconfig
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pmakit.errors import PmakitError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
"""The document separator, appended after every document; id 0 of every tokenizer trained here."""
CACHE_VERSION = 1
_MIN_VOCAB = 257  # 256 byte tokens + EOT
_SNIFF_BYTES = 8192
# Encode (and count for BPE training) in pieces of at most this many characters, so that one big file still
# spreads over every core; pieces are cut where the pre-tokenizer would cut anyway (see _pieces).
_PIECE_CHARS = 1 << 20
_BATCH_CHARS = 2 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_BUILD_FILES = {"version.py"}  # written by torch's build (CUDA version, git hash): differs between wheels
_TOKEN_SUFFIXES = {".npy", ".bin"}


@dataclass
class Corpus:
    """Token ids of a corpus, split into train and held-out validation, with the tokenizer that made them."""

    train: np.ndarray
    """Training token ids, 1-D (uint16 when the vocabulary has at most 65536 entries, else uint32)."""
    val: np.ndarray
    """Validation token ids, 1-D: held-out files (or the tail of a single file)."""
    tokenizer_dir: Path | None
    """Directory loadable by ``AutoTokenizer.from_pretrained``; None for pre-tokenized input."""
    val_bytes: int | None
    """UTF-8 bytes of the validation text (EOT separators excluded); None for pre-tokenized input."""
    vocab_size: int
    """Vocabulary size the model needs (the tokenizer's; max id + 1 for pre-tokenized input)."""
    files: dict[str, Any]
    """Description: source, kind, split, file counts, bytes and tokens per split, cache entry, cached or not."""

    @property
    def bytes_per_token(self) -> float | None:
        """Validation bytes per validation token: bits per byte = loss_nats / ln 2 / bytes_per_token."""
        if self.val_bytes is None or len(self.val) == 0:
            return None
        return self.val_bytes / len(self.val)


# ----------------------------------------------------------------------------------------------------------------
# Public API


def prepare_corpus(
    source: str | Path | None,
    cache_dir: Path,
    *,
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    seed: int = 0,
) -> Corpus:
    """Tokenize a corpus (see the module docstring for sources), reusing ``cache_dir`` when nothing changed.

    Args:
        source: None for the installed torch package's sources, ``"stdlib"`` for this Python's standard library;
            a text file, directory, glob, ``.npy`` or ``.bin``.
        cache_dir: Where tokenizer and token arrays are cached (created if missing).
        vocab_size: BPE vocabulary size, EOT and the 256 byte tokens included.
        val_fraction: Share of the text bytes held out for validation, in whole files (at least one), or as the
            tail of a single file.
        max_bytes: Use at most this many bytes of text (of token file for pre-tokenized input); None for all.
        seed: Seed of the train/val split and of which files the cap keeps.
    """
    _check_options(vocab_size, val_fraction, max_bytes, seed)
    if source is None:
        kind, label, paths = "torch-src", f"torch {torch_release()} sources", torch_files()
    elif str(source) == "stdlib" and not Path(source).exists():
        kind, label, paths = "stdlib", f"stdlib:{stdlib_root()}", stdlib_files()
    else:
        kind, paths = resolve_source(source)
        label = str(source)
    if kind == "tokens":
        return _load_token_files(paths, label, val_fraction=val_fraction, max_bytes=max_bytes)

    cache_dir = Path(cache_dir)
    key = _cache_key(
        kind, paths, vocab_size=vocab_size, val_fraction=val_fraction, max_bytes=max_bytes, seed=seed
    )
    entry = cache_dir / f"corpus-{key}"
    if (entry / "meta.json").is_file():
        log.info("corpus: reusing cached tokens %s", entry)
        return _load_entry(entry)
    if entry.exists() and not (entry / "meta.json").is_file():
        # Entries appear by rename with meta.json inside, so this one was cut short by something else: rebuild.
        shutil.rmtree(entry, ignore_errors=True)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PmakitError(
            f"cannot create the corpus cache directory {cache_dir}: {e.strerror or e}"
        ) from None
    tmp = cache_dir / f".tmp-corpus-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        meta = _build_entry(tmp, kind, label, paths, vocab_size, val_fraction, max_bytes, seed)
        try:
            tmp.rename(entry)
        except OSError:
            if not (entry / "meta.json").is_file():  # not a concurrent run that finished first: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "corpus: %d train / %d val files, %d / %d tokens, cached in %s%s",
        meta["train_files"],
        meta["val_files"],
        meta["train_tokens"],
        meta["val_tokens"],
        entry,
        f" (source sha256 {meta['source_digest'][:12]})" if "source_digest" in meta else "",
    )
    corpus = _load_entry(entry)
    corpus.files["cached"] = False
    return corpus


def get_batch(
    tokens: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int, shard: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows ``(x, y)``, ``y`` = ``x`` shifted by one token, int64 tensors of shape (batch, seq_len).

    The windows depend only on ``(seed, step, shard)`` (a fresh numpy Generator, no global RNG state), so a run
    resumed or forked at step k sees exactly the batches the original run saw from step k on. ``shard`` is a model
    copy's own data stream (``pmakit train --replicas``); shard 0 is the single-copy stream.
    """
    if step < 0 or seed < 0 or shard < 0:
        raise PmakitError(f"step, seed and shard must be >= 0, got step={step}, seed={seed}, shard={shard}")
    _check_window(len(tokens), batch_size, seq_len, what="training")
    rng = np.random.default_rng((seed, step) if shard == 0 else (seed, step, shard))
    starts = rng.integers(0, len(tokens) - seq_len, size=batch_size)
    return _windows(tokens, starts, seq_len)


def val_batches(
    val: np.ndarray, *, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: non-overlapping windows spread evenly over the whole val set, the same every call.

    Each token is a target at most once. Up to ``max_batches`` batches of ``batch_size`` windows.
    """
    if max_batches < 1:
        raise PmakitError(f"max_batches must be >= 1, got {max_batches}")
    _check_window(len(val), batch_size, seq_len, what="validation")
    n_windows = (len(val) - 1) // seq_len
    n_batches = min(max_batches, n_windows // batch_size)
    if n_batches == 0:
        raise PmakitError(
            f"the validation set has {len(val)} tokens, too few for one batch of {batch_size} x {seq_len} "
            f"(needs {batch_size * seq_len + 1}); lower the batch size or sequence length, or raise val_fraction"
        )
    total = n_batches * batch_size
    # Evenly spaced window indices (distinct because total <= n_windows): every held-out file gets a say.
    starts = (np.arange(total, dtype=np.int64) * n_windows // total) * seq_len
    return [_windows(val, starts[i * batch_size : (i + 1) * batch_size], seq_len) for i in range(n_batches)]


@dataclass(frozen=True)
class HeldOut:
    """The held-out tokens in two disjoint splits: choose on ``selection``, report on ``test``."""

    selection: np.ndarray
    """Token ids every choice is made on."""
    test: np.ndarray
    """Token ids the chosen model is reported on (no text of it is in ``selection``; by file, no file)."""
    mode: str
    """``by-file`` (whole documents), ``halves`` (the two halves of every document, when whole documents would
    divide too unevenly) or ``contiguous`` (two halves of one token stream)."""
    documents: tuple[int, int]
    """Documents (files) in (selection, test); (0, 0) for a contiguous division."""

    def describe(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "selection_tokens": len(self.selection),
            "test_tokens": len(self.test),
            "selection_documents": self.documents[0],
            "test_documents": self.documents[1],
        }


def heldout_splits(val: np.ndarray, *, eot: int | None = 0) -> HeldOut:
    """Divide held-out tokens into disjoint selection and test splits, by document where there are two or more.

    Documents are the runs of tokens ending in ``eot`` (the separator ``encode_docs`` appends), taken in their
    stored order (the corpus already shuffled its files with the seed) and each given to the split that holds
    fewer tokens so far, so the two come out about equal. With ``eot=None`` or fewer than two documents the tokens
    are cut into two contiguous halves (first half selection).

    Example: documents of 5, 3, 4 tokens -> selection [doc 0], test [doc 1, doc 2] (5 vs 3, then 5 vs 7).
    """
    if len(val) < 4:
        raise PmakitError(
            f"the held-out set has {len(val)} tokens, too few to divide into selection and test"
        )
    ends = np.flatnonzero(np.asarray(val) == eot) + 1 if eot is not None else np.zeros(0, dtype=np.int64)
    if len(ends) and ends[-1] != len(val):
        ends = np.append(ends, len(val))  # a trailing piece without separator is a document of its own
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    return heldout_of_documents([val[lo:hi] for lo, hi in zip(starts, ends)] if len(ends) >= 2 else [val])


def heldout_of_documents(docs: Sequence[np.ndarray]) -> HeldOut:
    """Documents (token arrays, in a shuffled order) divided by document; one document is cut in two halves."""
    if len(docs) < 2:
        tokens = docs[0]
        if len(tokens) < 4:
            raise PmakitError(f"the held-out text has {len(tokens)} tokens, too few to divide in two")
        half = len(tokens) // 2
        return HeldOut(tokens[:half], tokens[half:], "contiguous", (0, 0))
    parts: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    sides, held = document_sides([len(doc) for doc in docs])
    for doc, k in zip(docs, sides):
        parts[k].append(doc)
    if 3 * min(held) < sum(held):
        return _halves_of_documents(docs, held)
    return HeldOut(
        np.concatenate(parts[0]), np.concatenate(parts[1]), "by-file", (len(parts[0]), len(parts[1]))
    )


def document_sides(lengths: Sequence[int]) -> tuple[list[int], list[int]]:
    """Which split each document goes to (0 selection, 1 test: the lighter split takes the next document), and the
    tokens each split then holds. ``heldout_of_documents`` halves every document instead when one split would hold
    under a quarter of the tokens."""
    sides, held = [], [0, 0]
    for n in lengths:
        k = 0 if held[0] <= held[1] else 1
        sides.append(k)
        held[k] += n
    return sides, held


def _halves_of_documents(docs: Sequence[np.ndarray], held: Sequence[int]) -> HeldOut:
    """A few files of very different sizes (two Markdown files of 5K and 378K tokens) would leave one split too
    small to choose on: every document's first half goes to selection and its second half to test instead."""
    log.warning(
        "the held-out files divide unevenly (%s and %s tokens); selection and test take the first and second "
        "half of every held-out file instead, so they share files but no text",
        f"{held[0]:,}",
        f"{held[1]:,}",
    )
    first = [doc[: len(doc) // 2] for doc in docs]
    second = [doc[len(doc) // 2 :] for doc in docs]
    return HeldOut(np.concatenate(first), np.concatenate(second), "halves", (len(docs), len(docs)))


def corpus_heldout(corpus: Corpus) -> HeldOut:
    """``heldout_splits`` of a corpus's validation tokens (by file for text corpora tokenized here)."""
    by_file = corpus.tokenizer_dir is not None and corpus.files.get("split") == "by-file"
    return heldout_splits(corpus.val, eot=0 if by_file else None)


def split_batches(
    held: HeldOut, *, batch_size: int, seq_len: int, max_batches: int
) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Fixed batches of each split (``val_batches`` of each): ``{"selection": [...], "test": [...]}``."""
    return {
        name: val_batches(tokens, batch_size=batch_size, seq_len=seq_len, max_batches=max_batches)
        for name, tokens in (("selection", held.selection), ("test", held.test))
    }


def torch_release() -> str:
    """torch's release without the local build tag (``2.13.0+cpu`` and the CUDA wheel's ``2.13.0`` are one)."""
    return torch.__version__.split("+")[0]


def torch_files() -> list[Path]:
    """The installed torch package's ``.py`` files, ordered by their path inside the package (the same order on
    every machine), without the build-written ``version.py``."""
    root = Path(torch.__file__).parent
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(directory, n) for n in names if n.endswith(".py")]
    files = [f for f in files if f.relative_to(root).as_posix() not in _BUILD_FILES]
    if not files:
        raise PmakitError(
            f"the torch package at {root} ships without .py sources; "
            "pass a text corpus with --corpus PATH (a text file, a directory, a glob, or a .npy/.bin of token ids)"
        )
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def source_digest(paths: Sequence[Path], root: Path) -> str:
    """sha256 over the files' paths relative to ``root`` and their bytes: the same text gives the same digest on
    any machine, wherever it is installed."""
    h = hashlib.sha256()
    for p in paths:
        rel = p.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(8, "little") + rel)
        data = p.read_bytes()
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def stdlib_root() -> Path:
    """The directory of the standard library's Python sources (the base install's, also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted, without third-party packages; an error if it has none."""
    root = stdlib_root()
    files = []
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(directory, n) for n in names if n.endswith(".py")]
    if not files:
        raise PmakitError(
            f"this Python's standard library at {root} ships without .py sources; "
            "pass a text corpus with --corpus PATH (a text file, a directory, a glob, or a .npy/.bin of token ids)"
        )
    return sorted(files)


def resolve_source(source: str | Path) -> tuple[str, list[Path]]:
    """``(kind, paths)`` for a user's corpus: kind is file, dir, glob or tokens; paths are sorted candidates."""
    path = Path(source).expanduser()
    if path.is_file():
        return ("tokens" if path.suffix in _TOKEN_SUFFIXES else "file"), [path]
    if path.is_dir():
        for a, b in (("train.bin", "val.bin"), ("train.npy", "val.npy")):
            if (path / a).is_file() and (path / b).is_file():
                return "tokens", [path / a, path / b]
        return "dir", _files_below(path)
    if glob.has_magic(str(source)):
        matches = sorted(Path(m) for m in glob.glob(os.path.expanduser(str(source)), recursive=True))
        paths = sorted({f for m in matches for f in ([m] if m.is_file() else _files_below(m))})
        if not paths:
            raise PmakitError(f"the corpus glob {str(source)!r} matches no files")
        return "glob", paths
    raise PmakitError(
        f"corpus not found: {source} (give a text file, a directory, a glob, or a .npy/.bin of token ids)"
    )


def save_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    """Save a ``tokenizers.Tokenizer`` as an HF fast tokenizer that ``AutoTokenizer.from_pretrained`` loads.

    Writes tokenizer.json, tokenizer_config.json and special_tokens_map.json. The class is recorded as
    ``PreTrainedTokenizerFast``, the name both transformers 4.x and 5.x resolve.
    """
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        clean_up_tokenization_spaces=False,  # otherwise decode() would drop spaces before punctuation
    )
    hf.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5 writes a class 4.x does not know
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = directory / "special_tokens_map.json"
    if not special.exists():  # transformers 5 no longer writes it; 4.x reads it
        special.write_text(
            json.dumps({"bos_token": EOT, "eos_token": EOT, "pad_token": EOT}, indent=2) + "\n"
        )


# ----------------------------------------------------------------------------------------------------------------
# Reading text


def _check_options(vocab_size: int, val_fraction: float, max_bytes: int | None, seed: int) -> None:
    if vocab_size <= _MIN_VOCAB:
        raise PmakitError(f"vocab_size must be more than {_MIN_VOCAB} (256 bytes + EOT), got {vocab_size}")
    if not 0.0 < val_fraction < 1.0:
        raise PmakitError(f"val_fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if max_bytes is not None and max_bytes <= 0:
        raise PmakitError(f"max_bytes must be positive, got {max_bytes}")
    if seed < 0:
        raise PmakitError(f"seed must be >= 0, got {seed}")


def _files_below(directory: Path) -> list[Path]:
    """Regular files below ``directory``, sorted; hidden entries and ``__pycache__`` are skipped."""
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        found += [Path(root, n) for n in names if not n.startswith(".")]
    return sorted(p for p in found if p.is_file())


def _read_text(path: Path, limit: int | None = None) -> tuple[str | None, bool]:
    """``(text, truncated)``: the file's text (at most ``limit`` bytes of it), None when binary or not UTF-8.

    Binary means a NUL byte near the start. Reading stops at ``limit``, so a cap on a huge file reads only the cap.
    """
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
        if b"\0" in head:
            return None, False
        raw = head + (f.read() if limit is None else f.read(max(limit - len(head), 0) + 1))
    truncated = limit is not None and len(raw) > limit
    if truncated:
        raw = raw[:limit]
    try:
        return raw.decode("utf-8-sig"), truncated
    except UnicodeDecodeError as e:
        if truncated and e.start >= len(raw) - 3:  # the cut fell inside a multi-byte character
            return raw[: e.start].decode("utf-8-sig", errors="replace"), truncated
        return None, False


def _select_docs(
    paths: Sequence[Path], *, order: np.ndarray, max_bytes: int | None
) -> tuple[list[tuple[str, str]], int]:
    """Read files in ``order`` until ``max_bytes`` of text: ``([(path, text), ...], n_skipped)``.

    The file that reaches the cap is cut at its last line end within the cap, and is the last one read.
    """
    docs: list[tuple[str, str]] = []
    skipped, total = 0, 0
    for i in order:
        remaining = None if max_bytes is None else max_bytes - total
        if remaining is not None and remaining <= 0:
            break
        try:
            text, truncated = _read_text(paths[i], remaining)
        except OSError as e:
            raise PmakitError(f"cannot read {paths[i]}: {e.strerror or e}") from None
        if text is None:
            log.debug("corpus: skipping %s (binary or not UTF-8)", paths[i])
            skipped += 1
            continue
        if truncated:
            text = text[: text.rfind("\n") + 1] or text  # whole lines, unless not even one fits
            total = max_bytes or 0
        else:
            total += len(text.encode("utf-8"))
        if text:
            docs.append((str(paths[i]), text))
    return docs, skipped


def _tail_split(text: str, val_fraction: float) -> tuple[str, str]:
    """Split one text into head (train) and tail (val) at the first line end after the cut point."""
    if len(text) < 2:
        raise PmakitError("the corpus text is too short to split into train and validation")
    cut = min(max(int(len(text) * (1.0 - val_fraction)), 1), len(text) - 1)
    newline = text.find("\n", cut - 1, len(text) - 1)
    if newline >= 0:
        cut = newline + 1
    return text[:cut], text[cut:]


def _split_docs(
    docs: list[tuple[str, str]], val_fraction: float
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], str]:
    """Train and val documents: whole files when there are at least two, else the tail of the one file.

    Val takes files from the front of the (already shuffled) list until it holds ``val_fraction`` of the bytes:
    a fraction of the files would make the val size swing with which files happen to be drawn.
    """
    if len(docs) >= 2:
        sizes = [len(text.encode("utf-8")) for _, text in docs]
        target = val_fraction * sum(sizes)
        n_val, held = 0, 0
        while n_val < len(docs) - 1 and (n_val == 0 or held < target):
            held += sizes[n_val]
            n_val += 1
        return docs[n_val:], docs[:n_val], "by-file"
    name, text = docs[0]
    head, tail = _tail_split(text, val_fraction)
    return [(name, head)], [(name, tail)], "tail"


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and encoding


def _pieces(text: str, max_chars: int = _PIECE_CHARS) -> Iterator[str]:
    """Cut ``text`` into pieces of at most ``max_chars``, where GPT-2's pre-tokenizer cuts anyway.

    No pre-token spans a non-space character followed by a whitespace character, and no pattern looks behind, so
    cutting there gives exactly the ids of encoding the whole text. Only a window without any such place (no
    whitespace at all) is cut hard, which may change a token or two: harmless for training data.
    """
    start = 0
    while len(text) - start > max_chars:
        cut = start + max_chars
        while cut > start and not (text[cut].isspace() and not text[cut - 1].isspace()):
            cut -= 1
        if cut == start:
            cut = start + max_chars
        yield text[start:cut]
        start = cut
    if start < len(text):
        yield text[start:]


def _import_tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise PmakitError(
            "training a tokenizer needs the train extra: pip install -e '.[train]' in the pmakit checkout"
        ) from None
    return tokenizers


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` entries (EOT = id 0) trained on ``texts``."""
    tk = _import_tokenizers()
    tokenizer = tk.Tokenizer(tk.models.BPE())
    tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((p for t in texts for p in _pieces(t)), trainer)
    found = tokenizer.get_vocab_size()
    if found < vocab_size:
        raise PmakitError(
            f"vocab_size {vocab_size} is too large for this corpus: BPE ran out of merges at {found} tokens; "
            f"use a vocab size of at most {found}, or more text"
        )
    return tokenizer


def encode_docs(tokenizer: Tokenizer, texts: Sequence[str], dtype: type[np.integer[Any]]) -> np.ndarray:
    """Token ids of every text followed by EOT, concatenated; pieces are encoded in parallel batches."""
    eot = np.array([tokenizer.token_to_id(EOT)], dtype=dtype)
    pieces = [(piece, doc) for doc, text in enumerate(texts) for piece in _pieces(text)]
    parts: list[np.ndarray] = []
    # Text is data: a literal "<|endoftext|>" inside a file is encoded as text, not as the separator.
    tokenizer.encode_special_tokens = True
    try:
        for lo, hi in _batch_bounds([len(p) for p, _ in pieces], _BATCH_CHARS):
            encodings = tokenizer.encode_batch_fast([p for p, _ in pieces[lo:hi]], add_special_tokens=False)
            for k, enc in enumerate(encodings, lo):
                parts.append(np.asarray(enc.ids, dtype=dtype))
                if k + 1 == len(pieces) or pieces[k + 1][1] != pieces[k][1]:
                    parts.append(eot)
    finally:
        tokenizer.encode_special_tokens = False
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _batch_bounds(lengths: Sequence[int], max_chars: int) -> Iterator[tuple[int, int]]:
    """``[lo, hi)`` index ranges of consecutive items holding about ``max_chars`` characters each."""
    lo, chars = 0, 0
    for i, n in enumerate(lengths):
        chars += n
        if chars >= max_chars:
            yield lo, i + 1
            lo, chars = i + 1, 0
    if lo < len(lengths):
        yield lo, len(lengths)


# ----------------------------------------------------------------------------------------------------------------
# Cache


def _cache_key(
    kind: str,
    paths: Sequence[Path],
    *,
    vocab_size: int,
    val_fraction: float,
    max_bytes: int | None,
    seed: int,
) -> str:
    files = []
    for p in paths:
        st = p.stat()
        files.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    record = {
        "version": CACHE_VERSION,
        "tokenizers": getattr(_import_tokenizers(), "__version__", "?"),
        "kind": kind,
        "files": files,
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "seed": seed,
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def _build_entry(
    tmp: Path,
    kind: str,
    label: str,
    paths: Sequence[Path],
    vocab_size: int,
    val_fraction: float,
    max_bytes: int | None,
    seed: int,
) -> dict[str, Any]:
    """Read, split, train the tokenizer, encode, and write everything into ``tmp`` (meta.json last)."""
    t0 = time.perf_counter()
    docs, skipped = _read_docs(kind, label, paths, max_bytes, seed)
    train_docs, val_docs, split = _split_docs(docs, val_fraction)
    train_texts = [t for _, t in train_docs]
    val_texts = [t for _, t in val_docs]
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    log.info(
        "corpus: training a %d-token BPE on %.1f MB (%d files) of %s",
        vocab_size,
        train_bytes / 1e6,
        len(train_docs),
        label,
    )
    t_read = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, vocab_size)
    t1 = time.perf_counter()
    dtype: type[np.integer[Any]] = np.uint16 if vocab_size <= 1 << 16 else np.uint32
    train = encode_docs(tokenizer, train_texts, dtype)
    val = encode_docs(tokenizer, val_texts, dtype)
    t2 = time.perf_counter()

    meta = {
        "version": CACHE_VERSION,
        "source": label,
        "kind": kind,
        "split": split,
        "seed": seed,
        "val_fraction": val_fraction,
        "max_bytes": max_bytes,
        "vocab_size": vocab_size,
        "train_files": len(train_docs),
        "val_files": len(val_docs),
        "skipped_files": skipped,
        "train_bytes": train_bytes,
        "val_bytes": val_bytes,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "read_seconds": round(t_read - t0, 3),
        "tokenizer_seconds": round(t1 - t_read, 3),
        "encode_seconds": round(t2 - t1, 3),
        "val_paths": [name for name, _ in val_docs],
    }
    roots = {"torch-src": Path(torch.__file__).parent, "stdlib": stdlib_root()}
    if kind in roots:
        meta["source_digest"] = source_digest(paths, roots[kind])
    _write_entry(tmp, tokenizer, train, val, meta)
    return meta


def _read_docs(
    kind: str, label: str, paths: Sequence[Path], max_bytes: int | None, seed: int
) -> tuple[list[tuple[str, str]], int]:
    """The documents of ``paths`` in the seed's order (up to ``max_bytes``) and the number skipped; none is an error."""
    order = np.random.default_rng(seed).permutation(len(paths))
    docs, skipped = _select_docs(paths, order=order, max_bytes=max_bytes)
    if not docs:
        if kind == "file":
            raise PmakitError(
                f"{label} is not UTF-8 text (binary?) or is empty; give a text file or a .npy/.bin"
            )
        raise PmakitError(
            f"the corpus {label} has no text: {len(paths)} file(s), all empty, binary or not UTF-8"
        )
    return docs, skipped


def _write_entry(
    tmp: Path, tokenizer: Tokenizer, train: np.ndarray, val: np.ndarray, meta: dict[str, Any]
) -> None:
    """The cache entry's files, ``meta.json`` last: an entry without it is unfinished."""
    tmp.mkdir(parents=True)
    save_tokenizer(tokenizer, tmp / "tokenizer")
    np.save(tmp / "train.npy", train)
    np.save(tmp / "val.npy", val)
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def _load_entry(entry: Path) -> Corpus:
    meta = json.loads((entry / "meta.json").read_text())
    files = {k: v for k, v in meta.items() if k != "val_paths"}
    files.update(cache=str(entry), cached=True)
    return Corpus(
        train=np.load(entry / "train.npy"),
        val=np.load(entry / "val.npy"),
        tokenizer_dir=entry / "tokenizer",
        val_bytes=int(meta["val_bytes"]),
        vocab_size=int(meta["vocab_size"]),
        files=files,
    )


# ----------------------------------------------------------------------------------------------------------------
# Pre-tokenized input


def read_token_file(path: Path, max_bytes: int | None = None) -> np.ndarray:
    """Token ids of a ``.npy`` (1-D integer array) or a nanoGPT-style uint16 ``.bin``; an error line otherwise."""
    return _read_token_file(Path(path), max_bytes)


def _read_token_file(path: Path, max_bytes: int | None) -> np.ndarray:
    """A 1-D array of non-negative integer token ids from a .npy or a nanoGPT-style uint16 .bin."""
    if path.suffix == ".bin":
        size = path.stat().st_size
        if size == 0 or size % 2:
            raise PmakitError(f"{path}: a .bin corpus must hold uint16 token ids (an even, non-zero size)")
        tokens: np.ndarray = np.memmap(path, dtype=np.uint16, mode="r")
    else:
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise PmakitError(f"{path}: not a .npy array of token ids ({e})") from None
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise PmakitError(
                f"{path}: token ids must be a 1-D integer array, got {tokens.dtype} of shape {tokens.shape}"
            )
    if max_bytes is not None:
        tokens = tokens[: max(max_bytes // tokens.dtype.itemsize, 2)]
    if len(tokens) < 2:
        raise PmakitError(f"{path}: fewer than two token ids")
    if tokens.min() < 0:
        raise PmakitError(f"{path}: negative token ids")
    return tokens


def _load_token_files(
    paths: Sequence[Path], label: str, *, val_fraction: float, max_bytes: int | None
) -> Corpus:
    """Pre-tokenized input: one file split by its tail, or nanoGPT's train/val pair as given."""
    if len(paths) == 2:
        train, val = (_read_token_file(p, max_bytes) for p in paths)
        split = "given"
    else:
        tokens = _read_token_file(paths[0], max_bytes)
        n_val = min(max(1, round(len(tokens) * val_fraction)), len(tokens) - 1)
        train, val = tokens[:-n_val], tokens[-n_val:]
        split = "tail"
    vocab = int(max(train.max(), val.max())) + 1
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    train, val = (a if a.dtype == dtype else a.astype(dtype) for a in (train, val))
    files = {
        "source": label,
        "kind": "tokens",
        "split": split,
        "vocab_size": vocab,
        "train_tokens": len(train),
        "val_tokens": len(val),
        "cached": False,
    }
    return Corpus(train=train, val=val, tokenizer_dir=None, val_bytes=None, vocab_size=vocab, files=files)


# ----------------------------------------------------------------------------------------------------------------
# Batches


def _check_window(n_tokens: int, batch_size: int, seq_len: int, *, what: str) -> None:
    if batch_size < 1 or seq_len < 1:
        raise PmakitError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
    if n_tokens < seq_len + 1:
        raise PmakitError(
            f"the {what} set has {n_tokens} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())
