"""MoE non-weight state: router biases averaged (default) or the newest's, in fp32 whatever --dtype; counters the
newest's, never averaged; the manifest and inspect list them; bad MoE inputs fail in one line."""

import json
from pathlib import Path

import pytest
import torch

from conftest import load_dir, run_cli, write_states
from pmakit.errors import PmakitError
from pmakit.layouts.kinds import DEFAULT_BUFFERS, Kind, classify
from pmakit.merge import merge, plan_merge
from pmakit.snapshot import discover

E, H = 4, 8
BIAS = "layers.0.moe.router.expert_bias"  # Megatron's name
COUNT = "layers.0.moe.tokens_per_expert"  # torchtitan's (float32 in the trainer)
STEPS = "layers.0.moe.router.ga_steps"


def moe_state(seed: int, experts: int = E, bias: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {
        "layers.0.moe.router.weight": torch.randn(experts, H, generator=g).to(torch.bfloat16),
        "layers.0.moe.experts.w1": torch.randn(experts, H, 2 * H, generator=g).to(torch.bfloat16),
        "layers.0.attn.wq": torch.randn(H, H, generator=g).to(torch.bfloat16),
        COUNT: torch.randint(0, 1000, (experts,), generator=g).float(),
        STEPS: torch.tensor([seed], dtype=torch.int64),
    }
    if bias:
        # Values whose bf16 rounding is visible: the fp32 bits must survive whatever --dtype says.
        t[BIAS] = torch.randn(experts, generator=g) * 1e-3 + 0.1
    return t


@pytest.mark.parametrize(
    ("name", "dtype", "kind"),
    [
        ("decoder.layers.3.mlp.router.expert_bias", torch.float32, Kind.ROUTER_BIAS),  # Megatron
        ("decoder.layers.3.mlp.router.local_tokens_per_expert", torch.float32, Kind.COUNTER),
        ("layers.1.moe.expert_bias_E", torch.float32, Kind.ROUTER_BIAS),  # torchtitan 0.3.0
        ("layers.1.moe.tokens_per_expert_E", torch.float32, Kind.COUNTER),
        ("layers.1.moe.expert_bias", torch.bfloat16, Kind.ROUTER_BIAS),  # torchtitan before
        ("blocks.0.feed_forward_moe.router.score_bias", torch.float32, Kind.ROUTER_BIAS),  # OLMo-core
        ("model.layers.2.mlp.gate.e_score_correction_bias", torch.float32, Kind.ROUTER_BIAS),  # DeepSeek-V3
        ("model.layers.2.mlp.gate.weight", torch.bfloat16, Kind.WEIGHT),  # Qwen-MoE/OLMoE/Mixtral router
        ("model.layers.2.mlp.experts.gate_up_proj", torch.bfloat16, Kind.WEIGHT),
        ("model.layers.2.mlp.experts.0.gate_proj.weight", torch.bfloat16, Kind.WEIGHT),
        ("step_counter", torch.int64, Kind.COUNTER),
        ("model.expert_bias_scale", torch.float32, Kind.WEIGHT),  # a suffix match, not a substring one
    ],
)
def test_classify_names_of_each_framework(name: str, dtype: torch.dtype, kind: Kind) -> None:
    assert classify(name, dtype, (E,)) is kind


def test_default_averages_biases_in_fp32_and_takes_counters_from_the_newest(tmp_path: Path) -> None:
    states = [moe_state(s) for s in (1, 2, 3)]
    run = write_states(tmp_path / "run", states)
    snaps = discover(run)
    result = merge(snaps, [0.2, 0.3, 0.5], tmp_path / "out", dtype="bf16")
    got = load_dir(tmp_path / "out")
    assert DEFAULT_BUFFERS == "average"
    want = sum(w * s[BIAS].double() for w, s in zip([0.2, 0.3, 0.5], states))
    assert got[BIAS].dtype == torch.float32  # not bf16, although --dtype bf16
    torch.testing.assert_close(got[BIAS].double(), want, rtol=1e-6, atol=1e-9)
    assert not torch.equal(got[BIAS].to(torch.bfloat16).float(), got[BIAS])  # bf16 would have changed it
    # Counters: the newest's bytes, dtype kept, never averaged.
    assert got[COUNT].dtype == torch.float32 and torch.equal(got[COUNT], states[-1][COUNT])
    assert torch.equal(got[STEPS], states[-1][STEPS])
    assert got["layers.0.attn.wq"].dtype == torch.bfloat16
    kinds = result.manifest["tensor_kinds"]
    assert result.manifest["buffers"] == "average"
    assert kinds["router_bias"] == {"rule": "average", "names": [BIAS], "dtype": "float32"}
    assert kinds["counter"]["rule"] == "latest"
    assert sorted(kinds["counter"]["names"]) == sorted([COUNT, STEPS])
    on_disk = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    assert on_disk["tensor_kinds"] == kinds


def test_buffers_latest_takes_the_newest_bias_in_fp32(tmp_path: Path) -> None:
    states = [moe_state(s) for s in (1, 2, 3)]
    states[-1][BIAS] = states[-1][BIAS].to(torch.bfloat16)  # a trainer that downcast it: written back as fp32
    for s in states[:-1]:
        s[BIAS] = s[BIAS].to(torch.bfloat16)
    snaps = discover(write_states(tmp_path / "run", states))
    result = merge(snaps, [1 / 3] * 3, tmp_path / "out", buffers="latest", keep_fp32=True, dtype="bf16")
    got = load_dir(tmp_path / "out")
    assert got[BIAS].dtype == torch.float32 and torch.equal(got[BIAS], states[-1][BIAS].float())
    assert torch.equal(got[COUNT], states[-1][COUNT])
    assert result.manifest["tensor_kinds"]["router_bias"]["rule"] == "latest"
    # The weights are still averaged.
    want = sum(s["layers.0.attn.wq"].double() for s in states) / 3
    torch.testing.assert_close(got["layers.0.attn.wq"].double(), want, rtol=1e-2, atol=1e-2)


def test_plan_reads_a_latest_tensor_once(tmp_path: Path) -> None:
    snaps = discover(write_states(tmp_path / "run", [moe_state(s) for s in (1, 2)]))
    average = plan_merge(snaps, [0.5, 0.5])
    latest = plan_merge(snaps, [0.5, 0.5], buffers="latest")
    assert average.input_bytes - latest.input_bytes == E * 4  # one fp32 bias read once instead of twice
    with pytest.raises(PmakitError, match="unknown buffers rule 'newest'"):
        plan_merge(snaps, [0.5, 0.5], buffers="newest")


def test_cli_merge_buffers_latest_and_inspect_list_the_state(tmp_path: Path) -> None:
    states = [moe_state(s) for s in (1, 2)]
    run = write_states(tmp_path / "run", states)
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--buffers", "latest")
    assert proc.returncode == 0, proc.stderr
    assert f"router_bias: 1 tensor(s), from the newest snapshot in float32: {BIAS}" in proc.stdout
    assert torch.equal(load_dir(tmp_path / "out")[BIAS], states[-1][BIAS])
    proc = run_cli("inspect", run)
    assert proc.returncode == 0, proc.stderr
    assert "router_bias: 1 tensor(s), averaged in float32" in proc.stdout
    assert "counter: 2 tensor(s), from the newest snapshot" in proc.stdout
    proc = run_cli("inspect", run, "--json")
    assert json.loads(proc.stdout)["state"]["router_bias"]["names"] == [BIAS]


@pytest.mark.parametrize(
    ("older", "message"),
    [
        (
            moe_state(1, experts=2 * E),
            "Error: the number of experts differs: tensor 'layers.0.moe.",
        ),
        (moe_state(1, bias=False), f"Error: router bias '{BIAS}' is in "),
    ],
    ids=["experts", "bias-missing"],
)
def test_bad_moe_inputs_fail_in_one_line(
    tmp_path: Path, older: dict[str, torch.Tensor], message: str
) -> None:
    run = write_states(tmp_path / "run", [older, moe_state(2)])
    proc = run_cli("merge", run, "--last", "2", "-o", tmp_path / "out")
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr
    assert "step-10" in lines[0] and "step-20" in lines[0]
    assert not (tmp_path / "out").exists()
    if "experts" in message:
        assert f"({2 * E} vs {E} experts)" in lines[0]


@pytest.mark.parametrize("buffers", ["average", "latest"])
def test_average_states_applies_the_same_rules_as_merge(tmp_path: Path, buffers: str) -> None:
    from pmakit.merge import average_states

    states = [moe_state(s) for s in (1, 2, 3)]
    snaps = discover(write_states(tmp_path / "run", states))
    merge(snaps, [0.2, 0.3, 0.5], tmp_path / "out", buffers=buffers)
    got = average_states(states, [0.2, 0.3, 0.5], dtype="same", buffers=buffers)
    on_disk = load_dir(tmp_path / "out")
    assert got.keys() == on_disk.keys()
    for name, t in on_disk.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_online_averager_takes_counters_from_the_newest_and_matches_merge(tmp_path: Path) -> None:
    from pmakit.online import OnlineAverager
    from pmakit.saver import SnapshotSaver

    states = [moe_state(s) for s in (1, 2, 3)]
    averager = OnlineAverager(3, "sma")

    def on_save(snapshot: object, tensors: dict[str, torch.Tensor]) -> None:
        averager.update(tensors, tokens=snapshot.tokens, path=snapshot.path)  # type: ignore[attr-defined]

    saver = SnapshotSaver(tmp_path / "run", 100, on_save=[on_save], fsync=False)
    for i, s in enumerate(states, start=1):
        saver.save(s, tokens=i * 100, step=i)
    saver.wait()
    avg = averager.average()
    assert torch.equal(avg[COUNT], states[-1][COUNT]) and torch.equal(avg[STEPS], states[-1][STEPS])
    merge(discover(tmp_path / "run"), [1 / 3] * 3, tmp_path / "out", dtype="fp32")
    on_disk = load_dir(tmp_path / "out")
    for name in (BIAS, COUNT, "layers.0.moe.experts.w1"):
        torch.testing.assert_close(avg[name].float(), on_disk[name], rtol=0, atol=1e-6)


def test_incremental_update_averages_biases_and_refuses_latest(tmp_path: Path) -> None:
    states = [moe_state(s) for s in (1, 2, 3)]
    run = write_states(tmp_path / "run", states[:2])
    assert run_cli("merge", run, "--last", "2", "-o", tmp_path / "m0", "--dtype", "fp32").returncode == 0
    write_states(tmp_path / "run", states)  # a third snapshot: the window moves
    proc = run_cli("merge", run, "--last", "2", "--from-previous", tmp_path / "m0", "-o", tmp_path / "m1")
    assert proc.returncode == 0, proc.stderr
    got = load_dir(tmp_path / "m1")
    want = (states[1][BIAS].double() + states[2][BIAS].double()) / 2
    torch.testing.assert_close(got[BIAS].double(), want, rtol=1e-6, atol=1e-9)
    assert torch.equal(got[COUNT], states[-1][COUNT])
    proc = run_cli(
        "merge",
        run,
        "--last",
        "2",
        "--from-previous",
        tmp_path / "m0",
        "-o",
        tmp_path / "m2",
        "--buffers",
        "latest",
    )
    assert proc.returncode != 0 and "cannot take router biases from the newest snapshot" in proc.stderr
    assert not (tmp_path / "m2").exists()


@pytest.mark.parametrize(
    ("name", "dtype", "shape", "kind"),
    [
        (COUNT, torch.float32, (E, H), Kind.WEIGHT),  # a 2-D float "tokens_per_expert" is a projection
        (BIAS, torch.float32, (E, H), Kind.WEIGHT),
        (BIAS, torch.float32, (), Kind.WEIGHT),
        (COUNT, torch.float32, (), Kind.COUNTER),  # a scalar count is still a count
        (COUNT, torch.int64, (E, H), Kind.COUNTER),  # integers are never averaged, whatever their shape
    ],
)
def test_a_router_state_name_with_an_implausible_shape_is_a_weight(
    name: str, dtype: torch.dtype, shape: tuple[int, ...], kind: Kind
) -> None:
    assert classify(name, dtype, shape) is kind


@pytest.mark.parametrize("buffers", ["average", "latest"])
def test_streaming_merge_averages_implausible_router_state_as_weights(tmp_path: Path, buffers: str) -> None:
    g = torch.Generator().manual_seed(0)
    states = [moe_state(s) for s in (1, 2, 3)]
    for s in states:  # named like router state, shaped like weights
        s[COUNT] = torch.randn(E, H, generator=g).to(torch.bfloat16)
        s[BIAS] = torch.randn(E, H, generator=g).to(torch.bfloat16)
    run = write_states(tmp_path / "run", states)
    proc = run_cli("merge", run, "-o", tmp_path / "out", "--buffers", buffers, "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr
    got = load_dir(tmp_path / "out")
    for name in (COUNT, BIAS):
        want = (sum(s[name].float() for s in states) / 3).to(torch.bfloat16)
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want), name
        warnings = [x for x in proc.stderr.splitlines() if name in x]
        assert len(warnings) == 1 and "merged as a weight" in warnings[0], proc.stderr
    kinds = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())["tensor_kinds"]
    assert "router_bias" not in kinds and kinds["counter"]["names"] == [STEPS]


def test_stacked_layers_router_state_keeps_its_kind() -> None:
    """Megatron stacks its layers on a leading dimension: a 2-D expert_bias without a layer index is router state."""
    assert classify("decoder.layers.mlp.router.expert_bias", torch.float32, (2, E)) is Kind.ROUTER_BIAS
    assert (
        classify("decoder.layers.mlp.router.local_tokens_per_expert", torch.float32, (2, E)) is Kind.COUNTER
    )
    assert classify("decoder.layers.mlp.router.expert_bias", torch.float32, (2, E, H)) is Kind.WEIGHT
    assert classify("decoder.layers.3.mlp.router.expert_bias", torch.float32, (2, E)) is Kind.WEIGHT
