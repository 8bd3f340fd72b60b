"""Builders: per-party tables joined on IDs, arrays cut by a splitter, explicit blocks, loaded sources."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl import DataValidationError, Task
from partialvfl.data.builders import from_arrays, from_blocks, from_csv, from_parquet, from_source, from_tables
from partialvfl.data.ids import sample_order
from partialvfl.data.sources import load_source


def by_id(ds):  # test helper
    """The dataset in ID order (from_tables gives the canonical keyed-hash order; these checks read easier by ID)."""
    return ds.subset(np.argsort(ds.ids, kind="stable"))


def three_tables() -> dict[str, pd.DataFrame]:
    bank = pd.DataFrame({"uid": ["u3", "u1", "u2"], "income": [30.0, 10.0, 20.0], "age": [3, 1, 2],
                         "label": ["yes", "no", None]})
    shop = pd.DataFrame({"uid": ["u2", "u4"], "income": [200.0, 400.0]})  # same column name as bank's: fine
    telco = pd.DataFrame({"uid": ["u5", "u1", "u3"], "calls": [5.0, 1.0, 3.0], "roaming": [True, False, True]})
    return {"bank": bank, "shop": shop, "telco": telco}


# ---------------------------------------------------------------------- from_tables: the join
def test_tables_outer_join_gives_the_exact_observed_matrix() -> None:
    raw = from_tables(three_tables(), id_column="uid", label_column="label", active_party="bank")
    assert list(raw.ids) == [f"u{i}" for i in 1 + sample_order(["u1", "u2", "u3", "u4", "u5"])]  # canonical order
    ds = by_id(raw)
    assert list(ds.ids) == ["u1", "u2", "u3", "u4", "u5"]  # the union of IDs
    np.testing.assert_array_equal(
        ds.observed,
        [[1, 0, 1],
         [1, 1, 0],
         [1, 0, 1],
         [0, 1, 0],
         [0, 0, 1]],
    )
    assert ds.party_names == ("bank", "shop", "telco") and ds.active_party == 0
    assert ds.feature_names == (("bank:income", "bank:age"), ("shop:income",), ("telco:calls", "telco:roaming"))
    np.testing.assert_array_equal(ds.blocks[0][:3], [[10, 1], [20, 2], [30, 3]])
    assert np.isnan(ds.blocks[0][3:]).all()
    np.testing.assert_array_equal(ds.party(1).features, [[200.0], [400.0]])
    np.testing.assert_array_equal(ds.blocks[2][[0, 2, 4]], [[1, 0], [3, 1], [5, 1]])
    # Labels: 'no' < 'yes'; u2's label is empty, u4 and u5 are not in the bank's table.
    assert ds.task == Task.classification(["no", "yes"])
    np.testing.assert_array_equal(ds.labeled, [True, False, True, False, False])
    np.testing.assert_array_equal(ds.y, [0, -1, 1, -1, -1])
    assert ds.info["tables"] == {"bank": "DataFrame", "shop": "DataFrame", "telco": "DataFrame"}


def test_tables_declared_classes_regression_and_int_ids() -> None:
    a = pd.DataFrame({"id": [10, 2], "x": [1.0, 2.0], "y": ["b", "a"]})
    b = pd.DataFrame({"id": [2, 7], "z": [5.0, 6.0]})
    ds = by_id(from_tables({"a": a, "b": b}, id_column="id", label_column="y", active_party=0,
                           classes=["b", "a", "c"]))
    assert ds.ids.dtype.kind == "i" and list(ds.ids) == [2, 7, 10]
    np.testing.assert_array_equal(ds.y, [1, -1, 0])
    assert ds.task.classes == ("b", "a", "c")
    r = pd.DataFrame({"id": [1, 2, 3], "x": [1.0, 2.0, 3.0], "t": [0.5, np.nan, 2.5]})
    reg = by_id(from_tables({"r": r}, id_column="id", label_column="t", active_party="r", task=Task.regression()))
    assert reg.task.kind == "regression"
    np.testing.assert_array_equal(reg.labeled, [True, False, True])
    assert reg.y[2] == 2.5


def test_tables_integer_labels_with_gaps_stay_integer_class_names() -> None:
    a = pd.DataFrame({"id": [1, 2, 3], "x": [0.0, 1.0, 2.0], "y": [3, np.nan, 1]})  # NaN upcasts to float
    ds = by_id(from_tables({"a": a}, id_column="id", label_column="y", active_party="a"))
    assert ds.task.classes == (1, 3)
    np.testing.assert_array_equal(ds.y, [1, -1, 0])


def test_tables_from_csv_and_parquet_paths(tmp_path: Path) -> None:
    (tmp_path / "a.csv").write_text("id,x,label\n007,1.5,cat\n010,2.5,\n")
    pd.DataFrame({"id": ["007", "099"], "w": [3.0, 4.0]}).to_parquet(tmp_path / "b.parquet")
    ds = by_id(from_tables({"a": tmp_path / "a.csv", "b": str(tmp_path / "b.parquet")}, id_column="id",
                           label_column="label", active_party="a", classes=["cat", "dog"]))
    assert list(ds.ids) == ["007", "010", "099"]  # text IDs keep their leading zeros
    np.testing.assert_array_equal(ds.observed, [[1, 1], [1, 0], [0, 1]])
    np.testing.assert_array_equal(ds.labeled, [True, False, False])
    assert ds.info["tables"]["a"] == str(tmp_path / "a.csv")
    # Plain integer IDs in a CSV join with integer IDs of a DataFrame.
    (tmp_path / "c.csv").write_text("id,x,label\n3,1.0,1\n1,2.0,0\n")
    other = pd.DataFrame({"id": [1, 5], "v": [0.1, 0.2]})
    ds2 = from_tables({"c": tmp_path / "c.csv", "d": other}, id_column="id", label_column="label", active_party="c")
    assert sorted(ds2.ids) == [1, 3, 5] and ds2.ids.dtype.kind == "i"
    # The thin wrappers read by format whatever the suffix.
    (tmp_path / "a.txt").write_text("id,x,label\n1,1.0,a\n2,2.0,b\n")
    assert from_csv({"a": tmp_path / "a.txt"}, id_column="id", label_column="label", active_party="a").n_samples == 2
    pd.DataFrame({"id": [1], "x": [1.0], "label": ["a"]}).to_parquet(tmp_path / "p.bin")
    ds3 = from_parquet({"p": tmp_path / "p.bin"}, id_column="id", label_column="label", active_party="p",
                       classes=["a", "b"])
    assert ds3.n_labeled == 1


def test_tables_feature_columns_select_per_party() -> None:
    t = three_tables()
    ds = from_tables(t, id_column="uid", label_column="label", active_party="bank",
                     feature_columns={"bank": ["age"], "telco": ["calls"]})
    assert ds.feature_names == (("bank:age",), ("shop:income",), ("telco:calls",))


# ---------------------------------------------------------------------- from_tables: errors
def _with(table: str, df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    t = three_tables()
    t[table] = df
    return t


@pytest.mark.parametrize(
    ("tables", "kwargs", "message"),
    [
        (_with("shop", pd.DataFrame({"uid": ["u2", "u2"], "income": [1.0, 2.0]})), {},
         r"party 'shop', ID column 'uid': ID 'u2' at rows 0 and 1; IDs must be unique"),
        (_with("shop", pd.DataFrame({"uid": ["u2", " u2"], "income": [1.0, 2.0]})), {},
         r"party 'shop', ID column 'uid': IDs 'u2' and ' u2', the same ID once normalised \('u2'\), at rows 0 and 1"),
        (_with("shop", pd.DataFrame({"uid": ["u2", "  "], "income": [1.0, 2.0]})), {},
         r"party 'shop', ID column 'uid': the ID at row 1 is empty"),
        (_with("shop", pd.DataFrame({"uid": ["u2"], "city": ["Oslo"]})), {},
         r"party 'shop': feature column 'city' is not numeric .*pandas.get_dummies"),
        (_with("shop", pd.DataFrame({"uid": ["u2", "u4"], "income": [1.0, np.nan]})), {},
         r"party 'shop', column 'income': value is missing \(NaN\) for ID 'u4'"),
        (_with("telco", pd.DataFrame({"uid": ["u9"], "calls": [np.inf]})), {},
         r"party 'telco', column 'calls': value is infinite for ID 'u9'"),
        (_with("shop", pd.DataFrame({"id": ["u2"], "income": [1.0]})), {},
         r"party 'shop': ID column 'uid' not found; its columns: \['id', 'income'\]"),
        (_with("shop", pd.DataFrame({"uid": ["u2"], "income": [1.0], "label": ["no"]})), {},
         r"party 'shop' has the label column 'label', but labels live only in the active party 'bank'"),
        (_with("bank", pd.DataFrame({"uid": ["u1"], "income": [1.0]})), {},
         r"active party 'bank': label column 'label' not found"),
        (_with("shop", pd.DataFrame({"uid": ["u2", None], "income": [1.0, 2.0]})), {},
         r"party 'shop', ID column 'uid': the ID at row 1 is missing"),
        (_with("shop", pd.DataFrame({"uid": ["u2"]})), {}, r"party 'shop' has no feature columns"),
        (three_tables(), {"classes": ["no", "maybe"]},
         r"label 'yes' of ID 'u3' is not one of the declared classes \['no', 'maybe'\]"),
        (three_tables(), {"active_party": "nobody"}, r"active_party 'nobody' is not one of the parties"),
        (three_tables(), {"feature_columns": {"bank": ["salary"]}}, r"party 'bank': feature column 'salary' not found"),
        (three_tables(), {"feature_columns": {"bank": ["uid"]}}, r"party 'bank': 'uid' is the ID column"),
        (three_tables(), {"feature_columns": {"bnk": ["age"]}}, r"feature_columns names unknown parties \['bnk'\]"),
        (three_tables(), {"task": Task.regression()}, r"regression target 'no' of ID 'u1' is not a number"),
        (_with("bank", pd.DataFrame({"uid": ["a", "b"], "x": [1.0, 2.0], "label": [0.5, 1.5]})), {},
         r"label 0.5 is not a class .*task=Task.regression\(\)"),
        (_with("bank", pd.DataFrame({"uid": ["a", "b"], "x": [1.0, 2.0], "label": ["x", "x"]})), {},
         r"found 1 distinct label\(s\) \['x'\]"),
        (_with("bank", pd.DataFrame({"uid": ["a", "b"], "x": [1.0, 2.0], "label": ["x", 3]})), {},
         r"labels mix types \(int, str\)"),
    ],
)
def test_tables_errors_name_the_party_column_or_id(tables: dict, kwargs: dict, message: str) -> None:
    kw = {"id_column": "uid", "label_column": "label", "active_party": "bank", **kwargs}
    with pytest.raises(DataValidationError, match=message):
        from_tables(tables, **kw)


def test_tables_path_errors(tmp_path: Path) -> None:
    kw = {"id_column": "id", "label_column": "y", "active_party": "a"}
    with pytest.raises(DataValidationError, match=r"party 'a': cannot tell the format of .*t\.xlsx"):
        from_tables({"a": tmp_path / "t.xlsx"}, **kw)
    with pytest.raises(FileNotFoundError, match=r"party 'a': table file .*gone\.csv not found"):
        from_tables({"a": tmp_path / "gone.csv"}, **kw)
    with pytest.raises(DataValidationError, match="tables must be a non-empty mapping"):
        from_tables({}, **kw)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sets(st.integers(0, 30), min_size=1, max_size=12), min_size=1, max_size=4), st.integers(0, 10_000))
def test_tables_join_property(id_sets: list[set[int]], seed: int) -> None:
    """Any overlap pattern: observed[i, k] is exactly "party k's table holds ID i", and values follow their IDs."""
    rng = np.random.default_rng(seed)
    tables = {}
    for k, ids in enumerate(id_sets):
        order = rng.permutation(sorted(ids)).astype(np.int64)
        tables[f"p{k}"] = pd.DataFrame({"id": order, "v": order * 10.0 + k})
    tables["p0"]["y"] = np.where(tables["p0"]["id"] % 2 == 0, "even", "odd")
    union = sorted(set().union(*id_sets))
    if not union or len(set(tables["p0"]["y"])) < 2:
        return
    ds = by_id(from_tables(tables, id_column="id", label_column="y", active_party="p0", classes=["even", "odd"]))
    assert list(ds.ids) == union
    for k, ids in enumerate(id_sets):
        expected = np.isin(union, sorted(ids))
        np.testing.assert_array_equal(ds.observed[:, k], expected)
        np.testing.assert_array_equal(ds.blocks[k][expected, 0], np.asarray(union)[expected] * 10.0 + k)
    np.testing.assert_array_equal(ds.labeled, np.isin(union, sorted(id_sets[0])))


# ---------------------------------------------------------------------- blocks and arrays
def test_from_blocks_infers_observed_from_all_nan_rows_and_maps_label_names() -> None:
    a = np.array([[1.0, 2.0], [np.nan, np.nan], [5.0, 6.0]])
    b = np.array([[1.0], [2.0], [np.nan]])
    ds = from_blocks([a, b], ["dog", "cat", None], ids=["x", "y", "z"], party_names=["left", "right"])
    np.testing.assert_array_equal(ds.observed, [[1, 1], [0, 1], [1, 0]])
    assert ds.task.classes == ("cat", "dog")
    np.testing.assert_array_equal(ds.y, [1, 0, -1])
    with pytest.raises(DataValidationError, match=r"party 0 \('party0'\), column 'party0:1': NaN for ID 0"):
        from_blocks([np.array([[1.0, np.nan]]), np.ones((1, 1))], task=Task.classification("ab"))


def test_from_blocks_observed_blanks_and_indices_with_task() -> None:
    a = np.arange(6, dtype=float).reshape(3, 2)
    b = np.ones((3, 1))
    task = Task.classification(["no", "yes"])
    ds = from_blocks([a, b], np.array([1, -1, 0]), task=task, observed=[[1, 1], [0, 1], [1, 1]])
    assert np.isnan(ds.blocks[0][1]).all() and not np.isnan(a).any()  # the caller's array is untouched
    np.testing.assert_array_equal(ds.y, [1, -1, 0])
    np.testing.assert_array_equal(ds.labeled, [True, False, True])
    with pytest.raises(DataValidationError, match=r"observed must have shape \(3, 2\)"):
        from_blocks([a, b], task=task, observed=np.ones((3, 3), bool))
    with pytest.raises(DataValidationError, match="party 1 has 2 rows but party 0 has 3"):
        from_blocks([a, b[:2]], task=task)
    with pytest.raises(DataValidationError, match="features must be numeric"):
        from_blocks([a, np.array([["x"], ["y"], ["z"]])], task=task)


def test_from_arrays_contiguous_grid_and_columns() -> None:
    X = np.arange(40, dtype=float).reshape(4, 10)
    ds = from_arrays(X, [0, 1, 1, 0], splitter="contiguous", n_parties=2)
    assert ds.feature_dims == (5, 5) and ds.task.classes == (0, 1)
    np.testing.assert_array_equal(ds.blocks[1][0], X[0, 5:])
    assert ds.info["splitter"] == "contiguous"
    cols = from_arrays(X, [0, 1, 1, 0], splitter="columns:0-2;3-9")
    assert cols.n_parties == 2 and cols.feature_dims == (3, 7)
    images = np.random.default_rng(0).random((3, 4, 4))
    img = from_arrays(images, [0, 1, 2], task=Task.classification(["a", "b", "c"]), n_parties=4)
    assert img.n_parties == 4 and sum(img.feature_dims) == 16
    assert all(len(s) == 2 for s in img.feature_shapes)  # grid pieces keep their 2-D shape
    Xn = X.copy()
    Xn[2, 5:] = np.nan
    partial = from_arrays(Xn, [0, 1, 1, 0], n_parties=2)
    np.testing.assert_array_equal(partial.observed[:, 1], [True, True, False, True])
    with pytest.raises(DataValidationError, match="n_parties"):
        from_arrays(X, [0, 1, 1, 0])


def test_from_source_synthetic_and_digits() -> None:
    train, test = from_source(load_source("synthetic", n_samples=40, n_test=10))
    assert train.n_parties == 4 and train.feature_dims == (8, 8, 8, 8) and test.n_samples == 10
    assert train.party(0).feature_names[0] == "p0_f0"
    digits, none = from_source(load_source("digits"), n_parties=4)
    assert none is None and digits.n_labeled == 1797 and digits.task.n_classes == 10
    with pytest.raises(DataValidationError, match="n_parties"):
        from_source(load_source("digits"))
