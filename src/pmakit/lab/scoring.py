"""How a study scores weights: one model of the study's shape, the held-out batches of each split, and the
snapshots of a run read once each.

One copy for every study of ``pmakit experiment`` (the PMA grid, the scaling and sweep studies, the spike and init
studies): a state is swapped into the model, scored on a split's batches, and swapped out.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from pmakit.errors import PmakitError
from pmakit.evaluate import EvalResult, batch_losses, result_of
from pmakit.runs import snapshots_dir
from pmakit.units import format_tokens


class SplitScorer:
    """Scores states on named held-out splits (``selection``, ``test``, ...) with one model swapped in and out."""

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Mapping[str, Sequence[Any]],
        bytes_per_token: float | None,
        *,
        compiled: bool = False,
    ) -> None:
        self.model = model
        self.batches = batches
        self.bytes_per_token = bytes_per_token
        self.compiled = compiled

    @classmethod
    def build(
        cls,
        model: Any,
        corpus: Any,
        batches: Mapping[str, Sequence[Any]],
        *,
        seed: int = 0,
        compiled: bool = False,
    ) -> SplitScorer:
        """A scorer with a fresh model of config ``model`` over ``corpus``'s vocabulary (its weights are swapped)."""
        from pmakit.train.model import build_model

        built = build_model(model, corpus.vocab_size, seed=seed)
        return cls(built, batches, corpus.bytes_per_token, compiled=compiled)

    def losses(self, state: Mapping[str, torch.Tensor], split: str) -> Generator[float, None, None]:
        """``state``'s loss on each batch of ``split`` in turn (a search may stop part way)."""
        from pmakit.train.loop import swapped

        with swapped(self.model, state):
            yield from batch_losses(self.model, self.batches[split], compiled=self.compiled)

    def __call__(self, state: Mapping[str, torch.Tensor], split: str) -> EvalResult:
        return result_of(list(self.losses(state, split)), self.bytes_per_token)


class SnapshotStates:
    """The snapshots of one run by token count, each read once (until ``clear``), merged by a weighting."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self._found: dict[int, Path] | None = None
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def read(self, tokens: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """The states at ``tokens``, in order; a missing snapshot is an error naming the run and the tokens."""
        from pmakit.formats import read_state
        from pmakit.snapshot import discover

        missing = [t for t in tokens if t not in self._cache]
        if missing and self._found is None:
            self._found = {s.tokens: s.path for s in discover(snapshots_dir(self.run))}
        for t in missing:
            if t not in (self._found or {}):
                raise PmakitError(f"{self.run}: no snapshot at {format_tokens(t)} tokens")
            self._cache[t] = read_state((self._found or {})[t])
        return [self._cache[t] for t in tokens]

    def merged(self, tokens: Sequence[int], method: str = "sma") -> dict[str, torch.Tensor]:
        """The ``method`` merge of the snapshots at ``tokens`` (one snapshot: its own state)."""
        from pmakit.merge import average_states
        from pmakit.weights import get_weights

        states = self.read(tokens)
        return states[0] if len(states) == 1 else average_states(states, get_weights(method, len(states)))

    def clear(self) -> None:
        """Forget the states read so far (the next windows are mostly other snapshots)."""
        self._cache.clear()
