"""Megatron torch_dist save folders written by megatron-core's own ``dist_checkpointing.save`` (CPU, gloo, TP=1 and
TP=2 over 2 ranks): merged with no token flags, checked against torch's own DCP reader, loaded back by megatron's
``dist_checkpointing.load`` (default strictness) at TP=1 and TP=2, which then takes a training step."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from layouts.conftest import SRC
from pmakit.cli import cli
from pmakit.layouts import IncompleteSnapshot, get_layout, layout_of, open_weights
from pmakit.snapshot import discover

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)

ITERS = [f"iter_{i:07d}" for i in range(1, 7)]
TOKENS_PER_ITER = 4 * 16  # 4 samples of 16 tokens


def dcp_metadata(path: Path) -> Metadata:
    return dcp.FileSystemReader(path).read_metadata()


def dcp_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor entry of a DCP checkpoint, unsharded by torch's own reader (the reference)."""
    entries = dcp_metadata(path).state_dict_metadata
    state = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in entries.items()
        if isinstance(md, TensorStorageMetadata)
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: intended
        dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def dcp_bytes(path: Path) -> dict[str, bytes]:
    """The stored bytes of every non-tensor entry (``_extra_state``, RNG), sliced from the data files."""
    md = dcp_metadata(path)
    out = {}
    for key, entry in md.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            info = md.storage_data[MetadataIndex(key)]
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                out[key] = f.read(info.length)
    return out


def model_weights(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in dcp_tensors(path).items() if not k.startswith("optimizer.")}


def hand_average(checkpoints: list[Path]) -> dict[str, torch.Tensor]:
    states = [model_weights(c) for c in checkpoints]
    return {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[-1]}


def test_save_folder_is_read_from_megatrons_common_pt(megatron_runs: dict[str, Path]) -> None:
    ws1 = megatron_runs["ws1"]
    snaps = discover(ws1)  # latest_checkpointed_iteration.txt beside them is no candidate
    assert [s.path.name for s in snaps] == ITERS
    assert [(s.step, s.tokens) for s in snaps] == [(i, TOKENS_PER_ITER * i) for i in range(1, 7)]
    assert {(s.layout, s.source, s.lr) for s in snaps} == {("megatron", "megatron", 0.01)}
    assert snaps[-1].meta["tokens_from"] == "consumed_train_samples x seq_length"
    assert layout_of(ws1 / ITERS[-1]).name == "megatron"  # type: ignore[union-attr]  # not torch weights, not dcp
    with open_weights(ws1 / ITERS[-1]) as reader:
        assert set(reader.tensors) == set(model_weights(ws1 / ITERS[-1]))
        assert "decoder.layers.self_attention.linear_qkv.weight" in reader.tensors  # layers stacked on dim 0
        assert not any(name.startswith("optimizer.") for name in reader.tensors)
        kinds = {s.split(".state.")[1].split(".")[0] for s in reader.skipped if s.startswith("optimizer.")}
        assert kinds == {"exp_avg", "exp_avg_sq"}
        assert any(s.endswith("._extra_state/shard_0_2") for s in reader.skipped)
        assert any(s.startswith("rng_state/") for s in reader.skipped)


def test_merge_with_no_token_flags_is_the_hand_average_and_megatron_loads_it(
    megatron_runs: dict[str, Path],
) -> None:
    ws1, out = megatron_runs["ws1"], megatron_runs["merged"]
    newest = ws1 / ITERS[-1]
    want = hand_average([ws1 / name for name in ITERS])  # the default window: all 6
    got = dcp_tensors(out)
    assert got.keys() == want.keys()  # model weights only: no optimizer moment became a weight
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)  # fp32 sum of w * x vs mean: ulps apart
    # Not averaged, carried from the newest input byte for byte: _extra_state, RNG state, common.pt, metadata.json.
    carried = dcp_bytes(out)
    assert carried == dcp_bytes(newest) and any("._extra_state/" in k for k in carried)
    for name in ("common.pt", "metadata.json"):
        assert filecmp.cmp(out / name, newest / name, shallow=False), name
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert {i["layout"] for i in manifest["inputs"]} == {"megatron"}
    assert manifest["produced_by"]["format"] == "megatron"

    # megatron's dist_checkpointing.load (default strictness) loaded exactly the merge at TP=1 and at TP=2, and
    # took a training step from it.
    for tp in (1, 2):
        loaded = dcp_tensors(megatron_runs[f"loaded-tp{tp}"])
        assert loaded.keys() == got.keys()
        for name, value in got.items():
            assert torch.equal(loaded[name], value), (tp, name)
        step = json.loads((megatron_runs["root"] / f"pma-init-tp{tp}.json").read_text())
        assert math.isfinite(step["loss"]) and step["moved"], step


def test_tp2_checkpoints_merge_like_tp1_ones(megatron_runs: dict[str, Path], tmp_path: Path) -> None:
    tp2 = megatron_runs["tp2"]
    assert len(list((tp2 / ITERS[-1]).glob("__1_*.distcp"))) > 0  # rank 1 wrote its shards
    qkv = dcp_metadata(tp2 / ITERS[-1]).state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    assert isinstance(qkv, TensorStorageMetadata) and len(qkv.chunks) == 4  # 2 layers x 2 TP halves
    with open_weights(tp2 / ITERS[-1]) as reader:  # read a layer at a time, not the whole stacked tensor
        units = reader._unit_boxes("decoder.layers.self_attention.linear_qkv.weight")  # type: ignore[attr-defined]
        assert [tuple(box.sizes) for _, _, box in units] == [(1, 96, 32), (1, 96, 32)]
    for run in ("ws1", "tp2"):
        r = CliRunner().invoke(
            cli, ["merge", str(megatron_runs[run]), "-o", str(tmp_path / run), "--last", "3"]
        )
        assert r.exit_code == 0, r.output
    one, two = dcp_tensors(tmp_path / "ws1"), dcp_tensors(tmp_path / "tp2")
    assert one.keys() == two.keys()
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_inspect_names_the_layout_and_fails_when_nothing_is_mergeable(
    megatron_runs: dict[str, Path], tmp_path: Path
) -> None:
    r = CliRunner().invoke(cli, ["inspect", str(megatron_runs["ws1"]), "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert {row["layout"] for row in report["snapshots"]} == {"megatron"}
    assert report["model"]["tensors"] == len(model_weights(megatron_runs["ws1"] / ITERS[-1]))
    assert all(
        any(s.startswith("optimizer.state.exp_avg.") for s in row["skipped_entries"])
        for row in report["snapshots"]
    )
    # A save that never finished (Megatron writes metadata.json last) is reported, not merged: exit 1.
    partial = tmp_path / "save" / "iter_0000010"
    shutil.copytree(megatron_runs["ws1"] / ITERS[-1], partial)
    (partial / "metadata.json").unlink()
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "save")])
    assert r.exit_code == 1
    assert "Error: nothing to merge" in r.stderr


def test_plain_dcp_copy_never_averages_optimizer_moments(
    megatron_runs: dict[str, Path], tmp_path: Path
) -> None:
    """Only the DCP files of Megatron's checkpoints (no common.pt): a plain DCP folder, counted by
    --tokens-per-step; the flat ``optimizer.state.*`` keys still never become weights."""
    save = tmp_path / "save"
    for name in ITERS[-2:]:
        (save / name).mkdir(parents=True)
        for f in (megatron_runs["ws1"] / name).iterdir():
            if f.name == ".metadata" or f.suffix == ".distcp":
                shutil.copy2(f, save / name / f.name)
    r = CliRunner().invoke(cli, ["merge", str(save), "-o", str(tmp_path / "out"), "--tokens-per-step", "64"])
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    got = load_file(tmp_path / "out" / "model.safetensors")  # a plain DCP input's default output
    want = hand_average([save / n for n in ITERS[-2:]])
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


def write_common(checkpoint: Path, common: object) -> None:
    (checkpoint / "common.pt").unlink()
    torch.save(common, checkpoint / "common.pt")


def test_common_pt_is_never_run_and_counts_are_validated(
    megatron_runs: dict[str, Path], tmp_path: Path
) -> None:
    import argparse
    import os

    class Payload:
        def __init__(self, call: object, arg: str) -> None:
            self.call, self.arg = call, arg

        def __reduce__(self) -> tuple[object, ...]:
            return (self.call, (self.arg,))

    canary = tmp_path / "canary"
    canary.mkdir()
    save = tmp_path / "save"
    ckpt = save / "iter_0000007"
    shutil.copytree(megatron_runs["ws1"] / ITERS[-1], ckpt)
    # Any callable pickled in common.pt becomes an inert stand-in: nothing from the file runs.
    args = argparse.Namespace(
        consumed_train_samples=28, seq_length=16, hook=Payload(shutil.rmtree, str(canary))
    )
    write_common(ckpt, {"iteration": 7, "args": args})
    snap = discover(save)[0]
    assert (snap.tokens, snap.step) == (28 * 16, 7)
    assert canary.is_dir()
    # torch refuses modules such as os outright: the checkpoint is reported and skipped.
    write_common(ckpt, {"iteration": 7, "hook": Payload(os.system, f"touch {tmp_path / 'ran'}")})
    with pytest.raises(IncompleteSnapshot, match="refused"):
        get_layout("megatron").read(ckpt, None)
    r = CliRunner().invoke(cli, ["inspect", str(save)])
    assert r.exit_code == 1 and "nothing to merge" in r.stderr and not (tmp_path / "ran").exists()

    write_common(ckpt, {"iteration": 7, "tokens": 5000})  # an explicit count wins (megatron-core alone)
    assert discover(save)[0].tokens == 5000
    # MoE's ChainedOptimizer keeps one common state per inner optimizer: the lr is the first one's.
    inner = [{"optimizer": {"param_groups": [{"lr": lr}]}} for lr in (0.5, 0.25)]
    write_common(ckpt, {"iteration": 7, "tokens": 5000, "optimizer": dict(enumerate(inner))})
    assert discover(save)[0].lr == 0.5
    write_common(ckpt, {"iteration": 7})  # nothing but the iteration: --tokens-per-step
    assert discover(save, tokens_per_step=64)[0].tokens == 7 * 64
    r = CliRunner().invoke(cli, ["merge", str(save), "-o", str(tmp_path / "out")])
    assert r.exit_code == 1 and "--tokens-per-step" in r.stderr and "Traceback" not in r.stderr
    write_common(ckpt, {"iteration": 7, "tokens": True})  # JSON-ish true is not a count
    r = CliRunner().invoke(cli, ["inspect", str(save)])
    assert r.exit_code == 1 and "'tokens' must be a non-negative integer" in r.output + r.stderr


def test_read_without_megatron_installed(megatron_runs: dict[str, Path]) -> None:
    code = (
        "import sys; sys.modules['megatron'] = None\n"  # any import of megatron now fails
        "from pmakit.snapshot import discover; from pmakit.layouts import open_weights\n"
        f"s = discover({str(megatron_runs['tp2'])!r})[-1]\n"
        "r = open_weights(s.path); name = 'decoder.layers.self_attention.linear_qkv.weight'\n"
        "print(s.tokens, len(r.tensors), r.read(name, 0, 4).tolist())\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE"},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr
    tokens, count, head = proc.stdout.split(" ", 2)
    want = model_weights(megatron_runs["ws1"] / ITERS[-1])
    assert (int(tokens), int(count)) == (6 * TOKENS_PER_ITER, len(want))
    assert (
        json.loads(head) == want["decoder.layers.self_attention.linear_qkv.weight"].reshape(-1)[:4].tolist()
    )


def test_two_rank_merge_writes_the_same_megatron_checkpoint(
    megatron_runs: dict[str, Path], tmp_path: Path
) -> None:
    """``torchrun -m pmakit merge``: each rank writes its own tensors into one Megatron checkpoint (a DCP
    collective), the carried entries once."""
    import os

    out = tmp_path / "out"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*torchrun, "-m", "pmakit", "merge", str(megatron_runs["ws1"]), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(list(out.glob("__1_*.distcp"))) > 0  # rank 1 wrote its share
    got, want = dcp_tensors(out), dcp_tensors(megatron_runs["merged"])
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert dcp_bytes(out) == dcp_bytes(megatron_runs["merged"])


def test_safetensors_on_request_keeps_megatron_keys(megatron_runs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file

    args = ["merge", str(megatron_runs["ws1"]), "-o", str(tmp_path / "st"), "--format", "safetensors"]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    got, want = load_file(tmp_path / "st" / "model.safetensors"), dcp_tensors(megatron_runs["merged"])
    assert got.keys() == want.keys() and "decoder.layers.self_attention.linear_qkv.weight" in got
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_damaged_or_foreign_checkpoints_are_one_error_line(
    megatron_runs: dict[str, Path], tmp_path: Path
) -> None:
    save = tmp_path / "save"
    for name in ITERS[-2:]:
        shutil.copytree(megatron_runs["ws1"] / name, save / name)
    for f in (save / ITERS[-1]).glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])  # truncated after the save
    r = CliRunner().invoke(cli, ["merge", str(save), "-o", str(tmp_path / "out"), "--last", "2"])
    assert r.exit_code == 1, r.output
    assert (
        ITERS[-1] in r.stderr
        and "truncated" in r.stderr
        and len(r.stderr.splitlines()) == 1
        and "Traceback" not in r.output
    )
    assert not (tmp_path / "out").exists()
    # Megatron-LM's legacy format (mp_rank_XX/model_optim_rng.pt, no DCP files) is named, not guessed at.
    legacy = tmp_path / "legacy" / "iter_0000001"
    (legacy / "mp_rank_00").mkdir(parents=True)
    torch.save({"iteration": 1}, legacy / "common.pt")
    with pytest.raises(IncompleteSnapshot, match="legacy --ckpt-format torch is not read"):
        get_layout("megatron").read(legacy, 64)
    (save / ITERS[-2] / "metadata.json").write_text('{"sharded_backend": "zarr"}')  # an older backend
    with pytest.raises(IncompleteSnapshot, match="'zarr' format is not read"):
        get_layout("megatron").read(save / ITERS[-2], None)


# --- megatron-core 0.19: the common state inside the DCP files ---------------------------------------------------


def test_megatron_019_save_folders_merge_with_no_flags_and_019_loads_the_merge(
    megatron19_runs: dict[str, Path],
) -> None:
    """0.19's own save code writes no common.pt (the ``common_state`` entry instead); such folders are found,
    counted from that state, merged to the hand average, written back in the same layout, loaded by 0.19 and
    trained a step from."""
    ws1, out = megatron19_runs["ws1"], megatron19_runs["merged"]
    iters = sorted(p.name for p in ws1.glob("iter_*"))
    assert len(iters) == 4 and not (ws1 / iters[-1] / "common.pt").exists()
    assert any(k.startswith("common_state/") for k in dcp_metadata(ws1 / iters[-1]).state_dict_metadata)
    snapshots = discover(ws1)
    assert [s.tokens for s in snapshots] == [TOKENS_PER_ITER * i for i in range(1, 5)]
    assert {s.layout for s in snapshots} == {"megatron"} and snapshots[-1].lr == pytest.approx(1e-2)

    want = hand_average([ws1 / name for name in iters])
    got = dcp_tensors(out)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)
    # the 0.19 layout, not the 0.16 one: the common state is carried as its entry, byte for byte, and no common.pt
    assert not (out / "common.pt").exists()
    carried = dcp_bytes(out)
    assert carried == dcp_bytes(ws1 / iters[-1]) and any(k.startswith("common_state/") for k in carried)
    assert filecmp.cmp(out / "metadata.json", ws1 / iters[-1] / "metadata.json", shallow=False)
    assert layout_of(out) is get_layout("megatron")
    loaded = dcp_tensors(megatron19_runs["loaded"])
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    step = json.loads((megatron19_runs["root"] / "pma-init.json").read_text())
    assert math.isfinite(step["loss"]) and step["moved"], step


def test_megatron_019_safetensors_output_claims_no_megatron_format(
    megatron19_runs: dict[str, Path], tmp_path: Path
) -> None:
    """``--format safetensors`` of Megatron inputs writes HF safetensors only: no ``metadata.json`` that would make
    Megatron take the folder for a torch_dist checkpoint (it then failed: "global metadata read failed")."""
    r = CliRunner().invoke(
        cli, ["merge", str(megatron19_runs["ws1"]), "-o", str(tmp_path / "hf"), "--format", "safetensors"]
    )
    assert r.exit_code == 0, r.output
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert "model.safetensors" in names
    assert not {"metadata.json", "common.pt", ".metadata"} & set(names), names


def test_megatron_lm_save_checkpoint_folders_merge_and_load_checkpoint_loads_the_merge(
    megatron_lm19_runs: dict[str, Path],
) -> None:
    """Megatron-LM's own save_checkpoint (0.19.2): counted from its common state with no flags, merged into the
    same layout (its common state carried byte for byte as the entry it was), and loaded by its own
    load_checkpoint at TP=1 and TP=2, which then trains a step."""
    ws1, out = megatron_lm19_runs["ws1"], megatron_lm19_runs["merged"] / "iter_0000004"
    iters = [f"iter_{i:07d}" for i in range(1, 5)]
    snaps = discover(ws1)
    assert [(s.path.name, s.step, s.tokens) for s in snaps] == [
        (name, i, TOKENS_PER_ITER * i) for i, name in enumerate(iters, 1)
    ]
    assert {(s.layout, s.source, s.lr) for s in snaps} == {("megatron", "megatron", 0.01)}
    assert not any(ws1.glob("*/common.pt"))
    want, got = hand_average([ws1 / n for n in iters]), dcp_tensors(out)
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)
    carried = dcp_bytes(out)
    newest = {k: v for k, v in dcp_bytes(ws1 / iters[-1]).items() if not k.startswith("optimizer.")}
    assert carried == newest and any(k.startswith("common_state/") for k in carried)
    assert not (out / "common.pt").exists()
    for tp in (1, 2):
        loaded = dcp_tensors(megatron_lm19_runs[f"loaded-tp{tp}"])
        assert loaded.keys() == got.keys()
        for name, value in got.items():
            assert torch.equal(loaded[name], value), (tp, name)
        step = json.loads((megatron_lm19_runs["root"] / f"loaded-tp{tp}.json").read_text())
        assert step["tp"] == tp and step["iteration"] == 4, step
        assert math.isfinite(step["loss"]) and step["moved"], step


def test_megatron_moe_at_ep2_merges_to_the_hand_average_and_loads_at_ep1_and_ep2(
    megatron_moe_runs: dict[str, Path], tmp_path: Path
) -> None:
    ws1, out = megatron_moe_runs["ws1"], megatron_moe_runs["merged"]
    iters = [f"iter_{i:07d}" for i in range(1, 4)]
    check_router_bias_rules(ws1, out, [ws1 / n for n in iters], tmp_path / "latest")
    snaps = discover(ws1)
    assert [(s.step, s.tokens, s.lr) for s in snaps] == [(i, TOKENS_PER_ITER * i, 0.01) for i in (1, 2, 3)]
    want, got = hand_average([ws1 / n for n in iters]), dcp_tensors(out)
    assert got.keys() == want.keys()
    experts = [k for k in got if ".experts." in k]
    assert experts and "decoder.layers.mlp.router.expert_bias" in got  # every expert of both EP ranks
    for name, value in want.items():  # the router's bias too: the default rule averages it, in fp32
        torch.testing.assert_close(got[name], value, msg=name)
    assert got["decoder.layers.mlp.router.expert_bias"].dtype == torch.float32
    manifest = json.loads((out / "pmakit-merge.json").read_text())
    assert "decoder.layers.mlp.router.expert_bias" in json.dumps(manifest)  # listed as a router bias
    # written back in the inputs' own layout: common.pt up to 0.18, or 0.19's common state entry
    version = megatron_moe_runs["root"].name.split("-")[2][:4]  # megatron-moe-0.19N
    assert (ws1 / iters[-1] / "common.pt").exists() == (version != "0.19")
    assert (out / "common.pt").exists() == (version != "0.19")
    for ep in (1, 2):
        loaded = dcp_tensors(megatron_moe_runs[f"loaded-ep{ep}"])
        assert loaded.keys() == got.keys()
        for name, value in got.items():
            assert torch.equal(loaded[name], value), (ep, name)
        step = json.loads((megatron_moe_runs["root"] / f"loaded-ep{ep}.json").read_text())
        assert step["ep"] == ep and math.isfinite(step["loss"]) and step["moved"], step
        assert step["version"].startswith(f"{version}."), step  # the release this run is named after


ROUTER_BIAS = "decoder.layers.mlp.router.expert_bias"


def check_router_bias_rules(ws1: Path, merged: Path, checkpoints: list[Path], latest: Path) -> None:
    """Megatron's own bias update moved the router's ``expert_bias`` every step, so the two rules differ: the
    default averages it (the hand average), ``--buffers latest`` takes the newest exactly."""
    states = [model_weights(c) for c in checkpoints]
    biases = [s[ROUTER_BIAS] for s in states]
    assert all(not torch.equal(a, b) for a, b in zip(biases, biases[1:])), biases
    averaged = dcp_tensors(merged)[ROUTER_BIAS]
    torch.testing.assert_close(averaged, torch.stack(biases).mean(0), rtol=0, atol=1e-7)
    assert (averaged - biases[-1]).abs().max() > 1e-4  # the rules can be told apart
    r = CliRunner().invoke(cli, ["merge", str(ws1), "-o", str(latest), "-q", "--buffers", "latest"])
    assert r.exit_code == 0, r.output
    got, want = dcp_tensors(latest), hand_average(checkpoints)
    assert torch.equal(got[ROUTER_BIAS], biases[-1])
    for name, value in want.items():
        if name != ROUTER_BIAS:
            torch.testing.assert_close(got[name], value, msg=name)
    kinds = json.loads((latest / "pmakit-merge.json").read_text())["tensor_kinds"]
    assert kinds["router_bias"]["rule"] == "latest" and kinds["router_bias"]["names"] == [ROUTER_BIAS]
