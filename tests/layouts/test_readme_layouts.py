"""The framework block of docs/frameworks.md (`pmakit inspect SAVE_FOLDER`, `pmakit merge SAVE_FOLDER -o OUT`,
...) runs as written on save folders the frameworks' own trainers wrote (tests/test_readme.py runs every other
block)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_readme import readme_blocks, run_shell_block

KEY = "pmakit inspect SAVE_FOLDER"


def framework_block() -> str:
    (block,) = [b for b in readme_blocks() if b.key.startswith(KEY)]
    return block.text


def test_readme_framework_block_on_olmo_core(olmo_core_runs: dict[str, Path], tmp_path: Path) -> None:
    run_shell_block(framework_block(), tmp_path, {"SAVE_FOLDER": str(olmo_core_runs["ws1"])})
    assert (tmp_path / "OUT" / "model.safetensors").is_file()  # the last line: --format safetensors


@pytest.mark.parametrize(  # the mark keeps each case in its fixture's xdist group (not trained again elsewhere)
    "fixture", [pytest.param(f, marks=pytest.mark.shares(f)) for f in ("torchtitan_runs", "megatron_runs")]
)
def test_readme_framework_block_on_other_frameworks(
    fixture: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    try:
        runs = request.getfixturevalue(fixture)
    except pytest.FixtureLookupError:
        pytest.skip(f"no {fixture} fixture in tests/layouts/conftest.py yet (issue 11)")
    run_shell_block(framework_block(), tmp_path, {"SAVE_FOLDER": str(runs["ws1"])})
