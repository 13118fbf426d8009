import json
from collections.abc import Callable
from pathlib import Path

import pytest

from pmakit.errors import PmakitError
from pmakit.selection import select_snapshots
from pmakit.snapshot import Snapshot


def snaps(*tokens: int) -> list[Snapshot]:
    return [Snapshot(Path(f"s{t}"), tokens=t) for t in tokens]


def toks(chosen: list[Snapshot]) -> list[int]:
    return [s.tokens for s in chosen]


EVERY_100 = snaps(*range(100, 1001, 100))  # 100, 200, ..., 1000


def test_last_n_ends_at_newest() -> None:
    # merge at 1000 with 3 snapshots: [800, 900, 1000]
    assert toks(select_snapshots(EVERY_100, last=3)) == [800, 900, 1000]


def test_until_is_inclusive() -> None:
    # until 700 (a snapshot exactly there) with 3: [500, 600, 700]
    assert toks(select_snapshots(EVERY_100, last=3, until=700)) == [500, 600, 700]
    # until 799 falls back to the newest at or before it: [500, 600, 700]
    assert toks(select_snapshots(EVERY_100, last=3, until=799)) == [500, 600, 700]


def test_last_takes_exactly_what_exists() -> None:
    # until 300 with 3: [100, 200, 300], the whole prefix
    assert toks(select_snapshots(EVERY_100, last=3, until=300)) == [100, 200, 300]
    with pytest.raises(PmakitError, match="only 2 exist"):
        select_snapshots(EVERY_100, last=3, until=200)


def test_every_goes_back_from_window_end() -> None:
    # last 4 every 200 ending at 1000: [400, 600, 800, 1000]
    assert toks(select_snapshots(EVERY_100, last=4, every=200)) == [400, 600, 800, 1000]
    # last 5 every 200 ending at 900: [100, 300, 500, 700, 900]
    assert toks(select_snapshots(EVERY_100, last=5, every=200, until=950)) == [100, 300, 500, 700, 900]


def test_every_reaching_before_the_oldest_fails() -> None:
    # last 6 every 200 from 1000 would need 0: only 5 fit
    with pytest.raises(PmakitError, match="5 fit"):
        select_snapshots(EVERY_100, last=6, every=200)


def test_every_tolerates_late_saves() -> None:
    # Savers save at the first step past a multiple of V: 103, 205, 301, ...
    late = snaps(103, 205, 301, 404, 502, 600)
    assert toks(select_snapshots(late, last=3, every=200)) == [205, 404, 600]


def test_every_with_a_missing_snapshot_fails() -> None:
    holes = snaps(100, 200, 400, 500, 600)  # 300 is missing
    with pytest.raises(PmakitError, match="no snapshot at 300"):
        select_snapshots(holes, last=4, every=100)


def test_every_without_last_takes_all_that_fit() -> None:
    assert toks(select_snapshots(EVERY_100, last=None, every=300)) == [100, 400, 700, 1000]
    # going back from the window's end (1000), not forward from the oldest snapshot (100, 500, 900)
    assert toks(select_snapshots(EVERY_100, last=None, every=400)) == [200, 600, 1000]


def test_bad_arguments() -> None:
    with pytest.raises(PmakitError, match="no complete snapshots"):
        select_snapshots([], last=3)
    with pytest.raises(PmakitError, match="at least 1"):
        select_snapshots(EVERY_100, last=0)
    with pytest.raises(PmakitError, match="no snapshot at or before"):
        select_snapshots(EVERY_100, last=1, until=50)


def test_default_window_is_the_runs_own_n_or_10_and_a_short_run_merges_what_it_has() -> None:
    from pmakit.selection import default_last

    assert default_last(EVERY_100 + snaps(1100)) == 10  # nothing recorded: the paper's 10
    assert default_last(EVERY_100[:7]) == 7  # a short run: all 7, with a note
    recorded = [Snapshot(Path(f"s{t}"), tokens=t, meta={"window": 4}) for t in range(100, 1001, 100)]
    assert default_last(recorded) == 4  # the callback's last=4


def test_merge_of_a_short_run_and_its_errors_through_the_cli(
    make_run: Callable[..., Path], tmp_path: Path
) -> None:
    import json

    from click.testing import CliRunner

    from pmakit.cli import cli

    run = make_run(7)
    r = CliRunner().invoke(cli, ["merge", str(run), "-o", str(tmp_path / "m"), "-q"])
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "m" / "pmakit-merge.json").read_text())
    assert len(manifest["inputs"]) == 7
    assert "merging all 7 snapshots" in r.stderr
    # An explicit --last asks for exactly that many.
    r = CliRunner().invoke(cli, ["merge", str(run), "-o", str(tmp_path / "m2"), "--last", "9"])
    assert r.exit_code == 1 and "--last 9 asks for 9 snapshots but only 7 exist" in r.stderr
    # --every past the start of the run says how far it reaches, in tokens that make sense (no negative counts).
    r = CliRunner().invoke(
        cli, ["merge", str(run), "-o", str(tmp_path / "m3"), "--last", "4", "--every", "2B"]
    )
    assert (
        r.exit_code == 1
        and "spans 6B tokens back from 7K" in r.stderr
        and "-" not in r.stderr.split("spans")[1]
    )


def test_merge_says_why_it_takes_the_runs_recorded_window_not_10(tmp_path: Path) -> None:
    from conftest import run_cli, state, write_snapshot
    from pmakit.snapshot import write_metadata

    run = tmp_path / "run"
    for k in range(1, 11):  # as `pmakit train` with average_last: 8 writes them
        snap = write_snapshot(run / "snapshots" / f"step-{k}", state(k), step=k, tokens=100 * k)
        write_metadata(snap, step=k, tokens=100 * k, window=8)
    proc = run_cli("merge", run, "-o", tmp_path / "m", "-q")
    assert proc.returncode == 0, proc.stderr
    assert "merging the last 8 snapshots: the window of the run's own online merge" in proc.stderr
    assert len(json.loads((tmp_path / "m" / "pmakit-merge.json").read_text())["inputs"]) == 8
    helped = run_cli("merge", "--help")
    assert "the window its own online merge used" in " ".join(helped.stdout.split())


def test_the_default_window_is_a_library_function_the_cli_and_its_help_share(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from click.testing import CliRunner

    import pmakit
    from conftest import state, write_snapshot
    from pmakit.cli import cli
    from pmakit.selection import DEFAULT_WINDOW_RULE
    from pmakit.snapshot import write_metadata

    run = tmp_path / "run"
    for k in range(1, 13):  # 12 snapshots, the run's online merge recorded a window of 8
        snap = write_snapshot(run / "snapshots" / f"step-{k}", state(k), step=k, tokens=100 * k)
        write_metadata(snap, step=k, tokens=100 * k, window=8)
    with caplog.at_level("INFO", logger="pmakit"):
        chosen = pmakit.select_for_merge([run])
    assert toks(chosen) == list(range(500, 1201, 100))  # the recorded 8: [500, 1200]
    assert "merging the last 8 snapshots" in caplog.text
    assert toks(pmakit.select_for_merge([run], until=900)) == list(range(200, 901, 100))  # 8 ending at 900
    # --every without --last: every one that fits, back from the newest
    assert toks(pmakit.select_for_merge([run], every=200)) == list(range(200, 1201, 200))
    named = [run / "snapshots" / f"step-{k}" for k in (1, 5, 12)]
    assert toks(pmakit.select_for_merge(named)) == [100, 500, 1200]  # named one by one: all of them
    r = CliRunner().invoke(cli, ["merge", str(run), "-o", str(tmp_path / "m"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert r.stdout.count(" tokens  ") == 8 and "1.2K tokens" in r.stdout and " 400 tokens" not in r.stdout
    helped = " ".join(CliRunner().invoke(cli, ["merge", "--help"]).stdout.split())
    assert (
        helped.count(DEFAULT_WINDOW_RULE) == 2
    )  # the command's summary and --last: one rule, stated once each
