"""HF MoE end to end with transformers' own code: tiny Qwen2-MoE and OLMoE trained a few steps by the Trainer,
snapshots written by pmakit's HF callback (the modules' fused expert names) and by the Trainer (checkpoint-N,
``save_pretrained``'s per-expert names); merged, loaded back with ``from_pretrained``, run. DeepSeek-V3's
``e_score_correction_bias`` shows the router-bias rule both ways."""

from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import load_dir, run_cli
from pmakit.snapshot import discover

transformers = pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 4, 2, 8


def tiny(kind: str) -> Any:
    common = dict(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=32, eos_token_id=0, pad_token_id=0,
        bos_token_id=0,
    )  # fmt: skip
    if kind == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            intermediate_size=32, moe_intermediate_size=8, shared_expert_intermediate_size=16, **common
        )
    else:
        config = transformers.OlmoeConfig(intermediate_size=8, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module", params=["qwen2_moe", "olmoe"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny MoE trained ``STEPS`` steps: (the callback's snapshot dir, the Trainer's output dir)."""
    from pmakit.integrations.hf import PMACallback

    root = tmp_path_factory.mktemp(request.param)
    ids = torch.randint(0, 64, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(root / "trainer"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=1e-2,
        save_strategy="steps",
        save_steps=1,
        save_only_model=True,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        include_num_input_tokens_seen=True,
        seed=0,
    )
    callback = PMACallback(root / "snaps", BATCH * SEQ, last=STEPS)
    trainer = transformers.Trainer(
        model=tiny(request.param),
        args=args,
        train_dataset=[{"input_ids": x, "labels": x} for x in ids],
        callbacks=[callback],
    )
    trainer.train()
    return root / "snaps", root / "trainer"


def hand_average(paths: list[Path]) -> dict[str, torch.Tensor]:
    states = [load_dir(p) for p in paths]
    return {k: sum(s[k].double() for s in states) / len(states) for k in states[-1]}  # type: ignore[misc]


def check_loads_and_runs(out: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.arange(SEQ).unsqueeze(0)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert torch.isfinite(loss)


@pytest.mark.parametrize("source", ["callback", "trainer"])
def test_hf_moe_merge_equals_hand_average(trained: tuple[Path, Path], source: str, tmp_path: Path) -> None:
    snaps = discover(trained[0] if source == "callback" else trained[1])
    assert len(snaps) == STEPS
    names = load_dir(snaps[-1].path).keys()
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in names)
    per_expert = any(".mlp.experts.0.gate_proj.weight" in k for k in names)
    assert (fused, per_expert) == ((True, False) if source == "callback" else (False, True))
    proc = run_cli("merge", *[s.path for s in snaps], "-o", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    got, want = load_dir(tmp_path / "out"), hand_average([s.path for s in snaps])
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v.double(), want[k], rtol=1e-6, atol=1e-7, msg=k)
    check_loads_and_runs(tmp_path / "out")


def test_hf_moe_mix_of_conventions_fails_in_one_line(trained: tuple[Path, Path], tmp_path: Path) -> None:
    callback, checkpoints = discover(trained[0]), discover(trained[1])
    proc = run_cli("merge", checkpoints[0].path, callback[-1].path, "-o", tmp_path / "out")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "names its experts per-expert (mlp.experts.0.gate_proj.weight)" in lines[0]
    assert "fused (mlp.experts.gate_up_proj)" in lines[0]
    assert not (tmp_path / "out").exists()


def tiny_deepseek_v3() -> Any:
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, max_position_embeddings=32, eos_token_id=0,
        pad_token_id=0, bos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("buffers", ["average", "latest"])
def test_deepseek_v3_router_bias_rule(tmp_path: Path, buffers: str) -> None:
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    model, paths, biases = tiny_deepseek_v3(), [], []
    for i in range(3):  # three snapshots whose router biases differ, written by transformers itself in bf16
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
            model.get_buffer(bias).copy_(torch.linspace(-1, 1, 4) * (i + 1) / 7)
        model.to(torch.bfloat16).save_pretrained(tmp_path / "run" / f"step-{i + 1}")
        model.float()
        biases.append(load_dir(tmp_path / "run" / f"step-{i + 1}")[bias])
        paths.append(tmp_path / "run" / f"step-{i + 1}")
    assert biases[0].dtype == torch.bfloat16  # the model cast whole, bias too: what a bf16 run saves
    proc = run_cli(
        "merge",
        *paths,
        "-o",
        tmp_path / "out",
        "--tokens-per-step",
        "1",
        "--dtype",
        "bf16",
        "--buffers",
        buffers,
    )
    assert proc.returncode == 0, proc.stderr
    got = load_dir(tmp_path / "out")
    assert got[bias].dtype == torch.float32 and got["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    want = biases[-1].double() if buffers == "latest" else sum(b.double() for b in biases) / 3
    torch.testing.assert_close(got[bias].double(), want, rtol=1e-6, atol=1e-8)
    if buffers == "average":  # the fp32 mean of bf16 values is not a bf16 value: a bf16 output would round it
        assert not torch.equal(got[bias].to(torch.bfloat16).float(), got[bias])
    check_loads_and_runs(tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    assert torch.equal(loaded.get_buffer(bias), got[bias])
