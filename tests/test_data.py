"""pmakit.train.data: corpus sources, the by-file split, the tokenizer, the cache, and deterministic batches."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pmakit.errors import PmakitError
from pmakit.train import data
from pmakit.train.data import EOT, Corpus, get_batch, prepare_corpus, val_batches

VOCAB = 320  # 256 bytes + EOT + 63 merges: reachable on the tiny corpus below


def _text(seed: int, lines: int = 40) -> str:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 7))) for _ in range(60)]
    body = "\n".join(
        "    " * rng.randint(0, 2) + " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "(x, y):"
        for _ in range(lines)
    )
    return f"# file {seed}\n{body}\n"


@pytest.fixture
def corpus_dir(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """12 text files (one with non-ASCII text) plus files that must be skipped; returns (dir, {path: text})."""
    root = tmp_path / "corpus"
    texts: dict[str, str] = {}
    for i in range(12):
        path = root / ("sub" if i % 3 == 0 else "") / f"mod{i:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = _text(i) + ("héllo wörld 🙂 ≠ 世界\n" if i == 5 else "")
        path.write_text(text, encoding="utf-8")
        texts[str(path)] = text
    (root / "blob.bin").write_bytes(bytes(range(256)) * 4)  # binary: NUL bytes
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))  # not UTF-8
    (root / "empty.txt").write_text("")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden: never read
    return root, texts


def _docs(corpus: Corpus, ids: np.ndarray) -> list[str]:
    """Decode token ids back into the documents they were made of (split at EOT)."""
    from tokenizers import Tokenizer

    assert corpus.tokenizer_dir is not None
    tok = Tokenizer.from_file(str(corpus.tokenizer_dir / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    assert ids[-1] == eot
    cuts = np.flatnonzero(ids == eot)
    starts = np.concatenate([[0], cuts[:-1] + 1])
    return [tok.decode(ids[a:b].tolist(), skip_special_tokens=False) for a, b in zip(starts, cuts)]


# -- split, tokenizer, cache ---------------------------------------------------------------------------------------


def test_split_is_by_whole_files_and_reconstructs_them(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    root, texts = corpus_dir
    corpus = prepare_corpus(root, tmp_path / "cache", vocab_size=VOCAB, val_fraction=0.2)
    train_docs, val_docs = _docs(corpus, corpus.train), _docs(corpus, corpus.val)
    # Every text file lands whole in exactly one split; binary, latin-1, empty and hidden files in neither.
    assert sorted(train_docs + val_docs) == sorted(texts.values())
    assert not set(train_docs) & set(val_docs)
    assert 1 <= len(val_docs) < len(texts)
    assert corpus.val_bytes == sum(len(d.encode("utf-8")) for d in val_docs)
    total = sum(len(t.encode("utf-8")) for t in texts.values())
    # Files go to val until they hold 20% of the bytes: at least that, and at most one file more.
    assert 0.2 * total <= corpus.val_bytes < 0.2 * total + max(len(t.encode()) for t in texts.values())
    assert corpus.vocab_size == VOCAB
    assert corpus.train.dtype == np.uint16 and corpus.val.dtype == np.uint16
    f = corpus.files
    assert (f["kind"], f["split"], f["cached"]) == ("dir", "by-file", False)
    assert (f["train_files"], f["val_files"], f["skipped_files"]) == (len(train_docs), len(val_docs), 2)
    assert (f["train_tokens"], f["val_tokens"]) == (len(corpus.train), len(corpus.val))
    assert corpus.bytes_per_token == pytest.approx(corpus.val_bytes / len(corpus.val))


def test_tokenizer_sees_train_files_only(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus_dir
    seen: list[str] = []
    real = data.train_tokenizer

    def spy(texts: list[str], vocab_size: int) -> Any:
        seen.extend(texts)
        return real(texts, vocab_size)

    monkeypatch.setattr(data, "train_tokenizer", spy)
    corpus = prepare_corpus(root, tmp_path / "cache", vocab_size=VOCAB, val_fraction=0.2)
    assert sorted(seen) == sorted(_docs(corpus, corpus.train))
    assert not set(seen) & set(_docs(corpus, corpus.val))


def test_tokenizer_loads_with_autotokenizer_and_round_trips(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    root, texts = corpus_dir
    corpus = prepare_corpus(root, tmp_path / "cache", vocab_size=VOCAB)
    assert corpus.tokenizer_dir is not None
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (corpus.tokenizer_dir / name).is_file()
    tok = AutoTokenizer.from_pretrained(corpus.tokenizer_dir)
    assert len(tok) == VOCAB
    assert tok.eos_token == EOT and tok.eos_token_id == 0 and tok.pad_token_id == 0
    for text in [
        *texts.values(),
        "  def f(x) :  return x . y , z\n\n\tpass\r\n",
        "unseen: ÆØÅ ∮ 🙂🙂 日本語 \x01\x7f",
    ]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    # The cached arrays are what the saved tokenizer produces: the first train document, then EOT.
    first = _docs(corpus, corpus.train)[0]
    ids = tok(first, add_special_tokens=False)["input_ids"]
    assert corpus.train[: len(ids) + 1].tolist() == [*ids, 0]


def test_same_seed_same_corpus_other_seed_other_split(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    root, _ = corpus_dir
    a = prepare_corpus(root, tmp_path / "a", vocab_size=VOCAB, val_fraction=0.2, seed=0)
    b = prepare_corpus(root, tmp_path / "b", vocab_size=VOCAB, val_fraction=0.2, seed=0)
    assert a.files["cached"] is False and b.files["cached"] is False  # both built from scratch
    np.testing.assert_array_equal(a.train, b.train)
    np.testing.assert_array_equal(a.val, b.val)
    assert a.tokenizer_dir and b.tokenizer_dir
    assert (a.tokenizer_dir / "tokenizer.json").read_bytes() == (
        b.tokenizer_dir / "tokenizer.json"
    ).read_bytes()
    val_sets = {
        frozenset(_docs(c, c.val))
        for c in (
            prepare_corpus(root, tmp_path / f"s{s}", vocab_size=VOCAB, val_fraction=0.2, seed=s)
            for s in range(4)
        )
    }
    assert len(val_sets) > 1


def test_cache_is_reused_and_invalidated_by_changes(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, texts = corpus_dir
    cache = tmp_path / "cache"
    first = prepare_corpus(root, cache, vocab_size=VOCAB)

    def no_training(*_: Any) -> Any:
        raise AssertionError("the cache should have been used")

    with monkeypatch.context() as m:
        m.setattr(data, "train_tokenizer", no_training)
        again = prepare_corpus(root, cache, vocab_size=VOCAB)
    assert again.files["cached"] is True and again.tokenizer_dir == first.tokenizer_dir
    np.testing.assert_array_equal(again.train, first.train)
    np.testing.assert_array_equal(again.val, first.val)
    assert again.val_bytes == first.val_bytes

    other_vocab = prepare_corpus(root, cache, vocab_size=VOCAB + 8)
    assert other_vocab.files["cached"] is False and other_vocab.vocab_size == VOCAB + 8
    path = next(iter(texts))
    Path(path).write_text(texts[path] + "one more line\n")
    changed = prepare_corpus(root, cache, vocab_size=VOCAB)
    assert changed.files["cached"] is False
    assert len(changed.train) + len(changed.val) > len(first.train) + len(first.val)
    assert len(list(cache.glob("corpus-*"))) == 3
    assert not list(cache.glob(".tmp-*"))


def test_interrupted_build_leaves_nothing_that_looks_complete(
    corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root, _ = corpus_dir
    cache = tmp_path / "cache"
    real_save = np.save
    calls = []

    def save_then_ctrl_c(path: Any, array: Any) -> None:
        real_save(path, array)
        calls.append(path)
        if len(calls) == 2:  # train.npy and val.npy written, meta.json not yet
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(data.np, "save", save_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus(root, cache, vocab_size=VOCAB)
    assert list(cache.iterdir()) == []

    good = prepare_corpus(root, cache, vocab_size=VOCAB)
    entry = Path(good.files["cache"])
    # An entry without meta.json (a copy cut short, another tool) is never trusted: it is rebuilt.
    (entry / "meta.json").unlink()
    np.save(entry / "train.npy", np.zeros(3, dtype=np.uint16))
    rebuilt = prepare_corpus(root, cache, vocab_size=VOCAB)
    assert rebuilt.files["cached"] is False
    np.testing.assert_array_equal(rebuilt.train, good.train)


# -- other sources ---------------------------------------------------------------------------------------------------


def test_single_file_is_split_by_its_tail(tmp_path: Path) -> None:
    text = "".join(_text(i) for i in range(6))
    path = tmp_path / "one.txt"
    path.write_text(text)
    corpus = prepare_corpus(path, tmp_path / "cache", vocab_size=VOCAB, val_fraction=0.25)
    (head,), (tail,) = _docs(corpus, corpus.train), _docs(corpus, corpus.val)
    assert head + tail == text
    assert head.endswith("\n")  # cut at a line end
    assert len(tail) == pytest.approx(0.25 * len(text), abs=len(max(text.splitlines(), key=len)) + 1)
    assert corpus.val_bytes == len(tail.encode())
    assert (corpus.files["kind"], corpus.files["split"]) == ("file", "tail")


def test_max_bytes_caps_the_text(corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, texts = corpus_dir
    cap = sum(len(t.encode()) for t in texts.values()) // 3
    corpus = prepare_corpus(root, tmp_path / "cache", vocab_size=VOCAB, max_bytes=cap)
    docs = _docs(corpus, corpus.train) + _docs(corpus, corpus.val)
    used = sum(len(d.encode()) for d in docs)
    assert cap // 2 < used <= cap
    assert corpus.files["train_bytes"] + corpus.files["val_bytes"] == used
    # Whole files, except possibly one cut at a line end.
    partial = [d for d in docs if d not in texts.values()]
    assert len(partial) <= 1
    assert all(d.endswith("\n") and any(t.startswith(d) for t in texts.values()) for d in partial)


def test_max_bytes_reads_only_the_head_of_a_big_file(tmp_path: Path) -> None:
    text = "".join(_text(i) for i in range(6))
    path = tmp_path / "big.txt"
    path.write_text(text)
    cap = len(text.encode()) // 2
    corpus = prepare_corpus(path, tmp_path / "cache", vocab_size=VOCAB, max_bytes=cap)
    used = "".join(_docs(corpus, corpus.train) + _docs(corpus, corpus.val))
    assert text.startswith(used) and used.endswith("\n")
    assert cap - len(max(text.splitlines(), key=len)) - 1 <= len(used.encode()) <= cap
    # A cap inside a two-byte character keeps the characters before it, not an error.
    (tmp_path / "e.txt").write_text("é" * 1000)
    assert data._read_text(tmp_path / "e.txt", 1001) == ("é" * 500, True)
    assert data._read_text(tmp_path / "e.txt", 2000) == ("é" * 1000, False)


def test_glob_takes_only_matching_files(corpus_dir: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, texts = corpus_dir
    corpus = prepare_corpus(str(root / "**" / "mod0*.py"), tmp_path / "cache", vocab_size=VOCAB)
    expected = [t for p, t in texts.items() if Path(p).name.startswith("mod0")]
    assert sorted(_docs(corpus, corpus.train) + _docs(corpus, corpus.val)) == sorted(expected)
    assert corpus.files["kind"] == "glob"


def test_stdlib_files_skip_third_party_and_need_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "lib"
    for rel in [
        "os.py",
        "test/test_os.py",
        "site-packages/pip/x.py",
        "dist-packages/y.py",
        "__pycache__/z.py",
    ]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / "README").write_text("not python\n")
    monkeypatch.setattr(data, "stdlib_root", lambda: root)
    assert data.stdlib_files() == [root / "os.py", root / "test" / "test_os.py"]

    for rel in ["os.py", "test/test_os.py"]:
        (root / rel).unlink()
    (root / "os.pyc").write_bytes(b"\0compiled")
    with pytest.raises(PmakitError, match="ships without .py sources.*--corpus") as err:
        prepare_corpus("stdlib", tmp_path / "cache")
    assert "\n" not in str(err.value)


def test_torch_sources_are_ordered_by_package_path_and_digested(tmp_path: Path) -> None:
    files = data.torch_files()
    root = Path(torch.__file__).parent
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and "version.py" not in rel and "nn/modules/linear.py" in rel
    # The digest names the text, not where it lies: a copy elsewhere digests the same; one changed byte does not.
    few = files[:3]
    copy = tmp_path / "copy"
    for f in few:
        (copy / f.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
        (copy / f.relative_to(root)).write_bytes(f.read_bytes())
    moved = [copy / f.relative_to(root) for f in few]
    assert data.source_digest(few, root) == data.source_digest(moved, copy)
    moved[0].write_bytes(moved[0].read_bytes() + b" ")
    assert data.source_digest(few, root) != data.source_digest(moved, copy)


@pytest.mark.parametrize("source", [None, "stdlib"])
def test_builtin_corpus_slice(tmp_path: Path, source: str | None) -> None:
    corpus = prepare_corpus(source, tmp_path / "cache", vocab_size=512, max_bytes=200_000)
    f = corpus.files
    assert f["kind"] == ("torch-src" if source is None else "stdlib") and f["split"] == "by-file"
    assert len(f["source_digest"]) == 64
    assert f["train_files"] >= 2 and f["val_files"] >= 1
    assert 100_000 < f["train_bytes"] + f["val_bytes"] <= 200_000
    assert corpus.vocab_size == 512 and int(corpus.train.max()) < 512
    meta = json.loads((Path(f["cache"]) / "meta.json").read_text())
    for name, doc in zip(meta["val_paths"], _docs(corpus, corpus.val)):
        assert name.endswith(".py") and (source is None or "site-packages" not in name)
        assert Path(name).read_text(encoding="utf-8-sig").startswith(doc)


def test_pretokenized_npy_bin_and_nanogpt_pair(tmp_path: Path) -> None:
    ids = (np.arange(1000) * 7919 % 300).astype(np.int64)
    np.save(tmp_path / "ids.npy", ids)
    ids.astype(np.uint16).tofile(tmp_path / "ids.bin")
    for name in ("ids.npy", "ids.bin"):
        corpus = prepare_corpus(tmp_path / name, tmp_path / "cache", val_fraction=0.05)
        assert corpus.train.dtype == np.uint16
        np.testing.assert_array_equal(corpus.train, ids[:950])
        np.testing.assert_array_equal(corpus.val, ids[950:])
        assert corpus.vocab_size == 300 and corpus.tokenizer_dir is None and corpus.val_bytes is None
        assert (corpus.files["kind"], corpus.files["split"]) == ("tokens", "tail")
    capped = prepare_corpus(tmp_path / "ids.bin", tmp_path / "cache", max_bytes=400, val_fraction=0.1)
    np.testing.assert_array_equal(np.concatenate([capped.train, capped.val]), ids[:200])

    nano = tmp_path / "nano"
    nano.mkdir()
    ids[:800].astype(np.uint16).tofile(nano / "train.bin")
    ids[800:].astype(np.uint16).tofile(nano / "val.bin")
    corpus = prepare_corpus(nano, tmp_path / "cache")
    np.testing.assert_array_equal(corpus.val, ids[800:])
    assert corpus.files["split"] == "given"


# -- user mistakes ---------------------------------------------------------------------------------------------------


def _write(tmp_path: Path, case: str) -> str:
    if case == "missing":
        return str(tmp_path / "nope.txt")
    if case == "empty-dir":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.txt").write_text("")
        return str(tmp_path / "empty")
    if case == "only-binary":
        (tmp_path / "bins").mkdir()
        (tmp_path / "bins" / "a.dat").write_bytes(b"\0\1\2" * 100)
        return str(tmp_path / "bins")
    if case == "glob":
        return str(tmp_path / "*.nothing")
    if case == "binary-file":
        (tmp_path / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0{}" + bytes(100))
        return str(tmp_path / "model.safetensors")
    if case == "vocab-too-large":
        (tmp_path / "small.txt").write_text(_text(0))
        return str(tmp_path / "small.txt")
    if case == "cache-is-a-file":
        (tmp_path / "a.txt").write_text(_text(0))
        (tmp_path / "cache").write_text("")
        return str(tmp_path / "a.txt")
    if case == "odd-bin":
        (tmp_path / "ids.bin").write_bytes(b"\1\0\2")
        return str(tmp_path / "ids.bin")
    if case == "float-npy":
        np.save(tmp_path / "ids.npy", np.ones(10))
        return str(tmp_path / "ids.npy")
    raise ValueError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "corpus not found: .*nope.txt"),
        ("empty-dir", "has no text: 1 file"),
        ("only-binary", "has no text: 1 file.*binary"),
        ("glob", "matches no files"),
        ("binary-file", "is not UTF-8 text"),
        ("vocab-too-large", "vocab_size 4096 is too large for this corpus.*at most"),
        ("cache-is-a-file", "cannot create the corpus cache directory"),
        ("odd-bin", "uint16 token ids"),
        ("float-npy", "1-D integer array"),
    ],
)
def test_user_mistakes_are_one_line_errors(tmp_path: Path, case: str, message: str) -> None:
    source = _write(tmp_path, case)
    with pytest.raises(PmakitError, match=message) as err:
        prepare_corpus(source, tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache").is_dir() or not list((tmp_path / "cache").iterdir())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"vocab_size": 200}, "vocab_size must be more than 257"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"val_fraction": 1.0}, "val_fraction"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"seed": -1}, "seed"),
    ],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    (tmp_path / "a.txt").write_text(_text(0))
    with pytest.raises(PmakitError, match=message):
        prepare_corpus(tmp_path / "a.txt", tmp_path / "cache", **options)


# -- pieces ----------------------------------------------------------------------------------------------------------


def test_encoding_in_pieces_equals_encoding_the_whole(tmp_path: Path) -> None:
    source = (data.stdlib_root() / "argparse.py").read_text(encoding="utf-8")
    tok = data.train_tokenizer([source], 400)
    for text in (source, source.replace("\n", "\r\n").replace("    ", "\t \u3000")):
        pieces = list(data._pieces(text, 2000))
        assert "".join(pieces) == text and len(pieces) > 10
        assert all(len(p) <= 2000 for p in pieces)
        whole = tok.encode(text).ids
        assert [i for p in pieces for i in tok.encode(p).ids] == whole
        assert data.encode_docs(tok, [text], np.uint16).tolist() == [*whole, 0]
    hard = list(data._pieces("a" * 2500, 1000))
    assert [len(p) for p in hard] == [1000, 1000, 500]


# -- batches ---------------------------------------------------------------------------------------------------------


def test_get_batch_windows_are_shifted_and_in_range() -> None:
    tokens = np.arange(500, dtype=np.uint16)  # token i at position i: a window shows where it came from
    for step in range(50):
        x, y = get_batch(tokens, step, batch_size=8, seq_len=16, seed=3)
        assert x.dtype == torch.int64 and y.dtype == torch.int64 and x.shape == y.shape == (8, 16)
        assert torch.equal(y, x + 1)
        assert torch.equal(x - x[:, :1], torch.arange(16).expand(8, 16))  # contiguous windows
        assert int(x.min()) >= 0 and int(y.max()) <= 499


def test_get_batch_depends_only_on_seed_and_step() -> None:
    tokens = np.arange(10_000, dtype=np.uint16)

    def batches(steps: range | list[int], seed: int = 0) -> dict[int, torch.Tensor]:
        return {s: get_batch(tokens, s, batch_size=4, seq_len=32, seed=seed)[0] for s in steps}

    original = batches(range(20))
    np.random.seed(123)  # global RNG state must not matter
    torch.manual_seed(123)
    resumed = batches(list(range(19, 9, -1)))  # a run resumed (or forked) at step 10, asked in any order
    assert all(torch.equal(resumed[s], original[s]) for s in resumed)
    assert not torch.equal(original[0], original[1])
    assert not torch.equal(batches([0], seed=1)[0], original[0])


def test_get_batch_too_few_tokens() -> None:
    with pytest.raises(PmakitError, match="fewer than one window"):
        get_batch(np.arange(16, dtype=np.uint16), 0, batch_size=2, seq_len=16, seed=0)


def test_val_batches_are_fixed_non_overlapping_and_spread() -> None:
    val = np.arange(1000, dtype=np.uint16)
    full = val_batches(val, batch_size=4, seq_len=10, max_batches=100)
    assert len(full) == 24  # 99 windows of 10 targets -> 24 full batches of 4
    targets = torch.cat([y for _, y in full]).flatten()
    assert len(set(targets.tolist())) == len(targets) == 960  # each token a target at most once
    assert all(torch.equal(y, x + 1) for x, y in full)
    again = val_batches(val, batch_size=4, seq_len=10, max_batches=100)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(full, again))

    few = val_batches(val, batch_size=4, seq_len=10, max_batches=2)
    starts = sorted(int(x[0]) for b in few for x in b[0])
    assert len(starts) == 8 and starts[0] == 0 and starts[-1] > 800  # spread over the whole set
    assert all(b - a >= 10 for a, b in zip(starts, starts[1:]))


def test_val_batches_too_small_is_a_clear_error() -> None:
    with pytest.raises(PmakitError, match="too few for one batch of 4 x 10"):
        val_batches(np.arange(30, dtype=np.uint16), batch_size=4, seq_len=10, max_batches=5)
