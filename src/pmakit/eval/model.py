"""A recipe's model, ready to evaluate: merged in memory when it fits, else through a temporary folder.

In memory: the chosen snapshots are read one at a time and folded by ``average_states`` (the engine's arithmetic,
``dtype="same"``: bit for bit what ``pmakit merge`` writes), and the result is loaded into the model built from the
newest snapshot's ``config.json``. No model file is written. When the sums and the model would not fit in half the
free memory, the streaming engine (``pmakit.merge.merge``, bounded memory) writes the merge to a temporary folder
beside the run, the model is loaded from it, and the folder is removed. ``Built.how`` says which happened.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError, first_line
from pmakit.merge.recipe import Resolved
from pmakit.snapshot import Snapshot

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".pt", ".bin", ".pth", ".distcp")
VIA_DISK_ENV = "PMAKIT_EVAL_VIA_DISK"
"""Set to 1 to merge through a temporary folder even when the model fits in memory (what it costs)."""


@dataclass
class Built:
    """An HF causal LM in eval mode and its tokenizer."""

    model: Any
    tokenizer: Any
    how: str
    """``in memory``, ``via a temporary folder`` (removed), or ``loaded`` (a model folder as it is)."""
    seconds: float
    """Time to merge and load."""


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.suffix in WEIGHT_SUFFIXES and f.is_file())


def fits_in_memory(snapshot: Snapshot) -> bool:
    """Whether the fp32 sums, one state being read and the model fit in half the free memory."""
    need = 3 * 2 * weight_bytes(snapshot.path)  # fp32 of a bf16 file is twice its bytes; three copies
    try:
        import psutil

        available = int(psutil.virtual_memory().available)
    except ImportError:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need <= available // 2


def build(resolved: Resolved, *, via_disk: bool | None = None) -> Built:
    """The merged model of ``resolved`` (one raw snapshot is read as it is), with the newest snapshot's tokenizer."""
    t0 = time.perf_counter()
    newest = resolved.snapshots[-1]
    if via_disk is None:
        via_disk = os.environ.get(VIA_DISK_ENV) == "1" or not fits_in_memory(newest)
    if via_disk:
        with _merged_folder(resolved) as folder:
            model = load_folder(folder, config_dir=newest.path)
        how = "via a temporary folder (removed)"
    else:
        model = model_from_state(newest.path, _averaged(resolved))
        how = "in memory"
    return Built(model, load_tokenizer(newest.path), how, time.perf_counter() - t0)


def _averaged(resolved: Resolved) -> dict[str, torch.Tensor]:
    from pmakit.formats import read_state
    from pmakit.merge import average_states

    states = (read_state(s.path) for s in resolved.snapshots)  # one snapshot in memory at a time
    return average_states(states, list(resolved.weights), dtype="same")


@contextmanager
def _merged_folder(resolved: Resolved) -> Iterator[Path]:
    """The merge written by the streaming engine into a temporary folder beside the run, removed after."""
    from pmakit.merge import merge

    parent = resolved.snapshots[-1].path.parent
    scratch = Path(
        tempfile.mkdtemp(prefix=".pmakit-eval-", dir=parent if os.access(parent, os.W_OK) else None)
    )
    try:
        merge(list(resolved.snapshots), list(resolved.weights), scratch / "model", fsync=False)
        yield scratch / "model"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _config_of(path: Path) -> Any:
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise PmakitError(
            f"{path} has no config.json: lm-eval needs a Hugging Face causal LM (merge it with `pmakit merge` "
            "into a model folder with its config, or evaluate a layout that carries one)"
        )
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # transformers raises many kinds for a bad or unknown config
        raise PmakitError(f"{path}/config.json: cannot build a model from it ({first_line(exc)})") from None


def model_from_state(config_dir: Path, state: dict[str, torch.Tensor]) -> Any:
    """The causal LM of ``config_dir/config.json`` with ``state`` loaded (tied weights may be absent)."""
    from transformers import AutoModelForCausalLM

    config = _config_of(config_dir)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=_dtype_of(state))
    except Exception as exc:
        raise PmakitError(f"{config_dir}: cannot build a causal LM ({first_line(exc)})") from None
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    tied |= {k for k in result.missing_keys if k.endswith("lm_head.weight") and config.tie_word_embeddings}
    missing = sorted(set(result.missing_keys) - tied)
    if missing:
        raise PmakitError(
            f"{config_dir}: the weights lack {len(missing)} tensors of the model, e.g. {missing[0]}"
        )
    if result.unexpected_keys:
        log.info("%s: %d tensors the model does not use (e.g. %s) left out", config_dir,
                 len(result.unexpected_keys), result.unexpected_keys[0])  # fmt: skip
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def _dtype_of(state: dict[str, torch.Tensor]) -> torch.dtype:
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    return max(set(floats), key=floats.count) if floats else torch.float32


def load_folder(folder: Path, *, config_dir: Path | None = None) -> Any:
    """A model folder (or snapshot) as it is, read by pmakit's readers (any format it merges)."""
    from pmakit.formats import read_state

    try:
        state = read_state(folder)
    except PmakitError:
        raise
    except Exception as exc:
        raise PmakitError(f"{folder}: cannot read its weights ({first_line(exc)})") from None
    config = folder if (folder / "config.json").is_file() or config_dir is None else config_dir
    return model_from_state(config, state)


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise PmakitError(f"{path}: no tokenizer to evaluate with ({first_line(exc)})") from None


def build_path(path: Path) -> Built:
    """A model folder or one snapshot, evaluated as it is."""
    t0 = time.perf_counter()
    model = load_folder(path)
    return Built(model, load_tokenizer(path), "loaded", time.perf_counter() - t0)


def check_config(path: Path) -> None:
    """That a model can be built from ``path``'s config (before anything is evaluated or written)."""
    _config_of(Path(path))
