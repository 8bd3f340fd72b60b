"""Labels as users write them (class names, numbers, gaps) -> the class indices of :class:`VerticalDataset`.

One function, :func:`encode_labels`, serves every reader of labels: the builders (:func:`from_tables`,
:func:`from_blocks`) and a federation's label table (:func:`partialvfl.federation.grpc.federation_file.read_labels`), so
the same file gives the same classes in one process and across a federation.

* Missing labels (NaN, None, empty text) mean "unlabelled".
* Numbers that are all integral stay integers (``3.0``, which is how an integer column with gaps comes back from
  pandas, is the class ``3``); a fractional number is refused as a class (pass a regression task instead).
* Classes are the given ``classes`` (or the task's), else the sorted distinct labels present.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from partialvfl.data.checks import show_id
from partialvfl.data.dataset import UNLABELED, DataValidationError, Task

__all__ = ["encode_labels", "is_missing_label", "plain_labels"]


def is_missing_label(v: Any) -> bool:
    """Whether a label cell is missing (NaN, None, or blank text)."""
    if isinstance(v, str):
        return v.strip() == ""
    try:
        return bool(pd.isna(v))
    except (TypeError, ValueError):
        return False


def plain_labels(values: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Labels as an object array of plain Python values; integral floats (NaN upcasts) become ints."""
    out = np.empty(len(values), dtype=object)
    vals = [v.item() if isinstance(v, np.generic) else v for v in values]
    out[:] = vals
    got = [v for v, p in zip(vals, present) if p]
    if got and all(isinstance(v, float) for v in got) and all(np.isfinite(v) and v == int(v) for v in got):
        for i in np.flatnonzero(present):
            out[i] = int(out[i])
    return out


def encode_labels(
    values: Any, task: Task | None, classes: Sequence[Any] | None, ids: np.ndarray, where: str
) -> tuple[Task, np.ndarray, np.ndarray]:
    """Labels given as names (or regression targets) -> ``(task, y, labeled)`` in :class:`VerticalDataset` form."""
    raw = np.asarray(values, dtype=object) if not isinstance(values, np.ndarray) else values
    if raw.ndim != 1 or raw.shape[0] != len(ids):
        raise DataValidationError(
            f"{where}: labels must be 1-D with one entry per sample ({len(ids)}), got shape {raw.shape}"
        )
    present = np.array([not is_missing_label(v) for v in raw], dtype=bool)
    if task is not None and not task.is_classification:
        if classes is not None:
            raise DataValidationError("a regression task takes no `classes`")
        y = np.full(len(ids), np.nan)
        for i in np.flatnonzero(present):
            v = raw[i]
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
                raise DataValidationError(
                    f"{where}: regression target {show_id(v)} of ID {show_id(ids[i])} is not a number"
                )
            if not np.isfinite(float(v)):
                raise DataValidationError(f"{where}: regression target of ID {show_id(ids[i])} is not finite")
            y[i] = float(v)
        return task, y, present
    labels = plain_labels(raw, present)
    if classes is None and task is not None:
        classes = task.classes
    if classes is None:
        got = list({v for v in labels[present]})
        if any(isinstance(v, float) for v in got):
            bad = next(v for v in got if isinstance(v, float))
            raise DataValidationError(
                f"{where}: label {show_id(bad)} is not a class (fractional number); for continuous targets pass "
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
                f"{where}: label {show_id(v)} of ID {show_id(ids[i])} is not one of the declared classes "
                f"{list(classes)}"
            ) from None
    return out_task, y, present


