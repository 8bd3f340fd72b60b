"""The practitioner's entry points: one call from arrays, per-party blocks, per-party tables or a loaded source.

* :func:`from_tables` (and its thin wrappers :func:`from_csv`, :func:`from_parquet`): one table per party, joined on
  an ID column.  Which party holds which IDs *is* the observed matrix; the label column lives in the active
  party's table.
* :func:`from_arrays`: one feature array cut into party blocks by a splitter (``contiguous``, ``grid``,
  ``columns:...``, see :mod:`partialvfl.data.splitters`).
* :func:`from_blocks`: party blocks you have already cut.
* :func:`from_source`: a :class:`~partialvfl.data.sources.base.RawSource` (from ``load_source``) as train and test
  datasets.

Labels.  In :func:`from_tables`, and in :func:`from_arrays`/:func:`from_blocks` when ``classes`` is given or no
``task`` is, labels are class *names* as written (strings, numbers): they are mapped to indices by their position
in ``classes`` (or ``task.classes`` for tables), else in the sorted list of the labels present.  When
:func:`from_arrays`/:func:`from_blocks` get a classification ``task`` and no ``classes``, ``y`` already holds class
indices ``0..C-1`` (``-1`` or NaN = unlabelled), the convention of :class:`VerticalDataset` and of ``RawSource``.
Missing labels (NaN, None, empty string) mean "unlabelled".  Nothing is silently dropped or coerced: every problem
is an error naming the party, column or ID.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from partialvfl.data.dataset import UNLABELED, DataValidationError, Task, VerticalDataset
from partialvfl.data.sources.base import RawSource

__all__ = ["from_arrays", "from_blocks", "from_csv", "from_parquet", "from_source", "from_tables"]

TableLike = pd.DataFrame | str | Path
_CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.xz", ".csv.zip", ".csv.zst")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_CANONICAL_INT = re.compile(r"-?(0|[1-9][0-9]*)")


# ---------------------------------------------------------------------- labels
def _show(v: Any) -> str:
    return repr(v.item() if isinstance(v, np.generic) else v)


def _is_missing_label(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip() == ""
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def _plain_labels(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Labels as an object array of plain Python values; integral floats (NaN upcasts) become ints."""
    out = np.empty(len(values), dtype=object)
    vals = [v.item() if isinstance(v, np.generic) else v for v in values]
    out[:] = vals
    got = [v for v, p in zip(vals, present) if p]
    if got and all(isinstance(v, float) for v in got) and all(np.isfinite(v) and v == int(v) for v in got):
        for i in np.flatnonzero(present):
            out[i] = int(out[i])
    return out


def _encode_labels(
    values: Any, task: Task | None, classes: Sequence[Any] | None, ids: np.ndarray, where: str
) -> tuple[Task, np.ndarray, np.ndarray]:
    """Labels given as names (or regression targets) -> ``(task, y, labeled)`` in :class:`VerticalDataset` form."""
    raw = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
    if raw.ndim != 1 or raw.shape[0] != len(ids):
        raise DataValidationError(
            f"{where}: labels must be 1-D with one entry per sample ({len(ids)}), got shape {raw.shape}"
        )
    present = np.array([not _is_missing_label(v) for v in raw], dtype=bool)
    if task is not None and not task.is_classification:
        if classes is not None:
            raise DataValidationError("a regression task takes no `classes`")
        y = np.full(len(ids), np.nan)
        for i in np.flatnonzero(present):
            v = raw[i]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise DataValidationError(
                    f"{where}: regression target {_show(v)} of ID {_show(ids[i])} is not a number"
                )
            if not np.isfinite(float(v)):
                raise DataValidationError(f"{where}: regression target of ID {_show(ids[i])} is not finite")
            y[i] = float(v)
        return task, y, present
    labels = _plain_labels(raw, present)
    if classes is None and task is not None:
        classes = task.classes
    if classes is None:
        got = list({v for v in labels[present]})
        if any(isinstance(v, float) for v in got):
            bad = next(v for v in got if isinstance(v, float))
            raise DataValidationError(
                f"{where}: label {_show(bad)} is not a class (fractional number); for continuous targets pass "
                "task=Task.regression()"
            )
        try:
            classes = sorted(got)
        except TypeError:
            kinds = sorted({type(v).__name__ for v in got})
            raise DataValidationError(
                f"{where}: labels mix types ({', '.join(kinds)}) and cannot be ordered; pass `classes=[...]`"
            ) from None
        if len(classes) < 2:
            raise DataValidationError(
                f"{where}: found {len(classes)} distinct label(s) {classes!r}; a classification task needs at least 2 "
                "(pass `classes=[...]` to declare them, or task=Task.regression())"
            )
    classes = tuple(v.item() if isinstance(v, np.generic) else v for v in classes)
    out_task = Task.classification(classes)
    if task is not None and task.is_classification and tuple(task.classes) != classes:
        raise DataValidationError(f"`classes` {list(classes)} disagree with task.classes {list(task.classes)}")
    index = {c: k for k, c in enumerate(classes)}
    y = np.full(len(ids), UNLABELED, dtype=np.int64)
    for i in np.flatnonzero(present):
        v = labels[i]
        try:
            y[i] = index[v]
        except (KeyError, TypeError):
            raise DataValidationError(
                f"{where}: label {_show(v)} of ID {_show(ids[i])} is not one of the declared classes {list(classes)}"
            ) from None
    return out_task, y, present


# ---------------------------------------------------------------------- blocks and arrays
def from_blocks(
    blocks: Sequence[Any],
    y: Any = None,
    *,
    task: Task | None = None,
    classes: Sequence[Any] | None = None,
    ids: Any = None,
    observed: Any = None,
    labeled: Any = None,
    active_party: int = -1,
    party_names: Sequence[str] | None = None,
    feature_names: Sequence[Sequence[str]] | None = None,
    feature_shapes: Sequence[Sequence[int]] | None = None,
    name: str = "",
    info: Mapping[str, Any] | None = None,
) -> VerticalDataset:
    """A :class:`VerticalDataset` from per-party blocks ``(n, ...)`` over one sample order.

    ``observed`` (``(n, K)`` booleans) says which party holds which sample; values at unobserved positions are
    ignored (blanked to NaN).  Without it, a party observes a sample unless that sample's whole row of its block is
    NaN (a partly-NaN row is an error naming the ID and column).  Labels: see the module docstring.
    """
    if isinstance(blocks, np.ndarray) or not isinstance(blocks, Sequence) or not len(blocks):
        raise DataValidationError("blocks must be a non-empty list of per-party arrays")
    arrays = [np.asarray(b) for b in blocks]
    for j, b in enumerate(arrays):
        if b.ndim < 2:
            raise DataValidationError(f"party {j}: block must have a sample axis and features, got shape {b.shape}")
        if b.dtype.kind not in "biuf":
            raise DataValidationError(f"party {j}: features must be numeric, got dtype {b.dtype}")
    n = arrays[0].shape[0]
    for j, b in enumerate(arrays):
        if b.shape[0] != n:
            raise DataValidationError(f"party {j} has {b.shape[0]} rows but party 0 has {n}")
    shapes = [tuple(int(s) for s in b.shape[1:]) for b in arrays] if feature_shapes is None else feature_shapes
    flat = [b.reshape(n, -1).astype(np.float32) for b in arrays]
    if observed is None:
        obs = np.stack([~np.all(np.isnan(b), axis=1) for b in flat], axis=1)
    else:
        obs = np.asarray(observed)
        if obs.shape != (n, len(flat)):
            raise DataValidationError(
                f"observed must have shape ({n}, {len(flat)}) (samples x parties), got {obs.shape}"
            )
        if obs.dtype != bool:
            if not np.all(np.isin(obs, (0, 1))):
                raise DataValidationError("observed must be boolean (or 0/1)")
            obs = obs.astype(bool)
        for j, b in enumerate(flat):
            b[~obs[:, j]] = np.nan
    id_arr = np.arange(n) if ids is None else np.asarray(ids)
    if id_arr.shape != (n,):
        raise DataValidationError(f"ids must be a 1-D sequence of length {n}, got shape {id_arr.shape}")
    y_arr, lab = y, labeled
    if y is not None and (classes is not None or task is None):
        if labeled is not None:
            raise DataValidationError("give `labeled` only with class indices (a `task` and no `classes`)")
        task, y_arr, lab = _encode_labels(y, task, classes, id_arr, "labels")
    elif y is None and task is None and classes is not None:
        task = Task.classification(classes)
    return VerticalDataset(
        blocks=flat,
        observed=obs,
        ids=id_arr,
        y=y_arr,
        labeled=lab,
        task=task,
        active_party=active_party,
        feature_names=feature_names,
        party_names=party_names,
        feature_shapes=shapes,
        name=name,
        info=dict(info or {}),
    )


def from_arrays(
    X: Any,
    y: Any = None,
    *,
    task: Task | None = None,
    classes: Sequence[Any] | None = None,
    splitter: Any = None,
    n_parties: int | None = None,
    ids: Any = None,
    observed: Any = None,
    labeled: Any = None,
    active_party: int = -1,
    party_names: Sequence[str] | None = None,
    feature_names: Sequence[str] | None = None,
    name: str = "",
    info: Mapping[str, Any] | None = None,
) -> VerticalDataset:
    """Cut ``X`` (``(n, d)`` or images ``(n, ...)``) into ``n_parties`` blocks and build the dataset in one call.

    ``splitter`` defaults to ``"contiguous"`` for 2-D ``X`` and ``"grid"`` for images; a ``columns:...`` splitter
    implies ``n_parties``.  ``feature_names`` name the flattened columns of ``X``.  ``observed``, labels, ids: as
    :func:`from_blocks`.
    """
    from partialvfl.data.splitters import parse_splitter, split_source_array

    X = np.asarray(X)
    if X.ndim < 2:
        raise DataValidationError(f"X must be (samples, features...) with at least 2 dimensions, got shape {X.shape}")
    if splitter is None:
        splitter = "grid" if X.ndim >= 3 else "contiguous"
    parsed = parse_splitter(splitter)
    if n_parties is None:
        groups = getattr(parsed, "column_groups", None)
        if groups is None:
            raise DataValidationError(f"say how many parties to cut X into: n_parties=... (splitter {parsed.name!r})")
        n_parties = len(groups)
    blocks, names, shapes = split_source_array(X, parsed, int(n_parties), feature_names)
    return from_blocks(
        blocks,
        y,
        task=task,
        classes=classes,
        ids=ids,
        observed=observed,
        labeled=labeled,
        active_party=active_party,
        party_names=party_names,
        feature_names=names,
        feature_shapes=shapes,
        name=name,
        info={"splitter": parsed.name, **dict(info or {})},
    )


def from_source(
    source: RawSource,
    *,
    splitter: Any = None,
    n_parties: int | None = None,
    active_party: int = -1,
    party_names: Sequence[str] | None = None,
) -> tuple[VerticalDataset, VerticalDataset | None]:
    """A loaded dataset as ``(train, test)`` (``test`` is None without an official test split), both fully observed.

    The default splitter follows ``source.kind`` (``grid`` for images, ``contiguous`` otherwise); ``n_parties``
    defaults to the source's own party count when it has one (``synthetic``).
    """
    if splitter is None:
        splitter = "grid" if source.kind == "image" else "contiguous"
    if n_parties is None:
        n_parties = source.extra.get("n_parties")
        if n_parties is None:
            raise DataValidationError(f"say how many parties to cut {source.name!r} into: n_parties=...")
    out = []
    for part, X, y in (("train", source.X_train, source.y_train), ("test", source.X_test, source.y_test)):
        if X is None:
            out.append(None)
            continue
        out.append(
            from_arrays(
                X,
                y,
                task=source.task,
                splitter=splitter,
                n_parties=n_parties,
                active_party=active_party,
                party_names=party_names,
                feature_names=source.feature_names,
                name=f"{source.name}:{part}",
                info={"source": source.name, "origin": source.origin, "part": part},
            )
        )
    return out[0], out[1]


# ---------------------------------------------------------------------- tables
def _read_table(party: str, table: TableLike, id_column: str, fmt: str | None) -> tuple[pd.DataFrame, str]:
    """A party's table as a DataFrame, plus where it came from; CSV IDs are read as text (see :func:`from_tables`)."""
    if isinstance(table, pd.DataFrame):
        return table, "DataFrame"
    if not isinstance(table, (str, Path)):
        raise DataValidationError(
            f"party {party!r}: expected a pandas DataFrame or a CSV/Parquet path, got {type(table).__name__}"
        )
    path = Path(table).expanduser()
    lower = path.name.lower()
    kind = fmt or ("csv" if lower.endswith(_CSV_SUFFIXES) else "parquet" if lower.endswith(_PARQUET_SUFFIXES) else None)
    if kind is None:
        raise DataValidationError(
            f"party {party!r}: cannot tell the format of {path} from its name; use a .csv or .parquet file "
            "(or from_csv / from_parquet)"
        )
    if not path.is_file():
        raise FileNotFoundError(f"party {party!r}: table file {path} not found")
    if kind == "parquet":
        return pd.read_parquet(path), str(path)
    df = pd.read_csv(path, dtype={id_column: str})
    if id_column in df.columns:
        ids = df[id_column]
        text = ids[ids.notna()].astype(str)
        if len(text) and text.map(lambda s: bool(_CANONICAL_INT.fullmatch(s))).all() and ids.notna().all():
            df[id_column] = text.astype(np.int64)
    return df, str(path)


def _id_kind(party: str, id_column: str, ids: pd.Series) -> tuple[str, np.ndarray]:
    """``("int" | "str" | "float", values)`` of a party's ID column; other or mixed types are an error."""
    if pd.api.types.is_bool_dtype(ids.dtype):
        raise DataValidationError(f"party {party!r}: ID column {id_column!r} is boolean; use integers or strings")
    if pd.api.types.is_integer_dtype(ids.dtype):
        return "int", ids.to_numpy(dtype=np.int64)
    if pd.api.types.is_float_dtype(ids.dtype):
        return "float", ids.to_numpy(dtype=np.float64)
    values = ids.to_numpy(dtype=object)
    kinds = {"str" if isinstance(v, str) else "int" if isinstance(v, (int, np.integer)) and not isinstance(
        v, (bool, np.bool_)) else type(v).__name__ for v in values}
    if len(kinds) > 1:
        raise DataValidationError(
            f"party {party!r}: ID column {id_column!r} mixes types ({', '.join(sorted(kinds))}); use one type"
        )
    kind = kinds.pop() if kinds else "str"
    if kind == "int":
        return "int", values.astype(np.int64)
    if kind != "str":
        raise DataValidationError(
            f"party {party!r}: ID column {id_column!r} holds {kind} values; use integers or strings"
        )
    return "str", values


def _party_features(
    party: str, df: pd.DataFrame, id_column: str, label_column: str, columns: Sequence[str] | None
) -> list[str]:
    if columns is None:
        cols = [c for c in df.columns if c not in (id_column, label_column)]
    else:
        cols = list(columns)
        for c in cols:
            if c in (id_column, label_column):
                raise DataValidationError(
                    f"party {party!r}: {c!r} is the {'ID' if c == id_column else 'label'} column, not a feature"
                )
            if c not in df.columns:
                raise DataValidationError(
                    f"party {party!r}: feature column {c!r} not found; its columns: {[str(x) for x in df.columns]}"
                )
        if len(set(cols)) != len(cols):
            raise DataValidationError(f"party {party!r}: a feature column is listed twice in {cols}")
    if not cols:
        raise DataValidationError(
            f"party {party!r} has no feature columns (only {[str(x) for x in df.columns]}); every party must hold "
            "at least one feature"
        )
    for c in cols:
        dtype = df[c].dtype
        numeric = pd.api.types.is_bool_dtype(dtype) or (
            pd.api.types.is_numeric_dtype(dtype) and not pd.api.types.is_complex_dtype(dtype)
        )
        if not numeric and len(df):
            raise DataValidationError(
                f"party {party!r}: feature column {c!r} is not numeric (dtype {dtype}); encode it as numbers first, "
                f"e.g. pandas.get_dummies(table, columns=[{c!r}]) for categories, or convert text numbers with "
                "pandas.to_numeric"
            )
    return [str(c) for c in cols]


def from_tables(
    tables: Mapping[str, TableLike],
    *,
    id_column: str,
    label_column: str,
    active_party: str | int,
    task: Task | None = None,
    classes: Sequence[Any] | None = None,
    feature_columns: Mapping[str, Sequence[str]] | None = None,
    name: str = "",
    _format: str | None = None,
) -> VerticalDataset:
    """One table per party (a DataFrame, or a ``.csv``/``.parquet`` path), outer-joined on ``id_column``.

    * A party observes exactly the IDs in its table; the samples are the union of all IDs, in sorted order.
    * ``label_column`` must be in the active party's table and in no other; IDs it lacks, or whose label is empty
      or NaN, are unlabelled.  Class names map to indices in sorted order unless ``classes`` (or the ``task``'s
      classes) are given; ``task=Task.regression()`` for numeric targets.
    * Features: every other column of a table (or ``feature_columns[party]``); they must be numeric (bool counts as
      0/1) and finite in every held row.  Feature names are ``"<party>:<column>"``, so parties may share column
      names.
    * IDs keep their type (integers or strings; all tables must agree).  From CSV, an ID column is read as text and
      becomes integers only if every entry is a plain integer (``"007"`` stays the string ``"007"``).  In CSV label
      and feature columns, empty cells and pandas' standard NA markers are missing values.
    """
    if not isinstance(tables, Mapping) or not tables:
        raise DataValidationError("tables must be a non-empty mapping {party name: DataFrame or path}")
    parties = [str(p) for p in tables]
    if isinstance(active_party, (int, np.integer)) and not isinstance(active_party, bool):
        if not -len(parties) <= int(active_party) < len(parties):
            raise DataValidationError(f"active_party {active_party} is out of range for {len(parties)} parties")
        active = parties[int(active_party)]
    else:
        active = str(active_party)
        if active not in parties:
            raise DataValidationError(f"active_party {active_party!r} is not one of the parties {parties}")
    if feature_columns is not None:
        unknown = [p for p in feature_columns if str(p) not in parties]
        if unknown:
            raise DataValidationError(f"feature_columns names unknown parties {unknown}; parties: {parties}")

    frames: dict[str, pd.DataFrame] = {}
    origins: dict[str, str] = {}
    id_values: dict[str, np.ndarray] = {}
    id_kinds: dict[str, str] = {}
    features: dict[str, list[str]] = {}
    for key, party in zip(tables, parties):
        df, origin = _read_table(party, tables[key], id_column, _format)
        if id_column not in df.columns:
            raise DataValidationError(
                f"party {party!r}: ID column {id_column!r} not found; its columns: {[str(c) for c in df.columns]}"
            )
        has_label = label_column in df.columns
        if party == active and not has_label:
            raise DataValidationError(
                f"active party {party!r}: label column {label_column!r} not found; its columns: "
                f"{[str(c) for c in df.columns]}"
            )
        if party != active and has_label:
            raise DataValidationError(
                f"party {party!r} has the label column {label_column!r}, but labels live only in the active party "
                f"{active!r}'s table: drop the column there or make {party!r} the active party"
            )
        ids = df[id_column]
        if ids.isna().any():
            row = int(np.flatnonzero(ids.isna().to_numpy())[0])
            raise DataValidationError(f"party {party!r}: ID column {id_column!r} is empty at row {row}")
        kind, values = _id_kind(party, id_column, ids)
        uniq, counts = np.unique(values, return_counts=True)
        if (counts > 1).any():
            dup = uniq[counts > 1][0]
            rows = np.flatnonzero(values == dup)[:3].tolist()
            raise DataValidationError(f"party {party!r}: duplicate ID {_show(dup)} at rows {rows}; IDs must be unique")
        cols = None if feature_columns is None else feature_columns.get(key, feature_columns.get(party))
        features[party] = _party_features(party, df, id_column, label_column, cols)
        frames[party], origins[party], id_values[party], id_kinds[party] = df, origin, values, kind

    kinds = set(id_kinds.values())
    if len(kinds) > 1:
        a = parties[0]
        b = next(p for p in parties if id_kinds[p] != id_kinds[a])
        raise DataValidationError(
            f"ID column {id_column!r} holds {id_kinds[a]} IDs in party {a!r} but {id_kinds[b]} IDs in party {b!r}; "
            "IDs must have one type to be joined (convert one side, e.g. table[id].astype(str))"
        )
    all_ids = np.concatenate([id_values[p] for p in parties])
    if kinds == {"str"}:
        union = np.asarray(sorted(set(all_ids.tolist())), dtype=str)
        lookup = pd.Index(union.astype(object))
    else:
        union = np.unique(all_ids)
        lookup = pd.Index(union)
    n = len(union)

    blocks, observed, names = [], np.zeros((n, len(parties)), dtype=bool), []
    for j, party in enumerate(parties):
        df, cols = frames[party], features[party]
        pos = lookup.get_indexer(id_values[party])
        values = df[cols].to_numpy(dtype=np.float64, na_value=np.nan) if len(df) else np.zeros((0, len(cols)))
        bad = ~np.isfinite(values)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            what = "missing (NaN)" if np.isnan(values[r, c]) else "infinite"
            raise DataValidationError(
                f"party {party!r}, column {cols[c]!r}: value is {what} for ID {_show(id_values[party][r])}; a party "
                "that holds an ID must give every feature (drop the row if it does not hold that ID)"
            )
        block = np.full((n, len(cols)), np.nan, dtype=np.float32)
        block[pos] = values
        blocks.append(block)
        observed[pos, j] = True
        names.append(tuple(f"{party}:{c}" for c in cols))

    act = parties.index(active)
    labels = np.full(n, np.nan, dtype=object)
    label_col = frames[active][label_column].to_numpy(dtype=object)
    labels[lookup.get_indexer(id_values[active])] = label_col
    out_task, y, labeled = _encode_labels(labels, task, classes, union, f"active party {active!r}, column "
                                          f"{label_column!r}")
    return VerticalDataset(
        blocks=blocks,
        observed=observed,
        ids=union,
        y=y,
        labeled=labeled,
        task=out_task,
        active_party=act,
        feature_names=names,
        party_names=parties,
        name=name,
        info={"id_column": id_column, "label_column": label_column, "tables": origins},
    )


def from_csv(paths: Mapping[str, str | Path], **kwargs: Any) -> VerticalDataset:
    """:func:`from_tables` reading every path as CSV whatever its suffix."""
    return from_tables(paths, _format="csv", **kwargs)


def from_parquet(paths: Mapping[str, str | Path], **kwargs: Any) -> VerticalDataset:
    """:func:`from_tables` reading every path as Parquet whatever its suffix."""
    return from_tables(paths, _format="parquet", **kwargs)
