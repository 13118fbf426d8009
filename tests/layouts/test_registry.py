"""The layout registry: first match wins, framework layouts before the generic ones, merged outputs ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import state, write_snapshot
from pmakit.errors import PmakitError
from pmakit.formats.safetensors_io import save_file
from pmakit.layouts import candidates, get_layout, layout_of, out_formats, writer


def test_first_match_wins_and_generic_layouts_come_last(tmp_path: Path) -> None:
    pmakit_snap = write_snapshot(tmp_path / "run" / "step-10", state(1), step=10, tokens=100)
    plain = tmp_path / "run" / "step-20"
    plain.mkdir()
    save_file(state(2), plain / "model.safetensors")
    olmo = tmp_path / "run" / "step30"
    (olmo / "model_and_optim").mkdir(parents=True)
    (olmo / "model_and_optim" / ".metadata").write_bytes(b"")  # also a plain DCP dir one level down
    (tmp_path / "run" / "step3-merged" / "model_and_optim").mkdir(parents=True)  # OLMo-core's own merge
    merged = tmp_path / "run" / "merged"
    merged.mkdir()
    save_file(state(3), merged / "model.safetensors")
    (merged / "pmakit-merge.json").write_text("{}")
    (tmp_path / "run" / "latest_checkpointed_iteration.txt").write_text("30")
    found = {p.name: layout.name for p, layout in candidates(tmp_path / "run")}
    assert found == {"step-10": "pmakit", "step-20": "hf-model", "step30": "olmo-core"}
    assert layout_of(pmakit_snap) is get_layout("pmakit")
    assert layout_of(tmp_path / "run" / "step3-merged") is None


def test_output_formats_and_unknown_names() -> None:
    assert {"safetensors", "dcp", "olmo-core"} <= set(out_formats())
    assert writer("olmo-core").name == "olmo-core"
    with pytest.raises(PmakitError, match="known: pmakit"):
        get_layout("nope")
    with pytest.raises(PmakitError, match="unknown output format"):
        writer("hf-model")  # a layout that does not write itself back
