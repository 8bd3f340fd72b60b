"""Per-party tables (CSV, Parquet, DataFrames) keyed by an ID column: reading, checking, joining.

The one reader of tables: :func:`from_tables` (all parties in one process) and, in a deployment, the party server
(its own table, :class:`~partialvfl.federation.grpc.party_tables.PartyTable`) and the coordinator's label table use the
same functions here, so a table gives the same IDs, columns and values whichever way it is read:

* :func:`read_table`: a DataFrame from a path (CSV IDs read as text; see :func:`from_tables`);
* :func:`table_ids`: the ID column, normalised by the rule of :mod:`partialvfl.data.ids` (empty and colliding IDs
  refused, naming them);
* :func:`select_features` / :func:`feature_values`: the numeric feature columns (a categorical or text column is
  refused, naming it: one-hot encode it first) and their float32 values (a missing or infinite value inside a
  held row is refused, naming the column and the ID).
"""

from __future__ import annotations

import importlib
import re
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from partialvfl.data.dataset import DataValidationError, Task, VerticalDataset
from partialvfl.data.ids import normalize_ids, sample_order, show_id
from partialvfl.data.labels import encode_labels

__all__ = ["MAX_EXPANSION", "MissingLabelColumn", "TableLike", "check_table_file", "columns_hint", "csv_ids",
           "feature_values",
           "from_csv", "from_parquet", "from_tables", "read_table", "select_features", "table_format", "table_ids"]

TableLike = pd.DataFrame | str | Path
_CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.xz", ".csv.zip", ".csv.zst")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def columns_hint(df: pd.DataFrame, limit: int = 12) -> str:
    """A table's columns for an error message (the first ``limit`` of them and the count)."""
    cols = [str(c) for c in df.columns]
    if len(cols) <= limit:
        return f"its columns: {cols}"
    return f"its {len(cols)} columns begin {cols[:limit]}"


def table_format(path: str | Path) -> str | None:
    """``"csv"`` or ``"parquet"`` as a table file's name says (``.csv`` and compressed ``.csv.gz`` etc., ``.parquet``,
    ``.pq``; any case), ``None`` when the name says neither.  The one suffix rule for every reader of table files."""
    lower = Path(path).name.lower()
    return "csv" if lower.endswith(_CSV_SUFFIXES) else "parquet" if lower.endswith(_PARQUET_SUFFIXES) else None


def read_table(where: str, table: TableLike, id_column: str, fmt: str | None = None) -> tuple[pd.DataFrame, str]:
    """A table as a DataFrame, plus where it came from.

    From CSV the ID column is read as text and becomes integers only if every entry is a plain integer (``"007"``
    stays the text ``"007"``); from Parquet or a DataFrame it keeps its type.  ``where`` names the table's owner in
    errors (e.g. ``"party 'bank'"``).
    """
    if isinstance(table, pd.DataFrame):
        return table, "DataFrame"
    if not isinstance(table, (str, Path)):
        raise DataValidationError(f"{where}: expected a pandas DataFrame or a CSV/Parquet path, got "
                                  f"{type(table).__name__}")
    path = Path(table).expanduser()
    kind = fmt or table_format(path)
    if kind is None:
        raise DataValidationError(f"{where}: cannot tell the format of {path} from its name; name it .csv (or "
                                  ".csv.gz, ...) or .parquet (or .pq), or read it with from_csv / from_parquet")
    if not path.is_file():
        raise FileNotFoundError(f"{where}: table file {path} not found")
    check_table_file(where, path, kind)
    try:
        df = pd.read_parquet(path) if kind == "parquet" else pd.read_csv(path, dtype={id_column: str})
    except Exception as e:  # whatever the reader says, the message names the file
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataValidationError(f"{where}: cannot read {path} as {kind.upper() if kind == 'csv' else 'Parquet'} "
                                  f"({type(e).__name__}: {detail[:200]})") from None
    if kind == "parquet":
        return df, str(path)
    if id_column in df.columns:
        df[id_column] = csv_ids(df[id_column])
    return df, str(path)


def csv_ids(ids: pd.Series) -> pd.Series:
    """A CSV table's ID column (read as text) as :func:`read_table` keeps it: integers if every entry is a plain
    integer (``"007"`` stays the text ``"007"``), else the text."""
    text = ids[ids.notna()].astype(str)
    if len(text) and ids.notna().all() and text.map(lambda s: bool(_CANONICAL_INT.fullmatch(s))).all():
        return text.astype(np.int64)
    return ids


#: a compressed CSV may expand to at most this many times its size (or MIN_DECOMPRESSED_LIMIT, if larger): beyond
#: that it is refused before it is parsed, so that a small "compression bomb" cannot exhaust memory
MAX_EXPANSION = 100
MIN_DECOMPRESSED_LIMIT = 64 << 20
_OPENERS = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstandard"}


def _decompressed(path: Path, limit: int) -> int:
    """How many bytes ``path`` decompresses to, counting at most ``limit + 1`` (constant memory)."""
    suffix = path.suffix.lower()
    if suffix == ".zip":
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            stream: Any = zf.open(names[0]) if len(names) == 1 else None
            if stream is None:
                raise DataValidationError(f"{path} holds {len(names)} files; a zipped table holds one")
            return _count(stream, limit)
    if suffix == ".zst":
        import zstandard  # pandas needs it for .zst too

        with path.open("rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as stream:
            return _count(stream, limit)
    with importlib.import_module(_OPENERS[suffix]).open(path, "rb") as stream:
        return _count(stream, limit)


def _count(stream: Any, limit: int) -> int:
    total = 0
    while total <= limit:
        block = stream.read(1 << 20)
        if not block:
            break
        total += len(block)
    return total


def check_table_file(where: str, path: Path, kind: str) -> None:
    """Refuse, naming the file, what no reader should parse: an empty file, a Parquet file named .csv (or the
    reverse), a compressed CSV that expands beyond ``max(MAX_EXPANSION x its size, MIN_DECOMPRESSED_LIMIT)``."""
    size = path.stat().st_size
    if size == 0:
        raise DataValidationError(f"{where}: {path} is empty (0 bytes)")
    with path.open("rb") as f:
        head = f.read(4)
    if kind == "csv" and head == b"PAR1":
        raise DataValidationError(f"{where}: {path} is a Parquet file: name it .parquet (or .pq)")
    if kind == "parquet" and head != b"PAR1":
        raise DataValidationError(f"{where}: {path} is not a Parquet file (it does not start with PAR1); a CSV "
                                  "table must be named .csv")
    if kind == "csv" and path.suffix.lower() in (*_OPENERS, ".zip"):
        limit = max(MAX_EXPANSION * size, MIN_DECOMPRESSED_LIMIT)
        try:
            total = _decompressed(path, limit)
        except DataValidationError as e:
            raise DataValidationError(f"{where}: {e}") from None
        except Exception as e:  # a broken archive: name it
            raise DataValidationError(f"{where}: cannot decompress {path} ({type(e).__name__}: {e})") from None
        if total > limit:
            raise DataValidationError(f"{where}: {path} decompresses to more than {limit / 2**20:.0f} MB "
                                      f"({MAX_EXPANSION} times its {size / 2**20:.2f} MB): refused as a "
                                      "compression bomb; decompress it yourself if it is a real table")


def table_ids(where: str, df: pd.DataFrame, id_column: str) -> tuple[list[str], bool]:
    """The normalised IDs of a table, and whether they are all integers (so a dataset can keep them as numbers)."""
    if id_column not in df.columns:
        raise DataValidationError(f"{where}: ID column {id_column!r} not found; {columns_hint(df)}")
    col = df[id_column]
    texts = normalize_ids(col.to_numpy(dtype=object), f"{where}, ID column {id_column!r}")
    integral = pd.api.types.is_integer_dtype(col.dtype) and not pd.api.types.is_bool_dtype(col.dtype)
    if pd.api.types.is_float_dtype(col.dtype):
        integral = bool(np.all(np.mod(col.to_numpy(), 1) == 0))
    return texts, integral or (len(texts) == 0)


def select_features(where: str, df: pd.DataFrame, *, id_column: str, label_column: str | None = None,
                    columns: Sequence[str] | None = None, exclude: Sequence[str] = ()) -> list[str]:
    """The feature columns of a table: ``columns`` if given, else every column but the ID, label and ``exclude``.

    Every named column must exist, be listed once and be numeric (bool counts as 0/1).
    """
    for c in exclude:
        if c not in df.columns:
            raise DataValidationError(f"{where}: excluded column {c!r} not found; {columns_hint(df)}")
    reserved = {id_column: "ID", **({label_column: "label"} if label_column is not None else {})}
    if columns is None:
        cols = [c for c in df.columns if c not in reserved and c not in exclude]
    else:
        cols = list(columns)
        for c in cols:
            if c in reserved:
                raise DataValidationError(f"{where}: {c!r} is the {reserved[c]} column, not a feature")
            if c not in df.columns:
                raise DataValidationError(f"{where}: feature column {c!r} not found; {columns_hint(df)}")
        if len(set(cols)) != len(cols):
            raise DataValidationError(f"{where}: a feature column is listed twice in {cols}")
    if not cols:
        raise DataValidationError(f"{where} has no feature columns ({columns_hint(df)}); every party must hold at "
                                  "least one feature")
    for c in cols:
        dtype = df[c].dtype
        numeric = pd.api.types.is_bool_dtype(dtype) or (
            pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_complex_dtype(dtype))
        if not numeric and len(df):
            raise DataValidationError(
                f"{where}: feature column {c!r} is not numeric (dtype {dtype}); partialvfl does not guess an "
                f"encoding: one-hot encode categories first (pandas.get_dummies(table, columns=[{c!r}])) or convert "
                "text numbers with pandas.to_numeric")
    return [str(c) for c in cols]


def feature_values(where: str, df: pd.DataFrame, cols: Sequence[str], ids: Sequence[Any]) -> np.ndarray:
    """The ``(rows, len(cols))`` float32 values; a missing, infinite or float32-overflowing value is an error
    naming the column and the ID (a party that holds an ID gives every feature of it)."""
    if not len(df):
        return np.zeros((0, len(cols)), dtype=np.float32)
    values = df[list(cols)].to_numpy(dtype=np.float64, na_value=np.nan)
    bad = ~np.isfinite(values) | (np.abs(values) > _FLOAT32_MAX)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        v = values[r, c]
        what = ("missing (NaN)" if np.isnan(v) else "infinite" if np.isinf(v) else
                f"{v:g}, beyond the float32 range (+-{_FLOAT32_MAX:.3g}); rescale the column")
        raise DataValidationError(
            f"{where}, column {cols[c]!r}: value is {what} for ID {show_id(ids[r])}; a party that holds an ID must "
            "give every feature of it (fill the value, or drop the row if the party does not hold that ID)")
    return values.astype(np.float32)


def _active_name(parties: list[str], active_party: str | int | None, label_column: str | None) -> str:
    if active_party is None:
        if label_column is not None:
            raise DataValidationError("say which party holds the labels: active_party=NAME")
        return parties[-1]
    if isinstance(active_party, (int, np.integer)) and not isinstance(active_party, bool):
        if not -len(parties) <= int(active_party) < len(parties):
            raise DataValidationError(f"active_party {active_party} is out of range for {len(parties)} parties")
        return parties[int(active_party)]
    if str(active_party) not in parties:
        raise DataValidationError(f"active_party {active_party!r} is not one of the parties {parties}")
    return str(active_party)


class MissingLabelColumn(DataValidationError):
    """The active party's table lacks the label column (a table of users to predict needs none)."""

    def __init__(self, party: str, column: str, hint: str) -> None:
        super().__init__(f"active party {party!r}: label column {column!r} not found; {hint} (tables for "
                         "prediction need no label: leave label_column out)")
        self.party, self.column, self.hint = party, column, hint


def _check_label_column(party: str, active: str, df: pd.DataFrame, label_column: str | None) -> None:
    if label_column is None:
        return
    has = label_column in df.columns
    if party == active and not has:
        raise MissingLabelColumn(party, label_column, columns_hint(df))
    if party != active and has:
        raise DataValidationError(
            f"party {party!r} has the label column {label_column!r}, but labels live only in the active party "
            f"{active!r}'s table: drop the column there or make {party!r} the active party")


def from_tables(
    tables: Mapping[str, TableLike],
    *,
    id_column: str,
    label_column: str | None = None,
    active_party: str | int | None = None,
    task: Task | None = None,
    classes: Sequence[Any] | None = None,
    feature_columns: Mapping[str, Sequence[str]] | None = None,
    order_key: bytes | str | Path | None = None,
    name: str = "",
    _format: str | None = None,
    _columns: dict[str, list[Any]] | None = None,
) -> VerticalDataset:
    """One table per party (a DataFrame, or a ``.csv``/``.parquet`` path), outer-joined on ``id_column``.

    * A party observes exactly the IDs in its table.  IDs are joined by the rule of :mod:`partialvfl.data.ids`
      (as text, white space stripped; ``7`` and ``"7"`` are one user, ``"007"`` another); empty IDs and IDs that
      collide once normalised are refused.  They stay integers when every table's IDs are integers, else text.
    * The samples are the union of all IDs in the **canonical order**: sorted by ``HMAC-SHA256(key, ID)`` with
      ``order_key`` (the federation's HMAC key, as bytes or a key file) or, without it, the public default key
      (:data:`partialvfl.data.ids.DEFAULT_ORDER_KEY`), the order a federation builds from keyed hashes; so the same
      tables and seed give the same model in one process and across a federation.
    * ``label_column`` lives in the active party's table and in no other; IDs it lacks, or whose label is empty or
      NaN, are unlabelled.  Without ``label_column`` (tables of new users to predict) the dataset has no labels and
      no task unless ``task``/``classes`` say one; ``active_party`` then defaults to the last party.  Class names map
      to indices in sorted order unless ``classes`` (or the ``task``'s classes) are given;
      ``task=Task.regression()`` for numeric targets.
    * Features: every other column (or ``feature_columns[party]``); numeric only (bool as 0/1; a text or
      categorical column is refused, naming it) and finite in every held row.  Feature names are
      ``"<party>:<column>"``, so parties may share column names.

    ``_columns`` (a dict, filled in): every party's table columns as read, so a caller can name the columns it
    ignores without reading the tables again.
    """
    if not isinstance(tables, Mapping) or not tables:
        raise DataValidationError("tables must be a non-empty mapping {party name: DataFrame or path}")
    parties = [str(p) for p in tables]
    active = _active_name(parties, active_party, label_column)
    if feature_columns is not None:
        unknown = [p for p in feature_columns if str(p) not in parties]
        if unknown:
            raise DataValidationError(f"feature_columns names unknown parties {unknown}; parties: {parties}")

    frames, origins, keys, features = {}, {}, {}, {}
    integral = True
    for key, party in zip(tables, parties):
        where = f"party {party!r}"
        df, origins[party] = read_table(where, tables[key], id_column, _format)
        if label_column is not None and not len(df):  # a training table: every party holds some users
            raise DataValidationError(f"{where}: table {origins[party]} has no rows")
        keys[party], whole = table_ids(where, df, id_column)
        integral = integral and whole
        _check_label_column(party, active, df, label_column)
        cols = None if feature_columns is None else feature_columns.get(key, feature_columns.get(party))
        features[party] = select_features(where, df, id_column=id_column, label_column=label_column, columns=cols)
        frames[party] = df
        if _columns is not None:
            _columns[party] = list(df.columns)

    union = list(set().union(*(keys[p] for p in parties)))
    union = [union[i] for i in sample_order(union, order_key, normalized=True)]  # table_ids normalised them
    lookup = pd.Index(union)
    n = len(union)
    blocks, observed, names = [], np.zeros((n, len(parties)), dtype=bool), []
    for j, party in enumerate(parties):
        pos = lookup.get_indexer(keys[party])
        block = np.full((n, len(features[party])), np.nan, dtype=np.float32)
        block[pos] = feature_values(f"party {party!r}", frames[party], features[party], keys[party])
        blocks.append(block)
        observed[pos, j] = True
        names.append(tuple(f"{party}:{c}" for c in features[party]))
    ids = np.array([int(t) for t in union], dtype=np.int64) if integral else np.array(union, dtype=str)

    y = labeled = None
    out_task = task if task is not None or classes is None else Task.classification(classes)
    if label_column is not None:
        labels = np.full(n, np.nan, dtype=object)
        labels[lookup.get_indexer(keys[active])] = frames[active][label_column].to_numpy(dtype=object)
        out_task, y, labeled = encode_labels(labels, task, classes, ids,
                                             f"active party {active!r}, column {label_column!r}")
    info = {"id_column": id_column, "label_column": label_column, "tables": origins,
            "order": "canonical (keyed hash)" + (" with the given key" if order_key is not None else "")}
    return VerticalDataset(blocks=blocks, observed=observed, ids=ids, y=y, labeled=labeled, task=out_task,
                           active_party=parties.index(active), feature_names=names, party_names=parties, name=name,
                           info=info)


def from_csv(paths: Mapping[str, str | Path], **kwargs: Any) -> VerticalDataset:
    """:func:`from_tables` reading every path as CSV whatever its suffix."""
    return from_tables(paths, _format="csv", **kwargs)


def from_parquet(paths: Mapping[str, str | Path], **kwargs: Any) -> VerticalDataset:
    """:func:`from_tables` reading every path as Parquet whatever its suffix."""
    return from_tables(paths, _format="parquet", **kwargs)
