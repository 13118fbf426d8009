"""Random byte-level corruption of a valid snapshot never crashes pmakit, never hangs, and never yields a wrong merge.

Hypothesis flips, truncates or inserts bytes in one file of a three-snapshot run (a safetensors header or body, a
shard index, ``pmakit.json``, a torch zip) and runs ``pmakit merge`` through the real CLI. Either pmakit refuses
with one ``Error:`` line and leaves no output, or it succeeds and its output equals the merge computed from the
same (corrupted) files as read by the trusted readers (the safetensors library, ``torch.load``): a file those
refuse must be refused by pmakit too.
"""

from __future__ import annotations

import faulthandler
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import state, write_snapshot
from pmakit.cli import cli
from pmakit.merge import average_states, partial_dir
from test_merge import assert_one_ulp

STEPS = (100, 200, 300)
SETTINGS = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def build(root: Path, fmt: str) -> Path:
    run = root / "run"
    for i, step in enumerate(STEPS, 1):
        write_snapshot(run / f"step-{step:06d}", state(i), step=step, tokens=step * 10, fmt=fmt)
    return run


@st.composite
def corruption(draw: st.DrawFn, size: int) -> tuple[str, int, bytes]:
    kind = draw(st.sampled_from(["flip", "flip", "truncate", "insert"]))
    # Half the positions in the first 256 bytes, where headers and structure live.
    at = draw(st.one_of(st.integers(0, min(size, 256) - 1), st.integers(0, size - 1)))
    data = draw(st.binary(min_size=1, max_size=4))
    return kind, at, data


def corrupt(file: Path, how: tuple[str, int, bytes]) -> None:
    kind, at, data = how
    raw = bytearray(file.read_bytes())
    if kind == "flip":
        for k, b in enumerate(data):
            if at + k < len(raw):
                raw[at + k] ^= b or 0x01
    elif kind == "truncate":
        del raw[at:]
    else:
        raw[at:at] = data
    file.write_bytes(bytes(raw))


def run_merge(run: Path, out: Path) -> Any:
    faulthandler.dump_traceback_later(60, exit=True)  # a hang fails loudly instead of stalling the suite
    try:
        return CliRunner().invoke(cli, ["merge", str(run), "--last", "3", "-o", str(out), "-q"])
    finally:
        faulthandler.cancel_dump_traceback_later()


def check_refusal(result: Any, out: Path) -> None:
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith("Error: "), result.stderr
    assert not out.exists() and not partial_dir(out).exists()  # nothing written, nothing half-written


def trusted_load(directory: Path) -> dict[str, torch.Tensor] | None:
    """The snapshot's weights as the reference libraries read them, or None if they refuse the files."""
    try:
        if (directory / "model.safetensors").exists():
            from safetensors.torch import load_file

            return dict(load_file(directory / "model.safetensors"))
        with zipfile.ZipFile(directory / "model.pt") as z:
            if z.testzip() is not None:
                return None
        loaded = torch.load(directory / "model.pt", weights_only=True)
        return loaded if isinstance(loaded, dict) else None
    except Exception:
        return None


def check_output(run: Path, out: Path) -> None:
    loaded = [trusted_load(run / f"step-{s:06d}") for s in STEPS]
    assert all(s is not None for s in loaded), "pmakit merged a file the reference library refuses"
    states = [s for s in loaded if s is not None]
    from safetensors.torch import load_file

    got = load_file(out / "model.safetensors")
    # The expectation worked out here, not by pmakit: the fp64 mean of the three inputs as the reference readers
    # read them, cast once, within one ulp of the output dtype (a float tensor), or the newest input's tensor (a
    # counter). A wrong weight, a dropped or doubled input or a sum in bf16 moves values by more than that.
    assert got.keys() == states[-1].keys()
    for name, newest in states[-1].items():
        if newest.is_floating_point():
            assert_one_ulp(got[name], states, [1 / 3] * 3, name)
        else:
            assert torch.equal(got[name], newest), name
    # and bit for bit what the in-memory API computes from the same tensors (the engine's arithmetic, documented
    # as equal to ``merge``'s with dtype "same")
    expected = average_states(states, [1 / 3] * 3)
    for name, value in expected.items():
        assert torch.equal(got[name], value.to(got[name].dtype)), name


def check(run: Path, out: Path) -> Any:
    result = run_merge(run, out)
    event("merged" if result.exit_code == 0 else "refused")
    if result.exit_code == 0:
        check_output(run, out)
    else:
        check_refusal(result, out)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fuzz-base")
    return {fmt: build(base / fmt, fmt) for fmt in ("safetensors", "pt")}


def fresh(runs: dict[str, Path], fmt: str, tmp: Path) -> Path:
    work = tmp / "w"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(runs[fmt], work / "run", symlinks=True)
    return work


@SETTINGS
@given(how=corruption(7000))
def test_safetensors_file(runs: dict[str, Path], tmp_path: Path, how: tuple[str, int, bytes]) -> None:
    work = fresh(runs, "safetensors", tmp_path)
    file = work / "run" / "step-000300" / "model.safetensors"
    how = (how[0], how[1] % file.stat().st_size, how[2])
    corrupt(file, how)
    check(work / "run", work / "out")


@SETTINGS
@given(how=corruption(1400))
def test_torch_zip(runs: dict[str, Path], tmp_path: Path, how: tuple[str, int, bytes]) -> None:
    work = fresh(runs, "pt", tmp_path)
    file = work / "run" / "step-000300" / "model.pt"
    how = (how[0], how[1] % file.stat().st_size, how[2])
    corrupt(file, how)
    check(work / "run", work / "out")


@SETTINGS
@given(how=corruption(160))
def test_pmakit_json(runs: dict[str, Path], tmp_path: Path, how: tuple[str, int, bytes]) -> None:
    work = fresh(runs, "safetensors", tmp_path)
    meta = work / "run" / "step-000200" / "pmakit.json"
    how = (how[0], how[1] % meta.stat().st_size, how[2])
    corrupt(meta, how)
    result = run_merge(work / "run", work / "out")
    event("merged" if result.exit_code == 0 else "refused")
    if result.exit_code != 0:
        check_refusal(result, work / "out")
        return
    # Merged: the token count recorded is the file's own, a true integer (never `true` read as 1).
    record = json.loads(meta.read_text())
    manifest = json.loads((work / "out" / "pmakit-merge.json").read_text())
    tokens = {Path(i["path"]).name: i["tokens"] for i in manifest["inputs"]}
    assert type(tokens["step-000200"]) is int and tokens["step-000200"] == record["tokens"]


@SETTINGS
@given(how=corruption(300))
def test_shard_index(runs: dict[str, Path], tmp_path: Path, how: tuple[str, int, bytes]) -> None:
    work = fresh(runs, "safetensors", tmp_path)
    snap = work / "run" / "step-000300"
    (snap / "model.safetensors").rename(snap / "model-00001-of-00001.safetensors")
    weights = json.loads(json.dumps({k: "model-00001-of-00001.safetensors" for k in state(3)}))
    index = snap / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weights}))
    how = (how[0], how[1] % index.stat().st_size, how[2])
    corrupt(index, how)
    result = run_merge(work / "run", work / "out")
    event("merged" if result.exit_code == 0 else "refused")
    if result.exit_code != 0:
        check_refusal(result, work / "out")
        return
    (snap / "model-00001-of-00001.safetensors").rename(
        snap / "model.safetensors"
    )  # the reference reads it so
    check_output(work / "run", work / "out")
