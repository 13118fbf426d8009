"""Files carried from an input checkpoint into the output (tokenizer, config, OLMo-core's ``train/``) are copied only
when they resolve inside that checkpoint: a symlink to a file elsewhere is skipped with a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from conftest import run_cli, state, write_snapshot
from pmakit.layouts import olmo_core
from pmakit.runs import resolves_inside


def test_an_extra_file_linked_from_outside_is_not_copied(tmp_path: Path) -> None:
    secret = tmp_path / "elsewhere" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not part of the checkpoint")
    run = tmp_path / "run"
    for i in range(2):
        write_snapshot(run / f"step-{i + 1}", state(i), step=i + 1, tokens=100 * (i + 1))
    newest = run / "step-2"
    (newest / "tokenizer.json").symlink_to(secret)
    (newest / "vocab").mkdir()
    (newest / "vocab" / "merges.txt").write_text("a b")
    (newest / "merges.txt").symlink_to(newest / "vocab" / "merges.txt")  # inside: copied
    result = run_cli("merge", run, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "merges.txt").read_text() == "a b"
    assert "not copying" in result.stderr and "tokenizer.json" in result.stderr
    assert "not part of the checkpoint" not in "".join(
        p.read_text(errors="replace") for p in (tmp_path / "out").iterdir() if p.is_file()
    )


def test_olmo_core_train_files_linked_from_outside_are_not_copied(tmp_path: Path) -> None:
    outside = tmp_path / "other" / "rank1.pt"
    outside.parent.mkdir()
    outside.write_bytes(b"theirs")
    template = tmp_path / "step10"
    (template / "train").mkdir(parents=True)
    (template / "train" / "rank0.pt").write_bytes(b"ours")
    (template / "train" / "rank1.pt").symlink_to(outside)
    shutil.copytree(template / "train", tmp_path / "out", ignore=olmo_core._outside(template))
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rank0.pt"]


def test_resolves_inside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_text("")
    (root / "in").symlink_to(root / "a")
    (root / "out").symlink_to(tmp_path)
    (root / "loop").symlink_to(root / "loop")
    assert resolves_inside(root / "a", root) and resolves_inside(root / "in", root)
    assert not resolves_inside(root / "out", root)
    assert not resolves_inside(root / "loop", root)
    assert not resolves_inside(root / "missing", root)


def test_a_checkpoint_linked_from_outside_the_run_is_merged_and_said(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for i in range(2):
        write_snapshot(run / f"step-{i + 1}", state(i), step=i + 1, tokens=100 * (i + 1))
    write_snapshot(tmp_path / "elsewhere" / "step-3", state(2), step=3, tokens=300)
    (run / "step-3").symlink_to(tmp_path / "elsewhere" / "step-3")
    result = run_cli("merge", run, "-o", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert "symlink to" in result.stderr and "outside the run" in result.stderr
    inputs = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())["inputs"]
    assert [x["path"] for x in inputs][-1] == str((tmp_path / "elsewhere" / "step-3").resolve())
    named = run_cli("merge", run / "step-1", run / "step-3", "-o", tmp_path / "out2")
    assert named.returncode == 0, named.stderr
    assert "is a symlink to" in named.stderr
    assert str(tmp_path / "elsewhere" / "step-3") in (tmp_path / "out2" / "pmakit-merge.json").read_text()


def test_megatron_write_back_refuses_a_common_pt_linked_from_outside(tmp_path: Path) -> None:
    import pytest

    from pmakit.errors import PmakitError
    from pmakit.layouts import megatron

    (tmp_path / "other.pt").write_bytes(b"theirs")
    template = tmp_path / "iter_0000010"
    template.mkdir()
    (template / "common.pt").symlink_to(tmp_path / "other.pt")
    (template / "metadata.json").write_text("{}")
    with pytest.raises(PmakitError, match="outside the checkpoint"):
        megatron.LAYOUT.write({}, template, tmp_path / "out", distributed=False, fsync=False)
    assert not (tmp_path / "out").exists()
