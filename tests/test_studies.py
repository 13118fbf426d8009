"""The spike-recovery and PMA-init studies (`pmakit experiment --preset spike|init`) end to end through the real CLI,
on tiny configs overriding the presets, checked against the run's own files and against recomputations."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import run_cli
from pmakit.errors import PmakitError
from pmakit.lab.recovery import (
    STUDY_COLUMNS,
    continue_schedule,
    push_schedule,
    resolve_study,
    resume_schedule,
)
from pmakit.recover import choose_rollback, find_spikes, loss_lag_tokens, spike_boundary
from pmakit.snapshot import discover

TINY_TRAIN = {
    "max_corpus_bytes": 600_000,
    "vocab_size": 320,
    "model": {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 64},
    "batch_size": 8,  # 512 tokens per step
    "lr": 5.0e-3,
    "warmup_tokens": 5120,
    "every_tokens": 2560,  # 5 steps
    "eval_batches": 4,
}
TINY_SPIKE = {
    "preset": "spike",
    "study": "spike",
    "train": {**TINY_TRAIN, "total_tokens": 51200, "eval_every": 2},
    "spike": {
        "seeds": [0, 1],
        "push_at": 30720,  # step 60
        "push_factor": 60,
        "push_tokens": 5120,
        "detector": {"window": 30, "min_history": 15},
    },
}
TINY_INIT = {
    "preset": "init",
    "study": "init",
    "train": {**TINY_TRAIN, "eval_every": 1},
    "init": {
        "seeds": [0, 1],
        "init_at": 30720,
        "n": 4,
        "continue_tokens": 15360,
        "warmup_tokens": 2560,
        "early_tokens": 5120,
    },
}


def _run(tmp: Path, name: str, config: dict[str, Any], *extra: str) -> tuple[Path, Any]:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(config))
    run = tmp / name
    proc = run_cli("experiment", cfg, "-o", run, *extra, timeout=1800)
    return run, proc


@pytest.fixture(scope="module")
def spike(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("spike")
    run, proc = _run(tmp, "spike", TINY_SPIKE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


@pytest.fixture(scope="module")
def init(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    tmp = tmp_path_factory.mktemp("init")
    run, proc = _run(tmp, "init", TINY_INIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


def rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]


def csv_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def find(rs: list[dict[str, Any]], seed: int, stage: str, model: str) -> dict[str, Any]:
    (row,) = [r for r in rs if (r["seed"], r["stage"], r["model"]) == (seed, stage, model)]
    return row


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("kind") == "train":
            out.append(r)
    return out


# ------------------------------------------------------------------------------------------------- spike study


SPIKE_ARMS = ["no-intervention", "latest/reset", "sma3/reset", "latest/keep", "sma3/keep"]


def test_spike_writes_every_output_with_the_documented_columns(spike: tuple[Path, str]) -> None:
    run, stdout = spike
    for name in ("results.csv", "results.jsonl", "curves.csv", "train_curves.csv", "experiment.json",
                 "report.md", "report.html", "plots/spike_val_loss.png", "plots/spike_train_loss.png"):  # fmt: skip
        assert (run / name).is_file(), name
    with open(run / "results.csv") as f:
        assert next(csv.reader(f)) == list(STUDY_COLUMNS)
    exp = json.loads((run / "experiment.json").read_text())
    assert exp["study"] == "spike" and exp["preset"] == "spike"
    assert "stable-phase LR x 1 = 0.005" in exp["resume_lr"]
    assert "Spike-recovery study" in stdout and "sma3/reset" in stdout
    # every arm of every seed, scored at the end of the run
    rs = rows(run)
    for seed in (0, 1):
        for arm in SPIKE_ARMS:
            assert find(rs, seed, "final", arm)["tokens"] == 51200
        assert {find(rs, seed, "start", m)["model"] for m in ("latest", "sma3")} == {"latest", "sma3"}
    assert len(rs) == 2 * (len(SPIKE_ARMS) + 2)
    assert len(csv_rows(run / "results.csv")) == len(rs)


def test_the_pushed_run_really_spikes_and_the_detector_found_it(spike: tuple[Path, str]) -> None:
    run, _ = spike
    exp = json.loads((run / "experiment.json").read_text())
    tps = exp["tokens_per_step"]
    for seed in (0, 1):
        records = train_records(run / f"seed-{seed}" / "run")
        before = [r["loss"] for r in records if 20_000 < r["tokens"] <= 30720]
        during = [r["loss"] for r in records if 30720 < r["tokens"] <= 30720 + 5120]
        # a real spike: the loss during the push rises well above the stable phase's
        assert max(during) > statistics.median(before) + 1.0
        info = exp["seeds"][str(seed)]
        spike = info["spike"]
        assert 30720 < spike["start_tokens"] <= 30720 + 5120
        # the same detector on the logged losses finds the same start; the merged snapshots are exactly
        # choose_rollback's pick before the boundary
        from pmakit.recover import SpikeConfig

        cfg = SpikeConfig(**{**info["detector"]})
        found = [s for s in find_spikes(records, cfg) if s.start_tokens > 30720]
        assert found[0].start_tokens == spike["start_tokens"]
        boundary = spike_boundary(found[0], loss_lag_tokens(records))
        assert boundary == info["boundary_tokens"] == spike["start_tokens"] - tps
        chosen = choose_rollback(discover(run / f"seed-{seed}" / "run" / "snapshots"), boundary, 3)
        assert [m["tokens"] for m in info["merged"]] == [s.tokens for s in chosen]
        assert all(m["tokens"] < spike["start_tokens"] for m in info["merged"])
        assert [m["weight"] for m in info["merged"]] == pytest.approx([1 / 3] * 3)
        assert info["resume_tokens"] == chosen[-1].tokens


def test_spike_rows_are_consistent_with_their_batch_losses(spike: tuple[Path, str]) -> None:
    run, _ = spike
    rs = rows(run)
    for r in rs:
        assert r["val_loss"] == pytest.approx(statistics.fmean(r["batch_losses"]), rel=1e-6)
    for seed in (0, 1):
        control = find(rs, seed, "final", "no-intervention")
        for opt in ("reset", "keep"):
            latest, merged = find(rs, seed, "final", f"latest/{opt}"), find(rs, seed, "final", f"sma3/{opt}")
            diffs = [a - b for a, b in zip(merged["batch_losses"], latest["batch_losses"])]
            assert merged["delta_vs_latest"] == pytest.approx(statistics.fmean(diffs), abs=1e-7)
            assert merged["delta_se"] == pytest.approx(
                statistics.stdev(diffs) / math.sqrt(len(diffs)), rel=1e-5
            )
            assert latest["delta_vs_latest"] == 0.0
            for row in (latest, merged):
                assert row["delta_vs_control"] == pytest.approx(
                    row["val_loss"] - control["val_loss"], abs=1e-6
                )
                assert row["optimizer"] == opt and row["start_tokens"] == merged["start_tokens"]
        start = find(rs, seed, "start", "sma3")
        assert (
            start["window_start_tokens"]
            < start["tokens"]
            == find(rs, seed, "final", "sma3/keep")["start_tokens"]
        )


def test_each_arm_starts_from_its_weights_on_the_same_data(spike: tuple[Path, str]) -> None:
    run, _ = spike
    rs = rows(run)
    curves = csv_rows(run / "curves.csv")
    steps = csv_rows(run / "train_curves.csv")
    for seed in (0, 1):
        start = find(rs, seed, "start", "latest")["tokens"]
        for family in ("latest", "sma3"):
            start_loss = find(rs, seed, "start", family)["val_loss"]
            for opt in ("reset", "keep"):
                arm = f"{family}/{opt}"
                first = min((c for c in curves if c["arm"] == arm and c["seed"] == str(seed)),
                            key=lambda c: int(c["tokens"]))  # fmt: skip
                # the arm's curve starts at the resume point with exactly the starting weights' loss
                assert int(first["tokens"]) == start
                assert float(first["val_loss"]) == pytest.approx(start_loss, abs=1e-5)

        # same weights and batch on the first step: the first training loss of reset and keep arms agree,
        # then the optimizers make them differ
        def first_losses(arm: str, seed: int = seed) -> list[float]:
            s = sorted(
                (r for r in steps if r["arm"] == arm and r["seed"] == str(seed)), key=lambda r: int(r["step"])
            )
            return [float(r["loss"]) for r in s[:3]]

        reset, keep = first_losses("latest/reset"), first_losses("latest/keep")
        assert reset[0] == pytest.approx(keep[0], abs=1e-5)
        assert reset[1:] != pytest.approx(keep[1:], abs=1e-6)
        # the rollback events record the optimizer policy
        for arm, policy in (("latest-reset", "reset"), ("sma3-keep", "keep")):
            events = [
                json.loads(line)
                for line in (run / f"seed-{seed}" / arm / "metrics.jsonl").read_text().splitlines()
            ]
            (rollback,) = [e for e in events if e.get("event") == "rollback"]
            assert rollback["optimizer"] == policy and rollback["tokens"] == start


def test_resumed_arms_train_at_the_stated_lr(spike: tuple[Path, str]) -> None:
    run, _ = spike
    steps = csv_rows(run / "train_curves.csv")
    pushed = [
        float(r["lr"]) for r in steps if r["arm"] == "no-intervention" and 30720 < int(r["tokens"]) <= 35840
    ]
    assert pushed and all(lr == pytest.approx(0.3) for lr in pushed)  # 60 x 5e-3
    for arm in ("latest/reset", "sma3/keep"):
        lrs = [float(r["lr"]) for r in steps if r["arm"] == arm]
        assert lrs and all(lr == pytest.approx(5e-3) for lr in lrs)


def test_spike_report_shows_the_measured_numbers(spike: tuple[Path, str]) -> None:
    run, _ = spike
    md = (run / "report.md").read_text()
    rs = rows(run)
    for arm in SPIKE_ARMS:
        mean = statistics.fmean(find(rs, s, "final", arm)["val_loss"] for s in (0, 1))
        assert f"{mean:.4f}" in md, arm
    d = statistics.fmean(find(rs, s, "final", "sma3/reset")["delta_vs_latest"] for s in (0, 1))
    assert f"{d:+.4f}" in md
    assert "LR of the resumed arms" in md and "spike start" in md
    assert "data:image/png;base64," in (run / "report.html").read_text()


def test_spike_rerun_resumes_without_training_and_a_changed_config_is_refused(
    spike: tuple[Path, str], tmp_path: Path
) -> None:
    run, _ = spike
    before = (run / "results.jsonl").read_text()
    cfg = tmp_path / "same.yaml"
    cfg.write_text(yaml.safe_dump(TINY_SPIKE))
    proc = run_cli("experiment", cfg, "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "arm " not in proc.stderr and "main run" not in proc.stderr
    assert (run / "results.jsonl").read_text() == before
    changed = {**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "push_factor": 30}}
    cfg.write_text(yaml.safe_dump(changed))
    proc = run_cli("experiment", cfg, "-o", run, timeout=1800)
    assert proc.returncode == 1 and "spike.push_factor" in proc.stderr and "Traceback" not in proc.stderr


def test_adding_a_seed_runs_only_the_new_seed(spike: tuple[Path, str], tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(spike[0], run)
    before = (run / "results.jsonl").read_text()
    more = {**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "seeds": [0, 1, 2]}}
    cfg = tmp_path / "more.yaml"
    cfg.write_text(yaml.safe_dump(more))
    proc = run_cli("experiment", cfg, "-o", run, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "seed 2: main run" in proc.stderr and "seed 0: main run" not in proc.stderr
    after = (run / "results.jsonl").read_text()
    assert after.startswith(before)
    rs = rows(run)
    assert len(rs) == 3 * (len(SPIKE_ARMS) + 2)
    assert find(rs, 2, "final", "sma3/keep")["tokens"] == 51200
    assert "seed 2" in (run / "report.md").read_text()


# -------------------------------------------------------------------------------------------------- init study


def test_init_outputs_rows_and_report(init: tuple[Path, str]) -> None:
    run, stdout = init
    for name in ("results.csv", "curves.csv", "train_curves.csv", "report.md", "report.html",
                 "plots/init_val_loss.png", "plots/init_grad_norm.png"):  # fmt: skip
        assert (run / name).is_file(), name
    exp = json.loads((run / "experiment.json").read_text())
    assert exp["study"] == "init"
    rs = rows(run)
    assert len(rs) == 2 * 2 * 3
    for seed in (0, 1):
        for arm in ("latest", "sma4"):
            assert find(rs, seed, "start", arm)["tokens"] == 30720
            assert find(rs, seed, "early", arm)["tokens"] == 30720 + 5120
            assert find(rs, seed, "final", arm)["tokens"] == 30720 + 15360
            assert find(rs, seed, "final", arm)["optimizer"] == "reset"
        merged = find(rs, seed, "start", "sma4")
        assert merged["window_start_tokens"] == 30720 - 3 * 2560
        for stage in ("start", "early", "final"):
            a, b = find(rs, seed, stage, "sma4"), find(rs, seed, stage, "latest")
            diffs = [x - y for x, y in zip(a["batch_losses"], b["batch_losses"])]
            assert a["delta_vs_latest"] == pytest.approx(statistics.fmean(diffs), abs=1e-7)
    md = (run / "report.md").read_text()
    final = statistics.fmean(find(rs, s, "final", "sma4")["val_loss"] for s in (0, 1))
    assert f"{final:.4f}" in md and "Gradient norm" in md
    assert "PMA-init study" in stdout


def test_init_grad_stats_and_schedule_match_the_per_step_log(init: tuple[Path, str]) -> None:
    run, _ = init
    rs = rows(run)
    steps = csv_rows(run / "train_curves.csv")
    for seed in (0, 1):
        per_arm = {}
        for arm in ("latest", "sma4"):
            s = sorted(
                (r for r in steps if r["arm"] == arm and r["seed"] == str(seed)), key=lambda r: int(r["step"])
            )
            per_arm[arm] = s
            early = [float(r["grad_norm"]) for r in s if 30720 < int(r["tokens"]) <= 30720 + 5120]
            row = find(rs, seed, "early", arm)
            assert len(early) == 10
            assert row["grad_norm_mean"] == pytest.approx(statistics.fmean(early), rel=1e-6)
            assert row["grad_norm_max"] == pytest.approx(max(early), rel=1e-6)
            tv = statistics.fmean(abs(b - a) for a, b in zip(early, early[1:]))
            assert row["grad_norm_tv"] == pytest.approx(tv, rel=1e-6)
        # both arms follow the same new schedule: warmup from 0 over 5 steps, peak 5e-3, cosine to 0
        lr_a = [float(r["lr"]) for r in per_arm["latest"]]
        assert lr_a == pytest.approx([float(r["lr"]) for r in per_arm["sma4"]])
        assert lr_a[0] == pytest.approx(5e-3 * 512 / 2560)
        assert max(lr_a) == pytest.approx(5e-3)
        assert lr_a[-1] == pytest.approx(0.0, abs=1e-9)


# ---------------------------------------------------------------------------------------------- config, schedules


def test_study_configs_are_validated() -> None:
    with pytest.raises(PmakitError, match="multiple of every_tokens"):
        resolve_study({**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "push_at": 30000}})
    with pytest.raises(PmakitError, match="unknown spike config keys: bogus"):
        resolve_study({**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "bogus": 1}})
    with pytest.raises(PmakitError, match="unknown spike.detector config keys: windw; known: grad_threshold"):
        resolve_study({**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "detector": {"windw": 3}}})
    with pytest.raises(PmakitError, match="resume_lr"):
        resolve_study({**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "resume_lr": "low"}})
    with pytest.raises(PmakitError, match="unknown study"):
        resolve_study({"study": "nope"})
    with pytest.raises(PmakitError, match="snapshots"):
        resolve_study({**TINY_INIT, "init": {**TINY_INIT["init"], "n": 20}})


def test_schedules() -> None:
    study = resolve_study(TINY_SPIKE)
    spec, cfg = study.spec, study.train
    lr = push_schedule(cfg, spec)  # type: ignore[arg-type]
    assert lr(30720) == pytest.approx(5e-3) and lr(30721) == pytest.approx(0.3)
    assert lr(35840) == pytest.approx(0.3) and lr(35841) == pytest.approx(5e-3)
    # the study keeps full checkpoints at every snapshot time around the push
    assert {30720 - 2560, 30720, 33280} <= set(cfg.keep_checkpoints_at)
    resumed = resume_schedule(cfg, spec, 30720)  # type: ignore[arg-type]
    assert resumed(31000) == pytest.approx(5e-3)
    pushed = resolve_study({**TINY_SPIKE, "spike": {**TINY_SPIKE["spike"], "resume_lr": "pushed",
                                                     "resume_lr_factor": 0.5}})  # fmt: skip
    assert resume_schedule(pushed.train, pushed.spec, 30720)(31000) == pytest.approx(0.15)  # type: ignore[arg-type]
    init = resolve_study(TINY_INIT)
    c = continue_schedule(init.train, init.spec)  # type: ignore[arg-type]
    assert init.train.total_tokens == 30720 + 15360
    assert c(30720) == pytest.approx(5e-3)  # the constant-LR run up to the start
    assert c(30720 + 1280) == pytest.approx(2.5e-3)  # half way up the warmup
    assert c(30720 + 2560) == pytest.approx(5e-3)
    assert c(30720 + 2560 + 6400) == pytest.approx(2.5e-3)  # half way down the cosine
    assert c(46080) == pytest.approx(0.0, abs=1e-12)
