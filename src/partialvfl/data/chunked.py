"""A party's table read in chunks: a Parquet or CSV file, or a directory of them, never whole in memory.

:func:`read_party_table` gives what a party keeps of its table (the normalised IDs and the float32 feature matrix)
by the same rules as the in-memory readers of :mod:`partialvfl.data.tables` (the same IDs, columns, values and
refusals), reading :data:`CHUNK_ROWS` rows at a time: Parquet through ``pyarrow.dataset`` (a file, or a directory
of ``.parquet`` files read as one table, in file name order), CSV through pandas' chunked reader (a file, or a
directory of ``.csv`` files).  What stays in memory is the result, about ``4 x columns`` bytes of features per row
and the row's ID, not the table's text or a DataFrame of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from partialvfl.data.dataset import DataValidationError
from partialvfl.data.id_column import IdColumn
from partialvfl.data.ids import normalize_ids
from partialvfl.data.tables import (
    check_table_file,
    columns_hint,
    csv_ids,
    feature_values,
    select_features,
    table_format,
)

__all__ = ["CHUNK_ROWS", "PartyTableData", "read_party_table", "release_arrow_memory", "table_files"]

#: rows read at a time
CHUNK_ROWS = 65_536


@dataclass(frozen=True)
class PartyTableData:
    """A party's table as it keeps it: normalised ID texts (Arrow strings), float32 features, their names."""

    ids: IdColumn
    features: np.ndarray
    feature_names: tuple[str, ...]


def table_files(where: str, path: str | Path) -> tuple[list[Path], str]:
    """The files of a table (the file itself, or a directory's table files in name order) and their format;
    a directory must hold files of one format, and at least one."""
    p = Path(path).expanduser()
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.is_file() and table_format(f) is not None)
        kinds = {table_format(f) for f in files}
        if not files:
            raise DataValidationError(f"{where}: directory {p} holds no table files (.csv or .parquet)")
        if len(kinds) > 1:
            raise DataValidationError(f"{where}: directory {p} mixes CSV and Parquet files; keep one format")
        return files, str(kinds.pop())
    kind = table_format(p)
    if kind is None:
        raise DataValidationError(f"{where}: cannot tell the format of {p} from its name; name it .csv (or "
                                  ".csv.gz, ...) or .parquet (or .pq), or give a directory of such files")
    if not p.is_file():
        raise FileNotFoundError(f"{where}: table file {p} not found")
    return [p], kind


def _chunks(files: Sequence[Path], kind: str, id_column: str, rows: int) -> Iterator[pd.DataFrame]:
    if kind == "parquet":
        import pyarrow.dataset as ds

        dataset = ds.dataset([str(f) for f in files], format="parquet")
        empty = True
        # one batch and one file ahead at most (the defaults, 16 and 4, decode hundreds of MB ahead of the reader)
        for batch in dataset.to_batches(batch_size=rows, batch_readahead=1, fragment_readahead=1):
            if batch.num_rows:
                empty = False
                yield batch.to_pandas()
        if empty:
            yield dataset.schema.empty_table().to_pandas()
        return
    for f in files:
        with pd.read_csv(f, dtype={id_column: str}, chunksize=rows) as reader:
            yield from reader


def read_party_table(where: str, path: str | Path, id_column: str, *, columns: Sequence[str] | None = None,
                     exclude: Sequence[str] = (), chunk_rows: int = CHUNK_ROWS) -> PartyTableData:
    """A party's table (a file or a directory of files) read ``chunk_rows`` rows at a time; the same IDs, features
    and errors as :func:`~partialvfl.data.tables.read_table`, :func:`~partialvfl.data.tables.table_ids`,
    :func:`~partialvfl.data.tables.select_features` and :func:`~partialvfl.data.tables.feature_values` on the whole
    table (``where`` names the party in errors)."""
    files, kind = table_files(where, path)
    for f in files:
        check_table_file(where, f, kind)
    ids: list[Any] = []
    values: list[np.ndarray] = []
    cols: list[str] | None = None
    first_row = 0
    try:
        for df in _chunks(files, kind, id_column, chunk_rows):
            if id_column not in df.columns:
                raise DataValidationError(f"{where}: ID column {id_column!r} not found; {columns_hint(df)}")
            texts = normalize_ids(df[id_column].to_numpy(dtype=object), f"{where}, ID column {id_column!r}",
                                  unique=False, first_row=first_row)
            if cols is None:
                cols = select_features(where, df, id_column=id_column, columns=columns, exclude=exclude)
            elif len(df):
                select_features(where, df, id_column=id_column, columns=cols)
            values.append(feature_values(where, df, cols, texts))
            ids.append(pa.array(texts, type=pa.string()))
            first_row += len(df)
    except (OSError, ValueError) as e:
        if isinstance(e, DataValidationError):
            raise
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataValidationError(f"{where}: cannot read {path} as {'CSV' if kind == 'csv' else 'Parquet'} "
                                  f"({type(e).__name__}: {detail[:200]})") from None
    assert cols is not None
    all_ids = IdColumn(pa.chunked_array(ids, type=pa.string()))
    _check_unique(where, all_ids, files, kind, id_column)
    features = np.concatenate(values) if values else np.zeros((0, len(cols)), dtype=np.float32)
    release_arrow_memory()
    return PartyTableData(all_ids, features, tuple(cols))


def release_arrow_memory() -> None:
    """Hand the memory Arrow's allocator keeps for reuse back to the system (after reading a large table it held
    several hundred MB of decoded chunks no longer used: measured 650 MB at 5M rows)."""
    pa.default_memory_pool().release_unused()


def _check_unique(where: str, ids: IdColumn, files: Sequence[Path], kind: str, id_column: str) -> None:
    """Refuse two rows whose IDs are the same once normalised, as the in-memory reader does (its message: the
    rows and their IDs as written; found by reading the ID column alone again, only when there is a repeat)."""
    if len(ids) < 2:
        return
    ordered = ids.data.take(pc.sort_indices(ids.data)).combine_chunks()  # sorted: a repeat sits beside its twin
    repeats = pc.any(pc.equal(ordered.slice(1), ordered.slice(0, len(ordered) - 1))).as_py()
    del ordered
    if not repeats:  # (a hash table of every ID, pc.count_distinct, measured 430 MB at 5M IDs; this about 100)
        return
    column = pd.concat([df[id_column] for df in _chunks(files, kind, id_column, CHUNK_ROWS)], ignore_index=True)
    raw = (csv_ids(column) if kind == "csv" else column).to_numpy(dtype=object)
    normalize_ids(raw, f"{where}, ID column {id_column!r}")  # raises, naming both rows
    raise DataValidationError(f"{where}: IDs repeat once normalised; IDs must be unique")  # pragma: no cover
