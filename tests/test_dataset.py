"""VerticalDataset: validation errors, party views, subsetting, splitting, masking, standardisation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl import DataValidationError, Task, VerticalDataset
from partialvfl.data import Standardizer


def make(n: int = 12, dims: tuple[int, ...] = (3, 2), seed: int = 0, **kw) -> VerticalDataset:
    rng = np.random.default_rng(seed)
    blocks = [rng.normal(size=(n, d)) for d in dims]
    obs = kw.pop("observed", np.ones((n, len(dims)), bool))
    for j, b in enumerate(blocks):
        b[~obs[:, j]] = np.nan
    kw.setdefault("y", rng.integers(0, 3, n))
    kw.setdefault("task", Task.classification(["a", "b", "c"]))
    kw.setdefault("ids", [f"u{i}" for i in range(n)])
    return VerticalDataset(blocks, obs, **kw)


def test_valid_dataset_basic_properties() -> None:
    obs = np.ones((12, 2), bool)
    obs[[1, 4], 0] = False
    obs[4, 1] = False
    ds = make(observed=obs)
    assert ds.n_samples == 12 and ds.n_parties == 2 and ds.feature_dims == (3, 2)
    assert ds.active_party == 1  # default: the last party holds the labels
    s = ds.summary()
    assert s["observed_parties_histogram"] == [1, 1, 10] and s["all_missing"] == 1
    assert s["observed_fraction"] == [pytest.approx(10 / 12), pytest.approx(11 / 12)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(ids=["x"] * 12), "duplicate sample ID 'x'"),
        (dict(active_party=2), "active party index 2 is out of range"),
        (dict(y=np.full(12, 3)), "label 3 of ID 'u0' is outside the declared classes"),
        (dict(y=np.zeros(11, int)), "labels must be a 1-D array of length 12"),
        (dict(observed=np.ones((12, 3), bool)), "observed must have shape (12, 2)"),
        (dict(party_names=["bank", "bank"]), "party names must be unique"),
        (dict(feature_names=[["a", "b", "c"], ["d"]]), "party 1 ('party1'): 1 feature names for 2 columns"),
        (dict(task=Task.regression(), y=np.array(["x"] * 12)), "regression targets must be numeric"),
    ],
)
def test_validation_errors_name_the_culprit(change: dict, message: str) -> None:
    with pytest.raises(DataValidationError) as e:
        make(**change)
    assert message in str(e.value)


def test_nan_and_inf_in_observed_rows_are_refused_with_party_column_and_id() -> None:
    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(5, 2)), rng.normal(size=(5, 2))]
    blocks[1][3, 1] = np.nan
    with pytest.raises(DataValidationError, match=r"party 1 \('shop'\), column 'spend': NaN for ID 'c3'"):
        VerticalDataset(blocks, np.ones((5, 2), bool), ids=[f"c{i}" for i in range(5)], y=np.zeros(5, int),
                        task=Task.classification([0, 1]), party_names=["bank", "shop"],
                        feature_names=[["age", "income"], ["visits", "spend"]])
    blocks[1][3, 1] = np.inf
    with pytest.raises(DataValidationError, match="an infinite value for ID 3"):
        VerticalDataset(blocks, np.ones((5, 2), bool), y=np.zeros(5, int), task=Task.classification([0, 1]))


def test_block_present_where_observed_says_missing_is_refused() -> None:
    rng = np.random.default_rng(0)
    blocks = [rng.normal(size=(4, 2)), rng.normal(size=(4, 1))]
    obs = np.ones((4, 2), bool)
    obs[2, 0] = False  # but blocks[0][2] still holds numbers
    with pytest.raises(DataValidationError, match="party 0 .* has feature values for ID 2, but `observed` says"):
        VerticalDataset(blocks, obs, y=np.zeros(4, int), task=Task.classification([0, 1]))


def test_shape_errors() -> None:
    with pytest.raises(DataValidationError, match="party 1 .* has 3 rows but party 0 .* has 4"):
        VerticalDataset([np.zeros((4, 2)), np.zeros((3, 2))], np.ones((4, 2)), y=np.zeros(4, int),
                        task=Task.classification([0, 1]))
    with pytest.raises(DataValidationError, match="party 0 .* has no feature columns"):
        VerticalDataset([np.zeros((4, 0)), np.zeros((4, 2))], np.ones((4, 2)), y=np.zeros(4, int),
                        task=Task.classification([0, 1]))
    with pytest.raises(DataValidationError, match="at least one party block"):
        VerticalDataset([], np.ones((4, 0)), task=Task.classification([0, 1]))
    with pytest.raises(DataValidationError, match="at least 2 classes"):
        Task.classification(["only"])


def test_party_view_holds_only_its_rows_and_only_active_holds_labels() -> None:
    obs = np.ones((12, 2), bool)
    obs[[0, 5, 7], 0] = False
    ds = make(observed=obs)
    v0, v1 = ds.party(0), ds.party(1)
    assert v0.rows.tolist() == [r for r in range(12) if r not in (0, 5, 7)]
    assert np.isfinite(v0.features).all() and v0.features.shape == (9, 3)
    assert v0.labels is None and v1.labels is not None
    np.testing.assert_array_equal(v0.position_of_rows(np.array([1, 6])), [0, 4])
    with pytest.raises(KeyError, match="does not hold rows"):
        v0.position_of_rows(np.array([5]))
    with pytest.raises(ValueError):
        v0.features[0, 0] = 1.0  # read-only


def test_coordinator_view_has_no_features() -> None:
    cv = make().coordinator_view()
    assert not any(isinstance(getattr(cv, f), np.ndarray) and getattr(cv, f).dtype.kind == "f"
                   and getattr(cv, f).ndim == 2 for f in cv.__dataclass_fields__)


def test_with_observed_only_removes_and_blanks_rows() -> None:
    ds = make()
    obs = ds.observed.copy()
    obs[3, 1] = False
    ds2 = ds.with_observed(obs)
    assert np.isnan(ds2.blocks[1][3]).all() and not ds2.observed[3, 1]
    obs[3, 1] = True
    with pytest.raises(DataValidationError, match="cannot mark party 1 .* as observing ID 'u3'"):
        ds2.with_observed(obs)


def test_with_labels_erases_hidden_labels() -> None:
    ds = make()
    lab = np.zeros(12, bool)
    lab[:4] = True
    ds2 = ds.with_labels(lab)
    assert ds2.n_labeled == 4 and (ds2.y[4:] == -1).all() and (ds2.y[:4] == ds.y[:4]).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.floats(min_value=0.1, max_value=0.9))
def test_split_is_a_seeded_partition(seed: int, frac: float) -> None:
    ds = make(n=40)
    tr, te = ds.train_test_split(frac, seed=seed)
    assert sorted(tr.ids.tolist() + te.ids.tolist()) == sorted(ds.ids.tolist())
    tr2, _ = ds.train_test_split(frac, seed=seed)
    assert tr.ids.tolist() == tr2.ids.tolist()


def test_subset_keeps_alignment_of_all_arrays() -> None:
    ds = make()
    sub = ds.subset([5, 2, 9])
    assert sub.ids.tolist() == ["u5", "u2", "u9"]
    np.testing.assert_array_equal(sub.blocks[0], ds.blocks[0][[5, 2, 9]])
    np.testing.assert_array_equal(sub.y, ds.y[[5, 2, 9]])


def test_standardizer_uses_only_each_partys_observed_training_rows() -> None:
    obs = np.ones((12, 2), bool)
    obs[:6, 0] = False
    ds = make(observed=obs)
    sc = Standardizer.fit(ds)
    held = ds.blocks[0][6:]
    np.testing.assert_allclose(sc.means[0], held.mean(axis=0), rtol=1e-5)
    out = sc.transform(ds)
    np.testing.assert_allclose(np.nanmean(out.blocks[0], axis=0), 0, atol=1e-5)
    assert np.isnan(out.blocks[0][:6]).all()  # missing stays missing
