"""`pmakit inspect --plan`: bytes, memory per rank and time for a 70B-shaped layout and for real snapshots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from conftest import fake_node
from pmakit.cli import cli
from pmakit.errors import PmakitError
from pmakit.merge import plan_merge
from pmakit.merge.capacity import Bandwidth, layout_of, load_layout, plan_report, plan_scale
from pmakit.merge.plan import CHUNK_ELEMS
from pmakit.merge.resources import SCRATCH_BYTES
from pmakit.snapshot import discover
from pmakit.weights import get_weights


def llama_70b() -> dict[str, torch.Tensor]:
    """Llama-3-70B's state dict shapes as meta tensors (nothing allocated)."""
    vocab, d, ff, layers, kv = 128256, 8192, 28672, 80, 1024
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (d, d),
                p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d),
                p + "self_attn.o_proj.weight": (d, d),
                p + "mlp.gate_proj.weight": (ff, d),
                p + "mlp.up_proj.weight": (ff, d),
                p + "mlp.down_proj.weight": (d, ff),
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
            }
        )
    shapes.update({"model.norm.weight": (d,), "lm_head.weight": (vocab, d)})
    return {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in shapes.items()}


@pytest.fixture(scope="module")
def layout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("layout") / "llama70b.json"
    path.write_text(json.dumps(layout_of(llama_70b())))
    return path


def _plan(layout: Path, *args: str) -> dict[str, Any]:
    r = CliRunner().invoke(
        cli,
        [
            "inspect",
            "--plan",
            "--layout",
            str(layout),
            "--json",
            "--disk-bandwidth",
            "2GB",
            "--accumulate-bandwidth",
            "1GB",
            *args,
        ],
    )
    assert r.exit_code == 0, r.output
    return dict(json.loads(r.stdout))


def test_70b_layout_bytes_and_bounded_memory(layout: Path) -> None:
    params = 70_553_706_496  # Llama-3-70B
    plan = _plan(layout, "--snapshots", "10", "--ranks", "8", "--nodes", "2")
    assert plan["parameters"] == params and plan["tensors"] == 2 + 80 * 9 + 1
    assert plan["read_bytes"] == 10 * 2 * params and plan["write_bytes"] == 2 * params
    assert sum(r["read_bytes"] for r in plan["per_rank"]) == plan["read_bytes"]
    reads = [r["read_bytes"] for r in plan["per_rank"]]
    assert max(reads) - min(reads) <= 10 * plan["largest_tensor_bytes"]  # balanced to within one tensor
    fold = plan["fold"]  # sized for a quarter of this node's cores (4 ranks a node)
    memory = CHUNK_ELEMS * 4 * fold["buffers"] + SCRATCH_BYTES * fold["workers"]
    assert fold["buffers"] == fold["workers"] + 2
    assert plan["max_memory_bytes"] == memory < 2**30  # whatever the model size ...
    assert _plan(layout, "--snapshots", "40", "--ranks", "8")["max_memory_bytes"] == memory  # ... and N
    # The slowest rank, by hand: 4 ranks share a node's 2 GB/s disk; each accumulates at 1 GB/s.
    slowest = max(plan["per_rank"], key=lambda r: r["read_bytes"] + r["write_bytes"])
    io = (slowest["read_bytes"] + slowest["write_bytes"]) / 2e9 * 4
    assert plan["seconds"] == pytest.approx(max(io, slowest["read_bytes"] / 1e9), rel=0.02)


def test_more_ranks_on_one_disk_do_not_beat_the_disk(layout: Path) -> None:
    one = _plan(layout, "--ranks", "1")
    eight = _plan(layout, "--ranks", "8")
    two_nodes = _plan(layout, "--ranks", "8", "--nodes", "2")
    io_floor = (one["read_bytes"] + one["write_bytes"]) / 2e9
    # 1 rank accumulates at 1 GB/s, slower than the 2 GB/s disk: compute bound.
    assert one["seconds"] == pytest.approx(one["read_bytes"] / 1e9)
    # 8 ranks share the accumulation but not the disk: the disk bounds them.
    assert eight["seconds"] == pytest.approx(io_floor, rel=0.05)
    # Two nodes, two disks: half.
    assert two_nodes["seconds"] == pytest.approx(io_floor / 2, rel=0.05)


def test_plan_of_snapshots_matches_the_merge_plan(
    make_run: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    snaps = discover(make_run(4))
    report = plan_report(snaps, None, ranks=2, disk_bandwidth=1e9, accumulate_bandwidth=1e9)
    plan = plan_merge(snaps, get_weights("sma", 4))
    assert report["read_bytes"] == plan.input_bytes and report["write_bytes"] == plan.output_bytes
    assert report["snapshots"] == 4
    # each of two ranks on this node is sized for half its cores, as torchrun's ranks size themselves
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert report["max_memory_bytes"] == plan_merge(snaps, get_weights("sma", 4)).peak_memory
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    one = plan_report(snaps, None, ranks=1, disk_bandwidth=1e9, accumulate_bandwidth=1e9)
    assert one["max_memory_bytes"] == plan.peak_memory
    r = CliRunner().invoke(
        cli, ["inspect", "--plan", str(snaps[0].path.parent), "--last", "4", "--ranks", "2"]
    )
    assert r.exit_code == 0, r.output
    assert "expected time" in r.output and "rank   1" in r.output and "measured" in r.output
    assert "no work" not in r.output
    # 8 ranks for 5 tensors, two of them 40% of the bytes each: the idle ranks are named and explained
    r = CliRunner().invoke(cli, ["inspect", "--plan", str(snaps[0].path.parent), "--ranks", "8"])
    assert r.exit_code == 0, r.output
    idle = next(line for line in r.output.splitlines() if "have no work" in line)
    assert "each tensor is written whole by one rank" in idle and "1/8 of the" in " ".join(r.output.split())


def test_plan_scale_matches_hand_numbers() -> None:
    tensors = load_layout_from(
        {"a": {"shape": [1000], "dtype": "bf16"}, "b": {"shape": [10], "dtype": "int64"}}
    )
    plan = plan_scale(
        tensors, snapshots=3, ranks=1, bandwidth=Bandwidth(100.0, 50.0, 1e9), out_dtype=torch.float32
    )
    assert plan["read_bytes"] == 3 * 2000 + 80 and plan["write_bytes"] == 4000 + 80
    assert plan["seconds"] == pytest.approx(6080 / 100 + 4080 / 50)


def load_layout_from(data: dict[str, Any], tmp: Path | None = None) -> list[Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layout.json"
        path.write_text(json.dumps(data))
        return load_layout(path)


def test_bad_layouts_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(PmakitError, match="no valid shape"):
        load_layout_from({"a": {"shape": "big"}})
    with pytest.raises(PmakitError, match="unknown dtype"):
        load_layout_from({"a": {"shape": [1], "dtype": "fp12"}})
    (tmp_path / "x.json").write_text("{")
    r = CliRunner().invoke(cli, ["inspect", "--plan", "--layout", str(tmp_path / "x.json")])
    assert r.exit_code == 1 and "unreadable layout file" in r.output
    r = CliRunner().invoke(cli, ["inspect", "--plan"])
    assert r.exit_code == 1 and "needs snapshots or a --layout" in r.output


def test_a_planned_rank_is_sized_for_its_share_of_the_node(
    layout: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a node whose numbers are known (32 CPUs, no CPU quota, 256 GiB free), 8 ranks on 2 nodes are 4 ranks a
    node: each one's fold is sized for 32 / 4 = 8 cores, one worker a core less one for the reader and writer (7),
    and two more buffers than workers; on one node (8 ranks) 4 cores, 3 workers; one rank, 31."""
    fake_node(tmp_path, monkeypatch, {
        "cg/cgroup.controllers": "cpu memory",
        "cg/job/cpu.max": "max 100000\n",
        "cg/job/memory.max": "max\n",
        "proc-cgroup": "0::/job\n",
        "meminfo": "MemAvailable: 268435456 kB\n",
    }, cpus=32)  # fmt: skip
    monkeypatch.delenv("PMAKIT_FOLD_WORKERS", raising=False)
    for ranks, nodes, workers in ((8, 2, 7), (8, 1, 3), (1, 1, 31)):
        plan = _plan(layout, "--snapshots", "10", "--ranks", str(ranks), "--nodes", str(nodes))
        fold = plan["fold"]
        assert (fold["workers"], fold["buffers"]) == (workers, workers + 2), (ranks, nodes, fold)
        # the rates (measured when not given) at the same sizing
        assert plan["bandwidth"]["workers"] == workers
