"""The review sampler's rates, its inclusion probabilities, and the fit weights by simulation."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from guarduq.errors import StoreInputError
from guarduq.store import ReviewSampler, Sample, fit_weights, inclusion_probability


def rate_of(sampler: ReviewSampler, n: int, risk: float | None, escalated: bool, reason: str) -> float:
    return sum(reason in sampler.draw(risk, escalated).reasons for _ in range(n)) / n


def within(observed: float, p: float, n: int, sigmas: float = 4.5) -> bool:
    """Binomial tolerance: |observed - p| within ``sigmas`` standard errors."""
    return abs(observed - p) <= sigmas * math.sqrt(p * (1 - p) / n) + 1e-12


def test_uniform_rate_within_binomial_tolerance() -> None:
    s = ReviewSampler(rate=0.2, seed=1)
    n = 20_000
    assert within(rate_of(s, n, 0.5, False, "uniform"), 0.2, n)
    assert within(rate_of(s, n, None, False, "uniform"), 0.2, n)  # no risk: still uniform


def test_band_rates_and_overlap() -> None:
    s = ReviewSampler(rate=0.0, bands=[(0.4, 0.6, 0.3), (0.5, 0.7, 0.5)], seed=2)
    n = 10_000
    assert within(rate_of(s, n, 0.45, False, "band"), 0.3, n)
    assert within(rate_of(s, n, 0.55, False, "band"), 0.5, n)  # in both bands: the larger rate
    assert within(rate_of(s, n, 0.7, False, "band"), 0.5, n)  # edges are inside
    assert rate_of(s, 2000, 0.8, False, "band") == 0.0
    assert rate_of(s, 2000, None, False, "band") == 0.0  # no calibrator: in no band
    assert rate_of(s, 2000, float("nan"), False, "band") == 0.0
    d = s.draw(0.55, False)
    assert d.extra_probability == 0.5 and d.inclusion_probability == 0.5


def test_escalations_are_always_sampled() -> None:
    s = ReviewSampler(rate=0.1, bands=[(0.0, 1.0, 0.5)], seed=3)
    draws = [s.draw(0.9, True) for _ in range(2000)]
    assert all(d.sampled and d.reasons[0] == "escalation" and "band" not in d.reasons for d in draws)
    assert all(d.extra_probability == 1.0 and d.inclusion_probability == 1.0 for d in draws)
    assert within(sum(d.uniform for d in draws) / 2000, 0.1, 2000)
    off = ReviewSampler(rate=0.0, escalations=False, seed=3)
    assert not any(off.draw(0.9, True).sampled for _ in range(500))


def test_reasons_and_inclusion_probability_formula() -> None:
    s = ReviewSampler(rate=0.3, bands=[(0.2, 0.4, 0.4)], seed=4)
    n = 20_000
    draws = [s.draw(0.3, False) for _ in range(n)]
    p = 1 - (1 - 0.3) * (1 - 0.4)
    assert draws[0].inclusion_probability == pytest.approx(p) == inclusion_probability(0.3, 0.4)
    assert within(sum(d.sampled for d in draws) / n, p, n)
    assert within(sum(d.reasons == ("uniform", "band") for d in draws) / n, 0.3 * 0.4, n)
    assert all(d.uniform == ("uniform" in d.reasons) for d in draws)
    nothing = ReviewSampler().draw(0.5, False)
    assert nothing == Sample((), False, 0.0, 0.0, 0.0) and not nothing.sampled


def test_seeded_sampler_is_reproducible_and_thread_safe() -> None:
    a, b = ReviewSampler(rate=0.5, seed=7), ReviewSampler(rate=0.5, seed=7)
    assert [a.draw(0.5, False) for _ in range(100)] == [b.draw(0.5, False) for _ in range(100)]
    s = ReviewSampler(rate=0.5, seed=8)
    counts: list[int] = []

    def work() -> None:
        counts.append(sum(s.draw(0.5, False).uniform for _ in range(5000)))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert within(sum(counts) / 20_000, 0.5, 20_000)


def test_from_settings_policy_and_duck_typed() -> None:
    from guarduq.policy.schema import ReviewSettings

    settings = ReviewSettings(rate=0.05, escalations=False, bands=[{"low": 0.4, "high": 0.6, "rate": 0.25}])
    s = ReviewSampler.from_settings(settings)
    assert (s.rate, s.bands, s.escalations) == (0.05, ((0.4, 0.6, 0.25),), False)
    duck = SimpleNamespace(rate=0.1, escalations=True, bands=[SimpleNamespace(low=0.1, high=0.2, rate=1.0)])
    assert ReviewSampler.from_settings(duck).bands == ((0.1, 0.2, 1.0),)
    assert ReviewSampler.from_settings(ReviewSettings()).rate == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rate": 1.5}, r"review rate must be a probability in \[0, 1\], got 1.5"),
        ({"rate": float("nan")}, "review rate must be a probability"),
        ({"bands": [(0.6, 0.4, 0.5)]}, "review band 0: low 0.6 is above high 0.4"),
        ({"bands": [(0.1, 0.2, 0.0)]}, "review band 0 rate must be above 0"),
        ({"bands": [(0.1, 0.2)]}, r"review band 0 must be \(low, high, rate\)"),
    ],
)
def test_bad_sampler_settings(kwargs: dict, match: str) -> None:
    with pytest.raises(StoreInputError, match=match):
        ReviewSampler(**kwargs)


# ---------------------------------------------------------------------------- fit weights


def test_fit_weights_values() -> None:
    uni = Sample(("uniform",), True, 0.1, 0.5, 1 - 0.9 * 0.5)
    band = Sample(("band",), False, 0.1, 0.5, 1 - 0.9 * 0.5)
    esc = Sample(("escalation",), False, 0.1, 1.0, 1.0)
    none = Sample((), False, 0.1, 0.0, 0.1)
    w = fit_weights([uni, uni, band, esc, none], [True, False, False, False, True], 0.5)
    # π_fit = r·f + (1 − r)·e
    assert w.tolist() == pytest.approx([1 / (0.05 + 0.45), 0.0, 1 / (0.05 + 0.45), 1 / (0.05 + 0.9), 0.0])


def test_fit_weights_errors() -> None:
    uni = Sample(("uniform",), True, 0.1, 0.0, 0.1)
    with pytest.raises(StoreInputError, match="2 samples but 1 split flags"):
        fit_weights([uni, uni], [True], 0.5)
    with pytest.raises(StoreInputError, match="fit probability 0.0"):
        fit_weights([uni], [True], 0.0)  # in fit although fit_fraction is 0
    with pytest.raises(StoreInputError, match="fit_fraction must be a probability"):
        fit_weights([uni], [True], 1.2)


def test_fit_weights_reweight_the_fit_split_to_the_population() -> None:
    """Simulation: a population with escalations (high risk) and a borderline band, whose known
    quantity y rises with risk; over many sampled populations the Horvitz–Thompson mean of y over
    the fit split matches the population mean, while the unweighted fit mean is far off.

    Tolerance: 4.5 standard errors of the mean of R independent estimates (plus 0.002 for the
    Hájek ratio's O(1/n) bias)."""
    rng = np.random.default_rng(0)
    n_pop, reps, f = 1500, 80, 0.5
    risk = rng.uniform(0, 1, n_pop)
    escalated = risk > 0.85
    y = risk**2  # the known quantity (think: wrong)
    target = float(y.mean())
    sampler = ReviewSampler(rate=0.05, bands=[(0.4, 0.6, 0.5)], seed=1)
    ht, hajek, naive = [], [], []
    for _ in range(reps):
        samples = [sampler.draw(float(r), bool(e)) for r, e in zip(risk, escalated, strict=True)]
        split = rng.random(n_pop) < f
        w = fit_weights(samples, split.tolist(), f)
        fit = w > 0
        ht.append(float((w * y).sum()) / n_pop)
        hajek.append(float((w * y).sum() / w.sum()))
        naive.append(float(y[fit].mean()))
    for est, slack in ((np.array(ht), 0.0), (np.array(hajek), 0.002)):
        se = est.std(ddof=1) / math.sqrt(reps)
        assert abs(est.mean() - target) <= 4.5 * se + slack, (est.mean(), target, se)
    assert abs(np.mean(naive) - target) > 0.15  # unweighted, the escalations dominate


def test_sample_json_round_trips_every_drawn_record_and_refuses_broken_ones() -> None:
    s = ReviewSampler(rate=0.3, bands=[(0.2, 0.4, 0.4)], escalations=True, seed=5)
    draws = [s.draw(r, esc) for r in (0.1, 0.3, None) for esc in (False, True) for _ in range(20)]
    assert {d.reasons for d in draws} >= {("escalation",), ("uniform",), ("band",)}
    assert all(Sample.from_json(d.to_json()) == d for d in draws)
    # the export line's field, read by the dataset loader: one spelling in both places
    assert set(draws[0].to_json()) == {"uniform", "rate", "extra_probability", "inclusion_probability", "reasons"}
    good = Sample(("uniform",), True, 0.1, 0.0, 0.1).to_json()
    for broken, says in [({**good, "uniform": "yes"}, "uniform"), ({**good, "rate": 1.5}, "rate"),
                         ({**good, "inclusion_probability": 0.0}, "above 0"),
                         ({k: v for k, v in good.items() if k != "rate"}, "lacks 'rate'"),
                         ({**good, "reasons": "uniform"}, "reasons"), ([1], "object")]:
        with pytest.raises(StoreInputError, match=says):
            Sample.from_json(broken)


def test_the_store_module_paths_still_name_the_ground_floor_sampler() -> None:
    import guarduq.sampling as ground
    import guarduq.store.records as records
    import guarduq.store.sampling as old

    assert old.Sample is records.Sample is ground.Sample is Sample
    assert old.ReviewSampler is ground.ReviewSampler and old.fit_weights is ground.fit_weights


def test_a_drift_rate_is_an_extra_draw_so_the_uniform_sample_stays_uniform() -> None:
    s = ReviewSampler(rate=0.1, bands=[(0.0, 0.2, 0.3)], seed=11)
    n = 20_000
    draws = [s.draw(0.5, False, drift_rate=1.0) for _ in range(n)]
    assert all(d.sampled and "drift" in d.reasons for d in draws)  # every reply while drifting
    assert all(d.extra_probability == 1.0 and d.inclusion_probability == 1.0 for d in draws)
    assert within(sum(d.uniform for d in draws) / n, 0.1, n)  # the uniform draw is untouched
    banded = [s.draw(0.1, False, drift_rate=0.2) for _ in range(n)]  # the band's 0.3 is larger
    assert within(sum("band" in d.reasons for d in banded) / n, 0.3, n)
    assert not any("drift" in d.reasons for d in banded)
    with pytest.raises(StoreInputError, match="drift review rate"):
        s.draw(0.5, False, drift_rate=2.0)
