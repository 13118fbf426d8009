"""MoE checkpoints written by the frameworks' own code: torchtitan's deepseek_v3 debug model trained by its Trainer
(grouped experts as ``[E, ...]`` tensors, the router's ``expert_bias_E``), and OLMo-core's MoE transformer saved by
its Trainer's checkpointer (flattened experts, the router's ``score_bias``). Each is merged with no flags, checked
against a hand average read by torch's or OLMo-core's own reader, and loaded back by the framework."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from conftest import run_cli, write_snapshot
from layouts.test_torchtitan import model_weights as torchtitan_weights

olmo_ckpt = pytest.importorskip("olmo_core.distributed.checkpoint")

EXPERTS = "layers.1.moe.routed_experts.inner_experts.w1_EFD"  # layer 0 is dense in the debug model
EXPERT_BIAS = "layers.1.moe.expert_bias_E"


def olmo_core_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model weights of one OLMo-core checkpoint, read by OLMo-core's own reader."""
    metadata = olmo_ckpt.get_checkpoint_metadata(checkpoint / "model_and_optim")
    keys = [k for k in metadata.state_dict_metadata if k.startswith("model.")]
    values = olmo_ckpt.load_keys(checkpoint / "model_and_optim", keys)
    return {k.removeprefix("model."): v for k, v in zip(keys, values)}


def assert_hand_average(got: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]]) -> None:
    assert got.keys() == states[-1].keys()
    for name in got:
        want = torch.stack([s[name].float() for s in states]).mean(0)
        torch.testing.assert_close(got[name], want, msg=name)  # fp32 sum of w * x vs mean: ulps apart


def test_torchtitan_moe_merge_is_the_hand_average_and_torchtitan_loads_it(
    torchtitan_moe_runs: dict[str, Path],
) -> None:
    runs = torchtitan_moe_runs
    states = [torchtitan_weights(runs["ws1"] / "checkpoint" / f"step-{i}") for i in (1, 2, 3)]
    got = torchtitan_weights(runs["merged"])
    assert got[EXPERTS].shape == (8, 256, 256)  # grouped experts, one [E, F, D] tensor per layer
    # The router's load-balancing bias moved during training (so its average is a real check) and is kept fp32.
    assert not torch.equal(states[0][EXPERT_BIAS], states[-1][EXPERT_BIAS])
    assert got[EXPERT_BIAS].dtype == torch.float32
    assert_hand_average(got, states)
    # torchtitan 0.3.0 does not save its per-expert token counter (tokens_per_expert_E is a non-persistent buffer).
    assert not any("tokens_per_expert" in k for k in got)
    manifest = json.loads((runs["merged"] / "pmakit-merge.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["step-1", "step-2", "step-3"]
    # The manifest lists the router biases (layers 1 and 2 are MoE) and their rule; no counter reached the merge.
    assert manifest["buffers"] == "average" and set(manifest["tensor_kinds"]) == {"router_bias"}
    biases = manifest["tensor_kinds"]["router_bias"]
    assert biases["rule"] == "average" and biases["dtype"] == "float32"
    assert sorted(biases["names"]) == [f"layers.{i}.moe.expert_bias_E" for i in (1, 2)]

    # torchtitan loaded the merge (initial_load_path, model only) into its model, exactly, and trained a step.
    loaded = torch.load(runs["root"] / "loaded.pt", weights_only=True)
    assert loaded.keys() == got.keys()
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    record = json.loads((runs["root"] / "loaded.json").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def test_torchtitan_expert_parallel_checkpoints_merge_and_load_back_at_ep2(
    torchtitan_moe_runs: dict[str, Path],
) -> None:
    """Expert parallelism 2 over 2 gloo ranks: each rank saved its 4 experts of every grouped tensor; the merge is
    the hand average of the global tensors, and torchtitan at EP=2 loads it exactly and trains a step."""
    runs = torchtitan_moe_runs
    assert list((runs["ep2"] / "checkpoint" / "step-1").glob("__1_*.distcp"))  # saved by 2 ranks
    states = [torchtitan_weights(runs["ep2"] / "checkpoint" / f"step-{i}") for i in (1, 2)]
    got = torchtitan_weights(runs["merged-ep2"])
    assert got[EXPERTS].shape == (8, 256, 256)
    assert_hand_average(got, states)
    loaded = torch.load(runs["root"] / "loaded-ep2.pt", weights_only=True)  # full tensors, gathered by rank 0
    assert loaded.keys() == got.keys()
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    record = json.loads((runs["root"] / "loaded-ep2.json").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def test_torchtitan_moe_safetensors_export_splits_the_experts_into_hf_names_and_loads_back(
    torchtitan_moe_runs: dict[str, Path],
) -> None:
    from safetensors.torch import load_file

    runs = torchtitan_moe_runs
    hf = load_file(runs["merged-hf"] / "model-hf.safetensors")
    # torchtitan's deepseek_v3 adapter: one tensor per expert, the bias under DeepSeek-V3's HF name.
    assert {f"model.layers.1.mlp.experts.{e}.gate_proj.weight" for e in range(8)} <= hf.keys()
    assert hf["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert not any(k.endswith("_EFD") or k.endswith("_E") for k in hf)
    merged = torchtitan_weights(runs["merged"])
    torch.testing.assert_close(
        hf["model.layers.1.mlp.gate.e_score_correction_bias"], merged[EXPERT_BIAS], rtol=0, atol=0
    )
    # torchtitan's from_hf (--checkpoint.initial_load_in_hf) regroups them into exactly the merged weights.
    loaded = torch.load(runs["root"] / "loaded-hf.pt", weights_only=True)
    assert loaded.keys() == merged.keys()
    for name, value in merged.items():
        assert torch.equal(loaded[name], value), name
    assert math.isfinite(json.loads((runs["root"] / "loaded-hf.json").read_text())["loss"])


def test_torchtitan_moe_last_save_in_hf_regroups_the_experts_and_merges(
    torchtitan_moe_runs: dict[str, Path],
) -> None:
    """deepseek_v3 with --checkpoint.last_save_in_hf: step-3 holds one HF tensor per expert and the bias as
    e_score_correction_bias; read back, regrouped into [E, ...] tensors, it joins the DCP saves' average."""
    from safetensors.torch import load_file
    from torchtitan.models import deepseek_v3

    runs = torchtitan_moe_runs
    hf = runs["lasthf"] / "checkpoint" / "step-3"
    spec = deepseek_v3.model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    files = {k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()}
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in files
    last = adapter.from_hf(files)  # torchtitan's own reading of its HF save
    states = [torchtitan_weights(runs["lasthf"] / "checkpoint" / f"step-{i}") for i in (1, 2)] + [last]
    got = torchtitan_weights(runs["lasthf-merged"])
    assert got[EXPERTS].shape == (8, 256, 256) and not torch.equal(states[0][EXPERT_BIAS], last[EXPERT_BIAS])
    assert_hand_average(got, states)
    manifest = json.loads((runs["lasthf-merged"] / "pmakit-merge.json").read_text())
    assert [(Path(i["path"]).name, i["format"]) for i in manifest["inputs"]][-1] == (
        "step-3",
        "torchtitan-hf",
    )
    loaded = torch.load(runs["root"] / "lasthf-loaded.pt", weights_only=True)
    assert loaded.keys() == got.keys()
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name
    record = json.loads((runs["root"] / "lasthf-loaded.json").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def test_olmo_core_moe_merge_is_the_hand_average_and_olmo_core_loads_it(
    olmo_core_moe_runs: dict[str, Path],
) -> None:
    runs = olmo_core_moe_runs
    states = [olmo_core_weights(runs["e4"] / f"step{i}") for i in range(4)]  # step0: the init
    got = olmo_core_weights(runs["merged"])
    bias = "blocks.0.feed_forward_moe.router.score_bias"
    assert got["blocks.0.feed_forward_moe.experts.mlp.w1"].shape == (4 * 32, 32)  # experts flattened [E*H, D]
    assert got[bias].shape == (4,) and got[bias].dtype == torch.float32
    assert not torch.equal(states[0][bias], states[-1][bias])
    assert_hand_average(got, states)
    # OLMo-core's Trainer.load_checkpoint loaded exactly the merge into its MoE model.
    loaded = torch.load(runs["root"] / "loaded.pt", weights_only=True)
    assert loaded.keys() == got.keys()
    for name, value in got.items():
        assert torch.equal(loaded[name], value), name


def test_olmo_core_router_bias_is_listed_and_buffers_latest_takes_the_newest(
    olmo_core_moe_runs: dict[str, Path], tmp_path: Path
) -> None:
    runs = olmo_core_moe_runs
    biases = [f"blocks.{i}.feed_forward_moe.router.score_bias" for i in (0, 1)]
    manifest = json.loads((runs["merged"] / "pmakit-merge.json").read_text())
    assert set(manifest["tensor_kinds"]) == {"router_bias"}  # OLMo-core never saves its expert counters
    assert sorted(manifest["tensor_kinds"]["router_bias"]["names"]) == biases
    inspect = json.loads(run_cli("inspect", runs["e4"], "--json").stdout)
    assert inspect["state"]["router_bias"]["rule"] == "average"
    assert sorted(inspect["state"]["router_bias"]["names"]) == biases

    out = tmp_path / "latest"
    proc = run_cli("merge", runs["e4"], "-o", out, "-q", "--buffers", "latest")
    assert proc.returncode == 0, proc.stderr
    states = [olmo_core_weights(runs["e4"] / f"step{i}") for i in range(4)]  # step0: the init
    got = olmo_core_weights(out)
    for name in biases:  # the newest snapshot's, as it is
        assert torch.equal(got[name], states[-1][name]), name
    averaged = {k: v for k, v in got.items() if k not in biases}
    assert_hand_average(averaged, [{k: s[k] for k in averaged} for s in states])
    assert (
        json.loads((out / "pmakit-merge.json").read_text())["tensor_kinds"]["router_bias"]["rule"] == "latest"
    )


def test_snapshots_of_different_expert_counts_are_one_error(
    olmo_core_moe_runs: dict[str, Path], tmp_path: Path
) -> None:
    """An OLMo-core checkpoint of the 2-expert model among the 4-expert run's: no merge, one ``Error:`` line whose
    count comes from the router bias (OLMo-core flattens its experts: their first dimension is no count)."""
    run = tmp_path / "run"
    run.mkdir()
    # Copies (under 1 MiB each): pmakit skips a symlink that leaves the run directory.
    for i in (1, 2):
        shutil.copytree(olmo_core_moe_runs["e4"] / f"step{i}", run / f"step{i}")
    shutil.copytree(olmo_core_moe_runs["e2"] / "step4", run / "step3")  # 256 tokens: after the others
    proc = run_cli("merge", run, "-o", tmp_path / "out", "-q")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("info: ")]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "Error: the number of experts differs: tensor 'blocks.0.feed_forward_moe.router."
    )
    assert lines[0].endswith("(4 vs 2 experts)")
    assert not (tmp_path / "out").exists()


def test_inspect_summary_names_the_checkpoint_size_and_the_model_size(
    torchtitan_moe_runs: dict[str, Path],
) -> None:
    """torchtitan's full checkpoints hold the optimizer (3x the model); its last save is model-only: the summary
    gives both sizes, each under its own name, and the JSON each snapshot's."""
    from pmakit.units import format_bytes

    run = torchtitan_moe_runs["ws1"]
    rows = json.loads(run_cli("inspect", run, "--json").stdout)["snapshots"]
    disk = [sum(f.stat().st_size for f in (run / "checkpoint" / f"step-{i}").iterdir()) for i in (1, 2, 3)]
    model = sum(
        t.numel() * t.element_size() for t in torchtitan_weights(run / "checkpoint" / "step-3").values()
    )
    assert [r["bytes"] for r in rows] == disk and disk[0] == disk[1] > 2.5 * disk[2]
    assert {r["model_bytes"] for r in rows} == {model}
    proc = run_cli("inspect", run)
    assert proc.returncode == 0, proc.stderr
    summary = " ".join(proc.stdout.split("┏")[0].split())
    assert (
        f"checkpoint {format_bytes(disk[2])} .. {format_bytes(disk[0])} on disk, model {format_bytes(model)}"
        in summary
    ), summary


def test_flattened_experts_without_a_router_bias_claim_no_expert_count(tmp_path: Path) -> None:
    """OLMo-core's layout without ``bias_gamma``: experts [E * hidden, d], router [E * d]. Their first dimensions
    differ with the number of experts but are no count of it: the error says so instead of inventing one."""
    for i, experts in enumerate((4, 4, 2), start=1):
        state = {
            "blocks.0.feed_forward_moe.router.weight": torch.zeros(experts * 8),
            "blocks.0.feed_forward_moe.experts.mlp.w1": torch.zeros(experts * 16, 8),
        }
        write_snapshot(tmp_path / "run" / f"step{i}", state, step=i, tokens=100 * i)
    proc = run_cli("merge", tmp_path / "run", "-o", tmp_path / "out", "-q")
    lines = [line for line in proc.stderr.strip().splitlines() if not line.startswith("info: ")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("Error: the number of experts differs: tensor 'blocks.0.feed_forward_moe.")
    assert lines[0].endswith("(first dimension 32 vs 16, the experts flattened into it)") or lines[
        0
    ].endswith("(first dimension 64 vs 32, the experts flattened into it)")
    assert "experts)" not in lines[0]
