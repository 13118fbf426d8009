"""Runs that must not mix: a continuation after `pmakit recover` never leaves the abandoned trajectory's snapshots
where `pmakit merge RUN` finds them; `pmakit experiment -o` refuses a directory holding another kind of run."""

from __future__ import annotations

import json
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli
from pmakit.snapshot import discover
from pmakit.train.callbacks import Callback, StopTraining

TINY = (
    "train: {corpus: null, max_corpus_bytes: 300000, vocab_size: 300, val_fraction: 0.2, batch_size: 4,\n"
    "  model: {layers: 1, hidden: 32, heads: 2, seq_len: 32}, total_tokens: 5120, warmup_tokens: 0,\n"
    "  every_tokens: 640, average_last: 2, eval_every: 0, eval_batches: 2, log_every: 1}\n"
)


class StopAfterOneSnapshot(Callback):
    """A continuation that stops part-way (a crash, a pre-emption): after its first snapshot."""

    def on_snapshot(self, trainer: Any, snapshot: Any) -> None:
        raise StopTraining("stopped part-way")


def test_a_continuation_after_recover_never_merges_two_trajectories(tmp_path: Path) -> None:
    from pmakit.train.loop import TrainConfig, saved_config, train

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    run = tmp_path / "run"
    assert run_cli("train", cfg, "-o", run).returncode == 0
    old = {s.tokens: json.loads((s.path / "pmakit.json").read_text()) for s in discover(run / "snapshots")}
    assert max(old) == 5120
    proc = run_cli("recover", run, "--before", "2000", "--last", "2", "-o", tmp_path / "rec")
    assert proc.returncode == 0, proc.stderr
    args = shlex.split(proc.stdout.rsplit("resume with: ", 1)[1].strip())
    assert args[:3] == ["pmakit", "train", "--resume-from"] and args[4:] == ["-o", str(run)]
    rec, out = Path(args[3]), Path(args[5])
    # The printed continuation, stopped part-way after its first snapshot (at 1920 + 640 tokens).
    saved = saved_config(out)
    assert saved is not None
    train(
        TrainConfig.from_dict(saved), out, resume_from=rec, callbacks=[StopAfterOneSnapshot()], progress=False
    )
    kept = {s.tokens: json.loads((s.path / "pmakit.json").read_text()) for s in discover(run / "snapshots")}
    assert sorted(kept) == [640, 1280, 1920, 2560]
    assert kept[2560] != old[2560] and all(kept[t] == old[t] for t in (640, 1280, 1920))
    aside = run / "discarded" / "rollback-1920"
    assert sorted(p.name for p in aside.iterdir()) == sorted(
        [*(f"step-{t // 128:08d}" for t in old if t > 1920), "checkpoint"]
    )
    merged = run_cli("merge", run, "-o", tmp_path / "merged")  # the default merge: the newest snapshots
    assert merged.returncode == 0, merged.stderr
    manifest = json.loads((tmp_path / "merged" / "pmakit-merge.json").read_text())
    tokens = [i["tokens"] for i in manifest["inputs"]]
    assert max(tokens) == 2560 and all(t <= 2560 for t in tokens), tokens


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def short_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real `pmakit train` run of 5 steps (copy it before changing it)."""
    root = tmp_path_factory.mktemp("short")
    cfg = root / "tiny.yaml"
    cfg.write_text(TINY.replace("total_tokens: 5120", "total_tokens: 640"))
    proc = run_cli("train", cfg, "-o", root / "run")
    assert proc.returncode == 0, proc.stderr
    return root / "run"


def test_experiment_refuses_a_directory_holding_a_train_run(short_run: Path, tmp_path: Path) -> None:
    run = Path(shutil.copytree(short_run, tmp_path / "run"))
    before = _listing(run)
    proc = run_cli("experiment", "--preset", "smoke", "-o", run)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "holds a `pmakit train` run" in errors[0], (
        proc.stderr
    )
    assert "Traceback" not in proc.stderr and _listing(run) == before  # no main/, config.json, plots/


def test_experiment_refuses_a_directory_holding_another_study(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "experiment.json").write_text(json.dumps({"study": "sweep"}))
    before = _listing(run)
    proc = run_cli("experiment", "--preset", "smoke", "-o", run)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "holds the sweep study, not the pma" in errors[0]
    assert _listing(run) == before


def test_report_of_a_train_run_with_a_deeply_nested_metrics_line_is_one_line(
    short_run: Path, tmp_path: Path
) -> None:
    run = Path(shutil.copytree(short_run, tmp_path / "run"))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    proc = run_cli("report", run)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("Error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "json-depth = 64" in errors[0] and "metrics.jsonl:" in errors[0], errors
