"""WSD schedule at exact values and edges."""

import math

import pytest

from pmakit.errors import PmakitError
from pmakit.schedule import WSD, wsd_multiplier


def m(t: float, shape: str = "linear", floor: float = 0.0) -> float:
    return wsd_multiplier(t, warmup=10, decay_start=100, decay_end=200, shape=shape, floor=floor)


def test_warmup_stable_decay_linear_exact() -> None:
    assert m(0) == 0.0
    assert m(5) == 0.5
    assert m(10) == 1.0
    assert m(99.999) == 1.0
    assert m(100) == 1.0  # the decay starts at 1
    assert m(150) == 0.5
    assert m(175) == 0.25
    assert m(200) == 0.0
    assert m(10**9) == 0.0


def test_decay_shapes_exact() -> None:
    assert m(150, "cosine") == pytest.approx(0.5)
    assert m(125, "cosine") == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert m(125, "1sqrt") == pytest.approx(0.5)  # 1 - sqrt(1/4)
    assert m(136, "1sqrt") == pytest.approx(0.4)  # 1 - sqrt(0.36)


def test_floor() -> None:
    assert m(150, floor=0.1) == pytest.approx(0.55)
    assert m(300, floor=0.1) == pytest.approx(0.1)


def test_decay_inside_warmup_multiplies() -> None:
    # an anneal that starts during warmup: warmup 5/10 times decay 0.5
    assert wsd_multiplier(5, warmup=10, decay_start=0, decay_end=10) == pytest.approx(0.25)


def test_wsd_object_and_phases() -> None:
    s = WSD(peak_lr=3e-3, warmup=10, decay_start=100, decay_end=200)
    assert s(50) == 3e-3
    assert s(150) == pytest.approx(1.5e-3)
    assert [s.phase(t) for t in (5, 50, 150, 250)] == ["warmup", "stable", "decay", "done"]
    assert WSD(peak_lr=1.0)(10**12) == 1.0  # no decay by default


@pytest.mark.parametrize(
    "kwargs",
    [
        {"peak_lr": 0.0},
        {"peak_lr": 1.0, "decay_start": 10, "decay_end": 5},
        {"peak_lr": 1.0, "shape": "step"},
        {"peak_lr": 1.0, "floor": 2.0},
    ],
)
def test_bad_schedules_are_user_errors(kwargs: dict[str, float]) -> None:
    with pytest.raises(PmakitError):
        WSD(**kwargs)  # type: ignore[arg-type]
