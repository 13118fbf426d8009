"""torchtitan save folders written by torchtitan's own Trainer + CheckpointManager (CPU, gloo, world size 1 and FSDP
over 2 ranks): merged with no token flags, checked against torch.distributed.checkpoint's own reader, loaded back by
torchtitan (native DCP and its HF path), which takes a training step from the merge."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from layouts.conftest import SRC
from pmakit.cli import cli
from pmakit.snapshot import discover

dcp = pytest.importorskip("torch.distributed.checkpoint")
TRAINER_STATE = ("optimizer", "lr_scheduler", "dataloader", "train_state")
TOKENS_PER_STEP = 4 * 32  # 4 sequences of 32 tokens per step, over all ranks


def model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of one torchtitan checkpoint (its top-level tensors), read by torch's own DCP loader."""
    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    state = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, dcp.metadata.TensorStorageMetadata) and k.split(".", 1)[0] not in TRAINER_STATE
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(checkpoint), no_dist=True)
    return state


def hand_average(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    states = [model_weights(c) for c in checkpoints]
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[-1]}


def steps(run: Path, *which: int) -> list[Path]:
    return [run / "checkpoint" / f"step-{i}" for i in which]


def test_save_folder_is_read_from_torchtitans_train_state(torchtitan_runs: dict[str, Path]) -> None:
    snaps = discover(torchtitan_runs["ws1"])
    assert [s.path.name for s in snaps] == [f"step-{i}" for i in range(1, 6)]
    assert [s.tokens for s in snaps] == [TOKENS_PER_STEP * i for i in range(1, 6)]
    assert [s.step for s in snaps] == [1, 2, 3, 4, 5]
    assert {(s.layout, s.source) for s in snaps} == {("torchtitan", "torchtitan")}
    # step-5 is torchtitan's model-only last save: no train_state, tokens at the rate of the other checkpoints.
    assert snaps[-1].meta["model_only"] and "ntokens_seen" in snaps[0].meta
    # At world size 2 torchtitan counts tokens per rank; the data loader's world_size restores the run's count.
    native = discover(torchtitan_runs["ws2-native"])
    assert [(s.meta["ntokens_seen"], s.meta["dp"]) for s in native[:1]] == [(TOKENS_PER_STEP // 2, 2)]
    assert [s.tokens for s in native] == [TOKENS_PER_STEP, 2 * TOKENS_PER_STEP]
    assert [s.tokens for s in discover(torchtitan_runs["ws2"])] == [TOKENS_PER_STEP * i for i in (2, 3, 4)]


def test_merge_with_no_token_flags_is_the_hand_average_and_torchtitan_loads_it(
    torchtitan_runs: dict[str, Path],
) -> None:
    out, root = torchtitan_runs["merged"], torchtitan_runs["root"]
    want = hand_average(steps(torchtitan_runs["ws1"], 1, 2, 3, 4, 5))
    got = model_weights(out)
    assert got.keys() == want.keys() and "layers.0.attention.qkv_linear.wq.weight" in got
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)  # fp32 sum of w * x vs mean: ulps apart
    # Model only: nothing of the optimizer, scheduler, data loader or trainer state.
    keys = dcp.FileSystemReader(str(out)).read_metadata().state_dict_metadata
    assert not any(k.split(".", 1)[0] in TRAINER_STATE for k in keys)
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert {i["layout"] for i in manifest["inputs"]} == {"torchtitan"}
    assert manifest["produced_by"]["format"] == "torchtitan"
    # torchtitan loaded it (--checkpoint.initial_load_path OUT --checkpoint.initial_load_model_only) ...
    loaded = torch.load(root / "loaded.pt", weights_only=True)
    assert loaded.keys() == got.keys()
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    # ... and trained a step from it.
    record = json.loads((root / "loaded.json").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def test_fsdp_two_rank_checkpoints_merge_like_unsharded_ones(
    torchtitan_runs: dict[str, Path], tmp_path: Path
) -> None:
    assert list((torchtitan_runs["ws2"] / "checkpoint" / "step-4").glob("__1_*.distcp"))  # saved by 2 ranks
    one = tmp_path / "ws1"
    for src in steps(torchtitan_runs["ws1"], 2, 3, 4):
        (one / "checkpoint").mkdir(parents=True, exist_ok=True)
        (one / "checkpoint" / src.name).symlink_to(src)
    for run, folder in (("ws1", one), ("ws2", torchtitan_runs["ws2"])):
        r = CliRunner().invoke(cli, ["merge", str(folder), "-o", str(tmp_path / f"out-{run}"), "-q"])
        assert r.exit_code == 0, r.output
    a, b = model_weights(tmp_path / "out-ws1"), model_weights(tmp_path / "out-ws2")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_safetensors_export_has_hf_names_and_torchtitans_hf_path_loads_it(
    torchtitan_runs: dict[str, Path], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    out, root = torchtitan_runs["merged-hf"], torchtitan_runs["root"]
    hf = load_file(out / "model-hf.safetensors")
    assert "model.layers.0.self_attn.q_proj.weight" in hf and "model.embed_tokens.weight" in hf
    assert not any("qkv_linear" in k for k in hf)
    assert json.loads((out / "pmakit-merge.json").read_text())["produced_by"]["format"] == "torchtitan-hf"
    # torchtitan's from_hf (--checkpoint.initial_load_in_hf) gives back exactly the merged torchtitan weights,
    # rotary permutation of wq/wk included.
    loaded, merged = (
        torch.load(root / "loaded-hf.pt", weights_only=True),
        model_weights(torchtitan_runs["merged"]),
    )
    assert loaded.keys() == merged.keys()
    for name, value in merged.items():
        assert torch.equal(loaded[name], value), name
    assert math.isfinite(json.loads((root / "loaded-hf.json").read_text())["loss"])

    # Without torchtitan's job config the model is unknown: torchtitan's names, and a warning saying why.
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    for src in steps(torchtitan_runs["ws1"], 3, 4):
        (run / "checkpoint" / src.name).symlink_to(src)
    r = CliRunner().invoke(
        cli, ["merge", str(run), "-o", str(tmp_path / "st"), "-q", "--format", "safetensors"]
    )
    assert r.exit_code == 0, r.output
    assert "keeps torchtitan's parameter names" in r.stderr and "--debug.save_config_file" in r.stderr
    names = load_file(tmp_path / "st" / "model.safetensors").keys()
    assert "layers.0.attention.qkv_linear.wq.weight" in names


def test_inspect_names_the_layout_and_an_unfinished_save_is_reported(
    torchtitan_runs: dict[str, Path], tmp_path: Path
) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(torchtitan_runs["ws1"]), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {row["layout"] for row in report["snapshots"]} == {"torchtitan"}
    assert report["model"]["tensors"] == 57  # model weights only
    assert all(
        any(s.startswith("optimizer.") for s in row["skipped_entries"]) for row in report["snapshots"][:4]
    )

    # An async save still in flight (or killed): .distcp files, no .metadata (DCP writes it last).
    run = tmp_path / "run" / "checkpoint"
    run.mkdir(parents=True)
    for src in steps(torchtitan_runs["ws1"], 3, 4):
        (run / src.name).symlink_to(src)
    partial = run / "step-6"
    partial.mkdir()
    shutil.copy(steps(torchtitan_runs["ws1"], 4)[0] / "__0_0.distcp", partial)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "run"), "--json"])
    assert r.exit_code == 0, r.output
    rows = {Path(row["path"]).name: row for row in json.loads(r.stdout)["snapshots"]}
    assert not rows["step-6"]["complete"] and "did not finish" in rows["step-6"]["reason"]
    r = CliRunner().invoke(cli, ["merge", str(tmp_path / "run"), "-o", str(tmp_path / "out"), "-q"])
    assert r.exit_code == 0, r.output
    inputs = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())["inputs"]
    assert [Path(i["path"]).name for i in inputs] == ["step-3", "step-4"]


def test_checkpoints_are_read_without_torchtitan_installed(torchtitan_runs: dict[str, Path]) -> None:
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"  # any import of torchtitan now fails
        "from pmakit.snapshot import discover; from pmakit.layouts import open_weights\n"
        f"s = discover({str(torchtitan_runs['ws2'])!r})[-1]\n"
        "r = open_weights(s.path); name = 'layers.0.attention.qkv_linear.wq.weight'\n"
        "print(s.tokens, len(r.tensors), r.read(name, 0, 4).tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    tokens, count, head = proc.stdout.split(" ", 2)
    assert (int(tokens), int(count)) == (4 * TOKENS_PER_STEP, 57)
    want = model_weights(steps(torchtitan_runs["ws1"], 4)[0])["layers.0.attention.qkv_linear.wq.weight"]
    assert json.loads(head) == want.reshape(-1)[:4].tolist()


def test_online_snapshots_in_a_trainer_subclass_are_the_trainers_weights_and_resume_safe(
    torchtitan_runs: dict[str, Path],
) -> None:
    """pmakit.integrations.torchtitan.PMASnapshots under FSDP over 2 ranks: a snapshot every 2 steps' tokens; the run
    stopped after step 2 and was resumed by torchtitan from its checkpoint, and step 3 (resumed mid-interval) is
    not saved."""
    from safetensors.torch import load_file

    run = torchtitan_runs["online"]
    snaps = discover(run / "pma")
    assert [(s.step, s.tokens, s.layout) for s in snaps] == [(2, 256, "pmakit"), (4, 512, "pmakit")]
    for snap in snaps:
        saved = load_file(snap.path / "model.safetensors")
        want = model_weights(run / "dump" / "checkpoint" / f"step-{snap.step}")  # FSDP shards, read by torch
        assert saved.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(saved[name], value), name


# -- token counts from synthetic torchtitan-shaped checkpoints (no torchtitan needed) ------------------------------


def fake_checkpoint(path: Path, train_state: dict[str, object] | None, dp: int = 2) -> Path:
    """A DCP checkpoint shaped as torchtitan's: model tensors at the top level, its trainer entries beside them."""
    tree: dict[str, object] = {"w": torch.ones(4) * len(path.name)}
    if train_state is not None:
        tree |= {
            "train_state": train_state,
            "dataloader": {"world_size": dp},
            "optimizer": {"m": torch.zeros(4)},
        }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(tree, checkpoint_id=str(path), no_dist=True)
    return path


def test_tokens_of_model_only_saves_and_refused_records(tmp_path: Path) -> None:
    import argparse

    from pmakit.layouts import get_layout
    from pmakit.snapshot import scan

    run = tmp_path / "checkpoint"
    fake_checkpoint(run / "step-1", {"step": 1, "ntokens_seen": 10})
    fake_checkpoint(run / "step-2", {"step": 2, "ntokens_seen": 20})
    fake_checkpoint(run / "step-3", None)  # the model-only last save
    layout = get_layout("torchtitan")
    got = [(s.step, s.tokens) for s in discover(tmp_path)]
    assert got == [(1, 20), (2, 40), (3, 60)]  # x dataloader.world_size; step-3 at the others' 20 per step
    assert layout.read(run / "step-3", 7).tokens == 21  # --tokens-per-step wins for a model-only save
    # Checkpoints that disagree on the tokens per step (a batch-size ramp): the model-only save's count is unknown.
    fake_checkpoint(run / "step-2", {"step": 2, "ntokens_seen": 30})
    (found,) = [r for r in scan(tmp_path) if getattr(r, "path", None) == run / "step-3"]
    assert "disagree" in str(found) and "--tokens-per-step" in str(found)
    # A train_state record holding anything but plain data is refused, never unpickled.
    fake_checkpoint(run / "step-4", {"step": 4, "ntokens_seen": argparse.Namespace(n=1)})
    (bad,) = [r for r in scan(tmp_path) if getattr(r, "path", None) == run / "step-4"]
    assert "refused" in str(bad)
