"""The MoE model (OLMoE with a biased router), its balancing, and `pmakit experiment --preset moe-smoke` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from pmakit.errors import PmakitError
from pmakit.lab.moe import routing_health
from pmakit.merge import average_states
from pmakit.train.model import ModelConfig, active_parameters, balance_experts, build_model, routers

TINY = ModelConfig(layers=2, hidden=16, heads=2, seq_len=16, experts=4, top_k=2, expert_width=16)


def test_bias_steers_the_choice_not_the_weights() -> None:
    model = build_model(TINY, 64, seed=0)
    router = routers(model)[0]
    h = torch.randn(32, 16)
    chosen = router(h)[2]
    router.e_score_correction_bias[3] = 10.0  # expert 3 now wins every token's top-k
    logits2, weights2, chosen2 = router(h)
    assert (chosen2 == 3).any(dim=-1).all() and not (chosen == 3).any(dim=-1).all()
    probs = torch.softmax(logits2.float(), -1)
    picked = probs.gather(-1, chosen2)
    torch.testing.assert_close(weights2, picked / picked.sum(-1, keepdim=True))  # unbiased probabilities
    assert "model.layers.0.mlp.gate.e_score_correction_bias" in model.state_dict()
    assert not any(k.endswith(".load") for k in model.state_dict())  # the step's counts are not saved


def test_balance_experts_moves_the_bias_toward_the_idle_experts() -> None:
    model = build_model(TINY, 64, seed=0).train()
    router = routers(model)[0]
    router.load.copy_(torch.tensor([10.0, 0.0, 5.0, 5.0]))  # mean 5: expert 0 over, 1 under, 2 and 3 even
    balance_experts(model, 0.01)
    torch.testing.assert_close(router.e_score_correction_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    assert router.load.sum() == 0  # counting restarts for the next step


def test_active_parameters_count_top_k_of_the_experts() -> None:
    model = build_model(TINY, 64, seed=0)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    assert active_parameters(model) == total - experts // 2  # top-2 of 4


def test_the_engine_finds_this_models_router_bias() -> None:
    bias = "model.layers.0.mlp.gate.e_score_correction_bias"
    a = {"w": torch.zeros(2), bias: torch.tensor([0.0, 1.0])}
    b = {"w": torch.ones(2), bias: torch.tensor([2.0, 3.0])}
    avg = average_states([a, b], [0.5, 0.5], buffers="average")
    new = average_states([a, b], [0.5, 0.5], buffers="latest")
    torch.testing.assert_close(avg["w"], new["w"])
    torch.testing.assert_close(avg[bias], torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(new[bias], torch.tensor([2.0, 3.0]))


def test_routing_health_counts_every_slot() -> None:
    model = build_model(TINY, 64, seed=0)
    routers(model)[1].e_score_correction_bias[:2] = 10.0  # layer 1 routes every token to experts 0 and 1
    x = torch.randint(0, 64, (3, 16))
    losses, layers = routing_health(model, [(x, x)] * 2)
    assert len(losses) == 2 and all(r.observe is None for r in routers(model))
    assert [lay["tokens"] for lay in layers] == [96, 96]
    assert layers[1]["load"] == [0.5, 0.5, 0.0, 0.0] and layers[1]["dead_experts"] == 2
    assert layers[1]["max_over_mean"] == pytest.approx(2.0)


def test_moe_options_need_a_moe_model() -> None:
    from pmakit.train.loop import TrainConfig

    with pytest.raises(PmakitError, match="need a MoE model"):
        TrainConfig.from_dict({"router_bias_rate": 1e-3, "every_tokens": 40960})
    with pytest.raises(PmakitError, match="top_k"):
        ModelConfig(experts=2, top_k=3)
    dense = TrainConfig.from_dict(
        {"every_tokens": 40960}
    ).to_dict()  # a dense run's config stamp has no MoE keys (resume compares it)
    assert "router_bias_rate" not in dense and "experts" not in dense["model"]


@pytest.fixture(scope="module")
def moe_smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("moe") / "run"
    proc = run_cli("experiment", "--preset", "moe-smoke", "-o", run, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stdout


def test_moe_smoke_routing_is_consistent(moe_smoke: tuple[Path, str]) -> None:
    run, _ = moe_smoke
    data = json.loads((run / "moe.json").read_text())
    models = {"latest", "annealed", "merged, bias average", "merged, bias latest"}
    assert {r["model"] for r in data["routing"]} == models == {r["model"] for r in data["losses"]}
    for r in data["routing"]:
        assert r["split"] in ("selection", "test") and r["batches"] == data["batches"][r["split"]] > 0
        assert sum(r["load"]) == pytest.approx(1.0, abs=1e-5) and len(r["load"]) == data["experts"]
        assert 0.0 <= r["entropy"] <= math.log(data["experts"]) + 1e-6
        assert r["max_over_mean"] >= 1.0 - 1e-6 and r["dropped_tokens"] == 0
    for r in data["losses"]:
        assert r["split"] in ("selection", "test") and len(r["batch_losses"]) == r["batches"]
    # the merge with its bias averaged is the grid's cell it names: the same selection loss as in results.jsonl
    rows = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()]
    m = data["merge"]
    cell = next(
        r
        for r in rows
        if r["model"] == "merged"
        and r["method"] == "sma"
        and r["split"] == "selection"
        and r["role"] == ""
        and (r["fork_tokens"], r["n"], r["v_tokens"]) == (data["fork_tokens"], m["n"], m["v_tokens"])
    )
    merged = next(
        r for r in data["losses"] if r["model"] == "merged, bias average" and r["split"] == "selection"
    )
    assert merged["val_loss"] == pytest.approx(cell["val_loss"], abs=1e-5)
    assert data["bias_rule"]["chosen_on_selection"] in ("average", "latest")
    assert data["compute"]["anneal_flops"] > data["compute"]["merge_flops"] > 0


def test_moe_smoke_report_has_the_section(moe_smoke: tuple[Path, str]) -> None:
    run, _ = moe_smoke
    md = (run / "report.md").read_text()
    assert "## Mixture of experts: routing health and the router-bias rule" in md
    assert "plots/moe_routing.png" in md and (run / "plots" / "moe_routing.png").stat().st_size > 1000
    assert "model (test split)" in md and "Compute: the anneal trains" in md


def test_moe_smoke_scores_its_models_downstream(moe_smoke: tuple[Path, str]) -> None:
    """lm-eval's HFLM stopped on this OLMoE (a 64-token context; a few candidate lines are longer): every headline
    model and the noise band's raw snapshots now have both tasks' scores, and the report shows the table."""
    from pmakit.runs import read_jsonl

    run, _ = moe_smoke
    rows = read_jsonl(run / "downstream.jsonl")
    assert {r["task"] for r in rows} == {"pmakit_next_line", "pmakit_bpb"}
    latest = [r for r in rows if r["model"] == "latest" and r["metric"] == "acc"]
    assert latest and all(len(r["items"]) > 100 for r in latest)
    assert any(r["model"] == "annealed" for r in rows) and any(r["role"] == "noise" for r in rows)
    assert "Downstream tasks (lm-evaluation-harness, test items)" in (run / "report.md").read_text()
