"""The paper's protocol as one function: counts, aligned reserve, stage seeds, standardisation, validation."""

import numpy as np
import pytest
from sklearn.datasets import load_digits

from partialvfl.data.dataset import DataValidationError, Task
from partialvfl.data.mechanisms import MechanismError
from partialvfl.data.protocol import ProtocolConfig, describe, make_protocol, stage_rng, with_test_mechanism
from partialvfl.data.sources.base import RawSource
from partialvfl.data.splitters import SplitterError


@pytest.fixture(scope="module")
def digits():
    d = load_digits()
    return RawSource("digits", d.data.astype(np.float32), d.target.astype(np.int64), Task.classification(range(10)))


@pytest.fixture(scope="module")
def images():
    """A small image source with an official test split."""
    rng = np.random.default_rng(0)
    return RawSource(
        "tiny-images",
        rng.random((300, 28, 28), dtype=np.float32),
        rng.integers(0, 3, 300),
        Task.classification(["a", "b", "c"]),
        X_test=rng.random((80, 28, 28), dtype=np.float32),
        y_test=rng.integers(0, 3, 80),
        kind="image",
    )


def cfg(**kw):
    base = dict(dataset="digits", parties=4, n_labels=500, n_aligned=100, train_missing="mcar:0.5",
                test_missing="mnar:0.9", seed=0)
    base.update(kw)
    return ProtocolConfig(**base)


def aligned_mask(train):
    return np.isin(train.ids, train.info["aligned_ids"])


def test_counts_aligned_reserve_and_observed_fractions(digits):
    train, test = make_protocol(cfg(), digits)
    n = len(digits.X_train)
    assert train.n_samples + test.n_samples == n
    assert test.n_samples == pytest.approx(0.2 * n, abs=10)
    assert train.n_labeled == 500 and test.n_labeled == test.n_samples
    aligned = aligned_mask(train)
    assert aligned.sum() == 100
    assert train.labeled[aligned].all()  # the reserve is taken from the labelled samples
    assert train.observed[aligned].all()
    rest = ~aligned
    for k in range(4):  # MCAR 0.5 on every other training sample
        assert abs(train.observed[rest, k].mean() - 0.5) <= 4 * np.sqrt(0.25 / rest.sum())
    assert train.active_party == 3 and test.active_party == 3
    assert train.feature_dims == (16, 16, 16, 16)
    s = describe(train, test)
    assert s["train"]["n_labeled"] == 500 and s["test"]["n_samples"] == test.n_samples
    assert train.info["protocol"]["train_missing"] == "mcar5" and test.info["mechanism"] == "mnar9"
    assert train.info["splitter"] == "contiguous"


def test_holdout_is_stratified_and_ids_are_source_rows(digits):
    train, test = make_protocol(cfg(), digits)
    assert len(np.intersect1d(train.ids, test.ids)) == 0
    np.testing.assert_array_equal(test.y, digits.y_train[test.ids])
    for c in range(10):
        share = (test.y == c).sum() / (digits.y_train == c).sum()
        assert abs(share - 0.2) < 0.01


def test_test_mask_does_not_depend_on_the_training_mechanism_or_labels(digits):
    _, test_a = make_protocol(cfg(train_missing="mcar2"), digits)
    train_b, test_b = make_protocol(cfg(train_missing="mar1", n_labels=300, n_aligned=50), digits)
    np.testing.assert_array_equal(test_a.observed, test_b.observed)
    for a, b in zip(test_a.blocks, test_b.blocks):
        np.testing.assert_array_equal(a, b)  # NaN in the same places
    _, test_c = make_protocol(cfg(test_missing="mar2"), digits)
    assert not np.array_equal(test_a.observed, test_c.observed)


@pytest.mark.parametrize("mechanism", ["mcar0", "mar1", "mnar9"])
def test_with_test_mechanism_gives_the_protocols_test_set(digits, mechanism):
    """The grid and the L benchmark score every test mechanism on sets cut by with_test_mechanism: the same rows, values
    and mask as a protocol built with that test mechanism (and the given training mechanism)."""
    _, expected = make_protocol(cfg(train_missing="mar2", test_missing=mechanism), digits)
    got = with_test_mechanism(cfg(train_missing="mar2", test_missing="mcar2"), mechanism, digits)
    np.testing.assert_array_equal(got.ids, expected.ids)
    np.testing.assert_array_equal(got.observed, expected.observed)
    np.testing.assert_array_equal(got.y, expected.y)
    for a, b in zip(got.blocks, expected.blocks):
        np.testing.assert_array_equal(a, b)
    assert got.info["mechanism"] == expected.info["mechanism"]


def test_same_seed_same_data_other_seed_other_data(digits):
    a_tr, a_te = make_protocol(cfg(), digits)
    b_tr, b_te = make_protocol(cfg(), digits)
    np.testing.assert_array_equal(a_tr.observed, b_tr.observed)
    np.testing.assert_array_equal(a_tr.labeled, b_tr.labeled)
    np.testing.assert_array_equal(a_te.ids, b_te.ids)
    c_tr, _ = make_protocol(cfg(seed=1), digits)
    assert not np.array_equal(a_tr.ids, c_tr.ids)


def test_standardised_on_train_before_the_mechanism(digits):
    train, test = make_protocol(cfg(train_missing="none", test_missing="none"), digits)
    for b in train.blocks:
        sd = b.std(axis=0)
        varying = sd > 0
        np.testing.assert_allclose(b.mean(axis=0), 0, atol=1e-4)
        np.testing.assert_allclose(sd[varying], 1, atol=1e-4)
    assert train.observed.all() and test.observed.all()
    # the test set used the training scaling, not its own
    raw = digits.X_train[test.ids][:, 16:32]
    tr_raw = digits.X_train[train.ids][:, 16:32]
    scale = tr_raw.std(axis=0)
    scale[scale < 1e-8] = 1
    np.testing.assert_allclose(test.blocks[1], (raw - tr_raw.mean(axis=0)) / scale, rtol=1e-4, atol=1e-4)


def test_mechanism_applies_to_all_but_the_reserve(digits):
    train, _ = make_protocol(cfg(train_missing="absent:0"), digits)
    aligned = aligned_mask(train)
    np.testing.assert_array_equal(train.observed[:, 0], aligned)
    assert train.observed[:, 1:].all()


def test_mar_samples_see_standardised_blocks(digits):
    train, test = make_protocol(cfg(train_missing="mar1", test_missing="mar2"), digits)
    assert train.observed.any(axis=1).all() and test.observed.any(axis=1).all()
    assert (~test.observed).any()


def test_image_source_official_split_grid_and_caps(images):
    config = ProtocolConfig("tiny-images", parties=8, n_labels=40, n_aligned=10, train_missing="mcar2",
                            test_missing="mcar0", seed=3, max_train=200, max_test=50, active_party=0)
    train, test = make_protocol(config, images)
    assert train.n_samples == 200 and test.n_samples == 50
    assert train.feature_shapes == ((14, 7),) * 8
    assert train.info["splitter"] == "grid" and train.info["test_split"] == "official"
    assert test.observed.all() and train.active_party == 0
    # test IDs are rows of the official test set; pixels of party 5 (grid row 1, column 1)
    raw = images.X_test[test.ids][:, 14:28, 7:14].reshape(50, -1)
    tr_raw = images.X_train[train.ids][:, 14:28, 7:14].reshape(200, -1)
    expected = (raw - tr_raw.mean(axis=0)) / tr_raw.std(axis=0)
    np.testing.assert_allclose(test.blocks[5], expected, rtol=1e-4, atol=1e-4)
    train2, _ = make_protocol(ProtocolConfig("tiny-images", parties=8, n_labels=40, n_aligned=10,
                                             splitter="grid:4x2", seed=3), images)
    assert train2.feature_shapes == ((7, 14),) * 8


@pytest.mark.parametrize(
    "kw, error, message",
    [
        (dict(n_aligned=600), DataValidationError, "n_aligned \\(600\\) cannot exceed n_labels \\(500\\)"),
        (dict(parties=0), DataValidationError, "parties must be a positive integer"),
        (dict(n_labels=-1), DataValidationError, "n_labels must be a non-negative integer"),
        (dict(test_fraction=1.0), DataValidationError, "test_fraction must lie in"),
        (dict(active_party=4), DataValidationError, "active_party 4 is out of range for 4 parties"),
        (dict(train_missing="mcar:7"), MechanismError, "probability"),
        (dict(test_missing="sometimes"), MechanismError, "valid forms"),
        (dict(splitter="diagonal"), SplitterError, "unknown splitter"),
        (dict(max_train=0), DataValidationError, "max_train must be a positive integer"),
    ],
)
def test_config_validation(kw, error, message):
    with pytest.raises(error, match=message):
        cfg(**kw)


def test_data_dependent_validation(digits, images):
    with pytest.raises(DataValidationError, match="n_labels \\(2000\\) exceeds the 1438 training samples"):
        make_protocol(cfg(n_labels=2000, n_aligned=0), digits)
    with pytest.raises(DataValidationError, match="n_labels \\(500\\) exceeds the 100 training samples"):
        make_protocol(cfg(max_train=100), digits)
    with pytest.raises(SplitterError, match="cannot give 65 parties"):
        make_protocol(cfg(parties=65), digits)
    with pytest.raises(SplitterError, match="no grid of 5 equal pieces"):
        make_protocol(ProtocolConfig("tiny-images", parties=5, n_labels=10, n_aligned=0), images)


def test_stage_generators_are_distinct_and_stable():
    a = stage_rng(0, "labels").random(3)
    np.testing.assert_array_equal(a, stage_rng(0, "labels").random(3))
    assert not np.array_equal(a, stage_rng(0, "aligned").random(3))
    assert not np.array_equal(a, stage_rng(1, "labels").random(3))


def test_loads_the_source_by_name_when_none_is_given(digits):
    sources = pytest.importorskip("partialvfl.data.sources")
    if not hasattr(sources, "load_source"):
        pytest.skip("partialvfl.data.sources.load_source is not there yet")
    train, test = make_protocol(cfg())
    ref_train, ref_test = make_protocol(cfg(), digits)
    np.testing.assert_array_equal(train.observed, ref_train.observed)
    np.testing.assert_array_equal(test.ids, ref_test.ids)
