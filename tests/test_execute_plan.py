"""``execute(plan, out)`` writes the merge ``plan_merge`` planned, without planning again: the same files and
manifest as ``merge`` with the same options; a plan for other ranks is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

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
    assert manifests[0]["inputs"] == manifests[1]["inputs"]
    assert manifests[0]["output"]["files"] == manifests[1]["output"]["files"]


def test_execute_refuses_a_plan_for_other_ranks(make_run: Callable[..., Path], tmp_path: Path) -> None:
    snaps = discover(make_run(2))
    plan = plan_merge(snaps, [0.5, 0.5], ranks=2, max_shard_size=4096)
    with pytest.raises(PmakitError, match="among 2 rank"):
        execute(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()
