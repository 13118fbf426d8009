"""A merge recipe: one grammar for "which snapshots of a run, with which weights", shared by every command.

    latest                  the newest snapshot alone (= back:0)
    back:K                  the raw snapshot K before the newest (the noise band's members)
    sma:N  wma:N            the last N snapshots, uniform / linearly rising weights
    ema:ALPHA[:N]           EMA with factor ALPHA over the last N (default 10); ema-normalized:ALPHA[:N] likewise
    wsm:SHAPE:N             the WSM weights of a decay SHAPE (linear, cosine, 1sqrt; 1-sqrt is accepted) over N
    PATH                    a ``pmakit tune`` output (its folder or its tune.json): the tuned merge's snapshots and
                            weights, found again in the run by their token counts

Any method recipe takes trailing ``:every=V`` (spacing in tokens, as ``pmakit merge --every``) and ``:until=T``
(the window ends at the newest snapshot at or before T tokens). The text has no commas, so it fits lm-eval's
``model_args`` string (``run=RUN,merge=sma:10``). Parsing is pure; ``resolve`` maps a recipe onto a run's snapshots
through the same selection (``pmakit.selection``) and weighting registry (``pmakit.weights``) as ``pmakit merge``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pmakit.errors import PmakitError
from pmakit.selection import DEFAULT_LAST, select_snapshots
from pmakit.snapshot import Snapshot
from pmakit.units import parse_tokens
from pmakit.weights import DECAY_SHAPES, get_weights

SHAPE_ALIASES = {"1-sqrt": "1sqrt"}
GRAMMAR = "latest, back:K, sma:N, wma:N, ema:ALPHA[:N], wsm:SHAPE:N (+ :every=V :until=T), or a tune output"


@dataclass(frozen=True)
class Recipe:
    """A parsed recipe (see the module docstring)."""

    text: str
    """As the user wrote it (the row key's ``recipe``)."""
    method: str
    """``latest``/``back`` (one raw snapshot), a weighting name (``sma``, ``wsm-cosine``...), or ``tune``."""
    n: int = 1
    """Snapshots merged (for ``back``: the snapshot's distance from the newest is ``back``)."""
    alpha: float = 0.2
    back: int = 0
    every: int | None = None
    until: int | None = None
    tune_file: Path | None = None

    @property
    def raw(self) -> bool:
        """One snapshot as it was saved (no averaging)."""
        return self.method in ("latest", "back")


@dataclass(frozen=True)
class Resolved:
    """A recipe applied to a run: the snapshots (oldest first) and their weights."""

    recipe: Recipe
    snapshots: tuple[Snapshot, ...]
    weights: tuple[float, ...]
    key: dict[str, Any] = field(hash=False, compare=False)
    """Window (first and last tokens), V, N and the weights' hash: what a result row is keyed by."""


def parse_recipe(text: str) -> Recipe:
    """A recipe from its text; a malformed one is one ``PmakitError`` naming the grammar."""
    text = str(text).strip()
    head, *rest = text.split(":")
    opts = {k: v for k, _, v in (p.partition("=") for p in rest if "=" in p)}
    args = [p for p in rest if "=" not in p]
    try:
        recipe = _parse_method(text, head, args)
    except (ValueError, IndexError):
        raise PmakitError(f"cannot read the recipe {text!r}; recipes are: {GRAMMAR}") from None
    if recipe is None:
        return _tune_recipe(text)
    unknown = sorted(set(opts) - {"every", "until"})
    if unknown:
        raise PmakitError(f"recipe {text!r}: unknown option {unknown[0]!r} (known: every=V, until=T)")
    every = parse_tokens(opts["every"]) if "every" in opts else None
    until = parse_tokens(opts["until"]) if "until" in opts else None
    if recipe.n < 1 or recipe.back < 0 or not 0 < recipe.alpha <= 1:
        raise PmakitError(f"recipe {text!r}: N must be >= 1, K >= 0 and ALPHA in (0, 1]")
    return Recipe(text, recipe.method, recipe.n, recipe.alpha, recipe.back, every, until)


def _parse_method(text: str, head: str, args: list[str]) -> Recipe | None:
    """The method part; None when ``text`` is not a method recipe (then it may be a tune output path)."""
    if head == "latest" and not args:
        return Recipe(text, "latest")
    if head == "back" and len(args) == 1:
        return Recipe(text, "back", back=int(args[0]))
    if head in ("sma", "wma") and len(args) == 1:
        return Recipe(text, head, n=int(args[0]))
    if head in ("ema", "ema-normalized") and len(args) in (1, 2):
        n = int(args[1]) if len(args) == 2 else DEFAULT_LAST
        return Recipe(text, head, n=n, alpha=float(args[0]))
    if head == "wsm" and len(args) == 2:
        shape = SHAPE_ALIASES.get(args[0], args[0])
        if shape not in DECAY_SHAPES:
            raise PmakitError(
                f"recipe {text!r}: unknown decay shape {args[0]!r}; known: {', '.join(DECAY_SHAPES)}"
            )
        return Recipe(text, f"wsm-{shape}", n=int(args[1]))
    if head in ("back", "sma", "wma", "ema", "ema-normalized", "wsm"):
        raise ValueError(text)
    return None


def _tune_recipe(text: str) -> Recipe:
    path = Path(text).expanduser()
    found = path / "tune.json" if path.is_dir() else path
    if not found.is_file():
        raise PmakitError(f"cannot read the recipe {text!r}; recipes are: {GRAMMAR}")
    return Recipe(text, "tune", tune_file=found)


def resolve(recipe: Recipe, snapshots: Sequence[Snapshot]) -> Resolved:
    """The recipe's snapshots (oldest first) and weights among ``snapshots`` (a run's, oldest first)."""
    if recipe.method == "tune":
        chosen, weights = _tuned(recipe, snapshots)
    elif recipe.raw:
        pool = [s for s in snapshots if recipe.until is None or s.tokens <= recipe.until]
        if recipe.back >= len(pool):
            raise PmakitError(
                f"recipe {recipe.text!r} needs {recipe.back + 1} snapshots; the run has {len(pool)}"
            )
        chosen, weights = [pool[-1 - recipe.back]], [1.0]
    else:
        pool = [s for s in snapshots if recipe.until is None or s.tokens <= recipe.until]
        if recipe.every is None and len(pool) < recipe.n:
            raise PmakitError(f"recipe {recipe.text!r} needs {recipe.n} snapshots; the run has {len(pool)}")
        chosen = select_snapshots(snapshots, last=recipe.n, every=recipe.every, until=recipe.until)
        weights = get_weights(recipe.method, len(chosen), alpha=recipe.alpha)
    return Resolved(recipe, tuple(chosen), tuple(weights), _key(recipe, chosen, weights))


def _tuned(recipe: Recipe, snapshots: Sequence[Snapshot]) -> tuple[list[Snapshot], list[float]]:
    """The tuned merge of a ``pmakit tune`` record, found in ``snapshots`` by token count."""
    assert recipe.tune_file is not None
    try:
        record = json.loads(recipe.tune_file.read_text())
        merge = record["models"]["tuned"]["merge"]
        tokens, weights = [int(t) for t in merge["tokens"]], [float(w) for w in merge["weights"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise PmakitError(f"{recipe.tune_file}: not a pmakit tune record (no models.tuned.merge)") from None
    by_tokens = {s.tokens: s for s in snapshots}
    missing = [t for t in tokens if t not in by_tokens]
    if missing or len(tokens) != len(weights) or not tokens:
        raise PmakitError(
            f"{recipe.tune_file}: the tuned merge's snapshot at {missing[0] if missing else '?'} tokens is not in "
            "this run"
        )
    return [by_tokens[t] for t in tokens], get_weights("custom", len(weights), custom=weights)


def _key(recipe: Recipe, chosen: Sequence[Snapshot], weights: Sequence[float]) -> dict[str, Any]:
    gaps = [b.tokens - a.tokens for a, b in zip(chosen, chosen[1:])]
    digest = hashlib.sha256(
        json.dumps([[s.tokens for s in chosen], [round(w, 9) for w in weights]]).encode()
    ).hexdigest()[:16]
    return {
        "recipe": recipe.text,
        "window": [chosen[0].tokens, chosen[-1].tokens],
        "v": min(gaps) if gaps else None,
        "n": len(chosen),
        "weights_sha": digest,
    }
