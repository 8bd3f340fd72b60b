"""Missingness mechanisms: rates, the MAR stop rules on hand-built pieces, names, determinism, errors."""

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from partialvfl.data.mechanisms import (
    MAR1,
    MAR2,
    MCAR,
    MNAR,
    AbsentParties,
    BetaMCAR,
    Complete,
    MechanismError,
    block_means,
    block_variances,
    parse_mechanism,
    random_visit_order,
)


def gaussian_blocks(n, k, d=6, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)) for _ in range(k)]


def within(rate, p, n, z=4.0):
    """``rate`` is a binomial proportion of ``n`` trials within ``z`` standard errors of ``p``."""
    se = np.sqrt(max(p * (1 - p), 1e-12) / n)
    return abs(rate - p) <= z * se + 1e-12


def blocks_with_variances(v):
    """Blocks whose per-sample variance is exactly ``v[i, k]`` (features +-sqrt(v), mean 0)."""
    v = np.asarray(v, dtype=float)
    signs = np.array([1.0, -1.0, 1.0, -1.0])
    return [np.sqrt(v[:, [k]]) * signs[None, :] for k in range(v.shape[1])]


# ---------------------------------------------------------------------- MCAR / MNAR / none
@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_mcar_rate(p):
    n, k = 20_000, 5
    obs = MCAR(p).sample(gaussian_blocks(n, k, d=1), np.random.default_rng(1))
    assert obs.shape == (n, k) and obs.dtype == bool
    for j in range(k):
        assert within(1 - obs[:, j].mean(), p, n)


def test_complete_observes_everything():
    assert Complete().sample(gaussian_blocks(10, 3), np.random.default_rng(0)).all()


@pytest.mark.parametrize("p", [0.7, 0.9, 0.3])
def test_mnar_drop_rate_depends_on_the_sign_of_the_block_mean(p):
    n, k = 20_000, 3
    blocks = gaussian_blocks(n, k, d=5, seed=3)
    obs = MNAR(p).sample(blocks, np.random.default_rng(4))
    means = block_means(blocks)
    for j in range(k):
        neg = means[:, j] < 0
        assert within(1 - obs[neg, j].mean(), p, neg.sum())
        assert within(1 - obs[~neg, j].mean(), 1 - p, (~neg).sum())


def test_mnar_zero_mean_counts_as_non_negative():
    blocks = [np.zeros((4000, 2))]
    obs = MNAR(0.9).sample(blocks, np.random.default_rng(0))
    assert within(1 - obs.mean(), 0.1, 4000)  # xbar = 0 is not < 0: dropped with 1 - p


# ---------------------------------------------------------------------- MAR
def test_block_statistics_are_per_sample_within_the_block():
    v = np.array([[0.25, 4.0], [1.0, 0.0]])
    np.testing.assert_allclose(block_variances(blocks_with_variances(v)), v)
    np.testing.assert_allclose(block_means(blocks_with_variances(v)), 0.0, atol=1e-12)
    np.testing.assert_allclose(block_variances([np.array([[1.0, 2.0, 3.0]])]), [[2.0 / 3.0]])


IDENTITY4 = np.arange(4)


@pytest.mark.parametrize(
    "v, order, observed",
    [
        ([2.0, 0, 0, 0], IDENTITY4, [1, 0, 0, 0]),  # first piece above T = 1.1: stop at once
        ([1.1, 0, 0, 0], IDENTITY4, [1, 1, 1, 1]),  # v > T is strict; nothing later stops the walk
        ([1.0, 0.96, 5, 5], IDENTITY4, [1, 1, 0, 0]),  # 1.0 <= 1.1, then 0.96 > 0.95: stop at step 2
        ([1.0, 0.9, 0.7, 0.0], IDENTITY4, [1, 1, 1, 1]),  # 1.1, 0.95, 0.8, 0.65 never exceeded
        ([0, 0, 0, 0.81], IDENTITY4, [1, 1, 1, 1]),
        ([0, 0.0, 0.0, 1.0], [2, 0, 3, 1], [1, 0, 1, 1]),  # visits 2, 0, then 3 (1.0 > 0.8) and stops
        ([9.0, 0, 0, 0], [3, 2, 1, 0], [1, 1, 1, 1]),  # the high piece is visited last
    ],
)
def test_mar1_stop_rule_on_hand_built_pieces(v, order, observed):
    v = np.array([v])
    order = np.array([order])
    np.testing.assert_array_equal(MAR1().observe_in_order(v, order), np.array([observed], bool))


@pytest.mark.parametrize(
    "mech, v, order, observed",
    [
        (MAR2(), [1.3, 0, 0, 0], IDENTITY4, [1, 0, 0, 0]),  # excess 0.8 > budget 0.7
        (MAR2(budget=0.75), [1.25, 9, 9, 9], IDENTITY4, [1, 0, 0, 0]),  # budget exactly 0: B <= 0 stops
        (MAR2(budget=0.75), [1.0, 0, 0, 0], IDENTITY4, [1, 1, 1, 1]),  # 0.25 left, nothing else above T
        # accumulate: 0.9-0.5=0.4, 0.6-0.35=0.25 (B=0.05), 0.1 <= 0.2, 1.0-0.05 exhausts -> stop at step 4
        (MAR2(), [0.9, 0.6, 0.1, 1.0, 3.0], np.arange(5), [1, 1, 1, 1, 0]),
        (MAR2(), [3.0, 1.0, 0.1, 0.6, 0.9], np.arange(5)[::-1], [0, 1, 1, 1, 1]),
        (MAR2(budget=0.5), [0.9, 0.6, 0.1, 1.0, 3.0], np.arange(5), [1, 1, 0, 0, 0]),  # ModelNet10 budget
    ],
)
def test_mar2_stop_rule_on_hand_built_pieces(mech, v, order, observed):
    got = mech.observe_in_order(np.array([v]), np.array([order]))
    np.testing.assert_array_equal(got, np.array([observed], bool))


def test_mar_thresholds_decrease_by_the_decrement():
    np.testing.assert_allclose(MAR1().thresholds(4), [1.1, 0.95, 0.8, 0.65])
    np.testing.assert_allclose(MAR2().thresholds(3), [0.5, 0.35, 0.2])


def test_mar1_visiting_order_is_uniform_per_sample():
    # one piece always very informative, the others flat: the walk stops at the informative piece, so the number of
    # observed pieces is its (uniform) position in the visiting order and each flat piece is observed half the time
    n, k = 20_000, 4
    v = np.zeros((n, k))
    v[:, 2] = 10.0
    obs = MAR1().sample(blocks_with_variances(v), np.random.default_rng(5))
    assert obs[:, 2].all()
    counts = np.bincount(obs.sum(axis=1), minlength=k + 1)
    assert counts[0] == 0
    for c in range(1, k + 1):
        assert within(counts[c] / n, 1 / k, n)
    for j in (0, 1, 3):
        assert within(obs[:, j].mean(), 0.5, n)


def test_mar_observes_at_least_one_block_and_uses_the_sample_variances():
    blocks = gaussian_blocks(5000, 8, d=10, seed=6)
    for mech in (MAR1(), MAR2()):
        obs = mech.sample(blocks, np.random.default_rng(7))
        assert obs.any(axis=1).all()
    # the same rule, replayed with the same visiting order, gives the same mask
    rng_a, rng_b = np.random.default_rng(8), np.random.default_rng(8)
    obs = MAR2().sample(blocks, rng_a)
    order = random_visit_order(5000, 8, rng_b)
    np.testing.assert_array_equal(obs, MAR2().observe_in_order(block_variances(blocks), order))


def test_random_visit_order_rows_are_permutations():
    order = random_visit_order(1000, 6, np.random.default_rng(0))
    np.testing.assert_array_equal(np.sort(order, axis=1), np.broadcast_to(np.arange(6), (1000, 6)))
    first = np.bincount(order[:, 0], minlength=6) / 1000
    assert all(within(f, 1 / 6, 1000) for f in first)


def test_mar_is_fast_on_fashionmnist_size():
    rng = np.random.default_rng(0)
    blocks = [rng.random((60_000, 24), dtype=np.float32) * (k + 1) for k in range(8)]
    start = time.perf_counter()
    MAR1().sample(blocks, rng)
    MAR2().sample(blocks, rng)
    assert time.perf_counter() - start < 4.0  # ~0.1 s measured on the shared 2-core machine


def test_observe_in_order_rejects_non_permutations():
    with pytest.raises(MechanismError, match="permutation"):
        MAR1().observe_in_order(np.zeros((1, 3)), np.array([[0, 0, 1]]))
    with pytest.raises(MechanismError, match="samples, parties"):
        MAR1().observe_in_order(np.zeros((2, 3)), np.zeros((2, 2), int))


# ---------------------------------------------------------------------- Beta, absent
def test_beta_per_block_rates_follow_beta_2_2():
    n, k, reps = 4000, 4, 300
    blocks = gaussian_blocks(n, k, d=1)
    rng = np.random.default_rng(10)
    rates = np.array([1 - BetaMCAR().sample(blocks, rng).mean(axis=0) for _ in range(reps)]).ravel()
    # per-block rate = p_k + binomial noise (sd <= 0.008): its spread is that of Beta(2, 2): mean 0.5, var 0.05
    assert abs(rates.mean() - 0.5) < 4 * np.sqrt(0.05 / rates.size)
    assert 0.04 < rates.var() < 0.06
    assert stats.kstest(rates, stats.beta(2, 2).cdf).pvalue > 1e-3
    # one application: each block's rate is shared by its rows, and rates differ between blocks
    obs = BetaMCAR().sample(gaussian_blocks(20_000, 6, d=1), np.random.default_rng(11))
    assert np.ptp(obs.mean(axis=0)) > 0.05


def test_absent_parties():
    obs = AbsentParties((2, 0)).sample(gaussian_blocks(7, 4), np.random.default_rng(0))
    np.testing.assert_array_equal(obs, np.tile([False, True, False, True], (7, 1)))
    with pytest.raises(MechanismError, match="absent party 5 does not exist: there are 4 parties"):
        AbsentParties((5,)).sample(gaussian_blocks(3, 4), np.random.default_rng(0))


# ---------------------------------------------------------------------- determinism
ALL = ["none", "mcar5", "mnar9", "mar1", "mar2", "beta", "absent:1"]


@pytest.mark.parametrize("name", ALL)
def test_same_seed_same_mask(name):
    blocks = gaussian_blocks(500, 4, seed=12)
    mech = parse_mechanism(name)
    a = mech.sample(blocks, np.random.default_rng(3))
    b = mech.sample(blocks, np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    if name not in ("none", "absent:1"):
        assert not np.array_equal(a, mech.sample(blocks, np.random.default_rng(4)))


# ---------------------------------------------------------------------- names
@pytest.mark.parametrize(
    "text, expected, canonical",
    [
        ("none", Complete(), "none"),
        ("mcar0", MCAR(0.0), "mcar0"),
        ("MCAR2", MCAR(0.2), "mcar2"),
        ("mcar:0.5", MCAR(0.5), "mcar5"),
        ("mcar:0.35", MCAR(0.35), "mcar:0.35"),
        ("mnar7", MNAR(0.7), "mnar7"),
        ("mnar:0.9", MNAR(0.9), "mnar9"),
        ("mar1", MAR1(1.1, 0.15), "mar1"),
        ("mar1:threshold=1.1,decrement=0.15", MAR1(), "mar1"),
        ("mar1:threshold=2", MAR1(threshold=2.0), "mar1:threshold=2.0"),
        ("mar2", MAR2(0.5, 0.7, 0.15), "mar2"),
        ("mar2:budget=0.5", MAR2(budget=0.5), "mar2:budget=0.5"),
        (" mar2 : budget = 0.5 ", MAR2(budget=0.5), "mar2:budget=0.5"),
        ("beta", BetaMCAR(2.0, 2.0), "beta"),
        ("beta:a=1,b=3", BetaMCAR(1.0, 3.0), "beta:a=1.0,b=3.0"),
        ("absent:3", AbsentParties((3,)), "absent:3"),
        ("absent:3,0", AbsentParties((0, 3)), "absent:0,3"),
    ],
)
def test_parse_mechanism(text, expected, canonical):
    m = parse_mechanism(text)
    assert m == expected
    assert m.name == canonical
    assert parse_mechanism(m) is m


finite = st.floats(-5, 5, allow_nan=False)
mechanisms = st.one_of(
    st.just(Complete()),
    st.floats(0, 1).map(MCAR),
    st.floats(0, 1).map(MNAR),
    st.builds(MAR1, finite, finite),
    st.builds(MAR2, finite, finite, finite),
    st.builds(BetaMCAR, st.floats(1e-3, 50), st.floats(1e-3, 50)),
    st.lists(st.integers(0, 20), min_size=1, max_size=4).map(lambda x: AbsentParties(tuple(x))),
)


@settings(max_examples=200, deadline=None)
@given(mechanisms)
def test_name_round_trip(mech):
    assert parse_mechanism(mech.name) == mech
    assert parse_mechanism(mech.name).name == mech.name


@pytest.mark.parametrize(
    "text, why",
    [
        ("mar3", "unknown missingness mechanism 'mar3'"),
        ("mcar", "unknown missingness mechanism 'mcar'"),
        ("mcar:1.5", "probability in \\[0, 1\\]"),
        ("mnar:x", "'x' is not a number"),
        ("mar1:budget=0.5", "mar1 takes threshold=, decrement="),
        ("mar2:budget", "mar2 takes"),
        ("mar2:budget=1,budget=2", "given twice"),
        ("beta:a=-1", "must be positive"),
        ("absent:x", "comma list of party indices"),
        ("absent:", "comma list"),
    ],
)
def test_bad_names_list_the_valid_forms(text, why):
    with pytest.raises(MechanismError, match=why) as err:
        parse_mechanism(text)
    assert "valid forms" in str(err.value) and "mar2:threshold=T,budget=B,decrement=D" in str(err.value)


def test_bad_blocks():
    with pytest.raises(MechanismError, match="party 1's block has NaN"):
        MCAR(0.5).sample([np.zeros((2, 2)), np.full((2, 2), np.nan)], np.random.default_rng(0))
    with pytest.raises(MechanismError, match="every block needs the same 2 rows"):
        MNAR(0.5).sample([np.zeros((2, 2)), np.zeros((3, 2))], np.random.default_rng(0))
    with pytest.raises(MechanismError, match="at least one party block"):
        MAR1().sample([], np.random.default_rng(0))
