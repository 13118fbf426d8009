"""``plan_increment``: a previous SMA/EMA merge (with its fp32 sums, ``--keep-fp32``) plus the snapshots that entered
and left the window become the merge of the new window."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pmakit import limits
from pmakit.errors import PmakitError
from pmakit.formats import is_float
from pmakit.layouts import open_weights
from pmakit.layouts.kinds import DEFAULT_BUFFERS, Kind, TensorPolicy
from pmakit.merge.output import FP32_DIR, sha256_file
from pmakit.snapshot import MERGE_MANIFEST, Snapshot
from pmakit.weights import WEIGHTINGS, uses_alpha

log = logging.getLogger(__name__)


def incremental_methods() -> tuple[str, ...]:
    """Weightings whose weights, when the window moves, keep their ratios on the snapshots that stay
    (``Weighting.incremental``)."""
    return tuple(w.name for w in WEIGHTINGS.values() if w.incremental)


@dataclass(frozen=True)
class Increment:
    """How to get the merge of a new window from a previous merge: ``sum(weights[i] * terms[i])``."""

    terms: list[Snapshot]
    """The previous merge's fp32 sums first, then the snapshots to add or subtract, the window's newest last."""
    weights: list[float]
    """One per term; the first is the scale applied to the previous sums."""
    previous: Path
    """The previous merge directory."""

    @property
    def reads(self) -> int:
        return sum(1 for w in self.weights if w != 0)

    def record(self, given: Path) -> dict[str, Any]:
        """What the merge manifest says of the update (``given``: the path as the user named it)."""
        return {"from": str(given.resolve()), "scale": self.weights[0], "reads": self.reads}


def _same_files(snapshot: Path, recorded: Any) -> bool:
    """The snapshot's header checksums still match what the previous merge recorded."""
    if not isinstance(recorded, list):
        return False
    with open_weights(snapshot) as reader:
        return [f.header_sha256 for f in reader.files] == [r.get("header_sha256") for r in recorded]


def _verify_previous(previous: Path, state: Path, manifest: dict[str, Any]) -> None:
    """The sums an update builds on still have the sha256 their merge recorded: an edited or damaged previous merge
    would otherwise pass its error on to every later merge (one read of the sums, which the update reads anyway)."""
    output = manifest.get("output")
    recorded = (output if isinstance(output, dict) else {}).get(
        "fp32_files" if state != previous else "files"
    )
    if not isinstance(recorded, list) or not recorded:
        raise PmakitError(f"{previous}: its manifest records no checksums of its sums; run a full merge")
    for entry in recorded:
        try:
            file, sha = state / str(entry["name"]), str(entry["sha256"])
        except (KeyError, TypeError):
            raise PmakitError(f"{previous}: unreadable file record {entry!r} in its manifest") from None
        if "/" in str(entry["name"]) or not file.is_file() or sha256_file(file) != sha:
            raise PmakitError(
                f"{file}: does not match the sha256 its merge recorded (edited or damaged); run a full merge"
            )


def _scale(old: dict[str, float], new: dict[str, float]) -> float:
    """The factor on the previous merge that makes the most shared snapshots' weights right as they are."""
    ratios = [new[p] / old[p] for p in new.keys() & old.keys() if old[p] != 0]
    if not ratios:
        return 0.0
    votes: dict[float, list[float]] = {}
    for r in ratios:
        votes.setdefault(float(f"{r:.10g}"), []).append(r)
    return max(votes.values(), key=len)[0]


def plan_increment(
    previous: str | os.PathLike[str],
    window: Sequence[Snapshot],
    weights: Sequence[float],
    *,
    method: str,
    alpha: float,
    buffers: str = DEFAULT_BUFFERS,
) -> Increment:
    """Terms that turn the merge in ``previous`` into the merge of ``window`` with ``weights``.

    With the previous weights w and the new ones w', the new merge is c * previous + sum_p (w'_p - c * w_p) * p
    over the snapshots p of both windows, c chosen so that the snapshots in both need no term: for SMA and EMA a
    moved window then reads only the added and the dropped snapshots (and, for EMA, the new oldest one, which takes
    the seed's weight). The sums are fp32: a previous merge written in bf16 or fp16 must have kept its fp32 sums
    (``--keep-fp32``), or every update would add that rounding for good.
    """
    previous = Path(previous)
    manifest, prior = _read_previous(previous, method, alpha)
    _check_buffers(previous, manifest, buffers)
    state = _fp32_sums(previous)
    _verify_previous(previous, state, manifest)
    new = {str(s.path.resolve()): w for s, w in zip(window, weights)}
    old = {p: w for p, (w, _) in prior.items()}
    if not new.keys() & old.keys():
        raise PmakitError(
            f"the new window shares no snapshot with {previous}: nothing to reuse, run a full merge"
        )
    scale = _scale(old, new)
    terms = _terms(previous, window, prior, new, old, scale)
    if len(terms) + 1 > len(window):
        log.warning(
            "this update reads %d inputs, a full merge of the window %d: the window moved too far to save reads",
            len(terms) + 1,
            len(window),
        )
    sums = Snapshot(state, tokens=int(manifest.get("tokens", 0)), source="merge")
    return Increment([sums, *(s for s, _ in terms)], [scale, *(w for _, w in terms)], previous)


def _check_buffers(previous: Path, manifest: dict[str, Any], buffers: str) -> None:
    """An update is a weighted sum of terms: right for averaged router biases, not for the newest snapshot's, and
    only on top of a merge that averaged them too."""
    if TensorPolicy(buffers).rule_of(Kind.ROUTER_BIAS) != "average":
        raise PmakitError(
            f"--from-previous sums terms, so it cannot take router biases from the newest snapshot (--buffers "
            f"{buffers}); run a full merge"
        )
    done = manifest.get("buffers", "average")  # merges made before the rule existed averaged every float
    if done != buffers:
        raise PmakitError(f"{previous} took router biases by --buffers {done}; run a full merge")


def _read_previous(
    previous: Path, method: str, alpha: float
) -> tuple[dict[str, Any], dict[str, tuple[float, dict[str, Any]]]]:
    """The previous merge's manifest and its inputs by path, checked to be an update ``method`` can make."""
    manifest_file = previous / MERGE_MANIFEST
    try:
        manifest = limits.read_json(manifest_file)
        prior = {str(Path(i["path"])): (float(i["weight"]), i) for i in manifest["inputs"]}
    except (PmakitError, KeyError, TypeError, ValueError) as e:
        raise PmakitError(f"{previous}: not a pmakit merge with a readable {MERGE_MANIFEST} ({e})") from None
    if method not in incremental_methods():
        raise PmakitError(
            f"--from-previous updates {', '.join(incremental_methods())} merges: with {method} the weight of "
            "every snapshot changes when the window moves, so run a full merge"
        )
    if manifest.get("method") != method:
        raise PmakitError(
            f"{previous} is a {manifest.get('method')} merge; --from-previous cannot turn it into {method}"
        )
    if uses_alpha(method) and manifest.get("alpha") != alpha:
        raise PmakitError(f"{previous} used --alpha {manifest.get('alpha')}, not {alpha}; run a full merge")
    return manifest, prior


def _fp32_sums(previous: Path) -> Path:
    """Where the previous merge's fp32 sums are: its ``FP32_DIR``, or itself when it was written in fp32."""
    if (previous / FP32_DIR).is_dir():
        return previous / FP32_DIR
    with open_weights(previous) as reader:
        narrow = sorted(
            {str(i.dtype) for i in reader.tensors.values() if is_float(i.dtype) and i.dtype != torch.float32}
        )
    if narrow:
        raise PmakitError(
            f"{previous} holds {', '.join(narrow).replace('torch.', '')} weights and no fp32 sums ({FP32_DIR}/): "
            "updating it would keep that rounding in every later merge; run the full merge once with "
            "--keep-fp32 (or --dtype fp32)"
        )
    return previous


def _terms(
    previous: Path,
    window: Sequence[Snapshot],
    prior: dict[str, tuple[float, dict[str, Any]]],
    new: dict[str, float],
    old: dict[str, float],
    scale: float,
) -> list[tuple[Snapshot, float]]:
    """The snapshots to add or subtract (weight new - scale * old), oldest first, the window's newest last."""
    biggest = max(abs(w) for w in [*old.values(), *new.values()])
    by_path = {str(s.path.resolve()): s for s in window}
    terms: list[tuple[Snapshot, float]] = []
    for p in sorted(new.keys() | old.keys()):
        d = new.get(p, 0.0) - scale * old.get(p, 0.0)
        if abs(d) <= 1e-12 * biggest:
            continue
        entry = prior[p][1] if p in prior else None
        if p in by_path:
            snap = by_path[p]
        elif not Path(p).is_dir():
            raise PmakitError(
                f"{p} left the window but is gone: an incremental update subtracts it; run a full merge"
            )
        else:
            assert entry is not None  # it left the window, so the previous merge had it
            snap = Snapshot(Path(p), tokens=int(entry["tokens"]), step=entry.get("step"), source="merge")
        if entry is not None and not _same_files(snap.path, entry.get("files")):
            raise PmakitError(
                f"{p} changed since {previous} was merged (its headers differ); run a full merge"
            )
        terms.append((snap, d))
    terms.sort(key=lambda t: t[0].tokens)
    newest = window[-1]
    if not terms or terms[-1][0].path.resolve() != newest.path.resolve():
        terms.append(
            (newest, 0.0)
        )  # read only for its integer tensors and config files, as a full merge would
    return terms
