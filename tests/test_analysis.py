"""pmakit.lab.plane: plane geometry checked exactly, finding 9's terms on quadratics with known H, the CLI on a tiny run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conftest import run_cli
from pmakit.errors import PmakitError
from pmakit.lab.plane import Flattener, cross_terms, loss_plane, plane_through

# --- geometry


def _vectors(n: int, dim: int = 40, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(dim, generator=g, dtype=torch.float64) for _ in range(n)]


def test_defining_points_have_exact_coordinates() -> None:
    a, b, c = _vectors(3)
    plane = plane_through(a, b, c)
    assert plane.coords(a) == pytest.approx((0.0, 0.0, 0.0), abs=1e-12)
    assert plane.coords(b) == pytest.approx((float((b - a).norm()), 0.0, 0.0), abs=1e-12)
    # c: x = its component along b - a, y = the rest of |c - a| (Pythagoras), on the plane, on the positive side
    ab = (b - a) / (b - a).norm()
    x_c = float((c - a) @ ab)
    y_c = float(((c - a).norm() ** 2 - x_c**2) ** 0.5)
    assert plane.coords(c) == pytest.approx((x_c, y_c, 0.0), abs=1e-12)
    assert float(plane.u @ plane.v) == pytest.approx(0.0, abs=1e-14)
    assert float(plane.u.norm()) == pytest.approx(1.0) and float(plane.v.norm()) == pytest.approx(1.0)


def test_projection_of_points_in_and_off_the_plane() -> None:
    a, b, c, noise = _vectors(4, seed=1)
    plane = plane_through(a, b, c)
    p = a + 0.3 * (b - a) + 1.7 * (c - a)
    x, y, dist = plane.coords(p)
    assert dist == pytest.approx(0.0, abs=1e-12)
    torch.testing.assert_close(plane.point(x, y), p, rtol=0, atol=1e-12)
    # add a component orthogonal to the plane: same (x, y), distance = its norm
    n = noise - (noise @ plane.u) * plane.u - (noise @ plane.v) * plane.v
    x2, y2, dist2 = plane.coords(p + n)
    assert (x2, y2) == pytest.approx((x, y), abs=1e-12)
    assert dist2 == pytest.approx(float(n.norm()), rel=1e-12)


def test_collinear_points_are_refused() -> None:
    a, b = _vectors(2)
    with pytest.raises(PmakitError, match="collinear"):
        plane_through(a, b, a + 2.5 * (b - a))


# --- the plane on a toy quadratic over a state dict

SHAPES = {"w": (3, 4), "bias": (5,)}


def _states(k: int, seed: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()} for _ in range(k)
    ]


def _quadratic(dim: int, batches: int = 2, seed: int = 3) -> tuple[list[np.ndarray], np.ndarray]:
    """Per-batch Hessians (symmetric, not necessarily definite) and a shared centre."""
    rng = np.random.default_rng(seed)
    hs = []
    for _ in range(batches):
        m = rng.normal(size=(dim, dim))
        hs.append((m + m.T) / 2 + dim * np.eye(dim) * 0.3)
    return hs, rng.normal(size=dim)


def _loss_fn(hs: list[np.ndarray], centre: np.ndarray, flat: Flattener):  # type: ignore[no-untyped-def]
    def evaluate(state):  # type: ignore[no-untyped-def]
        d = flat.flat(state).numpy() - centre
        return [0.5 * float(d @ h @ d) + 1.0 for h in hs]

    return evaluate


def test_grid_loss_is_the_loss_of_the_weights_rebuilt_from_coordinates() -> None:
    states = _states(5)
    flat = Flattener.of(states[-1])
    hs, centre = _quadratic(flat.size)
    evaluate = _loss_fn(hs, centre, flat)
    result = loss_plane(states, evaluate, grid=4, margin=0.1, cross=False)
    # rebuild the plane independently (numpy Gram-Schmidt) from the default anchors: oldest, newest, middle
    a, b, c = (flat.flat(states[i]).numpy() for i in (0, 4, 2))
    u = (b - a) / np.linalg.norm(b - a)
    w = (c - a) - ((c - a) @ u) * u
    v = w / np.linalg.norm(w)
    assert result["anchors"] == {"origin": 0, "x": 4, "y": 2}
    for iy, y in enumerate(result["y"]):
        for ix, x in enumerate(result["x"]):
            theta = a + x * u + y * v
            d = theta - centre
            expected = np.mean([0.5 * d @ h @ d + 1.0 for h in hs])
            assert result["loss"][iy][ix] == pytest.approx(expected, rel=1e-10)
    # the snapshots and the merge carry their own (off-plane) losses and coordinates
    for s, st in zip(result["snapshots"], states):
        assert s["loss"] == pytest.approx(np.mean(evaluate(st)), rel=1e-12)
        d = flat.flat(st).numpy() - a
        assert s["x"] == pytest.approx(d @ u, abs=1e-10) and s["y"] == pytest.approx(d @ v, abs=1e-10)
    mean = np.mean([flat.flat(s).numpy() for s in states], axis=0)
    assert result["merge"]["distance"] == pytest.approx(
        np.linalg.norm((mean - a) - ((mean - a) @ u) * u - ((mean - a) @ v) * v), rel=1e-9
    )
    # the grid covers every projected point
    xs = [s["x"] for s in result["snapshots"]] + [result["merge"]["x"]]
    assert min(result["x"]) <= min(xs) and max(result["x"]) >= max(xs)
    json.dumps(result)  # JSON-able as returned


def test_plane_needs_three_snapshots() -> None:
    with pytest.raises(PmakitError, match="at least 3"):
        loss_plane(_states(2), lambda s: 0.0)


# --- finding 9 on a quadratic with known H


def _exact_terms(thetas: list[np.ndarray], ref: np.ndarray, h: np.ndarray) -> tuple[float, float]:
    ds = [t - ref for t in thetas]
    d = sum(x @ h @ x for x in ds)
    c = sum(ds[i] @ h @ ds[j] for i in range(len(ds)) for j in range(len(ds)) if i != j)
    return float(c), float(d)


@pytest.mark.parametrize("case", ["complementary", "aligned", "random"])
def test_cross_terms_match_the_exact_quadratic_values(case: str) -> None:
    dim, k = 12, 6
    hs, centre = _quadratic(dim, batches=3, seed=4)
    rng = np.random.default_rng(5)
    if case == "complementary":  # alternating around the optimum: d_i = +-e, strongly negatively correlated
        e = rng.normal(size=dim)
        thetas = [centre + (1 if i % 2 else -1) * e + 0.05 * rng.normal(size=dim) for i in range(k)]
    elif case == "aligned":  # all on one side, nearly the same displacement: the merge gains almost nothing
        e = rng.normal(size=dim)
        thetas = [centre + e + 0.05 * rng.normal(size=dim) for _ in range(k)]
    else:
        thetas = [centre + rng.normal(size=dim) for _ in range(k)]
    vecs = [torch.from_numpy(t) for t in thetas]

    def score(v: torch.Tensor) -> np.ndarray:
        d = v.numpy() - centre
        return np.array([0.5 * d @ h @ d - 2.0 for h in hs])

    out = cross_terms(vecs, score)
    mean = np.mean(thetas, axis=0)
    per_batch = {"end": [], "merge": [], "optimum": [], "gap": []}  # type: dict[str, list]
    for h in hs:
        per_batch["end"].append(_exact_terms(thetas[:-1], thetas[-1], h))  # d_k = 0 adds nothing
        per_batch["merge"].append(_exact_terms(thetas, mean, h))
        per_batch["optimum"].append(_exact_terms(thetas, centre, h))
        loss = [0.5 * (t - centre) @ h @ (t - centre) for t in thetas]
        per_batch["gap"].append(0.5 * (mean - centre) @ h @ (mean - centre) - np.mean(loss))
    c_end, d_end = np.mean(per_batch["end"], axis=0)
    c_m, d_m = np.mean(per_batch["merge"], axis=0)
    c_opt, d_opt = np.mean(per_batch["optimum"], axis=0)
    assert out["end_reference"]["D"]["mean"] == pytest.approx(d_end, rel=1e-9)
    assert out["end_reference"]["C"]["mean"] == pytest.approx(c_end, rel=1e-9, abs=1e-9)
    assert out["merge_reference"]["D"]["mean"] == pytest.approx(d_m, rel=1e-9)
    assert c_m == pytest.approx(-d_m, rel=1e-9)  # sum of deviations from the mean is zero
    assert out["gap"]["mean"] == pytest.approx(np.mean(per_batch["gap"]), rel=1e-9, abs=1e-12)
    # the reference-free quantity equals the paper's C - (k-1)D around the true optimum
    assert out["invariant"]["mean"] == pytest.approx(c_opt - (k - 1) * d_opt, rel=1e-9, abs=1e-9)
    assert out["condition_holds"] == (c_opt < (k - 1) * d_opt)
    # a quadratic is fully explained by its curvature around the merge
    assert out["merge_reference"]["predicted_gap"]["mean"] == pytest.approx(out["gap"]["mean"], rel=1e-9)
    if case == "complementary":
        assert c_opt < 0 and out["condition_holds"]
    if case == "aligned":
        assert c_opt / ((k - 1) * d_opt) > 0.95


# --- the CLI on a tiny Llama run


def _tiny_run(root: Path, corpus: Path, k: int = 4) -> Path:
    """An experiment-shaped run: RUN/config.json and RUN/main/snapshots/step-*, a 1-layer Llama."""
    from pmakit.formats.safetensors_io import save_file
    from pmakit.snapshot import write_metadata
    from pmakit.train.model import ModelConfig, build_model

    model_cfg = {"layers": 1, "hidden": 16, "heads": 2, "seq_len": 32, "tie_embeddings": False}
    train = {
        "corpus": str(corpus),
        "max_corpus_bytes": None,
        "vocab_size": 300,
        "val_fraction": 0.3,
        "model": model_cfg,
        "batch_size": 2,
        "every_tokens": 64,
        "warmup_tokens": 0,
    }
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"train": train, "experiment": {}}))
    model: Any = build_model(ModelConfig(**model_cfg), 300, seed=0)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(0)
    for i in range(1, k + 1):
        snap = run / "main" / "snapshots" / f"step-{i:08d}"
        snap.mkdir(parents=True)
        state = {
            n: p.detach() + 0.05 * i * torch.randn(p.shape, generator=g) for n, p in model.named_parameters()
        }
        save_file(state, snap / "model.safetensors")
        model.config.save_pretrained(snap)
        write_metadata(snap, step=i, tokens=64 * i)
    return run


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    lines = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)]
    path.write_text("".join(lines))
    return path


def test_cli_on_an_experiment_run_needs_no_flags_but_output(tmp_path: Path, text: Path) -> None:
    run = _tiny_run(tmp_path, text)
    out = tmp_path / "out"
    proc = run_cli(
        "analyze",
        run,
        "--grid",
        "3",
        "--batches",
        "2",
        "-o",
        out,
        env={"PMAKIT_CACHE": str(tmp_path / "cache")},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "plane.json").read_text())
    assert len(result["snapshots"]) == 4 and len(result["loss"]) == 3 and len(result["loss"][0]) == 3
    assert result["batches"] == 2
    assert [s["tokens"] for s in result["snapshots"]] == [64, 128, 192, 256]
    assert all(np.isfinite(v) for row in result["loss"] for v in row)
    # 9 grid points + 4 members + merge + E11's 2k - 1 reflections
    assert result["cost"]["total"]["evaluations"] == 9 + 4 + 1 + 7
    assert (out / "plane.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out / "summary.txt").read_text()
    assert "Finding 9" in summary and "Loss plane" in proc.stdout


def test_cli_without_a_run_config_uses_corpus_with_the_snapshot_tokenizer(tmp_path: Path, text: Path) -> None:
    from pmakit.train.data import save_tokenizer, train_tokenizer

    run = _tiny_run(tmp_path, text)
    (run / "config.json").unlink()
    snaps = sorted((run / "main" / "snapshots").iterdir())
    proc = run_cli("analyze", *snaps, "--grid", "2", "-o", tmp_path / "out")
    assert proc.returncode == 1
    lines = [x for x in proc.stderr.strip().splitlines() if not x.startswith("info: ")]
    assert len(lines) == 1 and lines[0].startswith("Error: no run config found"), proc.stderr
    tokenizer = train_tokenizer([text.read_text()], 300)
    for snap in snaps:
        save_tokenizer(tokenizer, snap)
    proc = run_cli(
        "analyze", *snaps[1:], "--grid", "2", "--batches", "1", "--corpus", text, "-o", tmp_path / "out"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "plane.json").read_text())
    assert [s["tokens"] for s in result["snapshots"]] == [128, 192, 256]  # the snapshots named, all of them
    assert (
        result["batches"] == 1 and "tokenized with the snapshot's tokenizer" in result["window"]["held_out"]
    )


# --- the experiment's step and the report section


class _FakeGrid:
    """The parts of pmakit.lab.pma._Grid that the plane step uses."""

    def __init__(self, run: Path) -> None:
        from types import SimpleNamespace

        from pmakit.formats import read_state
        from pmakit.snapshot import discover
        from pmakit.train.model import ModelConfig, build_model

        self.snapshots = {s.tokens: s for s in discover(run / "main" / "snapshots")}
        self._load = read_state
        model = build_model(ModelConfig(layers=1, hidden=16, heads=2, seq_len=32, tie_embeddings=False), 300)
        g = torch.Generator().manual_seed(1)
        self.batches = [(x, x) for x in (torch.randint(0, 300, (2, 32), generator=g) for _ in range(6))]
        self.trainer = SimpleNamespace(model=model)
        self.compiled = False  # experiment.compile_eval resolved
        self.study = SimpleNamespace(
            forks=[SimpleNamespace(fork_tokens=64), SimpleNamespace(fork_tokens=128)]
        )
        sma = {"model": "merged", "method": "sma", "fork_tokens": 128, "tokens": 256, "v_tokens": 64}
        self.rows = [
            {**sma, "n": 3, "val_loss": 1.0, "label": "SMA N=3"},
            {**sma, "n": 2, "val_loss": 0.1, "label": "SMA N=2"},  # lowest, but a plane needs 3 snapshots
            {**sma, "n": 4, "val_loss": 2.0, "label": "SMA N=4"},
            {**sma, "n": 4, "fork_tokens": 64, "val_loss": 0.5, "label": "an earlier fork"},
        ]

    def window(self, end: int, n: int, v: int) -> list[Any] | None:
        targets = [end - j * v for j in range(n)][::-1]
        return [self.snapshots[t] for t in targets] if all(t in self.snapshots for t in targets) else None

    def state(self, snap: Any) -> dict[str, torch.Tensor]:
        return self._load(snap.path)


def _held_out_loss(model: torch.nn.Module, state: dict[str, torch.Tensor], batches: list[Any]) -> float:
    """Mean next-token cross-entropy of ``model`` with ``state``'s weights over ``batches``: a plain forward pass,
    none of pmakit's evaluation or weight swapping."""
    from torch.func import functional_call

    losses = []
    with torch.no_grad():
        for x, y in batches:
            logits = functional_call(model, state, args=(), kwargs={"input_ids": x}).logits
            losses.append(float(torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())))
    return float(np.mean(losses))


def test_experiment_step_uses_the_best_sma_window_and_feeds_the_report(
    tmp_path: Path, text: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.torch import load_file

    from pmakit.lab.plane import experiment_plane
    from pmakit.report import plane as section

    run = _tiny_run(tmp_path, text)
    grid = _FakeGrid(run)
    result = experiment_plane(grid, run, size=3, batches=2)
    assert result is not None
    # the best SMA of at least 3 snapshots (N=3) at the LAST fork
    assert [s["tokens"] for s in result["snapshots"]] == [128, 192, 256]
    assert result["batches"] == 2 and "SMA N=3" in result["window"]["reason"]
    written = (run / "plane.json").stat().st_mtime_ns

    def no_state(snap: Any) -> dict[str, torch.Tensor]:
        raise AssertionError(f"recomputed: loaded {snap.path}")

    monkeypatch.setattr(grid, "state", no_state)
    again = experiment_plane(grid, run, size=3, batches=2)  # up to date: read back, not recomputed
    assert again is not None and again == json.loads((run / "plane.json").read_text())
    assert (run / "plane.json").stat().st_mtime_ns == written
    # What is read back is the plane of that window, worked out here from the snapshot files: each snapshot's and
    # the SMA merge's loss on 2 of the 6 held-out batches, evenly spaced (0 and 3).
    names = [f"step-{i:08d}" for i in (2, 3, 4)]
    states = [load_file(run / "main" / "snapshots" / n / "model.safetensors") for n in names]
    mean = {k: torch.stack([s[k].double() for s in states]).mean(0).float() for k in states[0]}
    model = grid.trainer.model.eval()
    held_out = [grid.batches[0], grid.batches[3]]
    assert again["window"]["snapshots"] == [f"main/snapshots/{n}" for n in names] and again["batches"] == 2
    assert [s["loss"] for s in again["snapshots"]] == pytest.approx(
        [_held_out_loss(model, s, held_out) for s in states], rel=1e-5
    )
    assert again["merge"]["loss"] == pytest.approx(_held_out_loss(model, mean, held_out), rel=1e-5)
    png = section.draw(run, run / "plots" / "loss_plane.png")
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"
    blocks = section.blocks(run, Path("plots/loss_plane.png"))
    texts = " ".join(str(b) for b in blocks)
    assert "Cross terms" in texts and "loss_plane.png" in texts
    verdict = "holds" if result["e11"]["condition_holds"] else "does not hold"
    assert f"the condition C < (k-1)D {verdict}" in texts
    assert section.blocks(tmp_path, None) == []  # no plane.json: no section
