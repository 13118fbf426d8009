"""One tensor policy: the online average and the offline merge of the same window treat router biases alike, under
both ``buffers`` rules, and the training callback passes the rule through."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import load_dir
from pmakit.layouts.kinds import TensorPolicy
from pmakit.merge import average_states, merge
from pmakit.online import OnlineAverager
from pmakit.saver import SnapshotSaver
from pmakit.snapshot import Snapshot, discover
from pmakit.train.averaging import Averaging

E, H = 4, 8
BIAS = "moe.router.expert_bias"  # Megatron's name
COUNT = "moe.tokens_per_expert"  # torchtitan's (float32 in the trainer)


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, H))
        self.register_buffer("expert_bias", torch.zeros(E))


class Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.register_buffer("tokens_per_expert", torch.zeros(E))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = Moe()


def moe_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "moe.router.weight": torch.randn(E, H, generator=g),
        BIAS: torch.randn(E, generator=g) * 1e-3 + 0.1,
        COUNT: torch.randint(0, 1000, (E,), generator=g).float(),
    }


def online(tmp_path: Path, states: list[dict[str, torch.Tensor]], buffers: str) -> OnlineAverager:
    """An SMA of the last 3 fed by a real saver: 4 snapshots, so the window slides once."""
    averager = OnlineAverager(3, "sma", buffers=buffers)

    def on_save(snapshot: Snapshot, tensors: dict[str, torch.Tensor]) -> None:
        averager.update(tensors, tokens=snapshot.tokens, path=snapshot.path)

    saver = SnapshotSaver(tmp_path / "run", 100, on_save=[on_save], fsync=False)
    for i, s in enumerate(states, start=1):
        saver.save(s, tokens=i * 100, step=i)
    saver.wait()
    return averager


@pytest.mark.parametrize("buffers", ["average", "latest"])
def test_online_and_offline_merges_treat_router_biases_alike(tmp_path: Path, buffers: str) -> None:
    states = [moe_state(s) for s in (1, 2, 3, 4)]
    avg = online(tmp_path, states, buffers).average()
    merge(discover(tmp_path / "run")[-3:], [1 / 3] * 3, tmp_path / "out", dtype="fp32", buffers=buffers)
    offline = load_dir(tmp_path / "out")
    in_memory = average_states(states[-3:], [1 / 3] * 3, buffers=buffers)
    for got in (avg, in_memory):
        assert got.keys() == offline.keys()
        for name, t in offline.items():
            assert got[name].dtype == t.dtype, name
            torch.testing.assert_close(got[name], t, rtol=0, atol=1e-7)
    want = states[-1][BIAS] if buffers == "latest" else sum(s[BIAS].double() for s in states[-3:]) / 3
    torch.testing.assert_close(avg[BIAS].double(), want.double(), rtol=0, atol=1e-7)
    assert torch.equal(avg[COUNT], states[-1][COUNT])


@pytest.mark.parametrize("buffers", ["average", "latest"])
def test_swapped_in_model_holds_the_policys_bias_and_gets_its_own_back(tmp_path: Path, buffers: str) -> None:
    states = [moe_state(s) for s in (1, 2, 3, 4)]
    averager = online(tmp_path, states, buffers)
    model = Model()
    live = torch.full((E,), 7.0)
    model.moe.router.expert_bias.copy_(live)
    with averager.swapped_in(model):
        torch.testing.assert_close(model.moe.router.expert_bias, averager.average()[BIAS], rtol=0, atol=0)
        assert torch.equal(model.moe.tokens_per_expert, torch.zeros(E))  # counters stay the model's
    assert torch.equal(model.moe.router.expert_bias, live)


def test_the_callback_and_a_resumed_averager_keep_the_rule(tmp_path: Path) -> None:
    core = Averaging(tmp_path / "run", 100, last=3, buffers="latest")
    assert core.averager.policy == TensorPolicy("latest")
    averager = online(tmp_path, [moe_state(s) for s in (1, 2, 3, 4)], "latest")
    state = averager.state_dict()
    assert state["buffers"] == "latest"
    resumed = OnlineAverager(3, "sma", buffers="average")
    resumed.load_state_dict(state)  # another rule: the sums are rebuilt from the files under its own
    mean = torch.stack([moe_state(s)[BIAS].double() for s in (2, 3, 4)]).mean(0)  # its own rule: the average
    assert not torch.allclose(mean, moe_state(4)[BIAS].double())  # (not the newest, the state's rule)
    torch.testing.assert_close(resumed.average()[BIAS].double(), mean, rtol=0, atol=1e-7)
    with pytest.raises(Exception, match="unknown buffers rule"):
        OnlineAverager(3, "sma", buffers="newest")
