"""A party's table read in chunks equals the in-memory reading (issue 46): IDs, features, refusals.

:func:`partialvfl.data.chunked.read_party_table` reads a Parquet or CSV file, or a directory of them, a few rows at
a time; whatever the chunk size it must give what :func:`read_table` / :func:`table_ids` / :func:`select_features`
/ :func:`feature_values` give on the whole table, and refuse what they refuse with the same message.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partialvfl.data.chunked import read_party_table
from partialvfl.data.dataset import DataValidationError
from partialvfl.data.tables import feature_values, read_table, select_features, table_ids

WHERE = "party 1 ('shop'), shop.csv"


def in_memory(path: Path, id_column: str = "id", **kw: object) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    df, _ = read_table(WHERE, path, id_column)
    ids, _ = table_ids(WHERE, df, id_column)
    cols = select_features(WHERE, df, id_column=id_column, **kw)  # type: ignore[arg-type]
    return np.array(ids, dtype=object), feature_values(WHERE, df, cols, ids), tuple(cols)


def table(n: int, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"id": rng.permutation(np.arange(10_000, 10_000 + n)), "x": rng.normal(size=n) * 1e3,
                         "flag": rng.random(n) < 0.5, "k": rng.integers(-5, 5, n), "label": rng.integers(0, 2, n)})


def assert_same(path: Path, chunk_rows: int, **kw: object) -> None:
    got = read_party_table(WHERE, path, "id", chunk_rows=chunk_rows, **kw)  # type: ignore[arg-type]
    ids, features, cols = in_memory(path, **kw)
    assert got.ids.tolist() == ids.tolist() and got.feature_names == cols
    assert got.features.dtype == np.float32 and np.array_equal(got.features, features)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 120), chunk=st.integers(1, 50), fmt=st.sampled_from(["csv", "parquet"]))
def test_chunks_of_any_size_give_the_in_memory_table(tmp_path_factory: pytest.TempPathFactory, n: int, chunk: int,
                                                     fmt: str) -> None:
    path = tmp_path_factory.mktemp("t") / f"shop.{fmt}"
    df = table(n)
    df.to_csv(path, index=False) if fmt == "csv" else df.to_parquet(path, row_group_size=7)
    assert_same(path, chunk, exclude=["label"])
    assert_same(path, chunk, columns=["k", "x"])


def test_text_ids_as_written_and_a_directory_of_files_read_as_one_table(tmp_path: Path) -> None:
    csv = tmp_path / "shop.csv"
    csv.write_text("id,x\n007,1.5\n 12,2\n12.5,3\nabc,4\n7,5\n")
    assert_same(csv, 2)
    assert read_party_table(WHERE, csv, "id", chunk_rows=2).ids.tolist() == ["007", "12", "12.5", "abc", "7"]
    d = tmp_path / "parts"
    d.mkdir()
    whole = table(90, seed=3)
    for i in range(3):
        whole.iloc[30 * i:30 * (i + 1)].to_parquet(d / f"part-{i}.parquet")
    got = read_party_table(WHERE, d, "id", chunk_rows=16, exclude=["label"])
    single = tmp_path / "whole.parquet"
    whole.to_parquet(single)
    ids, features, _ = in_memory(single, exclude=["label"])
    assert got.ids.tolist() == ids.tolist() and np.array_equal(got.features, features)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_refusals_in_a_later_chunk_read_as_the_in_memory_ones(tmp_path: Path, fmt: str) -> None:
    def refusal(df: pd.DataFrame, **kw: object) -> tuple[str, str]:
        path = tmp_path / f"shop.{fmt}"
        df.to_csv(path, index=False) if fmt == "csv" else df.to_parquet(path)
        with pytest.raises(DataValidationError) as chunked:
            read_party_table(WHERE, path, "id", chunk_rows=4, **kw)  # type: ignore[arg-type]
        with pytest.raises(DataValidationError) as whole:
            in_memory(path, **kw)
        return str(chunked.value), str(whole.value)

    base = table(20)
    repeated = base.copy()
    repeated.loc[17, "id"] = repeated.loc[2, "id"]  # rows 2 and 17: different chunks
    a, b = refusal(repeated, exclude=["label"])
    assert a == b and "rows 2 and 17" in a
    missing = base.copy()
    missing["x"] = missing["x"].astype(float)
    missing.loc[13, "x"] = np.nan
    a, b = refusal(missing, exclude=["label"])
    assert a == b and "column 'x'" in a
    a, b = refusal(base, columns=["nope"])
    assert a == b and "'nope' not found" in a
    empty_id = base.astype({"id": str})
    empty_id.loc[9, "id"] = ""
    a, b = refusal(empty_id, exclude=["label"])
    assert a == b and "row 9" in a
