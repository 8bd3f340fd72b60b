"""The scikit-learn conventions: VFLClassifier/VFLRegressor (a table whose column groups are the parties) in
cross_val_score, GridSearchCV and a Pipeline, scikit-learn's own estimator checks, regression ``score`` = R^2, method
classes importable by name, and no fitted (trailing-underscore) attribute before ``fit``."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pandas as pd
import pytest
from sklearn.base import clone
from sklearn.model_selection import GridSearchCV, KFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from partialvfl import Task, VerticalDataset
from partialvfl.data.builders import from_blocks
from partialvfl.data.dataset import DataValidationError
from partialvfl.methods import VFLClassifier, VFLRegressor, get_method
from partialvfl.methods.registry import load_specs

PARTIES = {"bank": ["income", "debt", "age"], "shop": ["visits", "basket", "returns"]}
QUICK = {"epochs": 5, "batch_size": 32}
TINY_FALSE = {"d_h": 8, "d_z": 4, "encoder_hidden": [16], "decoder_hidden": [16], "global_hidden": [16],
              "discriminator_hidden": [16], "mask_hidden": [8], "importance_samples": 3,
              "predict_importance_samples": 5, "pretrain_epochs": 3, "epochs": 5}


def frame(n: int = 180, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """Two parties over users ``u0..``: the shop misses every 5th user (its block NaN), a third of the users are
    unlabelled (None), the labels are the sign of a latent factor both parties see."""
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, 2))
    values = np.c_[z @ rng.normal(size=(2, 3)), z @ rng.normal(size=(2, 3))] + 0.3 * rng.normal(size=(n, 6))
    X = pd.DataFrame(values, columns=[c for cols in PARTIES.values() for c in cols],
                     index=[f"u{i}" for i in range(n)])
    X.iloc[::5, 3:] = np.nan
    y = np.where(z[:, 0] > 0, "yes", "no").astype(object)
    y[1::3] = None
    return X, y


def by_hand(X: pd.DataFrame, y: np.ndarray, train: np.ndarray, test: np.ndarray) -> float:
    """LASER-VFL fitted on the fold through the library's own builder, scored on the test fold's labelled rows."""
    def dataset(rows: np.ndarray, labels: np.ndarray | None) -> VerticalDataset:
        part = X.iloc[rows]
        return from_blocks([part[c].to_numpy() for c in PARTIES.values()], labels, ids=np.asarray(part.index),
                           active_party=0, party_names=list(PARTIES), feature_names=list(PARTIES.values()))

    model = get_method("laser-vfl")("fast", seed=0, **QUICK).fit(dataset(train, y[train]))
    predicted = model.predict(dataset(test, None))
    labeled = np.array([v is not None for v in y[test]])
    return float(np.mean(predicted[labeled] == y[test][labeled]))


# ---------------------------------------------------------------------- scikit-learn's tools
def test_cross_val_score_scores_each_fold_as_the_library_does_by_hand() -> None:
    X, y = frame()
    folds = KFold(3, shuffle=True, random_state=0)
    scores = cross_val_score(VFLClassifier("laser-vfl", PARTIES, params=QUICK), X, y, cv=folds)
    expected = [by_hand(X, y, train, test) for train, test in folds.split(X)]
    assert list(scores) == expected  # same data, same seed, same kernels: the adapter adds nothing and drops nothing
    assert min(scores) > 0.8


def test_grid_search_searches_method_parameters_and_refits_the_best() -> None:
    X, y = frame()
    model = VFLClassifier("laser-vfl", PARTIES, params=QUICK)
    grid = {"params__epochs": [1, QUICK["epochs"]], "params__batch_size": [32]}
    search = GridSearchCV(model, grid, cv=KFold(2)).fit(X, y)
    assert search.best_params_["params__epochs"] in (1, QUICK["epochs"])
    assert search.best_estimator_.model_.params_["epochs"] == search.best_params_["params__epochs"]
    assert model.params == QUICK and "model_" not in vars(model)  # the estimator given stays as it was
    again = cross_val_score(VFLClassifier("laser-vfl", PARTIES, params=QUICK), X, y, cv=KFold(2))
    assert search.cv_results_["mean_test_score"][1] == pytest.approx(again.mean())  # the same fits


def test_a_pipeline_scales_then_fits_keeping_the_parties_columns() -> None:
    X, y = frame()
    pipe = make_pipeline(StandardScaler().set_output(transform="pandas"),
                         VFLClassifier("laser-vfl", PARTIES, params=QUICK)).fit(X, y)
    scaled = StandardScaler().fit_transform(X)  # NaN stays NaN: the shop's missing users stay missing
    alone = VFLClassifier("laser-vfl", PARTIES, params=QUICK).fit(pd.DataFrame(scaled, X.index, X.columns), y)
    np.testing.assert_array_equal(pipe.predict_proba(X), alone.predict_proba(pd.DataFrame(scaled, X.index, X.columns)))
    assert pipe.score(X, y) == alone.score(pd.DataFrame(scaled, X.index, X.columns), y)


def test_scikit_learns_estimator_checks_pass_where_they_apply() -> None:
    from sklearn.utils.estimator_checks import check_estimator

    reason = ("the check puts one NaN into a party's block; a partly missing block is refused (a missing party is "
              "a whole block of NaN); pickling a fitted model is tested in test_a_fitted_model_pickles_as_its_files")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(VFLClassifier("laser-vfl", parties=2, params={"epochs": 2}), on_fail=None,
                                  expected_failed_checks={"check_estimators_pickle": reason})
    failed = [(r["check_name"], str(r["exception"])[:200]) for r in results if r["status"] == "failed"]
    assert not failed
    assert sum(r["status"] == "passed" for r in results) >= 45


@pytest.mark.slow
def test_scikit_learns_estimator_checks_of_the_regressor() -> None:
    from sklearn.utils.estimator_checks import check_estimator

    by_position = ("an array's rows are identified by position, and FALSE-VFL seeds each row's Monte Carlo samples "
                   "by that ID: moved rows draw other samples (a DataFrame's index keeps them: "
                   "test_a_rows_prediction_follows_its_index_not_its_position)")
    expected = {"check_estimators_pickle": "one NaN in a party's block, as for the classifier",
                "check_methods_sample_order_invariance": by_position, "check_methods_subset_invariance": by_position,
                "check_regressors_train": "the check's R^2 > 0.5 after a tiny fit (5 epochs) of a deep latent model"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = check_estimator(VFLRegressor("false-vfl-1", parties=2, params=TINY_FALSE), on_fail=None,
                                  expected_failed_checks=expected)
    assert not [(r["check_name"], str(r["exception"])[:200]) for r in results if r["status"] == "failed"]


def test_a_rows_prediction_follows_its_index_not_its_position() -> None:
    X, y = frame(120)
    model = VFLClassifier("false-vfl-1", PARTIES, params=TINY_FALSE).fit(X, y)
    order = np.random.default_rng(1).permutation(len(X))
    shuffled = pd.DataFrame(model.predict_proba(X.iloc[order]), index=X.index[order])
    np.testing.assert_array_equal(shuffled.loc[X.index].to_numpy(), model.predict_proba(X))


def test_a_fitted_model_pickles_as_its_files() -> None:
    X, y = frame(90)
    model = VFLClassifier("laser-vfl", PARTIES, params=QUICK).fit(X, y)
    copy = pickle.loads(pickle.dumps(model))
    np.testing.assert_array_equal(copy.predict_proba(X), model.predict_proba(X))
    assert list(copy.classes_) == ["no", "yes"] and copy.get_params() == model.get_params()


# ---------------------------------------------------------------------- parties, labels, parameters
def test_a_two_level_column_index_names_the_parties() -> None:
    X, y = frame(90)
    grouped = X.copy()
    grouped.columns = pd.MultiIndex.from_tuples([(p, c) for p, cols in PARTIES.items() for c in cols])
    by_index = VFLClassifier("laser-vfl", params=QUICK).fit(grouped, y)
    by_dict = VFLClassifier("laser-vfl", PARTIES, params=QUICK).fit(X, y)
    assert by_index.parties_ == {p: [(p, c) for c in cols] for p, cols in PARTIES.items()}
    assert by_index.model_.index_.feature_names == by_dict.model_.index_.feature_names
    np.testing.assert_array_equal(by_index.predict_proba(grouped), by_dict.predict_proba(X))


def test_nan_blocks_are_missing_parties_and_unlabeled_rows_are_kept() -> None:
    from partialvfl.methods.frame_estimators import _dataset

    X, y = frame(90)
    data = _dataset(X, np.asarray(X.index), PARTIES, "shop", y, classification=True)
    assert data.party_names == ("bank", "shop") and data.active_party == 1
    np.testing.assert_array_equal(data.observed[:, 1], np.arange(90) % 5 != 0)
    assert data.observed[:, 0].all() and list(data.ids[:2]) == ["u0", "u1"]
    np.testing.assert_array_equal(data.labeled, np.arange(90) % 3 != 1)
    model = VFLClassifier("laser-vfl", PARTIES, active_party="shop", params=QUICK).fit(X, y)
    labeled = y[np.arange(90) % 3 != 1]
    np.testing.assert_allclose(model.model_.label_prior_, [np.mean(labeled == "no"), np.mean(labeled == "yes")])


@pytest.mark.parametrize(("parties", "message"), [
    ({"bank": ["income", "debt", "age"], "shop": ["visits", "basket", "age"]}, "'age' is given to two parties"),
    ({"bank": ["income", "debt", "age"], "shop": ["visits", "basket"]}, "'returns' of X belongs to no party"),
    ({"bank": ["income", "debt", "age"], "shop": ["visits", "basket", "nope"]}, "party 'shop': column 'nope'"),
    (None, "say which columns each party holds"),
    (7, "parties=7 needs at least 7 columns"),
])
def test_bad_party_columns_are_refused_naming_them(parties: object, message: str) -> None:
    X, y = frame(30)
    with pytest.raises(DataValidationError, match=message):
        VFLClassifier("laser-vfl", parties).fit(X, y)


def test_a_partly_missing_block_is_refused_naming_party_column_and_row() -> None:
    X, y = frame(30)
    X.loc["u1", "debt"] = np.nan
    with pytest.raises(DataValidationError, match=r"party 0 \('bank'\), column 'debt': NaN for ID 'u1'"):
        VFLClassifier("laser-vfl", PARTIES, params=QUICK).fit(X, y)


def test_get_params_lists_method_parameters_for_grids_and_set_params_copies() -> None:
    params = {"epochs": 2}
    model = VFLClassifier("laser-vfl", PARTIES, params=params)
    assert model.get_params()["params__epochs"] == 2 and "params__epochs" not in model.get_params(deep=False)
    model.set_params(params__lr=0.01, seed=3)
    assert model.params == {"epochs": 2, "lr": 0.01} and params == {"epochs": 2} and model.seed == 3
    assert clone(model).get_params() == model.get_params()
    with pytest.raises(ValueError, match="nope"):
        model.set_params(nope=1)


# ---------------------------------------------------------------------- the methods' own conventions
def regression_data(n: int = 160) -> VerticalDataset:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(n, 2))
    blocks = [z @ rng.normal(size=(2, 3)) + 0.3 * rng.normal(size=(n, 3)) for _ in range(2)]
    return VerticalDataset(blocks, np.ones((n, 2), bool), y=5.0 + 3.0 * z[:, 0] - 2.0 * z[:, 1],
                           task=Task.regression())


def test_regression_score_is_r2_higher_is_better() -> None:
    data = regression_data()
    train, test = data.subset(np.arange(120)), data.subset(np.arange(120, 160))
    model = get_method("false-vfl-1")("fast", seed=0, **TINY_FALSE).fit(train)
    predicted = model.predict(test)
    truth = np.asarray(test.y)
    r2 = 1 - ((truth - predicted) ** 2).sum() / ((truth - truth.mean()) ** 2).sum()
    assert model.score(test) == pytest.approx(r2, rel=1e-12)
    X = np.concatenate(data.blocks, axis=1)
    wrapped = VFLRegressor("false-vfl-1", parties=2, params=TINY_FALSE).fit(X[:120], np.asarray(data.y)[:120])
    from sklearn.metrics import r2_score

    assert wrapped.score(X[120:], np.asarray(data.y)[120:]) == pytest.approx(
        r2_score(np.asarray(data.y)[120:], wrapped.predict(X[120:])), rel=1e-12)


def test_every_registered_method_class_is_importable_by_name() -> None:
    import partialvfl.methods as methods
    from partialvfl.methods.registry import package_methods

    specs = load_specs()
    for name in package_methods():  # the methods the package ships (a test's toy method is not exported)
        class_name = specs[name].implementation.rpartition(":")[2]
        assert getattr(methods, class_name).name == name
        assert class_name in methods.__all__ and class_name in dir(methods)


def test_no_fitted_attribute_before_fit() -> None:
    for name in load_specs():
        model = get_method(name)()
        fitted = [a for a in dir(model) if a.endswith("_") and not a.startswith("__") and hasattr(model, a)]
        assert fitted == [], (name, fitted)
