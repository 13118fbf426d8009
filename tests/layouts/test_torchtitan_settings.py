"""torchtitan's everyday checkpoint settings, written by its own Trainer and CheckpointManager (``torchtitan_run.py``):
``export_dtype`` (the model-only last save in fp16/bf16 beside fp32 checkpoints), ``last_save_in_hf`` (the last
save as HF safetensors), and ``--format safetensors`` of its MoE models (qwen3 MoE, gpt_oss) losing nothing. Each
is merged with no flags, equal to the hand average, loaded back by torchtitan, which trains a step from it, and the
conversions by transformers."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli
from layouts.conftest import SRC
from layouts.test_torchtitan import model_weights

QWEN3_BIAS = "layers.0.moe.expert_bias_E"


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoint" / f"step-{step}"


def assert_hand_average(got: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]]) -> None:
    assert got.keys() == states[0].keys()
    for name in got:
        want = torch.stack([s[name].float() for s in states]).mean(0)
        torch.testing.assert_close(got[name], want, msg=name)  # fp32 sum of w * x vs mean: ulps apart


def assert_loaded_and_trained(root: Path, stem: str, want: dict[str, torch.Tensor], **skip: Any) -> None:
    loaded = torch.load(root / f"{stem}.pt", weights_only=True)
    assert loaded.keys() == want.keys()
    for name, value in want.items():
        if name not in skip:
            assert torch.equal(loaded[name], value), name
    record = json.loads((root / f"{stem}.json").read_text())
    assert record["step"] == 1 and math.isfinite(record["loss"])


def pmakit(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)  # the real CLI in a subprocess, this checkout's src


def test_export_dtype_fp16_last_save_merges_with_the_fp32_checkpoints(
    torchtitan_settings_runs: dict[str, Path],
) -> None:
    """qwen3_moe_debug sets export_dtype="float16": step-3 (model-only) is fp16, step-1 and step-2 fp32."""
    runs = torchtitan_settings_runs
    states = [model_weights(ckpt(runs["q3"], i)) for i in (1, 2, 3)]
    assert {v.dtype for v in states[0].values()} == {torch.float32}
    assert {v.dtype for v in states[2].values()} == {torch.float16}
    assert not torch.equal(states[0][QWEN3_BIAS], states[1][QWEN3_BIAS])  # the router bias moves
    got = model_weights(runs["q3-merged"])
    assert {v.dtype for v in got.values()} == {torch.float32}
    assert_hand_average(got, states)
    manifest = json.loads((runs["q3-merged"] / "pmakit-merge.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["step-1", "step-2", "step-3"]
    precision = manifest["precision"]
    assert list(precision["inputs"].values()) == ["float32", "float32", "float16"]
    assert precision["output"] == "float32" and "export_dtype" in precision["why"]
    assert_loaded_and_trained(runs["root"], "q3-loaded", got)
    # inspect states which snapshot was in which dtype, the output's and why.
    r = pmakit("inspect", runs["q3"], "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["compatible"] and report["precision"] == precision
    r = pmakit("inspect", runs["q3"])
    assert r.returncode == 0 and "precision: the snapshots differ only in float precision" in r.stdout


def test_last_save_in_hf_bf16_is_merged_with_the_dcp_checkpoints(
    torchtitan_settings_runs: dict[str, Path],
) -> None:
    """llama3 with --checkpoint.last_save_in_hf --checkpoint.export_dtype bfloat16: step-3 is HF safetensors in
    bf16 (q/k rotary-permuted by torchtitan's to_hf); read back by torchtitan's own from_hf it joins the average."""
    import torchtitan.models.llama3 as llama3

    runs = torchtitan_settings_runs
    hf = ckpt(runs["l3"], 3)
    assert not (hf / ".metadata").exists() and list(hf.glob("*.safetensors"))
    spec = llama3.model_registry("debugmodel")
    adapter = spec.state_dict_adapter(spec.model, None)
    last = adapter.from_hf({k: v for f in hf.glob("*.safetensors") for k, v in load_file(f).items()})
    assert {v.dtype for v in last.values()} == {torch.bfloat16}
    states = [model_weights(ckpt(runs["l3"], i)) for i in (1, 2)] + [last]
    got = model_weights(runs["l3-merged"])
    assert_hand_average(got, states)
    manifest = json.loads((runs["l3-merged"] / "pmakit-merge.json").read_text())
    assert [(Path(i["path"]).name, i["tokens"]) for i in manifest["inputs"]] == [
        ("step-1", 128),
        ("step-2", 256),
        ("step-3", 384),  # the step x the other checkpoints' 128 tokens per step
    ]
    assert manifest["inputs"][-1]["format"] == "torchtitan-hf"
    assert list(manifest["precision"]["inputs"].values()) == ["float32", "float32", "bfloat16"]
    assert_loaded_and_trained(runs["root"], "l3-loaded", got)


def test_last_save_in_hf_lacking_the_router_bias_is_refused_in_one_line(
    torchtitan_settings_runs: dict[str, Path], tmp_path: Path
) -> None:
    """qwen3 MoE: torchtitan's to_hf writes no expert_bias_E, so its HF last save lacks them: never merged short,
    never dropped silently."""
    run = torchtitan_settings_runs["q3-lasthf"]
    r = pmakit("merge", run, "-o", tmp_path / "out", "-q")
    assert r.returncode == 1 and not (tmp_path / "out").exists()
    lines = r.stderr.strip().splitlines()
    (line,) = [x for x in lines if x.startswith("Error")]  # one error line, the last
    assert line == lines[-1] and "Traceback" not in r.stderr, r.stderr[-2000:]
    for part in ("--checkpoint.last_save_in_hf", "step-3", "expert_bias_E", "--exclude"):
        assert part in line, part
    r = pmakit("merge", run, "-o", tmp_path / "out", "-q", "--exclude", ckpt(run, 3))
    assert r.returncode == 0, r.stderr
    r = pmakit("inspect", run, "--json")
    report = json.loads(r.stdout)
    assert not report["compatible"] and "last_save_in_hf" in report["problems"][0]


def qwen3_hf_config() -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )


def gpt_oss_hf_config() -> Any:
    import transformers

    return transformers.GptOssConfig(
        vocab_size=2048,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=64,
        num_local_experts=8,
        num_experts_per_tok=4,
        tie_word_embeddings=False,
    )


def transformers_load(converted: Path, config: Any, cls_name: str, tmp_path: Path) -> Any:
    """transformers' from_pretrained on the converted file (plus the HF config of the debug model)."""
    import transformers

    model_dir = tmp_path / "hf-model"
    model_dir.mkdir()
    shutil.copy(converted / "model-hf.safetensors", model_dir / "model.safetensors")
    config.save_pretrained(model_dir)
    model, info = getattr(transformers, cls_name).from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    # Only the tensors HF's model has no slot for, kept under their documented torchtitan.* names.
    assert info["unexpected_keys"] == {f"torchtitan.layers.{i}.moe.expert_bias_E" for i in (0, 1)}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # ... and trains a step from it.
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    assert math.isfinite(loss.item())
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    return state


def test_qwen3_moe_safetensors_keeps_every_tensor_and_loads_in_transformers_and_torchtitan(
    torchtitan_settings_runs: dict[str, Path], tmp_path: Path
) -> None:
    runs = torchtitan_settings_runs
    merged = model_weights(runs["q3-merged"])
    hf = load_file(runs["q3-hf"] / "model-hf.safetensors")
    # 8 experts x 3 matrices per MoE layer as one tensor each, the router bias under its documented extra name:
    # every element of the merge is in the file (torchtitan's to_hf alone drops expert_bias_E).
    assert sum(v.numel() for v in hf.values()) == sum(v.numel() for v in merged.values())
    assert torch.equal(hf[f"torchtitan.{QWEN3_BIAS}"], merged[QWEN3_BIAS])
    assert len(hf) == len(merged) - 3 * 2 + 3 * 8 * 2
    sd = transformers_load(runs["q3-hf"], qwen3_hf_config(), "Qwen3MoeForCausalLM", tmp_path)
    experts = "layers.1.moe.routed_experts.inner_experts"
    fused = sd["model.layers.1.mlp.experts.gate_up_proj"]  # transformers 5 fuses [gate; up] per expert
    for e in range(8):
        want = torch.cat([merged[f"{experts}.w1_EFD"][e], merged[f"{experts}.w3_EFD"][e]])
        assert torch.equal(fused[e], want), e
    assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"], merged[f"{experts}.w2_EDF"])
    assert torch.equal(sd["model.layers.1.mlp.gate.weight"], merged["layers.1.moe.router.gate.weight"])
    assert torch.equal(sd["lm_head.weight"], merged["lm_head.weight"])
    # torchtitan's HF path (--checkpoint.initial_load_in_hf) loads every tensor it asks for at the merged value;
    # it asks no HF name for expert_bias_E (its to_hf maps none), which stays at its initial 0.
    loaded = torch.load(runs["root"] / "q3-loaded-hf.pt", weights_only=True)
    for i in (0, 1):
        assert torch.equal(loaded[f"layers.{i}.moe.expert_bias_E"], torch.zeros(8))
    biases = {f"layers.{i}.moe.expert_bias_E": None for i in (0, 1)}
    assert_loaded_and_trained(runs["root"], "q3-loaded-hf", merged, **biases)


def test_gpt_oss_safetensors_keeps_the_experts_and_transformers_computes_what_torchtitan_does(
    torchtitan_settings_runs: dict[str, Path], tmp_path: Path
) -> None:
    """gpt_oss: torchtitan 0.3.0's to_hf writes 55 of 75 tensors of its debug model (no routed expert, no
    expert_bias_E); pmakit writes them all, the experts under transformers' GptOssExperts names."""
    from torchtitan.models.gpt_oss.moe import swiglu

    runs = torchtitan_settings_runs
    states = [model_weights(ckpt(runs["gpt"], i)) for i in (1, 2, 3)]
    merged = model_weights(runs["gpt-merged"])
    assert_hand_average(merged, states)
    assert_loaded_and_trained(runs["root"], "gpt-loaded", merged)
    hf = load_file(runs["gpt-hf"] / "model-hf.safetensors")
    assert len(hf) == len(merged)
    assert sum(v.numel() for v in hf.values()) == sum(v.numel() for v in merged.values())
    sd = transformers_load(runs["gpt-hf"], gpt_oss_hf_config(), "GptOssForCausalLM", tmp_path)
    prefix, experts = "model.layers.1.mlp.experts", "layers.1.moe.routed_experts.inner_experts"
    assert torch.equal(sd[f"{prefix}.gate_up_proj_bias"], merged[f"{experts}.mlp1_bias_EG"])
    assert torch.equal(sd[f"{prefix}.down_proj_bias"], merged[f"{experts}.mlp2_bias_ED"])
    assert torch.equal(sd["model.layers.1.self_attn.sinks"], merged["layers.1.attention.sinks"])
    # One expert's MLP, as torchtitan computes it (x W1^T + b1, its swiglu, W2^T + b2) and as transformers does
    # with the converted tensors (x gate_up_proj + bias, GptOssExperts' gate, down_proj + bias): the same.
    import transformers

    hf_experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(gpt_oss_hf_config())
    x, e = torch.randn(5, 256, dtype=torch.float64), 3
    w1, b1 = merged[f"{experts}.mlp1_weight_EGD"][e].double(), merged[f"{experts}.mlp1_bias_EG"][e].double()
    w2, b2 = merged[f"{experts}.mlp2_weight_EDF"][e].double(), merged[f"{experts}.mlp2_bias_ED"][e].double()
    titan = swiglu(x @ w1.T + b1) @ w2.T + b2
    gated = hf_experts._apply_gate(x @ sd[f"{prefix}.gate_up_proj"][e].double() + b1)
    theirs = gated @ sd[f"{prefix}.down_proj"][e].double() + b2
    torch.testing.assert_close(theirs, titan)


def test_a_conversion_that_would_lose_tensors_fails_in_one_line(tmp_path: Path) -> None:
    """The written file is read back: a tensor missing or bytes short is one error line."""
    from pmakit.errors import PmakitError
    from pmakit.formats.safetensors_io import OutputTensor, save_file
    from pmakit.layouts import torchtitan_names as names
    from pmakit.layouts.torchtitan_hf import _check_written

    save_file({"a": torch.zeros(4), "b": torch.zeros(2)}, tmp_path / "x.safetensors")
    planned = [OutputTensor("a", torch.float32, (4,)), OutputTensor("b", torch.float32, (2,))]
    _check_written(tmp_path / "x.safetensors", planned)
    with pytest.raises(PmakitError, match=r"holds 2 of 3 converted tensors .*'c'"):
        _check_written(tmp_path / "x.safetensors", [*planned, OutputTensor("c", torch.float32, (1,))])
    shapes = {"x": (4, 2), "y": (3,)}
    with pytest.raises(PmakitError, match="'y' and 'x' would both be written as 'h'"):
        names.check_complete(
            {"x": names.Route("extra", ("h",), ((4, 2),)), "y": names.Route("extra", ("h",), ((3,),))}, shapes
        )
    with pytest.raises(PmakitError, match="'x' has 8 elements but its HF tensors"):
        names.check_complete(
            {"x": names.Route("experts", ("h0",), ((2,),)), "y": names.Route("extra", ("y",), ((3,),))},
            shapes,
        )
    with pytest.raises(PmakitError, match="1 of 2 tensors have no HF name"):
        names.check_complete({"x": names.Route("extra", ("h",), ((4, 2),))}, shapes)


def test_last_save_in_hf_without_torchtitan_installed_is_refused_in_one_line(
    torchtitan_settings_runs: dict[str, Path], tmp_path: Path
) -> None:
    """The HF names map back only through torchtitan's adapter: without torchtitan, one line, nothing written."""
    code = (
        "import sys; sys.modules['torchtitan'] = None\n"  # any import of torchtitan now fails
        "from pmakit.cli import main; sys.argv = ['pmakit', *sys.argv[1:]]; main()\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-c", code, "merge", str(torchtitan_settings_runs["l3"]), "-o", str(out), "-q"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC), "OMP_WAIT_POLICY": "PASSIVE"},
        timeout=1800,
    )
    assert proc.returncode == 1 and not out.exists() and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    (line,) = [x for x in lines if x.startswith("Error")]  # one error line, the last
    assert line == lines[-1] and "step-3" in line and "--checkpoint.last_save_in_hf" in line
