"""The experiment report: every number traced to the run's files, partial runs, headless-Chromium rendering."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pmakit.errors import PmakitError
from pmakit.report import summary_text, write_report
from pmakit.report.analysis import Gain, gap, recovered_fraction, verdict
from pmakit.report.load import RESULT_COLUMNS

# --- a realistic run directory ---------------------------------------------------------------------------

TPS = 4096  # tokens per step
V0 = 16 * TPS  # base snapshot interval
FORKS = [(32 * V0, 5 * V0), (64 * V0, 10 * V0)]  # (F, D): anneal ~15% of the tokens so far
WEIGHTINGS = [("sma", None), ("wma", None), ("ema", 0.1), ("ema", 0.2), ("wsm-1sqrt", None)]
NS, VS = (2, 4, 8, 16), (1, 2, 4)


def latest_curve(t: float) -> float:
    """A power-law loss curve of the constant-LR run."""
    return 3.05 + 6.0 * (t / 1e5 + 1) ** -0.9


def merge_gain(fork: int, n: int, mult: int, method: str, alpha: float | None) -> float:
    """Gain over latest: grows with merge duration, minus a staleness penalty that is large early."""
    d = n * mult * {"sma": 1.0, "wma": 0.67, "wsm-1sqrt": 0.55}.get(method, 1.0)
    if method == "ema":
        d = min(d, mult * (2 / (alpha or 0.2) - 1))
    peak, tau, stale = ((0.05, 3.0, 0.0012), (0.08, 5.0, 0.0002))[fork]
    return peak * (1 - math.exp(-d / tau)) - stale * d


def _row(**kw: object) -> dict[str, object]:
    return {c: kw.get(c, "") for c in RESULT_COLUMNS}


def build_run(
    run: Path,
    *,
    forks: list[tuple[int, int]] = FORKS,
    annealed: bool = True,
    curves: bool = True,
    weightings: list[tuple[str, float | None]] = WEIGHTINGS,
    ns: tuple[int, ...] = NS,
    vs: tuple[int, ...] = VS,
    se_scale: float = 1.0,
    batch_losses: bool = True,
    seed: int = 0,
) -> Path:
    """Write experiment.json, results.csv (+ .jsonl) and curves.csv shaped like `pmakit experiment`'s.

    Every model is scored on the same B batches: the latest snapshot's batch losses vary with batch difficulty,
    another model's are those minus its gain plus a small paired noise, and the statistics are computed from
    the batches the way pmakit.evaluate does (so the CSV, the JSONL and the batches agree).
    """
    rng = np.random.default_rng(seed)
    run.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    bpt = 1 / (math.log(2) * 3.1)  # bits per byte per nat, ~3.1 bytes per token
    n_batches = 24

    def add(
        fork: int | None, model: str, tokens: int, b: np.ndarray, ref: np.ndarray | None, **kw: object
    ) -> None:
        diff = None if ref is None else b - ref
        row = _row(
            fork_tokens=fork if fork is not None else "",
            model=model,
            tokens=tokens,
            val_loss=float(b.mean()),
            val_loss_se=float(b.std(ddof=1) / math.sqrt(n_batches)),
            bpb=float(b.mean() * bpt),
            delta_vs_latest=0.0 if diff is None else float(diff.mean()),
            delta_se=0.0 if diff is None else float(diff.std(ddof=1) / math.sqrt(n_batches)),
            **kw,
        )
        rows.append({**row, "batch_losses": [float(x) for x in b]} if batch_losses else row)

    def scored(ref: np.ndarray, gain: float) -> np.ndarray:
        return ref - gain + rng.normal(0, 0.008 * se_scale, n_batches)

    for k, (f, d) in enumerate(forks):
        end = f + d
        latest = latest_curve(end) + rng.normal(0, 0.12, n_batches)
        add(f, "latest", end, latest, None, label=f"latest ({end} tokens)")
        for method, alpha in weightings:
            for n in ns:
                for m in vs if method == "sma" else vs[:1]:
                    g = merge_gain(min(k, 1), n, m, method, alpha)
                    name = method.upper() + (f"({alpha})" if alpha else "")
                    add(
                        f,
                        "merged",
                        end,
                        scored(latest, g),
                        latest,
                        method=method,
                        n=n,
                        v_tokens=m * V0,
                        alpha="" if alpha is None else alpha,
                        window_start_tokens=end - (n - 1) * m * V0,
                        label=f"{name} N={n} V={m}x",
                    )
        if annealed:
            g = (0.045, 0.09)[min(k, 1)]
            add(f, "annealed", end, scored(latest, g), latest, label=f"anneal from {f}")
    for t in (16 * V0, 48 * V0):  # E1: points of the stable phase
        latest = latest_curve(t) + rng.normal(0, 0.12, n_batches)
        add(None, "latest", t, latest, None, label="latest")
        add(
            None,
            "merged",
            t,
            scored(latest, 0.03),
            latest,
            method="sma",
            n=8,
            v_tokens=V0,
            label="SMA N=8 V=1x",
        )

    with (run / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    if curves:
        end = max(f + d for f, d in forks)
        points = [("latest", t, latest_curve(t) + rng.normal(0, 0.012)) for t in range(0, end + 1, 4 * V0)]
        points += [("merged:sma:8", t, latest_curve(t) - 0.05) for t in range(8 * V0, end + 1, 4 * V0)]
        for f, d in forks:
            for s in np.linspace(0, 1, 6):
                t = f + int(s * d)
                points.append((f"anneal@{f}", t, latest_curve(t) - 0.09 * (1 - (1 - s) ** 2)))
        with (run / "curves.csv").open("w", newline="") as fh:
            w2 = csv.writer(fh)
            w2.writerow(["series", "tokens", "val_loss", "val_loss_se"])
            w2.writerows([s, t, round(v, 6), 0.031] for s, t, v in points)

    experiment = {
        "preset": "demo",
        "config": {
            "lr": 0.003,
            "warmup_tokens": 409600,
            "weight_decay": 0.1,
            "betas": [0.9, 0.95],
            "snapshot_every_tokens": V0,
            "n": list(ns),
            "v_multiples": list(vs),
            "seed": 1234,
            "model": {"layers": 4, "hidden": 128, "heads": 4},
        },
        "started": "2026-11-23T01:00:00Z",
        "finished": "2026-11-23T01:17:30Z",
        "seconds": {"train": 811.5, "anneal": 140.25, "merge_eval": 98.0, "total": 1050.0},
        "model": {"parameters": 3_215_360, "layers": 4, "hidden": 128},
        "corpus": {
            "source": "python stdlib",
            "train_files": 1712,
            "val_files": 90,
            "train_tokens": 9_876_543,
            "val_tokens": 262_144,
            "vocab_size": 4096,
        },
        "forks": [{"fork_tokens": f, "anneal_tokens": d, "eval_tokens": f + d} for f, d in forks],
        "base_every_tokens": V0,
        "tokens_per_step": TPS,
        "pmakit_version": "0.1.0",
    }
    (run / "experiment.json").write_text(json.dumps(experiment, indent=2))
    return run


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = build_run(tmp_path_factory.mktemp("report") / "run")
    write_report(run)
    return run


def read_rows(run: Path) -> list[dict[str, str]]:
    with (run / "results.csv").open() as fh:
        return list(csv.DictReader(fh))


# --- every number in the report traces back to the run's files -------------------------------------------

NUMBER = re.compile(r"(?<![\w.])[+-]?(\d+(?:\.\d+)?(?:e[+-]?\d+)?)([KMBT](?![a-zA-Z]))?(%)?", re.IGNORECASE)
SCALE = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}
# Names, not measurements: fork and paper-experiment labels (F1, E4), paper finding numbers, the 1-sqrt decay.
NOT_DATA = re.compile(r"\bfindings? \d+(?:, \d+)*|\b[FE]\d+\b|1-sqrt|1sqrt")


def numbers_in(text: str) -> list[tuple[str, float, float, str]]:
    """(printed text, value, tolerance of its rounding, kind) for every number in ``text``."""
    out = []
    for m in NUMBER.finditer(NOT_DATA.sub(" ", text)):
        digits, suffix, pct = m.group(1), (m.group(2) or "").upper(), m.group(3)
        decimals = len(digits.split(".")[1]) if "." in digits and "e" not in digits.lower() else 0
        scale = SCALE.get(suffix, 1.0) * (0.01 if pct else 1.0)
        tol = 0.5 * 10.0**-decimals * scale if "e" not in digits.lower() else abs(float(digits)) * 1e-6
        kind = "tokens" if suffix else "pct" if pct else {0: "int", 1: "z", 4: "loss"}.get(decimals, "other")
        out.append((m.group(0), float(digits) * scale, tol * (1 + 1e-9) + 1e-12, kind))
    return out


def _f(x: str | None) -> float | None:
    try:
        v = float(x) if x not in (None, "") else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def gain(row: dict[str, str], latest: list[dict[str, str]]) -> float | None:
    """latest - row: the file's delta when present, else the difference of the two losses."""
    d = _f(row.get("delta_vs_latest"))
    if d is not None:
        return -d
    if latest and _f(latest[0].get("val_loss")) is not None and _f(row.get("val_loss")) is not None:
        return _f(latest[0]["val_loss"]) - _f(row["val_loss"])  # type: ignore[operator]
    return None


def traceable_values(run: Path) -> dict[str, set[float]]:
    """What a report number may be, by kind, computed from the raw files independently of pmakit.report."""
    raw: set[float] = set()
    for text in [
        (run / "experiment.json").read_text() if (run / "experiment.json").exists() else "",
        run.name,
    ]:
        raw.update(abs(v) for _, v, _, _ in numbers_in(text))
    rows = read_rows(run)
    jsonl = run / "results.jsonl"
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    for r, rec in zip(rows, records):  # the JSONL has the CSV's rows in the same order, plus batch losses
        if rec.get("batch_losses"):
            r["batches"] = np.array(rec["batch_losses"])  # type: ignore[assignment]
    for r in rows:
        for k, v in r.items():
            if k == "batches":
                continue
            if k == "label":
                raw.update(abs(x) for _, x, _, _ in numbers_in(v))
            elif _f(v) is not None:
                raw.add(abs(_f(v)))  # type: ignore[arg-type]
    if (run / "curves.csv").exists():
        with (run / "curves.csv").open() as fh:
            for c in csv.DictReader(fh):
                raw.update(abs(x) for _, x, _, _ in numbers_in(c["series"]))
                raw.update(
                    abs(v) for v in map(_f, (c["tokens"], c["val_loss"], c["val_loss_se"])) if v is not None
                )
    ints: set[float] = {len(rows)}  # "k result rows ... were skipped"
    exp = json.loads((run / "experiment.json").read_text()) if (run / "experiment.json").exists() else {}
    z: set[float] = set()
    loss: set[float] = set()
    pct: set[float] = set()
    raw.update(v / 60 for v in (exp.get("seconds") or {}).values())
    v0 = exp.get("base_every_tokens") or V0
    ints.update(_f(r.get("v_tokens")) / v0 for r in rows if _f(r.get("v_tokens")))  # type: ignore[operator]
    for r in rows:  # gains computed from the losses when the delta column is missing
        ref = [x for x in rows if x.get("model") == "latest" and x.get("tokens") == r.get("tokens")]
        g = gain(r, ref)
        if g is not None:
            loss.add(abs(g))
    for r in rows:
        d, s = _f(r.get("delta_vs_latest")), _f(r.get("delta_se"))
        if d is not None and s:
            z.add(abs(d / s))
    for fork in {r.get("fork_tokens") for r in rows if r.get("fork_tokens")}:
        at = [r for r in rows if r.get("fork_tokens") == fork]
        merged = [r for r in at if r.get("model") == "merged"]
        ints.add(len(merged))
        raw.update(_f(r.get("tokens")) - float(fork) for r in at if _f(r.get("tokens")))  # type: ignore[operator]  # D
        ann = [r for r in at if r.get("model") == "annealed"]
        # pairs whose difference the report may print: any merge vs the anneal, weightings at the same N and V
        pairs = [(m, a) for m in merged for a in ann]
        pairs += [
            (a, b)
            for a in merged
            for b in merged
            if a is not b and a.get("n") == b.get("n") and a.get("v_tokens") == b.get("v_tokens")
        ]
        for a, b in pairs:
            if "batches" in a and "batches" in b:  # paired over the same batches
                diff = a["batches"] - b["batches"]  # type: ignore[operator]
                mean, se = abs(diff.mean()), diff.std(ddof=1) / math.sqrt(len(diff))
                loss.update({mean, se})
                z.add(mean / se)
            la, lb = _f(a.get("val_loss")), _f(b.get("val_loss"))
            if la is not None and lb is not None:
                loss.add(abs(la - lb))
            da, db = _f(a.get("delta_vs_latest")), _f(b.get("delta_vs_latest"))
            sa, sb = _f(a.get("delta_se")), _f(b.get("delta_se"))
            if da is None or db is None or sa is None or sb is None:
                continue
            loss.update({abs(da - db), sa + sb})
            z.add(abs(da - db) / (sa + sb))
            if sa != sb:
                z.add(abs(da - db) / abs(sa - sb))
        latest = [r for r in at if r.get("model") == "latest"]
        for m in merged:
            for a in ann:
                if latest and all("batches" in x for x in (latest[0], m, a)):
                    bl, bm, ba = (x["batches"] for x in (latest[0], m, a))
                    g_m, g_a = bl - bm, bl - ba  # type: ignore[operator]
                    ratio = g_m.mean() / g_a.mean()
                    cov = np.cov(np.vstack([g_m, g_a]), ddof=1) / len(g_m)
                    var = cov[0, 0] + ratio**2 * cov[1, 1] - 2 * ratio * cov[0, 1]
                    pct.update({abs(ratio), math.sqrt(var) / g_a.mean()})
                gm, ga = gain(m, latest), gain(a, latest)
                if gm is not None and ga is not None and ga > 0:
                    r_ = gm / ga
                    pct.add(abs(r_))
                    sm, sa = _f(m.get("delta_se")), _f(a.get("delta_se"))
                    if sm is not None and sa is not None:
                        pct.add((sm + abs(r_) * sa) / ga)
    return {"raw": raw, "z": z, "loss": loss, "pct": pct, "int": ints}


def untraceable(text: str, allowed: dict[str, set[float]]) -> list[str]:
    """Printed numbers that match no value of their kind (nor any raw value from the files)."""
    pools = {k: np.array(sorted(v | allowed["raw"])) for k, v in allowed.items()}
    pools["tokens"] = pools["other"] = pools["raw"]
    bad = []
    for printed, value, tol, kind in numbers_in(text):
        pool = pools[kind]
        i = np.searchsorted(pool, value)
        near = [pool[j] for j in (i - 1, i) if 0 <= j < len(pool)]
        if not any(abs(value - c) <= tol for c in near):
            bad.append(f"{printed} ({kind})")
    return bad


def html_text(page: str) -> str:
    """The visible text of the report page: no CSS, no embedded images, no tags."""
    import html as html_lib

    page = re.sub(r"<style>.*?</style>", " ", page, flags=re.S)
    page = re.sub(r'src="data:[^"]*"', " ", page)
    return html_lib.unescape(re.sub(r"<[^>]+>", " ", page))


def test_report_files_written(full_run: Path) -> None:
    assert (full_run / "report.md").stat().st_size > 1000
    assert (full_run / "report.html").stat().st_size > 10_000
    pngs = sorted(p.name for p in (full_run / "plots").glob("*.png"))
    assert pngs == [
        "fork_gains.png",
        "loss_vs_tokens.png",
        "n_v_sweeps.png",
        "sma_n_by_v.png",
        "weightings.png",
    ]
    import matplotlib.image as mpimg

    for p in (full_run / "plots").glob("*.png"):
        img = mpimg.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 500 and img[..., :3].std() > 0.05, p.name
    text = (full_run / "report.md").read_text()
    assert "Note:" not in text, "a complete run must not produce notes (missing files, failed plots)"


def test_every_number_in_markdown_comes_from_the_run_files(full_run: Path) -> None:
    text = (full_run / "report.md").read_text()
    found = numbers_in(text)
    assert len(found) > 200  # the check below is not vacuous
    assert untraceable(text, traceable_values(full_run)) == []


def test_every_number_in_html_comes_from_the_run_files(full_run: Path) -> None:
    text = html_text((full_run / "report.html").read_text())
    assert len(numbers_in(text)) > 200
    assert untraceable(text, traceable_values(full_run)) == []


def test_number_check_catches_a_made_up_number(full_run: Path) -> None:
    allowed = traceable_values(full_run)
    # each kind of number on its own: a loss and its s.e., a gain in s.e., a share recovered
    for made_up in ("latest 3.1416", "± 0.0271", "gain 97.3 s.e.", "41% recovered"):
        assert untraceable(made_up, allowed), made_up
    assert untraceable("latest 3.1416 ± 0.0271, gain 97.3 s.e., 41% recovered", allowed) == [
        "3.1416 (loss)",
        "0.0271 (loss)",
        "97.3 (z)",
        "41% (pct)",
    ]


def test_headline_table_matches_the_results_file(full_run: Path) -> None:
    rows = read_rows(full_run)
    f, _ = FORKS[-1]
    at = [r for r in rows if r["fork_tokens"] == str(f)]
    latest = next(r for r in at if r["model"] == "latest")
    best = min((r for r in at if r["model"] == "merged"), key=lambda r: float(r["val_loss"]))
    ann = next(r for r in at if r["model"] == "annealed")
    text = (full_run / "report.md").read_text()
    head = text.split("## Headline")[1].split("\n## ")[0]
    table = {
        cells[0]: cells[1:]
        for line in head.splitlines()
        if line.startswith("| ") and not line.startswith("| :")
        for cells in [[c.strip() for c in line.strip("|").split("|")]]
    }
    assert (
        table["latest snapshot"][1] == f"{float(latest['val_loss']):.4f} ± {float(latest['val_loss_se']):.4f}"
    )
    best_cells = table[f"best merge: {best['label']}"]
    assert best_cells[1] == f"{float(best['val_loss']):.4f} ± {float(best['val_loss_se']):.4f}"
    assert best_cells[2] == f"{float(best['bpb']):.4f}"
    assert best_cells[3] == f"{float(best['delta_vs_latest']):+.4f} ± {float(best['delta_se']):.4f}"
    assert best_cells[4] == f"{float(best['delta_vs_latest']) / float(best['delta_se']):.1f}"
    assert table["annealed branch"][1] == f"{float(ann['val_loss']):.4f} ± {float(ann['val_loss_se']):.4f}"
    lat, m, a = (float(r["val_loss"]) for r in (latest, best, ann))
    assert f"(latest − annealed): {100 * (lat - m) / (lat - a):.0f}%" in head
    z = -float(best["delta_vs_latest"]) / float(best["delta_se"])
    assert z > 10 and f"it beats the latest snapshot by {z:.1f} paired standard errors" in head

    # merge - anneal and the share recovered, paired over the batches of results.jsonl
    batches = {
        (r["fork_tokens"], r["model"], r["label"]): np.array(r["batch_losses"])
        for r in map(json.loads, (full_run / "results.jsonl").read_text().splitlines())
    }
    bl, bm, ba = (batches[(f, r["model"], r["label"])] for r in (latest, best, ann))
    diff = bm - ba
    se = diff.std(ddof=1) / math.sqrt(len(diff))
    assert f"Best merge − annealed: {diff.mean():+.4f} ± {se:.4f} (" in head
    g_m, g_a = bl - bm, bl - ba
    ratio = g_m.mean() / g_a.mean()
    cov = np.cov(np.vstack([g_m, g_a])) / len(g_m)
    se_r = math.sqrt(cov[0, 0] + ratio**2 * cov[1, 1] - 2 * ratio * cov[0, 1]) / g_a.mean()
    assert f"{100 * ratio:.0f}% (s.e. {100 * se_r:.0f}%)" in head


def test_without_batch_losses_the_anneal_gap_is_bounded(tmp_path: Path) -> None:
    run = build_run(tmp_path / "csv-only", curves=False, batch_losses=False, weightings=[("sma", None)])
    head = write_report(run).markdown.read_text().split("## Headline")[1].split("\n## ")[0]
    rows = [r for r in read_rows(run) if r["fork_tokens"] == str(FORKS[-1][0])]
    best = min((r for r in rows if r["model"] == "merged"), key=lambda r: float(r["val_loss"]))
    ann = next(r for r in rows if r["model"] == "annealed")
    gap_ = float(best["delta_vs_latest"]) - float(ann["delta_vs_latest"])
    bound = float(best["delta_se"]) + float(ann["delta_se"])
    assert f"Best merge − annealed: {gap_:+.4f} ± ≤{bound:.4f} (" in head
    assert "% (s.e. ≤ " in head


# --- judgments follow the numbers ------------------------------------------------------------------------


def test_verdict_follows_the_z_score() -> None:
    assert verdict(12.34, "it") == "it beats the latest snapshot by 12.3 paired standard errors"
    assert verdict(1.0, "it") == "it is within noise of the latest snapshot (+1.0 paired standard errors)"
    assert verdict(-3.0, "it") == "it is worse than the latest snapshot by 3.0 paired standard errors"
    assert "cannot be judged" in verdict(None, "it")


def test_recovered_fraction_and_gap_bounds() -> None:
    merge, anneal = Gain(0.08, 0.002), Gain(0.10, 0.003)
    r = recovered_fraction(merge, anneal)
    assert r is not None and r.value == pytest.approx(0.8)
    assert r.se_bound == pytest.approx((0.002 + 0.8 * 0.003) / 0.10)
    g = gap(merge, anneal)  # merged - annealed loss = 0.10 - 0.08
    assert g is not None and g.value == pytest.approx(0.02)
    assert (g.se_bound, g.se_floor) == (pytest.approx(0.005), pytest.approx(0.001))
    assert recovered_fraction(merge, Gain(-0.01, 0.002)) is None  # the anneal did not help: undefined


def test_the_share_recovered_is_not_given_where_the_anneal_gain_is_noise(tmp_path: Path) -> None:
    # The demo's early fork had an anneal 1.6 s.e. ahead of the latest snapshot and printed "recovered 671% (s.e.
    # 358%)": a ratio over a denominator that may be zero. Under 2 paired s.e. of the anneal's gain the share is
    # not given, in the tables, the sentences and the terminal summary; a clear anneal keeps it.
    from pmakit.report.analysis import summarize_forks
    from pmakit.report.document import headline_sentences, recovered_cell
    from pmakit.report.load import load_run

    clear = build_run(tmp_path / "clear", curves=False)
    noisy = build_run(tmp_path / "noisy", se_scale=60.0, curves=False)
    for run in (clear, noisy):
        write_report(run)
    for run, shown in ((clear, True), (noisy, False)):
        forks = [f.headline for f in summarize_forks(load_run(run))]
        md = (run / "report.md").read_text()
        fork_rows = [line for line in md.splitlines() if line.startswith("| F")]
        assert len(fork_rows) == len(forks) == len(FORKS)
        for f, line in zip(forks, fork_rows):
            g = f.gain(f.annealed)
            assert g is not None and g.z is not None and (g.z >= 2) is shown
            assert (f.recovered(f.best_merge) is not None) is shown
            last_cell = line.rstrip(" |").rsplit("|", 1)[-1].strip()
            if shown:
                assert re.fullmatch(r"\d+% \(s\.e\. \d+%\)", last_cell), line
            else:
                assert last_cell == "– (anneal within noise)", line
        text = summary_text(run)
        assert ("recovered – (anneal within noise)" in text) is not shown
        assert ("of the anneal's gain over the latest snapshot" in text) is shown
        assert ("so the share of it a merge recovers is not given" in md) is not shown
        assert untraceable(md, traceable_values(run)) == []
    # An anneal clearly worse than the latest snapshot (10 s.e.) is not noise: the share is undefined ("–"), and
    # the report says the anneal did not lower the loss.
    fork = summarize_forks(load_run(clear))[-1].headline
    assert fork.annealed is not None
    worse = dataclasses.replace(fork.annealed, delta_vs_latest=0.05, delta_se=0.005, batch_losses=None)
    fork = dataclasses.replace(fork, annealed=worse)
    assert not fork.anneal_within_noise and fork.recovered(fork.best_merge) is None
    assert recovered_cell(fork, fork.best_merge) == "–"
    assert any("did not lower the loss" in line for line in headline_sentences(fork, None))


def test_noisy_run_is_called_noise_not_a_win(tmp_path: Path) -> None:
    run = build_run(
        tmp_path / "noisy", se_scale=60.0, curves=False, weightings=[("sma", None)], ns=(4,), vs=(1,)
    )
    merged = next(
        r for r in read_rows(run) if r["fork_tokens"] == str(FORKS[-1][0]) and r["model"] == "merged"
    )
    z = -float(merged["delta_vs_latest"]) / float(merged["delta_se"])
    assert abs(z) < 2  # the fixture is noisy enough for the check below to mean something
    write_report(run)
    head = (run / "report.md").read_text().split("## Headline")[1].split("\n## ")[0]
    assert f"it is within noise of the latest snapshot ({z:+.1f} paired standard errors)" in head
    assert "beats the latest snapshot" not in head.split("The annealed branch")[0]
    assert untraceable((run / "report.md").read_text(), traceable_values(run)) == []


def test_best_of_many_noisy_merges_is_flagged_as_picked(tmp_path: Path) -> None:
    run = build_run(tmp_path / "many", se_scale=60.0, curves=False)
    write_report(run)
    head = (run / "report.md").read_text().split("## Headline")[1].split("\n## ")[0]
    assert (
        "It is the lowest of 28 merges evaluated here; picking the minimum after the fact flatters it" in head
    )


def test_merge_worse_than_latest_is_reported_as_worse(tmp_path: Path) -> None:
    run = tmp_path / "worse"
    run.mkdir()
    with (run / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=RESULT_COLUMNS)
        w.writeheader()
        w.writerow(
            _row(
                fork_tokens=1000,
                model="latest",
                tokens=1200,
                val_loss=3.5,
                val_loss_se=0.03,
                delta_vs_latest=0,
                delta_se=0,
            )
        )
        w.writerow(
            _row(
                fork_tokens=1000,
                model="merged",
                method="sma",
                n=4,
                v_tokens=100,
                tokens=1200,
                val_loss=3.52,
                val_loss_se=0.03,
                delta_vs_latest=0.02,
                delta_se=0.002,
            )
        )
        w.writerow(
            _row(
                fork_tokens=1000,
                model="annealed",
                tokens=1200,
                val_loss=3.45,
                val_loss_se=0.03,
                delta_vs_latest=-0.05,
                delta_se=0.002,
            )
        )
    write_report(run)
    text = (run / "report.md").read_text()
    assert "it is worse than the latest snapshot by 10.0 paired standard errors" in text
    assert "(latest − annealed): -40%" in text  # a negative share, shown as measured
    assert "the anneal is better by at least 17.5 standard errors" in text  # 0.07 / (0.002 + 0.002)
    assert untraceable(text, traceable_values(run)) == []


# --- partial runs ----------------------------------------------------------------------------------------


def test_single_fork_without_anneal_or_curves(tmp_path: Path) -> None:
    run = build_run(
        tmp_path / "partial",
        forks=FORKS[:1],
        annealed=False,
        curves=False,
        weightings=[("sma", None)],
        ns=(4, 8),
        vs=(1,),
    )
    paths = write_report(run)
    text = paths.markdown.read_text()
    assert "curves.csv is missing" in text
    assert "No annealed branch is in results.csv for this fork" in text
    assert "%" not in text  # no share of the anneal's gain without an anneal
    assert not (run / "plots" / "loss_vs_tokens.png").exists()
    assert not (run / "plots" / "weightings.png").exists()  # one weighting: nothing to compare
    assert {p.name for p in paths.plots} == {"fork_gains.png", "sma_n_by_v.png", "n_v_sweeps.png"}
    assert untraceable(text, traceable_values(run)) == []
    assert "Headline: final fork F1" in text
    summary = summary_text(run)
    assert "No annealed branch" in summary and len(summary.splitlines()) <= 25


def test_empty_or_damaged_run_still_gets_a_report(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    paths = write_report(run)
    text = paths.markdown.read_text()
    assert "results.csv is missing" in text and "experiment.json is missing" in text
    assert paths.plots == [] and "<html" in paths.html.read_text()
    assert "not written yet" not in summary_text(run)

    (run / "experiment.json").write_text("{not json")
    (run / "results.csv").write_text(
        ",".join(RESULT_COLUMNS) + "\n2000,latest,,,,,2400,,nan,,,,,\n2000,merged,sma,4,100,,2400,,3.1\n"
    )
    text = write_report(run).markdown.read_text()
    assert "experiment.json is unreadable" in text
    assert "1 result rows without a model kind or a val_loss were skipped" in text
    assert "3.1000" in text and "nan" not in text.lower()


def test_stale_plots_are_removed_on_rerun(tmp_path: Path) -> None:
    run = build_run(tmp_path / "rerun", forks=FORKS[:1], weightings=[("sma", None)], ns=(2, 4), vs=(1,))
    write_report(run)
    assert (run / "plots" / "loss_vs_tokens.png").exists()
    (run / "curves.csv").unlink()
    write_report(run)
    assert not (run / "plots" / "loss_vs_tokens.png").exists()


def test_missing_run_dir_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(PmakitError, match="does not exist"):
        write_report(tmp_path / "nope")
    with pytest.raises(PmakitError, match="does not exist"):
        summary_text(tmp_path / "nope")


def test_jsonl_is_read_when_the_csv_is_missing(tmp_path: Path) -> None:
    run = build_run(
        tmp_path / "jsonl", forks=FORKS[:1], curves=False, weightings=[("sma", None)], ns=(2,), vs=(1,)
    )
    (run / "results.csv").rename(run / "results.bak")
    text = write_report(run).markdown.read_text()
    assert "read results.jsonl instead" in text and "Headline: final fork F1" in text


# --- summary and HTML ------------------------------------------------------------------------------------


def test_summary_fits_one_screen(full_run: Path) -> None:
    text = summary_text(full_run)
    lines = text.splitlines()
    # a screen: at most 25 lines, none longer than 100 characters apart from the run directory's own path
    assert len(lines) <= 25 and max(len(line.replace(str(full_run), "RUN")) for line in lines) <= 100
    assert str(full_run / "report.html") in text and str(full_run / "report.md") in text
    best = min(
        (r for r in read_rows(full_run) if r["fork_tokens"] == str(FORKS[-1][0]) and r["model"] == "merged"),
        key=lambda r: float(r["val_loss"]),
    )
    assert f"{float(best['val_loss']):.4f} ± {float(best['val_loss_se']):.4f}" in text
    assert untraceable(text.replace(str(full_run), ""), traceable_values(full_run)) == []


def test_html_is_self_contained(full_run: Path) -> None:
    page = (full_run / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5
    assert not re.search(r"(?:src|href)=\"(?!data:)", page)  # nothing fetched: no links, scripts or files
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture
def chromium() -> Iterator[str]:
    exe = _chromium()
    if exe is None:
        pytest.skip(
            "chromium is not installed: `make test` installs it when run as root (apt-get install chromium)"
        )
    yield exe


def test_html_renders_in_headless_chromium(full_run: Path, chromium: str, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    cmd = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--screenshot={shot}",
        "--window-size=1200,3000",
        (full_run / "report.html").resolve().as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert shot.exists(), proc.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)[..., :3]
    assert img.shape[:2] == (3000, 1200)
    assert img.std() > 0.1  # not a blank page
    colored = (img.max(axis=2) - img.min(axis=2)) > 0.25
    assert colored.mean() > 0.01, "no coloured pixels: the embedded plots did not render"
    assert colored[1500:].mean() > 0.01  # plots further down the page rendered too


CUTS = ["fork_tokens", "model", "n", "v_tokens", "tokens", "val_loss", "delta_vs_latest", "delta_se", "label"]


@pytest.mark.parametrize("drop", [*CUTS, "model=latest", "model=annealed", "fork rows"])
def test_any_missing_column_or_row_kind_gives_a_report_not_a_crash(tmp_path: Path, drop: str) -> None:
    run = build_run(
        tmp_path / "cut",
        batch_losses=False,
        curves=False,
        weightings=[("sma", None), ("wma", None)],
        ns=(2, 4),
        vs=(1, 2),
    )
    (run / "results.jsonl").unlink()
    rows = read_rows(run)
    if drop.startswith("model="):
        rows = [r for r in rows if r["model"] != drop.split("=")[1]]
    elif drop == "fork rows":
        rows = [r for r in rows if not r["fork_tokens"]]
    with (run / "results.csv").open("w", newline="") as fh:
        cols = [c for c in RESULT_COLUMNS if c != drop]
        w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    paths = write_report(run)
    text = paths.markdown.read_text()
    assert "could not be drawn" not in text
    assert "nan" not in text.lower() and "None" not in text
    assert untraceable(text, traceable_values(run)) == []
    assert len(summary_text(run).splitlines()) <= 25


def test_weightings_caption_says_whether_the_run_agrees_with_finding_4(tmp_path: Path) -> None:
    # At the early fork WMA's shorter effective window loses less to staleness than SMA's: gains 0.0357 vs 0.0306.
    run = build_run(
        tmp_path / "f4", forks=FORKS[:1], weightings=[("sma", None), ("wma", None)], ns=(16,), vs=(1,)
    )
    write_report(run)
    text = (run / "report.md").read_text()
    assert (
        "This run agrees with the paper's finding 4 (early in training, WMA and EMA with the larger α are best) "
        "at its earliest fork: the best weighting there is WMA." in text
    )
    run = build_run(
        tmp_path / "f4b", forks=FORKS[:1], weightings=[("sma", None), ("wsm-1sqrt", None)], ns=(16,), vs=(1,)
    )
    write_report(run)
    assert "does not agree with the paper's finding 4" in (run / "report.md").read_text()
