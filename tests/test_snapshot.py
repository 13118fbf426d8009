import json
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.formats.safetensors_io import save_file
from pmakit.snapshot import IncompleteSnapshot, discover, gather, read_snapshot, write_metadata


def test_discover_orders_by_tokens(make_run: Callable[..., Path]) -> None:
    run = make_run(3)
    found = discover(run)
    assert [s.tokens for s in found] == [1000, 2000, 3000]
    assert [s.step for s in found] == [100, 200, 300]
    assert found[0].lr == 1e-3


def test_snapshot_without_metadata_is_skipped_with_warning(
    make_run: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    run = make_run(2)
    crashed = run / "step-000300"
    crashed.mkdir()
    save_file(state(3), crashed / "model.safetensors")  # weights written, metadata never
    with caplog.at_level("WARNING"):
        found = discover(run)
    assert [s.step for s in found] == [100, 200]
    assert "step-000300" in caplog.text and "pmakit.json" in caplog.text


def test_snapshots_in_a_subfolder_and_other_files_ignored(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_snapshot(run / "snapshots" / "step-10", state(1), step=10, tokens=100)
    write_snapshot(run / "snapshots" / "step-20", state(2), step=20, tokens=200)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "notes").mkdir()
    assert [s.tokens for s in discover(run)] == [100, 200]


def test_merged_outputs_and_hidden_dirs_are_not_snapshots(make_run: Callable[..., Path]) -> None:
    run = make_run(2)
    merged = run / "merged"
    merged.mkdir()
    save_file(state(9), merged / "model.safetensors")
    (merged / "pmakit-merge.json").write_text("{}")
    hidden = run / ".merged.pmakit-partial"
    hidden.mkdir()
    save_file(state(9), hidden / "model.safetensors")
    assert len(discover(run)) == 2


def test_hf_trainer_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoint-500"
    ckpt.mkdir()
    save_file(state(1), ckpt / "model.safetensors")
    trainer_state = {
        "global_step": 500,
        "num_input_tokens_seen": 2_048_000,
        "log_history": [{"loss": 2.5, "learning_rate": 3e-4, "step": 500}],
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state))
    snap = read_snapshot(ckpt)
    assert (snap.tokens, snap.step, snap.lr, snap.loss, snap.source) == (
        2_048_000,
        500,
        3e-4,
        2.5,
        "hf-trainer",
    )
    trainer_state["num_input_tokens_seen"] = 0
    (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state))
    with pytest.raises(IncompleteSnapshot, match="tokens-per-step"):
        read_snapshot(ckpt)
    assert read_snapshot(ckpt, tokens_per_step=4096).tokens == 500 * 4096


def test_step_in_name_with_tokens_per_step(tmp_path: Path) -> None:
    d = tmp_path / "step-000300"
    d.mkdir()
    save_file(state(1), d / "model.safetensors")
    with pytest.raises(IncompleteSnapshot, match="--tokens-per-step"):
        read_snapshot(d)
    snap = read_snapshot(d, tokens_per_step=1000)
    assert (snap.step, snap.tokens, snap.source) == (300, 300_000, "name")


def test_bad_metadata(tmp_path: Path) -> None:
    d = write_snapshot(tmp_path / "s", state(1), step=1, tokens=10)
    (d / "pmakit.json").write_text('{"step": 1, "tokens": "many"}')
    with pytest.raises(IncompleteSnapshot, match="'tokens' must be"):
        read_snapshot(d)
    (d / "pmakit.json").write_text("{not json")
    with pytest.raises(IncompleteSnapshot, match="unreadable"):
        read_snapshot(d)


def test_write_metadata_is_atomic_and_complete(tmp_path: Path) -> None:
    write_metadata(tmp_path, step=3, tokens=30, lr=0.1, loss=2.0, run="x")
    meta = json.loads((tmp_path / "pmakit.json").read_text())
    assert meta["tokens"] == 30 and meta["run"] == "x" and meta["format_version"] == 1
    assert not list(tmp_path.glob(".*tmp"))


def test_gather_explicit_and_duplicates(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(3)
    snaps, from_run = gather([run / "step-000300", run / "step-000100"])
    assert [s.step for s in snaps] == [100, 300] and not from_run
    snaps, from_run = gather([run], exclude=[run / "step-000200"])
    assert [s.step for s in snaps] == [100, 300] and from_run
    with pytest.raises(PmakitError, match="no such snapshot"):
        gather([tmp_path / "nope"])
    other = write_snapshot(tmp_path / "other", state(7), step=1, tokens=1000)
    with pytest.raises(PmakitError, match="two snapshots at 1000 tokens"):
        gather([run, other])
