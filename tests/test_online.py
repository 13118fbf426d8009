from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from conftest import state
from pmakit.errors import PmakitError
from pmakit.merge import merge
from pmakit.online import OnlineAverager, accumulator_coefficients
from pmakit.saver import SnapshotSaver
from pmakit.snapshot import Snapshot, discover
from pmakit.weights import get_weights

FLOAT_KEYS = [
    "embed.weight",
    "layers.0.attn.weight",
    "layers.0.norm.weight",
    "layers.1.attn.weight",
    "head.weight",
]


def states(k: int, dtype: torch.dtype = torch.float32) -> list[dict[str, torch.Tensor]]:
    return [state(i, dtype) for i in range(1, k + 1)]


def feed(
    averager: OnlineAverager, run: Path, snaps: list[dict[str, torch.Tensor]], every: int = 100
) -> list[dict[str, torch.Tensor]]:
    """Save each state with a real saver and update the averager from on_save; the average after each update."""
    averages = []

    def on_save(snapshot: Snapshot, tensors: dict[str, torch.Tensor]) -> None:
        averager.update(tensors, tokens=snapshot.tokens, path=snapshot.path)
        averages.append(averager.average())

    saver = SnapshotSaver(run, every, on_save=[on_save], fsync=False)
    for i, s in enumerate(snaps, start=1):
        saver.save(s, tokens=i * every, step=i)
    saver.wait()
    return averages


def reference(window: list[dict[str, torch.Tensor]], weights: list[float], key: str) -> torch.Tensor:
    return sum(w * s[key].double() for w, s in zip(weights, window))  # type: ignore[return-value]


def unrolled_ema(window: list[dict[str, torch.Tensor]], alpha: float, key: str) -> torch.Tensor:
    m = window[0][key].double()
    for s in window[1:]:
        m = alpha * s[key].double() + (1 - alpha) * m
    return m


def close(got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> None:
    torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=2e-6 * scale)


@pytest.mark.parametrize("hold", [False, True])
@pytest.mark.parametrize("method", ["sma", "wma", "ema", "ema-normalized", "wsm-cosine"])
def test_average_equals_weighted_window_after_every_update(tmp_path: Path, method: str, hold: bool) -> None:
    n, alpha = 4, 0.3
    snaps = states(9)
    averager = OnlineAverager(n, method, alpha, hold_in_memory=hold)
    averages = feed(averager, tmp_path / "run", snaps)
    for t, avg in enumerate(averages, start=1):
        window = snaps[max(0, t - n) : t]
        weights = get_weights(method, len(window), alpha=alpha)
        for k in FLOAT_KEYS:
            close(avg[k], reference(window, weights, k))
            assert avg[k].dtype == torch.float32, k
            if method == "sma":  # against weights written here, not only pmakit's
                close(avg[k], reference(window, [1 / len(window)] * len(window), k))
            if method == "ema":  # against the recursion itself, not only its closed-form weights
                close(avg[k], unrolled_ema(window, alpha, k))
            if method == "wma":
                close(
                    avg[k],
                    reference(
                        window,
                        [i / (len(window) * (len(window) + 1) / 2) for i in range(1, len(window) + 1)],
                        k,
                    ),
                )
        assert torch.equal(avg["step_counter"], snaps[t - 1]["step_counter"])  # non-float: the newest
    assert averager.window == [(t * 100, tmp_path / "run" / f"step-{t:08d}") for t in range(6, 10)]
    assert averager.count == n and averager.updates == 9 and averager.label == f"merged:{method}:4"


@pytest.mark.parametrize("method", ["sma", "wma", "ema"])
def test_average_equals_pmakit_merge_over_the_same_snapshots(tmp_path: Path, method: str) -> None:
    averager = OnlineAverager(5, method, 0.2)
    feed(averager, tmp_path / "run", states(8, torch.bfloat16))
    snapshots = discover(tmp_path / "run")[-5:]
    assert [(s.tokens, s.path) for s in snapshots] == averager.window
    merge(snapshots, get_weights(method, 5, alpha=0.2), tmp_path / "merged", dtype="fp32", fsync=False)
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    avg = averager.average()
    assert merged.keys() == avg.keys()
    for k in merged:
        if merged[k].is_floating_point():
            close(avg[k], merged[k])
        else:
            assert torch.equal(avg[k], merged[k])


def test_running_sums_match_a_rebuild_from_the_window(tmp_path: Path) -> None:
    """The incremental identities give what recomputing the sums from the files gives."""
    for method in ["sma", "wma", "ema", "ema-normalized"]:
        averager = OnlineAverager(3, method, 0.25, resum_every=0)
        feed(averager, tmp_path / method, states(7))
        incremental = averager.average()
        averager.rebuild_from(discover(tmp_path / method))
        for k, v in averager.average().items():
            close(incremental[k], v)


def test_accumulator_coefficients_give_the_merge_weights() -> None:
    m, a = 5, 0.2
    c = accumulator_coefficients("wma", m, a)
    assert [x * 2 / (m * (m + 1)) for x in c["wsum"]] == pytest.approx(get_weights("wma", m))
    u = accumulator_coefficients("ema-normalized", m, a)["u"]
    assert [x / (1 - (1 - a) ** m) for x in u] == pytest.approx(get_weights("ema-normalized", m, alpha=a))


def test_long_run_stays_within_fp32_tolerance(tmp_path: Path) -> None:
    """3000 slides of add/subtract: the periodic re-sum keeps the drift at fp32 rounding, not a random walk."""
    g = torch.Generator().manual_seed(0)
    n, steps = 10, 3000
    xs = [{"w": 100.0 + torch.randn(256, generator=g)} for _ in range(steps)]
    drifting = OnlineAverager(n, "sma", hold_in_memory=True, resum_every=0)
    resummed = OnlineAverager(n, "sma", hold_in_memory=True, resum_every=64)
    for t, x in enumerate(xs, start=1):
        drifting.update(x, tokens=t)
        resummed.update(x, tokens=t)
    want = torch.stack([x["w"].double() for x in xs[-n:]]).mean(0)
    err_resummed = (resummed.average()["w"].double() - want).abs().max().item()
    err_drifting = (drifting.average()["w"].double() - want).abs().max().item()
    # Measured: 0.9e-6 relative with the re-sum every 64 updates, 6.9e-6 without (it grows as sqrt(updates)).
    assert err_resummed < 2e-6 * 100  # fp32 tolerance relative to |x| ~ 100 (torch's fp32 rtol is 1.3e-6)
    assert err_drifting > 3 * err_resummed  # the random walk is real without the re-sum


def test_long_run_from_disk_equals_merge(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    snaps = [{"w": 3.0 + torch.randn(64, generator=g), "b": torch.randn(3, generator=g)} for _ in range(200)]
    averager = OnlineAverager(8, "ema", 0.1, resum_every=50)
    feed(averager, tmp_path / "run", snaps, every=1)
    chosen = discover(tmp_path / "run")[-8:]
    merge(chosen, get_weights("ema", 8, alpha=0.1), tmp_path / "m", dtype="fp32", fsync=False)
    merged = load_file(tmp_path / "m" / "model.safetensors")
    for k, v in averager.average().items():
        close(v, merged[k], scale=4)


@pytest.mark.parametrize("include_tensors", [True, False])
@pytest.mark.parametrize("hold", [False, True])
def test_state_dict_round_trip_continues_the_same_window(
    tmp_path: Path, include_tensors: bool, hold: bool
) -> None:
    snaps = states(10)
    whole = OnlineAverager(4, "ema", 0.3, hold_in_memory=hold)
    feed(whole, tmp_path / "a", snaps)

    first = OnlineAverager(4, "ema", 0.3, hold_in_memory=hold)
    feed(first, tmp_path / "b", snaps[:6])
    path = tmp_path / "averager.pt"
    torch.save(first.state_dict(include_tensors=include_tensors), path)
    resumed = OnlineAverager(4, "ema", 0.3, hold_in_memory=hold)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    assert resumed.window == first.window and resumed.updates == 6
    saver = SnapshotSaver(
        tmp_path / "b",
        100,
        start_tokens=600,
        on_save=[lambda s, t: resumed.update(t, tokens=s.tokens, path=s.path)],
    )
    for i in range(7, 11):
        saver.maybe_save(snaps[i - 1], tokens=i * 100, step=i)
    saver.wait()
    assert [t for t, _ in resumed.window] == [t for t, _ in whole.window] == [700, 800, 900, 1000]
    for k, v in whole.average().items():
        if include_tensors:
            assert torch.equal(resumed.average()[k], v)  # bit for bit
        else:
            close(resumed.average()[k], v)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("count", torch.tensor(7))


def net_states(k: int) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(k):
        torch.manual_seed(i)
        out.append(Net().to(torch.bfloat16).state_dict())
    return out


def test_swapped_in_copies_the_average_and_restores_exactly(tmp_path: Path) -> None:
    averager = OnlineAverager(3, "sma")
    feed(averager, tmp_path / "run", net_states(4))
    torch.manual_seed(99)
    model = Net().to(torch.bfloat16)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    avg = averager.average()
    with averager.swapped_in(model) as m:
        assert m is model
        assert torch.equal(model.proj.weight, avg["proj.weight"].to(torch.bfloat16))
        assert torch.equal(model.head.weight, avg["embed.weight"].to(torch.bfloat16))  # the tie holds
        assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k])

    with pytest.raises(ZeroDivisionError), averager.swapped_in(model):
        assert not torch.equal(model.proj.bias, original["proj.bias"])
        _ = 1 / 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, original[k])


def test_swapped_in_refuses_a_model_with_other_tensors(tmp_path: Path) -> None:
    averager = OnlineAverager(2, "sma", hold_in_memory=True)
    averager.update({"other.weight": torch.ones(4, 4)}, tokens=1)
    model = Net()
    before = model.proj.weight.clone()
    with pytest.raises(PmakitError, match="no tensors named"), averager.swapped_in(model):
        pass
    assert torch.equal(model.proj.weight, before)


def test_memory_is_one_fp32_copy_for_sma_and_ema(tmp_path: Path) -> None:
    snaps = states(5, torch.bfloat16)
    fp32 = sum(v.numel() * 4 for k, v in snaps[0].items() if k in FLOAT_KEYS)
    nonfloat = snaps[0]["step_counter"].nbytes
    bf16 = fp32 // 2
    for method, copies in [("sma", 1), ("ema", 1), ("ema-normalized", 1), ("wsm-1sqrt", 1), ("wma", 2)]:
        averager = OnlineAverager(3, method)
        feed(averager, tmp_path / method, snaps)
        assert averager.nbytes == copies * fp32 + nonfloat, method
    held = OnlineAverager(3, "sma", hold_in_memory=True)
    feed(held, tmp_path / "held", snaps)
    assert held.nbytes == fp32 + 3 * bf16 + nonfloat


def test_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(PmakitError, match="unknown method"):
        OnlineAverager(3, "median")
    averager = OnlineAverager(2, "sma")
    with pytest.raises(PmakitError, match="path="):
        averager.update(state(1), tokens=1)
    with pytest.raises(PmakitError, match="no snapshot yet"):
        averager.average()
    feed(averager, tmp_path / "run", states(2))
    with pytest.raises(PmakitError, match="token order"):
        averager.update(state(3), tokens=200, path=tmp_path / "x")
    bad = dict(state(3))
    bad["extra.weight"] = torch.ones(2)
    with pytest.raises(PmakitError, match="does not match the window"):
        averager.update(bad, tokens=300, path=tmp_path / "x")
    # A snapshot of the window deleted (keep_last < N): the error says why, and the average is still the old one.
    before = averager.average()
    for p in (tmp_path / "run" / "step-00000001").iterdir():
        p.unlink()
    (tmp_path / "run" / "step-00000001").rmdir()
    with pytest.raises(PmakitError, match="keep_last"):
        averager.update(state(3), tokens=300, path=tmp_path / "x")
    assert averager.window[0][0] == 100
    for k, v in averager.average().items():
        assert torch.equal(v, before[k])
