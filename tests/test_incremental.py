"""--from-previous: the merge of a moved window from the previous merge's fp32 sums equals a full merge."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.merge import FP32_DIR, merge, plan_increment
from pmakit.snapshot import Snapshot, discover
from pmakit.weights import get_weights
from test_merge import load_dir, ordered_bits


def _full(snaps: list[Snapshot], method: str, out: Path, **options: object) -> None:
    merge(
        snaps,
        get_weights(method, len(snaps), alpha=0.3),
        out,
        fsync=False,
        manifest_extra={"method": method, "alpha": 0.3},
        **options,
    )  # type: ignore[arg-type]


def _update(previous: Path, snaps: list[Snapshot], method: str, out: Path, **options: object) -> int:
    w = get_weights(method, len(snaps), alpha=0.3)
    inc = plan_increment(previous, snaps, w, method=method, alpha=0.3)
    merge(
        inc.terms,
        inc.weights,
        out,
        fsync=False,
        window=(snaps, w),
        keep_fp32=True,
        manifest_extra={"method": method, "alpha": 0.3},
        **options,
    )  # type: ignore[arg-type]
    return inc.reads


@pytest.mark.parametrize("method", ["sma", "ema", "ema-normalized"])
def test_sliding_window_equals_full_merge_fp32(
    make_run: Callable[..., Path], tmp_path: Path, method: str
) -> None:
    snaps = discover(make_run(8, dtype=torch.float32))
    _full(snaps[0:4], method, tmp_path / "m0")
    # Slide by 1 (reads: sums + added + dropped, + the new oldest for EMA's seed), then by 2 from the update.
    reads = _update(tmp_path / "m0", snaps[1:5], method, tmp_path / "m1")
    assert reads == {"sma": 3, "ema": 4, "ema-normalized": 3}[method]
    _update(tmp_path / "m1", snaps[3:7], method, tmp_path / "m2")
    for out, window in [("m1", snaps[1:5]), ("m2", snaps[3:7])]:
        _full(window, method, tmp_path / f"full-{out}")
        got, want = load_dir(tmp_path / out), load_dir(tmp_path / f"full-{out}")
        assert got.keys() == want.keys()
        for k in want:
            if k == "step_counter":
                assert torch.equal(got[k], want[k])  # copied from the new window's newest snapshot
            else:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=2e-6)
    manifest = json.loads((tmp_path / "m2" / "pmakit-merge.json").read_text())
    assert manifest["produced_by"]["mode"] == "incremental"
    assert [i["tokens"] for i in manifest["inputs"]] == [s.tokens for s in snaps[3:7]]
    assert manifest["weights"] == pytest.approx(get_weights(method, 4, alpha=0.3))
    assert manifest["terms"][0]["path"].endswith("m1")  # the previous merge's sums


def test_bf16_output_keeps_fp32_sums(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(6))
    _full(snaps[0:4], "sma", tmp_path / "m0", keep_fp32=True)
    assert (tmp_path / "m0" / FP32_DIR / "model.safetensors").exists()
    # The cast output of a --keep-fp32 merge is the same bytes as a merge without it.
    _full(snaps[0:4], "sma", tmp_path / "plain")
    assert (tmp_path / "m0" / "model.safetensors").read_bytes() == (
        tmp_path / "plain" / "model.safetensors"
    ).read_bytes()
    _update(tmp_path / "m0", snaps[2:6], "sma", tmp_path / "m1")
    _full(snaps[2:6], "sma", tmp_path / "full", dtype="fp32")
    sums, want = load_dir(tmp_path / "m1" / FP32_DIR), load_dir(tmp_path / "full")
    got = load_dir(tmp_path / "m1")
    # Its terms mix the fp32 sums with bf16 snapshots; the window's snapshots are all bf16: no precision note.
    assert "precision" not in json.loads((tmp_path / "m1" / "pmakit-merge.json").read_text())
    for k in want:
        if k != "step_counter":
            torch.testing.assert_close(sums[k], want[k], rtol=0, atol=2e-6)
            assert got[k].dtype == torch.bfloat16
            # The fp32 sums differ from a full merge's by fp32 rounding: after the cast, at most 1 bf16 ulp.
            assert (ordered_bits(got[k]) - ordered_bits(want[k].bfloat16())).abs().max() <= 1


def test_refusals(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(6))
    _full(snaps[0:4], "sma", tmp_path / "bf16")  # no fp32 sums
    with pytest.raises(PmakitError, match="--keep-fp32"):
        plan_increment(tmp_path / "bf16", snaps[1:5], get_weights("sma", 4), method="sma", alpha=0.3)
    _full(snaps[0:4], "sma", tmp_path / "m0", keep_fp32=True)
    with pytest.raises(PmakitError, match="run a full merge"):
        plan_increment(tmp_path / "m0", snaps[1:5], get_weights("wma", 4), method="wma", alpha=0.3)
    with pytest.raises(PmakitError, match="sma merge"):
        plan_increment(tmp_path / "m0", snaps[1:5], get_weights("ema", 4), method="ema", alpha=0.3)
    with pytest.raises(PmakitError, match="shares no snapshot"):
        plan_increment(tmp_path / "m0", snaps[4:6], get_weights("sma", 2), method="sma", alpha=0.3)
    with pytest.raises(PmakitError, match="not a pmakit merge"):
        plan_increment(snaps[0].path, snaps[1:5], get_weights("sma", 4), method="sma", alpha=0.3)
    gone = snaps[0].path.rename(snaps[0].path.parent / "moved-away")
    with pytest.raises(PmakitError, match="left the window but is gone"):
        plan_increment(tmp_path / "m0", snaps[1:5], get_weights("sma", 4), method="sma", alpha=0.3)
    gone.rename(snaps[0].path)


def test_cli_from_previous(make_run: Callable[..., Path], tmp_path: Path) -> None:
    run = make_run(6, dtype=torch.float32)
    r = CliRunner().invoke(
        cli, ["merge", str(run), "--last", "4", "--until", "5000", "-o", str(tmp_path / "m0"), "-q"]
    )
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(
        cli,
        [
            "merge",
            str(run),
            "--last",
            "4",
            "-o",
            str(tmp_path / "m1"),
            "--from-previous",
            str(tmp_path / "m0"),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "3 reads instead of 4" in r.output  # the sums, step 200 out, step 600 in
    manifest = json.loads((tmp_path / "m1" / "pmakit-merge.json").read_text())
    assert manifest["incremental"]["reads"] == 3 and manifest["produced_by"]["mode"] == "incremental"
    # and the update is the average of the window now chosen (steps 300-600), worked out here
    window = [load_dir(run / f"step-{step:06d}") for step in (300, 400, 500, 600)]
    got = load_dir(tmp_path / "m1")
    assert got.keys() == window[0].keys() and got
    for name, value in got.items():
        if not value.is_floating_point():  # a counter: the newest's
            assert torch.equal(value, window[-1][name]), name
            continue
        expected = torch.stack([w[name].double() for w in window]).mean(0)
        assert value.dtype == torch.float32 and torch.allclose(value.double(), expected, atol=1e-6), name
    r = CliRunner().invoke(
        cli,
        [
            "merge",
            str(run),
            "--last",
            "4",
            "-o",
            str(tmp_path / "m2"),
            "--from-previous",
            str(tmp_path / "m0"),
            "--method",
            "wma",
        ],
    )
    assert r.exit_code == 1 and "run a full merge" in r.output
