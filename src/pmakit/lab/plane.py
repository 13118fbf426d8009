"""Why merging works, measured on a run's own snapshots: the loss on a 2-D plane (E12) and the cross terms (E11).

Loss plane (paper finding 10, the SWA pictures of Garipov et al. 2018 / Izmailov et al. 2018). Three weight points
a, b, c span a plane: ``u = (b - a) / |b - a|`` and ``v`` = the part of ``c - a`` orthogonal to ``u``, normalised.
A point at coordinates (x, y) is ``a + x u + y v``; coordinates are Euclidean distances in weight space (the
float parameters flattened into one vector, in float64). The default points are the oldest (a), newest (b) and
middle (c) snapshot of the window, so x runs along the window's drift and y across it. Every snapshot of the window
and the merge are projected onto the plane; their distance from it is reported, because only the three defining
points lie exactly on it.

Cross terms (paper finding 9). With deviations ``d_i = theta_i - ref`` and a quadratic loss of Hessian H, the merge
of k snapshots beats the mean of its members iff ``C < (k-1) D`` with ``C = sum_{i!=j} d_i^T H d_j`` and
``D = sum_i d_i^T H d_i``. The linear (gradient) terms cancel exactly in ``L(mean) - mean_i L(theta_i)``, so the
reference need not be an optimum, and for a quadratic ``C - (k-1) D = 2 k^2 (L(mean) - mean_i L(theta_i))`` for
ANY reference. How C and D split depends on the reference, so two are reported:

- ``merge`` (ref = the SMA mean): then ``sum_i d_i = 0`` and ``C = -D`` identically; the condition reduces to
  ``D > 0`` (positive curvature along the deviations), and the quadratic model predicts the merge's gain over the
  mean member as ``D / (2k)``. Comparing that with the measured gain says how quadratic the loss is at this scale.
- ``end`` (ref = the newest snapshot, the model one would otherwise use; the paper's theta* stand-in): D from
  curvatures at the newest snapshot, and ``C = 2 k^2 gap + (k-1) D``. ``C / ((k-1) D) < 1`` is the paper's
  condition; a negative ratio means "complementary" deviations (negatively correlated in the H metric).

Method: every ``d^T H d`` is a central second difference of losses, ``L(ref + d) + L(ref - d) - 2 L(ref)``, which is
exact for a quadratic and, for a real loss, the curvature averaged over the segment the deviation spans (cubic terms
cancel; the error is fourth order). That is what matters for a finite merge, costs only forward passes (no_grad,
3k evaluations in all), and needs no Hessian-vector products, which at the deviation sizes of a high-LR stable
phase would measure curvature at one point only. Assumption: one H describes the loss over the window's span (the
"end" split mixes curvatures at the newest snapshot with the gap measured at the mean). Every quantity is computed
per held-out batch and reported as mean and standard error over batches.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pmakit.errors import PmakitError
from pmakit.runs import (
    MAIN_RUN,
    atomic_write_json,
    checkpoint_dir,
    read_json_object,
    run_relative,
    snapshots_dir,
    trainer_state,
)

log = logging.getLogger(__name__)

State = Mapping[str, torch.Tensor]
Evaluate = Callable[[State], "Sequence[float] | float | Any"]
"""Loss of a state dict: per-batch losses (preferred: gives standard errors), a float, or an ``EvalResult``."""

PLANE_VERSION = 1


# ---------------------------------------------------------------------------------------------------------------
# Weights as flat vectors


@dataclass(frozen=True)
class Flattener:
    """Maps the float tensors of a state dict to one float64 vector and back."""

    names: tuple[str, ...]
    """Tensor names, in vector order."""
    shapes: tuple[tuple[int, ...], ...]
    """Their shapes."""
    dtypes: tuple[torch.dtype, ...]
    """Their dtypes, restored by ``state``."""

    @classmethod
    def of(cls, state: State, names: Sequence[str] | None = None) -> Flattener:
        """The float tensors of ``state`` (or the given ``names``), sorted by name."""
        keys = sorted(names if names is not None else (k for k, t in state.items() if t.is_floating_point()))
        if not keys:
            raise PmakitError("no floating-point weights to analyse")
        return cls(
            tuple(keys), tuple(tuple(state[k].shape) for k in keys), tuple(state[k].dtype for k in keys)
        )

    @property
    def size(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def flat(self, state: State) -> torch.Tensor:
        missing = [k for k in self.names if k not in state]
        if missing:
            raise PmakitError(f"snapshot lacks tensors {', '.join(missing[:3])}: not the same model")
        bad = [k for k, s in zip(self.names, self.shapes) if tuple(state[k].shape) != s]
        if bad:
            raise PmakitError(f"snapshot has other shapes for {', '.join(bad[:3])}: not the same model")
        return torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in self.names])

    def state(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        out, start = {}, 0
        for name, shape, dtype in zip(self.names, self.shapes, self.dtypes):
            n = math.prod(shape)
            out[name] = vector[start : start + n].reshape(shape).to(dtype)
            start += n
        return out


# ---------------------------------------------------------------------------------------------------------------
# The plane


@dataclass(frozen=True)
class Plane:
    """The plane ``origin + x u + y v`` with orthonormal u, v (float64 vectors)."""

    origin: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor

    def coords(self, theta: torch.Tensor) -> tuple[float, float, float]:
        """(x, y, distance of theta from the plane)."""
        d = theta - self.origin
        x, y = float(d @ self.u), float(d @ self.v)
        residual = d - x * self.u - y * self.v
        return x, y, float(residual.norm())

    def point(self, x: float, y: float) -> torch.Tensor:
        return self.origin + x * self.u + y * self.v


def plane_through(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Plane:
    """The plane through a, b, c: u along b - a, v along the part of c - a orthogonal to u (Gram-Schmidt)."""
    ab = b - a
    if float(ab.norm()) == 0:
        raise PmakitError("the first two plane points are identical weights")
    u = ab / ab.norm()
    ac = c - a
    w = ac - (ac @ u) * u
    # Re-orthogonalise once: in float64 a single pass leaves u.v ~ 1e-16 |c - a|, plenty, but it is cheap.
    w = w - (w @ u) * u
    if float(w.norm()) <= 1e-12 * max(float(ac.norm()), 1e-300):
        raise PmakitError("the three plane points are (nearly) collinear; choose other snapshots")
    return Plane(a, u, w / w.norm())


def grid_axes(
    points: Sequence[tuple[float, float]], grid: int, margin: float
) -> tuple[list[float], list[float]]:
    """``grid`` values per axis covering every point's (x, y), padded by ``margin`` x the larger extent."""
    if grid < 2:
        raise PmakitError(f"the plane grid needs at least 2 points per axis, got {grid}")
    if margin < 0:
        raise PmakitError(f"margin must be >= 0, got {margin}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    pad = margin * max(max(xs) - min(xs), max(ys) - min(ys))
    return (
        np.linspace(min(xs) - pad, max(xs) + pad, grid).tolist(),
        np.linspace(min(ys) - pad, max(ys) + pad, grid).tolist(),
    )


# ---------------------------------------------------------------------------------------------------------------
# Evaluation helpers


def _losses(result: Any) -> np.ndarray:
    """Per-batch losses from whatever the evaluate function returned."""
    if hasattr(result, "batch_losses"):
        result = result.batch_losses
    if isinstance(result, int | float):
        return np.array([float(result)])
    arr = np.asarray(list(result), dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise PmakitError("the evaluate function must return a loss or a non-empty list of per-batch losses")
    return arr


class _Scorer:
    """Counts evaluations and their CPU and wall time."""

    def __init__(self, evaluate_fn: Evaluate, flattener: Flattener) -> None:
        self.evaluate_fn = evaluate_fn
        self.flattener = flattener
        self.count = 0
        self.cpu = 0.0
        self.wall = 0.0

    def __call__(self, vector: torch.Tensor) -> np.ndarray:
        c, w = time.process_time(), time.perf_counter()
        out = _losses(self.evaluate_fn(self.flattener.state(vector)))
        self.cpu += time.process_time() - c
        self.wall += time.perf_counter() - w
        self.count += 1
        return out

    def record(self) -> dict[str, Any]:
        return {
            "evaluations": self.count,
            "cpu_seconds": round(self.cpu, 3),
            "wall_seconds": round(self.wall, 3),
            "cpu_seconds_per_evaluation": round(self.cpu / max(self.count, 1), 4),
        }


def _mean_se(x: np.ndarray) -> dict[str, float | None]:
    n = x.size
    se = float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    return {"mean": float(x.mean()), "se": se}


def _cosines(vectors: Sequence[torch.Tensor]) -> list[list[float]]:
    m = torch.stack(list(vectors))
    norms = m.norm(dim=1, keepdim=True).clamp_min(1e-300)
    unit = m / norms
    return (unit @ unit.T).tolist()


def _mean_offdiag(matrix: list[list[float]]) -> float | None:
    k = len(matrix)
    vals = [matrix[i][j] for i in range(k) for j in range(k) if i != j]
    return float(np.mean(vals)) if vals else None


# ---------------------------------------------------------------------------------------------------------------
# E11: cross terms


def cross_terms(
    thetas: Sequence[torch.Tensor],
    score: Callable[[torch.Tensor], np.ndarray],
    *,
    member_losses: Sequence[np.ndarray] | None = None,
    merge_loss: np.ndarray | None = None,
) -> dict[str, Any]:
    """Finding 9's terms for the SMA of ``thetas`` (oldest first), from losses only (see the module docstring).

    Args:
        thetas: The window's weights as flat vectors, oldest first (k >= 2).
        score: Per-batch losses of a flat vector (the same batches for every call).
        member_losses: ``score(theta_i)`` if already computed (saves k evaluations).
        merge_loss: ``score(mean)`` if already computed.
    """
    k = len(thetas)
    if k < 2:
        raise PmakitError("the cross-term analysis needs at least 2 snapshots")
    mean = torch.stack(list(thetas)).mean(0)
    li = [score(t) for t in thetas] if member_losses is None else list(member_losses)
    lbar = score(mean) if merge_loss is None else merge_loss
    members = np.stack(li)  # (k, batches)
    gap = lbar - members.mean(0)  # < 0: the merge beats its average member
    invariant = 2 * k * k * gap  # C - (k-1) D, the same for any reference when the loss is quadratic
    merge_reference = _merge_reference(thetas, score, mean, li, lbar, gap)
    end_reference = _end_reference(thetas, score, li, invariant)
    steps = [b - a for a, b in zip(thetas, thetas[1:])]
    step_cos = [float(_cosines([a, b])[0][1]) for a, b in zip(steps, steps[1:])]
    return {
        "k": k,
        "method": "central second differences of held-out losses (forward passes only); see pmakit.lab.plane",
        "batches": int(gap.size),
        "member_loss_mean": _mean_se(members.mean(0)),
        "merge_loss": _mean_se(lbar),
        "gap": _mean_se(gap),
        "invariant": _mean_se(invariant),
        "condition_holds": bool(float(gap.mean()) < 0),
        "merge_reference": merge_reference,
        "end_reference": end_reference,
        "step_cosines": step_cos,
        "mean_step_cosine": float(np.mean(step_cos)) if step_cos else None,
    }


def _merge_reference(
    thetas: Sequence[torch.Tensor],
    score: Callable[[torch.Tensor], np.ndarray],
    mean: torch.Tensor,
    li: list[np.ndarray],
    lbar: np.ndarray,
    gap: np.ndarray,
) -> dict[str, Any]:
    """The terms with the merge as reference point (k more evaluations)."""
    k = len(thetas)
    # reference = the merge: q_i = L(mean + d_i) + L(mean - d_i) - 2 L(mean); sum_i d_i = 0 forces C = -D
    q_merge = np.stack([li[i] + score(2 * mean - thetas[i]) - 2 * lbar for i in range(k)])
    d_merge = q_merge.sum(0)
    dev_merge = [t - mean for t in thetas]
    cos_merge = _cosines(dev_merge)
    dm = float(d_merge.mean())
    return {
        "D": _mean_se(d_merge),
        "C": _mean_se(-d_merge),
        "curvatures": [float(q.mean()) for q in q_merge],
        "predicted_gap": _mean_se(-d_merge / (2 * k)),
        "explained": float(-dm / (2 * k) / float(gap.mean())) if float(gap.mean()) != 0 else None,
        "deviation_norms": [float(d.norm()) for d in dev_merge],
        "cosines": cos_merge,
        "mean_cosine": _mean_offdiag(cos_merge),
        "cosine_note": "deviations from their mean sum to zero: with equal norms the mean cosine is -1/(k-1)",
    }


def _end_reference(
    thetas: Sequence[torch.Tensor],
    score: Callable[[torch.Tensor], np.ndarray],
    li: list[np.ndarray],
    invariant: np.ndarray,
) -> dict[str, Any]:
    """The terms with the newest snapshot as reference point (k - 1 more evaluations)."""
    k = len(thetas)
    end = thetas[-1]
    # reference = the newest snapshot: d_k = 0, so k - 1 curvatures
    q_end = np.stack([li[i] + score(2 * end - thetas[i]) - 2 * li[-1] for i in range(k - 1)])
    d_end = q_end.sum(0)
    c_end = invariant + (k - 1) * d_end
    dev_end = [t - end for t in thetas[:-1]]
    cos_end = _cosines(dev_end)
    de, ce = float(d_end.mean()), float(c_end.mean())
    return {
        "D": _mean_se(d_end),
        "C": _mean_se(c_end),
        "curvatures": [float(q.mean()) for q in q_end] + [0.0],
        "ratio": ce / ((k - 1) * de) if de != 0 else None,
        "deviation_norms": [float(d.norm()) for d in dev_end] + [0.0],
        "cosines": cos_end,
        "mean_cosine": _mean_offdiag(cos_end),
    }


# ---------------------------------------------------------------------------------------------------------------
# E12: the plane


def loss_plane(
    snapshots: Sequence[State],
    evaluate_fn: Evaluate,
    *,
    grid: int = 11,
    margin: float = 0.25,
    anchors: tuple[int, int, int] | None = None,
    labels: Sequence[str] | None = None,
    tokens: Sequence[int | None] | None = None,
    names: Sequence[str] | None = None,
    cross: bool = True,
) -> dict[str, Any]:
    """The loss on the plane through three snapshots, every snapshot and the SMA merge placed on it (JSON-able).

    Args:
        snapshots: State dicts of the window, oldest first (at least 3).
        evaluate_fn: Loss of a state dict (per-batch losses preferred); called on the same batches every time.
        grid: Grid points per axis (grid x grid evaluations).
        margin: Padding around the points, as a fraction of their larger extent.
        anchors: Indices (origin a, x-direction b, third point c); default (oldest, newest, middle).
        labels: A name per snapshot (default "1".."k").
        tokens: Training tokens per snapshot, recorded in the result.
        names: Tensors to use (default: every float tensor of the newest snapshot).
        cross: Also compute finding 9's cross terms (``cross_terms``), 2k - 1 more evaluations.

    Returns:
        ``{"x": [...], "y": [...], "loss": [[...] per y] , "snapshots": [...], "merge": {...}, "e11": {...}, ...}``.
    """
    k = len(snapshots)
    a_i, b_i, c_i = _anchors(k, anchors)
    flattener = Flattener.of(snapshots[-1], names)
    thetas = [flattener.flat(s) for s in snapshots]
    mean = torch.stack(thetas).mean(0)
    plane = plane_through(thetas[a_i], thetas[b_i], thetas[c_i])
    score = _Scorer(evaluate_fn, flattener)

    member = [score(t) for t in thetas]
    merged = score(mean)
    placed = [plane.coords(t) for t in thetas]
    merge_xy = plane.coords(mean)
    xs, ys = grid_axes([(x, y) for x, y, _ in placed] + [merge_xy[:2]], grid, margin)
    surface = [[float(score(plane.point(x, y)).mean()) for x in xs] for y in ys]
    grid_record = score.record()

    labels = list(labels) if labels is not None else [str(i + 1) for i in range(k)]
    toks = list(tokens) if tokens is not None else [None] * k
    result: dict[str, Any] = {
        "kind": "loss_plane",
        "version": PLANE_VERSION,
        "parameters": flattener.size,
        "tensors": len(flattener.names),
        "batches": int(merged.size),
        "anchors": {"origin": a_i % k, "x": b_i % k, "y": c_i % k},
        "axes": _axes(labels[a_i], labels[b_i], labels[c_i]),
        "grid": grid,
        "margin": margin,
        "x": xs,
        "y": ys,
        "loss": surface,
        "snapshots": _placed_snapshots(placed, member, labels, toks),
        "merge": {
            "method": "sma",
            "x": merge_xy[0],
            "y": merge_xy[1],
            "distance": merge_xy[2],
            "loss": float(merged.mean()),
        },
        "window_span": float((thetas[-1] - thetas[0]).norm()),
        "cost": {"plane": grid_record},
    }
    if cross:
        result["e11"], result["cost"]["e11"] = _costed_cross_terms(thetas, score, member, merged)
    result["cost"]["total"] = score.record()
    return result


def _costed_cross_terms(
    thetas: list[torch.Tensor], score: _Scorer, member: list[np.ndarray], merged: np.ndarray
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``cross_terms`` of the window and what its extra evaluations cost."""
    before = score.count, score.cpu
    terms = cross_terms(thetas, score, member_losses=member, merge_loss=merged)
    cost = {"evaluations": score.count - before[0], "cpu_seconds": round(score.cpu - before[1], 3)}
    return terms, cost


def _anchors(k: int, anchors: tuple[int, int, int] | None) -> tuple[int, int, int]:
    """The plane's three defining snapshots: (origin, x-direction, third point); default oldest, newest, middle."""
    if k < 3:
        raise PmakitError(f"a loss plane needs at least 3 snapshots, got {k}")
    a_i, b_i, c_i = anchors if anchors is not None else (0, k - 1, k // 2 if k > 3 else 1)
    if len({a_i % k, b_i % k, c_i % k}) < 3:
        raise PmakitError(f"the plane needs three different snapshots, got indices {anchors}")
    return a_i, b_i, c_i


def _axes(origin: str, towards: str, third: str) -> dict[str, str]:
    return {
        "units": "Euclidean distance in weight space (all float parameters, flattened)",
        "u": f"from snapshot {origin} towards snapshot {towards}",
        "v": f"orthogonal to u, towards snapshot {third}",
    }


def _placed_snapshots(
    placed: Sequence[tuple[float, float, float]],
    member: Sequence[Any],
    labels: Sequence[str],
    tokens: Sequence[int | None],
) -> list[dict[str, Any]]:
    """Each snapshot's place on the plane (x, y, distance off it) and its own loss."""
    return [
        {
            "index": i + 1,
            "label": labels[i],
            "tokens": tokens[i],
            "x": x,
            "y": y,
            "distance": dist,
            "loss": float(member[i].mean()),
        }
        for i, (x, y, dist) in enumerate(placed)
    ]


def load_state(directory: Path) -> dict[str, torch.Tensor]:
    """A snapshot's weights (any format pmakit reads)."""
    from pmakit.formats import read_state

    return read_state(directory)


def find_train_config(start: Path) -> dict[str, Any] | None:
    """The ``train`` config of the run that holds ``start`` (a run directory or a snapshot), searching upwards.

    Looks for an experiment's RUN/config.json, a ``pmakit train`` run's RUN/checkpoint/trainer.pt, or a
    RUN/config.yaml, in ``start`` and up to three parents.
    """
    import json

    for d in [start, *list(start.resolve().parents)[:3]]:
        stamp = d / "config.json"
        if stamp.is_file():
            try:
                data = json.loads(stamp.read_text())
            except ValueError:
                data = None
            if isinstance(data, dict) and isinstance(data.get("train"), dict):
                return dict(data["train"])
        state = trainer_state(checkpoint_dir(d))
        if state.is_file():
            saved = torch.load(state, map_location="cpu", weights_only=True)
            if isinstance(saved, dict) and isinstance(saved.get("config"), dict):
                return dict(saved["config"])
        if (d / "config.yaml").is_file():
            from pmakit.config import read_file

            data = read_file(d / "config.yaml")
            return dict(data.get("train", data))
    return None


@dataclass
class Window:
    """The snapshots analysed and why these."""

    snapshots: list[Any]
    """``pmakit.snapshot.Snapshot`` objects, oldest first."""
    reason: str
    """How the window was chosen, for the summary."""
    run_dir: Path | None
    """The run they belong to (where its config is found)."""


def choose_window(inputs: Sequence[Path], last: int | None) -> Window:
    """The snapshots to analyse: an experiment's best SMA window, a run's last N, or the named snapshots."""
    from pmakit.snapshot import discover, gather

    if len(inputs) == 1 and snapshots_dir(inputs[0] / MAIN_RUN).is_dir():
        run = inputs[0]
        found = {s.tokens: s for s in discover(snapshots_dir(run / MAIN_RUN))}
        best = None if last is not None else _best_sma(run)
        if best is not None:
            targets = [best["tokens"] - j * best["v_tokens"] for j in range(best["n"])][::-1]
            if all(t in found for t in targets):
                return Window(
                    [found[t] for t in targets],
                    f"the experiment's best SMA at the last fork ({best['label']})",
                    run,
                )
        snaps = sorted(found.values(), key=lambda s: s.tokens)
        n = last or 8
        return Window(snaps[-n:], f"the last {min(n, len(snaps))} snapshots of {run / 'main'}", run)
    snaps, from_run = gather(inputs)
    if from_run or last is not None:
        n = last or 8
        snaps = snaps[-n:]
        reason = f"the last {len(snaps)} snapshots"
    else:
        reason = f"the {len(snaps)} snapshots named"
    root = inputs[0] if from_run and len(inputs) == 1 else None
    return Window(snaps, reason, root)


def _best_sma(run: Path) -> dict[str, Any] | None:
    """The lowest-loss SMA row of 3 or more snapshots at the experiment's last fork, from results.jsonl."""
    from pmakit.lab.results import iter_rows

    rows = [
        r
        for r in iter_rows(run)
        if r.get("model") == "merged"
        and r.get("method") == "sma"
        and (r.get("n") or 0) >= 3
        and r.get("split") != "test"  # the choice is made on the selection split, never on the test split
    ]
    forks = [r["fork_tokens"] for r in rows if r.get("fork_tokens") is not None]
    if not forks:
        return None
    last = max(forks)
    return min((r for r in rows if r.get("fork_tokens") == last), key=lambda r: r["val_loss"])


def held_out_batches(
    window: Window, *, batches: int, corpus: str | None
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], str]:
    """The run's fixed held-out batches (its corpus cache, reused), or ``corpus`` tokenized with the snapshot's
    tokenizer when no run config is found. Returns the batches and where they came from."""
    from pmakit.train.data import val_batches
    from pmakit.train.loop import TrainConfig, load_corpus

    newest = window.snapshots[-1].path
    raw = find_train_config(window.run_dir or newest)
    if raw is not None:
        if corpus is not None:
            raw["corpus"] = corpus
        cfg = TrainConfig.from_dict(raw)
        data = load_corpus(cfg)
        got = val_batches(data.val, batch_size=cfg.batch_size, seq_len=cfg.model.seq_len, max_batches=batches)
        return got, f"the run's held-out split ({data.files.get('source', cfg.corpus or 'stdlib')})"
    if corpus is None:
        raise PmakitError(
            f"no run config found above {newest} (an experiment's config.json or a run's checkpoint/trainer.pt); "
            "pass --corpus TEXT_FILE to evaluate on that text"
        )
    return _batches_from_text(
        newest, Path(corpus), batches
    ), f"{corpus} (tokenized with the snapshot's tokenizer)"


def _batches_from_text(
    snapshot: Path, text_file: Path, batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    import json

    from pmakit.train.data import val_batches

    if not (snapshot / "tokenizer.json").is_file():
        raise PmakitError(f"{snapshot} has no tokenizer.json to tokenize {text_file} with")
    if not text_file.is_file():
        raise PmakitError(f"{text_file}: no such text file")
    from tokenizers import Tokenizer

    ids = (
        Tokenizer.from_file(str(snapshot / "tokenizer.json"))
        .encode(text_file.read_text(errors="replace"))
        .ids
    )
    config = json.loads((snapshot / "config.json").read_text())
    seq_len = min(256, int(config.get("max_position_embeddings", 256)))
    return val_batches(np.asarray(ids, dtype=np.int64), batch_size=8, seq_len=seq_len, max_batches=batches)


def model_evaluator(
    snapshot_dir: Path, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.nn.Module, Evaluate]:
    """A model built from the snapshot's config.json (no weights downloaded) and a per-batch loss function."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pmakit.evaluate import evaluate
    from pmakit.train.loop import swapped

    if not (snapshot_dir / "config.json").is_file():
        raise PmakitError(f"{snapshot_dir} has no config.json: cannot build the model to evaluate")
    config = AutoConfig.from_pretrained(snapshot_dir)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()

    def score(state: State) -> list[float]:
        with swapped(model, state):
            return evaluate(model, batches).batch_losses

    return model, score


def analyze(
    inputs: Sequence[str | Path],
    out_dir: str | Path,
    *,
    last: int | None = None,
    grid: int = 11,
    batches: int = 4,
    corpus: str | None = None,
    margin: float = 0.25,
) -> dict[str, Any]:
    """``pmakit analyze``: plane.json, plane.png and summary.txt in ``out_dir``; returns the plane result."""

    from pmakit.evaluate import cpu_threads

    cpu_threads(None)
    window = choose_window([Path(p) for p in inputs], last)
    if len(window.snapshots) < 3:
        raise PmakitError(
            f"the loss plane needs at least 3 snapshots; {window.reason} gives {len(window.snapshots)}"
        )
    held_out, source = held_out_batches(window, batches=batches, corpus=corpus)
    _, score = model_evaluator(window.snapshots[-1].path, held_out)
    states = [load_state(s.path) for s in window.snapshots]
    t0 = time.perf_counter()
    result = loss_plane(
        states,
        score,
        grid=grid,
        margin=margin,
        labels=[str(i + 1) for i in range(len(states))],
        tokens=[s.tokens for s in window.snapshots],
    )
    result["window"] = {
        "reason": window.reason,
        "snapshots": [str(s.path) for s in window.snapshots],
        "held_out": source,
    }
    result["seconds"] = round(time.perf_counter() - t0, 2)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plane.json", result)
    from pmakit.report.plane import summary_lines

    lines = [f"Window: {window.reason}; held-out batches from {source}.", *summary_lines(result)]
    try:
        from pmakit.report.plane import plot_plane

        plot_plane(result, out / "plane.png")
    except ImportError as e:
        lines.append(f"plane.png not drawn: matplotlib is not available ({e}).")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    return result


def experiment_plane(grid: Any, run_dir: Path, *, size: int, batches: int) -> dict[str, Any] | None:
    """The experiment's optional step: the plane for the best SMA window at the final fork's end.

    ``grid`` is the experiment's ``_Grid`` (its snapshots, loaded states, model and fixed held-out batches are
    reused). Writes RUN/plane.json (the report draws plots/loss_plane.png from it); an up-to-date plane.json is
    not recomputed.
    """
    from pmakit.train.loop import swapped

    last = grid.study.forks[-1].fork_tokens
    rows = [
        r
        for r in grid.rows
        if r["model"] == "merged"
        and r["method"] == "sma"
        and r["fork_tokens"] == last
        and r["n"] >= 3
        and r.get("split") != "test"
    ]
    if not rows:
        log.info("loss plane: no SMA of 3 or more snapshots at the last fork; skipped")
        return None
    # the experiment's headline merge, unless that merges only 2 snapshots (a plane needs 3)
    best = min(rows, key=lambda r: r["val_loss"])
    chosen = grid.window(best["tokens"], best["n"], best["v_tokens"])
    if chosen is None:
        return None
    # spread over the held-out split like the experiment's own batches, not its first few windows
    held_out = list(grid.batches[:: max(1, len(grid.batches) // batches)][:batches])
    paths = [run_relative(s.path, run_dir) for s in chosen]  # the study may be moved or named another way
    previous = read_json_object(run_dir / "plane.json")
    if (
        previous is not None
        and previous.get("grid") == size
        and previous.get("batches") == len(held_out)
        and previous.get("window", {}).get("snapshots") == paths
    ):
        log.info("loss plane: already done")
        return previous
    log.info(
        "loss plane: %dx%d grid through %d snapshots on %d batches", size, size, len(chosen), len(held_out)
    )
    model = grid.trainer.model
    from pmakit.evaluate import evaluate

    def score(state: State) -> list[float]:
        with swapped(model, state):
            return evaluate(model, held_out, compiled=grid.compiled).batch_losses

    t0 = time.perf_counter()
    result = loss_plane(
        [grid.state(s) for s in chosen],
        score,
        grid=size,
        labels=[str(i + 1) for i in range(len(chosen))],
        tokens=[s.tokens for s in chosen],
    )
    result["seconds"] = round(time.perf_counter() - t0, 2)
    result["window"] = {
        "reason": f"the best SMA at the final fork's end ({best['label']})",
        "snapshots": paths,
        "held_out": f"{len(held_out)} of the experiment's {len(grid.batches)} fixed held-out batches, evenly spaced",
    }
    result["split"] = "selection"  # grid.batches: the split the window was chosen on, never the test split
    atomic_write_json(run_dir / "plane.json", result)
    return result
