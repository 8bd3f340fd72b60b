"""A dataset arranged the way a fitted model saw its training data: parties by name, features by name.

:func:`arrange` is what a model runs before it predicts or scores: it maps the data's parties to the model's by name
(any order), puts each party's columns in the model's order (any order), and refuses data whose parties or feature
names disagree, naming the party and the first mismatching column.  Tables written for prediction often list their
parties or columns in another order than the training tables: that is harmless; a renamed, missing or extra column
or party is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from partialvfl.data.dataset import DataValidationError, VerticalDataset

__all__ = ["arrange"]


def arrange(data: VerticalDataset, party_names: Sequence[str], feature_names: Sequence[Sequence[str]] | None = None,
            feature_dims: Sequence[int] | None = None, *, active_party: int | None = None) -> VerticalDataset:
    """``data`` with the parties ``party_names`` in that order, each with the columns ``feature_names[k]`` in that
    order (or, without names, ``feature_dims[k]`` columns), and ``active_party`` (an index into ``party_names``).

    Raises :class:`DataValidationError` naming the missing or unknown party, or the party and its first column that
    the model does not know (or that the data lacks).
    """
    want = [str(p) for p in party_names]
    have = list(data.party_names)
    missing = [p for p in want if p not in have]
    extra = [p for p in have if p not in want]
    if missing or extra:
        what = "; ".join(filter(None, [f"missing {missing}" if missing else "",
                                      f"not in the model {extra}" if extra else ""]))
        raise DataValidationError(f"the data's parties {have} are not the model's {want}: {what}")
    order = [have.index(p) for p in want]
    columns = []
    for k, j in enumerate(order):
        names = list(data.feature_names[j])
        if feature_names is None:
            if feature_dims is not None and len(names) != int(feature_dims[k]):
                raise DataValidationError(f"party {want[k]!r} has {len(names)} feature columns, the model "
                                          f"{int(feature_dims[k])}")
            columns.append(np.arange(len(names)))
            continue
        columns.append(_column_order(want[k], names, [str(c) for c in feature_names[k]]))
    if order == list(range(len(have))) and all(np.array_equal(c, np.arange(len(c))) for c in columns):
        out = data
    else:
        out = data._replace(
            blocks=[data.blocks[j][:, c] for j, c in zip(order, columns)],
            observed=data.observed[:, order],
            feature_names=[tuple(data.feature_names[j][i] for i in c) for j, c in zip(order, columns)],
            party_names=want,
            feature_shapes=[data.feature_shapes[j] for j in order],  # same columns: the same shape
            active_party=order.index(data.active_party),
        )
    if active_party is not None and out.active_party != active_party:
        out = out._replace(active_party=active_party)
    return out


def _column_order(party: str, have: list[str], want: list[str]) -> np.ndarray:
    """Positions in ``have`` of the columns ``want``; an error names the first column that does not match."""
    if have == want:
        return np.arange(len(have))
    if sorted(have) != sorted(want):
        for i in range(max(len(have), len(want))):
            ours = want[i] if i < len(want) else None
            theirs = have[i] if i < len(have) else None
            if ours is not None and ours not in have:
                raise DataValidationError(
                    f"party {party!r}: the model's column {ours!r} is missing from the data (the first mismatching "
                    f"column, position {i}" + (f"; the data has {theirs!r} there)" if theirs is not None else ")"))
            if theirs is not None and theirs not in want:
                raise DataValidationError(f"party {party!r}: column {theirs!r} (position {i}) is not one the model "
                                          "was trained on")
        raise DataValidationError(f"party {party!r}: a feature column is repeated")
    return np.array([have.index(c) for c in want], dtype=np.int64)
