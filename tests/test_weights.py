import math

import pytest
import torch

from pmakit.errors import PmakitError
from pmakit.weights import WEIGHTINGS, get_weights


def test_sma_wma_exact() -> None:
    assert get_weights("sma", 4) == [0.25] * 4
    assert get_weights("wma", 3) == pytest.approx([1 / 6, 2 / 6, 3 / 6])


def test_ema_exact_values() -> None:
    # N=3, alpha=0.5: M = M1; M = .5 M2 + .5 M; M = .5 M3 + .5 M  ->  [.25, .25, .5]
    assert get_weights("ema", 3, alpha=0.5) == pytest.approx([0.25, 0.25, 0.5])
    # alpha=0.2, N=3: [0.8^2, 0.2*0.8, 0.2]
    assert get_weights("ema", 3, alpha=0.2) == pytest.approx([0.64, 0.16, 0.2])


@pytest.mark.parametrize("alpha", [0.1, 0.2, 0.7])
@pytest.mark.parametrize("n", [1, 2, 5, 10])
def test_ema_matches_hand_unrolled_recursion(n: int, alpha: float) -> None:
    models = [torch.randn(7, dtype=torch.float64) for _ in range(n)]
    m = models[0].clone()
    for x in models[1:]:
        m = alpha * x + (1 - alpha) * m
    w = get_weights("ema", n, alpha=alpha)
    assert torch.allclose(torch.stack([wi * x for wi, x in zip(w, models)]).sum(0), m, atol=1e-12)


def test_ema_normalized_is_renormalised_closed_form() -> None:
    raw = [0.2 * 0.8 ** (3 - i) for i in range(1, 4)]
    assert get_weights("ema-normalized", 3, alpha=0.2) == pytest.approx([r / sum(raw) for r in raw])
    assert get_weights("ema-normalized", 3) != pytest.approx(get_weights("ema", 3))


@pytest.mark.parametrize("n", [1, 2, 3, 10, 16])
def test_wsm_linear_equals_sma(n: int) -> None:
    assert get_weights("wsm-linear", n) == pytest.approx(get_weights("sma", n))


def test_wsm_exact_values() -> None:
    # N=4, 1-sqrt: g = [1-sqrt(.25), 1-sqrt(.5), 1-sqrt(.75)] = [.5, .2929, .1340]
    g = [1 - math.sqrt(j / 4) for j in (1, 2, 3)]
    expected = [1 - g[0], g[0] - g[1], g[1] - g[2], g[2]]
    assert get_weights("wsm-1sqrt", 4) == pytest.approx(expected)
    # cosine, N=2: g_1 = (1+cos(pi/2))/2 = 0.5 -> [0.5, 0.5] (the linear shape's too: 1 - 1/2)
    assert get_weights("wsm-cosine", 2) == pytest.approx([0.5, 0.5])
    # cosine, N=6: g_j = (1+cos(j pi/6))/2, cos(pi/6) = sqrt(3)/2, cos(pi/3) = 1/2, cos(pi/2) = 0, so
    # c_1 = 1 - g_1 = (1 - sqrt(3)/2)/2, c_2 = g_1 - g_2 = (sqrt(3)/2 - 1/2)/2, c_3 = g_2 - g_3 = 1/4, and
    # symmetric (cos(pi - x) = -cos(x)): as heavy at the oldest as at the newest
    r = math.sqrt(3) / 2
    expected = [(1 - r) / 2, (r - 0.5) / 2, 0.25, 0.25, (r - 0.5) / 2, (1 - r) / 2]
    assert get_weights("wsm-cosine", 6) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("method", sorted(WEIGHTINGS))
@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_every_weighting_sums_to_one_and_is_non_negative(method: str, n: int) -> None:
    w = get_weights(method, n)
    assert len(w) == n
    assert math.fsum(w) == pytest.approx(1.0, abs=1e-12)
    assert min(w) >= -1e-12


def test_newest_heaviest_for_recency_weightings() -> None:
    # not wsm-cosine: its weights are symmetric (test_wsm_exact_values), newest = oldest up to rounding
    for method in ("wma", "ema-normalized"):
        w = get_weights(method, 6)
        assert w[-1] > w[0], method


def test_custom_weights(caplog: pytest.LogCaptureFixture) -> None:
    assert get_weights("custom", 2, custom=[0.25, 0.75]) == [0.25, 0.75]
    with caplog.at_level("WARNING"):
        assert get_weights("custom", 3, custom=[1, 1, 2]) == [0.25, 0.25, 0.5]
    assert "normalised" in caplog.text
    with pytest.raises(PmakitError, match="2 weights for 3"):
        get_weights("custom", 3, custom=[0.5, 0.5])
    with pytest.raises(PmakitError, match="positive sum"):
        get_weights("custom", 2, custom=[1, -1])


def test_unknown_method_lists_known() -> None:
    with pytest.raises(PmakitError, match="known: sma, wma, ema"):
        get_weights("lawa", 3)
    with pytest.raises(PmakitError, match="alpha"):
        get_weights("ema", 3, alpha=0)


@pytest.mark.parametrize("name", [w.name for w in WEIGHTINGS.values() if w.running is not None])
@pytest.mark.parametrize("alpha", [0.2, 0.7])
def test_running_sums_steps_keep_the_coefficients(name: str, alpha: float) -> None:
    """Applying a weighting's ``RunningSums.step`` in place, in its order (as the online averager does), to the
    coefficient vectors over snapshots 0..9 gives, after every update, ``coefficients`` of the window then held,
    and ``factor * sum`` is the merge weights: the form is the weighting's, while the window grows and slides."""
    running, n, total = WEIGHTINGS[name].running, 4, 10
    assert running is not None

    def unit(i: int) -> list[float]:
        return [1.0 if j == i else 0.0 for j in range(total)]

    def placed(window: list[int], c: list[float]) -> list[float]:
        v = [0.0] * total
        for i, x in zip(window, c):
            v[i] = x
        return v

    sums: dict[str, list[float]] = {}
    window: list[int] = []
    for new in range(total):
        m = len(window)
        if m == 0:
            sums = {k: placed([new], c) for k, c in running.coefficients(1, alpha).items()}
        else:
            terms_of = {"new": unit(new), "dropped": unit(window[0]), "second": unit(window[min(1, m - 1)])}
            if m == 1 and m == n:
                terms_of["second"] = unit(new)
            for key, terms in running.step(m, n, alpha).items():
                s = [x * terms.get(key, 1.0) for x in sums[key]]
                for term, c in terms.items():
                    if term != key:
                        src = sums[term] if term in sums else terms_of[term]
                        s = [a + c * b for a, b in zip(s, src)]
                sums[key] = s
        window = [*window, new][-n:]
        want = running.coefficients(len(window), alpha)
        for key, coefficients in want.items():
            assert sums[key] == pytest.approx(placed(window, coefficients), abs=1e-12), (key, window)
        key, factor = running.average(len(window), alpha)
        assert [factor * sums[key][i] for i in window] == pytest.approx(
            get_weights(name, len(window), alpha=alpha)
        )
