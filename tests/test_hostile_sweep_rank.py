"""`pmakit sweep-rank` against hostile runs, through the real CLI on two tiny GPT-2 runs built here: NaN weights,
tokenizers that differ at the same vocabulary size, a symlink loop, a bootstrap over the limits table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import run_cli
from pmakit.formats.safetensors_io import save_file
from pmakit.snapshot import write_metadata

VOCAB = 64


def _tokenizer(words: list[str]) -> str:
    """A word-level tokenizer.json of ``VOCAB`` ids (the same size whatever ``words`` are)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {w: i for i, w in enumerate(words[:VOCAB])}
    return Tokenizer(WordLevel(vocab, unk_token=words[0])).to_str()


def _run(root: Path, name: str, seed: int, tokenizer: str | None) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=1, n_head=2, bos_token_id=0,
                        eos_token_id=0)  # fmt: skip
    for k in (1, 2):
        torch.manual_seed(seed * 10 + k)
        model = GPT2LMHeadModel(config)
        snap = root / name / f"step-{10 * k:06d}"
        snap.mkdir(parents=True)
        tensors = {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}
        tensors.pop("lm_head.weight")  # tied to the embedding
        save_file(tensors, snap / "model.safetensors")
        config.save_pretrained(snap)
        if tokenizer is not None:
            (snap / "tokenizer.json").write_text(tokenizer)
        write_metadata(snap, step=10 * k, tokens=1000 * k, lr=1e-3, loss=3.0)
    return root / name


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two runs of one tokenizer, and a token file to score them on."""
    words = [f"w{i}" for i in range(VOCAB)]
    a = _run(tmp_path, "a", 0, _tokenizer(words))
    b = _run(tmp_path, "b", 1, _tokenizer(words))
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.random.default_rng(0).integers(0, VOCAB, 4000).astype(np.int64))
    return a, b, tokens


def rank(*args: object) -> tuple[int, list[str], str]:
    proc = run_cli("sweep-rank", *map(str, args), "--batches", "4", "--bootstrap", "50", timeout=600)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, [x for x in proc.stderr.splitlines() if x.startswith("Error:")], proc.stdout


def test_two_runs_of_one_tokenizer_are_ranked(runs: tuple[Path, Path, Path]) -> None:
    a, b, tokens = runs
    code, errors, out = rank(a, b, "--eval", tokens)
    assert code == 0 and not errors and "nan" not in out and "+0.0000 ± 0.0000" in out


def test_a_run_with_nan_weights_is_one_error_never_ranked(runs: tuple[Path, Path, Path]) -> None:
    a, b, tokens = runs
    from safetensors.torch import load_file

    path = b / "step-000020" / "model.safetensors"
    tensors = {k: t.clone() for k, t in load_file(path).items()}  # no mmap left on the file rewritten
    path.unlink()
    tensors["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    save_file(tensors, path)
    code, errors, out = rank(a, b, "--eval", tokens)
    assert code == 1 and len(errors) == 1 and "nan" not in out.lower()
    assert "transformer.h.0.mlp.c_fc.weight" in errors[0] and "step-000020" in errors[0], errors


def test_tokenizers_that_differ_at_the_same_vocabulary_size_are_refused(
    runs: tuple[Path, Path, Path],
) -> None:
    a, b, tokens = runs
    other = _tokenizer([f"w{i}" for i in reversed(range(VOCAB))])  # same size, other ids
    for snap in b.iterdir():
        (snap / "tokenizer.json").write_text(other)
    code, errors, _ = rank(a, b, "--eval", tokens)
    assert code == 1 and len(errors) == 1 and "different tokenizers" in errors[0], errors
    for snap in b.iterdir():
        (snap / "tokenizer.json").unlink()
    code, errors, _ = rank(a, b, "--eval", tokens)
    assert code == 1 and len(errors) == 1 and "has no tokenizer files" in errors[0], errors


def test_a_run_that_is_a_symlink_loop_is_one_line(runs: tuple[Path, Path, Path], tmp_path: Path) -> None:
    a, _, tokens = runs
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    code, errors, _ = rank(a, loop, "--eval", tokens)
    assert code == 1 and len(errors) == 1 and str(loop) in errors[0], errors


def test_a_bootstrap_over_the_limit_is_refused_before_any_work(runs: tuple[Path, Path, Path]) -> None:
    a, b, tokens = runs
    proc = run_cli("sweep-rank", a, b, "--eval", tokens, "--bootstrap", "200000000", timeout=600)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "bootstrap-resamples = 100,000" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and not proc.stdout
