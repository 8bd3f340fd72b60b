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

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from partialvfl.data.dataset import DataValidationError, Task, VerticalDataset
from partialvfl.data.labels import encode_labels
from partialvfl.data.sources.base import RawSource
from partialvfl.data.tables import from_csv, from_parquet, from_tables

__all__ = ["from_arrays", "from_blocks", "from_csv", "from_parquet", "from_source", "from_tables"]


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
        task, y_arr, lab = encode_labels(y, task, classes, id_arr, "labels")
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
