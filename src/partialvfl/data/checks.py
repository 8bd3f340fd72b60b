"""Validation of a :class:`~partialvfl.data.dataset.VerticalDataset`'s arrays: every error names the party, the
column or the ID at fault (kept apart from the data model so that it reads as the list of rules it is)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["UNLABELED", "DataValidationError", "check_block_values", "check_labels", "check_unique_ids", "show_id"]

#: the label of an unlabelled sample in a classification dataset (class indices are 0..C-1)
UNLABELED = -1


class DataValidationError(ValueError):
    """Raised when data handed to partialvfl is malformed; the message names the party, column or ID at fault."""


def show_id(v: Any) -> str:
    """An ID or label as the user wrote it (no numpy scalar noise)."""
    return repr(v.item() if isinstance(v, np.generic) else v)


def check_unique_ids(ids: np.ndarray) -> None:
    """Refuse duplicate sample IDs, naming the first duplicate and its rows."""
    uniq, first, counts = np.unique(ids, return_index=True, return_counts=True)
    if len(uniq) != len(ids):
        dup = uniq[counts > 1][0]
        where = np.flatnonzero(ids == dup)[:3].tolist()
        raise DataValidationError(f"duplicate sample ID {show_id(dup)} at rows {where}: IDs must be unique")


def check_block_values(
    block: np.ndarray, obs: np.ndarray, j: int, pname: str, fnames: Sequence[str], ids: np.ndarray
) -> None:
    """Refuse a non-finite observed value of party ``j``'s block, naming the party, feature and ID."""
    seen = block[obs]
    if seen.size and not np.all(np.isfinite(seen)):
        bad = ~np.isfinite(seen)
        r, c = np.argwhere(bad)[0]
        row = np.flatnonzero(obs)[r]
        what = "NaN" if np.isnan(seen[r, c]) else "an infinite value"
        raise DataValidationError(
            f"party {j} ({pname!r}), column {fnames[c]!r}: {what} for ID {show_id(ids[row])}; features must be finite "
            "(mark a whole block as missing through `observed`, not with NaN)"
        )
    unseen = block[~obs]
    if unseen.size and not np.all(np.isnan(unseen)):
        r = int(np.flatnonzero(~np.all(np.isnan(unseen), axis=1))[0])
        row = np.flatnonzero(~obs)[r]
        raise DataValidationError(
            f"party {j} ({pname!r}) has feature values for ID {show_id(ids[row])}, but `observed` says that block is "
            "missing; blank the row (NaN) or mark it observed"
        )


def check_labels(
    task: Any, y: Any, labeled: Any, n: int, ids: np.ndarray
) -> tuple[Any, np.ndarray, np.ndarray]:
    """Validate the labels against the task and the label mask: ``(task, labels, label mask)``."""
    if y is None:  # unlabelled data (e.g. new users to predict): the task is optional
        if labeled is not None and np.any(labeled):
            raise DataValidationError("a label mask marks samples labelled, but no labels `y` were given")
        classification = task is None or task.is_classification
        out = np.full(n, UNLABELED if classification else np.nan, dtype=np.int64 if classification else np.float64)
        lab = np.zeros(n, dtype=bool)
        out.flags.writeable = False
        lab.flags.writeable = False
        return task, out, lab
    else:
        y_arr = np.asarray(y)
        if y_arr.shape != (n,):
            raise DataValidationError(f"labels must be a 1-D array of length {n}, got shape {y_arr.shape}")
        if labeled is None:
            if y_arr.dtype.kind == "f":
                lab = ~np.isnan(y_arr)  # NaN marks an unknown label
            elif y_arr.dtype.kind in "iu" and (task is None or task.is_classification):
                lab = y_arr != UNLABELED  # -1 marks an unknown class index
            else:
                lab = np.ones(n, dtype=bool)
        else:
            lab = np.asarray(labeled)
            if lab.shape != (n,):
                raise DataValidationError(f"label mask must have length {n}, got shape {lab.shape}")
            if lab.dtype != bool:
                if not np.all(np.isin(lab, (0, 1))):
                    raise DataValidationError("label mask must be boolean (or 0/1)")
                lab = lab.astype(bool)
        if task is None:
            if not lab.any():  # no label known: nothing to say about the task
                return check_labels(None, None, None, n, ids)
            raise DataValidationError(
                "say what the labels are: task=Task.classification(classes) or Task.regression()"
            )
    lab = lab.copy()
    if task.is_classification:
        out = np.full(n, UNLABELED, dtype=np.int64)
        if lab.any():
            vals = y_arr[lab]
            if vals.dtype.kind == "f" and not np.all(np.isfinite(vals)):
                i = int(np.flatnonzero(lab)[np.flatnonzero(~np.isfinite(vals))[0]])
                raise DataValidationError(
                    f"label of ID {show_id(ids[i])} is not finite but the sample is marked labelled")
            if vals.dtype.kind == "f" and not np.all(vals == np.round(vals)):
                i = int(np.flatnonzero(lab)[np.flatnonzero(vals != np.round(vals))[0]])
                raise DataValidationError(f"label {show_id(y_arr[i])} of ID {show_id(ids[i])} is not a class index")
            if vals.dtype.kind not in "iuf":
                raise DataValidationError(
                    "classification labels must be class indices 0..C-1; map names with the builders "
                    f"(got dtype {vals.dtype})"
                )
            bad = (vals < 0) | (vals >= task.n_classes)
            if bad.any():
                i = int(np.flatnonzero(lab)[np.flatnonzero(bad)[0]])
                raise DataValidationError(
                    f"label {show_id(y_arr[i])} of ID {show_id(ids[i])} is outside the declared classes (indices 0.."
                    f"{task.n_classes - 1} for {list(task.classes)})"
                )
            out[lab] = vals.astype(np.int64)
    else:
        out = np.full(n, np.nan, dtype=np.float64)
        if lab.any():
            try:
                vals = y_arr[lab].astype(np.float64)
            except (TypeError, ValueError) as e:
                raise DataValidationError(f"regression targets must be numeric: {e}") from None
            if not np.all(np.isfinite(vals)):
                i = int(np.flatnonzero(lab)[np.flatnonzero(~np.isfinite(vals))[0]])
                raise DataValidationError(f"regression target of ID {show_id(ids[i])} is not finite")
            out[lab] = vals
    out.flags.writeable = False
    lab.flags.writeable = False
    return task, out, lab
