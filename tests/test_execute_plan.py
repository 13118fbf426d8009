"""``execute(plan, out)`` writes the merge ``plan_merge`` planned, without planning again: the same files and
manifest as ``merge`` with the same options; a plan for other ranks is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import load_dir
from pmakit.errors import PmakitError
from pmakit.merge import execute, merge, plan_merge
from pmakit.snapshot import MERGE_MANIFEST, discover


@pytest.mark.parametrize("dtype", ["same", "fp32"])
def test_execute_writes_what_merge_writes(make_run: Callable[..., Path], dtype: str) -> None:
    snaps = discover(make_run(4))
    weights = [0.1, 0.2, 0.3, 0.4]
    a = merge(snaps, weights, snaps[0].path.parent.parent / "a", dtype=dtype, max_shard_size=4096)
    plan = plan_merge(snaps, weights, dtype=dtype, max_shard_size=4096)
    assert (plan.dtype, plan.max_shard_size, plan.ranks) == (dtype, 4096, 1)
    b = execute(plan, snaps[0].path.parent.parent / "b")
    assert b.plan is plan and len(plan.shards) > 1
    got, want = load_dir(b.path), load_dir(a.path)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    manifests = [json.loads((r.path / MERGE_MANIFEST).read_text()) for r in (a, b)]
    for m in manifests:
        m.pop("created", None)
        m.pop("seconds", None)
    assert manifests[0]["dtype"] == manifests[1]["dtype"] == dtype
    assert manifests[0]["weights"] == pytest.approx(weights)
    assert manifests[0]["inputs"] and manifests[0]["output"]["files"]
    assert manifests[1] == manifests[0]  # the whole manifest but its date and duration


def test_execute_refuses_a_plan_for_other_ranks(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(2))
    plan = plan_merge(snaps, [0.5, 0.5], ranks=2, max_shard_size=4096)
    with pytest.raises(PmakitError, match="among 2 rank"):
        execute(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_merge_command_runs_the_plan_it_made(
    make_run: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pmakit merge` plans once (the plan it prints) and writes that plan: the library's planner is called once,
    and the output is the library's merge of the same snapshots."""
    from click.testing import CliRunner

    import pmakit.merge
    from pmakit.cli import cli

    run = make_run(3)
    plans: list[Any] = []
    planner = pmakit.merge.plan_merge

    def counted(*args: Any, **kwargs: Any) -> Any:
        plans.append(planner(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(pmakit.merge, "plan_merge", counted)
    r = CliRunner().invoke(cli, ["merge", str(run), "-o", str(tmp_path / "out"), "--max-shard-size", "4KB"])
    assert r.exit_code == 0, r.output
    assert len(plans) == 1 and len(plans[0].shards) > 1
    plan = plans[0]  # the one printed: its snapshots with their weights, its shard count and memory
    printed = [line for line in r.output.splitlines() if line.startswith("  ") and " tokens  " in line]
    assert [line.split()[0] for line in printed] == [f"{w:.5f}" for w in plan.weights]
    assert [line.rsplit(" ", 1)[-1] for line in printed] == [str(s.path.resolve()) for s in plan.snapshots]
    assert f"{len(plan.tensors)} tensors:" in r.output and f"in {len(plan.shards)} file(s)" in r.output
    monkeypatch.undo()
    want = merge(discover(run), [1 / 3] * 3, tmp_path / "lib", max_shard_size=4096)
    got = load_dir(tmp_path / "out")
    assert got.keys() == load_dir(want.path).keys()
    assert all(torch.equal(got[k], v) for k, v in load_dir(want.path).items())
